"""Session 20: where the varlen tree attention's fwd+bwd goes on the 32k harness tree (kernel table per variant).

python benchmarks/results/h100_s20/prof_attn.py [--shape 16:8:128] [--tree 32x2048@0.5]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench_fa4_attention as b  # noqa: E402
from trees import harness_tree_paths  # noqa: E402

from treecompile import Tree  # noqa: E402
from treecompile.ops.varlen_tree_attention import tree_attention_varlen  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="16:8:128")
ap.add_argument("--tree", default="32x2048@0.5")
a = ap.parse_args()
b.set_shape(*(int(x) for x in a.shape.split(":")))
tree = Tree.from_paths(harness_tree_paths(a.tree))
se = tree.to_batch(pad_to_multiple=128, device="cuda").subtree_end
q, k, v, do = b.inputs(se.numel(), seed=0)
view = lambda x: x.transpose(1, 2)  # noqa: E731


def step():
    tree_attention_varlen(view(q), view(k), view(v), se).backward(do)
    q.grad = k.grad = v.grad = None


for name, wrap in (("key_copies", lambda f: f()), ("index_add", lambda f: b.index_add_sums(f))):
    for _ in range(3):
        wrap(step)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            wrap(step)
        torch.cuda.synchronize()
    print(f"== {name}: {a.tree} shape {a.shape}, 5 steps (times are totals over the 5)")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
