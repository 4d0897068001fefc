#!/usr/bin/env bash
# session 15, second machine: the varlen op's per-batch choice (segments, or FA4's block-sparse kernels above
# VARLEN_GATHER_LIMIT x T gathered rows): its GPU tests, then the 0.6B step on the deep-agent tree (G ~ 8.5x T:
# the block-sparse plan) against the flex lowering.  Source pre.sh first.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-}
timeout 300 python -m pytest -q -m gpu tests/test_varlen_tree_attention.py -p no:cacheprovider -rfEs \
  > $OUT/varlen_tests2.txt 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/varlen_tests2.txt | tail -20
timeout 280 python -m benchmarks.harness --model qwen3-0.6b --suite agentic --agentic deep-agent --contenders tree tree_fa4_varlen \
  --iters 3 --child-timeout-s 200 --out $OUT/deep_agent > $OUT/deep_agent_log.txt 2>&1; echo "rc=$?"
grep -h '"step_s"' $OUT/deep_agent/results.jsonl | python -c "
import sys, json
for l in sys.stdin:
    d = json.loads(l); print(d['contender'], d['status'], d.get('step_s'), d.get('first_s'), d.get('bound'), d.get('peak_gib'), d.get('tree_tokens'), d.get('path_tokens'))"
