#!/usr/bin/env bash
# session 16, first machine: "auto" now lowers tree attention to the varlen op (segments or FA4 block-sparse per
# batch) where FA4 runs both plans.  The GPU tests of every attention route after session 15's review mends and
# this change (no fla: its tilelang compile takes minutes), then the 0.6B 32k step under the default.
# Source ../h100_s14/pre.sh first.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 330 python -m pytest -q -m gpu -p no:cacheprovider -rfEs tests/test_varlen_tree_attention.py \
  tests/test_fa4_tree_attention.py tests/test_dense_tree_attention.py tests/test_tree_layout.py \
  tests/test_flex_tree_attention_boundary.py tests/test_logprobs.py tests/test_entropy.py \
  tests/test_moe_grouped.py tests/test_redundancy_free.py > $OUT/gpu_tests.txt 2>&1
echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/gpu_tests.txt | tail -25
timeout 250 python -m benchmarks.harness --model qwen3-0.6b --suite sweep --por 0.5 --paths 32 --path-len 2048 \
  --contenders tree --iters 3 --child-timeout-s 240 --out $OUT/auto_0.6b > $OUT/auto_0.6b_log.txt 2>&1
echo "rc=$?"
grep -h '"step_s"' $OUT/auto_0.6b/results.jsonl | python -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l); print(d['contender'], d['status'], d.get('step_s'), d.get('first_s'), d.get('bound'), d.get('peak_gib'), d.get('note'))"
