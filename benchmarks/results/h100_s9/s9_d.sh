source .gpuwork/pre.sh
timeout 400 python -m benchmarks.harness --model qwen3-4b --suite sweep --por 0.5 --paths 16 --path-len 2048 --contenders packed_fa4_varlen tree --iters 3 --budget-s 250 --out $OUT/q4 > $OUT/q4_log.txt 2>&1; echo "rc=$?"
timeout 180 python -m benchmarks.harness --model qwen3-0.6b --suite agentic --agentic-scale 3 --agentic parallel-tools --contenders packed_fa4_varlen tree --iters 3 --budget-s 100 --out $OUT/ag > $OUT/ag_log.txt 2>&1; echo "rc=$?"
python - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/*/results.jsonl")):
    for l in open(f):
        r = json.loads(l); print(f.split("/")[-2], {k: r.get(k) for k in ("contender", "tree", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "frac_bound", "tree_tokens", "path_tokens", "note")})
PY
for f in $OUT/q4_log.txt $OUT/ag_log.txt; do tail -n 3 $f | cut -c1-300; done
