#!/usr/bin/env bash
# Issue 16: where the tree's attention loses against the baselines' attention on the end-to-end trees
# (fwd and bwd apart, the backward's kv-block balance), then the GPU tests of the lowering and FA4.
set -u
timeout 330 python benchmarks/bench_fa4_attention.py --sizes "" --deep none \
  --harness 32x2048@0.5,16x2048@0.5,32x2048@0.75 --contenders fa4_flex,fa4_direct,paths_fa4_varlen \
  --out $OUT/attn > $OUT/attn_log.txt 2>&1
echo "bench rc=$?"
grep -v -i warn $OUT/attn_log.txt | grep -E "^\||error|Error" | cut -c1-420 | tail -n 30
timeout 230 python -m pytest -q -m gpu tests/test_cuda_lowering.py tests/test_fa4_tree_attention.py \
  -p no:cacheprovider -rfEs > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$?"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^E " $OUT/gpu_tests.txt | cut -c1-300 | tail -20
