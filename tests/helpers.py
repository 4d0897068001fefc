"""Shared test helpers: gradient flattening, relative error, and the per-path reference's own noise."""

from __future__ import annotations

import torch

from treecompile import reference


def flat_grads(loss, params):
    return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def equal_per_path_computations(model, paths, masks, weights, batch):
    """Two per-path computations mathematically equal to ``reference.run(..., normalize="sum")``.

    (a) each unique token's log-prob read from one path's run (its last occurrence in DFS order)
        instead of summing over the paths through it;
    (b) every path split into two copies weighted 1/3 and 2/3 (exact: the same loss), which regroups
        the backward signals as the tree's summing of shared prefixes does.
    Returns ``[loss_a, loss_b]``.
    """
    tree = batch.tree
    last = torch.empty(tree.num_tokens, dtype=torch.long)
    last[tree.path_index] = torch.arange(tree.path_index.numel())
    lps = torch.cat(reference.run(model, paths).logprobs)
    loss_a = -(batch.loss_weight * lps[last]).sum()
    w = [1.0] * len(paths) if weights is None else list(weights)
    ref_b = reference.run(model, list(paths) * 2, loss_masks=None if masks is None else list(masks) * 2,
                          path_weights=[c / 3 for c in w] + [2 * c / 3 for c in w], normalize="sum")
    loss_b = 2 * ref_b.loss  # 2N paths under the 1/N of "sum"
    return [loss_a, loss_b]


def reference_noise(model, paths, masks, weights, batch, ref, params, g_ref):
    """How far two mathematically equal per-path computations disagree ("sum" normalization).

    HF computes RMSNorm and rotary in float32 even in a float64 model, in forward and backward, so
    where gradient contributions are summed (before or after a float32 cast) changes the rounding;
    see :func:`equal_per_path_computations`.  Returns (relative gradient noise, absolute loss noise).
    """
    g_noise = loss_noise = 0.0
    for loss in equal_per_path_computations(model, paths, masks, weights, batch):
        g_noise = max(g_noise, rel(flat_grads(loss, params), g_ref))
        loss_noise = max(loss_noise, abs(float(loss - ref.loss)))
    return g_noise, loss_noise
