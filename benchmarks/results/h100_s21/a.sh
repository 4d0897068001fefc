# session 21, first machine: host profiles (cProfile) of the hybrid tree step and of one levelled GDN layer
source benchmarks/results/h100_s18/pre.sh
R=benchmarks/results/h100_s21
timeout 200 python $R/host_prof.py agentic layer 2>&1 | grep -v -i "warn" > $OUT/layer_agentic.txt; head -c 9000 $OUT/layer_agentic.txt
timeout 330 python $R/host_prof.py agentic step 2>&1 | grep -v -i "warn\|aux_data\|exe_args\|TileLang" > $OUT/step_agentic.txt; head -c 2500 $OUT/step_agentic.txt
