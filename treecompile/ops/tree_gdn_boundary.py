"""``treecompile::tree_gated_delta_rule_boundary``: tree GDN for a partition of a redundancy-free plan.

:func:`treecompile.ops.tree_gdn.tree_gated_delta_rule` that also returns the *final* recurrent state
of chosen nodes, ``states = final[state_nodes]`` (``[E, Hv, Dk, Dv]``: what later partitions read as
their boundary state), and whose ``initial_state [Hv, Dk, Dv]`` (the boundary state every local root
node starts from: the state after the token the partition hangs below) receives a gradient.  The
backward is the reverse level sweep of ``tree_gdn`` with the final-state gradients of
``state_nodes`` seeded from the incoming ``grad_states`` (what later partitions sent back).

CPU reference; it runs on any device torch runs on.  Registered at import.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from treecompile.ops.tree_gdn import backward_sweep, check_inputs, sweep_forward, sweep_inputs

__all__ = ["tree_gated_delta_rule_boundary"]


def _check_states(node_start, initial_state, state_nodes):
    if initial_state is None:
        raise ValueError("tree_gated_delta_rule_boundary: initial_state is required (zeros for none)")
    Nn = node_start.numel()
    if state_nodes.dim() != 1 or state_nodes.dtype != torch.long:
        raise ValueError(f"state_nodes: expected int64 [E], got {state_nodes.dtype} {tuple(state_nodes.shape)}")
    if state_nodes.numel() and (int(state_nodes.min()) < 0 or int(state_nodes.max()) >= Nn):
        raise ValueError(f"state_nodes: node indices must lie in [0, {Nn}), got {state_nodes.tolist()}")


@torch.library.custom_op("treecompile::tree_gated_delta_rule_boundary", mutates_args=())
def tree_gated_delta_rule_boundary(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, node_start: Tensor,
                                   node_end: Tensor, node_parent: Tensor, node_level: Tensor,
                                   initial_state: Tensor, state_nodes: Tensor, *, scale: Optional[float] = None,
                                   use_qk_l2norm_in_kernel: bool = False,
                                   chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    """Tree GDN from ``initial_state``; returns ``(o [1, T, Hv, Dv], final[state_nodes] [E, Hv, Dk, Dv])``."""
    check_inputs(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state)
    _check_states(node_start, initial_state, state_nodes)
    s = sweep_inputs(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state, scale=scale,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    o, _, final = sweep_forward(s)
    return o[None].to(v.dtype), final[state_nodes].to(initial_state.dtype)


@tree_gated_delta_rule_boundary.register_fake
def _(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state, state_nodes, *,
      scale=None, use_qk_l2norm_in_kernel=False, chunk_size=64):
    return v.new_empty(v.shape), initial_state.new_empty((state_nodes.shape[0],) + tuple(initial_state.shape))


@torch.library.custom_op("treecompile::tree_gated_delta_rule_boundary_backward", mutates_args=())
def tree_gated_delta_rule_boundary_backward(
        grad_o: Tensor, grad_states: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
        node_start: Tensor, node_end: Tensor, node_parent: Tensor, node_level: Tensor, initial_state: Tensor,
        state_nodes: Tensor, *, scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False,
        chunk_size: int = 64) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dg, dbeta, d_initial_state)``; ``grad_states`` seeds the final-state
    gradients of ``state_nodes`` (summed where a node is listed twice)."""
    s = sweep_inputs(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state, scale=scale,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    _, inits, _ = sweep_forward(s)
    dfinal = torch.zeros_like(inits)
    dfinal.index_add_(0, state_nodes, grad_states.to(s.qs.dtype))  # what later partitions sent back
    dq, dk, dv, dg, dbeta, dh0 = backward_sweep(s, grad_o, inits=inits, dfinal=dfinal)
    return dq, dk, dv, dg, dbeta, dh0.to(initial_state.dtype)


@tree_gated_delta_rule_boundary_backward.register_fake
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
    dq, dk, dv, dg, db, dh0 = tree_gated_delta_rule_boundary_backward(grad_o, grad_states, *saved, **ctx.kw)
    return dq, dk, dv, dg, db, None, None, None, None, dh0, None


tree_gated_delta_rule_boundary.register_autograd(_gdn_backward, setup_context=_gdn_setup)
