# session 43 device calls (one H200 per lease): session 42's modes, `seq`, and the checks session 43 left to run
#   bash d.sh seq "MODE ARGS" "MODE ARGS" ...   each quoted command through h200_s42/d.sh, in order
#   bash d.sh gpu43                             pytest -m gpu of session 43's CPU-only changes ($OUT/gputests43.txt)
#   bash d.sh attn43                            bench_fa4_attention.py on the harness trees: fa4_varlen, fa4_segments,
#                                               the prefix-block prototype and the paths' packed attention ($OUT/attn)
#   bash d.sh MODE ...                          any other mode: h200_s42/d.sh MODE ... (install, tests, prof, probe)
mode=$1
F='warn\|aux_data\|exe_args\|TileLang'
if [ "$mode" = seq ]; then
  shift
  for c in "$@"; do echo "=== $c"; bash benchmarks/results/h200_s42/d.sh $c; done
elif [ "$mode" = gpu43 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-300} python -m pytest -m gpu -q -p no:cacheprovider tests/test_prefix_block_attention.py \
    tests/test_logprobs_kept.py tests/test_varlen_tree_attention.py \
    -k "prefix_block or key_rows or oracle and segments or replay or compiled_model or keeping or fit" 2>&1 \
    | tee $OUT/gputests43.txt | tail -15
elif [ "$mode" = attn43 ]; then
  source benchmarks/results/h100_s18/pre.sh
  set -o pipefail
  timeout ${T:-500} python benchmarks/bench_fa4_attention.py --sizes "" --deep none --harness 16x2048@0.5 \
    --agentic parallel-tools,deep-agent --contenders fa4_varlen,fa4_segments,fa4_prefix_block,paths_fa4_varlen \
    --out $OUT/attn 2>&1 | grep -v -i "$F" | tee $OUT/attn43_log.txt | tail -30
else
  bash benchmarks/results/h200_s42/d.sh "$@"
fi
