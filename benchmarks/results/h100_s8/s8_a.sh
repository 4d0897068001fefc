source .gpuwork/pre.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
git log --oneline | head -1 | tee -a $OUT/env.txt
timeout 150 python .gpuwork/fp32cap.py > $OUT/fp32cap_log.txt 2>&1
grep -E "CaptureError|ROOT|captured OK" $OUT/fp32cap_log.txt | cut -c1-600
timeout 420 python -m pytest -q -m gpu --runxfail tests/test_tree_layout.py tests/test_redundancy_free.py tests/test_dense_tree_attention.py tests/test_flex_tree_attention_boundary.py tests/test_logprobs.py tests/test_entropy.py -p no:cacheprovider -rfEs > $OUT/a_tests.txt 2>&1; echo rc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" $OUT/a_tests.txt | cut -c1-400 | tail -25
grep -n -A40 "^____" $OUT/a_tests.txt | grep -E "Error|error|assert|^[0-9]+-E" | head -30 | cut -c1-300
