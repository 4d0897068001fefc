#!/usr/bin/env bash
# Run in session 15 (tests, dense, hybrid as written; attn with --harness 32x2048@0.5,32x2048@0.75 only, and
# qwen3-1.7b as in dense): the first GPU checks of
# attention_kernel="fa4_varlen" (ops/varlen_tree_attention.py). One warm machine, FA4 (+ tilelang/fla for the
# hybrid step) installed with .whl/device-install.sh; source pre.sh first (it links treecompile/models).
#   bash benchmarks/results/h100_s14/next_varlen.sh tests|attn|dense|hybrid
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-}
case "${1:?tests|attn|dense|hybrid}" in
  tests)  # exactness against a float64 oracle (incl. head dim 256) and a compiled model vs the flex lowering
    timeout 400 python -m pytest -q -m gpu tests/test_varlen_tree_attention.py -p no:cacheprovider -rfEs \
      > $OUT/varlen_tests.txt 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/varlen_tests.txt | tail -20 ;;
  attn)  # the kernel against the block-sparse FA4 and the baselines' attention on the end-to-end trees
    timeout 500 python benchmarks/bench_fa4_attention.py --sizes "" --deep deep-16k \
      --harness 32x2048@0.5,16x2048@0.5,32x2048@0.75,64x2048@0.5 --contenders fa4_flex,fa4_varlen,paths_fa4_varlen \
      --out $OUT/attn_varlen > $OUT/attn_varlen_log.txt 2>&1; echo "rc=$?"
    grep -v -i warn $OUT/attn_varlen_log.txt | grep -E "^\||rror" | cut -c1-420 | tail -n 30 ;;
  dense)  # end to end, each contender in its own process (compare with tree 0.445 / packed 0.629 s, 0.6B)
    timeout 580 python -m benchmarks.harness --model qwen3-0.6b --suite sweep --por 0.5 --paths 32 --path-len 2048 \
      --contenders tree_fa4_varlen --iters 3 --child-timeout-s 560 --out $OUT/varlen_0.6b > $OUT/varlen_0.6b_log.txt 2>&1
    echo "rc=$?"; python benchmarks/results/h100_s14/show.py | grep -v "^|" ;;
  hybrid)  # the hybrid's head-dim-256 attention on FA4 varlen instead of flex (issue 17; packed 0.516 s, tree 0.416 s)
    timeout 580 python -m benchmarks.harness --model qwen3.5-hybrid-0.8b --suite sweep --por 0.5 --paths 16 \
      --path-len 2048 --contenders tree_fa4_varlen --iters 3 --child-timeout-s 560 --out $OUT/varlen_hybrid \
      > $OUT/varlen_hybrid_log.txt 2>&1; echo "rc=$?"; python benchmarks/results/h100_s14/show.py | grep -v "^|" ;;
esac
