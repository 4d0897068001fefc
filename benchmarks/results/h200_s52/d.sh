# session 52 device calls (one H200 per lease); any other mode goes to h200_s51/d.sh (and on to earlier sessions')
#   bash d.sh gqa52     probe_gqa52.py: the segments plan's attention per layer with FA4's GQA path against K/V
#                       expanded to the query heads, and (after this session's kernels) through gather_keys and
#                       sum_copies(rep=) ($OUT/probe_gqa52.txt)
#   bash d.sh kv52      the next lease's first call for K/V expanded: `pytest -m gpu tests/test_varlen_kv_heads.py`
#                       ($OUT/gpu52_kv.txt), then gqa52
mode=$1
if [ "$mode" = kv52 ]; then
  TAG=kv T=${T:-420} bash benchmarks/results/h200_s51/d.sh gpu50 tests/test_varlen_kv_heads.py
  mv $OUT/gpu50_kv.txt $OUT/gpu52_kv.txt 2>/dev/null
  T=150 bash "$0" gqa52
elif [ "$mode" = gqa52 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-300} python benchmarks/results/h200_s52/probe_gqa52.py 2>&1 | grep -v -i "warn" \
    | tee $OUT/probe_gqa52.txt | tail -12
else
  bash benchmarks/results/h200_s51/d.sh "$@"
fi
