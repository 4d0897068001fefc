# session 19, second machine: GPU tests, the Triton conv backward's block sizes, the conv alone (syn 16k, agentic)
source benchmarks/results/h100_s18/pre.sh
set -o pipefail
timeout 200 python -m pytest -q -m gpu tests/test_tree_conv_shifts.py tests/test_fla_conv.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -8 | tee $OUT/gpu_tests.txt
timeout 150 python benchmarks/results/h100_s19/conv_tune.py > $OUT/conv_tune.txt 2>&1; grep best $OUT/conv_tune.txt
timeout 100 python benchmarks/bench_tree_conv.py --only shifts,shifts_inductor,fla --profile > $OUT/bench_conv_syn.txt 2>&1
grep "ms fwd+bwd" $OUT/bench_conv_syn.txt
timeout 60 python benchmarks/bench_tree_conv.py --agentic parallel-tools --scale 1.5 --only shifts,shifts_inductor,fla > $OUT/bench_conv_agentic.txt 2>&1
grep "ms fwd+bwd" $OUT/bench_conv_agentic.txt
