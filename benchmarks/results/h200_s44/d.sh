# session 44 device calls (one H200 per lease): session 43's modes, run one after another
#   bash d.sh seq "MODE ARGS" "MODE ARGS" ...   each quoted command through h200_s43/d.sh, in order
#   bash d.sh MODE ...                          any other mode: h200_s43/d.sh MODE ... (install, gpu43, attn43, prof)
# Left for session 45 (written after this session's leases): the CUDA graphs' contender, with inductor's log of what
# it captured and where it partitioned,
#   TORCH_LOGS=cudagraphs,perf_hints bash d.sh prof k45_cg 560 --model qwen3-0.6b --agentic parallel-tools \
#     --contenders tree tree_cudagraphs --iters 10
mode=$1
if [ "$mode" = seq ]; then
  shift
  for c in "$@"; do echo "=== $c"; bash benchmarks/results/h200_s43/d.sh $c; done
else
  bash benchmarks/results/h200_s43/d.sh "$@"
fi
