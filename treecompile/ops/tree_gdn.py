"""Gated DeltaNet on a DFS-serialised tree: ``treecompile::tree_gated_delta_rule``.

Every radix node's segment ``[node_start, node_end)`` runs the gated delta rule starting from its
parent node's *final* state (roots start from zero or the given ``initial_state``), so every token
sees exactly the recurrence of its own root-to-leaf path.  Schedule: one varlen call per
``node_level`` (a node's parent is one level up, so it is always finished); a layer costs ``levels``
forward calls and ``levels`` backward calls, plus one state gather (parent -> child) and one
scatter-add (child -> parent, backward) per level.

Shapes (batch 1, flash-linear-attention conventions): ``q, k [1, T, Hk, Dk]``, ``v [1, T, Hv, Dv]``,
``g`` (log decay) and ``beta [1, T, Hv]``, node tensors ``[num_nodes]`` int64 in DFS order (parents
before children; see ``treecompile.tree.TreeBatch``), ``initial_state [Hv, Dk, Dv]`` or None.
Returns ``o [1, T, Hv, Dv]`` in v's dtype.

The implementation is the reference of :mod:`treecompile.ops.gdn` (chunked forward, explicit
reverse-mode backward registered as ``treecompile::tree_gated_delta_rule_backward``); it runs on any
device torch runs on.  Ops are registered at import.

The level sweeps (:func:`sweep_forward`, :func:`backward_sweep` on a :class:`SweepInputs`) are shared
with the boundary variant (``tree_gdn_boundary``).  HF's ``torch_chunk_gated_delta_rule`` is swapped
for this op during capture by ``treecompile.hf_adapters``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import gdn

__all__ = ["tree_gated_delta_rule", "sequence_nodes", "level_schedule", "check_inputs", "SweepInputs",
           "sweep_inputs", "sweep_forward", "backward_sweep"]


def sequence_nodes(batch: int, seq_len, device=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Node tensors of ``batch`` independent sequences of ``seq_len`` tokens laid end to end."""
    starts = torch.arange(batch, device=device) * seq_len
    return starts, starts + seq_len, torch.full((batch,), -1, dtype=torch.long, device=device), \
        torch.zeros(batch, dtype=torch.long, device=device)


def check_inputs(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state):
    if q.dim() != 4 or q.shape[0] != 1 or k.shape != q.shape:
        raise ValueError(f"q, k: expected equal shapes [1, T, Hk, Dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    T = q.shape[1]
    if v.dim() != 4 or v.shape[:2] != (1, T):
        raise ValueError(f"v: expected [1, T={T}, Hv, Dv], got {tuple(v.shape)}")
    Hv = v.shape[2]
    if Hv % q.shape[2]:
        raise ValueError(f"v: value heads ({Hv}) must be a multiple of q/k heads ({q.shape[2]})")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (1, T, Hv):
            raise ValueError(f"{name}: expected [1, T, Hv] = {(1, T, Hv)}, got {tuple(t.shape)}")
    Nn = node_start.numel()
    for name, t in (("node_start", node_start), ("node_end", node_end), ("node_parent", node_parent),
                    ("node_level", node_level)):
        if t.dim() != 1 or t.numel() != Nn or t.dtype != torch.long:
            raise ValueError(f"{name}: expected int64 [{Nn}], got {t.dtype} {tuple(t.shape)}")
    if initial_state is not None and initial_state.shape != (Hv, q.shape[3], v.shape[3]):
        raise ValueError(f"initial_state: expected [Hv, Dk, Dv] = {(Hv, q.shape[3], v.shape[3])}, "
                         f"got {tuple(initial_state.shape)}")


def level_schedule(node_start, node_end, node_parent, node_level, T: int) -> list[Tensor]:
    """Node indices of each level, after checking that the nodes tile ``[0, T)`` in DFS order."""
    Nn = node_start.numel()
    if Nn == 0:
        if T:
            raise ValueError(f"node tensors: no nodes for {T} tokens")
        return []
    s, e, p, lv = (x.cpu() for x in (node_start, node_end, node_parent, node_level))
    if int(s[0]) != 0 or int(e[-1]) != T or bool((s[1:] != e[:-1]).any()) or bool((e <= s).any()):
        bad = int(torch.nonzero(torch.cat([s[:1] != 0, s[1:] != e[:-1]]) | (e <= s))[0]) \
            if bool((torch.cat([s[:1] != 0, s[1:] != e[:-1]]) | (e <= s)).any()) else Nn - 1
        raise ValueError(f"node {bad}: nodes must tile [0, {T}) in order with non-empty segments "
                         f"(start {int(s[bad])}, end {int(e[bad])})")
    ar = torch.arange(Nn)
    bad = (p >= ar) | (p < -1) | torch.where(p >= 0, lv != lv[p.clamp(min=0)] + 1, lv != 0)
    if bool(bad.any()):
        n = int(torch.nonzero(bad)[0])
        raise ValueError(f"node {n}: parent {int(p[n])} / level {int(lv[n])} inconsistent (a parent comes "
                         "before its child in DFS order and is one level up; roots have parent -1, level 0)")
    dev = node_start.device
    return [torch.nonzero(lv == l).flatten().to(dev) for l in range(int(lv.max()) + 1)]


def _segments(nodes, node_start, node_end, chunk_size):
    starts, ends = node_start[nodes], node_end[nodes]
    return gdn.pad_segments(ends - starts, starts)


@dataclass
class SweepInputs:
    """One tree GDN call, prepared for the level sweeps (:func:`sweep_inputs`)."""

    q: Tensor  # the op's inputs as given: q, k [1, T, Hk, Dk], v [1, T, Hv, Dv], g, beta [1, T, Hv]
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor
    qs: Tensor  # prepared in the compute dtype: qs, ks [T, Hv, Dk] (scaled, heads repeated, l2-normed)
    ks: Tensor
    vs: Tensor  # [T, Hv, Dv]
    gs: Tensor  # [T, Hv]
    bs: Tensor  # [T, Hv]
    h0: Optional[Tensor]  # [Hv, Dk, Dv] roots' initial state, or None (zeros)
    node_start: Tensor  # [N] int64
    node_end: Tensor
    node_parent: Tensor
    levels: list[Tensor]  # node indices per level (level_schedule)
    chunk_size: int
    scale: Optional[float]
    use_qk_l2norm_in_kernel: bool


def sweep_inputs(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state, *,
                 scale, use_qk_l2norm_in_kernel, chunk_size) -> SweepInputs:
    """Check nothing (see :func:`check_inputs`); schedule the levels and prepare the tensors."""
    levels = level_schedule(node_start, node_end, node_parent, node_level, v.shape[1])
    ct = gdn._compute_dtype(v.dtype)
    qs, ks = gdn.prepare_qk(q[0].to(ct), k[0].to(ct), v.shape[2], scale=scale,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    h0 = None if initial_state is None else initial_state.to(ct)
    return SweepInputs(q=q, k=k, v=v, g=g, beta=beta, qs=qs, ks=ks, vs=v[0].to(ct), gs=g[0].to(ct),
                       bs=beta[0].to(ct), h0=h0, node_start=node_start, node_end=node_end, node_parent=node_parent,
                       levels=levels, chunk_size=chunk_size, scale=scale,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def sweep_forward(s: SweepInputs) -> tuple[Tensor, Tensor, Tensor]:
    """Level sweep, parents first.
    Returns (o [T, H, Dv], node initial states [Nn, H, Dk, Dv], node final states [Nn, H, Dk, Dv])."""
    qs = s.qs
    T, H, Dk = s.ks.shape
    Dv = s.vs.shape[-1]
    Nn = s.node_start.numel()
    final = qs.new_zeros(Nn, H, Dk, Dv)
    inits = qs.new_zeros(Nn, H, Dk, Dv)
    o = qs.new_zeros(T, H, Dv)
    root = qs.new_zeros(H, Dk, Dv) if s.h0 is None else s.h0
    for nodes in s.levels:
        par = s.node_parent[nodes]
        init = torch.where((par >= 0)[:, None, None, None], final[par.clamp(min=0)], root)
        index, valid = _segments(nodes, s.node_start, s.node_end, s.chunk_size)
        segs = [gdn._to_segments(x, index, valid) for x in (qs, s.ks, s.vs, s.gs, s.bs)]
        o_seg, hT = gdn.core_forward_chunked(*segs, init, s.chunk_size)
        o[index[valid]] = o_seg[valid]
        final[nodes] = hT
        inits[nodes] = init
    return o, inits, final


@torch.library.custom_op("treecompile::tree_gated_delta_rule", mutates_args=())
def tree_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, node_start: Tensor,
                          node_end: Tensor, node_parent: Tensor, node_level: Tensor,
                          initial_state: Optional[Tensor] = None, *, scale: Optional[float] = None,
                          use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64) -> Tensor:
    """Gated delta rule over a DFS tree (see module docstring). Returns ``o [1, T, Hv, Dv]``."""
    check_inputs(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state)
    s = sweep_inputs(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state, scale=scale,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    o, _, _ = sweep_forward(s)
    return o[None].to(v.dtype).contiguous()  # the fake impl promises a contiguous result


@tree_gated_delta_rule.register_fake
def _(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state=None, *, scale=None,
      use_qk_l2norm_in_kernel=False, chunk_size=64):
    return v.new_empty(v.shape)


def backward_sweep(s: SweepInputs, grad_o: Tensor, *, inits: Tensor, dfinal: Tensor):
    """The reverse level sweep shared by the tree GDN backward ops.

    ``inits`` come from :func:`sweep_forward`; ``dfinal [N, Hv, Dk, Dv]`` holds the final-state
    gradients already known (zeros, or what later partitions sent back) and is updated in place.
    Deepest level first; a node's initial-state gradient is added to its parent's final-state
    gradient (roots: to the returned ``dh0``).  Returns ``(dq, dk, dv, dg, dbeta)`` in the input
    dtypes and ``dh0`` in the compute dtype.
    """
    q, k, v = s.q, s.k, s.v
    qs = s.qs
    T, Hv, Dv = v.shape[1:]
    Hk, Dk = q.shape[2:]
    do = grad_o[0].to(qs.dtype)
    dh0 = qs.new_zeros(Hv, Dk, Dv)
    dqs, dks, dvs, dgs, dbs = (torch.zeros_like(x) for x in (qs, s.ks, s.vs, s.gs, s.bs))
    for nodes in reversed(s.levels):
        index, valid = _segments(nodes, s.node_start, s.node_end, s.chunk_size)
        segs = [gdn._to_segments(x, index, valid) for x in (qs, s.ks, s.vs, s.gs, s.bs, do)]
        grads = gdn.core_backward(*segs[:5], inits[nodes], segs[5], dfinal[nodes], s.chunk_size)
        tok = index[valid]
        for acc, gr in zip((dqs, dks, dvs, dgs, dbs), grads[:5]):
            acc[tok] = gr[valid]
        d_init = grads[5]
        par = s.node_parent[nodes]
        is_child = par >= 0
        dfinal.index_add_(0, par[is_child], d_init[is_child])
        dh0 = dh0 + d_init[~is_child].sum(0)
    # undo prepare_qk: scale, head repeat, l2norm
    scale = Dk ** -0.5 if s.scale is None else s.scale
    dqs = dqs * scale
    if Hv != Hk:
        dqs = dqs.reshape(T, Hk, Hv // Hk, Dk).sum(2)
        dks = dks.reshape(T, Hk, Hv // Hk, Dk).sum(2)
    if s.use_qk_l2norm_in_kernel:
        ct = qs.dtype
        dqs = gdn.l2norm_backward(q[0].to(ct), dqs)
        dks = gdn.l2norm_backward(k[0].to(ct), dks)
    return (dqs[None].to(q.dtype), dks[None].to(k.dtype), dvs[None].to(v.dtype), dgs[None].to(s.g.dtype),
            dbs[None].to(s.beta.dtype), dh0)


@torch.library.custom_op("treecompile::tree_gated_delta_rule_backward", mutates_args=())
def tree_gated_delta_rule_backward(
        grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, node_start: Tensor,
        node_end: Tensor, node_parent: Tensor, node_level: Tensor, initial_state: Optional[Tensor] = None, *,
        scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv, dg, dbeta, d_initial_state)`` of :func:`tree_gated_delta_rule`.

    Reverse level sweep: the deepest level first; a node's initial-state gradient is added to its
    parent's final-state gradient (roots: to ``d_initial_state``, zeros when there is none).
    """
    s = sweep_inputs(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state, scale=scale,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    _, inits, _ = sweep_forward(s)
    dq, dk, dv, dg, dbeta, dh0 = backward_sweep(s, grad_o, inits=inits, dfinal=torch.zeros_like(inits))
    dh0 = dh0 if initial_state is None else dh0.to(initial_state.dtype)
    # contiguous, as the fake impl promises (inductor checks sizes and strides)
    return tuple(t.contiguous() for t in (dq, dk, dv, dg, dbeta, dh0))


@tree_gated_delta_rule_backward.register_fake
def _(grad_o, q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state=None, *,
      scale=None, use_qk_l2norm_in_kernel=False, chunk_size=64):
    Hv, Dv = v.shape[2:]
    dt = initial_state.dtype if initial_state is not None else gdn._compute_dtype(v.dtype)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), v.new_empty((Hv, q.shape[3], Dv), dtype=dt))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.save_for_backward(*inputs[:9], *([inputs[9]] if inputs[9] is not None else []))
    ctx.has_init = inputs[9] is not None
    ctx.kw = keyword_only_inputs


def _backward(ctx, grad_o):
    saved = ctx.saved_tensors
    init = saved[9] if ctx.has_init else None
    dq, dk, dv, dg, db, dh0 = tree_gated_delta_rule_backward(grad_o, *saved[:9], init, **ctx.kw)
    return dq, dk, dv, dg, db, None, None, None, None, (dh0 if ctx.has_init else None)


tree_gated_delta_rule.register_autograd(_backward, setup_context=_setup_context)
