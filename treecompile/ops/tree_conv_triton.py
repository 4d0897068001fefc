"""``treecompile::tree_conv_shifts_backward``: the tree short conv's backward as three Triton kernels.

The backward of :func:`treecompile.ops.tree_conv_shifts.tree_causal_conv1d_shifts` (same math, same result):
``y[t] = act(bias + w[:, K-1] x[t] + sum_j w[:, K-2-j] x[conv_index[t, j]])``, so with ``dpre = dy * act'``

* ``dx[t] = dpre[t] w[:, K-1] + sum_s [conv_index[t+s, s-1] == t] dpre[t+s] w[:, K-1-s]`` (the shift entries,
  s = 1..K-1) ``+ sum over the exceptions e reading t of dpre[token_e] w[:, K-2-col_e]``;
* ``dw[:, K-1] = sum_t dpre[t] x[t]``, ``dw[:, K-2-j] = sum_t dpre[t] x[conv_index[t, j]]``, ``dbias = sum_t dpre``.

Three kernels, each walking a chunk of ``CHUNK_T`` rows x ``BLOCK_C`` channels per program:

1. ``_dpre_kernel``: ``dpre`` (the pre-activation recomputed from x and its gathered context), written once in
   float32 (float64 for float64 inputs), with the chunk's partial sums of ``dbias`` and ``dw[:, K-1]``;
2. ``_exceptions_kernel``: per source row of the exceptions (``ops.tree_conv_shifts.ContextExceptions``, made on the
   host once per batch), the sum of what its entries send it, and their ``dw`` terms;
3. ``_dx_kernel``: ``dx`` from ``dpre`` read at the row and at the K-1 rows after it (contiguous rows, no gather),
   the exceptions' sums added before the one rounding, and the shift entries' ``dw`` terms from the same products.

The ``dw``/``dbias`` partial sums (one ``[K, C]`` row per program) are reduced by one ``sum``.

Why a kernel of our own: inductor's code for the same math (the session-18 backward, still
``tree_causal_conv1d_shifts_inductor``) recomputes the pre-activation gradient at every shifted position and
fuses the weight-gradient reductions over T into it; fla's varlen conv (``ops.fla_conv``) is slow on few long
segments and costs host work per call (benchmarks/results/HISTORY.md, Session 18).  Where Triton cannot run (CPU without
``TRITON_INTERPRET=1``) the op refuses; ``tree_conv_shifts`` then keeps the traced backward.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from treecompile.ops.tree_conv import check_conv_args
# triton is None on CPU-only installs: tree_conv_shifts then keeps its traced backward
from treecompile.ops.triton_support import available, tl, triton, usable

__all__ = ["available", "usable", "tree_conv_shifts_backward"]

# Block sizes: of 27 configurations on an H100 (bf16, C = 6,144, K = 4; BLOCK_T 16/32/64 x BLOCK_C 64/128/256 x
# CHUNK_T 128/256/512) the fastest on the 16k synthetic and the 32k synthetic tree and within 5 % of it on the 15k
# agentic one: 1.36 / 2.58 / 1.45 ms for the backward against 1.62 / 2.84 / 1.65 ms at (32, 128, 256); BLOCK_C = 256
# spills (7-15 ms).  benchmarks/results/h100_s19/conv_tune.py.
BLOCK_T = 64  # rows per step of a program's walk
BLOCK_C = 64  # channels per program (128 bytes of bf16)
CHUNK_T = 256  # rows per program: its dw/dbias partial sums are one [K, C] row of a [chunks, K, C] tensor
BLOCK_E = 16  # exception entries per step of _exceptions_kernel
SOURCES = 16  # exception sources per program of _exceptions_kernel (one dw partial each)


if triton is not None:

    @triton.jit
    def _dpre_kernel(x_ptr, g_ptr, w_ptr, bias_ptr, ci_ptr, dpre_ptr, dwp_ptr, dbp_ptr, T, C, n_chunks,
                     sxb, sxt, sxc, sgb, sgt, sgc, swc, swk,
                     K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                     ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK_T: tl.constexpr):
        """dpre = dy act'(pre) over rows [chunk * CHUNK_T, +CHUNK_T) x BLOCK_C channels (the pre-activation
        recomputed from x and its gathered context), written in ACC; the chunk's partial sums of dbias and of
        dw[:, K-1] (dpre x: the row's own tap)."""
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        chunk = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        cmask = cols < C
        x_b = x_ptr + b * sxb
        g_b = g_ptr + b * sgb
        w_last = tl.load(w_ptr + cols * swc + (K - 1) * swk, mask=cmask, other=0.0).to(ACC)
        bias = tl.load(bias_ptr + cols, mask=cmask & HAS_BIAS, other=0.0).to(ACC)
        dw_own = tl.zeros((BLOCK_C,), ACC)
        db = tl.zeros((BLOCK_C,), ACC)
        for t0 in range(chunk * CHUNK_T, tl.minimum(chunk * CHUNK_T + CHUNK_T, T), BLOCK_T):
            rows = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            rmask = rows < T
            m2 = rmask[:, None] & cmask[None, :]
            xr = tl.load(x_b + rows[:, None] * sxt + cols[None, :] * sxc, mask=m2, other=0.0).to(ACC)
            pre = xr * w_last[None, :] + bias[None, :]
            for j in tl.static_range(K - 1):
                idx = tl.load(ci_ptr + rows * (K - 1) + j, mask=rmask, other=-1)
                xc = tl.load(x_b + idx[:, None] * sxt + cols[None, :] * sxc,
                             mask=(idx >= 0)[:, None] & cmask[None, :], other=0.0).to(ACC)
                wj = tl.load(w_ptr + cols * swc + (K - 2 - j) * swk, mask=cmask, other=0.0).to(ACC)
                pre += xc * wj[None, :]
            d = tl.load(g_b + rows[:, None] * sgt + cols[None, :] * sgc, mask=m2, other=0.0).to(ACC)
            if SILU:
                sig = 1.0 / (1.0 + tl.exp(-pre))
                d = d * sig * (1.0 + pre * (1.0 - sig))
            tl.store(dpre_ptr + (b * T + rows)[:, None] * C + cols[None, :], d, mask=m2)
            dw_own += tl.sum(d * xr, axis=0)
            db += tl.sum(d, axis=0)
        part = b * n_chunks + chunk
        tl.store(dwp_ptr + (part * KP + K - 1) * C + cols, dw_own, mask=cmask)
        tl.store(dbp_ptr + part * C + cols, db, mask=cmask)

    @triton.jit
    def _exceptions_kernel(x_ptr, dpre_ptr, w_ptr, ptr_ptr, src_ptr, tok_ptr, col_ptr, out_ptr, dwp_ptr, T, C, U,
                           part0, n_parts, sxb, sxt, sxc, swc, swk,
                           K: tl.constexpr, KP: tl.constexpr, ACC: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_C: tl.constexpr, SOURCES: tl.constexpr):
        """For sources [pid1 * SOURCES, +SOURCES) of the exceptions table: out[b, u] = sum over source u's entries
        e of dpre[token_e] w[:, K-2-col_e] (ACC), and the partial sums of dw[:, K-2-col_e] += dpre[token_e]
        x[sources[u]] over those entries (one [KP, BLOCK_C] partial per program, part0 + b * n_parts + pid1)."""
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        u0 = tl.program_id(1) * SOURCES
        b = tl.program_id(2).to(tl.int64)
        ks = tl.arange(0, KP)
        dw = tl.zeros((KP, BLOCK_C), ACC)
        for u in range(u0, tl.minimum(u0 + SOURCES, U)):
            e0 = tl.load(ptr_ptr + u)
            e1 = tl.load(ptr_ptr + u + 1)
            src = tl.load(src_ptr + u)
            xs = tl.load(x_ptr + b * sxb + src * sxt + cols * sxc, mask=cmask, other=0.0).to(ACC)
            acc = tl.zeros((BLOCK_C,), ACC)
            for start in range(e0, e1, BLOCK_E):
                es = start + tl.arange(0, BLOCK_E)
                emask = es < e1
                tok = tl.load(tok_ptr + es, mask=emask, other=0)
                col = tl.load(col_ptr + es, mask=emask, other=0)
                m2 = emask[:, None] & cmask[None, :]
                d = tl.load(dpre_ptr + (b * T + tok)[:, None] * C + cols[None, :], mask=m2, other=0.0)
                wv = tl.load(w_ptr + cols[None, :] * swc + (K - 2 - col)[:, None] * swk, mask=m2, other=0.0).to(ACC)
                acc += tl.sum(d * wv, axis=0)
                # dw[:, K-2-col] += d x[src]: scatter each entry's product into its column's row of dw
                prod = d * xs[None, :]
                for k in tl.static_range(K - 1):
                    dw += tl.where(ks[:, None] == k, tl.sum(tl.where((K - 2 - col == k)[:, None], prod, 0.0),
                                                            axis=0)[None, :], 0.0)
            tl.store(out_ptr + (b * U + u) * C + cols, acc, mask=cmask)
        part = part0 + b * n_parts + tl.program_id(1)
        tl.store(dwp_ptr + (part * KP + ks[:, None]) * C + cols[None, :], dw, mask=(ks[:, None] < K) & cmask[None, :])

    @triton.jit
    def _dx_kernel(x_ptr, dpre_ptr, w_ptr, ci_ptr, slot_ptr, exc_ptr, dx_ptr, dwp_ptr, T, C, U, n_chunks,
                   sxb, sxt, sxc, swc, swk,
                   K: tl.constexpr, KP: tl.constexpr, HAS_EXC: tl.constexpr, ACC: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, CHUNK_T: tl.constexpr):
        """dx over rows [chunk * CHUNK_T, +CHUNK_T) x BLOCK_C channels: the row's own tap, the shift entries of
        the K-1 rows after it (dpre read at t + s where conv_index[t + s, s - 1] == t) and the exceptions' sums;
        with the same products the chunk's partial sums of dw[:, K-1-s] over the shift entries."""
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        chunk = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        cmask = cols < C
        ks = tl.arange(0, KP)
        d_b = dpre_ptr + b * T * C
        dw = tl.zeros((KP, BLOCK_C), ACC)
        w_last = tl.load(w_ptr + cols * swc + (K - 1) * swk, mask=cmask, other=0.0).to(ACC)
        for t0 in range(chunk * CHUNK_T, tl.minimum(chunk * CHUNK_T + CHUNK_T, T), BLOCK_T):
            rows = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
            rmask = rows < T
            m2 = rmask[:, None] & cmask[None, :]
            dx = tl.load(d_b + rows[:, None] * C + cols[None, :], mask=m2, other=0.0) * w_last[None, :]
            xr = tl.load(x_ptr + b * sxb + rows[:, None] * sxt + cols[None, :] * sxc, mask=m2, other=0.0).to(ACC)
            for s in tl.static_range(1, K):
                src = rows + s
                idx = tl.load(ci_ptr + src * (K - 1) + (s - 1), mask=rmask & (src < T), other=-1)
                is_shift = idx == rows
                ds = tl.load(d_b + src[:, None] * C + cols[None, :], mask=is_shift[:, None] & cmask[None, :],
                             other=0.0)
                ws = tl.load(w_ptr + cols * swc + (K - 1 - s) * swk, mask=cmask, other=0.0).to(ACC)
                dx += ds * ws[None, :]
                dw += tl.where(ks[:, None] == K - 1 - s, tl.sum(ds * xr, axis=0)[None, :], 0.0)
            if HAS_EXC:
                slot = tl.load(slot_ptr + rows, mask=rmask, other=-1)
                dx += tl.load(exc_ptr + (b * U + slot)[:, None] * C + cols[None, :],
                              mask=(slot >= 0)[:, None] & cmask[None, :], other=0.0)
            tl.store(dx_ptr + (b * T + rows)[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)
        part = b * n_chunks + chunk
        tl.store(dwp_ptr + (part * KP + ks[:, None]) * C + cols[None, :], dw,
                 mask=(ks[:, None] < K - 1) & cmask[None, :])


def _check(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor) -> None:
    if not usable(x):
        raise ValueError(f"treecompile::tree_conv_shifts_backward: Triton kernels, CUDA tensors only (or "
                         f"TRITON_INTERPRET=1), got {x.device}"
                         + ("" if triton is not None else " and triton is not importable"))
    if grad.shape != x.shape or x.dim() != 3:
        raise ValueError(f"treecompile::tree_conv_shifts_backward: grad {tuple(grad.shape)} and x {tuple(x.shape)} "
                         "must both be [B, T, C]")
    check_conv_args(x.transpose(1, 2), weight, bias, conv_index, None)
    for name, t in (("grad", grad), ("weight", weight), ("bias", bias), ("conv_index", conv_index)):
        if t is not None and t.device != x.device:
            raise ValueError(f"treecompile::tree_conv_shifts_backward: {name} is on {t.device}, x on {x.device}")


@torch.library.custom_op("treecompile::tree_conv_shifts_backward", mutates_args=())
def tree_conv_shifts_backward(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor,
                              silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx [B, T, C] in x's dtype, dw [C, K] in weight's, dbias [C] in bias's or [0])`` of the tree conv whose
    input rows are ``x [B, T, C]`` and whose output rows' gradient is ``grad [B, T, C]`` (any strides; the last
    should be 1 for speed).  Sums are in float32 (float64 for float64 inputs), each output rounded once."""
    from treecompile.ops.tree_conv_shifts import _cached_exceptions

    _check(grad, x, weight, bias, conv_index)
    # rows of C contiguous channels (what the model hands over; a copy otherwise, else every load would be strided)
    grad, x = (t if t.stride(2) == 1 else t.contiguous() for t in (grad, x))
    bias = bias.contiguous() if bias is not None else None
    B, T, C = x.shape
    K = weight.shape[1]
    if x.numel() == 0:
        return (torch.zeros_like(x), torch.zeros_like(weight),
                torch.zeros_like(bias) if bias is not None else weight.new_empty(0))
    acc_dtype = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    ACC = tl.float64 if acc_dtype == torch.float64 else tl.float32
    # the table is kept per conv_index tensor (one per batch, prepared before the graph): look it up with the
    # caller's tensor, never with a copy of it (a copy would miss and rebuild it, a host sync, in every layer)
    exc = _cached_exceptions(conv_index) if K > 1 else None
    ci = conv_index.contiguous()
    U = 0 if exc is None else exc.sources.numel()
    KP = triton.next_power_of_2(K)
    n_chunks, n_src = triton.cdiv(T, CHUNK_T), triton.cdiv(U, SOURCES)
    dpre = torch.empty(B, T, C, dtype=acc_dtype, device=x.device)
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    dwp = torch.empty(B * (n_chunks + n_src), KP, C, dtype=acc_dtype, device=x.device)
    dbp = torch.empty(B * n_chunks, C, dtype=acc_dtype, device=x.device)
    xs = (x.stride(0), x.stride(1), x.stride(2))
    ws = (weight.stride(0), weight.stride(1))
    grid = (triton.cdiv(C, BLOCK_C), n_chunks, B)
    _dpre_kernel[grid](x, grad, weight, bias if bias is not None else weight, ci, dpre, dwp, dbp, T, C, n_chunks,
                       *xs, grad.stride(0), grad.stride(1), grad.stride(2), *ws, K=K, KP=KP,
                       HAS_BIAS=bias is not None, SILU=silu, ACC=ACC, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
                       CHUNK_T=CHUNK_T)
    exc_sums = dpre  # never read without HAS_EXC
    if U:
        exc_sums = torch.empty(B, U, C, dtype=acc_dtype, device=x.device)
        _exceptions_kernel[(triton.cdiv(C, BLOCK_C), n_src, B)](
            x, dpre, weight, exc.source_ptr, exc.sources, exc.source_token, exc.source_column, exc_sums, dwp, T, C,
            U, B * n_chunks, n_src, *xs, *ws, K=K, KP=KP, ACC=ACC, BLOCK_E=BLOCK_E, BLOCK_C=BLOCK_C,
            SOURCES=SOURCES)
    _dx_kernel[grid](x, dpre, weight, ci, exc.source_slot if U else ci, exc_sums, dx, dwp, T, C, U, n_chunks, *xs,
                     *ws, K=K, KP=KP, HAS_EXC=U > 0, ACC=ACC, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, CHUNK_T=CHUNK_T)
    dw = dwp.sum(0)[:K].T.to(weight.dtype).contiguous()
    db = dbp.sum(0).to(bias.dtype) if bias is not None else weight.new_empty(0)
    return dx, dw, db


@tree_conv_shifts_backward.register_fake
def _(grad, x, weight, bias, conv_index, silu):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0))
