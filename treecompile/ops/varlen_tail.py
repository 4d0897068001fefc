"""The varlen tree attention's tail in one Triton kernel each way: the tokens after the segments that each see only
themselves (a length bucket's padding, up to an eighth of a bucket), ``[n, T)`` of a segment plan.

A softmax over one key is exact without a kernel of attention: a tail token's output is its own value row (its kv
head's, for each query head of the group), its log-sum-exp its one score ``scale * q . k``; in the backward its query
and key get no gradient (the softmax's weight is 1 whatever the score) and its value row the sum of its output
gradient over the group's query heads.  Written with torch ops that was three kernels in the forward (the value rows'
copy, a batched dot product, its scaling into the lse rows) and six in the backward (the query rows' zero fill, the
key and value rows' zero fills in the copies' sums, the group sum and its copy, the lse's contiguous copy
for FA4), on every attention layer of a padded batch: 252 launches of a Qwen3-0.6B step on the agentic
parallel-tools tree, whose back-to-back steps are GPU-bound and lose about 4 us between kernels
(benchmarks/results/h200_s51).  Here the forward is one kernel and the backward one; FA4 reads the lse's first
``n`` columns in place where their rows are 16-byte aligned.

One program per tail token and kv head.  The scores' dot products and the group sums accumulate in float32 (float64
for float64 inputs), as :func:`~treecompile.ops.varlen_tree_attention.varlen_attention_reference` does; the group
sums are rounded once, the scores stored as float32 (the lse's dtype).
Where Triton cannot run (CPU without ``TRITON_INTERPRET=1``) the same values come from torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treecompile.ops.triton_support import tl, triton, usable

__all__ = ["tail_forward", "tail_backward"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _shape(q_t: Tensor, k_t: Tensor, n: int) -> tuple[int, int, int]:
    """(tail tokens ``T - n``, kv heads, query heads per kv head) of ``[T, H, D]`` queries over ``[T, Hkv, D]``
    keys."""
    Hkv = k_t.shape[1]
    return q_t.shape[0] - n, Hkv, q_t.shape[1] // Hkv


def tail_forward(q_t: Tensor, k_t: Tensor, v_t: Tensor, out: Tensor, lse: Tensor, n: int, scale: float) -> None:
    """Write ``out[n:]`` (``[T, H, Dv]``: each token's value row for every query head of its kv head's group) and
    ``lse[:, n:]`` (``[H, T]`` float32: ``scale * q . k``, the dot product accumulated in float32 / float64, the
    kernel's ``scale`` a float32) for the tokens ``[n, T)`` that see only themselves; ``q_t [T, H, D]``, ``k_t`` /
    ``v_t`` ``[T, Hkv, D / Dv]``."""
    m, Hkv, r = _shape(q_t, k_t, n)
    if m <= 0:
        return
    if usable(q_t):
        _tail_fwd_kernel[(m, Hkv)](q_t, k_t, v_t, out, lse, n, *_rows(q_t, k_t, v_t, out, lse), float(scale),
                                   **_sizes(q_t, v_t, r))
        return
    acc = _acc(q_t.dtype)
    out[n:].view(m, Hkv, r, -1).copy_(v_t[n:].unsqueeze(2))
    scores = torch.bmm(q_t[n:].reshape(m * Hkv, r, -1).to(acc), k_t[n:].reshape(m * Hkv, -1, 1).to(acc))
    torch.mul(scores.view(m, q_t.shape[1]).T, scale, out=lse[:, n:])


def tail_backward(dout_t: Tensor, dq: Tensor, dk: Tensor, dv: Tensor, n: int) -> None:
    """Write the gradients of the tokens ``[n, T)`` that see only themselves: ``dq[n:]`` and ``dk[n:]`` zero, ``dv[n:]``
    the sum of ``dout_t[n:]`` over each kv head's query heads (accumulated in float32 / float64, rounded once);
    ``dout_t`` / ``dq`` ``[T, H, Dv / D]``, ``dk`` / ``dv`` ``[T, Hkv, D / Dv]``."""
    m, Hkv, r = _shape(dq, dk, n)
    if m <= 0:
        return
    if usable(dq):
        _tail_bwd_kernel[(m, Hkv)](dout_t, dq, dk, dv, n, *_rows(dout_t, dq, dk, dv), **_sizes(dq, dv, r))
        return
    dq[n:].zero_()
    dk[n:].zero_()
    dv[n:] = dout_t[n:].unflatten(1, (Hkv, r)).sum(2, dtype=_acc(dv.dtype))


def _rows(*xs: Tensor) -> tuple[int, ...]:
    """The strides of each tensor but its last, in order (the kernels' stride arguments: token and head of a
    ``[T, heads, D]`` tensor, head of the ``[H, T]`` lse).  The kernels index the last dim as contiguous: any other
    layout is a ValueError (the torch path takes any)."""
    if any(x.stride(-1) != 1 for x in xs):
        raise ValueError("varlen_tail: the kernels read rows whose last dim is contiguous; got strides "
                         f"{[x.stride() for x in xs]}")
    return tuple(s for x in xs for s in x.stride()[:-1])


def _sizes(qd: Tensor, vd: Tensor, r: int) -> dict:
    """The kernels' sizes and meta-parameters: query heads per kv head, the query/key and value head dims, their
    power-of-two blocks, the accumulation type (float64 for float64, else float32) and the warps: one for a
    program's ``[r, max(D, Dv)]`` tile of up to 512 entries (a 0.6B model's 2 x 128), else 4."""
    D, Dv = qd.shape[2], vd.shape[2]
    block_r, block_d, block_dv = (triton.next_power_of_2(x) for x in (r, D, Dv))
    return dict(R=r, D=D, DV=Dv, ACC=tl.float64 if qd.dtype == torch.float64 else tl.float32, BLOCK_R=block_r,
                BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=1 if block_r * max(block_d, block_dv) <= 512 else 4)


if triton is not None:

    @triton.jit
    def _program(n, R, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """A program's tail token ``n + program 0`` and kv head ``program 1`` (int64), the ``BLOCK_R`` query heads of
        its group (the first ``R`` real: mask) and the aranges of the query/key and value head dims."""
        t = n + tl.program_id(0).to(tl.int64)
        g = tl.program_id(1).to(tl.int64)
        j = tl.arange(0, BLOCK_R)
        return t, g, g * R + j, j < R, tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)

    @triton.jit(do_not_specialize=["n"])  # the tail's start changes with every batch: one compiled kernel
    def _tail_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, n, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                         sl_h, scale, R, D, DV, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr):
        """Tail token ``n + program 0``, kv head ``program 1``: the scores of its ``R`` query heads with its key,
        scaled into the lse rows; its value row into their output rows."""
        t, g, heads, rmask, d, e = _program(n, R, BLOCK_R, BLOCK_D, BLOCK_DV)
        k = tl.load(k_ptr + t * sk_t + g * sk_h + d, mask=d < D, other=0.0).to(ACC)
        q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :], mask=rmask[:, None] & (d < D)[None, :],
                    other=0.0).to(ACC)
        s = tl.sum(q * k[None, :], axis=1) * scale
        tl.store(lse_ptr + heads * sl_h + t, s.to(tl.float32), mask=rmask)
        v = tl.load(v_ptr + t * sv_t + g * sv_h + e, mask=e < DV, other=0.0)
        rows = tl.zeros((BLOCK_R, BLOCK_DV), v.dtype) + v[None, :]
        tl.store(out_ptr + t * so_t + heads[:, None] * so_h + e[None, :], rows, mask=rmask[:, None] & (e < DV)[None, :])

    @triton.jit(do_not_specialize=["n"])
    def _tail_bwd_kernel(do_ptr, dq_ptr, dk_ptr, dv_ptr, n, sd_t, sd_h, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, R, D, DV,
                         ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Tail token ``n + program 0``, kv head ``program 1``: zero query rows of its ``R`` query heads and zero key
        row; its value row the sum of their output gradients."""
        t, g, heads, rmask, d, e = _program(n, R, BLOCK_R, BLOCK_D, BLOCK_DV)
        do = tl.load(do_ptr + t * sd_t + heads[:, None] * sd_h + e[None, :], mask=rmask[:, None] & (e < DV)[None, :],
                     other=0.0).to(ACC)
        tl.store(dv_ptr + t * sv_t + g * sv_h + e, tl.sum(do, axis=0).to(dv_ptr.dtype.element_ty), mask=e < DV)
        tl.store(dk_ptr + t * sk_t + g * sk_h + d, tl.zeros((BLOCK_D,), dk_ptr.dtype.element_ty), mask=d < D)
        tl.store(dq_ptr + t * sq_t + heads[:, None] * sq_h + d[None, :],
                 tl.zeros((BLOCK_R, BLOCK_D), dq_ptr.dtype.element_ty), mask=rmask[:, None] & (d < D)[None, :])
