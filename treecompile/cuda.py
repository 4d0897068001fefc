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

from treecompile.ops.flex_tree_attention import kernel_options_for, tree_attention_flex, tree_block_mask

__all__ = ["run_cuda", "lower_for_cuda"]

TREE_ATTENTION = torch.ops.treecompile.tree_attention.default
TREE_GDN = torch.ops.treecompile.tree_gated_delta_rule.default
LINEAR_LOGPROBS = torch.ops.treecompile.linear_logprobs.default
HALF = (torch.bfloat16, torch.float16)


def _triton_head(n: fx.Node) -> bool:
    """Whether the fused head ``n`` (``treecompile::linear_logprobs``) runs the Triton row kernels:
    half-precision hidden states and triton importable (else the reference op's torch ops)."""
    from treecompile.ops import logprobs_triton

    return n.args[0].meta["val"].dtype in HALF and logprobs_triton.available()


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


def _flex(q, k, v, block_mask, scale):
    """Inside a graph that runs under torch.compile: inductor compiles flex with the rest."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                          kernel_options=kernel_options_for(q))


def _flex_eager(q, k, v, block_mask, scale):
    """In a graph that runs eagerly: the separately compiled flex kernel (never the T^2 eager flex)."""
    return tree_attention_flex(q, k, v, block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def lower_for_cuda(gm: fx.GraphModule, *, compiled: bool = True, gdn_kernel: str = "reference"
                   ) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` whose tree_attention calls run FlexAttention under one shared BlockMask input
    (a new last placeholder ``tree_block_mask``), and whose tree GDN calls run fla when
    ``gdn_kernel == "fla"``, and whose half-precision fused heads run the Triton head
    (``treecompile::linear_logprobs_triton``, same signature).  ``compiled``: the copy will run under torch.compile (else eagerly).
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
                new = graph.call_function(_flex if compiled else _flex_eager, (q, k, v, mask, scale))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            graph.erase_node(n)
            count += 1
        elif n.op == "call_function" and n.target == LINEAR_LOGPROBS and _triton_head(n):
            n.target = torch.ops.treecompile.linear_logprobs_triton.default
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
    from treecompile.compile import bucket_length

    state = tmodel.__dict__.setdefault("_cuda_state", {})
    if "graph" not in state:
        state["graph"], state["lowered"] = lower_for_cuda(tmodel.graph_module, compiled=tmodel._compile_cuda,
                                                          gdn_kernel=resolve_gdn_kernel(tmodel._gdn_kernel))
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

        res = run_segments(tmodel, state["split"], args)
    else:
        res = state["fn"](*tmodel._lifted_values(), *args)
    # (loss, logprobs[, entropy][, router logits]): per-token outputs cut back from the bucket
    return tmodel.tree_output([res[0], *(x[:T] if tmodel._bucket else x for x in res[1:])], batch)
