source .gpuwork/pre.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 250 python -m pytest -q -x -s -m gpu tests/test_moe_grouped.py -p no:cacheprovider -rfEs > $OUT/moe_tests.txt 2>&1; echo rc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^E " $OUT/moe_tests.txt | cut -c1-300 | tail -20
timeout 250 python benchmarks/bench_moe.py --out $OUT/moe.json > $OUT/moe_bench_log.txt 2>&1; echo rc=$?
grep -v -i warn $OUT/moe_bench_log.txt | tail -25 | cut -c1-220
