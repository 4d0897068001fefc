# session 48 device calls (one H200 per lease); any other mode goes to h200_s46/d.sh (and on to earlier sessions')
#   bash d.sh pt48            agentic parallel-tools, packed FA4 varlen and `tree` in one process ($OUT/o48_parallel-tools.txt)
#   bash d.sh r48_4b32        Qwen3-4B 32 x 2,048 POR 0.5 (32k tree tokens), packed FA4 varlen and `tree` in one
#                             process ($OUT/r48_4b32.txt)
#   bash d.sh plan48          the varlen segment plan's host time for CUDA batches (h200_s47/probe_plan.py, this
#                             session's module against the old one copied in as treecompile/ops/_old_vta_s48.py),
#                             then the varlen and host-values GPU tests, then where the plan's time goes
#                             ($OUT/probe_plan48.txt, $OUT/gpu48.txt, $OUT/prof_plan48.txt)
#   bash d.sh gpu48b          the GPU tests of the files session 48's fixes touched after plan48 (scans, partitions,
#                             train_step, saved programs, the prefix-block plan that stages its tables) ($OUT/gpu48b.txt)
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
  PYTHONPATH=. timeout ${T3:-60} python benchmarks/results/h200_s47/prof_plan.py 2>&1 | tee $OUT/prof_plan48.txt | tail -8
elif [ "$mode" = gpu48b ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-300} python -m pytest -m gpu -q -p no:cacheprovider tests/test_train.py \
    tests/test_prefix_block_attention.py tests/test_partition.py tests/test_redundancy_free.py tests/test_saved.py \
    tests/test_input_checks.py tests/test_objectives.py -W ignore -rs 2>&1 | grep -v "torch.__trace" \
    | tee $OUT/gpu48b.txt | tail -25
  timeout ${T2:-120} python -m pytest -q -p no:cacheprovider tests/test_rewrite_mixers.py -k cuda -W ignore -rs 2>&1 \
    | grep -v "torch.__trace" | tee -a $OUT/gpu48b.txt | tail -5
else
  bash benchmarks/results/h200_s46/d.sh "$@"
fi
