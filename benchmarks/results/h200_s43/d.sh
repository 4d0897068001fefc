# session 43 device calls (one H200 per lease): session 42's modes, and `seq` (several modes in one call)
#   bash d.sh seq "MODE ARGS" "MODE ARGS" ...   each quoted command through h200_s42/d.sh, in order
#   bash d.sh MODE ...                          any other mode: h200_s42/d.sh MODE ... (install, tests, prof, probe)
mode=$1
if [ "$mode" = seq ]; then
  shift
  for c in "$@"; do echo "=== $c"; bash benchmarks/results/h200_s42/d.sh $c; done
else
  bash benchmarks/results/h200_s42/d.sh "$@"
fi
