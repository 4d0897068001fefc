source .gpuwork/pre.sh
for P in 32 64; do
timeout 285 python -m benchmarks.harness --model qwen3-0.6b --suite sweep --por 0.5 --paths $P --path-len 2048 --contenders packed_fa4_varlen tree --iters 3 --budget-s 200 --out $OUT/e$P > $OUT/e${P}_log.txt 2>&1; echo "rc=$?" >> $OUT/e${P}_log.txt
done
python - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/e*/*.jsonl")):
    for l in open(f):
        r = json.loads(l); print(f.split("/")[-2], {k: r.get(k) for k in ("contender", "tree", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "frac_bound", "tree_tokens", "path_tokens", "note")})
PY
tail -2 $OUT/e32_log.txt $OUT/e64_log.txt | cut -c1-300
