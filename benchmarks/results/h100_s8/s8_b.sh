source .gpuwork/pre.sh
pip list 2>/dev/null | grep -i -E "flash|cutlass|tilelang|linear" | tee -a $OUT/env.txt
cd benchmarks && timeout 560 python gdn_precision.py --skip-op --model qwen3-next-moe-small --out $OUT/moe_precision.json > $OUT/moe_log.txt 2>&1; echo rc=$?
tail -c 3000 $OUT/moe_log.txt
