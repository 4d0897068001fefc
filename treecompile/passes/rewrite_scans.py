"""rewrite_scans: cumulative ops along the sequence become prefix scans along each token's path.

``aten.cumsum`` / ``cumprod`` / ``logcumsumexp`` over a dim whose size is the sequence length T
become ``treecompile::tree_scan(x, pred_index, dim, op)``: token t's result combines the tokens on
its own path up to t, as the per-path run computes it.  This also covers positions derived as
``attention_mask.cumsum(-1)`` of an all-ones mask (the scan of ones is the depth + 1).  A dim of
any other size (features, T+1 after a pad) is left alone.  An integer input is cast to the op's
result dtype first (``cumsum`` of int/bool gives int64), as torch does.
"""

from __future__ import annotations

import torch
from torch import fx

import treecompile.ops.tree_mixers  # noqa: F401  (registers treecompile::tree_scan)
from treecompile.passes.base import PassContext, PassResult
from treecompile.passes.token_probe import token_dims

aten = torch.ops.aten
SCANS = {aten.cumsum.default: "sum", aten.cumprod.default: "prod", aten.logcumsumexp.default: "logsumexp"}
TREE_SCAN = torch.ops.treecompile.tree_scan.default


def rewrite_scans(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    counts = {op: 0 for op in SCANS.values()}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in SCANS:
            continue
        x, dim = node.args[0], node.args[1]
        xv = x.meta["val"]
        dim = dim % max(xv.dim(), 1)
        if dim not in token_dims(xv, ctx):
            continue
        op = SCANS[node.target]
        with gm.graph.inserting_before(node):
            src = x
            if node.meta["val"].dtype != xv.dtype:
                src = ctx.call(aten._to_copy.default, (x,), {"dtype": node.meta["val"].dtype}, like=node)
            new = ctx.call(TREE_SCAN, (src, ctx.tree_input("pred_index"), dim, op), like=node)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        counts[op] += 1
    return PassResult(sum(counts.values()), {k: v for k, v in counts.items() if v})
