# usage: MODEL=qwen3-0.6b SUITE=agentic|sweep PATHS=32 CONTENDERS="tree packed_fa4_varlen" T=580 CT=280 bash b.sh
source benchmarks/results/h100_s18/pre.sh
set -o pipefail
M=${MODEL:-qwen3.5-hybrid-0.8b}
if [ "${SUITE:-sweep}" = agentic ]; then A="--suite agentic --agentic parallel-tools --agentic-scale 1.5"; N=agentic
else A="--suite sweep --por 0.5 --paths ${PATHS:-32} --path-len 2048"; N=syn${PATHS:-32}; fi
N=${M}_${N}_$(echo ${CONTENDERS:-tree} | tr ' ' '-')
timeout ${T:-580} python -m benchmarks.harness --model $M $A --contenders ${CONTENDERS:-tree} \
  --iters 3 --child-timeout-s ${CT:-400} --out $OUT/$N 2>&1 | grep -v -i "warn\|aux_data\|exe_args\|TileLang" | tee $OUT/${N}_log.txt | tail -25
