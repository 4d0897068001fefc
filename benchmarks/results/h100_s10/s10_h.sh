source .gpuwork/pre.sh
git log --oneline | head -1
for c in packed_fla_varlen_conv packed_fla_varlen; do
timeout 200 python -m benchmarks.harness --model qwen3.5-hybrid-0.8b --suite sweep --por 0.5 --paths 16 --path-len 2048 --contenders $c --iters 3 --budget-s 100 --out $OUT/$c > $OUT/${c}_log.txt 2>&1; echo "rc=$?"
grep -v -i warn $OUT/${c}_log.txt | grep "| qwen" | cut -c1-260
done
