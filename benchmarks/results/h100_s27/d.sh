# session 27 device calls (one H100). Modes of its own:
#   bash d.sh cg [ARGS...]     results/h100_s27/cg.py (the tree step, CUDA graphs between treecompile's ops)
#   bash d.sh cgab [ARGS...]   cg.py without, then with --cuda-graphs, one process each
#   bash d.sh moeab OPT...     cg.py on the 4-layer MoE hybrid's agentic tree (parallel-tools @1.5), once per OPT
#                              (e.g. "" or --torch-moe: the experts' elementwise work as torch ops), one process each
# every other mode is session 26's d.sh (-> 25 -> 24: install, e2e, prof, gputests, ...), run as it is
case "$1" in
cg)
  shift
  source benchmarks/results/h100_s18/pre.sh
  N=cg_$(echo "$@" | tr -c 'a-zA-Z0-9.\n' '_')
  timeout 570 python benchmarks/results/h100_s27/cg.py "$@" 2>&1 | grep -v -i 'aux_data\|exe_args\|TileLang' \
    | tee $OUT/$N.txt | tail -60 ;;
cgab)
  shift
  source benchmarks/results/h100_s18/pre.sh
  for o in "" --cuda-graphs; do
    timeout 280 python benchmarks/results/h100_s27/cg.py $o "$@" 2>&1 | grep -v -i 'aux_data\|exe_args\|TileLang' \
      | tee -a $OUT/cgab.txt | grep '^{\|^#\|Error\|error\|skipping' | tail -20
  done ;;
moeab)
  shift
  source benchmarks/results/h100_s18/pre.sh
  for o in "$@"; do
    timeout 280 python benchmarks/results/h100_s27/cg.py --model qwen3.5-35b-a3b-4l --agentic-scale 1.5 --iters 20 $o \
      2>&1 | grep -v -i 'aux_data\|exe_args\|TileLang' | tee -a $OUT/moeab.txt | grep '^{\|Error' | tail -5
  done ;;
*) exec bash benchmarks/results/h100_s26/d.sh "$@" ;;
esac
