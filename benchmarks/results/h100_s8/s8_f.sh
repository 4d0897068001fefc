source .gpuwork/pre.sh
timeout 250 python -m benchmarks.hybrid_bench --out $OUT/layer --case both --skip-harness --iters 5 > $OUT/layer_log.txt 2>&1; echo rc=$?
grep -v -i warn $OUT/layer_log.txt | tail -30 | cut -c1-400
timeout 320 python .gpuwork/prof_hybrid.py > $OUT/prof_log.txt 2>&1; echo rc=$?
grep -E "^tree|^packed|index_add|indexFunc|gather|aten::index" $OUT/prof_log.txt | cut -c1-200
