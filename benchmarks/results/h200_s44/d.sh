# session 44 device calls (one H200 per lease): session 43's modes, run one after another
#   bash d.sh seq "MODE ARGS" "MODE ARGS" ...   each quoted command through h200_s43/d.sh, in order
#   bash d.sh MODE ...                          any other mode: h200_s43/d.sh MODE ... (install, gpu43, attn43, prof)
#   bash d.sh cg45                              left for session 45 (written after this session's leases): the CUDA
#                                               graphs' and the deep tree's deterministic GPU tests
#                                               ($OUT/cg45_test.txt), then, only if the first passed, the
#                                               contender against `tree` on the agentic tree with inductor's log of
#                                               what it captured and where it partitioned ($OUT/k45_cg.txt)
mode=$1
if [ "$mode" = cg45 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-240} python -m pytest -m gpu -v -p no:cacheprovider tests/test_varlen_tree_attention.py \
    -k "cudagraphs or deep_tree_on_its_segments" -W ignore 2>&1 | tee $OUT/cg45_test.txt | tail -25
  if grep -q "test_cudagraphs_contender_replays_without_stale_host_work PASSED" $OUT/cg45_test.txt; then
    TORCH_LOGS=cudagraphs,perf_hints bash benchmarks/results/h200_s40/d.sh prof k45_cg ${T2:-380} --model qwen3-0.6b \
      --agentic parallel-tools --contenders tree tree_cudagraphs --iters 10
  fi
elif [ "$mode" = seq ]; then
  shift
  for c in "$@"; do echo "=== $c"; bash benchmarks/results/h200_s43/d.sh $c; done
else
  bash benchmarks/results/h200_s43/d.sh "$@"
fi
