source .gpuwork/pre.sh
m=qwen3-1.7b
timeout 590 python -m benchmarks.harness --model $m --suite sweep --por 0.5 --paths 32 --path-len 2048 --contenders packed_fa4_varlen tree --iters 3 --child-timeout-s 290 --out $OUT/$m > $OUT/${m}_log.txt 2>&1; echo "$m rc=$?"
python .gpuwork/s11_show.py
grep -v -i warn $OUT/${m}_log.txt | grep -i -E "error|Traceback" | tail -n 5 | cut -c1-300
