"""lower_cuda: the rewritten graph as it runs on CUDA, chosen by typed :class:`CudaOptions`.

``treecompile::tree_attention`` is a registered op so that rewritten programs save and load by
name; on CUDA it is lowered, in a *copy* of the rewritten graph, to ``flex_attention`` under one
BlockMask input (a new last placeholder ``tree_block_mask``, built once per batch from the tree by
``ops.flex_tree_attention.tree_block_mask``, O(blocks)), so that inductor compiles the attention
kernel and its backward together with the rest of the graph.  ``attention_kernel`` picks the flex
kernel: ``"fa4"`` (FlashAttention-4 through FlexAttention's FLASH backend, same BlockMask), ``"flex"``
(FlexAttention's Triton kernel), ``"auto"`` (below); it is resolved when the graph is traced, on the attention
inputs (device, dtype, head size).
``"fa4_varlen"`` lowers it instead to ``treecompile::tree_attention_varlen_fwd``
(``ops.varlen_tree_attention``): FA4's varlen causal kernel over the tree's segments (each first-child chain
attends to its gathered path prefix), no BlockMask, no mask function.  Its key gather is the tree's path
tokens, which suits wide trees of long nodes, not deep trees of short ones, so the op chooses per batch: where
the segments would gather more than ``VARLEN_GATHER_LIMIT`` x T key rows it runs FA4's block-sparse kernels
under the tree mask instead (head dims 64/128; built from ``subtree_end`` inside the op, still no BlockMask
input).  ``"auto"`` lowers each tree attention to that op where FA4 runs (installed on sm_90+, bfloat16/float16,
DFS layout) at head dim 64 or 128 (both plans: measured no slower than FA4 through flex on every tree, faster on
wide ones) or 256 (the segments alone, measured faster than flex's Triton kernel on wide and deep trees; a batch
whose segments would gather past the op's bound runs a second lowering with flex, chosen per batch by
``TreeProgram``): :func:`_auto_varlen`.  Elsewhere flex: FA4 through the FLASH backend where it runs, else the
Triton kernel with one warning.
``treecompile::tree_gated_delta_rule``
is lowered to flash-linear-attention's varlen kernel when the resolved ``gdn_kernel`` is ``"fla"``, and with
it, in a graph that runs eagerly, the layer's short convolution ``treecompile::tree_causal_conv1d`` becomes
``treecompile::tree_causal_conv1d_fla`` (fla's varlen ``causal_conv1d`` over the tree's chains,
``ops.fla_conv``; float32 and half precision inputs: fla's kernels do not take float64).  In a compiled graph
the conv becomes ``ops.tree_conv_shifts.tree_causal_conv1d_shifts`` whatever the GDN kernel (a forward of shifted
products inductor fuses with the conv's neighbours, no host work per call, the backward as Triton kernels,
``ops.tree_conv_triton``; with session 18's inductor-made backward the hybrid step on an agentic tree ran 11.5 %
faster than with fla's conv on an H100, a GPU-bound 32k synthetic one 2 % slower: benchmarks/RESULTS.md):
``conv_kernel`` (:data:`CONV_KERNELS`).
The fused head ``treecompile::linear_logprobs`` of a half-precision model becomes
``treecompile::linear_logprobs_triton`` (same arguments; Triton row kernels) when triton imports: the
reference op never chooses it.  With ``head_logits`` (:data:`HEAD_LOGITS`) "kept", or "auto" where the user set no
``logits_chunk``, the head becomes :func:`_fused_head`, which runs ``treecompile::linear_logprobs_kept`` (logits
kept for the backward: no recompute, ``ops.logprobs_kept``) on calls that differentiate the head: every row under
"kept", under "auto" the leading rows whose logits fit in the memory the device has left when the head's forward
runs (the rest chunked in the same op; :func:`head_keep`), and the chunked op on calls without gradients.
The routed experts ``treecompile::moe_experts`` become ``treecompile::moe_experts_grouped`` (same arguments;
``torch._grouped_mm``, no host sync, ``ops.moe_grouped``) on Hopper for bfloat16 experts whose dims give
16-byte strides (:func:`_moe_grouped`); other dtypes run ``_grouped_mm``'s per-group loop on CUDA, which reads
the offsets on the host, so they keep the reference op.

``treecompile::tree_attention_boundary`` (a partition of a redundancy-free plan,
``expose_boundary``) is lowered the same way.  Under ``"fa4_varlen"``, and ``"auto"`` where the whole-tree
attention takes the varlen op, it becomes ``treecompile::tree_attention_boundary_varlen_fwd``
(``ops.varlen_boundary_attention``: the partition's segments, each with the boundary rows its queries see in front
of its path prefix, through FA4's varlen kernel; no BlockMask).  A partition whose segments would gather more than
``VARLEN_GATHER_LIMIT`` x (T + boundary rows) key rows runs a second lowering with flex, chosen per batch by
``TreeProgram`` (:func:`~treecompile.ops.varlen_boundary_attention.boundary_segments_fit`).  Elsewhere (and in
that lowering) FlexAttention over ``[boundary ; local]`` keys under one BlockMask of the partition
(``ops.flex_tree_attention_boundary``) with flex's Triton kernel (FA4 through flex is exact there but measured
slower: :func:`_boundary_kernel`; only ``attention_kernel="fa4"`` asks).

``treecompile::tree_attention_windowed`` (a sliding window of W tokens along each path) is lowered to
FlexAttention under a window BlockMask of its own (``ops.flex_tree_attention.tree_window_block_mask``: the tree's
tiles less those past the window), one placeholder ``tree_window_block_mask_<W>`` per distinct window after the
others, built per batch from ``subtree_end`` and the depths ``position_ids`` (:func:`attention_inputs`), so that
inductor compiles the kernel and flex's own backward with the graph (the op alone recomputes its forward in its
backward).  Its kernel: FA4 through the FLASH backend where it runs, else flex's Triton kernel with
:func:`~treecompile.ops.flex_tree_attention.window_kernel_options_for`.  Under ``"fa4_varlen"``, and ``"auto"`` where
it takes the varlen op, it becomes ``treecompile::tree_attention_varlen_windowed_fwd`` instead: FA4's varlen kernel
with its own window over the segments, each gathering at most ``W - 1`` rows of its path prefix
(``ops.varlen_tree_attention.windowed_plan``; a batch whose segments would still gather more than
``VARLEN_GATHER_LIMIT`` x T rows runs the window block mask inside the op).  In DFS order whatever
``attention_layout`` says (the window is the batch's).

The lowering also decides how the copy runs (:class:`CudaLowering`): under ``torch.compile`` with
static shapes and sequence lengths padded to buckets (``program.bucket_length``: at most one compile
per bucket), or eagerly.  A *boundary* program is bucketed like any other:
``TreeProgram`` pads its batch to the bucket, moves the ``pred_index``/``conv_index`` entries that read
boundary rows (``T + r``) past the padding, pads ``boundary_visible`` with 0 (padding tokens see no
boundary) and the boundary K/V to a bucket of their own with zero rows nobody sees.  Under the flex lowering it
compiles once per (T bucket, B bucket, fed hidden rows); with no block mask (every boundary attention varlen) it
compiles with dynamo's automatic dynamic shapes (``CudaLowering.dynamic``), about three compiles in all.
``attention_layout`` applies to whole-tree programs; a boundary program attends in DFS order.

Unlike the passes of ``pipeline.py`` it runs at the first CUDA call, not at compile time, and
returns a new graph module: the rewritten graph (the one ``treecompile.save`` writes) is untouched.
"""

from __future__ import annotations

import functools
import math
import operator
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch import fx
from torch.nn.attention.flex_attention import flex_attention

import treecompile.ops.tree_attention  # noqa: F401  (registers the ops lowered here)
import treecompile.ops.tree_attention_boundary  # noqa: F401
import treecompile.ops.logprobs  # noqa: F401
import treecompile.ops.logprobs_kept  # noqa: F401  (and logprobs_triton: the CUDA heads)
import treecompile.ops.tree_gdn  # noqa: F401
import treecompile.ops.tree_conv  # noqa: F401
import treecompile.ops.fla_conv  # noqa: F401
import treecompile.ops.moe  # noqa: F401
import treecompile.ops.moe_grouped  # noqa: F401
import treecompile.ops.materialize  # noqa: F401
from treecompile.ops.fa4_tree_attention import (FA4_HEAD_DIMS, FA4_KERNEL_OPTIONS, fa4_input_reason,
                                                fa4_unusable_reason, tree_attention_fa4)
from treecompile.ops.flex_tree_attention import (kernel_options_for, tree_attention_flex, tree_block_mask,
                                                 tree_window_block_mask, window_kernel_options_for)
from treecompile.ops import varlen_tree_attention
from treecompile.ops.logprobs_kept import logits_bytes
from treecompile.ops.varlen_boundary_attention import tree_attention_boundary_varlen
from treecompile.ops.varlen_tree_attention import tree_attention_varlen, tree_attention_varlen_windowed
from treecompile.ops.tree_conv_shifts import tree_causal_conv1d_shifts, tree_causal_conv1d_shifts_inductor
from treecompile.ops.flex_tree_attention_boundary import boundary_block_mask, tree_attention_boundary_flex
from treecompile.ops.tree_layout import heavy_first_order, permuted_subtree_end, reordered_attention
from treecompile.passes.token_axis import same

__all__ = ["CudaOptions", "CudaLowering", "lower_cuda", "attention_inputs", "resolve_gdn_kernel",
           "resolve_attention_kernel", "moe_grouped_unusable_reason", "GDN_KERNELS", "ATTENTION_KERNELS",
           "ATTENTION_LAYOUTS", "AUTO_SEGMENTS_HEAD_DIMS", "HEAD_LOGITS", "head_keep", "head_keeps",
           "warn_once", "prepare_plans", "VarlenPlanInput", "GdnPlanInput",
           "ConvPlanInput"]

TREE_ATTENTION = torch.ops.treecompile.tree_attention.default
TREE_ATTENTION_WINDOWED = torch.ops.treecompile.tree_attention_windowed.default
TREE_ATTENTION_BOUNDARY = torch.ops.treecompile.tree_attention_boundary.default
TREE_GDN = torch.ops.treecompile.tree_gated_delta_rule.default
TREE_CONV = torch.ops.treecompile.tree_causal_conv1d.default
TREE_CONV_FLA = torch.ops.treecompile.tree_causal_conv1d_fla.default
FLA_CONV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LINEAR_LOGPROBS = torch.ops.treecompile.linear_logprobs.default
HALF = (torch.bfloat16, torch.float16)
MOE_EXPERTS = torch.ops.treecompile.moe_experts.default
MOE_EXPERTS_GROUPED = torch.ops.treecompile.moe_experts_grouped.default
# torch._grouped_mm's CUTLASS kernel (sm90/sm100) takes bfloat16 only; float32/float16 go through a per-group
# loop that copies the offsets to the host (aten GroupedBlas.cpp, _grouped_mm_cuda)
MOE_GROUPED_DTYPES = (torch.bfloat16,)

# Gated DeltaNet kernel on CUDA: "fla" (flash-linear-attention, varlen calls planned by ops.fla_gdn.plan_calls),
# "reference" (the registered op's torch implementation), "auto" (fla if installed, else reference
# with a warning).  On CPU the reference always runs.
GDN_KERNELS = ("auto", "fla", "reference")
# Tree attention kernel on CUDA: "fa4" (FlashAttention-4 through FlexAttention's FLASH backend),
# "flex" (FlexAttention's Triton kernel), "auto" (fa4_varlen, else fa4 where it can run, else flex with one warning),
# "fa4_varlen" (FA4's varlen kernel over the tree's segments, or its block-sparse kernels for batches whose
# segments would gather too much, chosen per batch; ops/varlen_tree_attention.py; what "auto" takes where FA4
# runs: _auto_varlen).
ATTENTION_KERNELS = ("auto", "fa4", "flex", "fa4_varlen")
# Token order the tree attention kernel runs in: "dfs" (the batch's own order) or "heavy_first" (the same
# tree with children visited largest subtree first, ops/tree_layout.py: q/k/v gathered in, the output
# gathered back; far fewer partial tiles on deep agentic trees).
ATTENTION_LAYOUTS = ("dfs", "heavy_first")
# The tree's short convolution on CUDA: "shifts" (ops.tree_conv_shifts: a forward of shifted products inductor
# fuses, the backward as Triton kernels, ops.tree_conv_triton), "shifts_inductor" (the same forward, the backward
# as shifted products inductor fuses, the few non-shift entries through one index_add: session 18's), "fla"
# (fla's varlen conv over the tree's chains, ops.fla_conv; float32/half inputs, else the reference), "reference"
# (the registered op), "auto" ("shifts" in a compiled graph; in an eager one "fla" where the GDN kernel is fla,
# else the reference).
CONV_KERNELS = ("auto", "shifts", "shifts_inductor", "fla", "reference")
# What the fused head keeps for its backward on CUDA: "chunked" (one [chunk, V] block of logits at a time, forward
# and backward: the backward recomputes them), "kept" (ops.logprobs_kept: the [N, V] logits in the model's dtype
# from the forward to the head's backward, overwritten there by their gradient; one head GEMM per token less and
# dW over all rows in one GEMM), "auto" (where the user set no logits_chunk, in a whole-tree program: the leading
# rows whose logits fit in what the device has left when the head's forward runs, ops.logprobs_kept's keep="fit",
# the others chunked; else "chunked").  A call without gradients runs "chunked" whatever this says.
HEAD_LOGITS = ("auto", "kept", "chunked")
# What the varlen tree attention keeps for its backward on CUDA: "gathered" (nothing more: the backward gathers each
# segment's path prefix of K/V again), "kept" (the forward's gathered K/V rows, G x Hkv x (Dk + Dv) elements per
# layer, until the layer's backward), "auto" (kept where the device's memory covers the rest of the forward with them
# and the head's logits: ops.varlen_tree_attention.keeps_keys, decided once per forward at run time; the windowed
# op gathers again under "auto": its gather is at most T + segments x (W - 1) rows).  A call without gradients keeps
# nothing whatever this says.
ATTENTION_KEYS = ("auto", "kept", "gathered")


@dataclass(frozen=True)
class CudaOptions:
    """How a TreeModel runs on CUDA (ignored on CPU, where the rewritten graph runs eagerly).

    compile_cuda: run the lowered graph under ``torch.compile`` (else eagerly, flex compiled alone).
    bucket: pad sequence lengths to ``bucket_length`` buckets (bounded recompiles).
    gdn_kernel: one of ``GDN_KERNELS``.
    attention_kernel: one of ``ATTENTION_KERNELS``.
    conv_kernel: one of ``CONV_KERNELS``.
    head_logits: one of ``HEAD_LOGITS``.
    attention_keys: one of ``ATTENTION_KEYS``.
    attention_layout: one of ``ATTENTION_LAYOUTS``: ``"heavy_first"`` runs every tree attention in the
        heaviest-child-first DFS order of the batch (exact; one more ``[2, T]`` graph input); boundary
        programs (redundancy-free partitions) attend in DFS order whatever it says.
    recompile_limit: dynamo's ``recompile_limit`` while a compiled graph runs (one compile per length
        bucket needs room for many), applied with ``torch._dynamo.config.patch`` around each call
        only: the global setting is left as it is.  Never lowers a higher global limit.
    """

    compile_cuda: bool = True
    bucket: bool = True
    gdn_kernel: str = "auto"
    recompile_limit: int = 64
    attention_kernel: str = "auto"
    attention_layout: str = "dfs"
    conv_kernel: str = "auto"
    head_logits: str = "auto"
    attention_keys: str = "auto"

    def __post_init__(self):
        if self.head_logits not in HEAD_LOGITS:
            raise ValueError(f"head_logits: expected one of {HEAD_LOGITS}, got {self.head_logits!r}")
        if self.attention_keys not in ATTENTION_KEYS:
            raise ValueError(f"attention_keys: expected one of {ATTENTION_KEYS}, got {self.attention_keys!r}")
        if self.gdn_kernel not in GDN_KERNELS:
            raise ValueError(f"gdn_kernel: expected one of {GDN_KERNELS}, got {self.gdn_kernel!r}")
        if self.conv_kernel not in CONV_KERNELS:
            raise ValueError(f"conv_kernel: expected one of {CONV_KERNELS}, got {self.conv_kernel!r}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel: expected one of {ATTENTION_KERNELS}, got {self.attention_kernel!r}")
        if self.attention_layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"attention_layout: expected one of {ATTENTION_LAYOUTS}, got {self.attention_layout!r}")
        if self.attention_kernel == "fa4_varlen" and self.attention_layout != "dfs":
            raise ValueError(f"attention_layout={self.attention_layout!r} with attention_kernel='fa4_varlen': the "
                             "varlen kernel has no tiles across node boundaries to reorder (use "
                             "attention_layout='dfs')")


@dataclass
class CudaLowering:
    """What :func:`lower_cuda` made: the graph to run and how to run it."""

    graph_module: fx.GraphModule  # the rewritten graph's placeholders, then ``tree_block_mask`` (and
    #   ``tree_attention_order`` when ``layout`` is not "dfs")
    attention: int  # tree_attention(_boundary) calls lowered to flex (0: feed None for the block mask and the order)
    layout: str  # "heavy_first" feeds the order and the block mask of that order ("dfs" for a boundary program)
    boundary: bool  # a boundary program: the block mask is ops.flex_tree_attention_boundary's
    gdn_fla: int  # tree GDN calls lowered to fla
    triton_head: int  # fused heads lowered to linear_logprobs_triton (when they run chunked)
    compiled: bool  # run under torch.compile: dynamic=False, or dynamo's automatic dynamic shapes (``dynamic``)
    bucket: bool  # pad the batch to bucket_length(T) and cut the outputs back to T
    conv_fla: int = 0  # tree causal convs lowered to fla's varlen conv
    conv_shifts: int = 0  # tree causal convs lowered to shifted products (ops.tree_conv_shifts)
    moe_grouped: int = 0  # routed experts lowered to moe_experts_grouped (grouped GEMMs)
    materialized: int = 0  # position-only values computed once (``treecompile::materialize``; compiled only)
    attention_varlen: int = 0  # tree_attention calls lowered to tree_attention_varlen_fwd (no block mask)
    # of those, calls "auto" lowered at a head dim with the segments alone: a batch whose segments would gather
    # past the op's bound (varlen_tree_attention.segments_fit) runs a graph lowered with varlen=False instead
    attention_segments_only: int = 0
    # which rows the fused heads keep logits of for the backward ("all", "fit": ops.logprobs_kept's keep), None:
    # no head keeps any (options.head_logits, head_keep, _fused_head)
    head_keep: str | None = None
    # the distinct windows of the tree_attention_windowed calls lowered to flex, in the order of their block mask
    # placeholders (``tree_window_block_mask_<W>``, after the others)
    windows: tuple[int, ...] = ()
    # tree_attention_windowed calls lowered to tree_attention_varlen_windowed_fwd (FA4's window over the segments;
    # no block mask: a batch its segments do not suit runs the window block mask inside the op)
    windowed_varlen: int = 0
    # tree_attention_boundary calls lowered to tree_attention_boundary_varlen_fwd (FA4's varlen kernel over the
    # partition's segments, ops/varlen_boundary_attention.py; no block mask: a batch whose segments would gather past
    # ops.varlen_boundary_attention.boundary_segments_fit runs the flex lowering, TreeProgram)
    boundary_varlen: int = 0
    # what the varlen ops keep of their gathered K/V for the backward (ops.varlen_tree_attention.KEEP: "none", "all",
    # "fit"; the windowed ops' under "auto" is "none") and, under "fit", the head's kept logits per token (bytes)
    # that the decision leaves room for
    attention_keep: str = "none"
    keys_reserve_per_token: int = 0
    # the per-batch host plans of the graph's ops, one per distinct input (:func:`prepare_plans`: built ahead of a
    # step): VarlenPlanInput, GdnPlanInput, ConvPlanInput
    plans: tuple = ()

    @property
    def dynamic(self) -> bool:
        """Compiled with dynamo's automatic dynamic shapes (``torch.compile(dynamic=None)``: the first shape static,
        the sizes that change on a recompile symbolic from then on) instead of one static graph per shape: a compiled
        boundary program with no block mask (no flex kernel; its ops take symbolic sizes).  Qwen3-0.6B's 11
        partitions of a 16k tree at C = T/4 compile 3 times (the roots' B = 0 static, then T and B symbolic, then
        once more for a range guard inductor adds), where static shapes compiled 9 programs, one per (T bucket, B
        bucket), at 60-70 s each (H200, sessions 55-56)."""
        return self.compiled and self.boundary and self.attention == 0 and not self.windows


@dataclass(frozen=True)
class VarlenPlanInput:
    """What one varlen attention op of a lowered graph plans from: the batch placeholders it reads, its window
    (None: the unwindowed op) and its query's recorded dtype and head dim (the plan's kind depends on them)."""

    subtree_end: str
    position_ids: str | None
    window: int | None
    dtype: torch.dtype
    head_dim: int

    @property
    def names(self) -> tuple[str, ...]:
        return (self.subtree_end,) if self.position_ids is None else (self.subtree_end, self.position_ids)

    def prepare(self, inputs: Mapping[str, torch.Tensor]) -> None:
        se = inputs[self.subtree_end]
        q = torch.empty((1, 1, 0, self.head_dim), dtype=self.dtype, device=se.device)  # the plan reads these only
        varlen_tree_attention.prepare(se, q, None if self.position_ids is None else inputs[self.position_ids],
                                      self.window)


@dataclass(frozen=True)
class GdnPlanInput:
    """What one fla GDN call (:func:`_gdn_fla`) plans from: the batch's node placeholders, the layer's value heads
    and head dims, and the call's plan options."""

    node_start: str
    node_end: str
    node_parent: str
    value_heads: int
    key_dim: int
    value_dim: int
    replay_max: int | None
    levels: bool | None
    chunk_size: int

    @property
    def names(self) -> tuple[str, ...]:
        return self.node_start, self.node_end, self.node_parent

    def prepare(self, inputs: Mapping[str, torch.Tensor]) -> None:
        from treecompile.ops import fla_gdn

        fla_gdn.prepare(*(inputs[n] for n in self.names), value_heads=self.value_heads, key_dim=self.key_dim,
                        value_dim=self.value_dim, replay_max=self.replay_max, levels=self.levels,
                        chunk_size=self.chunk_size)


@dataclass(frozen=True)
class ConvPlanInput:
    """What one fla varlen conv (``treecompile::tree_causal_conv1d_fla``) plans from: the batch's ``conv_index``
    placeholder and the rows that share it."""

    conv_index: str
    batch: int

    @property
    def names(self) -> tuple[str, ...]:
        return (self.conv_index,)

    def prepare(self, inputs: Mapping[str, torch.Tensor]) -> None:
        from treecompile.ops import fla_conv

        fla_conv.prepare(inputs[self.conv_index], self.batch)


def _placeholders(*nodes) -> bool:
    return all(isinstance(a, fx.Node) and a.op == "placeholder" for a in nodes)


def _val(node):
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _varlen_plan(q, subtree_end, positions=None, window=None) -> VarlenPlanInput | None:
    """The :class:`VarlenPlanInput` of a varlen op reading these nodes, or None when its plan cannot be built ahead
    (its tree tensors are computed in the graph, not the batch's own, or its query has no recorded value): the
    op then builds it in the step, as without :func:`prepare_plans`."""
    val = _val(q)
    if val is None or not _placeholders(subtree_end, *(() if window is None else (positions,))):
        return None
    return VarlenPlanInput(subtree_end.name, None if window is None else positions.name, window, val.dtype,
                           val.shape[-1])


def _gdn_plan(args, kwargs) -> GdnPlanInput | None:
    """The :class:`GdnPlanInput` of a ``tree_gated_delta_rule`` node's arguments lowered to fla (``kwargs`` with
    the lowering's own), or None as :func:`_varlen_plan`."""
    q, v, nodes = _val(args[0]), _val(args[2]), args[5:8]
    if q is None or v is None or not _placeholders(*nodes) or kwargs.get("kernel") is not None:
        return None
    return GdnPlanInput(*(n.name for n in nodes), value_heads=v.shape[2], key_dim=q.shape[3], value_dim=v.shape[3],
                        replay_max=kwargs.get("replay_max"), levels=kwargs.get("levels"),
                        chunk_size=kwargs.get("chunk_size", 64))


def _conv_plan(args) -> ConvPlanInput | None:
    """The :class:`ConvPlanInput` of a ``tree_causal_conv1d`` node's arguments lowered to fla, or None as
    :func:`_varlen_plan`."""
    x, conv_index = _val(args[0]), args[3]
    if x is None or not _placeholders(conv_index):
        return None
    return ConvPlanInput(conv_index.name, x.shape[0])


def prepare_plans(lowering: CudaLowering, inputs: Mapping[str, torch.Tensor]) -> None:
    """Build now, and keep, the host plans the lowered graph's ops will make for one batch (``inputs``: the graph's
    batch placeholders by name, with the tensors the graph will get): their calls in the step then find them
    (each op module's ``prepare``).  A listed plan whose placeholders are not among ``inputs`` is left to its op."""
    for p in lowering.plans:
        if all(n in inputs for n in p.names):
            p.prepare(inputs)


@torch._dynamo.disable  # a host-side level schedule and fla's autograd Functions: kept out of dynamo
def _gdn_fla(*args, **kwargs):
    from treecompile.ops.fla_gdn import tree_gated_delta_rule_fla

    return tree_gated_delta_rule_fla(*args, **kwargs)


def resolve_gdn_kernel(requested: str) -> str:
    """``"auto"`` -> ``"fla"`` when flash-linear-attention imports, else ``"reference"`` (with a warning)."""
    from treecompile.ops.fla_gdn import fla_unusable_reason

    if requested == "reference":
        return requested
    reason = fla_unusable_reason()
    if reason is None:
        return "fla"
    if requested == "fla":
        raise RuntimeError(f"gdn_kernel='fla': {reason}")
    warnings.warn(f"{reason}; Gated DeltaNet layers run the slow reference implementation on CUDA",
                  stacklevel=3)
    return "reference"


def resolve_conv_kernel(requested: str, gdn_kernel: str, compiled: bool) -> str:
    """``"shifts"``, ``"shifts_inductor"``, ``"fla"`` or ``"reference"`` for the tree conv (:data:`CONV_KERNELS`;
    ``gdn_kernel`` resolved).  ``"fla"`` asked for where flash-linear-attention does not import raises naming the
    reason."""
    if requested == "auto":
        return "shifts" if compiled else ("fla" if gdn_kernel == "fla" else "reference")
    if requested == "fla":
        from treecompile.ops.fla_gdn import fla_unusable_reason

        if (reason := fla_unusable_reason()) is not None:
            raise RuntimeError(f"conv_kernel='fla': {reason}")
    return requested


_WARNED: set = set()  # warnings already given (once per process)


def warn_once(message: str, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` the first time this process sees ``message``."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=stacklevel)


_PROBE = object()  # resolve_attention_kernel: probe the installation and device now


def resolve_attention_kernel(requested: str, q, setup_reason=_PROBE) -> str:
    """``"fa4"`` or ``"flex"`` for attention inputs ``q`` (real or fake ``[B, H, T, D]``).

    ``setup_reason``: what ``fa4_unusable_reason()`` said about the installation and device when the
    graph was lowered (None: usable); then only the inputs are checked here, as plain Python that
    dynamo traces without imports or device queries.  By default both are probed now.
    ``"fa4"`` that cannot run raises RuntimeError naming the reason; ``"auto"`` falls back to flex
    and warns once per reason."""
    if requested == "flex":
        return "flex"
    if requested not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel: expected one of {ATTENTION_KERNELS}, got {requested!r}")
    if requested == "fa4_varlen":
        raise ValueError("attention_kernel='fa4_varlen' is not a FlexAttention kernel (lower_cuda lowers its "
                         "attention to ops.varlen_tree_attention)")
    if setup_reason is _PROBE:
        reason = fa4_unusable_reason(q)
    else:
        reason = setup_reason or fa4_input_reason(q)
    if reason is None:
        return "fa4"
    if requested == "fa4":
        raise RuntimeError(f"attention_kernel='fa4': {reason}")
    warn_once(f"attention_kernel='auto': {reason}; tree attention runs FlexAttention's Triton kernel")
    return "flex"


def _flex(q, k, v, block_mask, scale, kernel="flex", setup_reason=None, order=None):
    """Inside a graph that runs under torch.compile: inductor compiles flex with the rest (the kernel
    is resolved at trace time from the fake inputs' device, dtype and head size, and the installation
    and device probe made at lowering time).  ``order``: ``[2, T]`` of ``ops.tree_layout`` (the block mask
    is then that order's), or None to attend in the batch's order."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    fa4 = resolve_attention_kernel(kernel, q, setup_reason) == "fa4"
    attend = functools.partial(flex_attention, block_mask=block_mask, scale=scale,
                               enable_gqa=q.shape[1] != k.shape[1],
                               kernel_options=dict(FA4_KERNEL_OPTIONS) if fa4 else kernel_options_for(q))
    return attend(q, k, v) if order is None else reordered_attention(attend, q, k, v, order)


def _flex_eager(q, k, v, block_mask, scale, kernel="flex", setup_reason=None, order=None):
    """In a graph that runs eagerly: the separately compiled kernel (never the T^2 eager flex)."""
    fn = tree_attention_fa4 if resolve_attention_kernel(kernel, q, setup_reason) == "fa4" else tree_attention_flex
    attend = functools.partial(fn, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return attend(q, k, v) if order is None else reordered_attention(attend, q, k, v, order)


def _window_kernel(kernel: str) -> str:
    """The flex kernel of windowed tree attention under ``attention_kernel=kernel`` where the varlen op does not
    take it ("auto" where FA4 cannot run, or the flex graph of ``varlen=False``): FA4 through flex where it runs,
    else flex's Triton kernel."""
    return "auto" if kernel == "fa4_varlen" else kernel


def _flex_windowed(q, k, v, block_mask, scale, kernel="flex", setup_reason=None):
    """``tree_attention_windowed`` inside a compiled graph (as :func:`_flex`), under its window's block mask."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    fa4 = resolve_attention_kernel(kernel, q, setup_reason) == "fa4"
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          kernel_options=dict(FA4_KERNEL_OPTIONS) if fa4 else window_kernel_options_for(q))


def _flex_windowed_eager(q, k, v, block_mask, scale, kernel="flex", setup_reason=None):
    """``tree_attention_windowed`` in a graph that runs eagerly: the separately compiled kernel."""
    fa4 = resolve_attention_kernel(kernel, q, setup_reason) == "fa4"
    fn = tree_attention_fa4 if fa4 else functools.partial(tree_attention_flex,
                                                          kernel_options=window_kernel_options_for(q))
    return fn(q, k, v, block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def varlen_input_reason(q) -> str | None:
    """Why FA4's varlen kernel cannot take attention inputs ``q`` (None when it can)."""
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return f"FA4's varlen kernel takes bfloat16/float16 CUDA inputs, got {q.dtype} on {q.device.type}"
    return None


def _varlen(q, k, v, subtree_end, scale, setup_reason=None, kernel="fa4_varlen", keep="none", layer=0, layers=1,
            reserve_per_token=0):
    """``attention_kernel="fa4_varlen"`` (or ``"auto"``, :func:`_auto_varlen`):
    ``treecompile::tree_attention_varlen_fwd`` (an opaque op in the compiled graph, with its own backward op).
    Checked when the graph is traced: FA4 installed on sm_90+ (the lowering's probe) and half-precision CUDA
    inputs, else RuntimeError naming the reason.  ``keep`` (the gathered K/V kept for the backward) applies to calls
    that differentiate the attention (grad mode, decided when traced: dynamo guards on it); the call is the
    ``layer``-th of the graph's ``layers`` under "fit" (``ops.varlen_tree_attention.keeps_keys``)."""
    _check_varlen(q, setup_reason, kernel)
    return tree_attention_varlen(q, k, v, subtree_end, scale, keep=_keep_if_grad(keep, q, k, v), layer=layer,
                                 layers=layers, reserve_per_token=reserve_per_token)


def _keep_if_grad(keep: str, *xs) -> str:
    """``keep``, or "none" for a call that computes no gradient (nothing would read the kept rows)."""
    return keep if _differentiates(*xs) else "none"


def _check_varlen(q, setup_reason, kernel: str) -> None:
    reason = setup_reason or varlen_input_reason(q)
    if reason is not None:
        raise RuntimeError(f"attention_kernel={kernel!r}: {reason}")


def _varlen_windowed(q, k, v, subtree_end, position_ids, window, scale, setup_reason=None, kernel="fa4_varlen",
                     keep="none"):
    """``tree_attention_windowed`` under ``attention_kernel="fa4_varlen"`` or ``"auto"``:
    ``treecompile::tree_attention_varlen_windowed_fwd`` (FA4's varlen kernel with its own window over the
    segments, each gathering at most ``window - 1`` rows of its path prefix; a batch whose segments would gather
    too many rows runs the window block mask inside the op).  Checked and ``keep`` as :func:`_varlen`."""
    _check_varlen(q, setup_reason, kernel)
    return tree_attention_varlen_windowed(q, k, v, subtree_end, position_ids, window, scale,
                                          keep=_keep_if_grad(keep, q, k, v))


# head dims "auto" runs through the varlen op's segments alone (FA4's block-sparse tiles do not take them): measured
# faster than flex's Triton kernel on every tree tried (H100, 8 heads / 2 kv heads / D=256, fwd+bwd ms: 16 x 2,048
# POR 0.5 2.96 vs 10.24; 32 x 2,048 POR 0.75 4.06 vs 10.22; agentic deep-16k, 19.5x T gathered, 13.6 vs 17.6;
# benchmarks/results/h100_s16/attn256).  A batch whose segments would gather past the op's bound runs the flex
# graph instead (TreeProgram, per batch).
AUTO_SEGMENTS_HEAD_DIMS = (256,)


def _auto_varlen(q: fx.Node, layout: str, setup_reason) -> str | None:
    """How ``attention_kernel="auto"`` lowers the tree attention with query ``q``: ``"both"`` (the varlen op with
    both its plans: the query's recorded dtype is bf16/fp16 and its head dim in ``FA4_HEAD_DIMS``), ``"segments"``
    (the op's segments only: head dim in :data:`AUTO_SEGMENTS_HEAD_DIMS`), or None (flex), given FA4 usable here
    (``setup_reason`` None) and the DFS layout (the op has no reordered form).  The op was the faster or equal
    choice on every tree measured (H100, session 15: Qwen3-0.6B 32k step 0.407 vs 0.445 s, 1.7B 0.777 vs
    0.811 s, agentic deep-agent 0.336 vs 0.337 s).  The device is not read from the record (a program captured
    on the CPU runs here on CUDA); the traced call checks the real inputs."""
    val = _val(q)
    if setup_reason is not None or layout != "dfs" or val is None or val.dtype not in HALF:
        return None
    D = val.shape[-1]
    return "both" if D in FA4_HEAD_DIMS else "segments" if D in AUTO_SEGMENTS_HEAD_DIMS else None


def _boundary_kernel(kernel: str) -> str:
    """The flex kernel of boundary attention where the varlen op does not take it ("auto" where FA4's varlen kernel
    cannot run, and the flex graph of ``varlen=False`` for "auto" and "fa4_varlen"): flex's Triton kernel.  FA4
    (flex's FLASH backend) over ``[boundary ; zeros ; local]`` keys is exact (its GPU test passes; redundancy-free
    steps with it match the whole tree, H100 session 7) but slower there: eager RF steps of Qwen3-0.6B at C = T/2
    took 1.63 s with FA4 vs 0.97 s with flex's Triton kernel (benchmarks/RESULTS.md, session 7), so only an
    explicit ``attention_kernel="fa4"`` asks for it."""
    return "flex" if kernel in ("auto", "fa4_varlen") else kernel


def _varlen_boundary(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible, scale, setup_reason=None,
                     kernel="fa4_varlen"):
    """``tree_attention_boundary`` under ``attention_kernel="fa4_varlen"``, or ``"auto"`` where FA4's varlen kernel
    runs (:func:`_auto_varlen`): ``treecompile::tree_attention_boundary_varlen_fwd`` (the partition's segments with
    the boundary rows in front of their keys; an opaque op with its own backward op).  Checked as :func:`_varlen`."""
    _check_varlen(q, setup_reason, kernel)
    return tree_attention_boundary_varlen(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible, scale)


def _flex_boundary(q, k, v, boundary_k, boundary_v, block_mask, scale, kernel="flex", setup_reason=None):
    """``tree_attention_boundary`` inside a compiled graph (as :func:`_flex`): the ``[boundary ; local]``
    concatenation and the kernel are compiled with the rest."""
    fa4 = resolve_attention_kernel(kernel, q, setup_reason) == "fa4"
    return tree_attention_boundary_flex(q, k, v, boundary_k, boundary_v, block_mask, scale=scale,
                                        enable_gqa=q.shape[1] != k.shape[1], flex=flex_attention,
                                        kernel_options=dict(FA4_KERNEL_OPTIONS) if fa4 else kernel_options_for(q))


def _flex_boundary_eager(q, k, v, boundary_k, boundary_v, block_mask, scale, kernel="flex", setup_reason=None):
    """``tree_attention_boundary`` in a graph that runs eagerly: the separately compiled kernel."""
    fa4 = resolve_attention_kernel(kernel, q, setup_reason) == "fa4"
    return tree_attention_boundary_flex(q, k, v, boundary_k, boundary_v, block_mask, scale=scale,
                                        enable_gqa=q.shape[1] != k.shape[1],
                                        kernel_options=dict(FA4_KERNEL_OPTIONS) if fa4 else None)


def _triton_head(n: fx.Node) -> bool:
    """Whether the fused head ``n`` runs the Triton row kernels: half-precision hidden states, the weight and bias
    of the same dtype, and triton importable (else the reference op's torch ops, which promote mixed dtypes)."""
    from treecompile.ops import logprobs_triton

    h, W, b = (a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args[:3])
    return h.dtype in HALF and _one_dtype(h, W, b) and logprobs_triton.available()


def head_keeps(h, W, b) -> bool:
    """Whether :func:`_fused_head` keeps logits of this call: it differentiates the head (grad mode on, an input
    requires grad) and ``h``, ``W`` and ``b`` share one dtype (``linear_logprobs_kept``'s buffers are of it)."""
    return _differentiates(h, W, b) and _one_dtype(h, W, b)


def _differentiates(*xs) -> bool:
    """Whether a call on ``xs`` (None entries skipped) records gradients: grad mode on and an input requiring grad
    (decided when traced: dynamo guards on grad mode)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def _one_dtype(h, W, b) -> bool:
    return W.dtype == h.dtype and (b is None or b.dtype == h.dtype)


def _fused_head(h, W, b, targets, chunk, entropy=False, *, triton: bool, keep: str):
    """The fused head ``treecompile::linear_logprobs`` on CUDA: ``linear_logprobs_kept`` with ``keep`` ("all"
    rows, or those that "fit" in the device's memory when it runs) when this call differentiates the head, else
    chunked: ``linear_logprobs_triton`` (``triton``) or the reference op.  Decided per call from grad mode (under
    ``torch.compile`` at trace time; dynamo guards on it) and, under "fit", inside the op at run time."""
    if head_keeps(h, W, b):
        lp, lse, ent, _logits = torch.ops.treecompile.linear_logprobs_kept(h, W, b, targets, entropy, keep)
        return lp, lse, ent
    chunked = torch.ops.treecompile.linear_logprobs_triton if triton else torch.ops.treecompile.linear_logprobs
    return chunked(h, W, b, targets, chunk, entropy)


def head_keep(head_logits: str, chunk: int, *, boundary: bool = False) -> str | None:
    """Which rows a fused head keeps logits of under ``head_logits`` (:data:`HEAD_LOGITS`) with its graph's
    ``chunk`` (0: the user set no ``logits_chunk``): ``"all"`` ("kept"), ``"fit"`` ("auto" without a user chunk,
    in a whole-tree program: ``ops.logprobs_kept.fit_rows`` at run time) or None (chunked).  "auto" keeps nothing
    in a ``boundary`` program: a redundancy-free partition's graph stays alive while the partitions below it run,
    so kept logits would add up along each chain of partitions, memory the plan's budget does not count and the
    headroom seen by one partition's head does not know of."""
    if head_logits == "kept":
        return "all"
    if head_logits == "chunked" or chunk != 0 or boundary:
        return None
    return "fit"


def moe_grouped_unusable_reason() -> str | None:
    """Why ``moe_experts_grouped`` is not used on this device (None: it is): torch without
    ``_grouped_mm`` or a GPU other than compute capability 9.x.  Blackwell's kernel was reported to leave
    the weight gradient of an expert without tokens unwritten (pytorch#172439; the op zeroes it there,
    at the cost of a pass over the weight gradients) and has not been measured here."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        return f"compute capability {cap[0]}.{cap[1]} (the grouped experts run on 9.x)"
    return None


def _moe_grouped(n: fx.Node) -> bool:
    """Whether the routed experts ``n`` (``moe_experts(hidden, top_k_index, top_k_weights, gate_up_proj,
    down_proj)``) run ``moe_experts_grouped``: hidden and both expert weights of a ``MOE_GROUPED_DTYPES``
    dtype, ``D`` and ``I`` multiples of 8 (16-byte strides in bfloat16), fewer than 1024 experts (the CUDA
    kernel's group limit)."""
    hidden, _, _, gate_up, down = (a.meta["val"] for a in n.args[:5])
    E, D, I = down.shape
    return (all(t.dtype in MOE_GROUPED_DTYPES and t.dtype == hidden.dtype for t in (hidden, gate_up, down))
            and all((d * hidden.element_size()) % 16 == 0 for d in (D, I)) and E < 1024)


def _replace(graph: fx.Graph, n: fx.Node, target, args, kwargs=None) -> fx.Node:
    with graph.inserting_before(n):
        new = graph.call_function(target, tuple(args), dict(kwargs or {}))
    new.meta = dict(n.meta)
    n.replace_all_uses_with(new)
    graph.erase_node(n)
    return new


def attention_inputs(subtree_end: torch.Tensor, lowering: CudaLowering, *, boundary_visible: torch.Tensor | None = None,
                     num_boundary: int = 0, position_ids: torch.Tensor | None = None) -> list:
    """The graph inputs after the batch's (and boundary) inputs, for one batch of ``subtree_end [T]``:
    ``[block_mask]``, or ``[block_mask, order]`` with a non-"dfs" layout (the mask then of that order);
    None for each when the graph has no tree attention.  A boundary program's block mask is
    ``boundary_block_mask(subtree_end, boundary_visible, num_boundary)`` (``num_boundary``: the rows of
    the boundary K/V fed).  Then one window block mask per ``lowering.windows`` entry, built from the batch's
    depths ``position_ids [T]`` (required then)."""
    reorder = lowering.layout != "dfs"
    windows = _window_masks(subtree_end, position_ids, lowering.windows)
    if not lowering.attention:
        return ([None, None] if reorder else [None]) + windows
    if lowering.boundary:
        return [boundary_block_mask(subtree_end, boundary_visible, num_boundary, validate=False)] + windows
    if not reorder:
        return [tree_block_mask(subtree_end, validate=False)] + windows
    order = heavy_first_order(subtree_end)
    return [tree_block_mask(permuted_subtree_end(subtree_end, order), validate=False), order] + windows


def _window_masks(subtree_end: torch.Tensor, position_ids: torch.Tensor | None, windows: tuple[int, ...]) -> list:
    if windows and position_ids is None:
        raise TypeError(f"attention_inputs: the graph has sliding-window attention (windows {list(windows)}): "
                        "pass the batch's position_ids")
    return [tree_window_block_mask(subtree_end, position_ids, w, validate=False) for w in windows]


def lower_cuda(gm: fx.GraphModule, options: CudaOptions, *, boundary: bool = False,
               constants: Collection[str] = (), varlen: bool = True) -> CudaLowering:
    """A copy of ``gm`` for CUDA (module docstring).  ``boundary``: ``gm`` is a boundary program.
    ``constants``: names of placeholders holding no trained value (buffers, lifted constants: a RoPE
    ``inv_freq``), which :func:`materialize_position_values` treats as constants.  ``varlen=False``: "auto"
    lowers every tree attention to flex (the graph for batches the varlen op's segments cannot take)."""
    compiled = options.compile_cuda
    layout = "dfs" if boundary else options.attention_layout
    gdn_kernel = resolve_gdn_kernel(options.gdn_kernel)
    # installation and device, probed here (eagerly): the traced graph only checks its inputs
    setup_reason = None if options.attention_kernel == "flex" else fa4_unusable_reason()
    moe_grouped_ok = moe_grouped_unusable_reason() is None
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_ph):
        mask = graph.placeholder("tree_block_mask")
    order = None
    if layout != "dfs":
        with graph.inserting_after(mask):
            order = graph.placeholder("tree_attention_order")
    attention = gdn_fla = triton_head = conv_fla = conv_shifts = moe_grouped = attention_varlen = segments_only = 0
    windowed = windowed_varlen = boundary_varlen = 0
    plans: list = []  # VarlenPlanInput, GdnPlanInput, ConvPlanInput (None: an op that plans in the step)
    window_masks: dict[int, fx.Node] = {}  # one block mask placeholder per distinct window, after the others
    head_kept = None
    keys_keep, windowed_keep = _attention_keep(options.attention_keys)
    reserve = _head_reserve(graph, options, boundary) if keys_keep == "fit" else 0
    fit_calls: list[fx.Node] = []  # the varlen calls that share one "fit" decision per forward, in graph order
    conv_kernel = resolve_conv_kernel(options.conv_kernel, gdn_kernel, compiled)
    if gdn_kernel == "fla":  # levelled or whole fla calls (ops/fla_gdn_levels.py): decided once, not per layer call
        from treecompile.ops.fla_gdn import default_levels

        gdn_kwargs = {"levels": default_levels()}
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target == TREE_ATTENTION:
            q, k, v, subtree_end = n.args[:4]
            scale = n.args[4] if len(n.args) > 4 else n.kwargs.get("scale")
            auto = _auto_varlen(q, layout, setup_reason) if options.attention_kernel == "auto" and varlen else None
            if options.attention_kernel == "fa4_varlen" or auto:  # no block mask: the op plans from subtree_end
                new = _replace(graph, n, _varlen, (q, k, v, subtree_end, scale, setup_reason, options.attention_kernel),
                               dict(keep=keys_keep, layer=len(fit_calls), reserve_per_token=reserve))
                fit_calls.append(new)
                plans.append(_varlen_plan(q, subtree_end))
                attention_varlen += 1
                segments_only += auto == "segments"
            else:
                _replace(graph, n, _flex if compiled else _flex_eager, (q, k, v, mask, scale, options.attention_kernel,
                                                                             setup_reason, order))
                attention += 1
        elif n.op == "call_function" and n.target == TREE_ATTENTION_BOUNDARY:
            q, k, v, subtree_end, boundary_k, boundary_v, visible = n.args[:7]
            scale = n.args[7] if len(n.args) > 7 else n.kwargs.get("scale")
            auto = _auto_varlen(q, "dfs", setup_reason) if options.attention_kernel == "auto" and varlen else None
            if (options.attention_kernel == "fa4_varlen" and varlen) or auto:  # no block mask: planned in the op
                _replace(graph, n, _varlen_boundary, (q, k, v, subtree_end, boundary_k, boundary_v, visible, scale,
                                                      setup_reason, options.attention_kernel))
                boundary_varlen += 1
                continue
            _replace(graph, n, _flex_boundary if compiled else _flex_boundary_eager,
                     (q, k, v, boundary_k, boundary_v, mask, scale, _boundary_kernel(options.attention_kernel),
                      setup_reason))
            attention += 1
        elif n.op == "call_function" and n.target == TREE_ATTENTION_WINDOWED and _reads_batch_depths(n):
            q, k, v, subtree_end, positions, window = n.args[:6]
            scale = n.args[6] if len(n.args) > 6 else n.kwargs.get("scale")
            # the varlen op reads the batch's DFS tensors whatever the layout (as the window block mask does)
            auto = _auto_varlen(q, "dfs", setup_reason) if options.attention_kernel == "auto" and varlen else None
            if options.attention_kernel == "fa4_varlen" or auto:
                _replace(graph, n, _varlen_windowed, (q, k, v, subtree_end, positions, window, scale, setup_reason,
                                                      options.attention_kernel), dict(keep=windowed_keep))
                plans.append(_varlen_plan(q, subtree_end, positions, window))
                windowed_varlen += 1
                continue
            if window not in window_masks:
                last = [p for p in graph.nodes if p.op == "placeholder"][-1]
                with graph.inserting_after(last):
                    window_masks[window] = graph.placeholder(f"tree_window_block_mask_{window}")
            _replace(graph, n, _flex_windowed if compiled else _flex_windowed_eager,
                     (q, k, v, window_masks[window], scale, _window_kernel(options.attention_kernel), setup_reason))
            windowed += 1
        elif n.op == "call_function" and n.target == TREE_GDN and gdn_kernel == "fla":
            plans.append(_gdn_plan(n.args, {**n.kwargs, **gdn_kwargs}))
            _replace(graph, n, _gdn_fla, n.args, {**n.kwargs, **gdn_kwargs})
            gdn_fla += 1
        elif n.op == "call_function" and n.target == TREE_CONV and conv_kernel in ("shifts", "shifts_inductor"):
            _replace(graph, n, tree_causal_conv1d_shifts if conv_kernel == "shifts" else
                     tree_causal_conv1d_shifts_inductor, n.args, n.kwargs)
            conv_shifts += 1
        elif (n.op == "call_function" and n.target == TREE_CONV and conv_kernel == "fla"
              and all(a.meta["val"].dtype in FLA_CONV_DTYPES for a in n.args[:2])):  # x and weight
            plans.append(_conv_plan(n.args))
            _replace(graph, n, TREE_CONV_FLA, n.args, n.kwargs)
            conv_fla += 1
        elif n.op == "call_function" and n.target == LINEAR_LOGPROBS:
            triton = _triton_head(n)
            triton_head += triton
            keep = head_keep(options.head_logits, _head_chunk(n), boundary=boundary)
            if keep is not None:
                _replace(graph, n, _fused_head, n.args, {**n.kwargs, "triton": triton, "keep": keep})
                head_kept = keep
            elif triton:
                _replace(graph, n, torch.ops.treecompile.linear_logprobs_triton.default, n.args, n.kwargs)
        elif n.op == "call_function" and n.target == MOE_EXPERTS and moe_grouped_ok and _moe_grouped(n):
            _replace(graph, n, MOE_EXPERTS_GROUPED, n.args, n.kwargs)
            moe_grouped += 1
    for new in fit_calls:
        new.kwargs = {**new.kwargs, "layers": len(fit_calls)}
    graph.eliminate_dead_code()
    materialized = materialize_position_values(graph, constants, gm) if compiled else 0
    return CudaLowering(graph_module=fx.GraphModule(gm, graph), attention=attention, materialized=materialized,
                        layout=layout, boundary=boundary, gdn_fla=gdn_fla, triton_head=triton_head,
                        compiled=compiled, bucket=options.bucket, conv_fla=conv_fla, conv_shifts=conv_shifts,
                        moe_grouped=moe_grouped, attention_varlen=attention_varlen,
                        attention_segments_only=segments_only, head_keep=head_kept,
                        windows=tuple(window_masks), windowed_varlen=windowed_varlen,
                        boundary_varlen=boundary_varlen,
                        attention_keep=keys_keep if attention_varlen else windowed_keep if windowed_varlen else "none",
                        keys_reserve_per_token=reserve,
                        plans=tuple(dict.fromkeys(p for p in plans if p is not None)))


def _attention_keep(attention_keys: str) -> tuple[str, str]:
    """The varlen ops' ``keep`` under ``attention_keys`` (:data:`ATTENTION_KEYS`): (the tree attention's, the
    windowed attention's)."""
    if attention_keys == "kept":
        return "all", "all"
    if attention_keys == "gathered":
        return "none", "none"
    return "fit", "none"


def _head_reserve(graph: fx.Graph, options: CudaOptions, boundary: bool) -> int:
    """The bytes per token of logits the graph's fused heads keep for their backward (``head_keep``), which the
    attention's "fit" leaves room for: vocabulary x the hidden states' element size, the largest over the heads
    (0 without a kept head)."""
    reserve = 0
    for n in graph.nodes:
        if n.op == "call_function" and n.target == LINEAR_LOGPROBS:
            h, W = (_val(a) for a in n.args[:2])
            kept = head_keep(options.head_logits, _head_chunk(n), boundary=boundary) is not None
            if kept and h is not None and W is not None:
                reserve = max(reserve, logits_bytes(1, W.shape[0], h.dtype))
    return reserve


def _head_chunk(n: fx.Node) -> int:
    """The ``chunk`` argument of the fused head ``n`` (``treecompile::linear_logprobs``; 0: the user set none)."""
    return n.args[4] if len(n.args) > 4 else n.kwargs["chunk"]


def _reads_batch_depths(n: fx.Node) -> bool:
    """Whether windowed attention ``n`` reads the batch's own ``position_ids`` and ``subtree_end`` (the placeholders
    ``rewrite_attention`` gives it), from which :func:`attention_inputs` builds its block mask; another call
    keeps the op (FlexAttention inside it, its mask built per call)."""
    se, pos = n.args[3:5]
    return all(isinstance(a, fx.Node) and a.op == "placeholder" and a.name == name
               for a, name in ((se, "tree_subtree_end"), (pos, "tree_position_ids")))


MATERIALIZE = torch.ops.treecompile.materialize.default
# views: materializing one would copy what its input holds in less memory; the input is materialized instead
_VIEWS = {torch.ops.aten.expand.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
          torch.ops.aten.squeeze.default, torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
          torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.t.default,
          torch.ops.aten.reshape.default, torch.ops.aten.alias.default}
MATERIALIZE_MAX_WIDTH = 4096  # a materialized value holds at most this many elements per token


def _per_token_width(val, T) -> int | None:
    """Elements per token of ``val`` (a tensor with one dimension of size ``T``), or None."""
    width, seen = 1, False
    for d in val.shape:
        if not seen and same(d, T):
            seen = True
        elif isinstance(d, int):
            width *= d
        else:
            return None
    return width if seen else None


def _pure_op(target) -> bool:
    return (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded not in target.tags
            and not target._schema.is_mutable)


# higher-order ops that only run a subgraph under a grad/autocast mode (HF's ``@torch.no_grad`` rotary)
_MODE_HOPS = {"wrap_with_set_grad_enabled", "wrap_with_autocast"}


def _pure_call(n: fx.Node, root) -> bool:
    """``n`` computes a value from its inputs only: a pure op, ``getitem``, or a mode region with a pure subgraph."""
    return n.op == "call_function" and (_pure_op(n.target) or n.target is operator.getitem or _pure_hop(n, root))


def _pure_graph(gm) -> bool:
    """Every node of ``gm``'s graph computes a value from its inputs only (no randomness, no mutation)."""
    return all(n.op in ("placeholder", "output", "get_attr") or _pure_call(n, gm) for n in gm.graph.nodes)


def _pure_hop(n: fx.Node, root) -> bool:
    if getattr(n.target, "__name__", None) not in _MODE_HOPS or root is None:
        return False
    subs = [getattr(root, a.target, None) for a in n.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    return len(subs) == 1 and isinstance(subs[0], fx.GraphModule) and _pure_graph(subs[0])


def materialize_position_values(graph: fx.Graph, constants: Collection[str] = (), root=None) -> int:
    """Wrap each value computed from ``tree_position_ids`` and constants alone (ops without tensor inputs,
    the placeholders named in ``constants``, attributes of ``root``, the module whose attributes the graph's
    ``get_attr`` nodes name), where it meets the rest of the graph, in ``treecompile::materialize``
    (:mod:`treecompile.ops.materialize`: inductor then computes it once instead of inlining it into every
    consumer).  Pure ops, ``getitem`` and grad/autocast-mode regions whose subgraph is pure are followed.
    Walks back through views (their input is materialized); skips integer and bool values (position
    arithmetic: cheap to recompute), values with more than ``MATERIALIZE_MAX_WIDTH`` elements per token or
    without a token dimension.  Exact: the same ops on the same inputs, evaluated once.  Returns how many."""
    pos = next((n for n in graph.nodes if n.op == "placeholder" and n.name == "tree_position_ids"), None)
    if pos is None or not isinstance(pos.meta.get("val"), torch.Tensor):
        return 0
    T = pos.meta["val"].shape[0]
    # values of positions and constants alone, and those of them that depend on the positions
    only: set[fx.Node] = {pos} | {n for n in graph.nodes if n.op == "placeholder" and n.name in constants}
    from_pos: set[fx.Node] = {pos}
    for n in graph.nodes:
        if n.op == "get_attr" and root is not None:
            only.add(n)
            continue
        if not _pure_call(n, root):
            continue
        inputs = n.all_input_nodes
        if all(i in only for i in inputs):
            only.add(n)
            if any(i in from_pos for i in inputs):
                from_pos.add(n)
    chosen: dict[fx.Node, None] = {}  # graph order, O(1) membership
    for n in [n for n in graph.nodes if n in from_pos]:  # graph order: a deterministic graph
        if n is pos or not isinstance(n.meta.get("val"), torch.Tensor) or all(u in only for u in n.users):
            continue
        while n.target in _VIEWS and n.args and isinstance(n.args[0], fx.Node) and n.args[0] in from_pos \
                and n.args[0] is not pos:
            n = n.args[0]
        width = _per_token_width(n.meta["val"], T)
        if width is None or width > MATERIALIZE_MAX_WIDTH or not n.meta["val"].is_floating_point() or n in chosen:
            continue
        chosen[n] = None
    for n in chosen:
        with graph.inserting_after(n):
            m = graph.call_function(MATERIALIZE, (n,))
        m.meta = dict(n.meta)
        n.replace_all_uses_with(m, delete_user_cb=lambda u: u is not m)
    return len(chosen)
