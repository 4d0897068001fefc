# session 54 device calls (one H200 per lease); any other mode goes to h200_s53/d.sh (and on to earlier sessions')
#   bash d.sh plan54 [OLD]   probe_plan54.py: the varlen plan's host time for CUDA batches, this checkout's module
#                            against OLD's (8c0eeb1's varlen_tree_attention, key_copies and host_values, copied in
#                            for the call as treecompile/ops/_old_{vta,kc,hv}_s54.py, untracked, with _old_vta_s54
#                            importing _old_kc_s54 and its to_device_together from _old_hv_s54), alternating
#                            ($OUT/probe_plan54.txt)
mode=$1
if [ "$mode" = plan54 ]; then
  source benchmarks/results/h100_s18/pre.sh
  PYTHONPATH=. timeout ${T:-300} python benchmarks/results/h200_s54/probe_plan54.py ${2:-_old_vta_s54} 2>&1 \
    | grep -v USDT | tee $OUT/probe_plan54.txt | tail -30
else
  bash benchmarks/results/h200_s53/d.sh "$@"
fi
