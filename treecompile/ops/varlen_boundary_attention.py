"""Boundary tree attention as varlen causal attention over node segments
(``treecompile::tree_attention_boundary_varlen_fwd``).

A partition of a redundancy-free plan attends to its own tokens under the tree rule and to its **boundary**: the
K/V rows of the tokens from the root to the token it hangs below, computed by earlier partitions
(``ops/tree_attention_boundary.py``: query ``q`` sees boundary entry ``j`` iff ``j < boundary_visible[q]`` and local
key ``k`` iff ``k <= q < subtree_end[k]``).  This is the varlen segments op of
:mod:`treecompile.ops.varlen_tree_attention` with one more interval in front of each segment's keys: a segment's
queries ``[a, b)`` whose ``boundary_visible`` is ``beta`` throughout see the boundary rows ``[0, beta)``, then their
local path prefix, then the segment's own tokens up to themselves, which is again bottom-right causal attention of
``b - a`` queries over ``beta + len(prefix) + b - a`` keys.  A segment whose queries see different boundary lengths
is cut where the length changes (the part ``[c, b)`` keeps the prefix and the rows ``[a, c)`` among its keys, and
stays bottom-right causal); a redundancy-free partition never needs a cut, since a segment lies in one subtree of
the partition and every token of a subtree hangs below the same boundary token.  A trailing token that sees only
itself and no boundary (a length bucket's padding: ``TreeProgram.padded_call`` pads ``boundary_visible`` with 0)
is the op's tail, as in the whole-tree op.

The keys are read from ``[boundary ; local]`` rows (``boundary_rows`` + T, the boundary first), gathered per segment
with the whole-tree op's gather, and their gradients summed per source row by its copy sums (one float32 sum over
each row's copies, rounded once); the boundary rows' gradients flow back to the partitions that computed them.
The whole-tree op's FA4 varlen kernels run the segments on CUDA in bf16/fp16 (FA4's launch recorded once per plan,
``ops/fa4_replay.py``); elsewhere its float64-exact reference kernel runs the same plan, so the CPU tests check the
plan, the gather, the sums and the autograd wiring.  K/V heads as the whole-tree op's :data:`KV_HEADS`.

Where the segments would gather more than ``VARLEN_GATHER_LIMIT`` x (T + boundary rows) key rows (a deep
partition whose many short segments each read the whole boundary), :func:`boundary_segments_fit` says so and
``TreeProgram`` runs that batch through the flex lowering (``ops/flex_tree_attention_boundary.py``); the op itself
refuses past ``MAX_GATHER_FACTOR``, naming the sizes.

The gather reads each row where it lies (:func:`~treecompile.ops.key_copies.gather_keys` with the boundary as its
``front`` rows: one Triton kernel), so nothing concatenates ``[boundary ; local]`` (the flex lowering copies B + T rows
of K and of V per layer and saves the copy for its backward).  What it does not do: read the boundary rows where the
ancestors keep them.  The executor gathers a partition's boundary rows from its ancestors' kept rows into one
``[1, Hkv, B, D]`` input per layer (``runtime/redundancy_free.py``), which the op saves for its backward: 0.11 /
0.19 GiB of the 15.2 / 8.1 GiB peaks of Qwen3-0.6B at C = T/2 / T/4 (``benchmarks/results/h200_s55``).

Shapes as ``treecompile::tree_attention_boundary``: ``q [1, H, T, D]``, ``k``/``v`` ``[1, Hkv, T, D]``,
``subtree_end [T]`` int64, ``boundary_k``/``boundary_v`` ``[1, Hkv, B, D]`` (B may be 0), ``boundary_visible [T]``
int64 in ``[0, B]``.  Returns ``[1, H, T, Dv]``.
"""

from __future__ import annotations

import bisect
import math

import torch
from torch import Tensor

from treecompile.host_values import host_copy

from .last_batch import LastBatch
from .varlen_tree_attention import (
    MAX_GATHER_FACTOR,
    MAX_GATHER_ROWS,
    VARLEN_GATHER_LIMIT,
    SegmentPlan,
    _backward_grads,
    _check as _check_qkv,
    _check_nested,
    _forward,
    _heads_major,
    _prefix_intervals,
    _rows,
    _segment_plan,
    _tokens_major,
    _walk,
)

__all__ = ["boundary_segment_plan", "boundary_segments_fit", "tree_attention_boundary_varlen"]


def _visible_host(boundary_visible: Tensor, T: int, boundary_rows: int) -> Tensor:
    """``boundary_visible`` on the host, checked: int64 ``[T]`` with every entry in ``[0, boundary_rows]``
    (ValueError naming the first token that is not)."""
    if boundary_visible.shape != (T,) or boundary_visible.dtype != torch.int64:
        raise ValueError(f"tree_attention_boundary_varlen: boundary_visible must be int64 [T={T}], got "
                         f"{boundary_visible.dtype} {tuple(boundary_visible.shape)}")
    bv = host_copy(boundary_visible)
    bad = ((bv < 0) | (bv > boundary_rows)).nonzero()
    if bad.numel():
        t = int(bad[0, 0])
        raise ValueError(f"boundary_visible[{t}] = {int(bv[t])}: expected 0 <= boundary_visible[t] <= "
                         f"{boundary_rows} (the boundary K/V rows fed)")
    return bv


def _layout(subtree_end: Tensor, boundary_visible: Tensor, boundary_rows: int):
    """The segments' key intervals over ``[boundary ; local]`` rows (flat ``lo, hi`` pairs), both ``cu_seqlens`` and
    the tail, as host lists (module docstring)."""
    w = _walk(subtree_end)
    T = w.se.numel()
    bvt = _visible_host(boundary_visible, T, boundary_rows)
    _check_nested(w)
    Bs = boundary_rows
    cuts = (bvt[1:] != bvt[:-1]).nonzero().flatten().add_(1).tolist()  # where the boundary length changes
    bv = bvt.tolist()
    intervals: list[int] = []
    cu_q, cu_k = [0], [0]
    for j in range(w.n_main):
        a, b = w.starts[j], w.ends[j]
        local = _prefix_intervals(w, j, Bs)  # the ancestors' visible runs, root first, after the boundary rows
        c, x = a, bisect.bisect_right(cuts, a)  # cuts[x]: the first change after a
        while c < b:  # the parts of [a, b) with one boundary length: [c, e)
            e = min(b, cuts[x]) if x < len(cuts) else b
            x += 1
            beta = bv[c]
            if beta:
                intervals += (0, beta)
            intervals += local
            intervals += (Bs + a, Bs + e)
            cu_q.append(e)
            cu_k.append(cu_k[-1] + beta + w.prefix_len[j] + e - a)
            c = e
    # the whole-tree tail's tokens see only themselves locally; those that see boundary rows are segments of their own
    seen = bvt[w.tail:].nonzero()
    tail = w.tail + int(seen[-1, 0]) + 1 if seen.numel() else w.tail
    for t in range(w.tail, tail):
        if bv[t]:
            intervals += (0, bv[t])
        intervals += (Bs + t, Bs + t + 1)
        cu_q.append(t + 1)
        cu_k.append(cu_k[-1] + bv[t] + 1)
    return intervals, cu_q, cu_k, tail


def boundary_segment_plan(subtree_end: Tensor, boundary_visible: Tensor, boundary_rows: int) -> SegmentPlan:
    """The :class:`~treecompile.ops.varlen_tree_attention.SegmentPlan` of one partition (module docstring): its
    ``key_index`` reads ``[boundary (boundary_rows rows) ; local (T rows)]``, its copies sum into those rows, its
    tail is the trailing tokens that see only themselves and no boundary.  Raises ValueError naming the first token
    where ``subtree_end`` is out of bounds or not nested or ``boundary_visible`` is outside ``[0, boundary_rows]``,
    and when the segments would gather more than ``MAX_GATHER_FACTOR`` x the rows plus ``MAX_GATHER_ROWS``."""
    return _segment_plan_of(subtree_end, boundary_rows, _layout(subtree_end, boundary_visible, boundary_rows))


def _segment_plan_of(subtree_end: Tensor, boundary_rows: int, layout) -> SegmentPlan:
    """:func:`boundary_segment_plan` from the partition's :func:`_layout`."""
    intervals, cu_q, cu_k, tail = layout
    G, rows = cu_k[-1], boundary_rows + subtree_end.numel()
    if G > MAX_GATHER_FACTOR * rows + MAX_GATHER_ROWS:
        raise ValueError(f"tree_attention_boundary_varlen: this partition's {len(cu_q) - 1} segments would gather "
                         f"{G:,} key rows for {subtree_end.numel():,} tokens and {boundary_rows:,} boundary rows "
                         f"(at most {MAX_GATHER_FACTOR}x): run it through flex (attention_kernel='flex')")
    lo, hi, first = _rows(intervals, G)
    return _segment_plan(lo, hi, first, cu_q, cu_k, tail, subtree_end.device)


_LAYOUTS = LastBatch()  # the last partition's layout: TreeProgram's fit check and the op's plan read the same one
_PLANS = LastBatch()


def _last_layout(subtree_end: Tensor, boundary_visible: Tensor, boundary_rows: int):
    return _LAYOUTS.get((subtree_end, boundary_visible), boundary_rows,
                        lambda: _layout(subtree_end, boundary_visible, boundary_rows))


def boundary_segments_fit(subtree_end: Tensor, boundary_visible: Tensor, boundary_rows: int) -> bool:
    """Whether this partition's segments gather at most ``VARLEN_GATHER_LIMIT`` x (T + ``boundary_rows``) key rows
    (``TreeProgram`` runs a batch past it through the flex lowering).  Host work over the segments, kept for the op's
    plan of the same tensors."""
    cu_k = _last_layout(subtree_end, boundary_visible, boundary_rows)[2]
    return cu_k[-1] <= VARLEN_GATHER_LIMIT * (subtree_end.numel() + boundary_rows)


def _plan(subtree_end: Tensor, boundary_visible: Tensor, boundary_rows: int) -> SegmentPlan:
    """The partition's plan, kept while the same tensors come back (every attention layer of a partition)."""
    return _PLANS.get((subtree_end, boundary_visible), boundary_rows, lambda: _segment_plan_of(
        subtree_end, boundary_rows, _last_layout(subtree_end, boundary_visible, boundary_rows)))


def _check(q, k, v, subtree_end, boundary_k, boundary_v):
    _check_qkv(q, k, v, subtree_end)
    for name, x, y in (("boundary_k", boundary_k, k), ("boundary_v", boundary_v, v)):
        if x.dim() != 4 or x.shape[:2] != y.shape[:2] or x.shape[3] != y.shape[3] or x.dtype != y.dtype:
            raise ValueError(f"tree_attention_boundary_varlen: {name} must be [1, {y.shape[1]}, B, {y.shape[3]}] "
                             f"{y.dtype}, got {x.dtype} {tuple(x.shape)}")
    if boundary_k.shape[2] != boundary_v.shape[2]:
        raise ValueError(f"tree_attention_boundary_varlen: {boundary_k.shape[2]} boundary key rows, "
                         f"{boundary_v.shape[2]} value rows")


def _front(boundary_k: Tensor, boundary_v: Tensor) -> tuple[Tensor, Tensor]:
    """The boundary's key and value rows ``[B, Hkv, D]``, in front of the partition's own (the plan's key index reads
    ``[boundary ; local]``; the gather reads each where it lies)."""
    return _tokens_major(boundary_k), _tokens_major(boundary_v)


@torch.library.custom_op("treecompile::tree_attention_boundary_varlen_fwd", mutates_args=())
def tree_attention_boundary_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor, boundary_k: Tensor,
                                       boundary_v: Tensor, boundary_visible: Tensor,
                                       scale: float) -> tuple[Tensor, Tensor]:
    """(out ``[1, H, T, Dv]`` as a view of ``[T, H, Dv]`` storage, lse ``[H, T]`` float32): the whole-tree op's
    forward with the boundary rows in front (nothing kept for the backward, which gathers again)."""
    _check(q, k, v, subtree_end, boundary_k, boundary_v)
    plan = _plan(subtree_end, boundary_visible, boundary_k.shape[2])
    return _forward(q, k, v, plan, scale, front=_front(boundary_k, boundary_v))[:2]


@tree_attention_boundary_varlen_fwd.register_fake
def _(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible, scale):
    T, H = q.shape[2], q.shape[1]
    return _heads_major(q.new_empty((T, H, v.shape[-1]))), q.new_empty((H, T), dtype=torch.float32)


@torch.library.custom_op("treecompile::tree_attention_boundary_varlen_bwd", mutates_args=())
def tree_attention_boundary_varlen_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                                       subtree_end: Tensor, boundary_k: Tensor, boundary_v: Tensor,
                                       boundary_visible: Tensor,
                                       scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, d boundary_k, d boundary_v) in the inputs' layouts: the whole-tree op's backward with the boundary
    rows in front, each row's key/value gradient summed over its gathered copies in float32 and rounded once."""
    plan = _plan(subtree_end, boundary_visible, boundary_k.shape[2])
    return _backward_grads(q, k, v, out, lse, dout, plan, scale, front=_front(boundary_k, boundary_v))


@tree_attention_boundary_varlen_bwd.register_fake
def _(q, k, v, out, lse, dout, subtree_end, boundary_k, boundary_v, boundary_visible, scale):
    return tuple(_heads_major(x.new_empty((x.shape[2], x.shape[1], x.shape[3])))
                 for x in (q, k, v, boundary_k, boundary_v))


def _setup(ctx, inputs, output):
    q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, subtree_end, boundary_k, boundary_v, boundary_visible)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, subtree_end, boundary_k, boundary_v, boundary_visible = ctx.saved_tensors
    dq, dk, dv, dbk, dbv = torch.ops.treecompile.tree_attention_boundary_varlen_bwd(
        q, k, v, out, lse, dout, subtree_end, boundary_k, boundary_v, boundary_visible, ctx.scale)
    return dq, dk, dv, None, dbk, dbv, None, None


tree_attention_boundary_varlen_fwd.register_autograd(_backward, setup_context=_setup)


def tree_attention_boundary_varlen(q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor, boundary_k: Tensor,
                                   boundary_v: Tensor, boundary_visible: Tensor, scale: float | None = None) -> Tensor:
    """Boundary tree attention through varlen causal attention over node segments (module docstring)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.treecompile.tree_attention_boundary_varlen_fwd(q, k, v, subtree_end, boundary_k, boundary_v,
                                                                    boundary_visible, float(scale))[0]
