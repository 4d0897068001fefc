"""The tree GDN state recurrence of a whole layer in one launch each way: segments wait for their parent's state.

The levelled layer (:mod:`treecompile.ops.fla_gdn_levels`) runs fla's chunk-local kernels once over the layer's
rows, and only the state recurrence (fla's ``chunk_gated_delta_rule_fwd_h``, backward ``_bwd_dhu``) per call of the
plan: a call per tree level, each a Triton launch plus a state gather, and the backward's state-gradient sums.  On a
tree of a dozen levels that is ~50 launches and host operations per layer per step, and a 24-layer hybrid step is
bound by the host (``benchmarks/RESULTS.md``).

Here each recurrence is one launch over every segment of the tree.  The kernels are fla's two recurrence kernels
(``fla/ops/common/chunk_delta_h.py``, flash-linear-attention 0.6, MIT licence; gate ``g`` per head, states
``[K, V]``, ``K <= 256`` in four blocks of 64) with the per-chunk arithmetic unchanged, and two changes where a
segment's state comes from and goes to:

- forward: a segment's program (one per segment, value head and block of ``BV`` values) starts from its parent's
  final state, read from a buffer once the parent's program has published it (a flag per state block, set with
  release semantics after a barrier, waited for with acquire semantics: CUTLASS's ``GenericBarrier`` pattern);
  roots start from ``initial_state`` (or zero).  A segment with children writes its final state to the buffer.
- backward: a segment's state gradient starts from the sum of its children's initial-state gradients, in the order
  of the children (the sum the per-call path forms with ``index_add`` over the next call), each waited for the
  same way; every segment writes its initial-state gradient.

A program only waits for programs of lower id: the segments are numbered in :func:`tree_recurrence` so that every
parent comes before its children (forward) and every child before its parent (backward), and the GPU starts a
grid's programs in increasing id (the assumption every single-pass scan and stream-K kernel makes), so a waited-for
program is running or done.  The order is list scheduling by earliest start: forward by the tokens above a segment's
first token, backward by the tokens below its last one, so the programs that can run first are the first resident.

fla has no tree recurrence (its varlen calls take one initial state per sequence and return final states); this
module is the one place that holds a copy of its kernels' arithmetic.  Under Triton's interpreter (CPU) the programs
run one after the other in id order, so every wait finds its flag set: ``tests/test_fla_tree_recurrence.py`` checks
the kernels there against a float64 reference recurrence, and ``benchmarks/fla_interpret_check.py`` the whole layer
against fla's whole calls, bit for bit.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from treecompile.host_values import to_device_async
from treecompile.ops import fla_tree_recurrence_triton as kernels

__all__ = ["BV", "FALLBACK_CONFIGS", "NUM_STAGES", "NUM_WARPS", "TreeRecurrence", "tree_bwd_dhu", "tree_fwd_h",
           "tree_recurrence"]

# The config both kernels try first (a kernel that waits on flags cannot be autotuned by re-running it): 32 values
# per program gives 4 programs per head and segment at V = 128.  fla 0.6 autotunes BV in {32, 64}, 2 or 4 warps and
# 2-4 stages; these were picked on one H100 (benchmarks/prof_gdn_layer.py, see benchmarks/RESULTS.md).  Where it
# does not fit (shared memory: float32 inputs, K = 256) the launch steps down :data:`FALLBACK_CONFIGS`.
BV = 32
NUM_WARPS = 4
NUM_STAGES = 2
FALLBACK_CONFIGS = ((32, 4, 1), (32, 2, 1), (16, 2, 1))
_FITS: dict = {}  # (kernel, shapes, dtype, first config) -> the first config that fit


@dataclass(frozen=True)
class TreeRecurrence:
    """A tree of ``segments`` (each a contiguous row range ``cu_seqlens[s], cu_seqlens[s + 1]`` of the layer's rows,
    whose chunks start at ``chunk_offsets[s]`` in the chunk-state buffer), as the two kernels read it: device tensors
    (int64 offsets, int32 orders, slots and children), made on the host by :func:`tree_recurrence`."""

    segments: int
    states: int  # final-state slots: the segments with children
    cu_seqlens: Tensor  # [S + 1] int64
    chunk_offsets: Tensor  # [S + 1] int64
    fwd_order: Tensor  # [S] the segment of each forward program group (parents first)
    bwd_order: Tensor  # [S] the segment of each backward program group (children first)
    parent_slot: Tensor  # [S] the slot of the parent's final state, -1 for roots
    state_slot: Tensor  # [S] the slot this segment's final state goes to, -1 when it has no children
    child_ptr: Tensor  # [S + 1] segment s's children are child_idx[child_ptr[s]:child_ptr[s + 1]]
    child_idx: Tensor  # [S - roots] in increasing segment order per parent
    root_groups: tuple[Tensor, ...]  # root segments, in groups summed one after the other (d initial_state)


def tree_recurrence(starts: list[int], lengths: list[int], parents: list[int], device: torch.device, *,
                    chunk_size: int, root_groups: list[list[int]] | None = None) -> TreeRecurrence:
    """The :class:`TreeRecurrence` of segments ``s`` = rows ``[starts[s], starts[s] + lengths[s])`` laid end to end
    in this order (``starts`` increasing from 0, no gap), ``parents[s]`` < s or -1, cut into ``chunk_size``-row
    chunks (fla's: no chunk crosses a segment).  ``root_groups``: how the roots' initial-state gradients are summed
    (default: one group, all roots in order).  Built on the host, copied without blocking."""
    S = len(starts)
    if any(b != a + n for a, n, b in zip(starts, lengths, starts[1:])) or (S and starts[0] != 0):
        raise ValueError("tree_recurrence: segments must lie end to end from row 0")
    for s, p in enumerate(parents):
        if not -1 <= p < s or lengths[s] <= 0:
            raise ValueError(f"segment {s}: parent {p} must come before it, length {lengths[s]} must be positive")
    children: list[list[int]] = [[] for _ in range(S)]
    for s, p in enumerate(parents):
        if p >= 0:
            children[p].append(s)
    slot, states = [-1] * S, 0
    for s in range(S):
        if children[s]:
            slot[s], states = states, states + 1
    above = [0] * S  # tokens on the path above a segment: when it can start, forward
    for s, p in enumerate(parents):
        if p >= 0:
            above[s] = above[p] + lengths[p]
    below = [0] * S  # tokens of the longest path below a segment: when it can start, backward
    for s in range(S - 1, -1, -1):
        if parents[s] >= 0:
            below[parents[s]] = max(below[parents[s]], below[s] + lengths[s])
    groups = root_groups if root_groups is not None else [[s for s in range(S) if parents[s] < 0]]

    def dev(xs, dtype=torch.int32):
        return to_device_async(torch.tensor(xs, dtype=dtype), device)

    return TreeRecurrence(
        segments=S, states=states, cu_seqlens=dev([0, *itertools.accumulate(lengths)], torch.long),
        chunk_offsets=dev([0, *itertools.accumulate(-(-n // chunk_size) for n in lengths)], torch.long),
        fwd_order=dev(sorted(range(S), key=lambda s: (above[s], s))),
        bwd_order=dev(sorted(range(S), key=lambda s: (below[s], -s))),
        parent_slot=dev([slot[p] if p >= 0 else -1 for p in parents]), state_slot=dev(slot),
        child_ptr=dev([0, *itertools.accumulate(len(c) for c in children)]),
        child_idx=dev([c for cs in children for c in cs] or [0]),
        root_groups=tuple(dev(g, torch.long) for g in groups if g))


def tree_fwd_h(k: Tensor, w: Tensor, u: Tensor, g: Tensor, initial_state: Tensor | None, tr: TreeRecurrence,
               chunks: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """fla's ``chunk_gated_delta_rule_fwd_h`` over the whole tree: ``k [1, R, H, K]``, ``w [1, R, Hv, K]``,
    ``u [1, R, Hv, V]``, ``g [1, R, Hv]`` (the chunk-local cumulative log2 decay), ``initial_state [Hv, K, V]``
    (float32) or None for the roots.  Returns ``(h [1, chunks, Hv, K, V], v_new [1, R, Hv, V])``."""
    H, K, Hv, V = k.shape[2], k.shape[3], u.shape[2], u.shape[3]
    if K > 256:
        raise ValueError(f"the GDN recurrence kernel takes key head dims up to 256, got {K}")
    h = k.new_empty(1, chunks, Hv, K, V)
    v_new = torch.empty_like(u)
    states = torch.empty(max(tr.states, 1), Hv, K, V, dtype=torch.float32, device=k.device)
    _launch(kernels.tree_fwd_h_kernel, tr.segments * Hv, V, (K, Hv, H, chunk_size, k.dtype),
            lambda bv: (k, u, w, v_new, g, h, initial_state, states, _flags(tr.states, Hv, V, bv, k.device),
                        tr.cu_seqlens, tr.chunk_offsets, tr.fwd_order, tr.parent_slot, tr.state_slot, k.shape[1]),
            dict(H=H, HV=Hv, K=K, V=V, BT=chunk_size, USE_INITIAL_STATE=initial_state is not None))
    return h, v_new


def tree_bwd_dhu(q: Tensor, k: Tensor, w: Tensor, do: Tensor, dv: Tensor, g: Tensor, scale: float,
                 tr: TreeRecurrence, chunks: int, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """fla's ``chunk_gated_delta_rule_bwd_dhu`` over the whole tree (arguments as :func:`tree_fwd_h`, ``do`` / ``dv``
    ``[1, R, Hv, V]``).  Returns ``(dh [1, chunks, Hv, K, V], dh0 [S, Hv, K, V] float32, dv2 [1, R, Hv, V])``:
    ``dh0[s]`` the gradient of segment s's initial state."""
    H, K, Hv, V = q.shape[2], q.shape[3], do.shape[2], do.shape[3]
    dh = q.new_empty(1, chunks, Hv, K, V)
    dv2 = torch.empty_like(dv)
    dh0 = torch.empty(tr.segments, Hv, K, V, dtype=torch.float32, device=q.device)
    _launch(kernels.tree_bwd_dhu_kernel, tr.segments * Hv, V, (K, Hv, H, chunk_size, q.dtype),
            lambda bv: (q, k, w, g, dh0, do, dh, dv, dv2, _flags(tr.segments, Hv, V, bv, q.device), tr.cu_seqlens,
                        tr.chunk_offsets, tr.bwd_order, tr.child_ptr, tr.child_idx, scale, q.shape[1]),
            dict(H=H, HV=Hv, K=K, V=V, BT=chunk_size))
    return dh, dh0, dv2


def _flags(n: int, Hv: int, V: int, bv: int, device) -> Tensor:
    """One zeroed int32 flag per state block a program publishes: ``n`` states x ``Hv`` heads x value blocks."""
    return torch.zeros(max(n, 1) * Hv * -(-V // bv), dtype=torch.int32, device=device)


def _launch(kernel, groups: int, V: int, key: tuple, args, meta: dict) -> None:
    """``kernel`` over ``groups`` x value-block programs at the first config of (:data:`BV`, :data:`NUM_WARPS`,
    :data:`NUM_STAGES`), then :data:`FALLBACK_CONFIGS`, that fits this GPU (Triton raises ``OutOfResources`` before
    anything runs); the config that fit is remembered per kernel, shapes and dtype.  ``args(bv)``: the positional
    arguments (the flags depend on the value block)."""
    from triton.runtime.errors import OutOfResources

    first = (BV, NUM_WARPS, NUM_STAGES)
    cache_key = (kernel, key, first)
    configs = [_FITS[cache_key]] if cache_key in _FITS else [first, *(c for c in FALLBACK_CONFIGS if c != first)]
    for i, (bv, warps, stages) in enumerate(configs):
        try:
            kernel[(-(-V // bv) * groups,)](*args(bv), BV=bv, num_warps=warps, num_stages=stages, **meta)
        except OutOfResources:
            if i + 1 == len(configs):
                raise
            continue
        _FITS[cache_key] = (bv, warps, stages)
        return
