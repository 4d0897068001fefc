# session 42 device calls (one H200 per lease): session 40's modes (prof, and through it 36's/35's), and `probe`
#   bash d.sh probe T                  benchmarks/results/h200_s42/probe_replay.py, T seconds at most, $OUT/probe_replay.txt
#   bash d.sh MODE ...                 any other mode: h200_s40/d.sh MODE ... (install, tests, e2e, prof, attn)
mode=$1
if [ "$mode" = probe ]; then
  source benchmarks/results/h100_s18/pre.sh
  set -o pipefail
  timeout $2 python benchmarks/results/h200_s42/probe_replay.py 2>&1 | grep -v -i 'warn\|aux_data\|exe_args' \
    | tee $OUT/probe_replay.txt | tail -30
else
  bash benchmarks/results/h200_s40/d.sh "$@"
fi
