source .gpuwork/pre.sh
timeout 400 python -m pytest -q -m gpu tests/test_tree_gdn.py tests/test_hybrid_model.py tests/test_redundancy_free.py tests/test_compile_hybrid.py -p no:cacheprovider -rfEs > $OUT/b_tests.txt 2>&1; echo rc=$?
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" $OUT/b_tests.txt | cut -c1-300 | tail -20
