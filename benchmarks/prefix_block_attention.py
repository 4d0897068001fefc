"""A prototype to time, not the library's op: the varlen tree attention with each tree's shared prefix attended
as one full block, its keys read in place (issue 16, session 43's note).

The varlen op (``treecompile.ops.varlen_tree_attention``) gathers, for every segment (a run of tokens from a
branch point down to a leaf), its whole path prefix: a prompt that every branch shares is gathered once per
segment.  The gathered rows ``G`` cost a gather, FA4's float32 dK/dV accumulators and the copies' sums, all
per row (3.1 x T on the agentic parallel-tools tree: the excess of its kernels over the work bound, session 43).
Here, per tree (a root segment ``r`` and the segments under it), the first ``K`` tokens of ``r`` that every
segment under it sees are attended once, as one full (unmasked) block: queries ``[end of r, subtree end of r's
first token)`` against keys ``[start of r, start of r + K)``, read where they are.  The segments then gather
only the rest of their prefixes (parallel-tools: G 3.12 -> 1.61 x T; deep-agent 8.54 -> 3.08 x T,
``results/cpu_s43/shared_prefix_gather.txt``).  The two parts of a block row are merged by their log-sum-exps;
each part's backward runs with the merged output and log-sum-exp (FA4's backward takes them: the row's softmax
and ``rowsum(dO * O)`` are the whole row's, so each part's gradients are that part's share, as in a split-KV
backward).

On CUDA half precision the parts run through FA4 (the library's segment call; ``flash_attn.cute``'s non-causal
call for each block); elsewhere through reference formulas, so the CPU test checks the plan and the merge
against the dense tree mask in float64 (``tests/test_prefix_block_attention.py``).  The op's log-sum-exp is
float32 (FA4's), so merged rows carry its rounding: about 1e-7 relative in float64, not the op's 1e-12.
``bench_fa4_attention.py`` times it as ``fa4_prefix_block`` against ``fa4_varlen``.

**Measured: it does not pay** (H200, session 44, ``results/h200_s44/attn``; fwd+bwd ms against ``fa4_varlen``):
16x2048 POR 0.5 2.615 / 1.867, agentic parallel-tools 3.034 / 2.153, deep-agent 6.453 / 6.344.  The forward runs
two FA4 calls and a merge (0.97 against 0.44 ms at 16k), the backward two FA4 backwards, which cost more than the
gathered rows they save.  Kept as a prototype (its tests guard the merge's exactness) and not wired into the
lowering.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treecompile.ops import varlen_tree_attention as vta
from treecompile.ops.last_batch import LastBatch

__all__ = ["prefix_block_plan", "prefix_block_attention"]


def prefix_block_plan(subtree_end: Tensor) -> tuple[vta.SegmentPlan, list[tuple[int, int, int, int]]]:
    """(the segment plan without each tree's shared prefix, the blocks ``(q0, q1, k0, k1)``: queries ``[q0, q1)``
    see keys ``[k0, k1)``, all of them).  A tree with no segment under its root segment has no block."""
    w = vta._walk(subtree_end)
    shared: dict[int, int] = {}  # root segment -> how many of its tokens every segment under it sees
    for j in range(w.n_main):
        i, p = j, None
        while w.parents[i] is not None:
            i, p = w.parents[i]
        if p is not None:
            shared[i] = min(shared.get(i, p - w.starts[i]), p - w.starts[i])
    blocks = [(w.ends[r], int(w.se[w.starts[r]]), w.starts[r], w.starts[r] + K) for r, K in sorted(shared.items())
              if K > 0]
    cut = {r: K for r, K in shared.items() if K > 0}
    intervals, cu_k = [], [0]
    for j in range(w.n_main):  # segment j's keys: its ancestors' visible runs (a root's past its block), itself
        run, i = [(w.starts[j], w.ends[j])], j
        while w.parents[i] is not None:
            i, p = w.parents[i]
            run.append((w.starts[i] + (cut.get(i, 0) if w.parents[i] is None else 0), p))
        intervals += run[::-1]
        cu_k.append(cu_k[-1] + sum(h - lo for lo, h in run))
    device = subtree_end.device
    lo, hi, first = vta._rows([x for iv in intervals for x in iv], cu_k[-1])
    plan = vta._segment_plan(lo, hi, first, [0, *w.ends[:w.n_main]], cu_k, w.tail, device)
    return plan, blocks


_PLANS = LastBatch()


def _full_fwd(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Unmasked attention of tokens-major ``q [n, H, D]`` over ``k``/``v [m, Hkv, D]``: (out ``[n, H, Dv]``, lse
    ``[H, n]`` float32)."""
    if vta._fa4(q):
        from flash_attn.cute.interface import _flash_attn_fwd

        out, lse = _flash_attn_fwd(q[None], k[None], v[None], softmax_scale=scale, causal=False, return_lse=True)[:2]
        return out[0], lse[0]
    r = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,mhd->hnm", q, k.repeat_interleave(r, 1)) * scale
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hnm,mhd->nhd", torch.exp(s - lse[..., None]), v.repeat_interleave(r, 1)), lse.float()


def _partial_bwd(q, k, v, out, dout, lse, scale, visible=None):
    """(dq, dk, dv) of one part of rows whose whole softmax is ``lse`` and whose whole output is ``out``
    (``visible``: the part's ``[n, m]`` mask; None: all), reference formulas in the inputs' dtype."""
    r = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = torch.einsum("nhd,mhd->hnm", q, kk) * scale
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - lse.to(q.dtype)[..., None])
    dp = torch.einsum("nhd,mhd->hnm", dout, vv)
    ds = p * (dp - (dout * out).sum(-1).T[..., None]) * scale
    dq = torch.einsum("hnm,mhd->nhd", ds, kk)
    dk = torch.einsum("hnm,nhd->mhd", ds, q).unflatten(1, (k.shape[1], r)).sum(2)
    dv = torch.einsum("hnm,nhd->mhd", p, dout).unflatten(1, (k.shape[1], r)).sum(2)
    return dq, dk, dv


def _segments_bwd_given_lse(q_t, kg, vg, out_t, dout_t, lse, plan, scale, dq=None):
    """``vta._bwd``'s reference case, with the softmax of the rows' whole (merged) log-sum-exp instead of each
    segment's own (the library's reference recomputes the segment's softmax: right for the op, not for a part)."""
    dq_, dkg, dvg = torch.zeros_like(q_t), torch.zeros_like(kg), torch.zeros_like(vg)
    for rq, rk, visible in plan.pieces(q_t.device):
        a, b, c = _partial_bwd(q_t[rq], kg[rk], vg[rk], out_t[rq], dout_t[rq], lse[:, rq], scale, visible)
        dq_[rq] += a
        dkg[rk] += b
        dvg[rk] += c
    return (dq_ if dq is None else dq.copy_(dq_)), dkg, dvg


def _full_bwd(q, k, v, out, dout, lse, scale):
    if vta._fa4(q):
        from flash_attn.cute.interface import _flash_attn_bwd

        return tuple(g[0] for g in _flash_attn_bwd(q[None], k[None], v[None], out[None], dout[None], lse[None],
                                                   scale, False)[:3])
    return _partial_bwd(q, k, v, out, dout, lse, scale)


def _merge(out_rows: Tensor, lse_rows: Tensor, ob: Tensor, lb: Tensor) -> None:
    """Rows of two parts of one softmax, in place into the first: ``lse = logaddexp``, ``out`` their weighted sum
    (in float32, float64 for float64)."""
    acc = torch.promote_types(torch.float32, out_rows.dtype)
    new = torch.logaddexp(lse_rows, lb.float())
    wa, wb = (torch.exp(x - new).T[..., None].to(acc) for x in (lse_rows, lb.float()))
    out_rows.copy_(out_rows.to(acc) * wa + ob.to(acc) * wb)
    lse_rows.copy_(new)


class _PrefixBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, subtree_end, scale):
        plan, blocks = _PLANS.get((subtree_end,), None, lambda: prefix_block_plan(subtree_end))
        out, lse, *_ = vta._forward(q, k, v, plan, scale)
        out_t, q_t, k_t, v_t = (vta._tokens_major(x) for x in (out, q, k, v))
        for q0, q1, k0, k1 in blocks:
            ob, lb = _full_fwd(q_t[q0:q1], k_t[k0:k1], v_t[k0:k1], scale)
            _merge(out_t[q0:q1], lse[:, q0:q1], ob, lb)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.blocks, ctx.scale = plan, blocks, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        real = vta._bwd
        if not vta._fa4(q):  # FA4's backward takes the merged out / lse; the reference needs telling
            vta._bwd = _segments_bwd_given_lse
        try:
            dq, dk, dv = vta._backward_grads(q, k, v, out, lse, dout, ctx.plan, ctx.scale)
        finally:
            vta._bwd = real
        q_t, k_t, v_t, out_t, dout_t = (vta._tokens_major(x) for x in (q, k, v, out, dout))
        dq_t, dk_t, dv_t = (vta._tokens_major(x) for x in (dq, dk, dv))
        for q0, q1, k0, k1 in ctx.blocks:
            a, b, c = _full_bwd(q_t[q0:q1], k_t[k0:k1], v_t[k0:k1], out_t[q0:q1], dout_t[q0:q1],
                                lse[:, q0:q1].contiguous(), ctx.scale)
            dq_t[q0:q1] += a
            dk_t[k0:k1] += b
            dv_t[k0:k1] += c
        return vta._heads_major(dq_t), vta._heads_major(dk_t), vta._heads_major(dv_t), None, None


def prefix_block_attention(q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor,
                           scale: float | None = None) -> Tensor:
    """Tree attention of ``q [1, H, T, D]``, ``k``/``v [1, Hkv, T, D]`` under ``subtree_end`` (the op's layouts),
    each tree's shared prefix as one full block (module docstring)."""
    return _PrefixBlock.apply(q, k, v, subtree_end, q.shape[-1] ** -0.5 if scale is None else float(scale))
