#!/usr/bin/env bash
# session 16, second machine (source ../h100_s14/pre.sh first):
#   bash gpu2.sh moe_test   the HF MoE GPU test again, its CPU oracle now on HF's torch GDN function
#   bash gpu2.sh attn256    the Qwen3.5 hybrids' attention shape (8 heads, 2 kv heads, head dim 256): flex's Triton
#                           kernel (what "auto" runs there) vs the varlen op (segments: no block-sparse FA4 tiles at
#                           256) vs the baselines' attention over the paths; the hybrid's 16k tree and a deep tree
#   bash gpu2.sh moe        the Qwen3-30B-A3B-layer-shaped MoE (4 layers) under the new default: tree at 16k
#                           (session 13: 0.168 s vs packed FA4 varlen 0.242 s) and packed + tree at 32k
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-}
case "${1:?moe_test|attn256|moe}" in
  moe_test)
    timeout 200 python -m pytest -q -m gpu -p no:cacheprovider -rfEs tests/test_moe_grouped.py > $OUT/moe_test.txt 2>&1
    echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/moe_test.txt | tail -8 ;;
  attn256)
    timeout 380 python benchmarks/bench_fa4_attention.py --shape 8:2:256 --sizes "" --deep deep-16k \
      --harness 16x2048@0.5,32x2048@0.75 --contenders flex_triton,fa4_varlen,paths_fa4_varlen \
      --out $OUT/attn256 > $OUT/attn256_log.txt 2>&1; echo "rc=$?"
    grep -v -i warn $OUT/attn256_log.txt | grep -E "^\||rror" | cut -c1-420 | tail -n 30 ;;
  moe)
    for spec in "16 tree" "32 packed_fa4_varlen tree"; do
      set -- $spec; P=$1; shift
      timeout 280 python -m benchmarks.harness --model qwen3-30b-a3b-4l --suite sweep --por 0.5 --paths $P \
        --path-len 2048 --contenders "$@" --iters 3 --child-timeout-s 200 --out $OUT/moe_$P > $OUT/moe_${P}_log.txt 2>&1
      echo "paths=$P rc=$?"
      grep '^{"model"' $OUT/moe_${P}_log.txt | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r['contender'], r['status'], *(f'{k}={r[k]:.4g}' for k in ('step_s', 'first_s', 'bound', 'peak_gib') if isinstance(r.get(k), float)))"
    done ;;
esac
