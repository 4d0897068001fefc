"""Tree Gated DeltaNet on CUDA through flash-linear-attention (optional extra ``treecompile[gpu]``).

Same contract as ``treecompile::tree_gated_delta_rule`` (``ops/tree_gdn.py``): every radix node's
segment starts from its parent node's final state (roots: zero or ``initial_state``).  The nodes run in
varlen calls of fla's ``chunk_gated_delta_rule`` (``cu_seqlens``, one ``initial_state`` per segment,
``output_final_state=True``) planned by :func:`plan_calls`: single-child chains merged into one segment,
short parents replayed in front of their children, and every segment whose starting state is known in
the same call (ready sets), so a layer costs ``plan.calls`` fla calls forward and as many backward
(``<=`` the tree levels; ``benchmarks/hybrid_bench.py`` counts both).  By default :func:`cheapest_plan`
picks how much to replay: a call costs ~4.5 ms of host time on H100 whatever its size, a replayed row a
fraction of a microsecond, so the plan of least ``calls * call_cost_rows + rows`` wins.  Each call gets
its chunk indices from the plan (made on the host once per batch: fla would sync the host to derive them).  The inputs are gathered once per
layer into call order (each call reads a contiguous slice), the outputs scattered back once, unless the rows are
the tokens in DFS order already (``FlaPlan.identity``: a prompt and its samples) or the levelled path reads them in
place (:data:`IN_PLACE`, plans without replay); the
starting states are gathered with ``index_select`` from the previous call's final states, so autograd
(fla's own backward, which returns gradients for initial states and takes them for final states)
carries gradients to every ancestor.

By default (:data:`LEVELS`) the calls are not whole fla calls: :mod:`treecompile.ops.fla_gdn_levels` runs fla's
chunk-local kernels once over all the plan's rows and only the state recurrence per call (bit-equal to whole calls
on the same plan), so a call costs far less (:data:`LEVEL_COST_ROWS`) and the plan replays fewer rows.  Where Triton
runs (:func:`tree_usable`) the recurrence is one launch over the whole tree each way
(:mod:`treecompile.ops.fla_tree_recurrence`), the plan has no replay and the number of calls costs nothing.

This is a plain differentiable function, not a registered op: fla's kernels are autograd Functions,
which a registered op's implementation cannot call with autograd.  ``passes.lower_cuda`` calls it in
place of the registered op when the GDN kernel is ``"fla"``.  fla is imported lazily, never at import.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from treecompile.host_values import host_copy, to_device_async, to_device_with_host
from treecompile.ops.last_batch import LastBatch

__all__ = [
    "COMPUTE_DTYPE",
    "CALL_COST_ROWS",
    "CALL_COST_WIDTH",
    "REPLAY_FRACTION",
    "FlaPlan",
    "GATHER_COST_PER_ROW",
    "IN_PLACE",
    "LEVEL_COST_ROWS",
    "LEVELS",
    "LastBatch",
    "Wave",
    "fla_available",
    "fla_unusable_reason",
    "in_place_usable",
    "tree_usable",
    "call_cost_rows",
    "cheapest_plan",
    "default_levels",
    "level_cost_rows",
    "gather_rows",
    "host_chunk_indices",
    "occurrence_groups",
    "plan_calls",
    "prepare",
    "tree_gated_delta_rule_fla",
]

# dtype the fla kernels compute in when the caller passes none: None = the inputs' dtype (fla keeps its
# chunk states h in the input dtype and its final states in float32); torch.float32 upcasts bf16 inputs
# (what the model's own GDN does), at fla's fp32 speed.  benchmarks/gdn_precision.py measures both.
COMPUTE_DTYPE: torch.dtype | None = None

# What one more fla call costs, in GDN rows (``replay_max=None`` picks the plan of least
# ``calls * CALL_COST_ROWS + rows``).  Measured on one H100 (torch 2.11, triton 3.6, fla 0.6, tilelang 0.1.15;
# bf16, 16 q/k and 16 v heads of 128): one layer alone costs ~3.3-4.5 ms of host per call (fla's Python around
# its ~20 kernels; no host sync left) and ~0.31 us of GPU per row, so alone a call is worth ~13k rows; in a
# whole training step the host runs ahead of the GPU's other layers, so less of that shows.  The 24-layer
# Qwen3.5-shaped step (16 x 2,048 POR 0.5, results/h100_s9/hyb_cost_split*) ran 0.522 / 0.507 / 0.582 / 0.794 s
# at 12,288 / 4,096 / 1,024 / 0 rows per call (1 / 2 / 6 / 11 calls): 4,096 is the fastest measured.
# A row's GPU cost grows with the layer's state size (v heads x Dk x Dv), a call's host cost does not:
# :func:`call_cost_rows` scales the measured figure from that layer's width to the caller's.
CALL_COST_ROWS = 4096
CALL_COST_WIDTH = 16 * 128 * 128  # Hv * Dk * Dv of the layer CALL_COST_ROWS was measured on


# What one more call costs on the levelled path (``levels=True``: only the state recurrence runs per call, one
# ``fwd_h`` forward, ``fwd_h`` + ``bwd_dhu`` backward, plus a state gather/scatter), in GDN rows of the same layer
# width as :data:`CALL_COST_WIDTH`.  Measured on one H100 (fla 0.6, tilelang 0.1.15; one 16x128 GDN layer fwd+bwd,
# benchmarks/hybrid_bench.py, results/h100_s17): the plan at 512 ran 8.39 / 6.77 ms on the 16 x 2,048 POR 0.5 / agentic
# parallel-tools trees, against 10.0 / 6.6 at a replay budget of 64 rows and 10.1 / 6.9 without replay (machine 1);
# 7.85 / 6.11 against 9.3 / 6.45 and 11.5 / 6.12 on machine 2: the fastest or within 3 %.
LEVEL_COST_ROWS = 512
# What gathering the rows into call order costs, per row, in GDN rows (:func:`cheapest_plan` adds it to plans
# that are not in DFS order): the five input gathers, the output's, and their backward (`vectorized_gather`,
# `index_copy_`) against the rest of one levelled layer's kernels, same layer as above (results/h100_s33,
# prof_gdn_layer): 0.70 of 3.62 ms (agentic parallel-tools), 0.76 of 4.07 (16 x 2,048 POR 0.5), 0.92 of 4.59
# (a prompt of 2,048 and 16 samples, gathered): 0.24-0.25 of a row's other kernels.
GATHER_COST_PER_ROW = 0.25
# the levelled path by default where fla's chunk-level functions import (tree_gated_delta_rule_fla's ``levels``;
# a compiled program reads it when it is lowered for CUDA, at its first CUDA step)
LEVELS = True


def level_cost_rows(Hv: int, Dk: int, Dv: int) -> int:
    """:data:`LEVEL_COST_ROWS` scaled to a layer of ``Hv`` value heads and head dims ``Dk``, ``Dv``."""
    return max(1, round(LEVEL_COST_ROWS * CALL_COST_WIDTH / max(1, Hv * Dk * Dv)))


def tree_usable(device: torch.device) -> bool:
    """Whether the levelled path runs each recurrence as one launch over the tree on ``device``
    (:func:`treecompile.ops.fla_gdn_levels.tree_usable`)."""
    from treecompile.ops import fla_gdn_levels

    return fla_gdn_levels.tree_usable(device)


def _levels_reason() -> str | None:
    from treecompile.ops.fla_gdn_levels import levels_unusable_reason

    return levels_unusable_reason()


# The levelled path reads the rows of a plan without replay in place, in DFS order (no gather), where it launches
# fla's recurrence kernels itself (fla_gdn_levels.DIRECT); see fla_gdn_levels.level_tensors.
IN_PLACE = True


def in_place_usable() -> bool:
    """Whether the levelled path reads plans without replay in place here: :data:`IN_PLACE` and fla's recurrence
    kernels launched directly."""
    from treecompile.ops.fla_gdn_levels import direct_launches

    return IN_PLACE and direct_launches()


def default_levels() -> bool:
    """What ``levels=None`` means for fla's own kernels here: :data:`LEVELS` and fla's chunk functions import."""
    return LEVELS and _levels_reason() is None


def call_cost_rows(Hv: int, Dk: int, Dv: int) -> int:
    """:data:`CALL_COST_ROWS` for a GDN layer of ``Hv`` value heads and head dims ``Dk``, ``Dv``."""
    return max(1, round(CALL_COST_ROWS * CALL_COST_WIDTH / max(1, Hv * Dk * Dv)))


# cap on replayed rows for an explicit ``replay_max`` (a fraction of the tokens; :func:`plan_calls`)
REPLAY_FRACTION = 0.05


def fla_unusable_reason(device: torch.device | None = None) -> str | None:
    """Why fla cannot serve the tree GDN on ``device`` (None when it can).

    flash-linear-attention 0.6 refuses Triton >= 3.4, < 3.7.1 on Hopper (sm_90) for the gated
    backward (wrong results, fla issue #640) unless tilelang is installed; say so up front instead
    of failing in the first backward.
    """
    try:
        import fla.ops.gated_delta_rule  # noqa: F401  (availability probe)
    except ImportError:
        return "flash-linear-attention is not installed (pip install 'treecompile[gpu]')"
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9:
        import importlib.util

        import triton

        version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
        if (3, 4, 0) <= version < (3, 7, 1) and importlib.util.find_spec("tilelang") is None:
            return (f"flash-linear-attention refuses Triton {triton.__version__} on Hopper for the gated "
                    f"backward (fla #640): upgrade Triton to >= 3.7.1 or install tilelang")
    return None


def fla_available(device: torch.device | None = None) -> bool:
    return fla_unusable_reason(device) is None


@dataclass(frozen=True)
class Wave:
    """One fla call: rows ``[lo, hi)`` of :attr:`FlaPlan.index`, cut into segments by ``cu_seqlens``."""

    lo: int
    hi: int
    cu_seqlens: Tensor  # [k + 1] int64, relative to lo
    source: Tensor | None  # [k] row of the previous call's final states each segment starts from; None: roots
    lengths: tuple[int, ...]  # the k segment lengths, on the host (for :meth:`FlaPlan.chunk_indices`)
    # [r] the segments of a later call that are roots (a root that feeds no segment, such as a length bucket's
    # padding, runs in the last call so that the rows stay in DFS order): they start from the root state, and their
    # ``source`` entries are 0 and unread.  None: no root after the first call.
    roots: Tensor | None = None
    starts: tuple[int, ...] = ()  # the DFS token each segment's own rows start at (after its replayed rows), host


@dataclass(frozen=True)
class FlaPlan:
    """The varlen calls of one tree GDN layer (:func:`plan_calls`).

    ``index [R]``: the DFS token behind every row fed to fla, call after call (a replayed ancestor's
    tokens appear once more, in front of the segment that replays them); ``out_rows [T]``: the row whose
    output is token t's (its own segment's, or for a segment that does not run, the first child's replay
    of it); ``identity``: index and out_rows are ``arange(T)`` (no replay, and the calls' rows already in DFS
    order: one call, or e.g. a prompt and its sampled completions) and the gathers are skipped."""

    index: Tensor
    out_rows: Tensor
    waves: tuple[Wave, ...]
    identity: bool
    replayed_tokens: int
    levels: int  # tree levels (the calls of a per-level schedule)
    # The backward of the input gather, by how many rows read a token: ``(tokens [n], rows [n, c])`` per
    # count c (c = 0: tokens no row reads).  See :func:`gather_rows`.
    occurrences: tuple[tuple[Tensor, Tensor], ...] = ()
    # host-made device tensors per (call or "levels", chunk size): chunk_indices, fla_gdn_levels.level_tensors
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def calls(self) -> int:
        return len(self.waves)

    def rows_read(self, in_place: bool) -> str:
        """How a layer reads this plan's rows (:func:`_rows_read`); ``in_place``: the levelled path can read them
        in place (:func:`in_place_usable`)."""
        return _rows_read(self.identity, self.replayed_tokens > 0, in_place)

    def chunk_indices(self, wave: int, chunk_size: int) -> tuple[Tensor, Tensor]:
        """``(chunk_indices [NT, 2], cu_seqlens_cpu [k + 1])`` of call ``wave`` as fla's
        ``prepare_chunk_indices`` builds them (row j: segment, chunk within the segment), made on the host.

        Without them fla derives the chunk indices from the device ``cu_seqlens`` in every forward call,
        a ``repeat_interleave`` that syncs the host with the GPU (fla/ops/utils/index.py), and its identity
        cache of 4 entries misses when a layer has more calls than that.  Built once per plan and chunk
        size (every layer of a batch reuses them), copied to the device without blocking."""
        key = (wave, chunk_size)
        if key not in self._cache:
            w = self.waves[wave]
            cu_cpu = torch.tensor([0, *itertools.accumulate(w.lengths)], dtype=torch.long)
            self._cache[key] = (to_device_async(host_chunk_indices(w.lengths, chunk_size),
                                                        w.cu_seqlens.device), cu_cpu)
        return self._cache[key]


def host_chunk_indices(lengths, chunk_size: int) -> Tensor:
    """fla's ``chunk_indices [NT, 2]`` of segments of these ``lengths`` (row: segment, chunk within it), on the
    host: what fla's ``prepare_chunk_indices`` derives from the device ``cu_seqlens`` with a host sync."""
    rows = [(s, c) for s, n in enumerate(lengths) for c in range(-(-n // chunk_size))]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 2)


def plan_calls(node_start: Tensor, node_end: Tensor, node_parent: Tensor, *, replay_max: int = 0,
               max_replay_fraction: float | None = None) -> FlaPlan:
    """Group the radix nodes into as few varlen calls as the recurrence allows, exactly.

    1. Chains: a node whose parent has it as its only child and ends where it starts (DFS-adjacent)
       continues the parent's segment: one segment, no state handoff.
    2. Replay (``replay_max > 0``): a segment whose parent segment has at most ``replay_max`` tokens
       starts from the grandparent's final state and runs the parent's tokens again in front of its
       own (repeatedly, while the replayed tokens total at most ``replay_max``); the replayed rows'
       outputs are dropped and their input gradients add up through the gather, so the result is the
       same function.  It removes the short nodes (re-tokenization drift, one-token branches) from the
       critical path at the cost of ``replayed_tokens`` extra rows; a replay that does not lower the
       number of calls (its segment is not on the critical path) is undone.  A segment that no segment
       starts from and that every child replays does not run at all: its outputs are one child's replayed
       rows (so replaying every ancestor costs exactly the per-path rows, in one call).
       ``max_replay_fraction``: while the replayed rows exceed this fraction of the tokens, ``replay_max``
       is halved.
    3. Ready sets: a segment runs in the call after the one that produces its starting state (roots in
       the first), so each call holds every segment whose state is known: ``calls`` = depth of the
       segment tree, at most ``levels``.
    """
    segs = _segments(node_start, node_end, node_parent)
    while True:
        sched = _schedule(segs, replay_max)
        if max_replay_fraction is None or replay_max <= 0 or sched.rows - segs.tokens <= max_replay_fraction * segs.tokens:
            return _materialize(segs, sched, node_start.device)
        replay_max //= 2


@dataclass(frozen=True)
class _Segments:
    """Radix nodes with single-child chains merged (step 1 of :func:`plan_calls`)."""

    start: list[int]
    end: list[int]
    parent: list[int]  # parent segment, -1 for roots
    tokens: int
    levels: int


@dataclass(frozen=True)
class _Schedule:
    """Steps 2-3 of :func:`plan_calls` for one ``replay_max`` (host lists; no tensors yet)."""

    source: list[int]  # segment whose final state each segment starts from (-1: roots)
    replays: list[list[int]]  # ancestor segments each segment runs again in front of its own tokens, top first
    wave: list[int]  # the call each segment runs in; -1: not run (every child replays it)
    calls: int
    rows: int


def _segments(node_start: Tensor, node_end: Tensor, node_parent: Tensor) -> _Segments:
    ns, ne, par = (host_copy(t).tolist() for t in (node_start, node_end, node_parent))
    N = len(ns)
    for n in range(N):
        if ne[n] <= ns[n] or ns[n] != (ne[n - 1] if n else 0) or not -1 <= par[n] < n:
            raise ValueError(f"node {n}: nodes must tile [0, T) in DFS order with non-empty segments and a parent "
                             f"before the child (start {ns[n]}, end {ne[n]}, parent {par[n]})")
    kids = [0] * N
    level = [0] * N
    for n in range(N):
        if par[n] >= 0:
            kids[par[n]] += 1
            level[n] = level[par[n]] + 1
    seg_of, s_start, s_end, s_par = [0] * N, [], [], []
    for n in range(N):
        p = par[n]
        if p >= 0 and kids[p] == 1 and ne[p] == ns[n]:
            seg_of[n] = seg_of[p]
            s_end[seg_of[n]] = ne[n]
        else:
            seg_of[n] = len(s_start)
            s_start.append(ns[n])
            s_end.append(ne[n])
            s_par.append(seg_of[p] if p >= 0 else -1)
    return _Segments(s_start, s_end, s_par, tokens=ne[-1] if N else 0, levels=max(level) + 1 if N else 0)


def _schedule(segs: _Segments, replay_max: int) -> _Schedule:
    s_start, s_end, s_par = segs.start, segs.end, segs.parent
    S = len(s_start)
    length = [e - b for b, e in zip(s_start, s_end)]
    # 2. replay: each segment's source (whose final state it starts from) and replayed ancestors
    source, replays, wave = [-1] * S, [[] for _ in range(S)], [0] * S
    for s in range(S):
        src, budget = s_par[s], replay_max
        while src >= 0 and length[src] <= budget:
            budget -= length[src]
            replays[s].insert(0, src)
            src = s_par[src]
        source[s] = src
        wave[s] = wave[src] + 1 if src >= 0 else 0
    # a replay pays off only on the critical path: undo those whose segment ends below the last call anyway
    # (top-down, so every source's wave is final; ``height`` over source edges bounds what hangs below)
    height = [0] * S
    for s in range(S - 1, -1, -1):
        if source[s] >= 0:
            height[source[s]] = max(height[source[s]], height[s] + 1)
    total = max(wave) + 1 if S else 0
    for s in range(S):
        if replays[s]:
            alt = wave[s_par[s]] + 1
            if alt + height[s] < total:
                source[s], replays[s] = s_par[s], []
        wave[s] = wave[source[s]] + 1 if source[s] >= 0 else 0
    # a segment that no segment starts from and whose every running child replays it need not run: its
    # outputs are read from a replay of it.  Bottom-up, so a child that does not run is decided first: the
    # running segments below it that replay it start above it (it is no source), and not from this segment
    # (no source either), so they replay this segment too.
    children = [[] for _ in range(S)]
    for s in range(S):
        if s_par[s] >= 0:
            children[s_par[s]].append(s)
    is_source = [False] * S
    for s in range(S):
        if source[s] >= 0:
            is_source[source[s]] = True
    for s in range(S - 1, -1, -1):
        if children[s] and not is_source[s] and all(wave[c] < 0 or (replays[c] and replays[c][-1] == s)
                                                    for c in children[s]):
            wave[s] = -1
    rows = sum(length[s] + sum(length[a] for a in replays[s]) for s in range(S) if wave[s] >= 0)
    if rows == segs.tokens and (in_order := _roots_delayed(wave, source, is_source)) is not None:
        wave = in_order
    return _Schedule(source, replays, wave, calls=max(wave) + 1 if S else 0, rows=rows)


def _roots_delayed(wave: list[int], source: list[int], is_source: list[bool]) -> list[int] | None:
    """``wave`` with every root segment that feeds no segment (a length bucket's padding, a lone path) moved to
    the call of the segment before it in DFS order, where that makes the calls go forward in DFS order throughout
    (then the rows need no gather); None where it does not.  Such a root starts from the root state in any call."""
    out, top = [], 0
    for s, w in enumerate(wave):
        if w < top:
            if source[s] >= 0 or is_source[s]:
                return None
            w = top
        out.append(w)
        top = w
    return out


def start_states(source: Tensor | None, roots: Tensor | None, prev: Tensor | None, root_state: Tensor | None,
                 segments: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The states ``[segments, Hv, Dk, Dv]`` a call's segments start from: rows ``source`` of the previous call's
    final states ``prev``, and at ``roots`` (every segment where ``source`` is None) ``root_state [Hv, Dk, Dv]``
    (zeros where None).  Differentiable in ``prev`` and ``root_state``."""
    if source is None or roots is not None:
        n = segments if source is None else len(roots)
        root = (root_state.to(dtype).expand(n, *shape) if root_state is not None
                else torch.zeros(n, *shape, dtype=dtype, device=device))
        if source is None:
            return root.contiguous()
    init = prev.index_select(0, source)
    return init if roots is None else init.index_copy(0, roots, root)


def _rows_read(in_dfs_order: bool, replayed: bool, in_place: bool) -> str:
    """``"in DFS order"`` (the rows are the tokens: nothing to gather), ``"in place"`` (the levelled path reads a plan
    without replayed rows where they lie) or ``"gathered"`` (into call order, and the output gathered back)."""
    return "in DFS order" if in_dfs_order else "in place" if in_place and not replayed else "gathered"


def _in_dfs_order(sched: _Schedule, tokens: int) -> bool:
    """Whether the schedule's rows are the tokens in DFS order (``index == arange(T)``): no replayed rows, every
    segment runs, and the calls never go back in DFS order (segments are numbered in DFS order and laid out call
    after call, in increasing number within a call).  Then :func:`tree_gated_delta_rule_fla` gathers nothing."""
    wave = sched.wave
    return sched.rows == tokens and all(w >= 0 for w in wave) and all(a <= b for a, b in zip(wave, wave[1:]))


def _materialize(segs: _Segments, sched: _Schedule, dev: torch.device) -> FlaPlan:
    """The plan's tensors: made on the host from ranges (one ``arange`` per segment, not a Python int per row),
    then copied to ``dev`` without blocking (:func:`to_device_async`: a blocking copy would wait for the GPU's
    queue, and the plan is made inside the graph, at the first GDN layer)."""
    s_start, s_end, T = segs.start, segs.end, segs.tokens
    S = len(s_start)
    by_wave: list[list[int]] = [[] for _ in range(sched.calls)]
    for s in range(S):
        if sched.wave[s] >= 0:
            by_wave[sched.wave[s]].append(s)
    pieces: list[tuple[int, int]] = []  # the rows, in order: token ranges [a, b)
    out_rows = torch.full((T,), -1, dtype=torch.long)
    has_out = [False] * S
    row_in_wave = [0] * S
    waves, rows = [], 0

    def run(seg: int, out: bool):
        nonlocal rows
        a, b = s_start[seg], s_end[seg]
        if out:
            out_rows[a:b] = torch.arange(rows, rows + b - a)
            has_out[seg] = True
        pieces.append((a, b))
        rows += b - a

    for w, members in enumerate(by_wave):
        lo, cu = rows, [0]
        for r, s in enumerate(members):
            row_in_wave[s] = r
            for a in sched.replays[s]:  # a skipped ancestor's outputs: its first replayed rows
                run(a, sched.wave[a] < 0 and not has_out[a])
            run(s, True)
            cu.append(rows - lo)
        src = roots = None
        if w:  # (their host values kept: the in-place layout reads them without waiting for the device)
            src = to_device_with_host(torch.tensor([row_in_wave[sched.source[s]] if sched.source[s] >= 0 else 0
                                                    for s in members], dtype=torch.long), dev)
            if r := [i for i, s in enumerate(members) if sched.source[s] < 0]:
                roots = to_device_with_host(torch.tensor(r, dtype=torch.long), dev)
        waves.append(Wave(lo, rows, to_device_async(torch.tensor(cu, dtype=torch.long), dev), src,
                          tuple(b - a for a, b in zip(cu, cu[1:])), roots, tuple(s_start[s] for s in members)))
    identity = _in_dfs_order(sched, T)
    host_index = (torch.cat([torch.arange(a, b) for a, b in pieces]) if pieces
                  else torch.zeros(0, dtype=torch.long))
    return FlaPlan(index=to_device_async(host_index, dev), out_rows=to_device_async(out_rows, dev),
                   waves=tuple(waves), identity=identity, replayed_tokens=rows - T, levels=segs.levels,
                   occurrences=() if identity else occurrence_groups(host_index, T, dev))


def occurrence_groups(index: Tensor, tokens: int, device: torch.device | None = None
                      ) -> tuple[tuple[Tensor, Tensor], ...]:
    """``index [R]`` (values in ``[0, tokens)``) grouped by how often each value occurs: per count c, in
    increasing c, ``(values [n], rows [n, c])`` where ``index[rows[i, j]] == values[i]`` (rows in increasing
    order).  Made on the host; the tensors are moved to ``device``."""
    index = index.cpu()
    move = (lambda t: t) if device is None else (lambda t: to_device_async(t, device))
    counts = torch.bincount(index, minlength=tokens)
    # a value read once has its one row by a scatter; only the rows of values read several times (the replayed
    # tokens, a few) are sorted, stably, into the rows of the first such value, then of the next, ...
    once = torch.empty(tokens, dtype=torch.int64).index_put_((index,), torch.arange(index.numel()))
    multi = torch.nonzero(counts.index_select(0, index) > 1).flatten()
    order = multi.index_select(0, torch.argsort(index.index_select(0, multi), stable=True))
    several = torch.where(counts > 1, counts, 0)
    starts = torch.cumsum(several, 0) - several
    groups = []
    for c in torch.nonzero(torch.bincount(counts)).flatten().tolist():  # the distinct counts, increasing
        values = torch.nonzero(counts == c).flatten()
        if c == 0:
            rows = values.new_empty(len(values), 0)
        elif c == 1:
            rows = once.index_select(0, values)[:, None]
        else:
            rows = order[starts.index_select(0, values)[:, None] + torch.arange(c)]
        groups.append((move(values), move(rows)))
    return tuple(groups)


class _GatherRows(torch.autograd.Function):
    """``x.index_select(1, index)`` whose backward sums each token's rows per occurrence group: one gather,
    one sum over the group's rows and one collision-free ``index_copy_`` per distinct count, instead of
    ``index_add`` (atomics that collide wherever a token is replayed, and round at every add in bf16)."""

    @staticmethod
    def forward(ctx, x, index, groups):
        ctx.groups, ctx.tokens = groups, x.shape[1]
        return x.index_select(1, index)

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[0], ctx.tokens, *grad.shape[2:])
        for values, rows in ctx.groups:
            n, c = rows.shape
            if c == 0:
                out.index_fill_(1, values, 0)
                continue
            part = grad.index_select(1, rows.flatten())
            part = part if c == 1 else part.unflatten(1, (n, c)).sum(2)  # in grad's dtype, rounded once
            out.index_copy_(1, values, part)
        return out, None, None


def gather_rows(x: Tensor, index: Tensor, groups: tuple[tuple[Tensor, Tensor], ...]) -> Tensor:
    """``x.index_select(1, index)`` (x ``[B, T, ...]``); ``groups`` = :func:`occurrence_groups` of index.
    Same values and gradient (up to the order of the sum per token)."""
    return _GatherRows.apply(x, index, groups)


def cheapest_plan(node_start: Tensor, node_end: Tensor, node_parent: Tensor, *,
                  call_cost_rows: int = CALL_COST_ROWS, in_place: bool = False) -> FlaPlan:
    """The :func:`plan_calls` plan of least ``calls * call_cost_rows + rows`` (plus
    :data:`GATHER_COST_PER_ROW` per row where the rows must be gathered: not the tokens in DFS order, or with
    ``in_place`` (the levelled path reads plans without replay in place), replayed) over ``replay_max`` in
    0, 1, 2, 4, ... up to the tokens (all replayed: one call, the per-path rows), no fraction cap.  The
    candidates are planned on the host; only the chosen one is copied to the nodes' device."""
    segs = _segments(node_start, node_end, node_parent)
    best, best_cost, r = None, None, 0
    while True:
        sched = _schedule(segs, r)
        read = _rows_read(_in_dfs_order(sched, segs.tokens), sched.rows > segs.tokens, in_place)
        gather = GATHER_COST_PER_ROW * sched.rows if read == "gathered" else 0.0
        cost = sched.calls * call_cost_rows + sched.rows + gather
        if best is None or cost < best_cost:
            best, best_cost = sched, cost
        if r >= segs.tokens or sched.calls <= 1:
            return _materialize(segs, best, node_start.device)
        r = min(segs.tokens, max(1, 2 * r))


_PLANS = LastBatch()  # the plan of the last batch


def _cached_plan(node_start, node_end, node_parent, replay_max, cost_rows=CALL_COST_ROWS, in_place=False):
    """The plan of :func:`tree_gated_delta_rule_fla`, once per batch (:class:`LastBatch`)."""
    tensors = (node_start, node_end, node_parent)

    def build():
        return (cheapest_plan(*tensors, call_cost_rows=cost_rows, in_place=in_place) if replay_max is None
                else plan_calls(*tensors, replay_max=replay_max, max_replay_fraction=REPLAY_FRACTION))

    return _PLANS.get(tensors, (replay_max, (cost_rows, in_place) if replay_max is None else None), build)


def _layer_plan(node_start: Tensor, node_end: Tensor, node_parent: Tensor, Hv: int, Dk: int, Dv: int,
                device: torch.device, *, replay_max: int | None, levels: bool, chunk_size: int):
    """The batch's plan as a layer of these head counts and dims runs it (:func:`tree_gated_delta_rule_fla`, after
    ``levels`` is resolved): ``(plan, how its rows are read, the levelled path's tensors or None)``.  Built once
    per batch: the plan is kept per batch (:func:`_cached_plan`), its level tensors on the plan."""
    cost = level_cost_rows(Hv, Dk, Dv) if levels else call_cost_rows(Hv, Dk, Dv)
    tree = levels and tree_usable(device)
    if tree and replay_max is None:  # one recurrence launch over the tree: calls cost nothing, replay only rows
        replay_max = 0
    in_place = levels and (tree or in_place_usable())
    plan = _cached_plan(node_start, node_end, node_parent, replay_max, cost, in_place)
    read = plan.rows_read(in_place)
    if not levels:
        return plan, read, None
    from treecompile.ops.fla_gdn_levels import level_tensors

    return plan, read, level_tensors(plan, chunk_size, in_place=read == "in place",
                                     tree=tree and plan.replayed_tokens == 0)


def prepare(node_start: Tensor, node_end: Tensor, node_parent: Tensor, *, value_heads: int, key_dim: int,
            value_dim: int, replay_max: int | None = None, levels: bool | None = None, chunk_size: int = 64) -> None:
    """Build now, and keep, what :func:`tree_gated_delta_rule_fla` with fla's own kernel (``kernel=None``) will
    plan for this batch in a layer of these dims: its next call with the same node tensors, unchanged, finds it
    (``lower_cuda.prepare_plans``, for ``TreeModel.prepare``)."""
    if levels is None:
        levels = default_levels()
    _layer_plan(node_start, node_end, node_parent, value_heads, key_dim, value_dim, node_start.device,
                replay_max=replay_max, levels=levels, chunk_size=chunk_size)


def tree_gated_delta_rule_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, node_start: Tensor,
                              node_end: Tensor, node_parent: Tensor, node_level: Tensor,
                              initial_state: Tensor | None = None, *, scale: float | None = None,
                              use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64,
                              compute_dtype: torch.dtype | None = None, replay_max: int | None = None,
                              kernel=None, levels: bool | None = None) -> Tensor:
    """q, k ``[1, T, H, Dk]``, v ``[1, T, Hv, Dv]``, g (log decay) / beta ``[1, T, Hv]``; node tensors
    ``[N]`` as in a TreeBatch (``node_level`` is not needed by the plan and not read); ``initial_state
    [Hv, Dk, Dv]`` for root nodes.  Returns ``[1, T, Hv, Dv]`` in v's dtype.  ``compute_dtype``: the
    dtype q, k, v, g, beta enter fla in (default :data:`COMPUTE_DTYPE`, None = as given); states between
    calls are float32 (float64 for float64 inputs) either way.  ``replay_max``: see :func:`plan_calls`, with
    at most :data:`REPLAY_FRACTION` of the tokens replayed; None (default): no replay where the levelled path runs
    the recurrence as one launch over the tree (:func:`tree_usable`: a call costs nothing there), else
    :func:`cheapest_plan` at this layer's :func:`level_cost_rows` (levelled) or :func:`call_cost_rows` (whole calls).
    ``kernel``: a function with the signature of fla's ``chunk_gated_delta_rule`` (default: fla's; the
    CPU tests pass a torch one).
    ``levels``: run fla's chunk-local kernels once over all the plan's rows and only the state recurrence per
    call (:mod:`treecompile.ops.fla_gdn_levels`); None (default): :data:`LEVELS` when ``kernel`` is fla's own and
    its chunk-level functions import, whole calls otherwise (``passes.lower_cuda`` decides it once per lowering)."""
    if levels is None:
        levels = kernel is None and default_levels()
    elif levels and kernel is not None:
        raise ValueError("levels=True composes fla's own chunk kernels: it takes no `kernel`")
    elif levels and (reason := _levels_reason()) is not None:
        raise RuntimeError(reason)
    if kernel is None and not levels:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as kernel
        except ImportError as e:
            raise ImportError("the 'fla' GDN kernel needs flash-linear-attention (pip install 'treecompile[gpu]')") from e
    del node_level
    Hv, Dk, Dv = v.shape[2], q.shape[3], v.shape[3]
    compute_dtype = compute_dtype if compute_dtype is not None else COMPUTE_DTYPE
    if compute_dtype is not None:
        q, k, v_in, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    else:
        v_in = v
    plan, read, levelled = _layer_plan(node_start, node_end, node_parent, Hv, Dk, Dv, q.device,
                                       replay_max=replay_max, levels=levels, chunk_size=chunk_size)
    xs = (q, k, v_in, g, beta)
    gathered = read == "gathered"
    if gathered:  # one gather per input for all calls; each call reads a contiguous block of rows
        xs = tuple(gather_rows(x, plan.index, plan.occurrences) for x in xs)
    if levels:
        from treecompile.ops.fla_gdn_levels import TreeGDNLevels

        o = TreeGDNLevels.apply(*xs, initial_state, levelled, scale if scale is not None else Dk ** -0.5,
                                use_qk_l2norm_in_kernel)
        if gathered:
            o = o.index_select(1, plan.out_rows)
        return o.to(v.dtype)
    # each call's rows as one split of the gathered inputs: the backward is one cat per input (slices
    # x[:, lo:hi] would each fill a zero tensor of all rows and add it in: O(calls x rows) of memory traffic)
    sizes = [w.hi - w.lo for w in plan.waves]
    per_call = list(zip(*(x.split(sizes, 1) for x in xs)))
    outs, states = [], None
    state_dtype = torch.promote_types(torch.float32, xs[0].dtype)  # fla's float32 states (float64 stays)
    for i, (w, xi) in enumerate(zip(plan.waves, per_call)):
        n = w.cu_seqlens.numel() - 1
        chunk_indices, cu_seqlens_cpu = plan.chunk_indices(i, chunk_size)
        init = start_states(w.source, w.roots, states, initial_state, n, (Hv, Dk, Dv), state_dtype, q.device)
        oi, states = kernel(*xi, scale=scale, initial_state=init,
                            output_final_state=True, cu_seqlens=w.cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                            chunk_indices=chunk_indices,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
        outs.append(oi)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    if not plan.identity:
        o = o.index_select(1, plan.out_rows)
    return o.to(v.dtype)
