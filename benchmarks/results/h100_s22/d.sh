# session 22: the GDN layer A/B (fla_direct launches vs fla's own functions vs one fla call), GPU tests, harness rows
#   bash d.sh layer | tests | e2e   (e2e: b.sh of session 20 with MODEL, SUITE, PATHS, CONTENDERS, T, CT)
source benchmarks/results/h100_s18/pre.sh
case "$1" in
layer)
  for c in agentic syn; do
    timeout ${LT:-200} python -m benchmarks.prof_gdn_layer --case $c --iters 9 2>&1 | grep -v -i "warn\|TileLang" > $OUT/layer_$c.txt
    grep '"variant"\|plan' $OUT/layer_$c.txt
  done ;;
tests)
  timeout ${TT:-420} python -m pytest -q -m gpu tests/test_fla_gdn.py tests/test_fla_plan.py 2>&1 \
    | grep -E "passed|failed|Error|assert" | tail -8 | tee $OUT/gpu_tests.txt ;;
s21) PYTHONPATH=$PWD/benchmarks/results/h100_s22/s21_code:$PYTHONPATH bash benchmarks/results/h100_s20/b.sh ;;
*) bash benchmarks/results/h100_s20/b.sh ;;
esac
# s21: the same harness run with session 21's launches (s21_code/sitecustomize.py), e.g. SUITE=agentic CONTENDERS=tree
