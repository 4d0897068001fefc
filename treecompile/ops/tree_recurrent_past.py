"""Boundary variants of the tree GDN and tree conv ops, for partitions of a redundancy-free plan.

``treecompile::tree_gated_delta_rule_states``: :func:`treecompile.ops.tree_gdn.tree_gated_delta_rule`
that also returns the *final* recurrent state of chosen nodes, ``states = final[state_nodes]``
(``[E, Hv, Dk, Dv]``), and whose ``initial_state [Hv, Dk, Dv]`` (the state every local root node
starts from: the state after the token the partition hangs below) receives a gradient.  The
backward is the reverse level sweep of ``tree_gdn`` with the final-state gradients of
``state_nodes`` seeded from the incoming ``grad_states`` (what later partitions sent back).

``treecompile::tree_causal_conv1d_past``: :func:`treecompile.ops.tree_conv.tree_causal_conv1d` whose
context may reach boundary tokens: ``conv_index`` entries ``T + r`` read column ``r`` of ``past_x
[B, C, P]`` (the conv inputs of the boundary tokens), ``-1`` reads zero, ``0..T-1`` local tokens.
Implemented as the tree conv over ``[x ; past_x]`` (the extra P columns have no context and are
dropped); its backward recomputes under autograd and returns a gradient for ``past_x`` too.

CPU references; they run on any device torch runs on.  Registered at import.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from treecompile.ops import gdn
from treecompile.ops import tree_conv  # noqa: F401  (registers treecompile::tree_causal_conv1d)
from treecompile.ops.tree_gdn import _check as _gdn_check
from treecompile.ops.tree_gdn import _forward, _prepare, backward_sweep, level_schedule

__all__ = ["tree_gated_delta_rule_states", "tree_causal_conv1d_past"]


# ------------------------------------------------------------------------------------------ GDN
def _check_states(node_start, initial_state, state_nodes):
    if initial_state is None:
        raise ValueError("tree_gated_delta_rule_states: initial_state is required (zeros for none)")
    Nn = node_start.numel()
    if state_nodes.dim() != 1 or state_nodes.dtype != torch.long:
        raise ValueError(f"state_nodes: expected int64 [E], got {state_nodes.dtype} {tuple(state_nodes.shape)}")
    if state_nodes.numel() and (int(state_nodes.min()) < 0 or int(state_nodes.max()) >= Nn):
        raise ValueError(f"state_nodes: node indices must lie in [0, {Nn}), got {state_nodes.tolist()}")


@torch.library.custom_op("treecompile::tree_gated_delta_rule_states", mutates_args=())
def tree_gated_delta_rule_states(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, node_start: Tensor,
                                 node_end: Tensor, node_parent: Tensor, node_level: Tensor,
                                 initial_state: Tensor, state_nodes: Tensor, *, scale: Optional[float] = None,
                                 use_qk_l2norm_in_kernel: bool = False,
                                 chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Tree GDN from ``initial_state``; returns ``(o [1, T, Hv, Dv], final[state_nodes] [E, Hv, Dk, Dv])``."""
    _gdn_check(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state)
    _check_states(node_start, initial_state, state_nodes)
    levels = level_schedule(node_start, node_end, node_parent, node_level, q.shape[1])
    qs, ks, vs, gs, bs, h0 = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)
    o, _, final = _forward(qs, ks, vs, gs, bs, node_start, node_end, node_parent, levels, h0, chunk_size)
    return o[None].to(v.dtype), final[state_nodes].to(initial_state.dtype)


@tree_gated_delta_rule_states.register_fake
def _(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state, state_nodes, *,
      scale=None, use_qk_l2norm_in_kernel=False, chunk_size=64):
    return v.new_empty(v.shape), initial_state.new_empty((state_nodes.shape[0],) + tuple(initial_state.shape))


@torch.library.custom_op("treecompile::tree_gated_delta_rule_states_backward", mutates_args=())
def tree_gated_delta_rule_states_backward(
        grad_o: Tensor, grad_states: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
        node_start: Tensor, node_end: Tensor, node_parent: Tensor, node_level: Tensor, initial_state: Tensor,
        state_nodes: Tensor, *, scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False,
        chunk_size: int = 64) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dg, dbeta, d_initial_state)``; ``grad_states`` seeds the final-state
    gradients of ``state_nodes`` (summed where a node is listed twice)."""
    levels = level_schedule(node_start, node_end, node_parent, node_level, v.shape[1])
    qs, ks, vs, gs, bs, h0 = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)
    _, inits, _ = _forward(qs, ks, vs, gs, bs, node_start, node_end, node_parent, levels, h0, chunk_size)
    dfinal = torch.zeros_like(inits)
    dfinal.index_add_(0, state_nodes, grad_states.to(qs.dtype))  # what later partitions sent back
    dq, dk, dv, dg, dbeta, dh0 = backward_sweep(grad_o, q, k, v, g, beta, qs, ks, vs, gs, bs, inits, dfinal,
                                                 node_start, node_end, node_parent, levels, chunk_size, scale,
                                                 use_qk_l2norm_in_kernel)
    return dq, dk, dv, dg, dbeta, dh0.to(initial_state.dtype)


@tree_gated_delta_rule_states_backward.register_fake
def _(grad_o, grad_states, q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state,
      state_nodes, *, scale=None, use_qk_l2norm_in_kernel=False, chunk_size=64):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), initial_state.new_empty(initial_state.shape))


def _gdn_setup(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.kw = keyword_only_inputs


def _gdn_backward(ctx, grad_o, grad_states):
    saved = ctx.saved_tensors
    v, init, state_nodes = saved[2], saved[9], saved[10]
    if grad_o is None:
        grad_o = v.new_zeros(v.shape)
    if grad_states is None:
        grad_states = init.new_zeros((state_nodes.numel(),) + tuple(init.shape))
    dq, dk, dv, dg, db, dh0 = tree_gated_delta_rule_states_backward(grad_o, grad_states, *saved, **ctx.kw)
    return dq, dk, dv, dg, db, None, None, None, None, dh0, None


tree_gated_delta_rule_states.register_autograd(_gdn_backward, setup_context=_gdn_setup)


# ------------------------------------------------------------------------------------------ conv
def _conv_all(x, weight, bias, conv_index, past_x, activation):
    T, P = x.shape[2], past_x.shape[2]
    x_all = torch.cat([x, past_x.to(x.dtype)], 2)
    idx_all = torch.cat([conv_index, conv_index.new_full((P, conv_index.shape[1]), -1)], 0)
    return torch.ops.treecompile.tree_causal_conv1d(x_all, weight, bias, idx_all, activation)[:, :, :T]


@torch.library.custom_op("treecompile::tree_causal_conv1d_past", mutates_args=())
def tree_causal_conv1d_past(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor,
                            past_x: Tensor, activation: Optional[str] = None) -> Tensor:
    """Tree causal conv1d whose context may read boundary columns ``past_x`` (module docstring)."""
    T, P = x.shape[2], past_x.shape[2]
    if past_x.dim() != 3 or past_x.shape[:2] != x.shape[:2]:
        raise ValueError(f"past_x: expected [B={x.shape[0]}, C={x.shape[1]}, P], got {tuple(past_x.shape)}")
    if conv_index.numel() and int(conv_index.max()) >= T + P:
        raise ValueError(f"conv_index: entry {int(conv_index.max())} is past the {T} local + {P} boundary tokens")
    with torch.no_grad():
        return _conv_all(x, weight, bias, conv_index, past_x, activation).contiguous()


@tree_causal_conv1d_past.register_fake
def _(x, weight, bias, conv_index, past_x, activation=None):
    return x.new_empty(x.shape)


def _conv_setup(ctx, inputs, output):
    x, weight, bias, conv_index, past_x, activation = inputs
    ctx.save_for_backward(x, weight, bias, conv_index, past_x)
    ctx.activation = activation


def _conv_backward(ctx, grad):
    x, weight, bias, conv_index, past_x = ctx.saved_tensors
    with torch.enable_grad():
        xs = [x.detach().requires_grad_(), weight.detach().requires_grad_(), past_x.detach().requires_grad_()]
        b = bias.detach().requires_grad_() if bias is not None else None
        out = _conv_all(xs[0], xs[1], b, conv_index, xs[2], ctx.activation)
        grads = torch.autograd.grad(out, xs + ([b] if b is not None else []), grad, allow_unused=True)
    gx, gw, gp = (gr if gr is not None else torch.zeros_like(t) for gr, t in zip(grads[:3], xs))
    gb = grads[3] if b is not None else None
    return gx, gw, gb, None, gp, None


tree_causal_conv1d_past.register_autograd(_conv_backward, setup_context=_conv_setup)
