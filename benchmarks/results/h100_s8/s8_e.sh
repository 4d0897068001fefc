source .gpuwork/pre.sh
cd benchmarks
timeout 330 python gdn_precision.py --skip-op --skip-fp32-inputs --model qwen3-next-moe-small --router-std 0.1 --out $OUT/moe_std01.json > $OUT/moe_std01_log.txt 2>&1; echo rc=$?
timeout 240 python gdn_precision.py --skip-op --skip-fp32-inputs --model qwen3-next-moe-small --out $OUT/moe_std002.json > $OUT/moe_std002_log.txt 2>&1; echo rc=$?
for f in $OUT/moe_std01_log.txt $OUT/moe_std002_log.txt; do echo == $f; grep -E "^\{" $f | tail -n 1 | cut -c1-2500; grep "top-k" $f | head -1 | grep -o '"B top-k[^}]*'; done
