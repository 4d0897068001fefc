"""MoE router auxiliary losses on a tree: load balancing (Switch / HF ``load_balancing_loss_func``)
and router z-loss, with the statistics a per-path or a packed computation would take.

Per-path (or packed) training computes, over a set S of token rows (one path, or all rows of a packed
batch), with ``L`` MoE layers, ``E`` experts, ``top_k`` routed experts per token and
``p_l(t) = softmax(router_logits_l[t])``:

    f_e = sum_l sum_{t in S} [e in topk(p_l(t))] / (L |S|)      (fraction of routed slots; no gradient)
    P_e = sum_l sum_{t in S} p_l(t)_e / (L |S|)                  (mean router probability)
    aux(S) = E * sum_e f_e P_e                                   (HF sums over layers before the product)
    z(S) = sum_l sum_{t in S} logsumexp(router_logits_l[t])^2 / (L |S|)

On a tree each unique token is one row, so both need per-token sums weighted by how often the set
counts the token.  Two semantics (the caller chooses; neither is a default):

- ``"batch"``: S = all path tokens of the batch, each token counted once per path through it
  (``share_count``): the statistics sequence packing computes over the same paths;
- ``"path"``: each path's own ``aux(p)`` and ``z(p)``, combined as ``sum_p path_coef[p] * aux(p)``.
  The per-path sums are sums over the path's tokens = its ancestors-or-self in the tree: with
  ``D[t] += x[t]``, ``D[subtree_end[t]] -= x[t]``, ``cumsum(D)[t]`` is the sum of ``x`` over t's
  ancestors-or-self (t's visible keys in DFS order), read at each path's last token.

Shapes: ``router_logits`` a sequence of ``[T, E]`` (one per MoE layer, rows = the batch's real tokens in
DFS order); ``share_count [T]``; ``subtree_end [T]``, ``path_end [P]`` (DFS index of each path's last
token) and ``path_coef [P]``.  Everything is accumulated in float64.  Plain torch, differentiable in the
router logits (the top-k assignment is a constant, as in HF).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from treecompile.host_values import to_device

__all__ = ["SEMANTICS", "router_statistics", "load_balancing_loss", "router_z_loss", "ancestor_sums"]

SEMANTICS = ("batch", "path")


def router_statistics(router_logits: Sequence[Tensor], top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per token, summed over layers (float64 ``[T, E]``, ``[T, E]``, ``[T]``): router probabilities
    (softmax in the logits' dtype, as HF), top-k assignment counts, and ``logsumexp(logits)^2``."""
    if not router_logits:
        raise ValueError("router_logits: no MoE layer")
    T, E = router_logits[0].shape
    probs = torch.zeros(T, E, dtype=torch.float64, device=router_logits[0].device)
    counts = torch.zeros(T, E, dtype=torch.float64, device=router_logits[0].device)
    z = torch.zeros(T, dtype=torch.float64, device=router_logits[0].device)
    for i, rl in enumerate(router_logits):
        if rl.dim() != 2 or rl.shape != (T, E):
            raise ValueError(f"router_logits[{i}]: expected [{T}, {E}], got {tuple(rl.shape)}")
        p = torch.softmax(rl, dim=-1)
        sel = torch.topk(p, top_k, dim=-1).indices
        probs = probs + p.to(torch.float64)
        counts = counts.scatter_add(1, sel, torch.ones(sel.shape, dtype=torch.float64, device=sel.device))
        z = z + torch.logsumexp(rl.to(torch.float64), -1) ** 2
    return probs, counts, z


def ancestor_sums(x: Tensor, subtree_end: Tensor) -> Tensor:
    """``out[t] = sum of x[a] over t's ancestors-or-self a`` (``a <= t < subtree_end[a]``), for
    ``x [T, ...]`` in DFS order; differentiable."""
    T = x.shape[0]
    d = x.new_zeros((T + 1, *x.shape[1:]))
    d = d.index_add(0, torch.arange(T, device=x.device), x).index_add(0, to_device(subtree_end, x.device), -x)
    return torch.cumsum(d, 0)[:T]


def _check(semantics, T, share_count, subtree_end, path_end, path_coef):
    if semantics == "batch":
        if share_count is None or share_count.shape != (T,):
            raise ValueError(f"semantics='batch' needs share_count [{T}]")
    elif semantics == "path":
        if subtree_end is None or subtree_end.shape != (T,) or path_end is None or path_coef is None \
                or path_end.shape != path_coef.shape or path_end.dim() != 1:
            raise ValueError(f"semantics='path' needs subtree_end [{T}], path_end [P] and path_coef [P]")
    else:
        raise ValueError(f"semantics: expected one of {SEMANTICS}, got {semantics!r}")


def load_balancing_loss(probs: Tensor, counts: Tensor, *, num_layers: int, semantics: str,
                        share_count: Tensor | None = None, subtree_end: Tensor | None = None,
                        path_end: Tensor | None = None, path_coef: Tensor | None = None) -> Tensor:
    """``aux`` of the module docstring from :func:`router_statistics`' ``probs`` and ``counts``."""
    T, E = probs.shape
    _check(semantics, T, share_count, subtree_end, path_end, path_coef)
    if semantics == "batch":
        n = to_device(share_count, probs.device, torch.float64)
        rows = num_layers * n.sum()
        f = (n[:, None] * counts).sum(0) / rows
        P = (n[:, None] * probs).sum(0) / rows
        return E * (f * P).sum()
    end, subtree_end = to_device(path_end, probs.device), to_device(subtree_end, probs.device)
    length = (ancestor_sums(torch.ones(T, dtype=torch.float64, device=probs.device), subtree_end)[end]) * num_layers
    f = ancestor_sums(counts, subtree_end)[end] / length[:, None]  # [P, E]
    P = ancestor_sums(probs, subtree_end)[end] / length[:, None]
    return (to_device(path_coef, probs.device, torch.float64) * E * (f * P).sum(-1)).sum()


def router_z_loss(z: Tensor, *, num_layers: int, semantics: str, share_count: Tensor | None = None,
                  subtree_end: Tensor | None = None, path_end: Tensor | None = None,
                  path_coef: Tensor | None = None) -> Tensor:
    """``z`` of the module docstring from :func:`router_statistics`' per-token ``z``."""
    T = z.shape[0]
    _check(semantics, T, share_count, subtree_end, path_end, path_coef)
    if semantics == "batch":
        n = to_device(share_count, z.device, torch.float64)
        return (n * z).sum() / (num_layers * n.sum())
    end, subtree_end = to_device(path_end, z.device), to_device(subtree_end, z.device)
    length = ancestor_sums(torch.ones(T, dtype=torch.float64, device=z.device), subtree_end)[end] * num_layers
    return (to_device(path_coef, z.device, torch.float64) * ancestor_sums(z, subtree_end)[end] / length).sum()
