"""Tree Gated DeltaNet on CUDA through flash-linear-attention (optional extra ``treecompile[gpu]``).

Same contract as ``treecompile::tree_gated_delta_rule`` (``ops/tree_gdn.py``): every radix node's
segment starts from its parent node's final state (roots: zero or ``initial_state``).  The nodes run in
varlen calls of fla's ``chunk_gated_delta_rule`` (``cu_seqlens``, one ``initial_state`` per segment,
``output_final_state=True``) planned by :func:`plan_calls`: single-child chains merged into one segment,
short parents replayed in front of their children, and every segment whose starting state is known in
the same call (ready sets), so a layer costs ``plan.calls`` fla calls forward and as many backward
(``<=`` the tree levels; ``benchmarks/hybrid_bench.py`` counts both).  The inputs are gathered once per
layer into call order (each call reads a contiguous slice), the outputs scattered back once; the
starting states are gathered with ``index_select`` from the previous call's final states, so autograd
(fla's own backward, which returns gradients for initial states and takes them for final states)
carries gradients to every ancestor.

This is a plain differentiable function, not a registered op: fla's kernels are autograd Functions,
which a registered op's implementation cannot call with autograd.  ``passes.lower_cuda`` calls it in
place of the registered op when the GDN kernel is ``"fla"``.  fla is imported lazily, never at import.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "COMPUTE_DTYPE",
    "REPLAY_FRACTION",
    "REPLAY_MAX",
    "FlaPlan",
    "Wave",
    "fla_available",
    "fla_unusable_reason",
    "plan_calls",
    "tree_gated_delta_rule_fla",
]

# dtype the fla kernels compute in when the caller passes none: None = the inputs' dtype (fla keeps its
# chunk states h in the input dtype and its final states in float32); torch.float32 upcasts bf16 inputs
# (what the model's own GDN does), at fla's fp32 speed.  benchmarks/gdn_precision.py measures both.
COMPUTE_DTYPE: torch.dtype | None = None

# default ``replay_max`` of :func:`plan_calls`: a parent segment of at most this many tokens is run again in
# front of its children instead of costing them one more call (0 = never).  On the bench trees (16 x 2048
# synthetic, POR 0.2-0.85; agentic specs) 256 with REPLAY_FRACTION 0.05 halves the calls of the synthetic
# trees (9-11 -> 5-6) for 1.6-4.8 % more GDN rows; benchmarks/hybrid_bench.py times 0, 64 and this default
REPLAY_MAX = 256
# and the most replayed rows per token of the tree (replay_max is halved until the plan fits)
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


@dataclass(frozen=True)
class FlaPlan:
    """The varlen calls of one tree GDN layer (:func:`plan_calls`).

    ``index [R]``: the DFS token behind every row fed to fla, call after call (a replayed ancestor's
    tokens appear once more, in front of the segment that replays them); ``out_rows [T]``: the row whose
    output is token t's (its own segment's, never a replay); ``identity``: index and out_rows are
    ``arange(T)`` (one call, no replay) and the gathers are skipped."""

    index: Tensor
    out_rows: Tensor
    waves: tuple[Wave, ...]
    identity: bool
    replayed_tokens: int
    levels: int  # tree levels (the calls of a per-level schedule)
    _chunk_indices: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def calls(self) -> int:
        return len(self.waves)

    def chunk_indices(self, wave: int, chunk_size: int) -> tuple[Tensor, Tensor]:
        """``(chunk_indices [NT, 2], cu_seqlens_cpu [k + 1])`` of call ``wave`` as fla's
        ``prepare_chunk_indices`` builds them (row j: segment, chunk within the segment), made on the host.

        Without them fla derives the chunk indices from the device ``cu_seqlens`` in every forward call,
        a ``repeat_interleave`` that syncs the host with the GPU (fla/ops/utils/index.py), and its identity
        cache of 4 entries misses when a layer has more calls than that.  Built once per plan and chunk
        size (every layer of a batch reuses them), copied to the device without blocking."""
        key = (wave, chunk_size)
        if key not in self._chunk_indices:
            w = self.waves[wave]
            rows = [(s, c) for s, n in enumerate(w.lengths) for c in range(-(-n // chunk_size))]
            host = torch.tensor(rows, dtype=torch.long).reshape(-1, 2)
            if w.cu_seqlens.is_cuda:
                host = host.pin_memory()
            cu_cpu = torch.tensor([0, *itertools.accumulate(w.lengths)], dtype=torch.long)
            self._chunk_indices[key] = (host.to(w.cu_seqlens.device, non_blocking=True), cu_cpu)
        return self._chunk_indices[key]


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
       number of calls (its segment is not on the critical path) is undone.  ``max_replay_fraction``:
       while the replayed rows exceed this fraction of the tokens, ``replay_max`` is halved.
    3. Ready sets: a segment runs in the call after the one that produces its starting state (roots in
       the first), so each call holds every segment whose state is known: ``calls`` = depth of the
       segment tree, at most ``levels``.
    """
    ns, ne, par = (t.tolist() for t in (node_start, node_end, node_parent))
    N = len(ns)
    T = ne[-1] if N else 0
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
    # 1. chains -> segments (start, end, parent segment)
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
    S = len(s_start)
    # 2. replay: each segment's source (whose final state it starts from) and replayed ranges
    source, replays, wave = [-1] * S, [[] for _ in range(S)], [0] * S
    for s in range(S):
        src, budget = s_par[s], replay_max
        while src >= 0 and s_end[src] - s_start[src] <= budget:
            budget -= s_end[src] - s_start[src]
            replays[s].insert(0, (s_start[src], s_end[src]))
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
    # 3. ready sets
    by_wave: list[list[int]] = [[] for _ in range(max(wave) + 1 if S else 0)]
    for s in range(S):
        by_wave[wave[s]].append(s)
    dev = node_start.device
    index: list[int] = []
    out_rows = [0] * T
    row_in_wave = [0] * S
    waves = []
    for w, segs in enumerate(by_wave):
        lo, cu = len(index), [0]
        for r, s in enumerate(segs):
            row_in_wave[s] = r
            for a, b in replays[s]:
                index.extend(range(a, b))
            out_rows[s_start[s]:s_end[s]] = range(len(index), len(index) + s_end[s] - s_start[s])
            index.extend(range(s_start[s], s_end[s]))
            cu.append(len(index) - lo)
        src = None if w == 0 else torch.tensor([row_in_wave[source[s]] for s in segs], dtype=torch.long, device=dev)
        waves.append(Wave(lo, len(index), torch.tensor(cu, dtype=torch.long, device=dev), src,
                          tuple(b - a for a, b in zip(cu, cu[1:]))))
    if max_replay_fraction is not None and replay_max > 0 and len(index) - T > max_replay_fraction * T:
        return plan_calls(node_start, node_end, node_parent, replay_max=replay_max // 2,
                          max_replay_fraction=max_replay_fraction)
    identity = len(waves) == 1 and len(index) == T
    return FlaPlan(index=torch.tensor(index, dtype=torch.long, device=dev),
                   out_rows=torch.tensor(out_rows, dtype=torch.long, device=dev), waves=tuple(waves),
                   identity=identity, replayed_tokens=len(index) - T, levels=max(level) + 1 if N else 0)


_LAST: tuple = ()  # (node tensors, their versions, replay_max, plan) of the last batch


def _cached_plan(node_start, node_end, node_parent, replay_max):
    """The plan (one host sync) once per batch, not once per GDN layer: every layer of a forward gets
    the same node tensors, so the last plan is reused while they are unchanged."""
    global _LAST
    tensors = (node_start, node_end, node_parent)
    versions = tuple(t._version for t in tensors)
    if _LAST and all(a is b for a, b in zip(_LAST[0], tensors)) and _LAST[1] == versions and _LAST[2] == replay_max:
        return _LAST[3]
    plan = plan_calls(*tensors, replay_max=replay_max, max_replay_fraction=REPLAY_FRACTION)
    _LAST = (tensors, versions, replay_max, plan)
    return plan


def tree_gated_delta_rule_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, node_start: Tensor,
                              node_end: Tensor, node_parent: Tensor, node_level: Tensor,
                              initial_state: Tensor | None = None, *, scale: float | None = None,
                              use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64,
                              compute_dtype: torch.dtype | None = None, replay_max: int | None = None,
                              kernel=None) -> Tensor:
    """q, k ``[1, T, H, Dk]``, v ``[1, T, Hv, Dv]``, g (log decay) / beta ``[1, T, Hv]``; node tensors
    ``[N]`` as in a TreeBatch (``node_level`` is not needed by the plan and not read); ``initial_state
    [Hv, Dk, Dv]`` for root nodes.  Returns ``[1, T, Hv, Dv]`` in v's dtype.  ``compute_dtype``: the
    dtype q, k, v, g, beta enter fla in (default :data:`COMPUTE_DTYPE`, None = as given); states between
    calls are float32 (float64 for float64 inputs) either way.  ``replay_max``: see :func:`plan_calls` (default :data:`REPLAY_MAX`).
    ``kernel``: a function with the signature of fla's ``chunk_gated_delta_rule`` (default: fla's; the
    CPU tests pass a torch one)."""
    if kernel is None:
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
    plan = _cached_plan(node_start, node_end, node_parent, REPLAY_MAX if replay_max is None else replay_max)
    xs = (q, k, v_in, g, beta)
    if not plan.identity:  # one gather per input for all calls; each call reads a contiguous slice
        xs = tuple(x.index_select(1, plan.index) for x in xs)
    outs, states = [], None
    state_dtype = torch.promote_types(torch.float32, xs[0].dtype)  # fla's float32 states (float64 stays)
    for i, w in enumerate(plan.waves):
        n = w.cu_seqlens.numel() - 1
        chunk_indices, cu_seqlens_cpu = plan.chunk_indices(i, chunk_size)
        if w.source is None:
            init = (initial_state.to(state_dtype).expand(n, Hv, Dk, Dv).contiguous() if initial_state is not None
                    else q.new_zeros(n, Hv, Dk, Dv, dtype=state_dtype))
        else:
            init = states.index_select(0, w.source)
        oi, states = kernel(*(x[:, w.lo:w.hi] for x in xs), scale=scale, initial_state=init,
                            output_final_state=True, cu_seqlens=w.cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                            chunk_indices=chunk_indices,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
        outs.append(oi)
    o = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
    if not plan.identity:
        o = o.index_select(1, plan.out_rows)
    return o.to(v.dtype)
