# session 25 device calls (one H100). Modes of its own:
#   bash d.sh head    results/h100_s25/head_kept.py (the fused head chunked vs kept, fwd+bwd)
#   bash d.sh dw      results/h100_s25/dw.py (the kept head's dW GEMM: layouts and output dtypes)
# every other mode (install, dense, prof, e2e, ab, gputests, kcpack) is session 24's d.sh, run as it is
case "$1" in
head|dw)
  source benchmarks/results/h100_s18/pre.sh
  set -o pipefail
  N=$([ "$1" = head ] && echo head_kept || echo dw)
  timeout 570 python benchmarks/results/h100_s25/$N.py 2>&1 | tee $OUT/$N.txt | tail -20 ;;
*) exec bash benchmarks/results/h100_s24/d.sh "$@" ;;
esac
