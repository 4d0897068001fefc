# session 58 device calls (one H200 per lease): session 57's `unkept57`, split into two calls that each fit the
# 600 s limit, and anything else chained to h200_s57/d.sh
#   bash d.sh unkept58a   the GPU oracle test of UNKEPT_FORWARD, then prof_step on Qwen3-0.6B 128 x 2,048 POR 0.75
#                         (64k: rows not kept), `tree` against `tree_unkept_block_sparse`
#   bash d.sh unkept58b   prof_step on 32 x 2,048 POR 0.75 (16k: rows kept), `tree`, `tree_keys_gathered` and
#                         `tree_keys_gathered_block_sparse_forward`
#   bash d.sh unkept58c   the attention op alone, forward and backward apart, on the trees where the segments run
#                         (POR 0.5 harness trees, deep-agent, parallel-tools): fa4_varlen (segments),
#                         fa4_varlen_unkept_block_sparse and fa4_block_sparse ($OUT/unkept58c/)
#   bash d.sh flip58a     after UNKEPT_FORWARD's default became "block_sparse": the varlen ops' GPU tests, then prof_step
#                         on Qwen3-0.6B 16 x 2,048 POR 0.5 (rows kept, but a forward's first layer never keeps),
#                         `tree` against `tree_unkept_segments` (the old default)
#   bash d.sh flip58b     the same A/B on agentic parallel-tools (host-bound when synchronized), with --loop 10
#   bash d.sh flip58c     the GPU tests flip58a's 220 s did not reach (kv heads' oracle, forward replay, compiled
#                         steps keeping rows, prepared batches, CUDA graphs)
mode=$1
if [ "$mode" = unkept58a ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_tree_attention.py -k unkept -W ignore \
    -rs 2>&1 | grep -v "torch.__trace" | tee $OUT/gpu58_unkept.txt | tail -5
  bash benchmarks/results/h200_s40/d.sh prof o58_unkept_128x0.75 ${T:-400} --model qwen3-0.6b --paths 128 \
    --path-len 2048 --por 0.75 --contenders tree tree_unkept_block_sparse --iters 5
elif [ "$mode" = unkept58b ]; then
  bash benchmarks/results/h200_s40/d.sh prof o58_unkept_32x0.75 ${T:-560} --model qwen3-0.6b --paths 32 \
    --path-len 2048 --por 0.75 --contenders tree tree_keys_gathered tree_keys_gathered_block_sparse_forward --iters 10
elif [ "$mode" = unkept58c ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-400} python benchmarks/bench_fa4_attention.py --sizes "" --deep none --agentic deep-agent,parallel-tools \
    --harness 16x2048@0.5,32x2048@0.5,64x2048@0.5,32x2048@0.75 \
    --contenders fa4_varlen,fa4_varlen_unkept_block_sparse,fa4_block_sparse --out $OUT/unkept58c 2>&1 \
    | grep -v -i 'warn\|aux_data\|exe_args\|TileLang' | tee $OUT/unkept58c_log.txt | tail -30
elif [ "$mode" = flip58a ]; then
  K58="fa4_varlen_vs_fp64_oracle or compiled or cudagraphs_contender or deterministic_mode or forward_replay"
  K58="$K58 or expanded_kv_heads_vs or prepared_cuda"
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-200} python -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_tree_attention.py \
    tests/test_varlen_kv_heads.py -W ignore -rs -k "$K58" 2>&1 | grep -v "torch.__trace" | tee $OUT/gpu58_flip.txt | tail -8
  bash benchmarks/results/h200_s40/d.sh prof o58_flip_16x0.5 300 --model qwen3-0.6b --paths 16 --path-len 2048 \
    --por 0.5 --contenders tree tree_unkept_segments --iters 10
elif [ "$mode" = flip58b ]; then
  bash benchmarks/results/h200_s40/d.sh prof o58_flip_parallel_tools 300 --model qwen3-0.6b --agentic parallel-tools \
    --contenders tree tree_unkept_segments --iters 10 --loop 10
elif [ "$mode" = flip58c ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-230} python -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_kv_heads.py \
    tests/test_varlen_tree_attention.py -W ignore -rs -k "expanded_kv_heads_vs or forward_replay or compiled_steps or \
    prepared_cuda or cudagraphs_contender" 2>&1 | grep -v "torch.__trace" | tee $OUT/gpu58_flip_c.txt | tail -8
else
  bash benchmarks/results/h200_s57/d.sh "$@"
fi
