"""Path-level objectives (``SequenceClip``) on redundancy-free partitions, exactly.

A path-level loss ``L(lp)`` (e.g. ``exp`` of a per-path mean, clipped) is not a sum over tokens, and a
redundancy-free partition holds only pieces of paths.  But its gradient reaches the parameters only
through the per-token log-probs: ``dL/dtheta = sum_t g_t * dlp_t/dtheta`` with ``g = dL/dlp`` taken at
the step's log-probs.  A pre-pass (every partition's forward without gradient,
:func:`~treecompile.runtime.redundancy_free.prepass_redundancy_free`) gives those log-probs before any
backward; :func:`linearize` evaluates ``L`` and ``g`` on the whole tree from them, and each partition
then adds ``sum_t g_t * (lp_t - lp_t.detach())`` (value 0, gradient exactly its share of ``dL/dtheta``);
the step adds ``L``'s value once.  Exact when the training pass reproduces the pre-pass's log-probs
bit for bit (deterministic kernels); :meth:`Linearized.loss` checks it on every partition and raises
otherwise.  Cost: one extra forward without gradient per partition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from treecompile.host_values import host_copy
from treecompile.runtime.normalization import GlobalNorm, tree_batch
from treecompile.tree import Tree, TreeBatch

__all__ = ["Linearized", "linearize", "LogprobMismatchError"]


class LogprobMismatchError(RuntimeError):
    """A partition's log-probs differ from the pre-pass's (the linearization point)."""


@dataclass(frozen=True)
class Linearized:
    """``value``: the objectives' loss at the pre-pass log-probs; ``grad [T]`` (whole-tree DFS):
    its derivative in each token's log-prob; ``logprobs [T]``: the pre-pass log-probs."""

    value: float
    grad: torch.Tensor
    logprobs: torch.Tensor

    def loss(self, lp: torch.Tensor, batch: TreeBatch) -> torch.Tensor:
        """A partition's share (value 0, gradient exact): ``sum_t grad[t] * (lp_t - lp_t.detach())`` over
        its tokens (``batch.extras["tokens"]``), after checking that ``lp`` equals the pre-pass's."""
        n = batch.num_tokens
        tok = host_copy(batch.extras["tokens"])[:n]  # a moved batch's: its host values, no wait
        got = lp[:n].detach().to(torch.float64).cpu()
        bad = got != self.logprobs[tok]
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0])
            raise LogprobMismatchError(
                f"path-level objective on redundancy-free partitions: whole-tree token {int(tok[t])} has log-prob "
                f"{float(got[t])!r} here but {float(self.logprobs[tok[t]])!r} in the pre-pass: the forward is not "
                f"deterministic (nondeterministic kernels, active dropout), so the linearized gradient would be "
                f"taken at another point")
        g = self.grad[tok].to(device=lp.device, dtype=lp.dtype)
        return (g * (lp[:n] - lp[:n].detach())).sum()


def linearize(objectives: Sequence, tree: Tree, logprobs: torch.Tensor, norm: GlobalNorm, *,
              data: Mapping | None = None) -> Linearized:
    """Value and per-token gradient of ``sum(o.loss(lp, whole_tree_batch, norm=norm))`` at ``lp =
    logprobs`` (whole-tree DFS ``[T]``, e.g. a pre-pass's), ``data``: the tree's advantages / old /
    ref log-probs (``batch.extras``)."""
    batch = tree_batch(tree, norm)
    batch.extras.update(data or {})
    lp = logprobs.detach().to(torch.float64).clone().requires_grad_()
    total = sum(o.loss(lp, batch, norm=norm) for o in objectives)
    (grad,) = torch.autograd.grad(total, lp, allow_unused=True)
    grad = torch.zeros_like(lp) if grad is None else grad
    return Linearized(value=float(total.detach()), grad=grad.detach(), logprobs=logprobs.detach().to(torch.float64))
