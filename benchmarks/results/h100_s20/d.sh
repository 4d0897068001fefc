# session 20, third machine: the varlen op's GPU tests with VARLEN_GATHER_LIMIT = 6, then the MoE layer shape at 32k
source benchmarks/results/h100_s18/pre.sh
timeout 240 python -m pytest -q -m gpu tests/test_varlen_tree_attention.py 2>&1 | grep -E "passed|failed|Error" | tail -5 | tee $OUT/varlen_tests_limit6.txt
MODEL=qwen3-30b-a3b-4l SUITE=sweep PATHS=32 CONTENDERS="tree packed_fa4_varlen" T=300 CT=200 bash benchmarks/results/h100_s20/b.sh 2>&1 | grep -E "^\| qwen"
