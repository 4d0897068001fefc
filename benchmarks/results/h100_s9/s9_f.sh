source .gpuwork/pre.sh
timeout 560 python .gpuwork/prof_gdn_layer.py > $OUT/prof_gdn_log.txt 2>&1; echo rc=$?
grep -v -i "warn" $OUT/prof_gdn_log.txt | tail -90 | cut -c1-170
