"""CUDA execution of a TreeModel: FlexAttention lowering, torch.compile, length buckets.

``treecompile::tree_attention`` is a registered op so that captured programs save and load by name;
on CUDA it is lowered, in a copy of the rewritten graph, to ``flex_attention`` under a BlockMask
built once per batch from the tree (``ops.flex_tree_attention.tree_block_mask``, O(blocks)), so
that inductor compiles the attention kernel and its backward together with the rest of the graph.
Sequence lengths are padded to buckets (``compile.bucket_length``) and the graph is compiled with
static shapes: at most one compile per bucket.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import fx
from torch.nn.attention.flex_attention import flex_attention

from treecompile.ops.fa4_tree_attention import FA4_KERNEL_OPTIONS, fa4_unusable_reason, tree_attention_fa4
from treecompile.ops.flex_tree_attention import kernel_options_for, tree_attention_flex, tree_block_mask

__all__ = ["run_cuda", "lower_for_cuda"]

TREE_ATTENTION = torch.ops.treecompile.tree_attention.default
TREE_GDN = torch.ops.treecompile.tree_gated_delta_rule.default


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


# Tree attention kernel on CUDA: "fa4" (FlashAttention-4 through FlexAttention's FLASH backend),
# "flex" (FlexAttention's Triton kernel), "auto" (fa4 where it can run, else flex with one warning).
ATTENTION_KERNELS = ("auto", "fa4", "flex")
_WARNED: set = set()


def resolve_attention_kernel(requested: str, q) -> str:
    """``"fa4"`` or ``"flex"`` for attention inputs ``q`` (real or fake ``[B, H, T, D]``).

    ``"fa4"`` that cannot run raises RuntimeError naming the reason; ``"auto"`` falls back to flex
    and warns once per reason."""
    if requested == "flex":
        return "flex"
    if requested not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernel: expected one of {ATTENTION_KERNELS}, got {requested!r}")
    reason = fa4_unusable_reason(q)
    if reason is None:
        return "fa4"
    if requested == "fa4":
        raise RuntimeError(f"attention_kernel='fa4': {reason}")
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"attention_kernel='auto': {reason}; tree attention runs FlexAttention's Triton kernel",
                      stacklevel=2)
    return "flex"


def _flex(q, k, v, block_mask, scale, kernel="flex"):
    """Inside a graph that runs under torch.compile: inductor compiles flex with the rest (the kernel is
    resolved at trace time, on the fake inputs' device, dtype and head size)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    fa4 = resolve_attention_kernel(kernel, q) == "fa4"
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          kernel_options=dict(FA4_KERNEL_OPTIONS) if fa4 else kernel_options_for(q))


def _flex_eager(q, k, v, block_mask, scale, kernel="flex"):
    """In a graph that runs eagerly: the separately compiled flex kernel (never the T^2 eager flex)."""
    if resolve_attention_kernel(kernel, q) == "fa4":
        return tree_attention_fa4(q, k, v, block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return tree_attention_flex(q, k, v, block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def lower_for_cuda(gm: fx.GraphModule, *, compiled: bool = True, gdn_kernel: str = "reference",
                   attention_kernel: str = "auto") -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` whose tree_attention calls run FlexAttention under one shared BlockMask input
    (a new last placeholder ``tree_block_mask``), and whose tree GDN calls run fla when
    ``gdn_kernel == "fla"``.  ``compiled``: the copy will run under torch.compile (else eagerly).
    ``attention_kernel``: ``"auto" | "fa4" | "flex"``, resolved when the attention first runs.
    Returns (graph module, number of lowered attention calls)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    last_ph = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last_ph):
        mask = graph.placeholder("tree_block_mask")
    count = 0
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target == TREE_ATTENTION:
            q, k, v, _subtree_end = n.args[:4]
            scale = n.args[4] if len(n.args) > 4 else n.kwargs.get("scale")
            with graph.inserting_before(n):
                new = graph.call_function(_flex if compiled else _flex_eager, (q, k, v, mask, scale, attention_kernel))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            count += 1
        elif n.op == "call_function" and n.target == TREE_GDN and gdn_kernel == "fla":
            with graph.inserting_before(n):
                new = graph.call_function(_gdn_fla, n.args, dict(n.kwargs))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            graph.erase_node(n)
    graph.eliminate_dead_code()
    lowered = fx.GraphModule(gm, graph)
    return lowered, count


def run_cuda(tmodel, batch):
    from treecompile.compile import TreeOutput, bucket_length

    state = tmodel.__dict__.setdefault("_cuda_state", {})
    if "graph" not in state:
        state["graph"], state["lowered"] = lower_for_cuda(tmodel.graph_module, compiled=tmodel._compile_cuda,
                                                          gdn_kernel=resolve_gdn_kernel(tmodel._gdn_kernel),
                                                          attention_kernel=getattr(tmodel, "_attention_kernel", "auto"))
        if tmodel._compile_cuda:
            # one compile per length bucket; make room for many buckets before dynamo gives up
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

        def compiled(fn):
            return torch.compile(fn, dynamic=False) if tmodel._compile_cuda else fn

        if tmodel._split_owners:  # one compiled function per segment (per layer)
            state["split"] = tmodel.split_graph(state["graph"], wrap=compiled)
        else:
            state["fn"] = compiled(state["graph"])
    T = batch.seq_len
    if tmodel._bucket:
        batch = batch.padded(bucket_length(T))
    args = tmodel.batch_inputs(batch)
    args.append(tree_block_mask(batch.subtree_end, validate=False) if state["lowered"] else None)
    if "split" in state:
        from treecompile.compile import run_segments

        loss, lp = run_segments(tmodel, state["split"], args)
    else:
        loss, lp = state["fn"](*tmodel._lifted_values(), *args)
    return TreeOutput(loss=loss, logprobs=lp[:T] if tmodel._bucket else lp)
