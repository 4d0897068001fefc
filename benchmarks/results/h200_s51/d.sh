# session 51 device calls (one H200 per lease); any other mode goes to h200_s50/d.sh (and on to earlier sessions')
#   bash d.sh loop51 NAME ARGS...   benchmarks.prof_step --loop 10 --iters 10 --host-top 40 ARGS ($OUT/NAME.txt): the
#                                  synchronized step, and 10 steps back to back with one synchronize, in 3 rounds
#   bash d.sh fwd51                 probe_fwd51.py: host against GPU time of the 0.6B parallel-tools forward and backward,
#                                  and their cProfiles ($OUT/probe_fwd51.txt)
#   bash d.sh loop51b               probe_loop51.py: the back-to-back steps' idle and blocking calls ($OUT/probe_loop51.txt)
mode=$1
if [ "$mode" = loop51 ]; then
  N=$2; shift 2
  bash benchmarks/results/h200_s40/d.sh prof $N ${T:-560} --iters 10 --loop 10 --host-top 40 "$@"
elif [ "$mode" = fwd51 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-400} python benchmarks/results/h200_s51/probe_fwd51.py 2>&1 | grep -v -i "warn" \
    | tee $OUT/probe_fwd51.txt | head -3
elif [ "$mode" = loop51b ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-500} python benchmarks/results/h200_s51/probe_loop51.py 2>&1 | grep -v -i "warn" \
    | tee $OUT/probe_loop51.txt | tail -40
else
  bash benchmarks/results/h200_s50/d.sh "$@"
fi
