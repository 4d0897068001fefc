# session 21, first machine, second call: GC time and callers of the blocking calls in the hybrid tree step
source benchmarks/results/h100_s18/pre.sh
R=benchmarks/results/h100_s21
for c in agentic; do
timeout 280 python $R/host_prof.py $c step 2>&1 | grep -v -i "warn\|aux_data\|exe_args\|TileLang" > $OUT/step2_$c.txt; grep -E "^\{|first" $OUT/step2_$c.txt
mkdir -p $OUT/$c; mv $OUT/cprof_* $OUT/$c/
done
