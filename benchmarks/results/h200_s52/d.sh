# session 52 device calls (one H200 per lease); any other mode goes to h200_s51/d.sh (and on to earlier sessions')
#   bash d.sh gqa52     probe_gqa52.py: the segments plan's attention per layer with FA4's GQA path against K/V
#                       expanded to the query heads, and (after this session's kernels) through gather_rows and
#                       sum_copies(rep=) ($OUT/probe_gqa52.txt)
mode=$1
if [ "$mode" = gqa52 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-300} python benchmarks/results/h200_s52/probe_gqa52.py 2>&1 | grep -v -i "warn" \
    | tee $OUT/probe_gqa52.txt | tail -12
else
  bash benchmarks/results/h200_s51/d.sh "$@"
fi
