# Session 47: the varlen segment plan's host time (tree_attention_plan on a CPU subtree_end, walk included) on one
# CPU thread, for P x 2,048-token paths at POR 0.5 (trees built heaviest child first, the default), median of 200
# builds after 10, each on a fresh clone (no cached walk).  Run from a checkout's root:
#   PYTHONPATH=. python benchmarks/results/cpu_s47/probe_plan.py P [P ...]
import sys, time, torch
from benchmarks.trees import synthetic_paths
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta

torch.set_num_threads(1)
for P in map(int, sys.argv[1:] or ["64"]):
    se = Tree.from_paths(synthetic_paths(P, 2048, 0.5, seed=0)).to_batch().subtree_end
    ses = [se.clone() for _ in range(210)]
    ts = []
    for i, s in enumerate(ses):
        t0 = time.perf_counter()
        vta.tree_attention_plan(s, block_sparse=False)
        ts.append(time.perf_counter() - t0)
    ts = sorted(ts[10:])
    print(f"T {se.numel():6d}  plan ms median {ts[len(ts) // 2] * 1e3:.3f}  min {ts[0] * 1e3:.3f}")
