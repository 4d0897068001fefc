"""expose_boundary: the graph takes and returns the boundary tensors of a tree partition.

Enabled by ``treecompile.compile(model, boundary=True)``; runs after the default pipeline.  A
partition of a redundancy-free plan (``treecompile.runtime.partition.partition_redundancy_free``)
holds some tokens of the tree; the tokens it attends to but does not hold (its *boundary*: the
tokens from the root down to the token it hangs below, ``plan.partitions[i].boundary_last``) were
computed by earlier partitions.  The rewritten graph then

- takes, per attention layer, ``boundary_k [1, Hkv, B, D]`` / ``boundary_v [1, Hkv, B, Dv]`` (the
  boundary's keys and values exactly as the attention consumed them: after projections, norms and
  RoPE), and one ``boundary_visible [T]`` (token q sees boundary entries ``j < boundary_visible[q]``);
  ``tree_attention`` becomes ``treecompile::tree_attention_boundary``; it returns the layer's own
  ``k`` and ``v`` ``[1, Hkv, T, D]`` so that later partitions can read theirs;
- per Gated DeltaNet layer takes ``initial_state [Hv, Dk, Dv]`` (the recurrent state after the
  boundary's last token; every local root node starts from it) and returns ``final[state_nodes]`` for one shared
  input ``state_nodes [E]`` (the local nodes ending at a token that later partitions hang below):
  ``tree_gated_delta_rule`` becomes ``treecompile::tree_gated_delta_rule_boundary``;
- per causal conv takes ``boundary_x [1, C, P]`` (conv inputs of the boundary tokens inside the
  kernel's reach) and returns its input ``x [1, C, T]``; ``conv_index`` entries ``T + r`` read
  ``boundary_x[..., r]`` (``treecompile::tree_causal_conv1d_boundary``);
- for the loss takes ``boundary_hidden [Ph, D]``: the rows the lm_head reads for tokens whose path
  predecessor is a boundary token (the first token below the boundary is predicted by the boundary's
  last token's final hidden state, computed in the parent partition; the log-prob and its loss weight stay in the
  child, the gradient flows back through ``boundary_hidden``).  ``pred_index`` entries ``T + r`` read
  ``boundary_hidden[r]``.  It returns the rows it reads for its own tokens (``[T, D]``).

Graph inputs: the default ones, then (in this order) ``boundary_k``/``boundary_v`` per attention
layer, ``boundary_visible``, ``initial_state`` per GDN layer, ``state_nodes``, ``boundary_x`` per
conv, and ``boundary_hidden``.  Outputs: ``(loss, logprobs, *kept, k/v per attention layer, states
per GDN layer, x per conv, hidden)``, ``kept`` the outputs ``rewrite_loss`` returned after the log-probs
(the entropy, router logits: per token of the partition, like the log-probs).  The pass returns a :class:`BoundaryResult` whose ``spec``
(:class:`BoundarySpec`) is the contract the runtime reads: both lists as ``(kind, layer)`` pairs
(``layer`` counts the layers of that kind in graph order; ``-1`` for shared entries), the inputs'
shapes and ``conv_width`` (K-1).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

import treecompile.ops.tree_attention  # noqa: F401  (registers the ops)
import treecompile.ops.tree_attention_boundary  # noqa: F401
import treecompile.ops.tree_conv_boundary  # noqa: F401
import treecompile.ops.tree_gdn_boundary  # noqa: F401
from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError, remove_dead_code, where

__all__ = ["BoundarySpec", "BoundaryResult", "expose_boundary"]

aten = torch.ops.aten
ATTENTION = torch.ops.treecompile.tree_attention.default
ATTENTION_BOUNDARY = torch.ops.treecompile.tree_attention_boundary.default
GDN = torch.ops.treecompile.tree_gated_delta_rule.default
GDN_BOUNDARY = torch.ops.treecompile.tree_gated_delta_rule_boundary.default
CONV = torch.ops.treecompile.tree_causal_conv1d.default
CONV_BOUNDARY = torch.ops.treecompile.tree_causal_conv1d_boundary.default


@dataclass(frozen=True)
class BoundarySpec:
    """The boundary inputs and outputs of a partition graph, in graph order (module docstring)."""

    inputs: tuple[tuple[str, int], ...]  # (kind, layer) after the batch inputs
    input_shapes: tuple[tuple[tuple[int | None, ...], torch.dtype], ...]  # per input; None: a sized dim
    outputs: tuple[tuple[str, int], ...]  # (kind, layer) after (loss, logprobs, *kept)
    conv_width: int | None  # K-1 of the causal convs; None: no conv
    attention: int  # layers of each kind
    gdn: int
    conv: int
    kept: int = 0  # outputs between the log-probs and the boundary exports (entropy, router logits)


@dataclass
class BoundaryResult(PassResult):
    spec: BoundarySpec | None = None


def _placeholder(ctx: PassContext, name: str, shape, dtype, device) -> fx.Node:
    """A new placeholder after all others; symbolic sizes given as None become fresh unbacked ints."""
    last = [n for n in ctx.graph.nodes if n.op == "placeholder"][-1]
    with ctx.graph.inserting_after(last):
        node = ctx.graph.placeholder(name)
    env = ctx.fake_mode.shape_env
    dims = [(env.create_unbacked_symint() if env is not None else 1) if s is None else s for s in shape]
    with ctx.fake_mode:
        node.meta["val"] = torch.empty(dims, dtype=dtype, device=device)
    return node


def _loss_rows(ctx: PassContext) -> fx.Node:
    """The ``index_select(X, 0, clamp_min(pred_index, 0))`` rewrite_loss built (X = hidden or logits)."""
    pred = ctx.tree_inputs.get("pred_index")
    sites = [] if pred is None else [
        s for c in pred.users if c.target == aten.clamp_min.default
        for s in c.users if s.target == aten.index_select.default and s.args[2] is c and s.args[1] == 0]
    if len(sites) != 1:
        raise UnsupportedModelError(f"expose_boundary: expected one row gather at the path predecessor "
                                    f"(from rewrite_loss), found {len(sites)}; run the default pipeline first")
    return sites[0]


# mixer rewrites (rewrite_token_shifts/_causal_convs/_scans/_causal_attention) with no boundary form yet
_NO_BOUNDARY_FORM = ("tree_shift", "tree_scan", "tree_ancestors", "tree_attention_biased", "tree_attention_windowed")


def expose_boundary(gm: fx.GraphModule, ctx: PassContext) -> BoundaryResult:
    graph = gm.graph
    for n in graph.nodes:
        name = getattr(n.target, "__name__", "")
        if (n.op == "call_function" and getattr(n.target, "namespace", None) == "treecompile"
                and name.split(".")[0] in _NO_BOUNDARY_FORM):
            raise UnsupportedModelError(f"{where(n)}: treecompile::{name.split('.')[0]} has no partition-boundary "
                                        f"form yet (its context would stop at the partition); train this model "
                                        f"on whole trees (boundary=False)")
    attn = [n for n in graph.nodes if n.op == "call_function" and n.target == ATTENTION]
    gdn = [n for n in graph.nodes if n.op == "call_function" and n.target == GDN]
    conv = [n for n in graph.nodes if n.op == "call_function" and n.target == CONV]
    rows = _loss_rows(ctx)
    T = ctx.seq_len
    inputs: list[tuple[str, int]] = []
    outputs: list[tuple[str, int]] = []
    exports: list[fx.Node] = []

    # placeholders, in the documented order
    boundary_kv = []
    for i, n in enumerate(attn):
        k, v = n.args[1], n.args[2]
        kv, vv = k.meta["val"], v.meta["val"]
        pk = _placeholder(ctx, f"boundary_k_{i}", (1, kv.shape[1], None, kv.shape[3]), kv.dtype, kv.device)
        B = pk.meta["val"].shape[2]
        pv = _placeholder(ctx, f"boundary_v_{i}", (1, vv.shape[1], B, vv.shape[3]), vv.dtype, vv.device)
        boundary_kv.append((pk, pv))
        inputs += [("boundary_k", i), ("boundary_v", i)]
    visible = None
    if attn:
        visible = _placeholder(ctx, "boundary_visible", (T,), torch.long, ctx.device)
        inputs.append(("boundary_visible", -1))
    inits = []
    for i, n in enumerate(gdn):
        if len(n.args) > 9 and n.args[9] is not None or n.kwargs.get("initial_state") is not None:
            raise UnsupportedModelError(f"{where(n)}: the GDN layer has its own initial state; a partition's "
                                        f"initial state cannot be fed")
        v = n.args[2].meta["val"]
        ct = torch.float64 if v.dtype == torch.float64 else torch.float32
        Dk = n.args[0].meta["val"].shape[3]
        inits.append(_placeholder(ctx, f"boundary_initial_state_{i}", (v.shape[2], Dk, v.shape[3]), ct, v.device))
        inputs.append(("initial_state", i))
    state_nodes = None
    if gdn:
        state_nodes = _placeholder(ctx, "boundary_state_nodes", (None,), torch.long, ctx.device)
        inputs.append(("state_nodes", -1))
    boundary_x = []
    width = None
    for i, n in enumerate(conv):
        x = n.args[0].meta["val"]
        K1 = int(n.args[1].meta["val"].shape[1]) - 1
        width = K1 if width is None else width
        shared = boundary_x[0].meta["val"].shape[2] if boundary_x else None
        boundary_x.append(_placeholder(ctx, f"boundary_x_{i}", (x.shape[0], x.shape[1], shared), x.dtype, x.device))
        inputs.append(("boundary_x", i))
    X = rows.args[0]
    xv = X.meta["val"]
    boundary_hidden = _placeholder(ctx, "boundary_hidden", (None, xv.shape[1]), xv.dtype, xv.device)
    inputs.append(("boundary_hidden", -1))

    # rewrites
    for i, n in enumerate(attn):
        q, k, v, sub_end = n.args[:4]
        scale = n.args[4] if len(n.args) > 4 else n.kwargs.get("scale")
        with graph.inserting_before(n):
            new = ctx.call(ATTENTION_BOUNDARY, (q, k, v, sub_end, *boundary_kv[i], visible, scale), like=n)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        exports += [k, v]
        outputs += [("k", i), ("v", i)]
    for i, n in enumerate(gdn):
        with graph.inserting_before(n):
            new = ctx.call(GDN_BOUNDARY, (*n.args[:9], inits[i], state_nodes), dict(n.kwargs), like=n)
            o = ctx.call(operator.getitem, (new, 0))
            st = ctx.call(operator.getitem, (new, 1))
        n.replace_all_uses_with(o)
        graph.erase_node(n)
        exports.append(st)
        outputs.append(("states", i))
    for i, n in enumerate(conv):
        x, w, b, idx = n.args[:4]
        act = n.args[4] if len(n.args) > 4 else n.kwargs.get("activation")
        with graph.inserting_before(n):
            new = ctx.call(CONV_BOUNDARY, (x, w, b, idx, boundary_x[i], act), like=n)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        exports.append(x)
        outputs.append(("x", i))
    with graph.inserting_before(rows):
        both = ctx.call(aten.cat.default, ([X, boundary_hidden], 0))
    rows.replace_input_with(X, both)
    exports.append(X)
    outputs.append(("hidden", -1))

    new_phs = [n for n in graph.nodes if n.op == "placeholder"][-len(inputs):]
    shapes = tuple((tuple(d if isinstance(d, int) else None for d in n.meta["val"].shape), n.meta["val"].dtype)
                   for n in new_phs)
    out = graph.output_node()
    kept = tuple(out.args[0])
    out.args = ((*kept, *exports),)
    remove_dead_code(gm)
    spec = BoundarySpec(inputs=tuple(inputs), input_shapes=shapes, outputs=tuple(outputs), conv_width=width,
                        attention=len(attn), gdn=len(gdn), conv=len(conv), kept=len(kept) - 2)
    return BoundaryResult(len(attn) + len(gdn) + len(conv) + 1,
                          {"attention": len(attn), "gdn": len(gdn), "conv": len(conv)}, spec)
