source benchmarks/results/h100_s18/pre.sh
set -o pipefail
timeout 300 python -m pytest -q -m gpu tests/test_tree_conv_shifts.py tests/test_fla_conv.py tests/test_moe_grouped.py -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | tail -4
timeout 120 python benchmarks/bench_tree_conv.py 2>&1 | grep -v Warn | tee $OUT/bench_conv_syn.txt | grep -v "^ "
timeout 120 python benchmarks/bench_tree_conv.py --agentic parallel-tools --scale 1.5 2>&1 | grep -v Warn | tee $OUT/bench_conv_agentic.txt | grep -v "^ "
