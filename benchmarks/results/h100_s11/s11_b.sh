source .gpuwork/pre.sh
m=qwen3-0.6b
timeout 580 python -m benchmarks.harness --model $m --suite sweep --por 0.5 --paths 32 --path-len 2048 --contenders tree --iters 3 --child-timeout-s 560 --out $OUT/${m}_tree > $OUT/${m}_tree_log.txt 2>&1; echo "$m rc=$?"
python .gpuwork/s11_show.py
grep -v -i warn $OUT/${m}_tree_log.txt | grep -i -E "error|Traceback" | tail -n 5 | cut -c1-300
