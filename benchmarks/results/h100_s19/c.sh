# session 19, third machine (no parts installed: the shifts op needs only torch + triton): GPU tests with the tuned
# block sizes, then the conv alone
export PYTHONPATH=$PWD:$PYTHONPATH
ln -sfn ../models treecompile/models
timeout 100 python -m pytest -q -m gpu tests/test_tree_conv_shifts.py 2>&1 | grep -E "passed|failed|Error" | tail -4 | tee $OUT/gpu_tests.txt
timeout 60 python benchmarks/bench_tree_conv.py --only shifts,shifts_inductor > $OUT/bench_conv_syn.txt 2>&1; grep "ms fwd+bwd" $OUT/bench_conv_syn.txt
