source benchmarks/results/h100_s18/pre.sh
timeout ${T:-540} python -m benchmarks.gdn_precision --skip-op --skip-fp32-inputs --out $OUT/prec.json 2>&1 | grep -v -i "warn" | tee $OUT/prec_log.txt | grep "^{" | tail -3
