# session 19, first machine: GPU tests of the Triton conv backward, the conv alone (syn 16k with kernel profiles, agentic)
source benchmarks/results/h100_s18/pre.sh
set -o pipefail
timeout 240 python -m pytest -q -m gpu tests/test_tree_conv_shifts.py tests/test_fla_conv.py 2>&1 | grep -v -i "warn" | tail -8 | tee $OUT/gpu_tests.txt
timeout 150 python benchmarks/bench_tree_conv.py --only shifts,shifts_inductor,shifts_no_tree,fla,fla_no_tree --profile > $OUT/bench_conv_syn.txt 2>&1
grep "ms fwd+bwd" $OUT/bench_conv_syn.txt
timeout 100 python benchmarks/bench_tree_conv.py --agentic parallel-tools --scale 1.5 --only shifts,shifts_inductor,fla > $OUT/bench_conv_agentic.txt 2>&1
grep "ms fwd+bwd" $OUT/bench_conv_agentic.txt
