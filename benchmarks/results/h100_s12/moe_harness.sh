#!/usr/bin/env bash
# Issue 16 items 3-4, the MoE shape: the harness on HF Qwen3MoeForCausalLM at the Qwen3-30B-A3B layer shape
# with 4 layers (spec qwen3-30b-a3b-4l: 3.1B parameters, 128 experts top 8; benchmarks/hf_models.py) against
# the FA4 per-path, FA4 varlen packed and flex packed baselines, bf16, each contender in its own process.
# eager_per_path runs first only as the reference of the loss_rel_dev / grad_cos columns (HF's own eager
# model, grouped_mm experts; it is a baseline too, so it may become best_baseline if it is the fastest).
#
# One device call per size (each fits the 10-minute call limit; FA4 wheels installed by device-install.sh):
#   run(command="source .whl/device-install.sh && bash benchmarks/results/h100_s12/moe_harness.sh 16k", carry=[...])
#   run(command="source .whl/device-install.sh && bash benchmarks/results/h100_s12/moe_harness.sh 32k", carry=[...])
# Sizes: synthetic trees at POR 0.5, 2,048-token paths: 16k = 16 paths (16,384 tree tokens, 32,768 path
# tokens), 32k = 32 paths (32,768 tree tokens). Packs of --capacity 16384 (the default). The tree at 14k
# tokens peaked at 38.5 GiB on the H100 (gpu_checks --moe, session 11): 32k may be an OOM row there.
# Writes $OUT/moe_<size>/{results.jsonl,results.csv,tables.md,env.json}, $OUT/moe_<size>_log.txt, $OUT/env.txt.
set -u
SIZE=${1:?usage: moe_harness.sh 16k|32k}
case "$SIZE" in
  16k) PATHS=16 ;;
  32k) PATHS=32 ;;
  *) echo "unknown size $SIZE (16k|32k)"; exit 2 ;;
esac
OUT=${OUT:?OUT must name the output folder}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a $OUT/env.txt
pip list 2>/dev/null | grep -i -E "flash|cutlass" | tee -a $OUT/env.txt
timeout 580 python -m benchmarks.harness --model qwen3-30b-a3b-4l --suite sweep --por 0.5 --paths $PATHS \
  --path-len 2048 --contenders eager_per_path compiled_per_path_fa4 packed_fa4_varlen packed_flex tree \
  --iters 3 --child-timeout-s 200 --out $OUT/moe_$SIZE > $OUT/moe_${SIZE}_log.txt 2>&1
echo "harness rc=$?"
# the rows as the children finished them (results.jsonl is written when the whole tree is done)
grep '^{"model"' $OUT/moe_${SIZE}_log.txt | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['contender'], r['status'], *(f'{k}={r[k]:.4g}' for k in ('step_s', 'first_s', 'bound', 'peak_gib', 'loss_rel_dev', 'grad_cos') if isinstance(r.get(k), float)))"
[ -f $OUT/moe_$SIZE/tables.md ] && cat $OUT/moe_$SIZE/tables.md | cut -c1-400
grep -v -i warn $OUT/moe_${SIZE}_log.txt | grep -i -E "error|Traceback" | tail -n 8 | cut -c1-300
