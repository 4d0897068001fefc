source .gpuwork/pre.sh
pip list 2>/dev/null | grep -i -E "flash|cutlass|tilelang|linear" | tee -a $OUT/env.txt
timeout 570 python -m benchmarks.hybrid_bench --out $OUT/hyb --case syn --skip-layer --contenders tree packed_fla_varlen --iters 3 --budget-s 400 > $OUT/hyb_log.txt 2>&1; echo "rc=$?"
python - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/hyb/**/*.jsonl", recursive=True)):
    for l in open(f):
        r = json.loads(l); print(f.split("/")[-2], {k: r.get(k) for k in ("contender", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "frac_bound", "tree_tokens", "path_tokens", "note")})
PY
grep -v -i warn $OUT/hyb_log.txt | tail -6 | cut -c1-300
