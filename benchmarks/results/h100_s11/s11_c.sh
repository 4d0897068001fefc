source .gpuwork/pre.sh
# hybrid 16k: the packed baseline with its conv through fla's varlen causal_conv1d (never finished its first step before)
c=packed_fla_varlen_conv
timeout 590 python -m benchmarks.harness --model qwen3.5-hybrid-0.8b --suite sweep --por 0.5 --paths 16 --path-len 2048 --contenders $c --iters 3 --child-timeout-s 575 --out $OUT/$c > $OUT/${c}_log.txt 2>&1; echo "rc=$?"
python .gpuwork/s11_show.py
grep -v -i warn $OUT/${c}_log.txt | grep -i -E "error|Traceback" | tail -n 5 | cut -c1-300
