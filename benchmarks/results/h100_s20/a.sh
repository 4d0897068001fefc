# session 20, first machine: GPU tests of the varlen op (the Triton copy sums), the attention alone before/after,
# the kernel table; then the 0.6B end-to-end step at 32k (tree, then the packed FA4 baseline)
source benchmarks/results/h100_s18/pre.sh
R=benchmarks/results/h100_s20
timeout 240 python -m pytest -q -m gpu tests/test_varlen_tree_attention.py 2>&1 | grep -E "passed|failed|Error" | tail -5 | tee $OUT/varlen_tests.txt
timeout 200 python benchmarks/bench_fa4_attention.py --sizes "" --deep none --harness 32x2048@0.5,32x2048@0.75,16x2048@0.5 \
  --contenders fa4_varlen,fa4_varlen_index_add,paths_fa4_varlen --out $OUT/attn > $OUT/attn_log.txt 2>&1; grep -E '^\{"case' $OUT/attn_log.txt | cut -c1-260
timeout 120 python benchmarks/bench_fa4_attention.py --shape 8:2:256 --sizes "" --deep none --harness 32x2048@0.5,16x2048@0.5 \
  --contenders fa4_varlen,fa4_varlen_index_add,paths_fa4_varlen --out $OUT/attn256 > $OUT/attn256_log.txt 2>&1; grep -E '^\{"case' $OUT/attn256_log.txt | cut -c1-260
timeout 90 python $R/prof_attn.py > $OUT/prof_attn.txt 2>&1; grep -E "==|Self CUDA|^  *[a-zA-Z_]" $OUT/prof_attn.txt | cut -c1-200 | head -40
