source .gpuwork/pre.sh
timeout 100 python -m pytest -q -m gpu tests/test_fla_conv.py -p no:cacheprovider -rfEs > $OUT/g_tests.txt 2>&1; echo rc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^E " $OUT/g_tests.txt | cut -c1-300 | tail -20
timeout 470 python -m benchmarks.gdn_precision --skip-op --skip-fp32-inputs --out $OUT/prec.json > $OUT/prec_log.txt 2>&1; echo rc=$?
grep -v -i -E "warn|tilelang" $OUT/prec_log.txt | tail -25 | cut -c1-250
