#!/usr/bin/env bash
# Issue 16: dense end to end at 32k tree tokens (32 x 2,048 POR 0.5) with the RoPE tables materialized in the
# tree's lowering AND in the baselines (harness.materialized_rope), each contender in its own process.
#   bash benchmarks/results/h100_s14/dense32k.sh MODEL [contenders...]
set -u
m=${1:?model}; shift
C=${*:-packed_fa4_varlen tree}
timeout 585 python -m benchmarks.harness --model $m --suite sweep --por 0.5 --paths 32 --path-len 2048 \
  --contenders $C --iters 3 --child-timeout-s 400 --out $OUT/$m > $OUT/${m}_log.txt 2>&1
echo "$m rc=$?"
python benchmarks/results/h100_s14/show.py
grep -v -i warn $OUT/${m}_log.txt | grep -i -E "error|Traceback" | tail -n 8 | cut -c1-300
