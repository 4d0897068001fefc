# session 57 device calls (one H200 per lease); any other mode goes to h200_s56/d.sh (and on to earlier sessions')
#   bash d.sh gpu57    the GPU tests of this session's change and the one session 56 left: FA4's block-sparse plan with
#                      K/V expanded against the fp64 oracle, and the compiled steps that keep the gathered rows (on the
#                      fused key/value gather) ($OUT/gpu57.txt)
#   bash d.sh attn57   bench_fa4_attention on the block-sparse trees (deep-16k, deep-32k, deep-agent): fa4_varlen
#                      ("auto") against fa4_varlen_kv_expanded (K/V expanded to the query heads), FA4 causal at each T
#                      ($OUT/attn57/, $OUT/attn57_log.txt)
#   bash d.sh deep57   prof_step on deep-agent (Qwen3-0.6B): `tree` against `tree_kv_expanded` in one process
#                      ($OUT/o57_deep-agent.txt)
mode=$1
if [ "$mode" = gpu57 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-400} python -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_kv_heads.py \
    tests/test_varlen_tree_attention.py -k "block_sparse or compiled_steps_keeping" -W ignore -rs 2>&1 \
    | grep -v "torch.__trace" | tee $OUT/gpu57.txt | tail -20
elif [ "$mode" = attn57 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-300} python benchmarks/bench_fa4_attention.py --sizes "" --deep deep-16k,deep-32k \
    --agentic deep-agent --contenders fa4_varlen,fa4_varlen_kv_expanded --out $OUT/attn57 2>&1 \
    | grep -v -i 'warn\|aux_data\|exe_args\|TileLang' | tee $OUT/attn57_log.txt | tail -16
elif [ "$mode" = deep57 ]; then
  bash benchmarks/results/h200_s40/d.sh prof o57_deep-agent ${T:-400} --model qwen3-0.6b --agentic deep-agent \
    --contenders ${C:-tree tree_kv_expanded} --iters 10
else
  bash benchmarks/results/h200_s56/d.sh "$@"
fi
