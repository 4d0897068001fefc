source benchmarks/results/h100_s18/pre.sh >/dev/null
set -o pipefail
timeout 540 python -m pytest -q -m gpu tests/test_fla_gdn.py tests/test_fla_conv.py tests/test_moe_grouped.py -p no:cacheprovider 2>&1 | tee $OUT/gpu_tests.txt | tail -30
