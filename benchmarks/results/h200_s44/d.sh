# session 44 device calls (one H200 per lease): session 43's modes, run one after another
#   bash d.sh seq "MODE ARGS" "MODE ARGS" ...   each quoted command through h200_s43/d.sh, in order
#   bash d.sh MODE ...                          any other mode: h200_s43/d.sh MODE ... (install, gpu43, attn43, prof)
mode=$1
if [ "$mode" = seq ]; then
  shift
  for c in "$@"; do echo "=== $c"; bash benchmarks/results/h200_s43/d.sh $c; done
else
  bash benchmarks/results/h200_s43/d.sh "$@"
fi
