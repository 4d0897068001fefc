# session 36 device calls (H200s): session 35's modes (h100_s35/d.sh), and `attn`
#   bash d.sh attn ARGS...            benchmarks/bench_fa4_attention.py ARGS, tables under $OUT/attn
#   bash d.sh MODE ...                any other mode: h100_s35/d.sh MODE ... (install, tests, prec, e2e, kcpack)
mode=$1
if [ "$mode" = attn ]; then
  shift
  source benchmarks/results/h100_s18/pre.sh
  set -o pipefail
  timeout ${T:-560} python benchmarks/bench_fa4_attention.py --out $OUT/attn "$@" 2>&1 \
    | grep -v -i 'warn\|aux_data\|exe_args' | tee $OUT/attn_log.txt | tail -40
else
  bash benchmarks/results/h100_s35/d.sh "$@"
fi
