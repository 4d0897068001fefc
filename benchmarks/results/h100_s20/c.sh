# session 20, second machine: the segments against FA4's block-sparse kernels now that the copies' sums are cheap
# (for VARLEN_GATHER_LIMIT), then where the 0.6B 32k step goes (tree and the packed FA4 baseline)
source benchmarks/results/h100_s18/pre.sh
timeout 200 python benchmarks/bench_fa4_attention.py --sizes "" --deep deep-16k --harness 32x2048@0.75,64x2048@0.5 \
  --contenders fa4_varlen,fa4_segments,paths_fa4_varlen --out $OUT/attn_limit > $OUT/attn_limit_log.txt 2>&1; grep -E '^\{"case' $OUT/attn_limit_log.txt | cut -c1-240
timeout 330 python -m benchmarks.prof_step --model qwen3-0.6b --paths 32 --contenders tree packed_fa4_varlen > $OUT/prof_0.6b_32k.txt 2>&1; tail -60 $OUT/prof_0.6b_32k.txt | cut -c1-220
