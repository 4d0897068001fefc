# session 56 device calls (one H200 per lease); any other mode goes to h200_s55/d.sh (and on to earlier sessions')
#   bash d.sh prof56 [KERNELS] [C] [compiled|eager] [--cprofile]   probe_rf56.py: RF steps and their profiles
#                                                    ($OUT/probe_rf56.txt)
#   bash d.sh packed56 [C]                           probe_packed56.py: the compiled packed baseline's steps
#                                                    ($OUT/probe_packed56.txt)
mode=$1
if [ "$mode" = prof56 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-560} python benchmarks/results/h200_s56/probe_rf56.py ${2:-auto} ${3:-4096} ${4:-compiled} $5 2>&1 \
    | grep -v -i "warn\|exe_args" | tee $OUT/probe_rf56.txt | grep "==\|first"
elif [ "$mode" = packed56 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-560} python benchmarks/results/h200_s56/probe_packed56.py $2 2>&1 \
    | grep -v -i "warn\|exe_args" | tee $OUT/probe_packed56.txt | grep "=="
else
  bash benchmarks/results/h200_s55/d.sh "$@"
fi
