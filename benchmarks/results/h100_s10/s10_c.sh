source .gpuwork/pre.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/env.txt
pip list 2>/dev/null | grep -i -E "flash|cutlass|tilelang|linear" | tee -a $OUT/env.txt
git log --oneline | head -1 | tee -a $OUT/env.txt
# hybrid at 32k tree tokens (32 x 2,048 POR 0.5): the tree
timeout 560 python -m benchmarks.harness --model qwen3.5-hybrid-0.8b --suite sweep --por 0.5 --paths 32 --path-len 2048 --contenders tree --iters 3 --budget-s 400 --out $OUT/h32t > $OUT/h32t_log.txt 2>&1; echo "rc=$?"
python - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/*/results.jsonl")):
    for l in open(f):
        r = json.loads(l); print(f.split("/")[-2], {k: r.get(k) for k in ("contender", "tree", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "frac_bound", "tree_tokens", "path_tokens", "note")})
PY
grep -v -i warn $OUT/h32t_log.txt | tail -4 | cut -c1-300
