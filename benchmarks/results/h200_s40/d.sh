# session 40 device calls (one H200 per lease): session 36's modes, and `prof`
#   bash d.sh prof NAME T ARGS...     benchmarks.prof_step ARGS, T seconds at most, printed table in $OUT/NAME.txt
#   bash d.sh MODE ...                any other mode: h200_s36/d.sh MODE ... (install, tests, e2e, attn)
mode=$1
if [ "$mode" = prof ]; then
  N=$2; T=$3; shift 3
  source benchmarks/results/h100_s18/pre.sh
  set -o pipefail
  timeout $T python -m benchmarks.prof_step "$@" 2>&1 | grep -v -i 'warn\|aux_data\|exe_args\|TileLang\|lowering = ' \
    | tee $OUT/$N.txt | grep -v '^#   \|^#    ' | tail -20
else
  bash benchmarks/results/h200_s36/d.sh "$@"
fi
