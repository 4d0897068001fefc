# Session 43: how many key rows the varlen segment plan gathers (G) on the harness trees, and how many it would
# gather with the tree's shared prefix attended as one full block in place (queries [end of segment 0, T) against
# keys [0, K), K = the shortest prefix of segment 0 that another segment sees).  PYTHONPATH=. python <this file>
from benchmarks.harness import agentic_cases, synthetic_cases
from treecompile.ops import varlen_tree_attention as va
from treecompile.tree import Tree

for c in agentic_cases(1.0, 150000) + synthetic_cases([0.5, 0.75], 16, 2048, 150000):
    t = Tree.from_paths([list(p) for p in c.paths])
    w = va._walk(t.subtree_end)
    T = w.se.numel()
    seen = []  # for each segment under segment 0: how many of segment 0's tokens it sees
    for j in range(1, w.n_main):
        i, p = j, None
        while w.parents[i] is not None:
            i, p = w.parents[i]
        if i == 0 and p is not None:
            seen.append(p)
    K = min(seen) if seen else 0
    G_block = w.gathered - K * len(seen)
    print(f"{c.name:26s} T={T:6d} G={w.gathered:7d} ({w.gathered / T:5.2f} T)  K={K:5d} x {len(seen):2d} segments  "
          f"G with the block={G_block:7d} ({G_block / T:5.2f} T)")
