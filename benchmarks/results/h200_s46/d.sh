# session 46 device calls (one H200 per lease): session 45's modes, and the heavy-first serialisation
#   bash d.sh order46 TREE    prof_step on the agentic tree TREE (deep-agent, parallel-tools): packed FA4 varlen,
#                             `tree` (the Tree built heaviest child first, the new default) and `tree_lex` (the
#                             lexicographic serialisation, the old default) in one process ($OUT/o46_TREE.txt)
#   bash d.sh attn46          bench_fa4_attention's fa4_varlen on trees built heaviest child first (the default now):
#                             POR 0.9 at 32k and 64k, deep-16k, deep-32k, deep-agent, with FA4 causal ($OUT/attn46)
#   bash d.sh deep47          left for session 47: deep-agent, packed FA4 varlen and `tree` in one process (a call of
#                             its own: packed's step is 1.9 s; $OUT/o47_deep-agent.txt)
#   bash d.sh gpu47           left for session 47: the GPU tests of the files the order change touched
#                             (tests/test_tree_layout.py, tests/test_varlen_tree_attention.py; $OUT/gpu47.txt)
#   bash d.sh MODE ...        any other mode: h200_s45/d.sh MODE ... (rows46 N, hf46, hfprof46, install, prof ...)
mode=$1
if [ "$mode" = order46 ]; then
  bash benchmarks/results/h200_s40/d.sh prof o46_$2 ${T:-560} --model qwen3-0.6b --agentic $2 \
    --contenders ${C:-packed_fa4_varlen tree tree_lex} --iters 10
elif [ "$mode" = attn46 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-300} python benchmarks/bench_fa4_attention.py --sizes 32768,65536 --pors 0.9 --deep deep-16k,deep-32k \
    --agentic deep-agent --contenders fa4_varlen --out $OUT/attn46 2>&1 \
    | grep -v -i 'warn\|aux_data\|exe_args\|TileLang' | tee $OUT/attn46_log.txt | tail -16
elif [ "$mode" = deep47 ]; then
  bash benchmarks/results/h200_s40/d.sh prof o47_deep-agent ${T:-560} --model qwen3-0.6b --agentic deep-agent \
    --contenders packed_fa4_varlen tree --iters 10
elif [ "$mode" = gpu47 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-540} python -m pytest -m gpu -q -p no:cacheprovider tests/test_tree_layout.py \
    tests/test_varlen_tree_attention.py -W ignore -rs 2>&1 | grep -v "torch.__trace" | tee $OUT/gpu47.txt | tail -30
else
  bash benchmarks/results/h200_s45/d.sh "$@"
fi
