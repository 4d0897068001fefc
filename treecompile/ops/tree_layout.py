"""Tile-friendly token order for tree attention: the same tree, its children visited heaviest first.

Tree attention only needs *a* DFS order: in any DFS order the queries that see a key form one
contiguous interval (the key's subtree), so the interval BlockMask of ``flex_tree_attention`` applies.
The order the children of a node are visited in is free, and it decides how many 128x128 tiles are
partial (evaluate the mask_mod on every entry) rather than full or empty:

* a kv block that straddles the end of a node ``p`` and the start of its first visited child ``c`` is
  seen partially by every query block of ``p``'s *later* children (they see ``p``, not ``c``);
* so the child visited first should be the one whose siblings' subtrees are small, i.e. the heaviest
  child (largest subtree) first, the light ones (a dropped reasoning turn, a short tool branch) after.

On deep agentic trees (50+ levels, ~90-token nodes, a light leaf hanging off every spine node) a
lexicographic DFS order (``Tree.from_paths(order="lex")``) visits children in token-sort order, which puts a
leaf before the spine's next node about half of the time: 71 % of the non-empty tiles are partial.
Heaviest-first takes that to 13-14 % and the computed tiles down by 27-29 % (``benchmarks/tile_cost_model.py``,
benchmarks/results/HISTORY.md).  ``Tree.from_paths`` builds this order itself by default (since session 46), so
the reorder below only moves tokens of a batch serialised otherwise.

:func:`heavy_first_order` computes the permutation from ``subtree_end`` alone (the same input the
BlockMask is built from); :func:`permuted_subtree_end` gives the tree rule in the new order, and
:func:`reordered_attention` wraps an attention function so that the model keeps its own order: it gathers
``q, k, v`` into the new order, attends there, and gathers the output back (each gather's backward is the
inverse permutation's gather).  Exact: the new order is a permutation of keys and queries with the mask
permuted alike, so every output row is the same softmax over the same set of keys.

Shapes: ``subtree_end [T]``; ``order [2, T]`` int64, ``order[0][i]`` = the token at new position ``i``,
``order[1][t]`` = the new position of token ``t``.  This module knows tensors only.
"""

from __future__ import annotations

import torch

from treecompile.host_values import host_copy, repeat_counts, to_device_async
from treecompile.tree import heavy_first_starts

__all__ = ["heavy_first_order", "permuted_subtree_end", "reordered_attention"]


def _nodes(se: torch.Tensor):
    """Maximal runs of equal ``subtree_end`` (radix nodes; a single child merged with its parent,
    which sees and is seen alike): (start [N], end [N], subtree end [N]) as Python lists."""
    T = se.numel()
    cut = torch.ones(T, dtype=torch.bool)
    cut[1:] = se[1:] != se[:-1]
    start = torch.nonzero(cut).flatten()
    end = torch.cat([start[1:], start.new_tensor([T])])
    return start.tolist(), end.tolist(), se[start].tolist()


def heavy_first_order(subtree_end: torch.Tensor) -> torch.Tensor:
    """The DFS order of the same tree with every node's children (and the roots) visited largest subtree
    first, ties kept in the given order; ``[2, T]`` int64 on ``subtree_end``'s device (module docstring).

    ``subtree_end`` must be a valid DFS tree (``k < subtree_end[k] <= T``, intervals nested); padding
    tokens (``subtree_end[t] = t + 1``) are one-token roots and go last.  Host work O(T) tensor ops plus
    a Python loop over the nodes.
    """
    if subtree_end.dim() != 1 or subtree_end.numel() == 0:
        raise ValueError(f"subtree_end: expected a non-empty 1-D tensor [T], got shape {tuple(subtree_end.shape)}")
    dev = subtree_end.device
    se = host_copy(subtree_end).to(torch.int64)
    T = se.numel()
    start, end, sub = _nodes(se)
    N = len(start)
    parent = [-1] * N
    stack: list[int] = []
    for n in range(N):
        s = start[n]
        while stack and sub[stack[-1]] <= s:
            stack.pop()
        if stack:
            if sub[n] > sub[stack[-1]]:
                raise ValueError(f"subtree_end: token {s}'s interval [{s}, {sub[n]}) leaves its parent's "
                                 f"[{start[stack[-1]]}, {sub[stack[-1]]}): not a DFS tree")
            parent[n] = stack[-1]
        stack.append(n)
    ns = heavy_first_starts(torch.tensor(start), torch.tensor(end), torch.tensor(sub), torch.tensor(parent))
    length = torch.tensor(end) - torch.tensor(start)
    pos = repeat_counts(ns - torch.tensor(start), length, T) + torch.arange(T)  # new position of token t
    perm = torch.full_like(pos, -1)
    perm[pos] = torch.arange(T)  # the token at new position i
    if bool((perm < 0).any()):  # pos in [0, T) by construction; every position hit once <=> a permutation
        raise AssertionError("heavy_first_order: not a permutation (internal error)")
    return to_device_async(torch.stack([perm, pos]), dev)


def permuted_subtree_end(subtree_end: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``subtree_end`` of the reordered sequence: a DFS reorder keeps each token's subtree contiguous and
    of the same size, so the token at new position ``i`` ends at ``i + (se[t] - t)``, ``t = order[0][i]``."""
    perm = order[0]
    T = perm.numel()
    return torch.arange(T, device=perm.device, dtype=subtree_end.dtype) + (subtree_end[perm] - perm.to(subtree_end.dtype))


def reordered_attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, order: torch.Tensor, *,
                        dim: int = 2, **kwargs) -> torch.Tensor:
    """``attend(q', k', v', **kwargs)`` in the order ``order`` (:func:`heavy_first_order`), the output back
    in the caller's order.  ``dim``: the sequence dimension (2 for ``[B, H, T, D]``).  ``attend`` must use
    a mask of the reordered sequence (e.g. a BlockMask of :func:`permuted_subtree_end`)."""
    perm, pos = order[0], order[1]
    out = attend(*(_Permute.apply(x, dim, perm, pos) for x in (q, k, v)), **kwargs)
    return _Permute.apply(out, dim, pos, perm)


def _take(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(dim, index)`` keeping ``x``'s memory order when ``x`` is a ``[B, H, T, D]`` view of
    ``[B, T, H, D]`` storage (the model's layout: heads inside tokens), so the kernel sees the same strides."""
    if x.dim() == 4 and dim == 2 and x.stride(1) < x.stride(2):
        return x.transpose(1, 2).index_select(1, index).transpose(1, 2)
    return x.index_select(dim, index)


class _Permute(torch.autograd.Function):
    """``x`` reordered along ``dim`` by the permutation ``index`` (``inverse`` its inverse).  The backward
    is the inverse gather, not index_select's scatter-add (no zero fill, no atomics, deterministic)."""

    @staticmethod
    def forward(ctx, x, dim: int, index, inverse):
        ctx.dim = dim
        ctx.save_for_backward(inverse)
        return _take(x, dim, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return _take(grad, ctx.dim, inverse), None, None, None
