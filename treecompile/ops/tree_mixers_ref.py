"""CPU references for :mod:`treecompile.ops.tree_mixers`, one token at a time.

Each function walks every token's path explicitly (``pred_index`` up to the root) and applies the
plain-sequence op (``torch.cumsum``...) to the path, so they state the semantics with no tree
cleverness: slow (O(T * depth)), differentiable, for tests in float64.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["path_of", "tree_ancestors_reference", "tree_scan_reference", "tree_shift_reference"]


def path_of(pred_index: Tensor, t: int) -> list[int]:
    """DFS indices of t's path, root first, t last."""
    out = []
    while t >= 0:
        out.append(t)
        t = int(pred_index[t])
    return out[::-1]


def tree_ancestors_reference(pred_index: Tensor, n: int, step: int = 1) -> Tensor:
    out = torch.full((pred_index.numel(), n), -1, dtype=torch.long)
    for t in range(pred_index.numel()):
        path = path_of(pred_index, t)
        for j in range(n):
            i = len(path) - 1 - (j + 1) * step
            if i >= 0:
                out[t, j] = path[i]
    return out


def tree_shift_reference(x: Tensor, pred_index: Tensor, k: int, dim: int) -> Tensor:
    xd = x.movedim(dim, 0)
    rows = []
    for t in range(xd.shape[0]):
        path = path_of(pred_index, t)
        rows.append(xd[path[-1 - k]] if len(path) > k else torch.zeros_like(xd[t]))
    return torch.stack(rows).movedim(0, dim)


def tree_scan_reference(x: Tensor, pred_index: Tensor, dim: int, op: str) -> Tensor:
    fn = {"sum": torch.cumsum, "prod": torch.cumprod, "logsumexp": torch.logcumsumexp}[op]
    xd = x.movedim(dim, 0)
    rows = [fn(xd[path_of(pred_index, t)], 0)[-1] for t in range(xd.shape[0])]
    return torch.stack(rows).movedim(0, dim)
