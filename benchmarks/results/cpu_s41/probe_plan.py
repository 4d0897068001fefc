# Session 41: the varlen segment plan's host time (tree_attention_plan, walk included) on one CPU thread, for
# P x 2,048-token paths at POR 0.5.  PYTHONPATH=. python benchmarks/results/cpu_s41/probe_plan.py P [-p]
import time, sys, torch, cProfile, pstats
from benchmarks.trees import synthetic_paths
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta
torch.set_num_threads(1)
P = int(sys.argv[1]) if len(sys.argv) > 1 else 64
paths = synthetic_paths(P, 2048, 0.5, seed=0)
b = Tree.from_paths(paths).to_batch()
se = b.subtree_end
print("T", se.numel())
def build():
    vta._WALKS.clear() if hasattr(vta._WALKS, "clear") else None
    return vta.tree_attention_plan(se.clone(), block_sparse=False)
for _ in range(3): build()
ts = []
for _ in range(20):
    t0 = time.perf_counter(); build(); ts.append(time.perf_counter() - t0)
ts.sort(); print("plan ms median", ts[10] * 1e3, "min", ts[0] * 1e3)
if "-p" in sys.argv:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(20): build()
    pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(18)
