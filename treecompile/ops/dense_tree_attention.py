"""Tree attention through dense attention kernels (cuDNN, flash): exact decompositions, timed by
``benchmarks/bench_attention.py --dense``.

Measured slower than compiled FlexAttention with the tree BlockMask on an H200 (torch 2.11; numbers
in benchmarks/results/HISTORY.md, "Dense decompositions"), so ``treecompile.compile`` does not use them.  They
live in ``ops/`` (tensors and kernels only, like the other tree-attention ops) rather than in
``benchmarks/`` so that their tests (tests/test_dense_tree_attention.py) import library code and the
comparison can be re-run when the kernels underneath change.

In DFS order the tokens between two consecutive leaves form a chain: the tokens that the path to the
second leaf adds to the tree.  Call it the path's *segment*.  Segments tile the sequence, and a query
of segment ``j`` (``[s_j, e_j)``) sees exactly the keys ``{k < e_j : subtree_end[k] > s_j}``: the
ancestors of the segment's first token, then the segment itself, in path order.  Two exact
decompositions follow, both computing every unmasked entry once and no masked tile:

* **varlen** (``varlen_tree_attention``): one variable-length call whose sequences are the segments
  (queries contiguous in the serialised sequence) against their gathered paths, with the causal
  diagonal aligned bottom-right.  Flash's varlen kernel does that (``backend="flash"``).  cuDNN's
  varlen entry point (``aten._cudnn_attention_forward`` with ``cum_seq_q/k``) is not offered: under
  torch 2.11 it gave wrong outputs (relative error 1-2), took ~50 ms per call and, at T=32k, an
  illegal memory access; torch 2.13's own ``varlen_attn`` no longer routes to it.
* **segmented** (``segmented_tree_attention``): per segment, dense cuDNN attention of the segment to
  itself (causal, top-left aligned since the lengths are equal) and to its gathered prefix (no mask),
  merged by log-sum-exp; the backward calls each piece's cuDNN backward with the merged output and
  log-sum-exp (softmax gradients split exactly over disjoint key sets).  Exact, but one dense call per
  piece, and cuDNN builds an execution plan for every new (s_q, s_kv): 2.4-3.4 s for a new tree.

``tree_varlen_plan(subtree_end)`` builds the segment layout with tensor ops on ``subtree_end``'s
device; ``varlen_tree_attention_reference`` runs it with SDPA, segment by segment (any device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["VarlenTreePlan", "tree_varlen_plan", "varlen_tree_attention", "varlen_tree_attention_reference",
           "segmented_tree_attention"]


@dataclass(frozen=True)
class VarlenTreePlan:
    """Varlen layout of a tree: segment ``j`` is queries ``[cu_q[j], cu_q[j+1])``; its keys are
    ``kv_index[cu_k[j]:cu_k[j+1]]`` (prefix, then the segment itself, in path order)."""

    cu_q: torch.Tensor  # [S+1] int32
    cu_k: torch.Tensor  # [S+1] int32
    kv_index: torch.Tensor  # [N] int64, N = sum of path lengths
    bounds_q: tuple[int, ...]  # cu_q on the host (segment loops need no device sync)
    bounds_k: tuple[int, ...]  # cu_k on the host
    seq_len: int  # T

    @property
    def num_segments(self) -> int:
        return len(self.bounds_q) - 1

    @property
    def max_q(self) -> int:  # longest segment
        return max(b - a for a, b in zip(self.bounds_q, self.bounds_q[1:]))

    @property
    def max_k(self) -> int:  # longest path
        return max(b - a for a, b in zip(self.bounds_k, self.bounds_k[1:]))

    @property
    def path_tokens(self) -> int:
        return self.kv_index.numel()


def tree_varlen_plan(subtree_end: torch.Tensor, *, max_matrix_entries: int = 1 << 26) -> VarlenTreePlan:
    """The varlen plan of a DFS-serialised tree (``q`` sees ``k`` iff ``k <= q < subtree_end[k]``).

    Tensor ops on ``subtree_end``'s device; host synchronisations: one per chunk (the key count) and one
    for the offsets.
    The key sets come from a ``[segments, T]`` comparison made in chunks of at most
    ``max_matrix_entries`` entries.
    """
    if subtree_end.dim() != 1 or subtree_end.numel() == 0:
        raise ValueError(f"subtree_end: expected a non-empty 1-D tensor [T], got shape {tuple(subtree_end.shape)}")
    se = subtree_end.to(torch.int64)
    T = se.numel()
    dev = se.device
    ar = torch.arange(T, device=dev)
    ends = torch.nonzero(se == ar + 1).flatten() + 1  # a token nothing descends from ends a segment
    starts = F.pad(ends[:-1], (1, 0))
    S = ends.numel()
    chunk = max(1, max_matrix_entries // T)
    index, counts = [], []
    for a in range(0, S, chunk):
        s, e = starts[a:a + chunk, None], ends[a:a + chunk, None]
        vis = (ar[None, :] < e) & (se[None, :] > s)
        counts.append(vis.sum(1))
        index.append(torch.nonzero(vis)[:, 1])  # row-major: segment by segment, keys in path order
    counts = torch.cat(counts)
    kv_index = torch.cat(index)
    cu_q = F.pad(ends, (1, 0)).to(torch.int32)
    cu_k = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    host = torch.stack([cu_q, cu_k]).tolist()
    return VarlenTreePlan(cu_q=cu_q, cu_k=cu_k, kv_index=kv_index, bounds_q=tuple(host[0]),
                          bounds_k=tuple(host[1]), seq_len=T)


def _bottom_right_causal(lq: int, lk: int, device) -> torch.Tensor:
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq)


def varlen_tree_attention_reference(q, k, v, plan: VarlenTreePlan, scale=None):
    """Segment-by-segment SDPA over the plan (differentiable, any device): ``q [1, H, T, D]``,
    ``k, v [1, Hkv, T, D]`` -> ``[1, H, T, D]``."""
    gqa = q.shape[1] != k.shape[1]
    cu_q, cu_k = plan.bounds_q, plan.bounds_k
    outs = []
    for j in range(plan.num_segments):
        idx = plan.kv_index[cu_k[j]:cu_k[j + 1]]
        qs = q[:, :, cu_q[j]:cu_q[j + 1]]
        ks, vs = k.index_select(2, idx), v.index_select(2, idx)
        mask = _bottom_right_causal(qs.shape[2], ks.shape[2], q.device)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa))
    return torch.cat(outs, dim=2)


# ------------------------------------------------------------------------------------------ CUDA kernels
def _flash_fwd(q, k, v, plan, scale):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, 0.0, True, False, scale=scale)
    return out, lse, (rng, unused)


def _flash_bwd(do, q, k, v, out, lse, rng, plan, scale):
    return torch.ops.aten._flash_attention_backward(do, q, k, v, out, lse, plan.cu_q, plan.cu_k, plan.max_q,
                                                    plan.max_k, 0.0, True, rng[0], rng[1], scale=scale)


KERNELS = {"flash": (_flash_fwd, _flash_bwd)}


def _gather(x, plan, heads):
    """``[1, Hkv, T, D]`` -> path-ordered ``[N, heads, D]`` (heads repeated when the kernel wants them)."""
    g = x[0].transpose(0, 1).index_select(0, plan.kv_index)
    if heads != g.shape[1]:
        g = g.repeat_interleave(heads // g.shape[1], dim=1)
    return g


class _VarlenTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale, backend, kv_heads):
        fwd, _ = KERNELS[backend]
        qt = q[0].transpose(0, 1).contiguous()  # [T, H, D]
        kg, vg = _gather(k, plan, kv_heads), _gather(v, plan, kv_heads)
        out, lse, rng = fwd(qt, kg, vg, plan, scale)
        ctx.save_for_backward(qt, k, v, out, lse, *rng)
        ctx.plan, ctx.scale, ctx.backend, ctx.kv_heads = plan, scale, backend, kv_heads
        return out.transpose(0, 1).unsqueeze(0)

    @staticmethod
    def backward(ctx, dout):
        qt, k, v, out, lse, *rng = ctx.saved_tensors
        plan = ctx.plan
        _, bwd = KERNELS[ctx.backend]
        kg, vg = _gather(k, plan, ctx.kv_heads), _gather(v, plan, ctx.kv_heads)  # regathered, not saved
        do = dout[0].transpose(0, 1).contiguous()
        dq, dkg, dvg = bwd(do, qt, kg, vg, out, lse, rng, plan, ctx.scale)
        hkv = k.shape[1]

        acc_dtype = torch.float32 if k.element_size() < 4 else k.dtype  # accumulate low precision in float32

        def scatter(dg):  # the gathered keys' gradients summed back onto the tree's keys
            if dg.shape[1] != hkv:
                dg = dg.unflatten(1, (hkv, dg.shape[1] // hkv)).sum(2, dtype=acc_dtype)
            acc = torch.zeros(k.shape[2], hkv, k.shape[3], device=k.device, dtype=acc_dtype)
            acc.index_add_(0, plan.kv_index, dg.to(acc_dtype))
            return acc.to(k.dtype).transpose(0, 1).unsqueeze(0)

        return dq.transpose(0, 1).unsqueeze(0), scatter(dkg), scatter(dvg), None, None, None, None


def varlen_tree_attention(q, k, v, plan: VarlenTreePlan, *, scale=None, backend: str = "flash",
                          native_gqa: bool = True):
    """Tree attention through a dense varlen kernel (CUDA): ``q [1, H, T, D]``, ``k, v [1, Hkv, T, D]``.

    backend: a key of ``KERNELS`` (``"flash"``).  ``native_gqa=False`` repeats k/v heads in the gather for
    kernels without grouped-query support.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    kv_heads = k.shape[1] if native_gqa else q.shape[1]
    return _VarlenTreeAttention.apply(q, k, v, plan, scale, backend, kv_heads)


# ------------------------------------------------------------------ segmented: dense cuDNN per segment
def _cudnn_dense_fwd(q, k, v, causal, scale):
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return r[0], r[1], r[6], r[7]


def _cudnn_dense_bwd(do, q, k, v, out, lse, seed, offset, causal, scale):
    # None reaches the kernel as an undefined tensor: no bias, not nested (an empty tensor would be "defined")
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)


def _rep(x, heads):
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _segment_pieces(plan: VarlenTreePlan) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
    """Per segment ``(s, e, pieces)``; a piece ``(a, b, causal)`` attends the segment's queries to the keys
    ``kv_index[a:b]``.  A segment of m >= 2 tokens: its own keys causally (``causal=True``; the
    keys are then the contiguous ``[s, e)``) and its n prefix keys fully, when n > 0.  A one-token
    segment: its whole path at once, fully (cuDNN refuses s_q = s_kv = 1; n = 0 is handled apart)."""
    cu_q, cu_k = plan.bounds_q, plan.bounds_k
    out = []
    for j in range(plan.num_segments):
        s, e, a, b = cu_q[j], cu_q[j + 1], cu_k[j], cu_k[j + 1]
        m, n = e - s, b - a - (e - s)
        if m == 1:
            pieces = [(a, b, False)] if n else []
        else:
            pieces = [(s, e, True)] + ([(a, a + n, False)] if n else [])
        out.append((s, e, pieces))
    return out


class _SegmentedTreeAttention(torch.autograd.Function):
    """Dense cuDNN attention per segment and piece, merged by log-sum-exp; backward calls each piece's
    backward with the merged output and log-sum-exp (exact: softmax gradients split over key sets)."""

    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        H, T = q.shape[1], q.shape[2]
        segs = _segment_pieces(plan)
        out = torch.empty_like(q)
        lse = torch.empty(1, H, T, device=q.device, dtype=torch.float32 if q.element_size() < 4 else q.dtype)
        philox = None  # cuDNN's dropout seed/offset: any call's (dropout is 0), for the backward calls
        for s, e, pieces in segs:
            qj = q[:, :, s:e]
            if not pieces:  # a lone token: it sees only itself
                out[:, :, s:e] = _rep(v[:, :, s:e], H)
                lse[:, :, s:e] = (qj.float() * _rep(k[:, :, s:e], H).float()).sum(-1) * scale
                continue
            res = []
            for a, b, causal in pieces:
                kj, vj = _piece_kv(k, v, plan, a, b, causal, H)
                o, l, *philox = _cudnn_dense_fwd(qj, kj, vj, causal, scale)
                res.append((o, l.view(1, H, -1)))
            if len(res) == 1:
                out[:, :, s:e], lse[:, :, s:e] = res[0]
            else:
                (oB, lB), (oA, lA) = res
                l = torch.logaddexp(lA, lB)
                out[:, :, s:e] = oA * torch.exp(lA - l)[..., None] + oB * torch.exp(lB - l)[..., None]
                lse[:, :, s:e] = l
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.philox, ctx.segs = plan, scale, philox, segs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        H, Hkv = q.shape[1], k.shape[1]
        dq = torch.zeros_like(q)
        acc = torch.float32 if k.element_size() < 4 else k.dtype  # accumulate low precision in float32
        dk = torch.zeros(1, Hkv, k.shape[2], k.shape[3], device=k.device, dtype=acc)
        dv = torch.zeros_like(dk)

        def fold(g):  # [1, H, n, D] -> [1, Hkv, n, D] (sum over each kv head's query group)
            return g.unflatten(1, (Hkv, H // Hkv)).sum(2, dtype=acc)

        for s, e, pieces in ctx.segs:
            dj = dout[:, :, s:e]
            if not pieces:  # out = v: only v gets a gradient
                dv[:, :, s:e] += fold(dj)
                continue
            qj, oj = q[:, :, s:e], out[:, :, s:e]
            lj = lse[:, :, s:e].unsqueeze(-1).contiguous()  # [1, H, m, 1] as cuDNN returns it
            for a, b, causal in pieces:
                kj, vj = _piece_kv(k, v, plan, a, b, causal, H)
                gq, gk, gv = _cudnn_dense_bwd(dj, qj, kj, vj, oj, lj, *ctx.philox, causal, scale)
                dq[:, :, s:e] += gq
                if causal:  # the segment's own keys: contiguous
                    dk[:, :, a:b] += fold(gk)
                    dv[:, :, a:b] += fold(gv)
                else:
                    idx = plan.kv_index[a:b]
                    dk.index_add_(2, idx, fold(gk))
                    dv.index_add_(2, idx, fold(gv))
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def _piece_kv(k, v, plan, a, b, causal, heads):
    if causal:
        return _rep(k[:, :, a:b], heads), _rep(v[:, :, a:b], heads)
    idx = plan.kv_index[a:b]
    return _rep(k.index_select(2, idx), heads), _rep(v.index_select(2, idx), heads)


def segmented_tree_attention(q, k, v, plan: VarlenTreePlan, *, scale=None):
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return _SegmentedTreeAttention.apply(q, k, v, plan, scale)
