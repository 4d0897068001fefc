# session 55 device calls (one H200 per lease); any other mode goes to h200_s54/d.sh (and on to earlier sessions')
#   bash d.sh rf55 TAG KERNEL ARGS...   benchmarks.redundancy_free_cuda --attention-kernel KERNEL ARGS
#                                       ($OUT/rf_TAG/: rf_cuda.jsonl, rf_cuda.md; the log $OUT/rf_TAG.txt)
#   bash d.sh prof55 [KERNELS] [C]      probe_rf55.py: eager RF steps and their profiles ($OUT/probe_rf55.txt)
mode=$1
if [ "$mode" = prof55 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-400} python benchmarks/results/h200_s55/probe_rf55.py ${2:-auto,flex} $3 2>&1 | grep -v -i "warn\|exe_args" \
    | tee $OUT/probe_rf55.txt | grep "=="
elif [ "$mode" = rf55 ]; then
  source benchmarks/results/h100_s18/pre.sh
  TAG=$2 KERNEL=$3; shift 3
  timeout ${T:-560} python -m benchmarks.redundancy_free_cuda --out $OUT/rf_$TAG --attention-kernel $KERNEL "$@" 2>&1 \
    | grep -v -i "warn" | tee $OUT/rf_$TAG.txt | tail -25
else
  bash benchmarks/results/h200_s54/d.sh "$@"
fi
