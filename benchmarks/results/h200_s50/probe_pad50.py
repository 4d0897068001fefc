# Session 50, after the lease's other calls: the varlen plan's host time for CUDA batches (h200_s47/probe_plan.py's
# measurement: moved with their host values, one intra-op thread, median of 200 builds after 10, each on a fresh
# tensor) with this checkout's module, on 64 x 2,048 POR 0.5, 56 x 2,048 padded to 64k (8,192 tokens that see only
# themselves: a length bucket's tail), parallel-tools and deep-agent; two rounds.  PYTHONPATH=. python probe_pad50.py
import torch
from benchmarks.results.h200_s50.probe_agentic import plan_ms
from benchmarks.trees import agentic_paths, agentic_specs, synthetic_paths
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta

torch.set_num_threads(1)
trees = [("64 x 2048", synthetic_paths(64, 2048, 0.5, seed=0)), ("56 x 2048 + 8k pad", synthetic_paths(56, 2048, 0.5, seed=0))]
trees += [(s.name, agentic_paths(s)) for s in agentic_specs(1.0, ["parallel-tools", "deep-agent"])]
for rnd in range(2):
    for name, paths in trees:
        se = Tree.from_paths(paths).to_batch().subtree_end
        if "pad" in name:
            se = torch.cat([se, torch.arange(se.numel() + 1, 65537)])
        med, low = plan_ms(vta, se)
        print(f"round {rnd} {name:18s} T {se.numel():6d}  plan ms median {med:.3f}  min {low:.3f}", flush=True)
