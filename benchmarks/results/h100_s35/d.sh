# session 35 device calls (one H100 per lease); every call sources session 18's pre.sh (install parts, kernel caches)
#   bash d.sh install                 nothing more (an install call)
#   bash d.sh tests FILES...          pytest -m gpu FILES (the first run compiles tilelang's kernels)
#   bash d.sh prec MODEL [ARGS...]    benchmarks.gdn_precision, model level only (bf16 cosines vs the fp32 oracle)
#   bash d.sh e2e NAME T ARGS...      benchmarks.harness with ARGS, T seconds at most, rows under $OUT/NAME
#   bash d.sh kcpack                  the kernel caches as parts in $OUT (carry them in .kc/ next time)
source benchmarks/results/h100_s18/pre.sh
set -o pipefail
F='warn\|aux_data\|exe_args\|TileLang'
mode=$1; shift
case "$mode" in
install) ;;
tests)
  timeout 560 python -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee $OUT/gputests.txt | tail -30 ;;
prec)
  M=$1; shift
  timeout ${T:-560} python -m benchmarks.gdn_precision --skip-op --skip-fp32-inputs --model $M --out $OUT/prec_$M.json "$@" \
    2>&1 | grep -v -i "$F" | tee $OUT/prec_${M}_log.txt | tail -30 ;;
e2e)
  N=$1; T=$2; shift 2
  timeout $T python -m benchmarks.harness --out $OUT/$N "$@" 2>&1 | grep -v -i "$F" | tee $OUT/${N}_log.txt | tail -12 ;;
kcpack) source benchmarks/results/h100_s18/kc_pack.sh ;;
esac
