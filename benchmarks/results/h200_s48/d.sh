# session 48 device calls (one H200 per lease); any other mode goes to h200_s46/d.sh (and on to earlier sessions')
#   bash d.sh pt48            agentic parallel-tools, packed FA4 varlen and `tree` in one process ($OUT/o48_parallel-tools.txt)
#   bash d.sh r48_4b32        Qwen3-4B 32 x 2,048 POR 0.5 (32k tree tokens), packed FA4 varlen and `tree` in one
#                             process ($OUT/r48_4b32.txt)
#   bash d.sh plan48          the varlen segment plan's host time for CUDA batches (h200_s47/probe_plan.py, this
#                             session's module against the old one copied in as treecompile/ops/_old_vta_s48.py),
#                             then the varlen and host-values GPU tests, then where the plan's time goes
#                             ($OUT/probe_plan48.txt, $OUT/gpu48.txt, $OUT/prof_plan48.txt)
mode=$1
if [ "$mode" = pt48 ]; then
  bash benchmarks/results/h200_s40/d.sh prof o48_parallel-tools ${T:-560} --model qwen3-0.6b --agentic parallel-tools \
    --contenders packed_fa4_varlen tree --iters 10
elif [ "$mode" = r48_4b32 ]; then
  bash benchmarks/results/h200_s40/d.sh prof r48_4b32 ${T:-580} --model qwen3-4b --paths 32 \
    --contenders packed_fa4_varlen tree --iters 10
elif [ "$mode" = plan48 ]; then
  source benchmarks/results/h100_s18/pre.sh
  PYTHONPATH=. timeout ${T:-120} python benchmarks/results/h200_s47/probe_plan.py _old_vta_s48 2>&1 | tee $OUT/probe_plan48.txt | tail -20
  timeout ${T2:-300} python -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_tree_attention.py \
    tests/test_host_values.py -W ignore -rs 2>&1 | grep -v "torch.__trace" | tee $OUT/gpu48.txt | tail -20
  PYTHONPATH=. timeout ${T3:-60} python benchmarks/results/h200_s48/prof_plan.py 2>&1 | tee $OUT/prof_plan48.txt | tail -8
else
  bash benchmarks/results/h200_s46/d.sh "$@"
fi
