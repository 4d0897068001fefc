"""Triton row kernels of ``treecompile::linear_logprobs`` (CUDA, bf16/fp16 logits).

Each program owns one row of a ``[n, V]`` logits chunk and streams it in blocks of ``BLOCK`` columns,
in float32: ``lse_and_target`` with an online max / sum (one read), ``dlogits_`` with
``d = exp(x - lse) * (grad_lse - grad_lp) + [col == target] * grad_lp`` written over the logits
(one read, one write).  The formulas are those of the torch path in ``logprobs.py``.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: logprobs.py keeps its torch path
    triton = None

__all__ = ["available", "lse_and_target", "dlogits_"]

BLOCK = 4096


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _lse_target_kernel(X, T, LP, LSE, V, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride
        m = tl.full((), float("-inf"), tl.float32)
        acc = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            acc = acc * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(acc)
        t = tl.load(T + row)
        xt = tl.load(x_row + t).to(tl.float32)
        tl.store(LSE + row, lse)
        tl.store(LP + row, xt - lse)

    @triton.jit
    def _dlogits_kernel(X, T, LSE, G, GL, V, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride
        lse = tl.load(LSE + row)
        g = tl.load(G + row)
        coef = tl.load(GL + row) - g
        t = tl.load(T + row)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            d = tl.exp(x - lse) * coef + tl.where(cols == t, g, 0.0)
            tl.store(x_row + cols, d.to(X.dtype.element_ty), mask=ok)


def _check(logits, *vecs):
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected a row-major [n, V] tensor, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    n = logits.shape[0]
    for v in vecs:
        if v.shape != (n,) or not v.is_contiguous():
            raise ValueError(f"expected contiguous [{n}] vectors, got {tuple(v.shape)}")


def lse_and_target(logits: torch.Tensor, targets: torch.Tensor, lp_out: torch.Tensor, lse_out: torch.Tensor):
    """``lse_out[i] = logsumexp(logits[i])``, ``lp_out[i] = logits[i, targets[i]] - lse_out[i]`` (float32)."""
    _check(logits, targets, lp_out, lse_out)
    n, V = logits.shape
    if n:
        _lse_target_kernel[(n,)](logits, targets, lp_out, lse_out, V, logits.stride(0), BLOCK=BLOCK, num_warps=8)


def dlogits_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_lp: torch.Tensor,
             grad_lse: torch.Tensor) -> torch.Tensor:
    """Overwrite ``logits`` with d(loss)/d(logits) and return it."""
    _check(logits, targets, lse, grad_lp, grad_lse)
    n, V = logits.shape
    if n:
        _dlogits_kernel[(n,)](logits, targets, lse, grad_lp, grad_lse, V, logits.stride(0), BLOCK=BLOCK,
                              num_warps=8)
    return logits
