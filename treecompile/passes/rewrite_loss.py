"""rewrite_loss: the logits output becomes per-token log-probs and the tree's weighted loss.

``logprobs[t] = log p(token t | path prefix)`` is read at the token's *path predecessor*
(``pred_index``): a parent's last position predicts the first token of every child.  Roots get 0.
``loss = -(loss_weight * logprobs).sum()``.  The graph's outputs become ``(loss, logprobs)``, or
``(loss, logprobs, entropy)`` with the option ``entropy``: ``entropy[t]`` is the entropy of the
distribution that predicts token t (read at the same predecessor; 0 where ``logprobs`` is 0).
Outputs tagged ``node.meta["treecompile_output"]`` by an earlier pass (router logits) follow.

When the logits come straight from a linear layer (the lm_head; through slices/casts/views that
change nothing), the head is fused: ``treecompile::linear_logprobs`` gathers the predecessor
hidden states and computes log-softmax one chunk of rows at a time, so [T, V] logits never exist.
Otherwise ``treecompile::gather_logprobs`` upcasts the given logits one chunk at a time.
"""

from __future__ import annotations

import operator
import warnings

import torch
from torch import fx

import treecompile.ops.logprobs  # noqa: F401  (registers the ops)
from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError, remove_dead_code
from treecompile.passes.token_axis import same

aten = torch.ops.aten
OUTPUT_TAG = "treecompile_output"  # node.meta key of an output another pass asks to keep (sorted by its value)
OUTPUT_NAME = "treecompile_output_name"  # node.meta key: the captured output's name (:func:`tag_output_names`)
DROPPED_TAG = "treecompile_dropped"  # node.meta key of an output dropped on the user's request (value: why)
_PASS_THROUGH = {aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default,
                 aten.contiguous.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _find_logits(out_nodes, T, vocab: int | None = None):
    """The one ``[1, T, V]`` output; among several (``(logits, hidden_states)``), the one named ``logits``
    (HF's output), else the one whose width is ``vocab`` (the rows of the embedding the input ids read), when
    exactly one is; the others are dropped with :func:`rewrite_loss`'s warning."""
    cands = [n for n in out_nodes if isinstance(n, fx.Node) and "val" in n.meta
             and isinstance(n.meta["val"], torch.Tensor) and n.meta["val"].dim() == 3
             and n.meta["val"].shape[0] == 1 and same(n.meta["val"].shape[1], T)]
    if len(cands) > 1:
        named = [n for n in cands if n.meta.get(OUTPUT_NAME) == "logits"]
        wide = [n for n in cands if vocab is not None and n.meta["val"].shape[2] == vocab]
        cands = named if len(named) == 1 else wide if len(wide) == 1 else cands
    if len(cands) != 1:
        shapes = [tuple(n.meta["val"].shape) for n in out_nodes if isinstance(n, fx.Node) and "val" in n.meta]
        raise UnsupportedModelError(
            f"expected exactly one [1, T, V] logits output, found {len(cands)} (outputs: {shapes}"
            + (f"; the embedding has {vocab} rows" if vocab is not None else "") + "): return the logits alone, "
            "or first in an output named 'logits' (HF's CausalLMOutput)")
    return cands[0]


def _input_vocab(graph: fx.Graph, input_node: fx.Node) -> int | None:
    """Rows of the embedding that reads the input ids (None unless exactly one width)."""
    rows = {int(n.args[0].meta["val"].shape[0]) for n in graph.nodes
            if n.op == "call_function" and n.target == aten.embedding.default and n.args[1] is input_node
            and "val" in n.args[0].meta}
    return rows.pop() if len(rows) == 1 else None


def _lm_head(logits: fx.Node):
    """Walk back through shape/dtype no-ops to an ``aten.linear``; None if something else computes."""
    n = logits
    while True:
        if n.target == aten.linear.default:
            return n
        if n.target == aten.slice.Tensor:
            _, dim, start, end = (list(n.args) + [0, None, None])[:4]
            if dim not in (1, -2) or start not in (0, None) or n.meta["val"].shape != n.args[0].meta["val"].shape:
                return None
            n = n.args[0]
            continue
        if (n.target in _PASS_THROUGH and n.meta["val"].shape == n.args[0].meta["val"].shape
                and not _narrows(n.args[0].meta["val"].dtype, n.meta["val"].dtype)):
            n = n.args[0]
            continue
        return None


def _narrows(src: torch.dtype, dst: torch.dtype) -> bool:
    """A cast that rounds (to fewer mantissa bits, or float to integer): a fused head computing in the head's dtype
    would skip it (``head(h).bfloat16().double()``: log-probs off by 1e-3), so the loss reads the logits as cast."""
    if not src.is_floating_point:
        return False
    if not dst.is_floating_point:
        return True
    return torch.finfo(dst).eps > torch.finfo(src).eps or torch.finfo(dst).max < torch.finfo(src).max


def rewrite_loss(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    graph = gm.graph
    out = graph.output_node()
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    logits = _find_logits(flat, ctx.seq_len, _input_vocab(graph, ctx.input_node))
    V = int(logits.meta["val"].shape[-1])
    chunk = int(ctx.options.logits_chunk or 0)  # 0: the head op picks its chunk at run time
    entropy = bool(ctx.options.entropy)
    head = _lm_head(logits)
    pred = ctx.tree_input("pred_index")
    weight = ctx.tree_input("loss_weight")
    with graph.inserting_before(out):
        idx = ctx.call(aten.clamp_min.default, (pred, 0))
        targets = ctx.call(aten.select.int, (ctx.input_node, 0, 0))
        if head is not None:
            h, W = head.args[0], head.args[1]
            b = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
            h2 = ctx.call(aten.select.int, (h, 0, 0))
            hp = ctx.call(aten.index_select.default, (h2, 0, idx))
            res = ctx.call(torch.ops.treecompile.linear_logprobs.default, (hp, W, b, targets, chunk, entropy),
                          like=head)
        else:
            l2 = ctx.call(aten.select.int, (logits, 0, 0))
            lp_in = ctx.call(aten.index_select.default, (l2, 0, idx))
            res = ctx.call(torch.ops.treecompile.gather_logprobs.default, (lp_in, targets, chunk, entropy),
                          like=logits)
        lp_raw = ctx.call(operator.getitem, (res, 0))
        has_pred = ctx.call(aten.ge.Scalar, (pred, 0))
        lp = ctx.call(aten.where.ScalarOther, (has_pred, lp_raw, 0.0))
        w = ctx.call(aten._to_copy.default, (weight,), {"dtype": lp.meta["val"].dtype})
        loss = ctx.call(aten.neg.default, (ctx.call(aten.sum.default, (ctx.call(aten.mul.Tensor, (lp, w)),)),))
        if entropy:
            ent = ctx.call(aten.where.ScalarOther, (has_pred, ctx.call(operator.getitem, (res, 2)), 0.0))
    # outputs another pass asked to keep (rewrite_router_loss: router logits), in their order
    kept = sorted((n for n in flat if isinstance(n, fx.Node) and OUTPUT_TAG in n.meta),
                  key=lambda n: n.meta[OUTPUT_TAG])
    dropped = _dropped_outputs(flat, logits)
    if dropped:
        warnings.warn(f"treecompile trains the tree loss of the logits output only; the model's other outputs "
                      f"{', '.join(dropped)} are not computed (a loss term among them is not trained: add it to "
                      f"the objective yourself, or, for a MoE router loss, see compile(..., router_aux=...))",
                      stacklevel=2)
    out.args = ((loss, lp, *([ent] if entropy else []), *kept),)
    remove_dead_code(gm)
    return PassResult(1, {"fused_lm_head": head is not None, "vocab": V, "chunk": chunk, "entropy": entropy,
                          "kept": [n.meta[OUTPUT_TAG] for n in kept], "dropped": dropped})


def tag_output_names(gm: fx.GraphModule, names) -> None:
    """Record each graph output's captured name (``aux_loss``, ``router_logits.0``; a tuple's index: ``output 1``)
    on its node, before any pass changes the outputs (``passes.pipeline.run_passes``); unnamed outputs get their
    position."""
    out = gm.graph.output_node()
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    names = names if names is not None and len(names) == len(flat) else [str(i) for i in range(len(flat))]
    for n, name in zip(flat, names):
        if isinstance(n, fx.Node):
            n.meta.setdefault(OUTPUT_NAME, f"output {name}" if str(name).isdigit() else name)


def _dropped_outputs(flat, logits: fx.Node) -> list[str]:
    """Names of the graph outputs that this pass drops: all but the logits, those another pass keeps
    (``OUTPUT_TAG``) and those dropped on the user's request (``DROPPED_TAG``: router logits under
    ``router_aux="none"``)."""
    return [repr(n.meta.get(OUTPUT_NAME, n.name)) for n in flat
            if isinstance(n, fx.Node) and n is not logits and OUTPUT_TAG not in n.meta and DROPPED_TAG not in n.meta]
