# session 53 device calls (one H200 per lease); any other mode goes to h200_s52/d.sh (and on to earlier sessions')
#   bash d.sh host53        probe_host53.py: host and GPU cost of the expanded gather ways and the copy sums (no FA4)
#   bash d.sh gqa53         probe_gqa52.py with 32 query heads on 8 kv heads (Qwen3-4B's groups of four), then 16 / 8
#                           ($OUT/probe_gqa53_h32.txt, $OUT/probe_gqa53_h16.txt)
mode=$1
if [ "$mode" = host53 ]; then
  ln -sfn ../models treecompile/models
  PYTHONPATH=$PWD timeout ${T:-300} python benchmarks/results/h200_s53/probe_host53.py 2>&1 | grep -v -i warn \
    | tee $OUT/probe_host53.txt | head -12
elif [ "$mode" = gqa53 ]; then
  source benchmarks/results/h100_s18/pre.sh
  for h in 32 16; do
    H=$h HKV=8 timeout ${T:-200} python benchmarks/results/h200_s52/probe_gqa52.py 2>&1 | grep -v -i "warn\|exe_args" \
      | tee $OUT/probe_gqa53_h$h.txt | tail -7
  done
else
  bash benchmarks/results/h200_s52/d.sh "$@"
fi
