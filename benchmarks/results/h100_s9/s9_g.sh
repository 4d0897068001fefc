source .gpuwork/pre.sh
timeout 560 python .gpuwork/hyb_cost.py > $OUT/hyb_cost_log.txt 2>&1; echo rc=$?
grep -E "^first_s|^\{" $OUT/hyb_cost_log.txt | cut -c1-300; tail -3 $OUT/hyb_cost_log.txt | cut -c1-300
