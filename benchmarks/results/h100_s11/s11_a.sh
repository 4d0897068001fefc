source .gpuwork/pre.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
pip list 2>/dev/null | grep -i -E "flash|cutlass|tilelang|linear" | tee -a $OUT/env.txt
# dense at 32k tree tokens (32 x 2,048 POR 0.5), each contender in its own process (--isolate, default on CUDA)
for m in qwen3-0.6b qwen3-1.7b; do
timeout 290 python -m benchmarks.harness --model $m --suite sweep --por 0.5 --paths 32 --path-len 2048 --contenders packed_fa4_varlen tree --iters 3 --child-timeout-s 270 --out $OUT/$m > $OUT/${m}_log.txt 2>&1; echo "$m rc=$?"
done
python .gpuwork/s11_show.py
for m in qwen3-0.6b qwen3-1.7b; do grep -v -i warn $OUT/${m}_log.txt | grep -i -E "error|Traceback|frac" | tail -n 5 | cut -c1-300; done
