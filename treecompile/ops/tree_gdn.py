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

Capture helpers: :func:`hf_chunk_gated_delta_rule` has the signature of HF's
``torch_chunk_gated_delta_rule`` and runs the tree op on a one-node-per-sequence "tree", so that a
captured graph holds one ``tree_gated_delta_rule`` node per GDN layer whose node inputs the GDN pass
re-points at the batch's ``node_*`` tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import gdn

__all__ = ["tree_gated_delta_rule", "sequence_nodes", "hf_chunk_gated_delta_rule", "level_schedule"]


def sequence_nodes(batch: int, seq_len, device=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Node tensors of ``batch`` independent sequences of ``seq_len`` tokens laid end to end."""
    starts = torch.arange(batch, device=device) * seq_len
    return starts, starts + seq_len, torch.full((batch,), -1, dtype=torch.long, device=device), \
        torch.zeros(batch, dtype=torch.long, device=device)


def _check(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state):
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


def _forward(qs, ks, vs, gs, bs, node_start, node_end, node_parent, levels, h0, chunk_size):
    """Level sweep on prepared tensors ([T, H, D] etc.).
    Returns (o [T, H, Dv], node initial states [Nn, H, Dk, Dv], node final states [Nn, H, Dk, Dv])."""
    T, H, Dk = ks.shape
    Dv = vs.shape[-1]
    Nn = node_start.numel()
    final = qs.new_zeros(Nn, H, Dk, Dv)
    inits = qs.new_zeros(Nn, H, Dk, Dv)
    o = qs.new_zeros(T, H, Dv)
    root = qs.new_zeros(H, Dk, Dv) if h0 is None else h0
    for nodes in levels:
        par = node_parent[nodes]
        init = torch.where((par >= 0)[:, None, None, None], final[par.clamp(min=0)], root)
        index, valid = _segments(nodes, node_start, node_end, chunk_size)
        segs = [gdn._to_segments(x, index, valid) for x in (qs, ks, vs, gs, bs)]
        o_seg, hT = gdn.core_forward_chunked(*segs, init, chunk_size)
        o[index[valid]] = o_seg[valid]
        final[nodes] = hT
        inits[nodes] = init
    return o, inits, final


def _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel):
    ct = gdn._compute_dtype(v.dtype)
    Hv = v.shape[2]
    qs, ks = gdn.prepare_qk(q[0].to(ct), k[0].to(ct), Hv, scale=scale,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    h0 = None if initial_state is None else initial_state.to(ct)
    return qs, ks, v[0].to(ct), g[0].to(ct), beta[0].to(ct), h0


@torch.library.custom_op("treecompile::tree_gated_delta_rule", mutates_args=())
def tree_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, node_start: Tensor,
                          node_end: Tensor, node_parent: Tensor, node_level: Tensor,
                          initial_state: Optional[Tensor] = None, *, scale: Optional[float] = None,
                          use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64) -> Tensor:
    """Gated delta rule over a DFS tree (see module docstring). Returns ``o [1, T, Hv, Dv]``."""
    _check(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state)
    levels = level_schedule(node_start, node_end, node_parent, node_level, q.shape[1])
    qs, ks, vs, gs, bs, h0 = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)
    o, _, _ = _forward(qs, ks, vs, gs, bs, node_start, node_end, node_parent, levels, h0, chunk_size)
    return o[None].to(v.dtype).contiguous()  # the fake impl promises a contiguous result


@tree_gated_delta_rule.register_fake
def _(q, k, v, g, beta, node_start, node_end, node_parent, node_level, initial_state=None, *, scale=None,
      use_qk_l2norm_in_kernel=False, chunk_size=64):
    return v.new_empty(v.shape)


def backward_sweep(grad_o, q, k, v, g, beta, qs, ks, vs, gs, bs, inits, dfinal, node_start, node_end, node_parent,
                   levels, chunk_size, scale, use_qk_l2norm_in_kernel):
    """The reverse level sweep shared by the tree GDN backward ops.

    ``qs..bs``/``inits`` come from ``_prepare``/``_forward``; ``dfinal [N, Hv, Dk, Dv]`` holds the
    final-state gradients already known (zeros, or what later partitions sent back) and is updated in
    place.  Deepest level first; a node's initial-state gradient is added to its parent's final-state
    gradient (roots: to the returned ``dh0``).  Returns ``(dq, dk, dv, dg, dbeta)`` in the input dtypes
    and ``dh0`` in the compute dtype.
    """
    T, Hv, Dv = v.shape[1:]
    Hk, Dk = q.shape[2:]
    do = grad_o[0].to(qs.dtype)
    dh0 = qs.new_zeros(Hv, Dk, Dv)
    dqs, dks, dvs, dgs, dbs = (torch.zeros_like(x) for x in (qs, ks, vs, gs, bs))
    for nodes in reversed(levels):
        index, valid = _segments(nodes, node_start, node_end, chunk_size)
        segs = [gdn._to_segments(x, index, valid) for x in (qs, ks, vs, gs, bs, do)]
        grads = gdn.core_backward(*segs[:5], inits[nodes], segs[5], dfinal[nodes], chunk_size)
        tok = index[valid]
        for acc, gr in zip((dqs, dks, dvs, dgs, dbs), grads[:5]):
            acc[tok] = gr[valid]
        d_init = grads[5]
        par = node_parent[nodes]
        is_child = par >= 0
        dfinal.index_add_(0, par[is_child], d_init[is_child])
        dh0 = dh0 + d_init[~is_child].sum(0)
    # undo prepare_qk: scale, head repeat, l2norm
    s = Dk ** -0.5 if scale is None else scale
    dqs = dqs * s
    if Hv != Hk:
        dqs = dqs.reshape(T, Hk, Hv // Hk, Dk).sum(2)
        dks = dks.reshape(T, Hk, Hv // Hk, Dk).sum(2)
    if use_qk_l2norm_in_kernel:
        ct = qs.dtype
        dqs = gdn.l2norm_backward(q[0].to(ct), dqs)
        dks = gdn.l2norm_backward(k[0].to(ct), dks)
    return (dqs[None].to(q.dtype), dks[None].to(k.dtype), dvs[None].to(v.dtype), dgs[None].to(g.dtype),
            dbs[None].to(beta.dtype), dh0)


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
    levels = level_schedule(node_start, node_end, node_parent, node_level, v.shape[1])
    qs, ks, vs, gs, bs, h0 = _prepare(q, k, v, g, beta, initial_state, scale, use_qk_l2norm_in_kernel)
    _, inits, _ = _forward(qs, ks, vs, gs, bs, node_start, node_end, node_parent, levels, h0, chunk_size)
    dq, dk, dv, dg, dbeta, dh0 = backward_sweep(grad_o, q, k, v, g, beta, qs, ks, vs, gs, bs, inits,
                                                 torch.zeros_like(inits), node_start, node_end, node_parent,
                                                 levels, chunk_size, scale, use_qk_l2norm_in_kernel)
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


def hf_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                              cu_seqlens=None, **kwargs):
    """Drop-in for HF's ``torch_chunk_gated_delta_rule`` (same signature and ``(o, state)`` return):
    each batch row is one root node of the tree op.  Training capture only: ``output_final_state``,
    ``cu_seqlens`` and a batched ``initial_state`` are refused."""
    if output_final_state:
        raise ValueError("hf_chunk_gated_delta_rule: output_final_state=True is not supported (capture with "
                         "use_cache=False)")
    if cu_seqlens is not None:
        raise ValueError("hf_chunk_gated_delta_rule: cu_seqlens (packed sequences) is not supported")
    B, T = query.shape[:2]
    if initial_state is not None and initial_state.shape[0] != 1:
        raise ValueError(f"hf_chunk_gated_delta_rule: initial_state must have batch 1, got {tuple(initial_state.shape)}")
    nodes = sequence_nodes(B, T, device=query.device)
    flat = [x.reshape((1, B * T) + tuple(x.shape[2:])) for x in (query, key, value, g, beta)]
    o = tree_gated_delta_rule(*flat, *nodes, None if initial_state is None else initial_state[0],
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    return o.reshape(value.shape), None
