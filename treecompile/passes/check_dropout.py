"""check_dropout: refuse active dropout, which cannot be made identical to the per-path run.

Capture bakes the model's train/eval mode into the graph (``aten.dropout(x, p, train)``).  With
``p > 0`` and ``train=True`` a shared prefix token would draw ONE dropout mask on the tree where the
per-path baseline draws one per path: the expected gradient agrees, the gradient does not.  Unless
``allow_dropout=True`` (accepting that), the pass raises naming the node; it changes nothing.
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError, where

aten = torch.ops.aten
DROPOUTS = {aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
            aten.alpha_dropout.default, aten.feature_alpha_dropout.default}


def _active(node: fx.Node) -> tuple[float, bool]:
    args = list(node.args) + [None, None]
    p = node.kwargs.get("p", args[1])
    train = node.kwargs.get("train", args[2])
    return float(p or 0.0), bool(train) if train is not None else True


def check_dropout(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    active = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in DROPOUTS:
            p, train = _active(node)
            if p > 0 and train:
                active.append((node, p))
    if active and not ctx.options.allow_dropout:
        node, p = active[0]
        raise UnsupportedModelError(
            f"{where(node)}: dropout p={p} is active ({len(active)} site(s)); on a tree a shared token draws one "
            f"mask for all its paths, so gradients would differ from the per-path run. Set dropout to 0 (or "
            f"compile the model in eval mode: capture bakes the train/eval mode), or pass allow_dropout=True")
    return PassResult(0, {"active_dropout": len(active)})
