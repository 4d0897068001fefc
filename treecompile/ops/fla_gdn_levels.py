"""Tree Gated DeltaNet through fla's chunk kernels in one pass per layer: only the state recurrence runs per call.

:func:`treecompile.ops.fla_gdn.tree_gated_delta_rule_fla` runs a layer as ``plan.calls`` whole fla calls
(``chunk_gated_delta_rule``), each ~20 kernels and ~3.3-4.5 ms of host time on H100: on agentic trees (dozens
of calls per layer) the host, not the GPU, sets the pace.  But of those kernels only one depends on the
state a segment starts from: ``chunk_gated_delta_rule_fwd_h`` (the recurrence over chunks; backward
``chunk_gated_delta_rule_bwd_dhu``).  Everything else (the gate's chunk-local cumsum, the WY representation,
the outputs from the chunk states, the backward's local and final gradients) is chunk-local, and fla's
chunks never cross a ``cu_seqlens`` boundary, so it gives the same numbers whether the segments run in one
call or in many.  :class:`TreeGDNLevels` therefore runs those kernels once over all of the plan's rows
(the calls' rows laid end to end, one ``cu_seqlens`` over every segment) and only the recurrence once per
call of the plan, each call starting from the previous call's final states (``index_select`` by the plan's
``source``); the backward runs ``bwd_dhu`` call after call in reverse, each call's final-state gradients
being its children's initial-state gradients summed (``index_add``).  The sequence of kernel invocations
per segment is fla's own (``fla/ops/gated_delta_rule/chunk.py``: ``chunk_gated_delta_rule_fwd`` / ``_bwd``,
whose steps the forward and backward below follow one for one), so the result equals the per-call path's up
to nothing: same kernels, same chunks, same state dtypes.

Uses fla's internal (not exported) functions of flash-linear-attention 0.6; :func:`levels_unusable_reason`
says when they are not importable, and the caller then falls back to whole calls.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LevelTensors", "TreeGDNLevels", "level_tensors", "levels_unusable_reason"]


def levels_unusable_reason() -> str | None:
    """Why fla's chunk-level functions cannot be imported here (None when they can)."""
    try:
        _fla()
    except ImportError as e:
        return f"fla's chunk-level functions are not importable ({e}); GDN layers run as whole fla calls"
    return None


def _fla():
    """fla's internal functions the levelled path composes (imported when first needed)."""
    from fla.modules.norm.l2norm import l2norm_bwd, l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu, chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    return dict(l2norm_fwd=l2norm_fwd, l2norm_bwd=l2norm_bwd, fwd_h=chunk_gated_delta_rule_fwd_h,
                bwd_dhu=chunk_gated_delta_rule_bwd_dhu, fwd_o=chunk_fwd_o, bwd_dv_local=chunk_bwd_dv_local,
                bwd_dqkwg=chunk_bwd_dqkwg, fwd_intra=chunk_gated_delta_rule_fwd_intra,
                wy_bwd=prepare_wy_repr_bwd, recompute_w_u=recompute_w_u_fwd, cumsum=chunk_local_cumsum,
                RCP_LN2=RCP_LN2)


@dataclass(frozen=True)
class CallSlice:
    """One call of the plan inside the laid-out rows: rows ``[lo, hi)``, chunks ``[c_lo, c_hi)``."""

    lo: int
    hi: int
    c_lo: int
    c_hi: int
    segments: int
    cu_seqlens: Tensor  # [k + 1], relative to lo (device)
    chunk_indices: Tensor  # [c_hi - c_lo, 2] (device)
    chunk_offsets: Tensor  # [k + 1] first chunk of each segment, relative to c_lo (device)
    source: Tensor | None  # [k] row of the previous call's final states; None: roots


@dataclass(frozen=True)
class LevelTensors:
    """What :class:`TreeGDNLevels` needs of a :class:`~treecompile.ops.fla_gdn.FlaPlan` at one chunk size,
    made on the host once per plan (:func:`level_tensors`) and copied to the device without blocking."""

    cu_seqlens: Tensor  # [S + 1] every segment of every call, laid end to end (device)
    chunk_indices: Tensor  # [NT, 2] fla's (segment, chunk) rows over all of them (device)
    calls: tuple[CallSlice, ...]
    chunk_size: int


def level_tensors(plan, chunk_size: int) -> LevelTensors:
    """The :class:`LevelTensors` of ``plan`` (cached on the plan)."""
    from treecompile.ops.fla_gdn import host_chunk_indices, to_device_async

    key = ("levels", chunk_size)
    cache = plan._chunk_indices
    if key in cache:
        return cache[key]
    dev = plan.index.device
    lengths = [n for w in plan.waves for n in w.lengths]
    calls, c_lo = [], 0
    for w in plan.waves:
        nchunks = [-(-n // chunk_size) for n in w.lengths]
        offsets = [0, *itertools.accumulate(nchunks)]
        calls.append(CallSlice(
            lo=w.lo, hi=w.hi, c_lo=c_lo, c_hi=c_lo + offsets[-1], segments=len(w.lengths),
            cu_seqlens=w.cu_seqlens,
            chunk_indices=to_device_async(host_chunk_indices(w.lengths, chunk_size), dev),
            chunk_offsets=to_device_async(torch.tensor(offsets, dtype=torch.long), dev), source=w.source))
        c_lo += offsets[-1]
    out = LevelTensors(
        cu_seqlens=to_device_async(torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long), dev),
        chunk_indices=to_device_async(host_chunk_indices(lengths, chunk_size), dev),
        calls=tuple(calls), chunk_size=chunk_size)
    cache[key] = out
    return out


def _recurrence(f, k, w, u, g, inits, L: LevelTensors, *, final_states: bool):
    """``fwd_h`` call after call: per call the chunk states ``h``, the new values and its final states (each
    call's initial states from the previous call's final states when ``inits`` is a function, else
    ``inits[i]``).  Returns ``(h [1, NT, Hv, K, V], v_new [1, R, Hv, V], initial states per call)``."""
    hs, vs, used, state = [], [], [], None
    for i, c in enumerate(L.calls):
        init = inits(i, c, state) if callable(inits) else inits[i]
        h, v_new, state = f["fwd_h"](
            k=k[:, c.lo:c.hi], w=w[:, c.lo:c.hi], u=u[:, c.lo:c.hi], g=g[:, c.lo:c.hi], initial_state=init,
            output_final_state=final_states and i + 1 < len(L.calls), chunk_size=L.chunk_size,
            cu_seqlens=c.cu_seqlens, chunk_indices=c.chunk_indices, chunk_offsets=c.chunk_offsets)
        hs.append(h)
        vs.append(v_new)
        used.append(init)
    cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, 1)  # noqa: E731
    return cat(hs), cat(vs), used


class TreeGDNLevels(torch.autograd.Function):
    """``o [1, R, Hv, V]`` of fla's gated delta rule over the plan's rows (inputs already laid out in call
    order, ``[1, R, ...]``), every segment starting from its source's final state (roots: ``initial_state
    [Hv, K, V]`` or zero).  Arguments as fla's ``chunk_gated_delta_rule`` (``g`` the log decay, ``beta``
    after its sigmoid); see the module docstring for the steps."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, L: LevelTensors, scale: float, l2norm: bool):
        f = _fla()
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        q_rstd = k_rstd = None
        if l2norm:
            q, q_rstd = f["l2norm_fwd"](q)
            k, k_rstd = f["l2norm_fwd"](k)
        cs, Hv, K, V, g_dtype = L.chunk_size, v.shape[2], k.shape[3], v.shape[3], g.dtype
        g = f["cumsum"](g, chunk_size=cs, scale=f["RCP_LN2"], cu_seqlens=L.cu_seqlens, chunk_indices=L.chunk_indices)
        w, u, A = f["fwd_intra"](k=k, v=v, g=g, beta=beta, cu_seqlens=L.cu_seqlens, chunk_indices=L.chunk_indices,
                                 chunk_size=cs)

        def inits(i, c, prev):
            if c.source is not None:
                return prev.index_select(0, c.source)
            if initial_state is not None:
                return initial_state.float().expand(c.segments, Hv, K, V).contiguous()
            return k.new_zeros(c.segments, Hv, K, V, dtype=torch.float32)

        h, v_new, used = _recurrence(f, k, w, u, g, inits, L, final_states=True)
        o = f["fwd_o"](q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=L.cu_seqlens,
                       chunk_indices=L.chunk_indices, chunk_size=cs)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, *used)
        ctx.L, ctx.scale, ctx.l2norm, ctx.g_dtype = L, scale, l2norm, g_dtype
        ctx.init_meta = None if initial_state is None else (initial_state.dtype, initial_state.requires_grad)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        f = _fla()
        q, q_rstd, k, k_rstd, v, g, beta, A, *inits = ctx.saved_tensors
        L, scale, cs = ctx.L, ctx.scale, ctx.L.chunk_size
        do = do.contiguous()
        w, u = f["recompute_w_u"](k=k, v=v, beta=beta, A=A, g=g, cu_seqlens=L.cu_seqlens,
                                  chunk_indices=L.chunk_indices)
        h, v_new, _ = _recurrence(f, k, w, u, g, inits, L, final_states=False)
        dv = f["bwd_dv_local"](q=q, k=k, g=g, do=do, scale=scale, cu_seqlens=L.cu_seqlens,
                               chunk_indices=L.chunk_indices, chunk_size=cs)
        dhs, dv2s, dht = [None] * len(L.calls), [None] * len(L.calls), None
        for i in range(len(L.calls) - 1, -1, -1):
            c = L.calls[i]
            r = slice(c.lo, c.hi)
            dhs[i], dh0, dv2s[i] = f["bwd_dhu"](
                q=q[:, r], k=k[:, r], w=w[:, r], do=do[:, r], dv=dv[:, r], g=g[:, r], h0=inits[i], dht=dht,
                scale=scale, cu_seqlens=c.cu_seqlens, chunk_size=cs, chunk_indices=c.chunk_indices,
                chunk_offsets=c.chunk_offsets)
            if c.source is not None:  # the previous call's final states feed these segments: their gradients
                prev = L.calls[i - 1]
                dht = dh0.new_zeros(prev.segments, *dh0.shape[1:]).index_add_(0, c.source, dh0)
            else:
                d_init = dh0
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, 1)  # noqa: E731
        dh, dv2 = cat(dhs), cat(dv2s)
        dq, dk, dw, dg = f["bwd_dqkwg"](q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv2, do=do, dh=dh, scale=scale,
                                        cu_seqlens=L.cu_seqlens, chunk_indices=L.chunk_indices, chunk_size=cs)
        dk2, dv, db, dg2 = f["wy_bwd"](k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=dv2, cu_seqlens=L.cu_seqlens,
                                       chunk_indices=L.chunk_indices)
        dk.add_(dk2)
        dg.add_(dg2)
        dg = f["cumsum"](dg, chunk_size=cs, reverse=True, cu_seqlens=L.cu_seqlens, chunk_indices=L.chunk_indices)
        if ctx.l2norm:
            dq = f["l2norm_bwd"](q, q_rstd, dq)
            dk = f["l2norm_bwd"](k, k_rstd, dk)
        d_initial = None
        if ctx.init_meta is not None and ctx.init_meta[1]:
            d_initial = d_init.sum(0).to(ctx.init_meta[0])
        return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), d_initial, None, None, None
