"""``treecompile::tree_causal_conv1d_boundary``: tree causal conv1d whose context may reach boundary tokens.

For a partition of a redundancy-free plan: :func:`treecompile.ops.tree_conv.tree_causal_conv1d` where
``conv_index`` entries ``T + r`` read column ``r`` of ``boundary_x [B, C, P]`` (the conv inputs of
the boundary tokens), ``-1`` reads zero, ``0..T-1`` local tokens.  Implemented as the tree conv over
``[x ; boundary_x]`` (the extra P columns have no context and are dropped); its backward recomputes
under autograd and returns a gradient for ``boundary_x`` too.

CPU reference; it runs on any device torch runs on.  Registered at import.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from treecompile.ops import tree_conv  # noqa: F401  (registers treecompile::tree_causal_conv1d)

__all__ = ["tree_causal_conv1d_boundary"]


def _conv_all(x, weight, bias, conv_index, boundary_x, activation):
    T, P = x.shape[2], boundary_x.shape[2]
    x_all = torch.cat([x, boundary_x.to(x.dtype)], 2)
    idx_all = torch.cat([conv_index, conv_index.new_full((P, conv_index.shape[1]), -1)], 0)
    return torch.ops.treecompile.tree_causal_conv1d(x_all, weight, bias, idx_all, activation)[:, :, :T]


@torch.library.custom_op("treecompile::tree_causal_conv1d_boundary", mutates_args=())
def tree_causal_conv1d_boundary(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor,
                                boundary_x: Tensor, activation: Optional[str] = None) -> Tensor:
    """Tree causal conv1d whose context may read boundary columns ``boundary_x`` (module docstring)."""
    T, P = x.shape[2], boundary_x.shape[2]
    if boundary_x.dim() != 3 or boundary_x.shape[:2] != x.shape[:2]:
        raise ValueError(f"boundary_x: expected [B={x.shape[0]}, C={x.shape[1]}, P], got {tuple(boundary_x.shape)}")
    if conv_index.numel() and int(conv_index.max()) >= T + P:
        raise ValueError(f"conv_index: entry {int(conv_index.max())} is past the {T} local + {P} boundary tokens")
    with torch.no_grad():
        return _conv_all(x, weight, bias, conv_index, boundary_x, activation).contiguous()


@tree_causal_conv1d_boundary.register_fake
def _(x, weight, bias, conv_index, boundary_x, activation=None):
    return x.new_empty(x.shape)


def _conv_setup(ctx, inputs, output):
    x, weight, bias, conv_index, boundary_x, activation = inputs
    ctx.save_for_backward(x, weight, bias, conv_index, boundary_x)
    ctx.activation = activation


def _conv_backward(ctx, grad):
    x, weight, bias, conv_index, boundary_x = ctx.saved_tensors
    with torch.enable_grad():
        xs = [x.detach().requires_grad_(), weight.detach().requires_grad_(), boundary_x.detach().requires_grad_()]
        b = bias.detach().requires_grad_() if bias is not None else None
        out = _conv_all(xs[0], xs[1], b, conv_index, xs[2], ctx.activation)
        grads = torch.autograd.grad(out, xs + ([b] if b is not None else []), grad, allow_unused=True)
    gx, gw, gp = (gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads[:3], xs))
    gb = grads[3] if b is not None else None
    return gx, gw, gb, None, gp, None


tree_causal_conv1d_boundary.register_autograd(_conv_backward, setup_context=_conv_setup)
