"""rewrite_router_loss: a model's own router auxiliary loss is never computed on the DFS sequence.

A MoE model asked for router logits (HF: ``config.output_router_logits=True``) computes its
load-balancing loss inside the captured forward, over the rows it is given: on a tree's DFS sequence
that counts every shared token once instead of once per path, which is neither per-path nor packed
training.  This pass finds the outputs by name (the captured output structure: ``aux_loss``,
``router_logits.<i>``) and, by ``router_aux`` (a compile option):

- None (default): refuses a model that outputs ``aux_loss``, naming the node;
- ``"none"``: drops the model's aux loss (trained without it);
- ``"batch"`` / ``"path"``: drops the model's aux loss and tags each ``router_logits`` output
  (``node.meta["treecompile_output"] = ("router_logits", i)``) so that ``rewrite_loss`` keeps them as
  graph outputs after its own; the runner computes the tree-weighted loss from them
  (:mod:`treecompile.ops.router_loss`).

Runs before ``rewrite_loss``.  Count: 1 when the outputs changed.
"""

from __future__ import annotations

from torch import fx

from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError, where
from treecompile.passes.rewrite_loss import DROPPED_TAG, OUTPUT_TAG

ROUTER_AUX = ("batch", "path", "none")


def rewrite_router_loss(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    mode = ctx.options.router_aux
    if mode is not None and mode not in ROUTER_AUX:
        raise ValueError(f"router_aux: expected one of {ROUTER_AUX} or None, got {mode!r}")
    names = ctx.options.output_names
    out = gm.graph.output_node()
    flat = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    if names is None or len(names) != len(flat):
        if mode in ("batch", "path"):
            raise UnsupportedModelError("router_aux: the captured program's output names are unknown")
        return PassResult(0)
    aux = [n for n, name in zip(flat, names) if name in ("aux_loss", "z_loss") and isinstance(n, fx.Node)]
    router = [n for n, name in zip(flat, names) if name.startswith("router_logits") and isinstance(n, fx.Node)]
    if not aux and mode in (None, "none"):
        return PassResult(0)
    if aux and mode is None:
        raise UnsupportedModelError(
            f"{where(aux[0])}: the model computes a router auxiliary loss (output {names[flat.index(aux[0])]!r}) "
            f"over its input rows; on a tree's DFS sequence it would count each shared token once.  Choose "
            f"treecompile.compile(model, router_aux='batch') (statistics over all path tokens, as packing), "
            f"router_aux='path' (each path's own loss, averaged over paths) or router_aux='none' (train without it)")
    if mode in ("batch", "path"):
        if not router:
            raise UnsupportedModelError(f"router_aux={mode!r}: the model returns no router_logits outputs "
                                        f"(HF: set config.output_router_logits=True)")
        for i, n in enumerate(router):
            n.meta[OUTPUT_TAG] = ("router_logits", i)
    if mode == "none":
        for n in router:  # dropped as asked: rewrite_loss does not warn about them
            n.meta[DROPPED_TAG] = "router_aux='none'"
    out.args = (tuple(a for a in flat if a not in aux),)
    return PassResult(1, {"router_aux": mode, "router_logits": len(router) if mode != "none" else 0,
                          "dropped": [names[flat.index(a)] for a in aux]})
