source .gpuwork/pre.sh
# hybrid 16k (16 x 2,048 POR 0.5) tree with the conv through fla; then 32k
timeout 330 python -m benchmarks.harness --model qwen3.5-hybrid-0.8b --suite sweep --por 0.5 --paths 16 --path-len 2048 --contenders tree --iters 3 --budget-s 300 --out $OUT/h16t > $OUT/h16t_log.txt 2>&1; echo "rc=$?"
timeout 250 python -m benchmarks.harness --model qwen3.5-hybrid-0.8b --suite sweep --por 0.5 --paths 32 --path-len 2048 --contenders tree --iters 3 --budget-s 200 --out $OUT/h32t > $OUT/h32t_log.txt 2>&1; echo "rc=$?"
python - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/*/results.jsonl")):
    for l in open(f):
        r = json.loads(l); print(f.split("/")[-2], {k: r.get(k) for k in ("contender", "tree", "status", "step_s", "first_s", "peak_gib", "bound", "tree_tokens", "path_tokens", "note")})
PY
for f in $OUT/h16t_log.txt $OUT/h32t_log.txt; do grep -v -i warn $f | tail -n 2 | cut -c1-300; done
