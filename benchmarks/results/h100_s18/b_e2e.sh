# usage: SUITE=agentic|sweep CONTENDERS="tree tree_conv_fla" bash b_e2e.sh
source benchmarks/results/h100_s18/pre.sh
set -o pipefail
if [ "${SUITE:-agentic}" = agentic ]; then A="--suite agentic --agentic parallel-tools --agentic-scale 1.5"; N=agentic
else A="--suite sweep --por 0.5 --paths ${PATHS:-32} --path-len 2048"; N=syn${PATHS:-32}; fi
timeout ${T:-580} python -m benchmarks.harness --model qwen3.5-hybrid-0.8b $A --contenders ${CONTENDERS:-tree} \
  --iters 3 --child-timeout-s ${CT:-400} --out $OUT/h_$N 2>&1 | grep -v -i "warn\|aux_data\|exe_args\|TileLang" | tee $OUT/h_${N}_log.txt | tail -25
