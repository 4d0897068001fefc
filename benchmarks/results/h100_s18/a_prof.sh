source benchmarks/results/h100_s18/pre.sh >/dev/null
set -o pipefail
timeout ${PROF_TIMEOUT:-540} python benchmarks/results/h100_s18/agentic_prof.py ${CASE:-agentic} 2>&1 | tee $OUT/prof_${CASE:-agentic}_log.txt | grep -v "^ " | head -5
tail -90 $OUT/prof_${CASE:-agentic}_log.txt
