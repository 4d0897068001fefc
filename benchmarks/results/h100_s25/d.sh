# session 25 device calls (one H100); every call sources session 18's pre.sh (install parts, kernel caches)
#   bash d.sh install                 nothing more (the install calls)
#   bash d.sh dense TREE SCALE        qwen3-0.6b on one agentic tree: packed FA4 varlen (pack_plan) and tree
#   bash d.sh prof MODEL [ARGS...]    benchmarks.prof_step (kernels by kind, the GPU's idle gaps by host event)
#   bash d.sh e2e MODEL [ARGS...]     benchmarks.harness with ARGS (tree, contenders, capacity...)
#   bash d.sh ab MODEL [ARGS...]      prof_step through ab.py (NO_HOST_VALUES=1: plans read the tree back from the GPU)
#   bash d.sh gputests FILES...       pytest -m gpu FILES
#   bash d.sh head                    results/h100_s25/head_kept.py (the head chunked vs kept)
#   bash d.sh dw                      results/h100_s25/dw.py (the kept head's dW GEMM: layouts and output dtypes)
#   bash d.sh kcpack                  the kernel caches as parts in $OUT (carry them in .kc/ next time)
source benchmarks/results/h100_s18/pre.sh
set -o pipefail
F='warn\|aux_data\|exe_args\|TileLang'
mode=$1; shift
case "$mode" in
install) ;;
dense)
  N=dense_$1_$2
  timeout 570 python -m benchmarks.harness --model qwen3-0.6b --suite agentic --agentic $1 --agentic-scale $2 \
    --contenders packed_fa4_varlen tree --iters 3 --child-timeout-s 280 --out $OUT/$N 2>&1 | grep -v -i "$F" \
    | tee $OUT/${N}_log.txt | tail -8 ;;
prof)
  M=$1; shift
  N=prof_${M}_$(echo "$@" | tr -c 'a-zA-Z0-9.\n' '_')
  timeout 570 python -m benchmarks.prof_step --model $M "$@" 2>&1 | grep -v -i "$F" | tee $OUT/${N}.txt | tail -60 ;;
e2e)
  M=$1; shift
  N=e2e_${M}_$(date +%H%M%S)
  timeout 570 python -m benchmarks.harness --model $M --iters 3 --out $OUT/$N "$@" 2>&1 | grep -v -i "$F" \
    | tee $OUT/${N}_log.txt | tail -8 ;;
ab)
  M=$1; shift
  N=ab${NO_HOST_VALUES:-0}_${M}_$(echo "$@" | tr -c 'a-zA-Z0-9.\n' '_')
  timeout 570 python benchmarks/results/h100_s24/ab.py --model $M "$@" 2>&1 | grep -v -i "$F" | tee $OUT/${N}.txt | tail -45 ;;
gputests)
  timeout 570 python -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee $OUT/gputests.txt | tail -30 ;;
head)
  timeout 570 python benchmarks/results/h100_s25/head_kept.py 2>&1 | tee $OUT/head_kept.txt | tail -20 ;;
dw)
  timeout 570 python benchmarks/results/h100_s25/dw.py 2>&1 | tee $OUT/dw.txt | tail -20 ;;
kcpack) source benchmarks/results/h100_s18/kc_pack.sh ;;
esac
