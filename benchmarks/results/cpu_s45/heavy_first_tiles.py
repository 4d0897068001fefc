# Session 45: the varlen op's block-sparse plan in the batch's DFS order against the heaviest-child-first order
# (varlen_tree_attention.BLOCK_SPARSE_LAYOUT) on the agentic trees: 128 x 128 tiles of the tree mask (full, partial,
# computed area and partial area over the mask's entries), the segments' gather G / T (the same: which child goes
# first does not change a segment's prefix), then the host time the order adds to a block-sparse plan on one thread
# of this CPU (heavy_first_order + permuted_subtree_end; the BlockMask is built on CUDA only).
#   PYTHONPATH=. python benchmarks/results/cpu_s45/heavy_first_tiles.py
import time

import torch

from benchmarks.trees import agentic_paths, agentic_specs, synthetic_paths
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta
from treecompile.ops.flex_tree_attention import tree_block_mask
from treecompile.ops.tree_layout import heavy_first_order, permuted_subtree_end

torch.set_num_threads(1)
cases = [(spec.name, agentic_paths(spec)) for spec in agentic_specs(1.0)]
cases.append(("syn 64 x 2,048 POR 0.9", synthetic_paths(64, 2048, 0.9, seed=0)))
for name, paths in cases:
    se = Tree.from_paths(paths).to_batch().subtree_end
    T = se.numel()
    nnz = int((se - torch.arange(T)).sum())
    order = heavy_first_order(se)
    for layout, s in (("dfs", se), ("heavy", permuted_subtree_end(se, order))):
        bm = tree_block_mask(s, block_size=(128, 128))
        full, part = int(bm.full_kv_num_blocks.sum()), int(bm.kv_num_blocks.sum())
        w = vta._walk(s)
        print(f"{name:22s} {layout:5s} T {T:6d} full {full:6d} partial {part:5d} computed/nnz "
              f"{(full + part) * 16384 / nnz:.3f} partial/nnz {part * 16384 / nnz:.3f} G/T {w.gathered / T:5.2f}")
    w = vta._walk(se)
    if w.gathered > vta.VARLEN_GATHER_LIMIT * T:
        for layout in ("dfs", "heavy_first"):
            vta.BLOCK_SPARSE_LAYOUT = layout
            ts = []
            for _ in range(12):
                t0 = time.perf_counter()
                vta._block_sparse_plan(se, w)
                ts.append(time.perf_counter() - t0)
            print(f"{name:22s} block-sparse plan, {layout:11s} order: {sorted(ts)[6] * 1e3:.3f} ms host (CPU plan)")
        vta.BLOCK_SPARSE_LAYOUT = "dfs"
