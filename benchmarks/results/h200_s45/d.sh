# session 45 device calls (one H200 per lease): session 44's modes, and the runs session 44 left
#   bash d.sh cgtest          the CUDA graphs' and the deep tree's deterministic GPU tests ($OUT/cg45_test.txt)
#   bash d.sh cgprof          prof_step of `tree` against `tree_cudagraphs` on the agentic tree, with inductor's log
#                             of what it captured and where it partitioned ($OUT/k45_cg.txt)
#   bash d.sh cgdiag          cg_diag.py: the CUDA graphs' test with its generated modules kept, then with inductor's
#                             slow-path pool assertion off ($OUT/cgdiag.txt, $OUT/code)
#   bash d.sh detprof         prof_step of `tree` against `tree_deterministic` on the agentic tree, with the host
#                             ops of most self time ($OUT/k45_det.txt)
#   bash d.sh gpuall          pytest -m gpu over every test file, FA4 installed, GDN's extras not ($OUT/gpuall.txt)
#   bash d.sh rows46 N        left for session 46: the end-to-end rows not re-measured since their sessions, fastest
#                             baseline and `tree` in one process, one row per call (N = 1..4, $OUT/r46_N.txt):
#                             1 0.6B 32 x 2,048 (32k), 2 1.7B 32 x 2,048, 3 4B 16 x 2,048 (16k, the 32k row's 4B at
#                             half the tokens, which fits one call), 4 the 4-layer 30B-A3B MoE at 16k
#   bash d.sh hf46            left for session 46: the block-sparse plan in the heaviest-child-first order. Its GPU
#                             oracle tests, then bench_fa4_attention's fa4_varlen against fa4_varlen_heavy_first on
#                             the deep agentic trees and POR 0.9 ($OUT/hf46_test.txt, $OUT/hf46_log.txt, $OUT/attn)
#   bash d.sh hfprof46        deep-agent, `tree` against `tree_block_sparse_heavy_first` ($OUT/r46_hf.txt)
#   bash d.sh MODE ...        any other mode: h200_s44/d.sh MODE ... (install, seq, gpu43, attn43, prof)
mode=$1
if [ "$mode" = cgtest ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-240} python -m pytest -m gpu -v -p no:cacheprovider tests/test_varlen_tree_attention.py \
    -k "${K:-cudagraphs or deep_tree_on_its_segments}" -W ignore 2>&1 | grep -v "torch.__trace" \
    | tee $OUT/cg45_test.txt | tail -40
elif [ "$mode" = cgprof ]; then
  TORCH_LOGS=cudagraphs,perf_hints bash benchmarks/results/h200_s40/d.sh prof k45_cg ${T:-500} --model qwen3-0.6b \
    --agentic parallel-tools --contenders tree tree_cudagraphs --iters 10
elif [ "$mode" = cgdiag ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-300} python benchmarks/results/h200_s45/cg_diag.py 2>&1 | grep -v "torch.__trace" \
    | tee $OUT/cgdiag.txt | tail -40
elif [ "$mode" = detprof ]; then
  bash benchmarks/results/h200_s40/d.sh prof k45_det ${T:-400} --model qwen3-0.6b --agentic parallel-tools \
    --contenders tree tree_deterministic --iters 10 --host-top 25
elif [ "$mode" = gpuall ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-540} python -m pytest -m gpu -q -p no:cacheprovider tests -W ignore --durations=25 -rs 2>&1 \
    | grep -v "torch.__trace" | tee $OUT/gpuall.txt | tail -60
elif [ "$mode" = rows46 ]; then
  case $2 in
    1) A="--model qwen3-0.6b --paths 32";; 2) A="--model qwen3-1.7b --paths 32";;
    3) A="--model qwen3-4b --paths 16";; 4) A="--model qwen3-30b-a3b-4l --paths 16";;
    *) echo "rows46: N = 1..4"; exit 2;;
  esac
  bash benchmarks/results/h200_s40/d.sh prof r46_$2 ${T:-560} $A --contenders packed_fa4_varlen tree --iters 10
elif [ "$mode" = hf46 ]; then
  source benchmarks/results/h100_s18/pre.sh
  timeout ${T:-150} python -m pytest -m gpu -q -p no:cacheprovider tests/test_varlen_tree_attention.py \
    -k "fp64_oracle and block_sparse" -W ignore 2>&1 | grep -v "torch.__trace" | tee $OUT/hf46_test.txt | tail -5
  timeout ${T2:-400} python benchmarks/bench_fa4_attention.py --sizes 32768,65536 --pors 0.9 --deep deep-16k,deep-32k \
    --agentic deep-agent --contenders fa4_varlen,fa4_varlen_heavy_first --out $OUT/attn 2>&1 \
    | grep -v -i 'warn\|aux_data\|exe_args\|TileLang' | tee $OUT/hf46_log.txt | tail -30
elif [ "$mode" = hfprof46 ]; then
  bash benchmarks/results/h200_s40/d.sh prof r46_hf ${T:-560} --model qwen3-0.6b --agentic deep-agent \
    --contenders tree tree_block_sparse_heavy_first --iters 10
else
  bash benchmarks/results/h200_s44/d.sh "$@"
fi
