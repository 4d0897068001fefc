# session 21, H200 (ran from benchmarks/results/h100_s21/c.sh, moved here after): GPU tests of the changed host plans, then one harness run (b.sh of session 20, argument: which)
source benchmarks/results/h100_s18/pre.sh
R=benchmarks/results/h100_s20
case "$1" in
tests)
  timeout 420 python -m pytest -q -m gpu tests/test_fla_plan.py tests/test_varlen_tree_attention.py tests/test_fla_gdn.py 2>&1 \
    | grep -E "passed|failed|Error" | tail -6 | tee $OUT/gpu_tests.txt ;;
*) bash $R/b.sh ;;
esac
