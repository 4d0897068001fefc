source .gpuwork/pre.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
git log --oneline | head -1 | tee -a $OUT/env.txt
timeout 150 python -m pytest -q -m gpu tests/test_fla_conv.py -p no:cacheprovider -rfEs > $OUT/e_tests.txt 2>&1; echo rc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^E " $OUT/e_tests.txt | cut -c1-300 | tail -20
timeout 150 python benchmarks/bench_tree_conv.py > $OUT/conv_log.txt 2>&1; echo rc=$?
grep -v -i warn $OUT/conv_log.txt | tail -30 | cut -c1-200
timeout 280 python -m benchmarks.gdn_precision --skip-op --skip-fp32-inputs --out $OUT/prec.json > $OUT/prec_log.txt 2>&1; echo rc=$?
grep -v -i warn $OUT/prec_log.txt | tail -25 | cut -c1-250
