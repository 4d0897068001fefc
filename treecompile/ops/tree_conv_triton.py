"""``treecompile::tree_conv_shifts_backward``: the tree short conv's backward as two Triton kernels.

The backward of :func:`treecompile.ops.tree_conv_shifts.tree_causal_conv1d_shifts` (same math, same result):
``y[t] = act(bias + w[:, K-1] x[t] + sum_j w[:, K-2-j] x[conv_index[t, j]])``, so with ``dpre = dy * act'``

* ``dx[t] = dpre[t] w[:, K-1] + sum_s [conv_index[t+s, s-1] == t] dpre[t+s] w[:, K-1-s]`` (the shift entries,
  s = 1..K-1) ``+ sum over the exceptions e reading t of dpre[token_e] w[:, K-2-col_e]``;
* ``dw[:, K-1] = sum_t dpre[t] x[t]``, ``dw[:, K-2-j] = sum_t dpre[t] x[conv_index[t, j]]``, ``dbias = sum_t dpre``.

``_exceptions_kernel`` sums, per source row of the exceptions (``ops.tree_conv_shifts.ContextExceptions``, made on
the host once per batch), what its entries send it, in float32 (float64 stays); ``_backward_kernel`` walks each
program's chunk of rows once: it recomputes ``dpre`` at the rows and at the K-1 rows after them (the shift
entries' senders: cache hits, no ``dpre`` tensor is written), writes ``dx`` (the exceptions' sums added before the
one rounding) and the chunk's float32 partial sums of ``dw`` and ``dbias``, which one ``sum`` reduces.

Why a kernel of our own: inductor's code for the same math (the session-18 backward, still
``tree_causal_conv1d_shifts_inductor``) recomputes the pre-activation gradient at every shifted position and
fuses the weight-gradient reductions over T into it; fla's varlen conv (``ops.fla_conv``) is slow on few long
segments and costs host work per call (benchmarks/RESULTS.md, Session 18).  Where Triton cannot run (CPU without
``TRITON_INTERPRET=1``) the op refuses; ``tree_conv_shifts`` then keeps the traced backward.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: tree_conv_shifts keeps its traced backward
    triton = None

__all__ = ["available", "usable", "tree_conv_shifts_backward"]

BLOCK_T = 32  # rows per step of a program's walk
BLOCK_C = 128  # channels per program (256 bytes of bf16: whole sectors)
CHUNK_T = 256  # rows per program: its dw/dbias partial sums are one [K, C] row of a [chunks, K, C] tensor
BLOCK_E = 16  # exception entries per step of _exceptions_kernel


def available() -> bool:
    return triton is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(t: Tensor) -> bool:
    """The kernels can run on ``t``'s device: CUDA with Triton, or anywhere under Triton's CPU interpreter."""
    return triton is not None and (t.is_cuda or _interpreting())


if triton is not None:

    @triton.jit
    def _preact_dpre(x_b, g_b, w_ptr, bias_ptr, ci_ptr, rows, rmask, cols, cmask, sxt, sxc, sgt, sgc, swc, swk,
                     K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr):
        """``dpre`` [BT, BC] at ``rows`` (zero where ``rmask`` is off): the pre-activation recomputed from x."""
        m2 = rmask[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        xr = tl.load(x_b + rows64[:, None] * sxt + cols[None, :] * sxc, mask=m2, other=0.0).to(ACC)
        w_last = tl.load(w_ptr + cols * swc + (K - 1) * swk, mask=cmask, other=0.0).to(ACC)
        pre = xr * w_last[None, :]
        for j in tl.static_range(K - 1):
            idx = tl.load(ci_ptr + rows64 * (K - 1) + j, mask=rmask, other=-1)
            ok = idx >= 0
            xc = tl.load(x_b + idx[:, None] * sxt + cols[None, :] * sxc, mask=ok[:, None] & cmask[None, :],
                         other=0.0).to(ACC)
            wj = tl.load(w_ptr + cols * swc + (K - 2 - j) * swk, mask=cmask, other=0.0).to(ACC)
            pre += xc * wj[None, :]
        if HAS_BIAS:
            pre += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        d = tl.load(g_b + rows64[:, None] * sgt + cols[None, :] * sgc, mask=m2, other=0.0).to(ACC)
        if SILU:
            s = 1.0 / (1.0 + tl.exp(-pre))
            d = d * s * (1.0 + pre * (1.0 - s))
        return d

    @triton.jit
    def _exceptions_kernel(x_ptr, g_ptr, w_ptr, bias_ptr, ci_ptr, ptr_ptr, tok_ptr, col_ptr, out_ptr, T, C, U,
                           sxb, sxt, sxc, sgb, sgt, sgc, swc, swk,
                           K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr):
        """out[b, u, c] = sum over the exceptions e of source u of dpre[token_e] w[c, K-2-col_e] (ACC dtype)."""
        u = tl.program_id(0)
        b = tl.program_id(2).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        e0 = tl.load(ptr_ptr + u)
        e1 = tl.load(ptr_ptr + u + 1)
        acc = tl.zeros((BLOCK_C,), ACC)
        for start in range(e0, e1, BLOCK_E):
            es = start + tl.arange(0, BLOCK_E)
            emask = es < e1
            tok = tl.load(tok_ptr + es, mask=emask, other=0)
            col = tl.load(col_ptr + es, mask=emask, other=0)
            d = _preact_dpre(x_ptr + b * sxb, g_ptr + b * sgb, w_ptr, bias_ptr, ci_ptr, tok, emask, cols, cmask,
                             sxt, sxc, sgt, sgc, swc, swk, K, HAS_BIAS, SILU, ACC)
            wv = tl.load(w_ptr + cols[None, :] * swc + (K - 2 - col)[:, None] * swk,
                         mask=emask[:, None] & cmask[None, :], other=0.0).to(ACC)
            acc += tl.sum(d * wv, axis=0)
        tl.store(out_ptr + (b * U + u) * C + cols, acc, mask=cmask)

    @triton.jit
    def _backward_kernel(x_ptr, g_ptr, w_ptr, bias_ptr, ci_ptr, slot_ptr, exc_ptr, dx_ptr, dwp_ptr, dbp_ptr,
                         T, C, U, n_chunks, sxb, sxt, sxc, sgb, sgt, sgc, swc, swk,
                         K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                         HAS_EXC: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                         CHUNK_T: tl.constexpr):
        """dx over rows [chunk * CHUNK_T, +CHUNK_T) x one BLOCK_C of channels, and that chunk's dw/dbias partials."""
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        chunk = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        cmask = cols < C
        x_b = x_ptr + b * sxb
        g_b = g_ptr + b * sgb
        ks = tl.arange(0, KP)
        dw = tl.zeros((KP, BLOCK_C), ACC)
        db = tl.zeros((BLOCK_C,), ACC)
        for t0 in range(chunk * CHUNK_T, tl.minimum(chunk * CHUNK_T + CHUNK_T, T), BLOCK_T):
            rows = t0 + tl.arange(0, BLOCK_T)
            rmask = rows < T
            rows64 = rows.to(tl.int64)
            m2 = rmask[:, None] & cmask[None, :]
            d = _preact_dpre(x_b, g_b, w_ptr, bias_ptr, ci_ptr, rows, rmask, cols, cmask, sxt, sxc, sgt, sgc,
                             swc, swk, K, HAS_BIAS, SILU, ACC)
            # weight and bias gradients: dpre times what multiplied each weight column
            xr = tl.load(x_b + rows64[:, None] * sxt + cols[None, :] * sxc, mask=m2, other=0.0).to(ACC)
            dw += tl.where(ks[:, None] == K - 1, tl.sum(d * xr, axis=0)[None, :], 0.0)
            for j in tl.static_range(K - 1):
                idx = tl.load(ci_ptr + rows64 * (K - 1) + j, mask=rmask, other=-1)
                ok = idx >= 0
                xc = tl.load(x_b + idx[:, None] * sxt + cols[None, :] * sxc, mask=ok[:, None] & cmask[None, :],
                             other=0.0).to(ACC)
                dw += tl.where(ks[:, None] == K - 2 - j, tl.sum(d * xc, axis=0)[None, :], 0.0)
            db += tl.sum(d, axis=0)
            # input gradient: the row's own tap, then the shift entries of the K-1 rows after it
            w_last = tl.load(w_ptr + cols * swc + (K - 1) * swk, mask=cmask, other=0.0).to(ACC)
            dx = d * w_last[None, :]
            for s in tl.static_range(1, K):
                src = rows + s
                smask = rmask & (src < T)
                idx = tl.load(ci_ptr + src.to(tl.int64) * (K - 1) + (s - 1), mask=smask, other=-1)
                is_shift = smask & (idx == rows64)
                ds = _preact_dpre(x_b, g_b, w_ptr, bias_ptr, ci_ptr, src, is_shift, cols, cmask, sxt, sxc, sgt,
                                  sgc, swc, swk, K, HAS_BIAS, SILU, ACC)
                ws = tl.load(w_ptr + cols * swc + (K - 1 - s) * swk, mask=cmask, other=0.0).to(ACC)
                dx += ds * ws[None, :]
            if HAS_EXC:
                slot = tl.load(slot_ptr + rows64, mask=rmask, other=-1)
                has = slot >= 0
                dx += tl.load(exc_ptr + (b * U + slot.to(tl.int64))[:, None] * C + cols[None, :],
                              mask=has[:, None] & cmask[None, :], other=0.0)
            tl.store(dx_ptr + (b * T + rows64)[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=m2)
        part = b * n_chunks + chunk
        tl.store(dwp_ptr + (part * KP + ks[:, None]) * C + cols[None, :], dw, mask=(ks[:, None] < K) & cmask[None, :])
        if HAS_BIAS:
            tl.store(dbp_ptr + part * C + cols, db, mask=cmask)


def _check(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor) -> None:
    if not usable(x):
        raise ValueError(f"treecompile::tree_conv_shifts_backward: Triton kernels, CUDA tensors only (or "
                         f"TRITON_INTERPRET=1), got {x.device}"
                         + ("" if triton is not None else " and triton is not importable"))
    if grad.shape != x.shape or x.dim() != 3:
        raise ValueError(f"treecompile::tree_conv_shifts_backward: grad {tuple(grad.shape)} and x {tuple(x.shape)} "
                         "must both be [B, T, C]")


@torch.library.custom_op("treecompile::tree_conv_shifts_backward", mutates_args=())
def tree_conv_shifts_backward(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor,
                              silu: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx [B, T, C] in x's dtype, dw [C, K] in weight's, dbias [C] in bias's or [0])`` of the tree conv whose
    input rows are ``x [B, T, C]`` and whose output rows' gradient is ``grad [B, T, C]`` (any strides; the last
    should be 1 for speed).  Sums are in float32 (float64 for float64 inputs), each output rounded once."""
    from treecompile.ops.tree_conv_shifts import _cached_exceptions

    _check(grad, x, weight, bias, conv_index)
    B, T, C = x.shape
    K = weight.shape[1]
    acc_dtype = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    KP = triton.next_power_of_2(K)
    n_chunks = triton.cdiv(T, CHUNK_T)
    dwp = torch.empty(B * n_chunks, KP, C, dtype=acc_dtype, device=x.device)
    dbp = torch.empty(B * n_chunks if bias is not None else 0, C, dtype=acc_dtype, device=x.device)
    if dx.numel() == 0 or K == 0:
        dx.zero_()
        dw = torch.zeros_like(weight)
        db = torch.zeros_like(bias) if bias is not None else weight.new_empty(0)
        return dx, dw, db
    ci = conv_index.contiguous()
    exc = _cached_exceptions(ci) if K > 1 else None
    U = 0 if exc is None else exc.sources.numel()
    ACC = tl.float64 if acc_dtype == torch.float64 else tl.float32
    args = (x.stride(0), x.stride(1), x.stride(2), grad.stride(0), grad.stride(1), grad.stride(2),
            weight.stride(0), weight.stride(1))
    bias_arg = bias if bias is not None else weight  # never read without HAS_BIAS
    if U:
        exc_sums = torch.empty(B, U, C, dtype=acc_dtype, device=x.device)
        _exceptions_kernel[(U, triton.cdiv(C, BLOCK_C), B)](
            x, grad, weight, bias_arg, ci, exc.source_ptr, exc.source_token, exc.source_column, exc_sums, T, C, U,
            *args, K=K, HAS_BIAS=bias is not None, SILU=silu, ACC=ACC, BLOCK_E=BLOCK_E, BLOCK_C=BLOCK_C)
        slots = exc.source_slot
    else:
        exc_sums, slots = dwp, ci  # never read without HAS_EXC
    _backward_kernel[(triton.cdiv(C, BLOCK_C), n_chunks, B)](
        x, grad, weight, bias_arg, ci, slots, exc_sums, dx, dwp, dbp, T, C, U, n_chunks, *args,
        K=K, KP=KP, HAS_BIAS=bias is not None, SILU=silu, HAS_EXC=U > 0, ACC=ACC, BLOCK_T=BLOCK_T,
        BLOCK_C=BLOCK_C, CHUNK_T=CHUNK_T)
    dw = dwp.sum(0)[:K].T.to(weight.dtype).contiguous()
    db = dbp.sum(0).to(bias.dtype) if bias is not None else weight.new_empty(0)
    return dx, dw, db


@tree_conv_shifts_backward.register_fake
def _(grad, x, weight, bias, conv_index, silu):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else weight.new_empty(0))
