"""Tree attention as varlen causal attention over node segments (``treecompile::tree_attention_varlen``).

The tree mask ``k <= q < subtree_end[k]`` (ops/tree_attention.py) splits the DFS order into **segments**:
maximal runs of tokens each in the previous token's subtree (a radix node, or a chain of nodes).  Every
query of a segment ``[a, b)`` sees the same ancestors, ``prefix(a) = {k < a : subtree_end[k] > a}`` (a union
of earlier intervals, root first), and the segment's own tokens up to itself.  So with the segment's keys
laid out as ``prefix(a) ++ [a, b)``, query ``a + i`` sees exactly the first ``len(prefix) + i + 1`` keys:
**bottom-right causal** attention of ``b - a`` queries over ``len(prefix) + b - a`` keys, which is what a
varlen kernel computes per sequence (``cu_seqlens_q`` = the segments, ``cu_seqlens_k`` = their gathered
keys).  No mask function, no partial tiles from node boundaries; the price is the key gather: ``G`` = the
sum of the segments' key counts (the tree's path prefixes, once per segment rather than once per path).

On CUDA with bf16/fp16 the kernel is FlashAttention-4's varlen forward and backward (``flash-attn-4``,
``treecompile[hopper]``); elsewhere a float64-exact reference (one SDPA per segment) runs the same plan, so
the CPU tests check the plan, the gather, the scatter-add of the key gradients and the autograd wiring.
Queries are not gathered (segments tile ``[0, T)`` in order); key/value gradients of the gathered rows are
summed back per token in float32 (the root's rows appear in every segment) by one Triton kernel over runs of
tokens with the same copies (:mod:`treecompile.ops.key_copies`; ``index_add_`` where Triton cannot run).  A
trailing run of tokens that see only themselves (the padding of a length bucket: up to T/8 of them) is not
handed to the kernel as that many one-token sequences: each one's output is its own value row (softmax over one
key), written with its log-sum-exp, and in the backward its gradients, by one small kernel each way
(:mod:`treecompile.ops.varlen_tail`).
The plan (host work, one sync) is built once per batch and kept while the same ``subtree_end`` tensor comes
back (:class:`last_batch.LastBatch`).  The backward needs the gathered rows again: it gathers them again, or reads
the forward's, kept as the op's third and fourth results (``keep``: always, never, or where the device's memory
allows, measured once per forward: :func:`keeps_keys`; the lowering's ``attention_keys``).

Where the gather is large (deep trees of short nodes: every leaf re-reads the whole spine, ``G`` = 10-22x T) the
block-sparse kernels do less work.  So the op chooses per batch (:func:`tree_attention_plan`): segments through
the varlen kernel while ``G <= VARLEN_GATHER_LIMIT * T``, else FA4's block-sparse kernels on the whole sequence
with the tree ``mask_mod`` and the tree's 128 x 128 block lists (:class:`BlockSparsePlan`; the kernels of
``attention_kernel="fa4"``, called directly: inside this opaque op dynamo never sees the autograd Function).
With :data:`BLOCK_SPARSE_LAYOUT` = ``"heavy_first"`` the block-sparse plan runs the tree in its
heaviest-child-first DFS order (``ops/tree_layout.py``): the same tree with every node's largest subtree visited
first, so that fewer 128 x 128 tiles straddle a node boundary and evaluate the mask per entry (deep-agent: 439
partial tiles instead of 1,185, computed tiles -7 %); q, k, v are permuted in and the output and log-sum-exp back
(the backward likewise), which is exact (a permutation of queries and keys with the mask permuted alike).  A
``subtree_end`` that is not nested keeps the batch's order (the mask's rule holds in any order; the permutation
needs a tree).  Off by default: ``Tree.from_paths`` builds trees in that order already (its default since session
46), which takes the same tiles with no permutation; timed on an H200 on a lexicographic deep-agent tree, the
permutations cost 11 ms of kernels a step and kept half the gain (298.4 ms against 285.0 ms for the tree built in
that order, ``benchmarks/results/h200_s46``).  The setting is for batches serialised in another order.
The block-sparse tiles need head dim 64 or 128 (``fa4_tree_attention.FA4_HEAD_DIMS``); other head dims keep the
varlen kernel up to ``MAX_GATHER_FACTOR`` (:func:`segments_fit`: past it the op refuses, and the lowering's
``"auto"`` runs such a batch through flex instead).  Off CUDA both plans run float64-exact reference kernels, so
the CPU tests cover the choice and the wiring of both.

**The plan's host time.** A batch's plan is host work over a few numbers per node: a 64 x 2,048-token POR 0.5
tree has 125 runs of equal subtree ends, 64 segments and 173 key intervals, where each tensor op costs 3-7 us of
dispatch on the host whatever its size (and up to twice that on the H200's VM host).  So after the one pass over
the tokens (the runs of equal subtree ends), the bounds check, the walk, the intervals, the copy runs' offsets and
both ``cu_seqlens`` are Python over lists, and tensors are built only for what the device reads (the copy runs one
row per run: the sums kernel finds its tiles, :mod:`treecompile.ops.key_copies`): under 90 tensor ops a plan where
there were 414; 0.76-0.80 ms at 64k tokens on the H200's host against 1.17-1.22 (session 54,
``benchmarks/results/h200_s54/``).  Trees of very short nodes have thousands of runs, where loops over them cost
more than the ops: past :data:`WALK_TENSOR_RUNS` runs the walk's per-run work is tensor ops.

**K/V heads.** With grouped-query attention (``H > Hkv``) a segment plan hands FA4 the gathered rows with the
model's ``Hkv`` heads (:data:`KV_HEADS` = ``"grouped"``): FA4's backward then accumulates each kv head's
dK/dV over the query heads of its group in float32 buffers of the gathered rows' size, which it zero-fills, and
converts them (two more kernels); the op sums the copies per token.  With ``"expanded"`` the gather repeats each kv
head for its query heads (``[G, H, D]``, :func:`key_copies.gather_keys`, one kernel), FA4 runs as multi-head
attention and writes per-head dK/dV, and the copy sums add the heads of a group in the same float32 accumulator
(``sum_copies(rep=)``): no accumulators, fills or conversions, for ``H / Hkv`` times the gathered and summed bytes
and the kept rows' memory (kept as ``[G * rep, Hkv, D]`` views, the op's declared layout; the backward tells the two
forms apart by their count, so the setting may differ between a forward and its backward).  Measured per layer on
an H200 (Qwen3-0.6B shapes, parallel-tools' plan, ``benchmarks/results/h200_s52/``): FA4's backward 1.303 ->
1.082 ms, its forward 0.386 -> 0.397 ms, and at their bytes a gather 0.055 -> 0.113 ms and the copy sums 0.050 ->
0.091 ms, and through this module's kernels 0.083 and 0.084 ms: 1.789 -> 1.648 ms a layer (session 53).  In a
step it pays for groups of two query heads and not for four (:data:`EXPAND_MAX_GROUP`, where the measurements are),
so ``"auto"``, the default, expands groups of at most two; the harness's ``tree_kv_expanded`` and
``tree_kv_grouped`` time either form.  The block-sparse plan reads K/V in place and keeps its groups.

**The forward without kept rows.**  A segment plan's forward gathers the path prefixes (``G`` rows) to hand them to
the varlen kernel; where it keeps them the backward reads them, else the backward gathers them again.  A forward that
keeps none instead runs FA4's block-sparse kernels on the sequence's own rows, where their tiles take the head dim
(no gather: :data:`UNKEPT_FORWARD` = ``"block_sparse"``, the default since session 58; ``"segments"`` gathers as the
backward does): the same attention, whose out and log-sum-exp the segments' backward takes as FA4's backward takes
its own forward's.  Its plan is kept per batch beside the op's (:func:`prepare` builds both).

Under ``torch.use_deterministic_algorithms(True)`` FA4's backward runs its deterministic form (semaphores order
the dQ, and for GQA the dK/dV, accumulations; the key copies' sums have a fixed order anyway), so a step's
gradients repeat bit for bit.  FA4's deterministic block-sparse backward needs write orders this op does not
build, so in that mode a batch whose segments fit (:func:`segments_fit`) runs the segments whatever their gather;
one past their bound raises a RuntimeError naming the cause, as torch's own non-deterministic ops do (a warning
under ``warn_only=True``, and the block-sparse plan runs).  ``attention_kernel="flex"`` runs such trees
deterministically on Hopper (flex's Triton backward has no atomics; torch refuses determinism to FA4 block-sparse
below sm100 as well).

``treecompile::tree_attention_varlen_windowed_fwd`` is the same op under a sliding window of W tokens along each
path (``tree_attention_windowed``'s): each segment keeps only the last ``W - 1`` rows of its path prefix and the
kernel's own window (``window_size_left = W - 1``) drops the rest per query (:func:`windowed_plan`; the positions
must be the depths, checked), so the gather stays under ``T + segments * (W - 1)`` however deep the tree.  A batch
whose windowed segments would still gather more than ``VARLEN_GATHER_LIMIT * T`` rows runs the window block mask
(FlexAttention) inside the op.

Shapes as ``treecompile::tree_attention``: ``q [1, H, T, D]``, ``k``/``v`` ``[1, Hkv, T, D]`` (GQA when
``H > Hkv``), ``subtree_end [T]`` int64; returns ``[1, H, T, Dv]``.
"""

from __future__ import annotations

import bisect
import math
import operator
import os
import threading
from dataclasses import dataclass
from itertools import accumulate, compress, repeat

import torch
from torch import Tensor

from treecompile.host_values import host_copy, to_device_async, to_device_tables

from .key_copies import CopyRuns, copy_run_lists, gather_key_values, sum_copies
from . import fa4_replay
from .last_batch import LastBatch
from .logprobs_kept import allocator_bytes, fit_margin_bytes, headroom_bytes
from .tree_attention import tree_mask
from .varlen_tail import tail_backward, tail_forward

__all__ = ["SegmentPlan", "BlockSparsePlan", "segment_plan", "segments_fit", "tree_attention_plan",
           "tree_attention_varlen", "varlen_attention_reference", "varlen_attention_reference_bwd",
           "VARLEN_GATHER_LIMIT", "windowed_plan", "tree_attention_varlen_windowed", "prepare", "KEEP", "KeysFit",
           "keeps_keys", "gathered_bytes", "pop_last_keys_fit"]


@dataclass(frozen=True)
class SegmentPlan:
    """Segments of one batch's tree mask (module docstring)."""

    key_index: Tensor  # [G] int64, on the tokens' device: the token each gathered key row reads
    cu_seqlens_q: Tensor  # [S + 1] int32, device: segment starts (queries in the batch's order)
    cu_seqlens_k: Tensor  # [S + 1] int32, device: offsets of each segment's keys in the gathered rows
    cu_seqlens_q_host: tuple  # the same, on the host (the reference kernel loops over segments)
    cu_seqlens_k_host: tuple
    max_seqlen_q: int
    max_seqlen_k: int
    tail: int  # the segments cover queries [0, tail); [tail, T) are tokens that see only themselves (padding)
    copies: CopyRuns  # the gathered rows as runs of tokens with the same copies: the backward's per-token sums
    window: int = 0  # a sliding window of this many tokens along each path (0: none; :func:`windowed_plan`)

    @property
    def segments(self) -> int:
        return len(self.cu_seqlens_q_host) - 1

    @property
    def gathered(self) -> int:
        """G: key rows the kernel reads (T when the tree is one chain)."""
        return self.cu_seqlens_k_host[-1]

    def keys(self, k_t: Tensor, v_t: Tensor, rep: int = 1, front: tuple | None = None) -> tuple[Tensor, Tensor]:
        """The key/value rows the varlen kernel reads: each segment's path prefix and itself, gathered; ``rep`` > 1:
        each kv head repeated for that many query heads (``[G, Hkv * rep, D]``, :func:`_kv_rep`); ``front``: (key,
        value) rows in front of the sequence's, which the key index reads first (a partition's boundary rows)."""
        return gather_key_values(k_t, v_t, self.key_index, rep, front)

    def pieces(self, device):
        """Per segment: (query rows, gathered key rows, the bottom-right causal ``[n, m]`` visibility)."""
        cq, ck = self.cu_seqlens_q_host, self.cu_seqlens_k_host
        for j in range(self.segments):
            n, m = cq[j + 1] - cq[j], ck[j + 1] - ck[j]
            diag = torch.arange(n, device=device)[:, None] + (m - n)  # query i's own row among the keys
            visible = torch.arange(m, device=device)[None, :] <= diag
            if self.window:
                visible &= torch.arange(m, device=device)[None, :] > diag - self.window
            yield slice(cq[j], cq[j + 1]), slice(ck[j], ck[j + 1]), visible


@dataclass(frozen=True)
class BlockSparsePlan:
    """A batch whose segments would gather more than ``VARLEN_GATHER_LIMIT * T`` key rows: the whole sequence
    through FA4's block-sparse kernels under the tree ``mask_mod`` (module docstring)."""

    subtree_end: Tensor  # [T] int64, the tokens' device: the kernels' order's (order None: the batch's own)
    mask_end: Tensor | None  # [T rounded up to kv blocks] int32: FA4's mask_mod aux tensor (0 past T); None off CUDA
    sparse: tuple | None  # (forward, backward) FA4 BlockSparseTensorsTorch of the tree's block mask; None off CUDA
    gathered: int  # the key rows the segments would have gathered (why this plan was chosen)
    tail: int  # all T queries are the kernel's (the mask gives padding tokens themselves)
    # [2, T] int64 on the tokens' device (ops.tree_layout.heavy_first_order): order[0][i] the batch's token at the
    # kernels' position i, order[1][t] the kernels' position of the batch's token t; None: the batch's order
    order: Tensor | None = None

    def keys(self, k_t: Tensor, v_t: Tensor) -> tuple[Tensor, Tensor]:
        """The sequence's own key/value rows (the mask picks them), in the kernels' order."""
        return self.to_kernel(k_t), self.to_kernel(v_t)

    def to_kernel(self, x: Tensor, dim: int = 0) -> Tensor:
        """``x`` (tokens along ``dim``, the batch's order) in the kernels' order."""
        return x if self.order is None else x.index_select(dim, self.order[0])

    def to_batch(self, x: Tensor, dim: int = 0) -> Tensor:
        """``x`` (tokens along ``dim``, the kernels' order) back in the batch's order."""
        return x if self.order is None else x.index_select(dim, self.order[1])

    def pieces(self, device):
        T = self.subtree_end.numel()
        yield slice(0, T), slice(0, T), tree_mask(self.subtree_end.to(device))


# Whether each segment plan is proven to be the tree mask once laid out (:func:`_check_plan`: every query-key pair
# of the mask attended once, nothing else; O(intervals + runs), about 120 small host ops: 0.7 ms at 64k tokens on
# this repository's CPU, where the rest of a CUDA batch's plan takes 0.8).  The plan is a function of the walk, and
# the walk is exact on every ``subtree_end`` that the nesting check (:func:`_check_nested`, always run) passes; so
# this is a check of this module's own layout code, not of the batch: on in the test suite (tests/conftest.py), and
# for a user who wants the proof at run time (``TREECOMPILE_VERIFY_PLANS=1``).
VERIFY_PLANS = os.environ.get("TREECOMPILE_VERIFY_PLANS", "0") == "1"
# most key rows a plan may gather, in units of T (plus MAX_GATHER_ROWS): the deep agentic trees of the
# benchmark gather 20-22x T; a comb (a long spine with a leaf at every token) would gather O(T^2) rows
MAX_GATHER_FACTOR = 64
MAX_GATHER_ROWS = 1 << 16
# the varlen kernel while the segments gather at most this many key rows per token, else the block-sparse
# kernels.  Measured fwd+bwd on one H100 (bf16, H=16, Hkv=8, D=128) since the copies' gradients are summed by
# ops/key_copies.py (benchmarks/results/h100_s20/attn_limit): G = 2.0x T (64 x 2,048 POR 0.5): segments
# 7.8-7.9 ms (the baselines' attention over the paths: 10.9); 4.0x T (32 x 2,048 POR 0.75): segments 2.85 vs
# block-sparse 3.22 ms; 19.6x T (agentic deep-16k): 10.50 vs 6.65 ms.  The time ratio crosses 1 near 6.7x T
# (linear between those two points): 6.  A point in between, on one H200 (session 44, benchmarks/results/h200_s44/
# attn): 8.5x T (agentic deep-agent), segments 7.51 vs block-sparse 6.34 ms: the limit is on the right side there.
# (Before, with index_add_ sums, the segments lost from 4x T on: session 15, limit 3.)  G ~ path tokens on wide
# trees, i.e. T / (1 - POR).
VARLEN_GATHER_LIMIT = 6.0
# The token order of the block-sparse plan: "dfs" (the batch's own order) or "heavy_first" (the tree with every
# node's largest subtree first, permuted inside the op: fewer partial tiles on a batch not built in that order,
# module docstring; the harness's ``tree_block_sparse_heavy_first``).  Read when a batch's plan is built.
BLOCK_SPARSE_LAYOUT = "dfs"
BLOCK_SPARSE_LAYOUTS = ("heavy_first", "dfs")
# How a segment plan hands grouped-query K/V to the kernel (module docstring, "K/V heads"): "grouped" (the model's kv
# heads; FA4 accumulates their dK/dV over the query heads of a group in float32 and converts them), "expanded"
# (each kv head repeated for its query heads in the gather; FA4 writes per-head dK/dV, summed with the copies), or
# "auto" (the default): expanded where a group has at most EXPAND_MAX_GROUP query heads, grouped otherwise.
# Read at run time, by every forward and backward of a segment plan (the harness's ``tree_kv_expanded`` and
# ``tree_kv_grouped`` force one).  Expanded rows take H / Hkv times the gathered (and kept) memory.
KV_HEADS = "auto"
KV_HEADS_CHOICES = ("auto", "grouped", "expanded")
# "auto"'s largest group to expand.  Measured on one H200 (session 53, benchmarks/results/h200_s53/), a step of the
# expanded form against the grouped one: groups of 2 (Qwen3-0.6B, 16 / 8 heads) 156.0 against 161.2 ms at
# 16 x 2,048 POR 0.5, 124.4-125.3 against 127.9-131.3 ms back to back on agentic parallel-tools, and the sliding-window
# Mistral-0.6B there 84.0-85.5 against 87.0-95.3 ms; groups of 4 (Qwen3-4B, 32 / 8) 758.5 against 757.0 ms at
# 16 x 2,048 (its kernels 736.8 against 728.8 ms: the gather and sums of four copies cost what FA4's backward saves).
# Groups of 3 or 5+ are unmeasured and stay grouped.
EXPAND_MAX_GROUP = 2
# The forward of a segment plan that keeps no rows for its backward (module docstring, "The forward without kept
# rows"): "block_sparse" (FA4's block-sparse kernels on the sequence's own rows: no gather; the backward gathers and
# runs the segments as before) or "segments" (FA4's varlen kernel over the gathered rows, as the backward runs).
# Measured at attention level on one H200 (session 57, benchmarks/results/h200_s57/bs57): on the harness's POR 0.75
# trees (G = 4 x T) the block-sparse forward takes 0.501 / 1.113 / 2.157 ms against the segments' 0.643 / 1.333 / 2.864
# (16k / 32k / 64k), while the segments' backward stays the faster (1.768 / 3.505 / 7.154 against 1.990 / 4.048 /
# 8.263).  In a step (session 58, benchmarks/results/h200_s58, Qwen3-0.6B, two processes of one lease): 64k POR 0.75
# (the rows do not fit to keep) 711.6 / 711.7 ms against 722.1 / 725.9 (94.6 % of the work bound against packed FA4
# varlen's 2,402.6 ms in the same process, was 92.8 %); 16k POR 0.75 with no rows kept 177.0 against 181.0 (keeping
# them, the default where they fit, 174.4).  The default since session 58.  Read by every forward.
UNKEPT_FORWARD = "block_sparse"
UNKEPT_FORWARD_CHOICES = ("segments", "block_sparse")
# The walk's per-run checks and lists (:func:`_walk`): Python loops in C over the runs up to this many runs, a few
# tensor ops over them past it.  A tree has about two runs per leaf (125 at 64 x 2,048 POR 0.5), where the loops
# cost less than the ops' dispatch; trees of very short nodes have thousands (17k at 64k tokens of 1-4-token nodes),
# where the loops took about 5 ms of a 14 ms walk on this repository's CPU (session 54).
WALK_TENSOR_RUNS = 2048


def segment_plan(subtree_end: Tensor) -> SegmentPlan:
    """The segments of ``subtree_end`` (module docstring); raises ValueError naming the first token where
    ``subtree_end`` is not the DFS layout of a forest (``t < subtree_end[t] <= T``, subtrees nested), and when
    the segments would gather more than ``MAX_GATHER_FACTOR * T + MAX_GATHER_ROWS`` key rows."""
    return tree_attention_plan(subtree_end, block_sparse=False)


@dataclass(frozen=True)
class _Walk:
    """The segments of one ``subtree_end`` before any key row is laid out (:func:`_walk`)."""

    se: Tensor  # [T] int64 on the host
    run_se: Tensor  # [R] int64: the runs of equal subtree ends (:func:`_walk`), each run's subtree end ...
    run_end: Tensor  # [R] int64: ... and its end (run r is tokens [run_end[r - 1], run_end[r]))
    starts: list  # segment j is [starts[j], ends[j]): the segments for the kernel
    ends: list
    parents: list  # (parent segment, end of its tokens that segment j sees), None for a root segment
    prefix_len: list  # keys before segment j's own: its ancestors' visible runs
    n_main: int  # the segments (after them: the tail, tokens that each see only themselves)
    tail: int  # the segments cover queries [0, tail)
    gathered: int  # G: the key rows the segments gather
    not_nested: int | None  # the first token whose subtree is not inside its parent's (:func:`_check_nested`)

    @property
    def fits(self) -> bool:
        """Whether the segments gather at most ``MAX_GATHER_FACTOR * T + MAX_GATHER_ROWS`` key rows."""
        return self.gathered <= MAX_GATHER_FACTOR * self.se.numel() + MAX_GATHER_ROWS


def _walk(subtree_end: Tensor) -> _Walk:
    """Bounds-check ``subtree_end`` and walk its segments (no device copy for a moved batch's own tensor:
    :mod:`treecompile.host_values`).

    One pass over the tokens cuts them into **runs** of equal subtree ends (:func:`_runs`: a radix node,
    or a node and the chain of only children that ends with it); everything after is per run or per segment, as
    every quantity here is constant along a run: the bounds ``t < subtree_end[t] <= T`` hold on run ``r`` iff its
    end is at most its subtree end and that is at most ``T``; only a run's last token can see only itself (the next
    token then starts a segment); a batch's trailing tokens that each see only themselves and that nothing before
    reaches past (its padding: the tail) are found from the last run that is not one such token, and only the
    segments before them are walked; and a parent segment's tokens that see a child segment's start ``a`` are the
    runs before its first run whose subtree ends by ``a`` (a binary search over the parent's runs).

    After the runs (and a padded batch's tail: a few tensor ops over all runs), the walk, the bounds check
    included, is Python over lists of the runs before the tail: about two runs per leaf (125 for 64 x 2,048 POR
    0.5), where a tensor op costs 3-7 us of dispatch on the host whatever its size (module docstring, "The plan's
    host time"); past :data:`WALK_TENSOR_RUNS` runs its per-run checks and lists are tensor ops instead."""
    if subtree_end.dim() != 1 or subtree_end.numel() == 0:
        raise ValueError(f"subtree_end: expected a non-empty 1-D tensor [T], got shape {tuple(subtree_end.shape)}")
    if subtree_end.dtype.is_floating_point or subtree_end.dtype.is_complex or subtree_end.dtype == torch.bool:
        raise ValueError(f"subtree_end: expected an integer tensor, got {subtree_end.dtype}")
    raw = host_copy(subtree_end)  # no device copy for a moved batch's own tensor (host_values)
    se = raw.to(torch.int64)  # (a uint64 past int64 wraps to a negative value: out of bounds all the same)
    T = se.numel()
    run_se, run_end, counts = _runs(se)
    # the tail: the trailing tokens that see only themselves and that no token before sees (a length bucket's
    # padding), not for the kernel and no segments of the walk.  After the last run that is not one such token (its
    # end P), the first token that no earlier token reaches past: max(P, the largest subtree end before P).  Only a
    # batch whose last run is that one token has one to look for (over the runs, as tensors: a padded batch has a
    # run per padding token); else the tail is empty.  A run out of bounds is not one such token (its subtree end is
    # not its end), so the tail's runs are in bounds, and the bounds are checked on the runs before it
    R = run_se.numel()
    if T == 1 or operator.ne(*se[-2:].tolist()):
        other = (run_se == run_end).logical_and_(counts == 1).logical_not_().nonzero()
        f = int(other[-1, 0]) if other.numel() else -1
        tail = max(int(run_end[f]), int(run_se[:f + 1].max())) if f >= 0 else 0
        R = int(torch.searchsorted(run_end, tail, right=True))  # the runs before the tail
    else:
        tail = T
    rse, rend = run_se[:R].tolist(), run_end[:R].tolist()
    # per-run values below from Python loops in C over the lists, or, past WALK_TENSOR_RUNS runs, from a few tensor
    # ops over all of them (the same values either way)
    big = R > WALK_TENSOR_RUNS
    t_se, t_end = (run_se[:R], run_end[:R]) if big else (None, None)
    if (bool((t_se < t_end).logical_or_(t_se > T).any()) if big else
            rse and (min(map(operator.sub, rse, rend)) < 0 or max(rse) > T)):
        r = next(r for r, v, e in zip(range(R), rse, rend) if v < e or v > T)  # run r: [rend[r - 1], rend[r])
        a, v = rend[r - 1] if r else 0, rse[r]
        t = a if v > T else max(a, v)  # the run's first token past the bound
        v = raw[t].item()  # as given (a uint64 past int64 by its own value: int() of it overflows)
        raise ValueError(f"subtree_end[{t}] = {v}: expected {t} < subtree_end[t] <= {T} (token {t} must "
                         f"see itself and the sequence has {T} tokens)")
    # segment j's last run (it closes: its last token sees only itself; the last run before the tail closes)
    last_run = (t_se.eq(t_end).nonzero().flatten().tolist() if big else
                list(compress(range(R), map(operator.eq, rse, rend))))
    ends_l = [rend[r] for r in last_run]
    starts_l = [0, *ends_l[:-1]][:len(ends_l)]
    first_run = [0, *[r + 1 for r in last_run[:-1]]][:len(last_run)]
    se_start = [rse[r] for r in first_run]  # each segment's first token's subtree end
    # each segment's parent segment (the open ancestor segment), from a stack of the open ancestor segments:
    # O(segments), before any key row is laid out
    parent_seg: list[int] = []  # -1: a root segment
    stack: list[int] = []  # segment indices
    for j, a in enumerate(starts_l):
        while stack and se_start[stack[-1]] <= a:
            stack.pop()
        parent_seg.append(stack[-1] if stack else -1)
        stack.append(j)
    # nested subtrees (:func:`_check_nested`): inside a segment each run's subtree ends before the previous run's ...
    if big:  # (a run whose subtree ends past its end does not close)
        wider = (t_se[:-1] < t_se[1:]).logical_and_(t_se[:-1] > t_end[:-1]).nonzero()
        up = rend[int(wider[0, 0])] if wider.numel() else None
    else:
        up = next(compress(rend, map(operator.and_, map(operator.lt, rse, rse[1:]), map(operator.gt, rse, rend))),
                  None)
    wide = [] if up is None else [up]  # the first such run's next token
    # then how many of its parent segment's tokens each segment's start sees (the parent's runs before its first
    # run whose subtree ends by the start: one binary search over the parent's runs), and its prefix length
    n_main = len(starts_l)
    parents: list[tuple[int, int] | None] = [None] * n_main
    prefix_len: list[int] = [0] * n_main
    lo_run = [first_run[i] if i >= 0 else 0 for i in parent_seg]  # each segment's parent's runs: [lo_run, hi_run)
    hi_run = [last_run[i] + 1 if i >= 0 else 0 for i in parent_seg]
    neg = t_se.neg().tolist() if big else list(map(operator.neg, rse))  # increasing along a nested segment's runs
    seen = list(map(bisect.bisect_left, repeat(neg, n_main), map(operator.neg, starts_l), lo_run, hi_run))
    head = None  # ... and a segment's first token's ends no later than that of the last token above it that sees it
    for j, i, r, lo, a, e in zip(range(n_main), parent_seg, seen, lo_run, starts_l, se_start):
        if i < 0:
            continue
        r = r - 1 if r > lo else lo  # the parent's last run that sees the start (its first does: the stack's rule)
        p = rend[r]
        parents[j] = (i, p)  # parents come before their children: their prefix lengths are known
        prefix_len[j] = prefix_len[i] + p - starts_l[i]
        if head is None and e > rse[r] > a:
            head = a
    wide += [] if head is None else [head]
    G = sum(prefix_len) + tail  # the key rows the segments gather
    return _Walk(se=se, run_se=run_se, run_end=run_end, starts=starts_l, ends=ends_l, parents=parents,
                 prefix_len=prefix_len, n_main=n_main, tail=tail, gathered=G,
                 not_nested=min(wide, default=None))


_WALKS = LastBatch()  # the last batch's walk: TreeProgram's segments_fit and the op's plan read the same one


def _last_walk(subtree_end: Tensor) -> _Walk:
    return _WALKS.get((subtree_end,), None, lambda: _walk(subtree_end))


def segments_fit(subtree_end: Tensor) -> bool:
    """Whether this op's segments for ``subtree_end`` stay within the gather bound (read on the host, O(segments),
    kept for the op's plan of the same tensor).  Where they do not, a head dim without block-sparse tiles cannot
    run the batch through this op: ``"auto"`` then runs it through flex (``TreeProgram``'s per-batch fallback)."""
    return _last_walk(subtree_end).fits


def tree_attention_plan(subtree_end: Tensor, *, block_sparse: bool) -> SegmentPlan | BlockSparsePlan:
    """The plan the op runs for one batch: a :class:`BlockSparsePlan` when ``block_sparse`` (the kernels can take
    the inputs) and the segments would gather more than ``VARLEN_GATHER_LIMIT * T`` key rows, else the
    :class:`SegmentPlan` (:func:`segment_plan`'s checks and refusals).  The block-sparse plan evaluates the mask
    ``k <= q < subtree_end[k]`` itself, so it is exact for any ``subtree_end`` that passes the bounds check; only
    the segments need nested subtrees (checked, and refused naming the token, when they are built)."""
    w = _last_walk(subtree_end)
    T, G, n_main = w.se.numel(), w.gathered, w.n_main
    if block_sparse and G > VARLEN_GATHER_LIMIT * T:
        return _block_sparse_plan(subtree_end, w)
    _check_nested(w)  # a non-nested batch is refused naming the token (its walk's counts are not the segments')
    if not w.fits:
        raise ValueError(f"tree_attention_varlen: this tree's {n_main} segments would gather {G:,} key "
                         f"rows for {T:,} tokens ({G / T:.0f}x; at most {MAX_GATHER_FACTOR}x): its paths share "
                         "long prefixes among many short branches; run it through a block-sparse kernel: "
                         "attention_kernel='flex' (any head dim) or 'fa4' (head dim 64/128)")
    intervals = []  # flat: lo, hi of each interval in turn
    for j in range(n_main):  # segment j's keys: its ancestors' visible runs, root first, then itself
        intervals += _prefix_intervals(w, j)
        intervals += (w.starts[j], w.ends[j])
    lo, hi, first = _rows(intervals, G)
    cu_k = list(accumulate((w.prefix_len[j] + w.ends[j] - w.starts[j] for j in range(n_main)), initial=0))
    cu_q = [0, *w.ends[:n_main]]
    if VERIFY_PLANS:
        _check_plan(w.se, *_host_tensors(lo, hi, first), G, *_host_tensors(cu_q, cu_k), w.tail,
                    (w.run_se, w.run_end))
    return _segment_plan(lo, hi, first, cu_q, cu_k, w.tail, subtree_end.device)


def _prefix_intervals(w: _Walk, j: int, shift: int = 0) -> list:
    """Segment ``j``'s path prefix as flat ``lo, hi`` token intervals, root first (its ancestors' runs it sees), each
    moved by ``shift`` rows (a partition's boundary rows in front: ``ops/varlen_boundary_attention.py``)."""
    run, i = [], j  # reversed
    while w.parents[i] is not None:
        i, p = w.parents[i]
        run += (shift + p, shift + w.starts[i])
    run.reverse()
    return run


def _host_tensors(*lists: list) -> tuple[Tensor, ...]:
    return tuple(torch.tensor(x, dtype=torch.int64) for x in lists)


def _rows(intervals: list, G: int) -> tuple[list, list, list]:
    """(lo, hi, first row) of the gathered rows, host lists: the ``[lo, hi)`` intervals (``intervals``: their
    bounds, flat) one after the other, ``G`` rows in all (else an internal error)."""
    lo, hi = (intervals[0::2], intervals[1::2]) if intervals else ([0], [0])  # none: an empty plan
    lengths = list(map(operator.sub, hi, lo))
    first = list(accumulate(lengths, initial=0))
    if min(lengths) < 0 or first.pop() != G:
        raise AssertionError(f"tree_attention_varlen: key row intervals of {sum(lengths)} rows for a plan of {G} "
                             "(internal error)")
    return lo, hi, first


def _key_index_changes(lo: list, first: list) -> tuple[list, list]:
    """(rows, changes) on the host from which :func:`_key_index_from` builds the key index of intervals laid out
    one after the other (``lo`` / ``first``, lists): where an interval starts, the change of its offset
    ``lo - first`` (empty intervals' changes add up; those of empty intervals at the end, at row ``G``, fall past
    the rows)."""
    off = list(map(operator.sub, lo, first))
    return first, list(map(operator.sub, off, [0, *off[:-1]]))


def _key_index_from(at: Tensor, by: Tensor, G: int) -> Tensor:
    """``[G]`` int64 on ``at``'s device: row ``r`` of interval ``m`` reads token ``r + lo[m] - first[m]``.  As one
    running sum over the rows: 1 per row, plus the changes of :func:`_key_index_changes`.  Built where it is read: on
    the GPU, only the intervals' changes cross (no ``[G]`` host tensor, 1 MB at 64k tokens, nor its copy)."""
    return torch.ones(G + 1, dtype=torch.int64, device=at.device).index_add_(0, at, by)[:G].cumsum_(0).sub_(1)


def _segment_plan(lo: list, hi: list, first: list, cu_q: list, cu_k: list, tail: int, dev,
                  window: int = 0) -> SegmentPlan:
    """The :class:`SegmentPlan` of laid-out rows (host lists: :func:`_rows`' intervals, both ``cu_seqlens``).  Its
    six device tables (the key index's changes, both ``cu_seqlens``, the copy runs and their offsets) cross in one
    copy (:func:`to_device_tables`), without blocking; the key index is then built on ``dev``."""
    segments = len(cu_q) - 1
    G = cu_k[-1]
    at, by = _key_index_changes(lo, first)
    runs, offsets, tokens, rows, n_tiles = copy_run_lists(lo, hi, first)
    at, by, cu_q32, cu_k32, runs, offsets = to_device_tables((at, by, cu_q, cu_k, runs, offsets), dev, int32=(2, 3))
    return SegmentPlan(copies=CopyRuns(runs=runs.view(-1, 5), offsets=offsets, tokens=tokens, rows=rows,
                                       n_tiles=n_tiles),
        key_index=_key_index_from(at, by, G), cu_seqlens_q=cu_q32, cu_seqlens_k=cu_k32,
        cu_seqlens_q_host=tuple(cu_q), cu_seqlens_k_host=tuple(cu_k),
        max_seqlen_q=max(map(operator.sub, cu_q[1:], cu_q[:-1])) if segments else 0,
        max_seqlen_k=max(map(operator.sub, cu_k[1:], cu_k[:-1])) if segments else 0,
        tail=tail, window=window)


def windowed_plan(subtree_end: Tensor, position_ids: Tensor, window: int) -> SegmentPlan | None:
    """The segments of ``subtree_end`` under a sliding window of ``window`` tokens along each path: each segment's
    keys are the last ``window - 1`` rows of its path prefix and itself, and the kernel's own window
    (``window_size_left = window - 1``, bottom-right aligned as its causal mask) drops the rest per query: the
    window of ``tree_attention_windowed``, whose distances are ``position_ids`` differences, equal to row
    distances when the positions are the depths (consecutive along every path: checked, else ValueError naming
    the token).  G is at most ``T + segments * (window - 1)``, whatever the depth.  None when that is more than
    ``VARLEN_GATHER_LIMIT * T`` rows (deep trees of short nodes): the op then runs the window block mask instead.
    ``subtree_end`` is checked as :func:`segment_plan` checks it (bounds, nested subtrees), without laying out the
    unwindowed plan."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window: expected a positive number of tokens, got {window!r}")
    w = _last_walk(subtree_end)
    T, n_main = w.se.numel(), w.n_main
    pos = host_copy(position_ids).reshape(-1).to(torch.int64)
    if pos.numel() != T:
        raise ValueError(f"position_ids: expected {T} entries (one per token of subtree_end), got {pos.numel()}")
    _check_nested(w)
    keep = [min(w.prefix_len[j], window - 1) for j in range(n_main)]
    G = sum(keep) + w.tail
    if G > VARLEN_GATHER_LIMIT * T:
        return None
    intervals = []  # flat: lo, hi of each interval in turn
    for j in range(n_main):  # segment j's keys: the last keep[j] rows of its ancestors' visible runs, then itself
        run, i, need = [w.ends[j], w.starts[j]], j, keep[j]  # reversed
        while need > 0:
            i, p = w.parents[i]
            take = min(need, p - w.starts[i])
            run += (p, p - take)
            need -= take
        intervals += run[::-1]
    lo, hi, first = _rows(intervals, G)
    cu_k = list(accumulate((keep[j] + w.ends[j] - w.starts[j] for j in range(n_main)), initial=0))
    cu_q = [0, *w.ends[:n_main]]
    _check_depths(w, pos)
    return _segment_plan(lo, hi, first, cu_q, cu_k, w.tail, subtree_end.device, window)


def _check_depths(w: _Walk, pos: Tensor) -> None:
    """The window counts positions, the segments count rows: they agree (for every key, the kept ones and those
    cut) when each token's position is its parent's plus one, which is checked here on the whole tree (inside a
    segment the parent is the previous token; a segment's first token's is the last token above it that sees it;
    a root may start anywhere).  Else ValueError naming the token.  Inside the segments: the tokens whose position
    is not the previous token's plus one (one pass over the tokens) are segments' first tokens."""
    changes = torch.sub(pos[1:], pos[:-1]).ne_(1).nonzero().flatten().add_(1)  # tokens not their previous + 1
    starts = torch.tensor(w.starts, dtype=torch.int64)
    changes = changes[changes < w.tail]  # (the tail's tokens are roots: they may start anywhere)
    inner = changes[torch.isin(changes, starts, invert=True)]
    pairs = [(int(inner[0]) - 1, int(inner[0]))] if inner.numel() else []
    heads = [(par[1] - 1, a) for a, par in zip(w.starts, w.parents) if par is not None]
    if heads:
        above, a = torch.tensor(heads).unbind(1)
        off = (pos[a] != pos[above] + 1).nonzero()
        pairs += [(int(above[off[0, 0]]), int(a[off[0, 0]]))] if off.numel() else []
    if pairs:
        a, b = min(pairs, key=lambda x: x[1])
        raise ValueError(f"position_ids are not the depths along the tree's paths: token {b} (position {int(pos[b])}) "
                         f"follows token {a} (position {int(pos[a])}) on its path; the sliding window counts "
                         "positions, the segments count tokens (give the depths, or attention_kernel='flex')")


def _check_nested(w: _Walk) -> None:
    """Raise ValueError naming the first token where ``subtree_end`` is not nested, read off the walk
    (``_Walk.not_nested``): inside a segment each run's subtree ends before the previous run's, and a segment's
    first token's ends no later than that of the last token above it that sees it.  Those are each token's subtree
    inside its parent's (inside a segment the parent is the previous token; a segment's first token's is that last
    token above it, which the walk finds wherever the first condition holds on the tokens before), and a subtree
    inside its parent's is inside every ancestor's: so the first token where either fails is the first whose
    subtree sticks out of an ancestor's, and where neither does, every token that sees a segment's start is on its
    chain of parents, which is what the segments' keys are."""
    se = w.se
    t = w.not_nested
    if t is not None:
        raise ValueError(f"subtree_end is not the DFS layout of a forest at token {t} (subtree_end[{t}] = {int(se[t])}:"
                         f" its subtree is not nested in its ancestors' subtrees)")


def _block_sparse_plan(subtree_end: Tensor, w: _Walk) -> BlockSparsePlan:
    """The block-sparse plan of a batch with walk ``w``, in :data:`BLOCK_SPARSE_LAYOUT`'s order where
    ``subtree_end`` is nested (else the batch's own order: the kernels' mask holds in any order, a reorder
    needs a tree)."""
    from .tree_layout import heavy_first_order, permuted_subtree_end

    if BLOCK_SPARSE_LAYOUT not in BLOCK_SPARSE_LAYOUTS:
        raise ValueError(f"BLOCK_SPARSE_LAYOUT: expected one of {BLOCK_SPARSE_LAYOUTS}, got {BLOCK_SPARSE_LAYOUT!r}")
    T, order = subtree_end.numel(), None
    if BLOCK_SPARSE_LAYOUT == "heavy_first" and w.not_nested is None:
        order = heavy_first_order(w.se)  # from the walk's host copy: no second read of the device's tensor
        if subtree_end.device.type != "cpu":
            order = to_device_async(order, subtree_end.device)
        subtree_end = permuted_subtree_end(subtree_end, order)
    if subtree_end.device.type != "cuda":
        return BlockSparsePlan(subtree_end=subtree_end, mask_end=None, sparse=None, gathered=w.gathered, tail=T,
                               order=order)
    from .fa4_tree_attention import fa4_block_sparse_tensors, fa4_mask_end
    from .flex_tree_attention import DEFAULT_BLOCK_SIZE, tree_block_mask

    # the bounds were checked by tree_attention_plan (a reorder keeps them): no second host sync in tree_block_mask
    bm = tree_block_mask(subtree_end, block_size=DEFAULT_BLOCK_SIZE, validate=False)
    return BlockSparsePlan(subtree_end=subtree_end, mask_end=fa4_mask_end(subtree_end, bm.BLOCK_SIZE[1]),
                           sparse=fa4_block_sparse_tensors(bm), gathered=w.gathered, tail=T, order=order)


def _check_plan(se: Tensor, lo: Tensor, hi: Tensor, first: Tensor, rows: int, cu_q: Tensor, cu_k: Tensor,
                tail: int, runs: tuple[Tensor, Tensor] | None = None) -> None:
    """The plan is the mask, or ValueError naming a token (a non-nested ``subtree_end``).

    Segment ``s``'s queries are tokens ``[cu_q[s], cu_q[s+1])``; its key rows ``[cu_k[s], cu_k[s+1])`` hold the
    tokens of the intervals ``[lo[m], hi[m])`` laid out from row ``first[m]`` (``rows`` key rows in all); FA4's causal
    mask (aligned bottom-right) lets query ``i`` see key rows up to ``nk - nq + i``.  So a row in the first ``nk - nq``
    (the prefix) is seen by every query of the segment, and own row ``i`` by the queries from ``cu_q[s] + i`` on.
    The plan is the mask iff (1) every row's queries are in the mask: its key is at most its first query, and its
    subtree reaches past the segment's last query; (2) no key repeats within a segment; (3) every key ``k`` is seen
    by ``subtree_end[k] - k`` queries in all (the tail's tokens by themselves alone): with (1) and (2), a pair is
    seen at most once and only inside the mask, so equal counts leave none of the mask out.  All three per interval
    (split where the prefix ends), each interval's smallest subtree end as a range minimum over the runs of equal
    subtree ends (:func:`_interval_min`), the counts compared where they can change (:func:`_first_count_off`):
    O(intervals + runs) after the runs (``runs``: ``(run_se, run_end)`` of ``se``, :func:`_walk`'s; else found
    here in one pass over the tokens)."""
    T = se.numel()
    run_se, run_end = runs if runs is not None else _runs(se)[:2]
    nq, nk = cu_q.diff(), cu_k.diff()
    keep = hi > lo
    lo, hi, first = lo[keep], hi[keep], first[keep]
    n = hi - lo
    seg = torch.searchsorted(cu_k, first, right=True) - 1  # each interval's segment
    inside = seg.clamp(0, max(nk.numel() - 1, 0))
    if (bool((nk < nq).any()) or int(cu_k[-1]) != rows or int(cu_q[-1]) != tail
            or not torch.equal(first, torch.cumsum(n, 0) - n) or bool((seg != inside).any())
            or bool((first + n > cu_k[1:][inside]).any()) or bool((lo < 0).any()) or bool((hi > T).any())):
        raise AssertionError("tree_attention_varlen: a segment plan whose key rows do not tile its segments "
                             "(internal error)")
    q0, q1, own = cu_q[:-1][seg], cu_q[1:][seg], cu_k[1:][seg] - nq[seg]  # own: the segment's first own row
    nqs = nq[seg]
    # split each interval where its segment's own rows begin: prefix keys [lo, lo + p), own keys [lo + p, hi)
    p = (own - first).clamp(min=0).minimum(n)
    i0 = first + p - own  # own index of the first own row (>= 0 where the own part is not empty)
    ko = lo + p
    # (1) within the mask: a prefix key is at most the segment's first query; own key ko + t at most q0 + i0 + t;
    # every key's subtree ends past the segment's last query (q1 - 1)
    late_prefix = (p > 0) & (lo + p - 1 > q0)
    late_own = (p < n) & (ko > q0 + i0)
    short = _interval_min(run_se, run_end, lo, hi) < q1
    # (2) distinct keys within a segment: the segment's intervals, by first key, do not overlap
    order = torch.argsort(seg * (T + 1) + lo)
    s_o, lo_o, hi_o = seg[order], lo[order], hi[order]
    repeated = (s_o[1:] == s_o[:-1]) & (lo_o[1:] < hi_o[:-1])
    # (3) counts: a prefix key is seen by nq queries; own key ko + t by nq - i0 - t = (nq - i0 + ko) - k; a tail
    # token by itself.  Compared with subtree_end[k] - k, so each key's count plus k (:func:`_first_count_off`)
    bad = []
    off = _first_count_off(T, lo, ko, hi, nqs, nqs - i0 + ko, tail, run_se, run_end)
    if off is not None:
        bad.append(off)
    outside = torch.nonzero(late_prefix | late_own | short).flatten()
    if outside.numel():  # the first interval with a row outside the mask: its first such key
        m = int(outside[0])
        if bool(late_prefix[m]):
            bad.append(max(int(lo[m]), int(q0[m]) + 1))  # the first prefix key past the segment's first query
        elif bool(late_own[m]):
            bad.append(int(ko[m]))
        else:
            k = torch.arange(int(lo[m]), int(hi[m]))
            bad.append(int(k[se[k] < q1[m]][0]))
    if repeated.any():
        m = int(torch.nonzero(repeated).flatten()[0])
        bad.append(int(lo_o[m + 1]))
    if bad:
        t = bad[0]
        raise ValueError(f"subtree_end is not the DFS layout of a forest at token {t} (subtree_end[{t}] = {int(se[t])}:"
                         f" its subtree is not nested in its ancestors' subtrees)")


def _runs(se: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(run_se, run_end, counts)``: the runs of equal entries of ``se`` (host int64 ``[T]``), each run's value, end
    and length."""
    run_se, counts = torch.unique_consecutive(se, return_counts=True)
    return run_se, counts.cumsum(0), counts


def _count_plus_key(x: Tensor, lo: Tensor, ko: Tensor, hi: Tensor, nq: Tensor, c: Tensor, tail: int) -> Tensor:
    """At the keys ``x``: each key ``k`` plus the number of queries that see it, where interval ``m``'s prefix keys
    ``[lo[m], ko[m])`` are each seen by ``nq[m]`` queries, its own keys ``[ko[m], hi[m])`` by ``c[m] - k``, and the
    tokens from ``tail`` on by themselves.  A line in ``k``, ``A + S k``, between the ranges' ends: ``A`` and ``S``
    are running sums of the ranges' changes in position order (an empty range's changes cancel), read at ``x``."""
    one = torch.ones(1, dtype=torch.int64)
    at = torch.cat([lo, ko, ko, hi, torch.tensor([tail])])
    d_a = torch.cat([nq, -nq, c, -c, one])  # the constant part: nq on [lo, ko), c on [ko, hi), 1 from tail on
    d_s = torch.cat([torch.zeros_like(lo), torch.zeros_like(ko), -one.expand_as(ko), one.expand_as(hi), one - 1])
    order = torch.argsort(at)
    a = torch.cat([one - 1, d_a[order].cumsum(0)])
    s = torch.cat([one - 1, d_s[order].cumsum(0)])
    i = torch.searchsorted(at[order], x, right=True)  # the changes at or before each key
    return a[i] + (s[i] + 1) * x


def _first_count_off(T: int, lo: Tensor, ko: Tensor, hi: Tensor, nq: Tensor, c: Tensor, tail: int, run_se: Tensor,
                     run_end: Tensor) -> int | None:
    """The first key ``k`` in ``[0, T)`` whose :func:`_count_plus_key` is not ``subtree_end[k]`` (given as runs of
    equal values), or None.  Both sides are lines between the ranges' ends and the runs' ends, so they agree on a
    piece of keys iff they agree at its first and last key (a line that differs somewhere on a piece and not at its
    first key differs at the next one)."""
    starts = torch.cat([lo, ko, hi, torch.tensor([0, tail]), run_end[:-1]])
    starts = torch.unique(starts[(starts >= 0) & (starts < T)])  # sorted, and 0 is among them
    lasts = torch.cat([starts[1:], torch.tensor([T])]) - 1
    x = torch.cat([starts, lasts])
    want = run_se[torch.searchsorted(run_end, x, right=True)]  # the run holding each key
    off = (_count_plus_key(x, lo, ko, hi, nq, c, tail) != want).view(2, -1)
    if not bool(off.any()):
        return None
    piece = int(off.any(0).nonzero()[0, 0])
    return int(starts[piece]) + (0 if bool(off[0, piece]) else 1)


def _interval_min(run_se: Tensor, run_end: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """``min(se[lo[m]:hi[m]])`` per non-empty interval ``m`` of keys in ``[0, T)``, ``se`` given as runs of equal
    values: the minimum of the runs from the one holding ``lo[m]`` to the one holding ``hi[m] - 1``, read off a
    sparse table of the runs' minima over powers of two (two lookups a range, O(runs log runs) to build)."""
    if not lo.numel():
        return lo.new_zeros(0)
    r0 = torch.searchsorted(run_end, lo, right=True)
    r1 = torch.searchsorted(run_end, hi - 1, right=True)
    R = run_se.numel()
    levels, width = [run_se], 1  # level j: the minimum of the runs [r, r + 2^j), for r in [0, R - 2^j]
    while 2 * width <= R:
        levels.append(torch.minimum(levels[-1][:-width], levels[-1][width:]))
        width *= 2
    table = torch.cat(levels)
    base = torch.tensor([0] + [R - (1 << j) + 1 for j in range(len(levels) - 1)]).cumsum(0)
    j = torch.frexp((r1 - r0 + 1).double()).exponent.long() - 1  # floor(log2(length)), exact
    at = base[j] + r0
    return torch.minimum(table[at], table[at + (r1 + 1 - r0) - (1 << j)])


_PLANS = LastBatch()


def _plan(subtree_end: Tensor, q: Tensor) -> SegmentPlan | BlockSparsePlan:
    """The batch's plan, kept per ``subtree_end`` tensor.  Off the FA4 kernels (the reference) both plans are
    possible; on them the block-sparse one needs what FA4 tree attention takes (head dim 64/128)."""
    from .fa4_tree_attention import refuse_block_sparse_backward_if_deterministic

    fa4 = _fa4(q)
    block_sparse = _block_sparse_takes(q)
    if block_sparse and fa4 and torch.are_deterministic_algorithms_enabled():
        # the segments take FA4's deterministic backward as they are: they run wherever they fit; past their bound
        # the block-sparse plan is refused (or, under warn_only, runs)
        block_sparse = not segments_fit(subtree_end)
        if block_sparse:
            refuse_block_sparse_backward_if_deterministic(
                "tree_attention_varlen: this batch's segments would gather past their bound (segments_fit: "
                f"{MAX_GATHER_FACTOR} x its tokens)", "attention_kernel='flex' runs such trees deterministically")
    return _PLANS.get((subtree_end,), (block_sparse, BLOCK_SPARSE_LAYOUT),
                      lambda: _build_plan(subtree_end, block_sparse))


def _block_sparse_takes(q: Tensor) -> bool:
    """Whether the block-sparse plan's kernels take ``q``: off the FA4 kernels (the reference) always, on them where
    FA4's block-sparse tiles take its head dim."""
    if not _fa4(q):
        return True
    from .fa4_tree_attention import fa4_input_reason

    return fa4_input_reason(q) is None


def prepare(subtree_end: Tensor, q: Tensor, position_ids: Tensor | None = None, window: int | None = None) -> None:
    """Build now, and keep, the plan that the op (``window=None``) or its windowed form will run for this batch:
    their next call with the same ``subtree_end`` (and ``position_ids``) tensors, unchanged, finds it
    (``TreeProgram.prepare``: a step's host work done while the GPU runs the step before).  ``q``: any tensor with
    the attention inputs' device, dtype and head dim (the plan's kind depends on them, not on the values)."""
    if window is None:
        _check_settings()
        _unkept_forward_plan(_plan(subtree_end, q), subtree_end, q)  # the forward's own plan, where it runs one
    else:
        _window_plan(subtree_end, position_ids, window)


def _build_plan(subtree_end: Tensor, block_sparse: bool) -> SegmentPlan | BlockSparsePlan:
    with torch.profiler.record_function("treecompile::attention_plan"):  # host work, once per batch: named in profiles
        return tree_attention_plan(subtree_end, block_sparse=block_sparse)


_FORWARD_PLANS = LastBatch()


def _unkept_forward_plan(plan, subtree_end: Tensor, q: Tensor):
    """The plan the forward runs when it keeps no rows: under :data:`UNKEPT_FORWARD` = "block_sparse" a segment plan's
    batch runs its forward on the block-sparse plan where that plan's kernels take ``q`` (off the FA4 kernels: the
    reference, always), kept per ``subtree_end`` tensor as the op's plan is; else ``plan`` itself.  The backward
    reads the batch's segment plan (:func:`_plan`) and gathers the rows, as it does for any forward that kept none:
    the same attention, its out and log-sum-exp from either kernel.  (Its callers have checked the setting.)"""
    if (UNKEPT_FORWARD == "segments" or not isinstance(plan, SegmentPlan) or plan.window or not plan.tail
            or not _block_sparse_takes(q)):
        return plan
    return _FORWARD_PLANS.get((subtree_end,), BLOCK_SPARSE_LAYOUT, lambda: _build_forward_plan(subtree_end))


def _check_setting(name: str, value, choices: tuple) -> None:
    """A module setting refused (ValueError naming it) if not one of its ``choices``."""
    if value not in choices:
        raise ValueError(f"varlen_tree_attention.{name}: expected one of {choices}, got {value!r}")


def _check_settings() -> None:
    """The settings a forward reads (:data:`KV_HEADS`, :data:`UNKEPT_FORWARD`), checked by every forward and by
    :func:`prepare` whether or not the call gathers rows or keeps them."""
    _check_setting("KV_HEADS", KV_HEADS, KV_HEADS_CHOICES)
    _check_setting("UNKEPT_FORWARD", UNKEPT_FORWARD, UNKEPT_FORWARD_CHOICES)


def _build_forward_plan(subtree_end: Tensor) -> BlockSparsePlan:
    with torch.profiler.record_function("treecompile::attention_plan"):
        return _block_sparse_plan(subtree_end, _last_walk(subtree_end))


def _segments(q: Tensor, k: Tensor, v: Tensor, plan):
    """Per piece of the plan (a segment, or the whole sequence of a block-sparse plan): (query rows, key rows,
    ``[H, n, D]`` queries, ``[H, m, D]`` keys and values with the kv heads repeated for GQA, the ``[n, m]``
    visibility), as the reference kernels read them."""
    r = q.shape[1] // k.shape[1]
    for rq, rk, visible in plan.pieces(q.device):
        qs = q[rq].transpose(0, 1)
        ks, vs = (x[rk].transpose(0, 1).repeat_interleave(r, 0) for x in (k, v))
        yield rq, rk, qs, ks, vs, visible


def varlen_attention_reference(q: Tensor, k: Tensor, v: Tensor, plan,
                               scale: float) -> tuple[Tensor, Tensor]:
    """The plan's attention: ``q [T, H, D]``, ``k``/``v`` ``[G, Hkv, D]`` (gathered for a :class:`SegmentPlan`, the
    sequence's own for a :class:`BlockSparsePlan`) -> ``(out [tail, H, Dv], lse [H, tail] float32)``; any dtype and
    device (exact in float64; half precision computed in float32, as the kernels accumulate)."""
    dtype = q.dtype
    q, k, v = (x.to(torch.promote_types(torch.float32, dtype)) for x in (q, k, v))
    outs, lses = [], []
    for _, _, qs, ks, vs, visible in _segments(q, k, v, plan):
        s = ((qs @ ks.transpose(1, 2)) * scale).masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append((torch.exp(s - lse[..., None]) @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs, 0).to(dtype), torch.cat(lses, 1).float()


def varlen_attention_reference_bwd(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, plan,
                                   scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`varlen_attention_reference` (``dq [T, H, D]``, ``dk``/``dv`` ``[G, Hkv, D]``), written
    out (softmax backward per piece, GQA groups summed), so that it runs inside a custom op where autograd
    does not record.  Half precision computed in float32."""
    dtype = q.dtype
    q, k, v, dout = (x.to(torch.promote_types(torch.float32, dtype)) for x in (q, k, v, dout))
    Hkv = k.shape[1]
    r = q.shape[1] // Hkv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rq, rk, qs, ks, vs, visible in _segments(q, k, v, plan):
        dos = dout[rq].transpose(0, 1)
        p = torch.softmax(((qs @ ks.transpose(1, 2)) * scale).masked_fill(~visible, float("-inf")), -1)
        dp = dos @ vs.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * scale
        dq[rq] = (ds @ ks).transpose(0, 1)
        dk[rk] = (ds.transpose(1, 2) @ qs).unflatten(0, (Hkv, r)).sum(1).transpose(0, 1)
        dv[rk] = (p.transpose(1, 2) @ dos).unflatten(0, (Hkv, r)).sum(1).transpose(0, 1)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def _fa4(q: Tensor) -> bool:
    return q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16)


def _fwd(q_t, kg, vg, plan, scale, out=None, lse=None):
    """(out, lse) of the plan's attention; ``out`` / ``lse``: where to write them (FA4 writes them in place, the
    reference copies), as ``[n, H, Dv]`` / ``[H, n]`` views of the op's ``[T, ...]`` results: given for a segment
    plan, not for a block-sparse plan (every query is the kernel's: its fresh tensors)."""
    if out is not None and isinstance(plan, BlockSparsePlan):
        raise AssertionError("_fwd: a block-sparse plan has no tail to write around (internal error)")
    if not _fa4(q_t):
        with torch.no_grad():
            o, l_ = varlen_attention_reference(q_t, kg, vg, plan, scale)
        return (o if out is None else out.copy_(o)), (l_ if lse is None else lse.copy_(l_))
    from flash_attn.cute.interface import _flash_attn_fwd

    if isinstance(plan, BlockSparsePlan):  # [T, H, D] as a batch of one; lse [1, H, T]
        from .fa4_tree_attention import cute_tree_mask

        out, lse = _flash_attn_fwd(q_t[None], kg[None], vg[None], softmax_scale=scale, causal=False,
                                   return_lse=True, mask_mod=cute_tree_mask(), aux_tensors=[plan.mask_end],
                                   block_sparse_tensors=plan.sparse[0])[:2]
        return out[0], lse[0]
    if out is None or lse is None:
        raise AssertionError("_fwd: a segment plan's out / lse are the op's buffers (internal error)")

    def interface():
        _flash_attn_fwd(q_t, kg, vg, softmax_scale=scale, causal=True, return_lse=True,
                        cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q,
                        max_seqlen_k=plan.max_seqlen_k, out=out, lse=lse, **_window_kw(plan))
    # the layers of one plan: FA4's recorded launch, without its interface's per-call host work (ops/fa4_replay.py)
    fa4_replay.launch(plan, (scale,), (q_t, kg, vg, out, lse), interface, kind="forward",
                      owned=(plan.cu_seqlens_q, plan.cu_seqlens_k))
    return out, lse


def _bwd(q_t, kg, vg, out_t, dout_t, lse, plan, scale, dq=None):
    """(dq, dk, dv) of the plan's attention (dk/dv per gathered row); ``dq``: where to write the query gradient
    (FA4 writes it in place, the reference copies): a segment plan with a tail, as in :func:`_fwd`."""
    if dq is not None and isinstance(plan, BlockSparsePlan):
        raise AssertionError("_bwd: a block-sparse plan has no tail to write around (internal error)")
    if not _fa4(q_t):
        grads = varlen_attention_reference_bwd(q_t, kg, vg, dout_t, plan, scale)
        return grads if dq is None else (dq.copy_(grads[0]), *grads[1:])
    from flash_attn.cute.interface import _flash_attn_bwd

    if isinstance(plan, BlockSparsePlan):
        from .fa4_tree_attention import cute_tree_mask

        grads = _flash_attn_bwd(q_t[None], kg[None], vg[None], out_t[None], dout_t[None], lse[None], scale, False,
                                mask_mod=cute_tree_mask(), aux_tensors=[plan.mask_end],
                                block_sparse_tensors=plan.sparse[1])[:3]
        return tuple(g[0] for g in grads)
    deterministic = torch.are_deterministic_algorithms_enabled()

    def interface():
        return _flash_attn_bwd(q_t, kg, vg, out_t, dout_t, lse, scale, True,
                               cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
                               max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k, dq=dq,
                               deterministic=deterministic, **_window_kw(plan))[:3]
    # as the forward's: the interface's five launches and scratch buffers recorded once per plan, replayed after
    tensors = (q_t, kg, vg, out_t, dout_t, lse) + (() if dq is None else (dq,))
    return fa4_replay.launch(plan, (scale, deterministic), tensors, interface, kind="backward",
                             owned=(plan.cu_seqlens_q, plan.cu_seqlens_k))


def _window_kw(plan: SegmentPlan) -> dict:
    """FA4's arguments for the plan's sliding window: query row i of a segment sees key rows
    ``(i - window, i]`` (counted bottom-right, as its causal mask); none without a window."""
    return dict(window_size_left=plan.window - 1, window_size_right=0) if plan.window else {}


def _check(q, k, v, subtree_end):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1 or k.shape[0] != 1 or v.shape[0] != 1:
        raise ValueError(f"tree_attention_varlen: expected q [1,H,T,D], k/v [1,Hkv,T,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"tree_attention_varlen: {q.shape[1]} query heads over {k.shape[1]} key / {v.shape[1]} "
                         "value heads (query heads must be a multiple of the kv heads)")
    if not (q.shape[2] == k.shape[2] == v.shape[2] == subtree_end.shape[-1]):
        raise ValueError(f"tree_attention_varlen: sequence lengths differ: q {q.shape[2]}, k {k.shape[2]}, "
                         f"v {v.shape[2]}, subtree_end {subtree_end.shape[-1]}")


def _tokens_major(x: Tensor) -> Tensor:
    """``[1, H, T, D]`` -> ``[T, H, D]``, contiguous (a free view of the model's ``[1, T, H, D]`` storage).  That
    storage is taken as one view (each torch call costs host time on every layer: 10-50 us on the H200's host)."""
    _, H, T, D = x.shape
    if x.stride()[1:] == (D, H * D, 1):
        return x.as_strided((T, H, D), (H * D, D, 1))
    return x[0].transpose(0, 1).contiguous()


def _heads_major(x: Tensor) -> Tensor:
    """``[T, H, D]`` -> ``[1, H, T, D]`` view (one call for a contiguous ``x``, as :func:`_tokens_major`)."""
    T, H, D = x.shape
    if x.is_contiguous():
        return x.as_strided((1, H, T, D), (T * H * D, D, H * D, 1))
    return x.transpose(0, 1).unsqueeze(0)


# ------------------------------------------------------------------ the gathered rows, kept for the backward
# What a varlen op keeps of a segment plan's gathered key/value rows from its forward to its backward (``keep``):
# "none" (the backward gathers them again), "all" (always), "fit" (where memory allows: :func:`keeps_keys`).
KEEP = ("none", "all", "fit")


@dataclass(frozen=True)
class KeysFit:
    """One forward's ``keep="fit"`` decision (:func:`keeps_keys`), in bytes."""

    layers: int  # the varlen calls of the forward that share the decision
    per_layer: int  # allocated between the first two calls' starts: one layer's activations, measured
    keys: int  # the second call's gathered rows (K and V): what each later call would keep
    reserve: int  # left for the head's logits (``reserve_per_token`` x T)
    margin: int  # what the head's "fit" leaves too (ops.logprobs_kept.fit_margin_bytes)
    headroom: int  # what the device had left at the second call (ops.logprobs_kept.headroom_bytes)
    keep: bool


class _FitState(threading.local):
    """The "fit" decision of the forward now running on this thread (a thread per device runs its own forwards)."""

    start: tuple | None = None  # (device, memory allocated) at the forward's first call (layer 0)
    keep = False  # the decision, made at its second call (layer 1)


_FIT = _FitState()
# The last decision of this process, for benchmarks and logs (None until one was made); nothing reads it to decide.
last_keys_fit: KeysFit | None = None


def pop_last_keys_fit() -> KeysFit | None:
    """:data:`last_keys_fit`, which is then None until the next "fit" decision (benchmarks: one record per row)."""
    global last_keys_fit
    fit, last_keys_fit = last_keys_fit, None
    return fit


def _check_keep(keep: str) -> None:
    if keep not in KEEP:
        raise ValueError(f"tree_attention_varlen: keep must be one of {KEEP}, got {keep!r}")


def _kv_rep(H: int, Hkv: int) -> int:
    """How many times a segment plan's gather repeats each kv head under :data:`KV_HEADS`: the query heads per kv
    head when "expanded", or "auto" with groups of at most :data:`EXPAND_MAX_GROUP`; else 1."""
    _check_setting("KV_HEADS", KV_HEADS, KV_HEADS_CHOICES)
    group = H // Hkv
    if KV_HEADS == "expanded" or (KV_HEADS == "auto" and group <= EXPAND_MAX_GROUP):
        return group
    return 1


def gathered_bytes(plan, k: Tensor, v: Tensor, rep: int = 1) -> int:
    """The bytes of the gathered key and value rows that ``plan`` reads (0 for a plan that gathers none), with each
    kv head repeated ``rep`` times (:func:`_kv_rep`)."""
    if not isinstance(plan, SegmentPlan):
        return 0
    return plan.gathered * rep * sum(x.shape[1] * x.shape[3] * x.element_size() for x in (k, v))


def keeps_keys(keep: str, plan, q: Tensor, k: Tensor, v: Tensor, layer: int = 0, layers: int = 1,
               reserve_per_token: int = 0) -> bool:
    """Whether a varlen call keeps its gathered key/value rows for its backward (which then does not gather them
    again: 2.0 ms of a 164 ms step, Qwen3-0.6B at 16k tree tokens on an H200, session 41).
    Only a segment plan that gathers rows keeps any.  ``keep``:

    - ``"none"``, ``"all"``: never, always.
    - ``"fit"``: off CUDA always (memory is not tracked there).  On CUDA one decision per forward for its
      ``layers`` calls (the lowering numbers them in graph order, ``layer``): the first call only notes the memory
      allocated; the second measures what one layer's activations took since then and keeps, for itself and every
      later call, when the device's headroom covers the rest of the forward with the rows kept, the head's logits
      (``reserve_per_token`` bytes per token: the head's kept logits are worth more per byte than the rows, which
      save one gather of memory-bound copies) and the head's margin::

          (layers - 1) * (per_layer + rows) + reserve_per_token * T + total / FIT_MARGIN_FRACTION <= headroom

      The estimate assumes the later layers are like the second (a hybrid's attention layers: the same period of
      other layers between them).  A forward whose decision says no runs as it would without keeping; where the
      estimate is short, the head's own "fit" keeps fewer logits.  The decision is in :data:`last_keys_fit`.
      A second call with no first call since the last decision reuses it: activation checkpointing recomputes
      layers last to first, and must keep what the forward kept (``torch.utils.checkpoint`` checks the shapes).
      The state is per thread; first two calls on different devices keep nothing.
    """
    if keep == "fit" and q.is_cuda:
        keep_rows = _fit(plan, q, k, v, layer, layers, reserve_per_token)
    else:
        keep_rows = keep != "none"
    return keep_rows and isinstance(plan, SegmentPlan) and plan.tail > 0


def _fit(plan, q: Tensor, k: Tensor, v: Tensor, layer: int, layers: int, reserve_per_token: int) -> bool:
    """:func:`keeps_keys` under "fit" on CUDA: note the memory at call 0, decide at the call 1 after it, else reuse
    the decision."""
    global last_keys_fit
    fit = _FIT
    if layer == 0:
        fit.start, fit.keep = (q.device, allocator_bytes(q.device)[0]), False
        return False
    if layer == 1 and fit.start is not None:
        (device, start), fit.start = fit.start, None
        if device != q.device:  # the first two calls on two devices: nothing measured
            fit.keep = False
            return False
        allocator = allocator_bytes(q.device)
        per_layer = max(0, allocator[0] - start)
        rows = gathered_bytes(plan, k, v, _kv_rep(q.shape[1], k.shape[1]))
        reserve = reserve_per_token * q.shape[2]
        margin = fit_margin_bytes(q.device)
        headroom = headroom_bytes(q.device, allocator)
        fit.keep = (layers - 1) * (per_layer + rows) + reserve + margin <= headroom
        last_keys_fit = KeysFit(layers=layers, per_layer=per_layer, keys=rows, reserve=reserve, margin=margin,
                                headroom=headroom, keep=fit.keep)
    return fit.keep


@torch.library.custom_op("treecompile::tree_attention_varlen_fwd", mutates_args=())
def tree_attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor, scale: float, keep: str = "none",
                              layer: int = 0, layers: int = 1,
                              reserve_per_token: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out ``[1, H, T, Dv]`` as a view of ``[T, H, Dv]`` storage, lse ``[H, T]`` float32, and the gathered key /
    value rows ``[G, Hkv, D]`` kept for the backward, or ``[0, Hkv, D]``: :func:`keeps_keys` decides under ``keep``
    as the ``layer``-th of ``layers`` varlen calls of one forward, ``reserve_per_token`` bytes per token left for the
    head)."""
    _check(q, k, v, subtree_end)
    _check_keep(keep)
    _check_settings()
    plan = _plan(subtree_end, q)
    keep_rows = keeps_keys(keep, plan, q, k, v, layer, layers, reserve_per_token)
    if not keep_rows:  # nothing kept: the forward may read the rows in place (UNKEPT_FORWARD)
        plan = _unkept_forward_plan(plan, subtree_end, q)
    return _forward(q, k, v, plan, scale, keep_rows)


def _forward(q: Tensor, k: Tensor, v: Tensor, plan, scale: float, keep: bool = False,
             front: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The forward ops' work under ``plan`` (a segment plan, windowed or not, or a block-sparse plan): out, lse and
    the gathered key/value rows when ``keep`` (else empty).  ``front``: ``[F, Hkv, D]`` key and value rows in front of
    the sequence's, which a segment plan's key index reads first (a partition's boundary rows,
    ``ops/varlen_boundary_attention.py``)."""
    n = plan.tail
    q_t, k_t, v_t = _tokens_major(q), _tokens_major(k), _tokens_major(v)
    T, H = q_t.shape[0], q_t.shape[1]
    keys = None
    if front is not None and not isinstance(plan, SegmentPlan):
        raise AssertionError("_forward: rows in front need a segment plan (internal error)")
    if n:  # a segment plan's rows as KV_HEADS says; the block-sparse plan's in place, in its order
        keys = (plan.keys(k_t, v_t, _kv_rep(H, k_t.shape[1]), front) if isinstance(plan, SegmentPlan)
                else plan.keys(k_t, v_t))
    # keep: only a segment plan (keeps_keys); rows expanded to the query heads are kept as [G * rep, Hkv, D] views
    # (the op's declared layout: the backward tells them apart by their count)
    kept = _as_kept(keys, k_t.shape[1]) if keep and keys is not None else _no_keys(k_t, v_t)
    if isinstance(plan, BlockSparsePlan):  # every query is the kernel's: its fresh tensors, in the kernels' order
        out, lse = _fwd(plan.to_kernel(q_t), *keys, plan, scale)
        return _heads_major(plan.to_batch(out).contiguous()), plan.to_batch(lse.float(), 1).contiguous(), *kept
    # a segment plan: the kernel writes the first n rows of the op's results in place (no concatenation copies)
    out = q_t.new_empty((T, H, v_t.shape[-1]))
    lse = torch.empty((H, T), dtype=torch.float32, device=q.device)
    if n == T:
        _fwd(q_t, *keys, plan, scale, out=out, lse=lse)
        return _heads_major(out), lse, *kept
    if n:
        _fwd(q_t[:n], *keys, plan, scale, out=out[:n], lse=lse[:, :n])
    # tokens that see only themselves, softmax over one key: the output is the token's value row, the log-sum-exp its
    # one score (one kernel: ops/varlen_tail.py)
    tail_forward(q_t, k_t, v_t, out, lse, n, scale)
    return _heads_major(out), lse, *kept


def _as_kept(keys: tuple[Tensor, Tensor], Hkv: int) -> tuple[Tensor, Tensor]:
    """The gathered rows ``[G, Hkv * rep, D]`` as the op's kept results ``[G * rep, Hkv, D]`` (the same memory)."""
    return tuple(x.view(-1, Hkv, x.shape[-1]) for x in keys)


def _kept_keys(kept_k: Tensor, kept_v: Tensor, plan: SegmentPlan, H: int) -> tuple[tuple[Tensor, Tensor], int]:
    """The forward's kept rows back as the kernel's ``[G, Hkv * rep, D]`` and their ``rep`` (1, or the query heads
    per kv head where the forward expanded them: :data:`KV_HEADS` when it ran)."""
    G, Hkv = plan.gathered, kept_k.shape[1]
    rep = kept_k.shape[0] // G if G else 0
    if rep not in (1, H // Hkv) or kept_k.shape[0] != G * rep or kept_v.shape[0] != kept_k.shape[0]:
        raise AssertionError(f"tree_attention_varlen: the forward kept {kept_k.shape[0]} / {kept_v.shape[0]} gathered "
                             f"rows of {Hkv} kv heads, the plan has {G} for {H} query heads (internal error)")
    return tuple(x.view(G, Hkv * rep, x.shape[-1]) for x in (kept_k, kept_v)), rep


def _no_keys(k_t: Tensor, v_t: Tensor) -> tuple[Tensor, Tensor]:
    """No kept rows: ``[0, Hkv, D]`` of each (the backward gathers again)."""
    return k_t.new_empty((0, *k_t.shape[1:])), v_t.new_empty((0, *v_t.shape[1:]))


def _fake_keys(k: Tensor, v: Tensor, keep) -> tuple[Tensor, Tensor]:
    """The kept rows' fake tensors: none under ``keep="none"``, else an unbacked row count (the plan and,
    under "fit", the memory left decide it at run time: one compiled graph serves every count)."""
    if keep == "none":
        return _no_keys(k[0].transpose(0, 1), v[0].transpose(0, 1))
    G = torch.library.get_ctx().new_dynamic_size()
    return k.new_empty((G, k.shape[1], k.shape[3])), v.new_empty((G, v.shape[1], v.shape[3]))


@tree_attention_varlen_fwd.register_fake
def _(q, k, v, subtree_end, scale, keep="none", layer=0, layers=1, reserve_per_token=0):
    T, H = q.shape[2], q.shape[1]
    return (_heads_major(q.new_empty((T, H, v.shape[-1]))),
            q.new_empty((H, T), dtype=torch.float32), *_fake_keys(k, v, keep))


@torch.library.custom_op("treecompile::tree_attention_varlen_bwd", mutates_args=())
def tree_attention_varlen_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                              subtree_end: Tensor, scale: float, kept_k: Tensor,
                              kept_v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the layouts of :func:`_heads_major`; key/value gradients summed over their gathered
    copies in float32.  ``kept_k``/``kept_v``: the gathered rows the forward kept, or none: then K/V are gathered
    again here (G rows per layer, ~2x T on wide trees; :func:`keeps_keys` says when they are kept)."""
    return _backward_grads(q, k, v, out, lse, dout, _plan(subtree_end, q), scale, kept_k, kept_v)


def _backward_grads(q, k, v, out, lse, dout, plan, scale: float, kept_k: Tensor | None = None,
                    kept_v: Tensor | None = None, front: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, ...]:
    """The backward ops' work under ``plan`` (``kept_k``/``kept_v``: the forward's gathered rows, when it kept any):
    (dq, dk, dv), then with ``front`` (:func:`_forward`'s) the gradients of those rows too, each row's summed over its
    copies as the sequence's are."""
    if front is not None and not isinstance(plan, SegmentPlan):
        raise AssertionError("_backward_grads: rows in front need a segment plan (internal error)")
    n = plan.tail
    q_t, k_t, v_t, dout_t = _tokens_major(q), _tokens_major(k), _tokens_major(v), _tokens_major(dout)
    if isinstance(plan, BlockSparsePlan):  # every key once (no copies to sum), every query the kernel's
        grads = _bwd(plan.to_kernel(q_t), *plan.keys(k_t, v_t), plan.to_kernel(_tokens_major(out)),
                     plan.to_kernel(dout_t), plan.to_kernel(lse, 1).contiguous(), plan, scale)
        return tuple(_heads_major(plan.to_batch(g)) for g in grads)
    T, H = q_t.shape[0], q_t.shape[1]
    F = 0 if front is None else front[0].shape[0]
    if not n:
        dq, dk, dv = torch.empty_like(q_t), torch.empty_like(k_t), torch.empty_like(v_t)
        dfront = () if front is None else tuple(torch.zeros_like(x) for x in front)
    else:
        if kept_k is not None and kept_k.shape[0]:
            keys, rep = _kept_keys(kept_k, kept_v, plan, H)
        else:
            rep = _kv_rep(H, k_t.shape[1])
            keys = plan.keys(k_t, v_t, rep, front)
        args = (q_t[:n], *keys, _tokens_major(out)[:n], dout_t[:n], _lse_rows(lse, n), plan, scale)
        if n == T:
            dq, dkg, dvg = _bwd(*args)
        else:  # the kernel writes the first n rows of dq in place; the tail's rows come after
            dq = torch.empty_like(q_t)
            dkg, dvg = _bwd(*args, dq=dq[:n])[1:]
        # each row's key/value gradient: the sum over its gathered copies (float32, rounded once); rows >= F + n next
        if plan.copies.tokens != F + n:  # every segment token is a key of its own segment: the sums cover [0, F + n)
            raise AssertionError(f"tree_attention_varlen: the key copies cover {plan.copies.tokens} rows, the "
                                 f"segments {F} + {n} (internal error)")
        dks = sum_copies(dkg, plan.copies, plan.key_index, F + T, zero_tail=False, rep=rep)
        dvs = sum_copies(dvg, plan.copies, plan.key_index, F + T, zero_tail=False, rep=rep)
        dk, dv = (dks, dvs) if front is None else (dks[F:], dvs[F:])
        # the front rows as tensors of their own (an op's outputs may not share storage); 0 where no query sees one
        dfront = () if front is None else (dks[:F].clone(), dvs[:F].clone())
    # the tail (softmax over one key): no query or key gradient; the value rows receive their own output gradient,
    # summed over the query heads of a group (one kernel: ops/varlen_tail.py)
    tail_backward(dout_t, dq, dk, dv, n)
    return tuple(_heads_major(x) for x in (dq, dk, dv, *dfront))


def _lse_rows(lse: Tensor, n: int) -> Tensor:
    """The segments' ``[H, n]`` columns of the forward's ``[H, T]`` lse for the backward kernel: in place where FA4
    takes them as they are (FA4's ``maybe_contiguous`` keeps a tensor that is contiguous, or whose last dim is and
    whose start and row stride are 16-byte aligned; it copies any other, and a copy inside the call keeps the call
    from being replayed, ops/fa4_replay.py), else one contiguous copy here."""
    rows = lse[:, :n]
    aligned = rows.stride(1) == 1 and (rows.stride(0) * rows.element_size()) % 16 == 0 and rows.data_ptr() % 16 == 0
    return rows if rows.is_contiguous() or aligned else rows.contiguous()


@tree_attention_varlen_bwd.register_fake
def _(q, k, v, out, lse, dout, subtree_end, scale, kept_k, kept_v):
    return tuple(_heads_major(x.new_empty((x.shape[2], x.shape[1], x.shape[3]))) for x in (q, k, v))


def _setup(ctx, inputs, output):
    q, k, v, subtree_end, scale, *_ = inputs
    out, lse, kept_k, kept_v = output
    ctx.save_for_backward(q, k, v, out, lse, subtree_end, kept_k, kept_v)
    ctx.scale = scale
    ctx.mark_non_differentiable(lse, kept_k, kept_v)


def _backward(ctx, dout, _dlse, _dkept_k, _dkept_v):
    q, k, v, out, lse, subtree_end, kept_k, kept_v = ctx.saved_tensors
    dq, dk, dv = torch.ops.treecompile.tree_attention_varlen_bwd(q, k, v, out, lse, dout, subtree_end, ctx.scale,
                                                                 kept_k, kept_v)
    return dq, dk, dv, None, None, None, None, None, None


tree_attention_varlen_fwd.register_autograd(_backward, setup_context=_setup)


def tree_attention_varlen(q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor, scale: float | None = None, *,
                          keep: str = "none", layer: int = 0, layers: int = 1, reserve_per_token: int = 0) -> Tensor:
    """Tree attention through varlen causal attention over node segments (module docstring); ``keep`` and the rest:
    whether the gathered key/value rows are kept for the backward (:func:`keeps_keys`)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, subtree_end, float(scale), keep, int(layer),
                                                           int(layers), int(reserve_per_token))[0]


# --------------------------------------------------------------------------- a sliding window along each path
_WINDOW_PLANS: dict = {}  # window -> LastBatch: a model's causal and sliding layers alternate; each keeps its plan


def _window_plan(subtree_end: Tensor, position_ids: Tensor, window: int) -> SegmentPlan | None:
    last = _WINDOW_PLANS.setdefault(window, LastBatch())
    return last.get((subtree_end, position_ids), None, lambda: windowed_plan(subtree_end, position_ids, window))


_WINDOW_MASKS: dict = {}  # window -> LastBatch: the fallback's block mask, built once per batch, not per layer


def _flex_window(q, k, v, subtree_end, position_ids, window, scale):
    """The window block mask's attention (``tree_attention_windowed``'s own CUDA path, the dense reference off
    CUDA): the batches whose windowed segments would gather too many rows."""
    from .tree_attention import _windowed

    mask = None
    if q.is_cuda:
        from .flex_tree_attention import tree_window_block_mask

        mask = _WINDOW_MASKS.setdefault(window, LastBatch()).get(
            (subtree_end, position_ids), None,
            lambda: tree_window_block_mask(subtree_end, position_ids, window, validate=False))
    return _windowed(q, k, v, subtree_end, position_ids, window, scale, block_mask=mask)


@torch.library.custom_op("treecompile::tree_attention_varlen_windowed_fwd", mutates_args=())
def tree_attention_varlen_windowed_fwd(q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor, position_ids: Tensor,
                                       window: int, scale: float, keep: str = "none", layer: int = 0, layers: int = 1,
                                       reserve_per_token: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``tree_attention_windowed`` through the segments (:func:`windowed_plan`): (out as
    :func:`tree_attention_varlen_fwd`'s, lse ``[H, T]`` float32, unset where the batch ran the window block mask
    instead: its backward recomputes; the kept gathered rows as :func:`tree_attention_varlen_fwd`'s, none then)."""
    _check(q, k, v, subtree_end)
    _check_keep(keep)
    plan = _window_plan(subtree_end, position_ids, window)
    keep_keys = keeps_keys(keep, plan, q, k, v, layer, layers, reserve_per_token)
    if plan is None:
        with torch.no_grad():
            out = _flex_window(q, k, v, subtree_end, position_ids, window, scale)
        lse = torch.empty((q.shape[1], q.shape[2]), dtype=torch.float32, device=q.device)
        return (_heads_major(_tokens_major(out)), lse,
                *_no_keys(k[0].transpose(0, 1), v[0].transpose(0, 1)))
    return _forward(q, k, v, plan, scale, keep_keys)


@tree_attention_varlen_windowed_fwd.register_fake
def _(q, k, v, subtree_end, position_ids, window, scale, keep="none", layer=0, layers=1, reserve_per_token=0):
    T, H = q.shape[2], q.shape[1]
    return (_heads_major(q.new_empty((T, H, v.shape[-1]))),
            q.new_empty((H, T), dtype=torch.float32), *_fake_keys(k, v, keep))


@torch.library.custom_op("treecompile::tree_attention_varlen_windowed_bwd", mutates_args=())
def tree_attention_varlen_windowed_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                                       subtree_end: Tensor, position_ids: Tensor, window: int,
                                       scale: float, kept_k: Tensor, kept_v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of :func:`tree_attention_varlen_windowed_fwd`, laid out as its inputs' :func:`_heads_major`."""
    plan = _window_plan(subtree_end, position_ids, window)
    if plan is None:  # the forward ran the window block mask: recomputed here with autograd
        from .op_autograd import autograd_inside_op

        with autograd_inside_op():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            grads = torch.autograd.grad(_flex_window(qq, kk, vv, subtree_end, position_ids, window, scale),
                                        (qq, kk, vv), dout)
        return tuple(_heads_major(_tokens_major(g)) for g in grads)
    return _backward_grads(q, k, v, out, lse, dout, plan, scale, kept_k, kept_v)


@tree_attention_varlen_windowed_bwd.register_fake
def _(q, k, v, out, lse, dout, subtree_end, position_ids, window, scale, kept_k, kept_v):
    return tuple(_heads_major(x.new_empty((x.shape[2], x.shape[1], x.shape[3]))) for x in (q, k, v))


def _setup_windowed(ctx, inputs, output):
    q, k, v, subtree_end, position_ids, window, scale, *_ = inputs
    out, lse, kept_k, kept_v = output
    ctx.save_for_backward(q, k, v, out, lse, subtree_end, position_ids, kept_k, kept_v)
    ctx.window, ctx.scale = window, scale
    ctx.mark_non_differentiable(lse, kept_k, kept_v)


def _backward_windowed(ctx, dout, _dlse, _dkept_k, _dkept_v):
    q, k, v, out, lse, subtree_end, position_ids, kept_k, kept_v = ctx.saved_tensors
    dq, dk, dv = torch.ops.treecompile.tree_attention_varlen_windowed_bwd(q, k, v, out, lse, dout, subtree_end,
                                                                          position_ids, ctx.window, ctx.scale,
                                                                          kept_k, kept_v)
    return dq, dk, dv, None, None, None, None, None, None, None, None


tree_attention_varlen_windowed_fwd.register_autograd(_backward_windowed, setup_context=_setup_windowed)


def tree_attention_varlen_windowed(q: Tensor, k: Tensor, v: Tensor, subtree_end: Tensor, position_ids: Tensor,
                                   window: int, scale: float | None = None, *, keep: str = "none", layer: int = 0,
                                   layers: int = 1, reserve_per_token: int = 0) -> Tensor:
    """``tree_attention_windowed`` (a sliding window of ``window`` tokens along each path, ``position_ids`` the
    depths) through FA4's varlen kernel with its own window over the segments (:func:`windowed_plan`); ``keep`` and
    the rest as :func:`tree_attention_varlen`'s."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.treecompile.tree_attention_varlen_windowed_fwd(q, k, v, subtree_end, position_ids, int(window),
                                                                    float(scale), keep, int(layer), int(layers),
                                                                    int(reserve_per_token))[0]
