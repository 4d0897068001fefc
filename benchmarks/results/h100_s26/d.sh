# session 26 device calls (one H100). Modes of its own:
#   bash d.sh host [ARGS...]   results/h100_s26/host.py (the tree step's host time: timed, then under cProfile)
#   bash d.sh hostab [ARGS...] host.py --no-cprofile, this session's paths then session 25's (--old), one process each
# every other mode is session 25's d.sh (which hands its own non-head modes to session 24's), run as it is
case "$1" in
host)
  shift
  source benchmarks/results/h100_s18/pre.sh
  set -o pipefail
  N=host_$(echo "$@" | tr -c 'a-zA-Z0-9.\n' '_')
  timeout 570 python benchmarks/results/h100_s26/host.py "$@" 2>&1 | grep -v -i 'warn\|aux_data\|exe_args\|TileLang' \
    | tee $OUT/$N.txt | head -120 ;;
hostab)
  shift
  source benchmarks/results/h100_s18/pre.sh
  for o in "" --old; do
    timeout 280 python benchmarks/results/h100_s26/host.py --no-cprofile $o "$@" 2>&1 | grep '^{\|^old\|Error' \
      | tee -a $OUT/hostab.txt
  done ;;
*) exec bash benchmarks/results/h100_s25/d.sh "$@" ;;
esac
