"""rewrite_positions: the sequence-index ``arange`` becomes the tree's depth positions.

Any ``aten.arange`` of length T (the sequence length) counting 0, 1, ..., T-1 is a token position
(RoPE's ``arange``/``cache_position``, a learned position embedding's index): on a tree a token's
position is its depth, ``batch.position_ids``.  Runs after rewrite_attention, so that the aranges
that only built the causal mask are already gone.  Counts how many of them reach a rotary
embedding (a ``cos``/``sin``, also inside a higher-order-op submodule) in ``info["rope"]``.
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError, where
from treecompile.passes.token_axis import same

aten = torch.ops.aten
ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}


def _arange_bounds(node: fx.Node):
    args = list(node.args)
    if node.target == aten.arange.default:
        return 0, args[0], 1
    if node.target == aten.arange.start:
        return args[0], args[1], 1
    return args[0], args[1], args[2] if len(args) > 2 else 1


def _reaches_trig(node: fx.Node, gm: fx.GraphModule) -> bool:
    trig = {aten.cos.default, aten.sin.default}
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target in trig:
                return True
            if u.op == "call_function" and isinstance(u.target, torch._ops.HigherOrderOperator):
                for a in u.args:
                    if isinstance(a, fx.Node) and a.op == "get_attr":
                        sub = getattr(gm, a.target, None)
                        if isinstance(sub, fx.GraphModule) and any(
                                m.target in trig for m in sub.graph.nodes):
                            return True
            stack.append(u)
    return False


def rewrite_positions(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    count, rope = 0, 0
    T = ctx.seq_len
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in ARANGES:
            continue
        val = node.meta.get("val")
        # sizes compared as expressions (token_axis.same): ``bool(16 == s)`` would read the symbol's hint, the
        # capture's example length 16, and take a constant arange(16) (rotary frequencies of head dim 32) for positions
        if val is None or val.dim() != 1 or not same(val.shape[0], T):
            continue
        start, end, step = _arange_bounds(node)
        if not (type(start) is int and type(step) is int and step != 0):
            raise UnsupportedModelError(f"{where(node)}: a sequence-length arange whose start and step are not "
                                        f"integer constants (start={start}, step={step}); cannot map it to tree "
                                        f"positions")
        rope += _reaches_trig(node, gm)
        pos = ctx.tree_input("position_ids")
        with gm.graph.inserting_before(node):
            new = pos
            if (start, step) != (0, 1):  # arange(start, start + step * T, step): token k holds start + step * k
                if step != 1:
                    new = ctx.call(aten.mul.Tensor, (new, step), like=node)
                if start != 0:
                    new = ctx.call(aten.add.Tensor, (new, start), like=node)
            if val.dtype != torch.long or val.device != pos.meta["val"].device:
                new = ctx.call(aten._to_copy.default, (new,), {"dtype": val.dtype, "device": val.device},
                               like=node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    return PassResult(count, {"rope": rope})
