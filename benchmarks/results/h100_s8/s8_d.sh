source .gpuwork/pre.sh
timeout 230 python -m benchmarks.harness --model qwen3-0.6b --suite sweep --por 0.5 --paths 64 --path-len 2048 --contenders tree_packed --capacity 32768 --iters 3 --budget-s 100 --out $OUT/f64 > $OUT/f64_log.txt 2>&1; echo "rc=$?" >> $OUT/f64_log.txt
timeout 320 python -m benchmarks.harness --model qwen3-1.7b --suite sweep --por 0.5 --paths 32 --path-len 2048 --contenders packed_fa4_varlen tree --iters 3 --budget-s 150 --out $OUT/g32 > $OUT/g32_log.txt 2>&1; echo "rc=$?" >> $OUT/g32_log.txt
python - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/*/results.jsonl")):
    for l in open(f):
        r = json.loads(l); print(f.split("/")[-2], {k: r.get(k) for k in ("contender", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "frac_bound", "tree_tokens", "path_tokens", "note")})
PY
for f in $OUT/f64_log.txt $OUT/g32_log.txt; do tail -n 2 $f | cut -c1-300; done
