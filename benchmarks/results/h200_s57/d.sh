# session 57 device calls (one H200 per lease); any other mode goes to h200_s56/d.sh (and on to earlier sessions')
#   bash d.sh gpu57    the GPU tests of this session's change and the one session 56 left: FA4's block-sparse plan with
#                      K/V expanded against the fp64 oracle, and the compiled steps that keep the gathered rows (on the
#                      fused key/value gather) ($OUT/gpu57.txt)
#   bash d.sh attn57   bench_fa4_attention on the block-sparse trees (deep-16k, deep-32k, deep-agent): fa4_varlen
#                      ("auto") against fa4_varlen_kv_expanded (K/V expanded to the query heads), FA4 causal at each T
#                      ($OUT/attn57/, $OUT/attn57_log.txt)
#   bash d.sh sweep57  bench_fa4_attention's fa4_varlen ("auto", the lowering's default on Hopper) and paths_fa4_varlen (FA4's
#                      varlen causal kernel over the same tree's paths: what the baselines run) on every tree shape of
#                      the target: synthetic POR 0.5 / 0.75 / 0.9 at 16k, 32k, 64k, the harness's 16 and 32 x 2,048
#                      POR 0.5, deep-16k, deep-32k, deep-agent, parallel-tools ($OUT/sweep57/, $OUT/sweep57_log.txt)
#   bash d.sh por57 P POR   prof_step on Qwen3-0.6B, P x 2,048 paths at POR (the synthetic POR sweep, dense): packed
#                      FA4 varlen and `tree` in one process, ITERS steps (default 10) ($OUT/o57_PxPOR.txt)
#   bash d.sh lim57    bench_fa4_attention on the end-to-end POR sweep's trees (32 / 64 x 2,048 POR 0.75, 80 / 160 x 2,048
#                      POR 0.9): fa4_varlen ("auto": block-sparse past VARLEN_GATHER_LIMIT x T gathered rows), the
#                      segments forced (fa4_segments) and the paths ($OUT/lim57/, $OUT/lim57_log.txt)
#   bash d.sh bs57     the POR 0.75 end-to-end trees (32 / 64 / 128 x 2,048, G = 4 x T): the op's choice (segments)
#                      against its block-sparse plan forced (fa4_block_sparse) ($OUT/bs57/, $OUT/bs57_log.txt)
#   bash d.sh unkept57    for the next lease (not run here): the GPU oracle test of UNKEPT_FORWARD, then prof_step
#                         on Qwen3-0.6B 128 x 2,048 POR 0.75 (64k: rows not kept) `tree` against
#                         `tree_unkept_block_sparse`, and 32 x 2,048 POR 0.75 (16k) `tree`, `tree_keys_gathered` and
#                         `tree_keys_gathered_block_sparse_forward` ($OUT/gpu57_unkept.txt, $OUT/o57_unkept_*.txt)
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
elif [ "$mode" = sweep57 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-540} python benchmarks/bench_fa4_attention.py --sizes 16384,32768,65536 --pors 0.5,0.75,0.9 \
    --deep deep-16k,deep-32k --agentic deep-agent,parallel-tools --harness 16x2048@0.5,32x2048@0.5 \
    --contenders fa4_varlen,paths_fa4_varlen --out $OUT/sweep57 2>&1 \
    | grep -v -i 'warn\|aux_data\|exe_args\|TileLang' | tee $OUT/sweep57_log.txt | tail -45
elif [ "$mode" = por57 ]; then
  bash benchmarks/results/h200_s40/d.sh prof o57_${2}x${3} ${T:-400} --model qwen3-0.6b --paths $2 --path-len 2048 \
    --por $3 --contenders packed_fa4_varlen tree --iters ${ITERS:-10}
elif [ "$mode" = lim57 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-300} python benchmarks/bench_fa4_attention.py --sizes "" --deep none \
    --harness 32x2048@0.75,64x2048@0.75,80x2048@0.9,160x2048@0.9 --contenders fa4_varlen,fa4_segments,paths_fa4_varlen \
    --out $OUT/lim57 2>&1 | grep -v -i 'warn\|aux_data\|exe_args\|TileLang' | tee $OUT/lim57_log.txt | tail -30
elif [ "$mode" = bs57 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-200} python benchmarks/bench_fa4_attention.py --sizes "" --deep none \
    --harness 32x2048@0.75,64x2048@0.75,128x2048@0.75 --contenders fa4_varlen,fa4_block_sparse \
    --out $OUT/bs57 2>&1 | grep -v -i 'warn\|aux_data\|exe_args\|TileLang' | tee $OUT/bs57_log.txt | tail -16
elif [ "$mode" = unkept57 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_tree_attention.py -k unkept -W ignore \
    -rs 2>&1 | grep -v "torch.__trace" | tee $OUT/gpu57_unkept.txt | tail -5
  bash benchmarks/results/h200_s40/d.sh prof o57_unkept_128x0.75 300 --model qwen3-0.6b --paths 128 --path-len 2048 \
    --por 0.75 --contenders tree tree_unkept_block_sparse --iters 5
  bash benchmarks/results/h200_s40/d.sh prof o57_unkept_32x0.75 300 --model qwen3-0.6b --paths 32 --path-len 2048 \
    --por 0.75 --contenders tree tree_keys_gathered tree_keys_gathered_block_sparse_forward --iters 10
else
  bash benchmarks/results/h200_s56/d.sh "$@"
fi
