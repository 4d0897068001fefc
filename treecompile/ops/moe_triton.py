"""The routed experts' elementwise work and their sum over ``k`` as Triton kernels (``moe_experts_grouped``).

Between its grouped GEMMs :mod:`treecompile.ops.moe_grouped` runs the SwiGLU activation, the routing weights and,
in the backward, the activation's gradient.  As torch ops on the ``[P, I]`` halves of ``h = [gate, up]`` (``P``:
routed pairs, ``T * k``) that was 3 kernels forward and ~12 backward, each a pass over ``[P, I]`` rows in the
model's dtype: on the Qwen3.5-35B-A3B agentic tree (H100, 4 layers, ``P`` = 122,880, ``I`` = 512) 36 launches and
7.3 ms of a 203 ms step (``results/h100_s25/prof_moe4l_agentic_kept_vs_chunked.txt``).  Here:

- :func:`activation` (forward): ``a_w = w * silu(gate) * up``, one read of ``h``, one write;
- :func:`activation_backward`: from ``h``, ``g = dL/d(w a)`` and ``w``, in one pass: ``dh = [da * up * silu'(gate),
  da * silu(gate)]`` with ``da = w g``, ``a_w = w a`` (the down projection's weight gradient reads it) and
  ``d_w = <g, a>`` per pair (float32);
- :func:`sum_over_k`: ``out[t] = sum_j rows[inv[t k + j]]``, the gather and the sum over a token's ``k`` pairs in
  one pass, in pair order ``j = 0 .. k-1``, instead of a gathered ``[P, D]`` copy and a reduction over it.

Everything is computed in float32 from the model-dtype inputs and rounded once per output (the torch ops
rounded every intermediate to the model's dtype): the results differ from the torch path by that rounding; in
float32 they agree with it to a few ulps (the same math in another order: ``silu`` as ``x * sigmoid(x)``, the sum
over ``I`` in ``d_w`` blocked, the sum over ``k`` in pair order).  The kernels run on CUDA, or on the CPU
under Triton's interpreter (``TRITON_INTERPRET=1``: the tests); :func:`usable` says where.
"""

from __future__ import annotations

import torch
from torch import Tensor

# triton is None on CPU-only installs: moe_grouped keeps its torch ops
from treecompile.ops.triton_support import tl, triton, usable

__all__ = ["activation", "activation_backward", "sum_over_k", "usable"]

BLOCK_P = 16  # pairs (rows) per program
BLOCK_I = 128  # activation columns per step
BLOCK_T = 16  # tokens per program of the sum over k
BLOCK_D = 128  # hidden columns per program of the sum over k


if triton is not None:

    @triton.jit
    def _activation_kernel(H, W, OUT, P, I, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr):
        """OUT[p, i] = W[p] * silu(H[p, i]) * H[p, I + i]."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        m = (rows < P)[:, None] & (cols < I)[None, :]
        h = H + rows[:, None] * (2 * I) + cols[None, :]
        gate = tl.load(h, mask=m, other=0.0).to(tl.float32)
        up = tl.load(h + I, mask=m, other=0.0).to(tl.float32)
        w = tl.load(W + rows, mask=rows < P, other=0.0).to(tl.float32)
        a = gate * tl.sigmoid(gate) * up * w[:, None]
        tl.store(OUT + rows[:, None] * I + cols[None, :], a.to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _activation_bwd_kernel(H, G, W, DH, AW, DW, P, I, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr):
        """From h = [gate, up], g = dL/d(w a), w: DH = [w g up silu'(gate), w g silu(gate)], AW = w a,
        DW[p] = sum_i g a (float32), a = silu(gate) up."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
        rmask = rows < P
        w = tl.load(W + rows, mask=rmask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_P,), tl.float32)
        for start in range(0, I, BLOCK_I):
            cols = start + tl.arange(0, BLOCK_I)
            m = rmask[:, None] & (cols < I)[None, :]
            h = H + rows[:, None] * (2 * I) + cols[None, :]
            gate = tl.load(h, mask=m, other=0.0).to(tl.float32)
            up = tl.load(h + I, mask=m, other=0.0).to(tl.float32)
            g = tl.load(G + rows[:, None] * I + cols[None, :], mask=m, other=0.0).to(tl.float32)
            sig = tl.sigmoid(gate)
            s = gate * sig
            a = s * up
            dw += tl.sum(g * a, 1)
            da = g * w[:, None]
            dh = DH + rows[:, None] * (2 * I) + cols[None, :]
            tl.store(dh, (da * up * sig * (1.0 + gate * (1.0 - sig))).to(DH.dtype.element_ty), mask=m)
            tl.store(dh + I, (da * s).to(DH.dtype.element_ty), mask=m)
            tl.store(AW + rows[:, None] * I + cols[None, :], (a * w[:, None]).to(AW.dtype.element_ty), mask=m)
        tl.store(DW + rows, dw, mask=rmask)

    @triton.jit
    def _sum_over_k_kernel(ROWS, INV, OUT, T, D, K, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """OUT[t] = sum_{j < K} ROWS[INV[t K + j]] (float32, pair order)."""
        tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        tmask = tok < T
        m = tmask[:, None] & (cols < D)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        for j in range(0, K):
            src = tl.load(INV + tok * K + j, mask=tmask, other=0)
            acc += tl.load(ROWS + src[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + tok[:, None] * D + cols[None, :], acc.to(OUT.dtype.element_ty), mask=m)


def _check(h: Tensor, w: Tensor, g: Tensor | None = None) -> tuple[int, int]:
    P, I2 = h.shape
    if I2 % 2 or not h.is_contiguous() or w.shape != (P,) or (g is not None and (g.shape != (P, I2 // 2)
                                                                                   or not g.is_contiguous())):
        raise ValueError(f"moe_triton: expected h [P, 2I] and g [P, I] contiguous, w [P]; got h "
                         f"{tuple(h.shape)}, w {tuple(w.shape)}" + ("" if g is None else f", g {tuple(g.shape)}"))
    return P, I2 // 2


def activation(h: Tensor, w: Tensor) -> Tensor:
    """``[P, I]``: ``w[:, None] * silu(gate) * up`` for ``h = [gate, up]`` ``[P, 2I]`` (float32 math, rounded once)."""
    P, I = _check(h, w)
    out = h.new_empty((P, I))
    if P and I:
        _activation_kernel[(triton.cdiv(P, BLOCK_P), triton.cdiv(I, BLOCK_I))](
            h, w.contiguous(), out, P, I, BLOCK_P=BLOCK_P, BLOCK_I=BLOCK_I)
    return out


def activation_backward(h: Tensor, g: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dh [P, 2I], a_w [P, I], d_w [P] float32)`` for ``g = dL/d(w a)`` ``[P, I]`` (module docstring)."""
    P, I = _check(h, w, g)
    dh, aw = torch.empty_like(h), h.new_empty((P, I))
    dw = torch.empty(P, dtype=torch.float32, device=h.device)  # the kernel writes every row
    if P and I:
        _activation_bwd_kernel[(triton.cdiv(P, BLOCK_P),)](h, g, w.contiguous(), dh, aw, dw, P, I,
                                                          BLOCK_P=BLOCK_P, BLOCK_I=BLOCK_I)
    return dh, aw, dw


def sum_over_k(rows: Tensor, inv: Tensor, T: int, k: int) -> Tensor:
    """``[T, D]``: token ``t`` sums ``rows[inv[t * k + j]]`` over ``j < k`` (``rows [P, D]`` contiguous, ``inv [P]``
    a permutation of the pairs), float32, rounded once."""
    P, D = rows.shape
    if P != T * k or inv.shape != (P,) or not rows.is_contiguous():
        raise ValueError(f"moe_triton.sum_over_k: expected rows [T*k, D] contiguous and inv [T*k] for T={T}, k={k}; "
                         f"got rows {tuple(rows.shape)}, inv {tuple(inv.shape)}")
    out = rows.new_empty((T, D))
    if T and D:
        _sum_over_k_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))](
            rows, inv.contiguous(), out, T, D, k, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D)
    return out
