# Session 50: the varlen segment plan's host time (tree_attention_plan on a CPU subtree_end, walk included) on one
# CPU thread, median of 200 builds after 10, each on a fresh clone (no cached walk): for P x 2,048-token paths at
# POR 0.5 (trees built heaviest child first, the default), the agentic trees, and 56 x 2,048 padded to 64k (8,192
# tokens that see only themselves: a length bucket's padding).  "cpu": the plan of a CPU batch
# (its key index built on the host, O(G)); "cuda-host": the same with the key index not built, which is what a CUDA
# batch leaves on the host (there the index is four kernels on the GPU; the six tables cross in one copy, not
# counted here).  Run from a checkout's root (any revision: compare two by running it from both):
#   PYTHONPATH=. python benchmarks/results/cpu_s50/probe_plan.py [P ...]
import statistics, sys, time

import torch

from benchmarks.trees import agentic_paths, agentic_specs, synthetic_paths
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta

torch.set_num_threads(1)
vta.VERIFY_PLANS = False  # the run-time default (absent before session 50: the check always ran)
trees = [(f"{P} x 2048 POR 0.5", synthetic_paths(P, 2048, 0.5, seed=0)) for P in map(int, sys.argv[1:] or [16, 32, 64])]
trees += [(s.name, agentic_paths(s)) for s in agentic_specs(1.0, ["parallel-tools", "deep-agent"])]
trees += [("56 x 2048 + 8k pad", synthetic_paths(56, 2048, 0.5, seed=0))]  # padded to 64k below (a length bucket's tail)
real = vta._key_index_from
for name, paths in trees:
    se = Tree.from_paths(paths).to_batch().subtree_end
    if "pad" in name:
        se = torch.cat([se, torch.arange(se.numel() + 1, 65537)])  # tokens that see only themselves, to 65,536
    row = f"{name:18s} T {se.numel():6d}"
    for kind in ("cpu", "cuda-host"):
        vta._key_index_from = real if kind == "cpu" else (lambda at, by, G: at)
        ts = []
        for s in [se.clone() for _ in range(210)]:
            t0 = time.perf_counter()
            vta.tree_attention_plan(s, block_sparse=False)
            ts.append(time.perf_counter() - t0)
        row += f"  {kind} {statistics.median(ts[10:]) * 1e3:.3f} ms"
    print(row)
