source .gpuwork/pre.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
git log --oneline | head -1 | tee -a $OUT/env.txt
timeout 300 python benchmarks/bench_tree_conv.py > $OUT/conv_log.txt 2>&1; echo rc=$?
grep -v -i warn $OUT/conv_log.txt | tail -40 | cut -c1-300
