# Session 44: the varlen plan's walk (_walk: bounds check, segments, their parents and prefix lengths) on one CPU thread,
# a wide synthetic tree and two deep trees of short nodes.  PYTHONPATH=. python benchmarks/results/cpu_s44/walk.py
import time, torch, sys

from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta
from benchmarks.trees import synthetic_paths
torch.set_num_threads(1)
import random
def deep(levels, leaves, node):
    random.seed(0); spine = []; paths = []; nxt = iter(range(10**7))
    for l in range(levels):
        spine = spine + [next(nxt) for _ in range(node)]
        paths += [spine + [next(nxt) for _ in range(node)] for _ in range(leaves)]
    return paths + [spine]
for name, paths in [("syn64", synthetic_paths(64, 2048, 0.5, seed=0)), ("deep 100x3x20", deep(100, 3, 20)), ("deep 400x2x16", deep(400, 2, 16))]:
    se = Tree.from_paths(paths).to_batch().subtree_end
    for _ in range(3): w = vta._walk(se)
    ts = []
    for _ in range(30):
        t0 = time.perf_counter(); vta._walk(se); ts.append(time.perf_counter() - t0)
    ts.sort(); print(name, "T", se.numel(), "segments", len(w.starts), "walk ms", round(ts[15] * 1e3, 3))
