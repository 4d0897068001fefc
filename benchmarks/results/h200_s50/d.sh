# session 50 device calls (one H200 per lease); any other mode goes to h200_s49/d.sh (and on to earlier sessions')
#   bash d.sh plan50 [OLD]     the varlen plan's host time for CUDA batches (h200_s47/probe_plan.py), this checkout's
#                              module against OLD (78212d8's, copied in for the call as treecompile/ops/_old_vta_s50.py
#                              with its key_copies as _old_kc_s50.py, not kept), alternating ($OUT/probe_plan50.txt);
#                              then the agentic trees ($OUT/probe_plan50_agentic.txt)
#   bash d.sh gpu50 FILES...   `pytest -m gpu` over FILES, -k $K when set ($OUT/gpu50_$TAG.txt)
mode=$1
if [ "$mode" = plan50 ]; then
  source benchmarks/results/h100_s18/pre.sh
  PYTHONPATH=. timeout ${T:-150} python benchmarks/results/h200_s47/probe_plan.py ${2:-_old_vta_s50} 2>&1 \
    | tee $OUT/probe_plan50.txt | tail -12
  PYTHONPATH=. timeout 60 python benchmarks/results/h200_s50/probe_agentic.py ${2:-_old_vta_s50} 2>&1 \
    | tee $OUT/probe_plan50_agentic.txt | tail -8
elif [ "$mode" = gpu50 ]; then
  source benchmarks/results/h100_s18/pre.sh
  shift
  timeout ${T:-570} python -m pytest -m gpu -q -p no:cacheprovider "$@" ${K:+-k "$K"} -W ignore -rs 2>&1 \
    | grep -v "torch.__trace" | tee $OUT/gpu50_${TAG:-run}.txt | tail -30
else
  bash benchmarks/results/h200_s49/d.sh "$@"
fi
