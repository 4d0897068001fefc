# session 49 device calls (one H200 per lease); any other mode goes to h200_s48/d.sh (and on to earlier sessions')
#   bash d.sh replay49        the FA4 replay GPU tests (forward and backward, bitwise against the interface) and the
#                             varlen op's other GPU tests ($OUT/gpu49_replay.txt)
#   bash d.sh pt49            agentic parallel-tools: packed FA4 varlen, `tree` (forward and backward replayed) and
#                             `tree_fa4_bwd_interface` (the backward through FA4's interface: sessions 42-48) in one
#                             process ($OUT/o49_parallel-tools.txt)
#   bash d.sh gpuall49 [FILES] `pytest -m gpu` over FILES (default: all of tests/) ($OUT/gpuall49.txt)
#   bash d.sh mis49           HF Mistral-0.6B-shaped, sliding window 512, agentic parallel-tools: packed FA4 varlen
#                             (windowed) and `tree` in one process ($OUT/o49_mistral_parallel-tools.txt)
mode=$1
if [ "$mode" = replay49 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-540} python -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_tree_attention.py \
    -W ignore -rs -k "${K:-replay}" 2>&1 | grep -v "torch.__trace" | tee $OUT/gpu49_replay.txt | tail -25
elif [ "$mode" = pt49 ]; then
  bash benchmarks/results/h200_s40/d.sh prof o49_parallel-tools ${T:-560} --model qwen3-0.6b --agentic parallel-tools \
    --contenders ${C:-packed_fa4_varlen tree tree_fa4_bwd_interface} --iters 10
elif [ "$mode" = mis49 ]; then
  bash benchmarks/results/h200_s40/d.sh prof o49_mistral_parallel-tools ${T:-560} --model hf-mistral-0.6b-w512 \
    --agentic parallel-tools --contenders packed_fa4_varlen tree --iters 10
elif [ "$mode" = gpuall49 ]; then
  source benchmarks/results/h100_s18/pre.sh
  shift
  timeout ${T:-570} python -m pytest -m gpu -q -p no:cacheprovider ${@:-tests} -W ignore -rs 2>&1 \
    | grep -v "torch.__trace" | tee $OUT/gpuall49.txt | tail -30
else
  bash benchmarks/results/h200_s48/d.sh "$@"
fi
