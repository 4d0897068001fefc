"""Exact optima of packed partitioning for small trees: the oracle that tests and
``benchmarks/bench_partition.py`` measure :func:`~treecompile.runtime.partition.pack`'s cost against.

A packed partition is prefix-closed; giving every leaf to one partition that holds it and shrinking
each partition to the union of its leaves' root paths never raises the cost (every token lies on
some leaf's path).  So the optimum is a grouping of the *leaves*: minimise
``sum over groups of |union of the group's root-to-leaf paths|`` subject to each union <= C.

Two formulations (our reading of the seed paper's appendix, which we could not retrieve; see
notes/partition.md):

- :func:`dp_single_path`: the leaves in one DFS order (the same sequence the heuristic walks) are cut
  into consecutive runs.  ``f[i] = min_j f[j] + union(leaves j..i-1)``, and in a DFS order
  ``union(j..i-1) = len_j + sum_{k=j+1}^{i-1} (len_k - lcp_k)``.  O(L^2).  Optimal among
  contiguous groupings of that order; the greedy heuristic is one such grouping.
- :func:`dp_multi_path`: any grouping of leaves.  Set-partition DP over leaf subsets,
  ``g[S] = min over feasible groups G containing S's lowest leaf of union(G) + g[S \\ G]``,
  O(3^L); refuses more than ``max_leaves`` leaves.
"""

from __future__ import annotations

from treecompile.runtime.partition import TreeShape, check_capacity, leaf_order
from treecompile.tree import Tree

__all__ = ["dp_single_path", "dp_multi_path", "leaf_groups_cost"]


def _check_fits(tree: Tree, C: int) -> None:
    longest = int(tree.path_lengths.max())
    if longest > C:
        p = int(tree.path_lengths.argmax())
        raise ValueError(f"path {p} has {longest} tokens, more than the budget C={C}")


def dp_single_path(tree: Tree, capacity: int, *, order: str = "deepest") -> int:
    """Minimum cost over cuts of the leaf sequence (``order`` as in :func:`pack`) into runs."""
    C = check_capacity(capacity)
    _check_fits(tree, C)
    sh = TreeShape(tree)
    leaves, lcps = leaf_order(sh, order)
    L = len(leaves)
    lens = [sh.leaf_len(n) for n in leaves]
    # S[k] = sum_{m<k} (len_m - lcp_m), so union(j..i-1) = len_j + S[i] - S[j+1]
    S = [0] * (L + 1)
    for k in range(L):
        S[k + 1] = S[k] + lens[k] - lcps[k]
    INF = float("inf")
    f = [0] + [INF] * L
    for i in range(1, L + 1):
        best = INF
        for j in range(i - 1, -1, -1):
            u = lens[j] + S[i] - S[j + 1]
            if u > C:
                break  # unions only grow as the run extends to the left
            if f[j] + u < best:
                best = f[j] + u
        f[i] = best
    return int(f[L])


def leaf_groups_cost(tree: Tree, groups) -> int:
    """Cost of a grouping of leaf nodes: sum over groups of the union of their ancestor nodes."""
    sh = TreeShape(tree)
    total = 0
    for g in groups:
        nodes = set()
        for leaf in g:
            nodes.update(sh.ancestors(leaf))
        total += sum(sh.end[a] - sh.start[a] for a in nodes)
    return total


def dp_multi_path(tree: Tree, capacity: int, *, max_leaves: int = 12) -> int:
    """Minimum cost over all groupings of the leaves (exact optimum of packed partitioning)."""
    C = check_capacity(capacity)
    _check_fits(tree, C)
    sh = TreeShape(tree)
    leaves = [n for n in range(sh.num_nodes) if sh.is_leaf(n)]
    L = len(leaves)
    if L > max_leaves:
        raise ValueError(f"dp_multi_path: the tree has {L} leaves, more than max_leaves={max_leaves} "
                         f"(the DP is O(3^L))")
    node_bit = [0] * L
    for i, leaf in enumerate(leaves):
        for a in sh.ancestors(leaf):
            node_bit[i] |= 1 << a
    node_len = [sh.end[a] - sh.start[a] for a in range(sh.num_nodes)]
    full = (1 << L) - 1
    union = [0] * (full + 1)  # union size of each subset of leaves
    cover = [0] * (full + 1)
    for m in range(1, full + 1):
        low = m & -m
        cover[m] = cover[m ^ low] | node_bit[low.bit_length() - 1]
        c, s = cover[m], 0
        while c:
            b = c & -c
            s += node_len[b.bit_length() - 1]
            c ^= b
        union[m] = s
    INF = float("inf")
    g = [INF] * (full + 1)
    g[0] = 0
    for m in range(1, full + 1):
        low = m & -m
        rest = m ^ low
        best = INF
        sub = rest
        while True:  # groups = low + any subset of the rest
            grp = sub | low
            u = union[grp]
            if u <= C:
                v = u + g[m ^ grp]
                if v < best:
                    best = v
            if sub == 0:
                break
            sub = (sub - 1) & rest
        g[m] = best
    return int(g[full])
