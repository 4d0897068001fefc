source .gpuwork/pre.sh
timeout 540 python -m benchmarks.hybrid_bench --out $OUT/hyba --case agentic --skip-layer --contenders tree packed_fla_varlen --iters 3 --budget-s 330 > $OUT/hyba_log.txt 2>&1; echo "rc=$?"
python - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/hyba/**/*.jsonl", recursive=True)):
    for l in open(f):
        r = json.loads(l); print({k: r.get(k) for k in ("tree", "contender", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "frac_bound", "tree_tokens", "path_tokens", "note")})
PY
grep -v -i warn $OUT/hyba_log.txt | tail -4 | cut -c1-300
