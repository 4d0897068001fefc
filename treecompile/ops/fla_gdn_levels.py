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
to nothing: same kernels, same chunks, same state dtypes (checked bit for bit on CPU with fla's kernels under
Triton's interpreter, and on Hopper in ``tests/test_fla_gdn.py``).  The two recurrence kernels are launched
straight into slices of one buffer per layer (:data:`DIRECT`) unless a backend of fla's dispatch that is
enabled here claims their functions.

A plan without replayed rows is read in place (``level_tensors(..., in_place=True)``, chosen by
``fla_gdn.IN_PLACE`` where the recurrence kernels are launched directly): the chunk-local kernels run over the
segments in DFS order, and each call's recurrence over its segments where they lie, through slots whose
``cu_seqlens`` pairs alternate a segment's range with a backwards gap (no chunk runs there; see
:class:`CallSlice`).  No gather of the inputs, no scatter of the output, the same numbers (bit for bit under
Triton's interpreter, ``benchmarks/fla_interpret_check.py``).

By default (:data:`TREE`, where Triton runs: CUDA, or its interpreter) a plan without replayed rows runs each
recurrence as one launch over the whole tree instead of one per call
(:mod:`treecompile.ops.fla_tree_recurrence`: a segment's programs wait for their parent's final state), so a layer
costs the same host work whatever the tree's depth.

Uses fla's internal (not exported) functions of flash-linear-attention 0.6; :func:`levels_unusable_reason`
says when they are not importable, and the caller then falls back to whole calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from treecompile.host_values import host_copy, to_device_async
from treecompile.ops.fla_gdn import host_chunk_indices, start_states
from treecompile.ops.fla_tree_recurrence import TreeRecurrence, tree_bwd_dhu, tree_fwd_h, tree_recurrence
from treecompile.ops.triton_support import available, interpreting

__all__ = ["LevelTensors", "TREE", "TreeGDNLevels", "level_tensors", "levels_unusable_reason", "tree_usable"]


def levels_unusable_reason() -> str | None:
    """Why fla's chunk-level functions cannot be imported here (None when they can)."""
    try:
        _import_fla_functions()  # not the cached copy: a test may swap fla out of sys.modules
    except ImportError as e:
        return f"fla's chunk-level functions are not importable ({e}); GDN layers run as whole fla calls"
    return None


def _fla():
    """fla's internal functions the levelled path composes, with ``direct``: the recurrence kernels when
    :data:`DIRECT` and :func:`_direct_kernels` allow launching them directly, else None.  A layer's backward uses
    the set its forward used (:data:`DIRECT` may change in between)."""
    return _fla_set(DIRECT)


@functools.cache
def _fla_set(direct: bool) -> dict:
    return dict(_fla_functions(), direct=_direct_kernels() if direct else None)


def _fla_functions():
    """fla's internal functions (imported once)."""
    global _FLA_FUNCTIONS
    if _FLA_FUNCTIONS is None:
        _FLA_FUNCTIONS = _import_fla_functions()
    return _FLA_FUNCTIONS


_FLA_FUNCTIONS = None


def _import_fla_functions():
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


# Run a plan's recurrence as one launch over the whole tree each way (fla_tree_recurrence) where :func:`tree_usable`.
TREE = True


def tree_usable(device: torch.device) -> bool:
    """Whether the layer's recurrence runs as one launch over the tree on ``device``: :data:`TREE`, and Triton runs
    there (a CUDA device, or any device under Triton's interpreter)."""
    return TREE and available() and (device.type == "cuda" or interpreting())


# Launch the recurrence kernels straight into slices of one buffer per layer (no per-call allocation, no cat, no
# trip through fla's backend dispatch) where fla's dispatch has no backend for them (:func:`_direct_kernels`).
DIRECT = True


@functools.cache
def _direct_kernels():
    """fla's two recurrence Triton kernels, or None when a backend of fla's dispatch that is available and
    enabled here could serve the functions that launch them (``chunk_gated_delta_rule_fwd_h`` / ``_bwd_dhu``;
    fla 0.6 has an NPU one and an opt-in inference-only one, ``FLA_INTRACARD_CP``): then those functions are
    called as they are, through the dispatch, and their outputs concatenated."""
    import fla.backends as fb
    from fla.ops.common import chunk_delta_h as m

    names = ("chunk_gated_delta_rule_fwd_h", "chunk_gated_delta_rule_bwd_dhu")
    registries = [fb._operation_registries.get("common")]
    registries += [fb._function_registries.get(fb.unwrap(getattr(m, n))) for n in names]
    for reg in registries:
        for backend in (reg._backends.values() if reg is not None else ()):
            if not (backend.is_available() and backend.is_enabled()):
                continue
            if getattr(backend, "implementation", None) is not None or any(
                    backend.get_implementation(n) is not None for n in names):
                return None
    return m.chunk_gated_delta_rule_fwd_kernel_h_blockdim64, m.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64


def _launch_fwd_h(kernel, k, w, u, g, init, c: CallSlice, h, v_new, final: bool, chunk_size: int):
    """``chunk_gated_delta_rule_fwd_h`` of one call with its outputs written into ``h`` / ``v_new`` (slices of the
    layer's buffers); the arguments are the ones that function passes (fla/ops/common/chunk_delta_h.py)."""
    H, K, HV, V = k.shape[2], k.shape[3], u.shape[2], u.shape[3]
    ht = k.new_zeros(c.segments, HV, K, V, dtype=torch.float32) if final else None
    kernel[lambda meta: (-(-V // meta["BV"]) * c.segments * HV,)](
        k=k, v=u, w=w, v_new=v_new, g=g, gk=None, h=h, h0=init, ht=ht, cu_seqlens=c.cu_seqlens,
        chunk_offsets=c.chunk_offsets, T=k.shape[1], H=H, HV=HV, K=K, V=V, BT=chunk_size, STATE_V_FIRST=False)
    return ht


def _launch_bwd_dhu(kernel, q, k, w, do, dv, g, h0, dht, scale, c: CallSlice, dh, dv2, chunk_size: int):
    """``chunk_gated_delta_rule_bwd_dhu`` of one call with ``dh`` / ``dv2`` written into slices of the layer's
    buffers; returns ``dh0``."""
    H, K, HV, V = q.shape[2], q.shape[3], do.shape[2], do.shape[3]
    dh0 = torch.empty_like(h0, dtype=torch.float32)
    kernel[lambda meta: (-(-V // meta["BV"]) * c.segments * HV,)](
        q=q, k=k, w=w, g=g, gk=None, dht=dht, dh0=dh0, do=do, dh=dh, dv=dv, dv2=dv2, cu_seqlens=c.cu_seqlens,
        chunk_offsets=c.chunk_offsets, scale=scale, T=q.shape[1], H=H, HV=HV, K=K, V=V, BT=chunk_size,
        STATE_V_FIRST=False)
    return dh0


@dataclass(frozen=True)
class CallSlice:
    """One call of the plan inside the laid-out rows: rows ``[lo, hi)``, chunks ``[c_lo, c_hi)``.  Its recurrence
    kernels run one program per slot (and value block and head): ``segments`` slots, slot ``j`` the rows
    ``[cu_seqlens[j], cu_seqlens[j + 1])``.  Gathered rows: a slot per segment of the call.  In place
    (:func:`level_tensors` with ``in_place``): the call's segments in decreasing DFS order with a slot between
    each two, whose ``cu_seqlens`` pair goes backwards (an empty recurrence: no chunk runs, its final state is its
    initial state, and its state gradient, zero, passes through), so every segment reads its rows where they lie."""

    lo: int
    hi: int
    c_lo: int
    c_hi: int
    segments: int  # slots
    cu_seqlens: Tensor  # [slots + 1], relative to lo (device)
    chunk_indices: Tensor | None  # [c_hi - c_lo, 2] (device); None in place (only the direct launches read it)
    chunk_offsets: Tensor  # [slots + 1] first chunk of each slot, relative to c_lo (device)
    source: Tensor | None  # [slots] slot of the previous call's final states; None: roots
    roots: Tensor | None  # [r] the slots of a later call's roots (:attr:`~treecompile.ops.fla_gdn.Wave.roots`)
    members: Tensor | None = None  # [k] the slot of each segment, in the plan's order; None: slot = segment


@dataclass(frozen=True)
class LevelTensors:
    """What :class:`TreeGDNLevels` needs of a :class:`~treecompile.ops.fla_gdn.FlaPlan` at one chunk size,
    made on the host once per plan (:func:`level_tensors`) and copied to the device without blocking."""

    cu_seqlens: Tensor  # [S + 1] every segment of every call, laid end to end (in place: in DFS order) (device)
    chunk_indices: Tensor  # [NT, 2] fla's (segment, chunk) rows over all of them (device)
    calls: tuple[CallSlice, ...]
    chunk_size: int
    in_place: bool = False  # the rows are the tokens in DFS order, read by the calls where they lie
    tree: TreeRecurrence | None = None  # one recurrence launch over the tree (then ``calls`` is empty)


def direct_launches() -> bool:
    """Whether the levelled path launches fla's recurrence kernels itself (:data:`DIRECT` and no fla backend
    claims them): what reading the rows in place needs."""
    return _fla()["direct"] is not None


def level_tensors(plan, chunk_size: int, *, in_place: bool = False, tree: bool = False) -> LevelTensors:
    """The :class:`LevelTensors` of ``plan`` (cached on the plan; each call's chunk indices are the plan's own,
    :meth:`~treecompile.ops.fla_gdn.FlaPlan.chunk_indices`).  ``in_place`` (a plan without replayed rows): the rows
    are the tokens in DFS order, not gathered into call order (:func:`_in_place_tensors`).  ``tree`` (a plan without
    replayed rows): the rows are the tokens in DFS order and each recurrence one launch over the tree
    (:func:`_tree_tensors`)."""
    in_place = in_place and not plan.identity  # rows in DFS order are read as they are either way
    key = ("levels", chunk_size, "tree" if tree else in_place)
    if key not in plan._cache:
        build = _tree_tensors if tree else _in_place_tensors if in_place else _gathered_tensors
        plan._cache[key] = build(plan, chunk_size)
    return plan._cache[key]


def _longs(xs, dev: torch.device) -> Tensor:
    """A host list of ints as an int64 tensor on ``dev``, copied without blocking."""
    return to_device_async(torch.tensor(xs, dtype=torch.long), dev)


def _level_tensors(lengths: list[int], calls: list[CallSlice], chunk_size: int, dev, in_place: bool) -> LevelTensors:
    """:class:`LevelTensors` over segments of these ``lengths``, laid end to end in this order."""
    return LevelTensors(cu_seqlens=_longs([0, *itertools.accumulate(lengths)], dev),
                        chunk_indices=to_device_async(host_chunk_indices(lengths, chunk_size), dev),
                        calls=tuple(calls), chunk_size=chunk_size, in_place=in_place)


def _gathered_tensors(plan, chunk_size: int) -> LevelTensors:
    """:class:`LevelTensors` over the plan's rows gathered into call order: each call a contiguous block."""
    dev = plan.index.device
    calls, c_lo = [], 0
    for i, w in enumerate(plan.waves):
        offsets = [0, *itertools.accumulate(-(-n // chunk_size) for n in w.lengths)]
        calls.append(CallSlice(
            lo=w.lo, hi=w.hi, c_lo=c_lo, c_hi=c_lo + offsets[-1], segments=len(w.lengths), cu_seqlens=w.cu_seqlens,
            chunk_indices=plan.chunk_indices(i, chunk_size)[0], chunk_offsets=_longs(offsets, dev), source=w.source,
            roots=w.roots))
        c_lo += offsets[-1]
    return _level_tensors([n for w in plan.waves for n in w.lengths], calls, chunk_size, dev, in_place=False)


def _dfs_segments(plan, refusal: str) -> list[tuple[int, int]]:
    """``(first DFS token, length)`` of every segment of a plan without replayed rows (each segment's rows are one DFS
    range: ``Wave.starts``, ``Wave.lengths``), in DFS order; a plan with replayed rows raises ``refusal``."""
    if plan.replayed_tokens:
        raise ValueError(refusal)
    return sorted((a, n) for w in plan.waves for a, n in zip(w.starts, w.lengths))


def _in_place_tensors(plan, chunk_size: int) -> LevelTensors:
    """:class:`LevelTensors` that read a plan's rows where they lie in DFS order.  Without replay each segment's rows
    are one DFS range (``Wave.starts``, ``Wave.lengths``); the chunk-local kernels run over all segments in DFS order
    (fla's chunks never cross a segment, so the order of the segments does not change a number), and each call's
    recurrence over its segments through the slots of :class:`CallSlice`: its segments in decreasing DFS order, an
    empty slot between two, so that ``cu_seqlens`` pairs name the segments' own ranges and the gaps go backwards.
    Same kernels over the same chunks as the gathered rows: the same numbers."""
    segs = _dfs_segments(plan, "rows read in place need a plan without replayed rows")
    dev = plan.index.device
    first_chunk, c = {}, 0
    for a, n in segs:
        first_chunk[a] = c
        c += -(-n // chunk_size)
    R = sum(n for _, n in segs)
    calls, slot_of_prev = [], None
    for w in plan.waves:
        order = sorted(range(len(w.starts)), key=lambda j: -w.starts[j])  # members, in decreasing DFS order
        slot = [0] * len(order)
        cu, offsets = [], []
        for m, j in enumerate(order):
            slot[j] = 2 * m
            cu += [w.starts[j], w.starts[j] + w.lengths[j]]
            offsets += [first_chunk[w.starts[j]], 0]  # a gap's chunk offset is never read
        slots = 2 * len(order) - 1
        src = roots = None
        if w.source is not None:
            source = [0] * slots  # gaps: any valid slot (their gradient, zero, adds nothing)
            for j, r in enumerate(host_copy(w.source).tolist()):
                source[slot[j]] = slot_of_prev[r]
            src = _longs(source, dev)
            if w.roots is not None:
                roots = _longs([slot[j] for j in host_copy(w.roots).tolist()], dev)
        calls.append(CallSlice(lo=0, hi=R, c_lo=0, c_hi=c, segments=slots, cu_seqlens=_longs(cu, dev),
                               chunk_indices=None, chunk_offsets=_longs(offsets[:slots] + [0], dev), source=src,
                               roots=roots, members=_longs(slot, dev)))
        slot_of_prev = slot
    return _level_tensors([n for _, n in segs], calls, chunk_size, dev, in_place=True)


def _tree_tensors(plan, chunk_size: int) -> LevelTensors:
    """:class:`LevelTensors` that run a plan without replayed rows as one recurrence over the tree: the rows are the
    tokens in DFS order (each segment one DFS range), each segment's parent the segment its call's ``source`` names
    in the previous call.  The roots' initial-state gradients are summed call by call from the last, as the calls
    sum them."""
    segs = _dfs_segments(plan, "a recurrence over the tree needs a plan without replayed rows")
    dev = plan.index.device
    seg_of = {a: i for i, (a, _) in enumerate(segs)}
    parent, root_groups = [-1] * len(segs), []
    for i, w in enumerate(plan.waves):
        src = host_copy(w.source).tolist() if w.source is not None else None
        roots = set(host_copy(w.roots).tolist()) if w.roots is not None else set()
        group = []
        for j, a in enumerate(w.starts):
            if src is None or j in roots:
                group.append(seg_of[a])
            else:
                parent[seg_of[a]] = seg_of[plan.waves[i - 1].starts[src[j]]]
        root_groups.insert(0, group)
    lengths = [n for _, n in segs]
    tr = tree_recurrence([a for a, _ in segs], lengths, parent, dev, chunk_size=chunk_size, root_groups=root_groups)
    return dataclasses.replace(_level_tensors(lengths, [], chunk_size, dev, in_place=True), tree=tr)


def _recurrence(f, k, w, u, g, inits, L: LevelTensors, *, final_states: bool):
    """``fwd_h`` call after call: per call the chunk states ``h``, the new values and (with ``final_states``) its
    final states; call ``i`` starts from ``inits(i, call, previous call's final states)``.  Returns
    ``(h [1, NT, Hv, K, V], v_new [1, R, Hv, V], initial states per call)``."""
    direct = f["direct"]
    if direct:
        h = k.new_empty(1, len(L.chunk_indices), u.shape[2], k.shape[3], u.shape[3])
        v_new = torch.empty_like(u)
    hs, vs, used, state = [], [], [], None
    for i, c in enumerate(L.calls):
        init = inits(i, c, state)
        r, final = slice(c.lo, c.hi), final_states and i + 1 < len(L.calls)
        if direct:
            state = _launch_fwd_h(direct[0], k[:, r], w[:, r], u[:, r], g[:, r], init, c, h[:, c.c_lo:c.c_hi],
                                  v_new[:, r], final, L.chunk_size)
        else:
            hi, vi, state = f["fwd_h"](
                k=k[:, r], w=w[:, r], u=u[:, r], g=g[:, r], initial_state=init, output_final_state=final,
                chunk_size=L.chunk_size, cu_seqlens=c.cu_seqlens, chunk_indices=c.chunk_indices,
                chunk_offsets=c.chunk_offsets)
            hs.append(hi)
            vs.append(vi)
        used.append(init)
    if not direct:
        h, v_new = _cat(hs), _cat(vs)
    return h, v_new, used


def _add(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a + b


def _cat(xs):
    return xs[0] if len(xs) == 1 else torch.cat(xs, 1)


def _on(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class TreeGDNLevels(torch.autograd.Function):
    """``o [1, R, Hv, V]`` of fla's gated delta rule over the plan's rows (inputs already laid out in call
    order, ``[1, R, ...]``), every segment starting from its source's final state (roots: ``initial_state
    [Hv, K, V]`` or zero).  Arguments as fla's ``chunk_gated_delta_rule`` (``g`` the log decay, ``beta``
    after its sigmoid); see the module docstring for the steps."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, L: LevelTensors, scale: float, l2norm: bool):
        with _on(q.device):  # Triton launches on the current device (fla's ``input_guard`` does the same)
            return TreeGDNLevels._forward(ctx, q, k, v, g, beta, initial_state, L, scale, l2norm)

    @staticmethod
    def backward(ctx, do):
        with _on(do.device):
            return TreeGDNLevels._backward(ctx, do)

    @staticmethod
    def _forward(ctx, q, k, v, g, beta, initial_state, L: LevelTensors, scale: float, l2norm: bool):
        f = _fla()
        if L.in_place and L.tree is None and f["direct"] is None:
            raise RuntimeError("rows read in place need fla's recurrence kernels launched directly (DIRECT)")
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        q_rstd = k_rstd = None
        if l2norm:
            q, q_rstd = f["l2norm_fwd"](q)
            k, k_rstd = f["l2norm_fwd"](k)
        cs, Hv, K, V, g_dtype = L.chunk_size, v.shape[2], k.shape[3], v.shape[3], g.dtype
        if K > 256:  # what fla's own chunk_gated_delta_rule_fwd_h asserts (its kernel holds K in 4 blocks of 64)
            raise ValueError(f"fla's GDN kernels take key head dims up to 256, got {K}")
        g = f["cumsum"](g, chunk_size=cs, scale=f["RCP_LN2"], cu_seqlens=L.cu_seqlens, chunk_indices=L.chunk_indices)
        w, u, A = f["fwd_intra"](k=k, v=v, g=g, beta=beta, cu_seqlens=L.cu_seqlens, chunk_indices=L.chunk_indices,
                                 chunk_size=cs)

        def inits(i, c, prev):
            return start_states(c.source, c.roots, prev, initial_state, c.segments, (Hv, K, V), torch.float32,
                                k.device)

        if L.tree is not None:  # one launch over the tree; the backward runs it again from the root state
            used = [] if initial_state is None else [initial_state.to(torch.float32).contiguous()]
            h, v_new = tree_fwd_h(k, w, u, g, used[0] if used else None, L.tree, len(L.chunk_indices), cs)
        else:
            h, v_new, used = _recurrence(f, k, w, u, g, inits, L, final_states=True)
        o = f["fwd_o"](q=q, k=k, v=v_new, h=h, g=g, scale=scale, cu_seqlens=L.cu_seqlens,
                       chunk_indices=L.chunk_indices, chunk_size=cs)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, *used)
        ctx.f, ctx.L, ctx.scale, ctx.l2norm, ctx.g_dtype = f, L, scale, l2norm, g_dtype
        ctx.init_dtype = None if initial_state is None else initial_state.dtype
        return o.to(q.dtype)

    @staticmethod
    def _backward(ctx, do):
        f = ctx.f
        q, q_rstd, k, k_rstd, v, g, beta, A, *inits = ctx.saved_tensors
        L, scale, cs = ctx.L, ctx.scale, ctx.L.chunk_size
        do = do.contiguous()
        w, u = f["recompute_w_u"](k=k, v=v, beta=beta, A=A, g=g, cu_seqlens=L.cu_seqlens,
                                  chunk_indices=L.chunk_indices)
        if L.tree is not None:
            h, v_new = tree_fwd_h(k, w, u, g, inits[0] if inits else None, L.tree, len(L.chunk_indices), cs)
        else:
            h, v_new, _ = _recurrence(f, k, w, u, g, lambda i, c, prev: inits[i], L, final_states=False)
        dv = f["bwd_dv_local"](q=q, k=k, g=g, do=do, scale=scale, cu_seqlens=L.cu_seqlens,
                               chunk_indices=L.chunk_indices, chunk_size=cs)
        if L.tree is not None:
            dh, dh0, dv2 = tree_bwd_dhu(q, k, w, do, dv, g, scale, L.tree, len(L.chunk_indices), cs)
            d_init = None
            if ctx.needs_input_grad[5]:
                for group in L.tree.root_groups:
                    d_init = _add(d_init, dh0.index_select(0, group).sum(0))
            return TreeGDNLevels._local_backward(ctx, q, q_rstd, k, k_rstd, v, g, beta, A, w, v_new, h, dh, dv2, do,
                                                 d_init)
        direct = f["direct"]
        if direct:
            dh, dv2 = torch.empty_like(h), torch.empty_like(dv)
        dhs, dv2s, dht, d_init = [None] * len(L.calls), [None] * len(L.calls), None, None
        for i in range(len(L.calls) - 1, -1, -1):
            c = L.calls[i]
            r = slice(c.lo, c.hi)
            if direct:
                dh0 = _launch_bwd_dhu(direct[1], q[:, r], k[:, r], w[:, r], do[:, r], dv[:, r], g[:, r], inits[i],
                                      dht, scale, c, dh[:, c.c_lo:c.c_hi], dv2[:, r], cs)
            else:
                dhs[i], dh0, dv2s[i] = f["bwd_dhu"](
                    q=q[:, r], k=k[:, r], w=w[:, r], do=do[:, r], dv=dv[:, r], g=g[:, r], h0=inits[i], dht=dht,
                    scale=scale, cu_seqlens=c.cu_seqlens, chunk_size=cs, chunk_indices=c.chunk_indices,
                    chunk_offsets=c.chunk_offsets)
            if c.source is None:  # (summed in the plan's order of the segments, as whole calls sum them)
                d_init = _add(d_init, (dh0 if c.members is None else dh0.index_select(0, c.members)).sum(0))
                continue
            if c.roots is not None:  # these segments started from the root state: their gradients are its
                d_init = _add(d_init, dh0.index_select(0, c.roots).sum(0))
                dh0 = dh0.index_fill(0, c.roots, 0)
            # the previous call's final states feed the other segments: their gradients
            dht = dh0.new_zeros(L.calls[i - 1].segments, *dh0.shape[1:]).index_add_(0, c.source, dh0)
        if not direct:
            dh, dv2 = _cat(dhs), _cat(dv2s)
        return TreeGDNLevels._local_backward(ctx, q, q_rstd, k, k_rstd, v, g, beta, A, w, v_new, h, dh, dv2, do, d_init)

    @staticmethod
    def _local_backward(ctx, q, q_rstd, k, k_rstd, v, g, beta, A, w, v_new, h, dh, dv2, do, d_init):
        """The chunk-local rest of the backward, once over all rows, from the recurrence's ``dh`` and ``dv2``."""
        f, L, scale, cs = ctx.f, ctx.L, ctx.scale, ctx.L.chunk_size
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
        d_initial = d_init.to(ctx.init_dtype) if ctx.needs_input_grad[5] else None
        return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), d_initial, None, None, None
