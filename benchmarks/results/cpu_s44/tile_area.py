# Session 44: the tiles FA4's block-sparse plan computes on the agentic trees, at the 128 x 128 blocks it uses and at
# the 64 x 128 blocks its sm90 backward could take (its tile_m is 64 at head dim 128): full and partial tiles, and the
# computed area (full + partial tiles) and the masked area (partial tiles) over the tree's mask entries (nnz).
#   PYTHONPATH=. python benchmarks/results/cpu_s44/tile_area.py
import torch

from benchmarks.trees import agentic_paths, agentic_specs
from treecompile import Tree
from treecompile.ops.flex_tree_attention import tree_block_mask

for spec in agentic_specs(1.0):
    se = Tree.from_paths(agentic_paths(spec)).to_batch().subtree_end
    T = se.numel()
    nnz = int((se - torch.arange(T)).sum())
    for bs in ((128, 128), (64, 128)):
        bm = tree_block_mask(se, block_size=bs)
        full, part = int(bm.full_kv_num_blocks.sum()), int(bm.kv_num_blocks.sum())
        area = bs[0] * bs[1]
        print(f"{spec.name:15s} T {T:6d} blocks {bs[0]:3d}x{bs[1]}: full {full:6d} partial {part:5d} "
              f"computed/nnz {(full + part) * area / nnz:.3f} partial/nnz {part * area / nnz:.3f}")
