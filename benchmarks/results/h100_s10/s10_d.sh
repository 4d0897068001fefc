source .gpuwork/pre.sh
# hybrid 32k: the packed baseline (fla varlen + FA4 varlen, packs of 8,192), then the agentic packed baseline
timeout 300 python -m benchmarks.harness --model qwen3.5-hybrid-0.8b --suite sweep --por 0.5 --paths 32 --path-len 2048 --contenders packed_fla_varlen --iters 3 --budget-s 200 --out $OUT/h32p > $OUT/h32p_log.txt 2>&1; echo "rc=$?"
timeout 270 python -m benchmarks.harness --model qwen3.5-hybrid-0.8b --suite agentic --agentic parallel-tools --agentic-scale 1.5 --contenders packed_fla_varlen --iters 3 --budget-s 150 --out $OUT/hap > $OUT/hap_log.txt 2>&1; echo "rc=$?"
python - <<'PY'
import json, os, glob
for f in sorted(glob.glob(os.environ["OUT"] + "/*/results.jsonl")):
    for l in open(f):
        r = json.loads(l); print(f.split("/")[-2], {k: r.get(k) for k in ("contender", "tree", "status", "step_s", "first_s", "peak_gib", "bound", "x_best", "frac_bound", "tree_tokens", "path_tokens", "note")})
PY
for f in $OUT/h32p_log.txt $OUT/hap_log.txt; do grep -v -i warn $f | tail -n 3 | cut -c1-300; done
