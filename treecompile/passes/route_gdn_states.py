"""route_gdn_states: Gated DeltaNet states and causal-conv context follow the tree.

During capture each GDN layer became ``treecompile::tree_gated_delta_rule`` over one plain
sequence (node tensors built from ``arange``) and its conv ``treecompile::tree_causal_conv1d`` over
a chain ``conv_index``.  This pass re-points those inputs at the batch: the node tensors become
``node_start/node_end/node_parent/node_level`` (every radix node's segment starts from its parent's
final state; all segments of one level run in one varlen call), and ``conv_index`` becomes the
batch's K-1 preceding tokens along the path.  The old arange subgraphs die.
"""

from __future__ import annotations

import torch
from torch import fx

import treecompile.ops.tree_conv  # noqa: F401  (registers the ops)
import treecompile.ops.tree_gdn  # noqa: F401
from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError, remove_dead_code, where

GDN = torch.ops.treecompile.tree_gated_delta_rule.default
CONV = torch.ops.treecompile.tree_causal_conv1d.default
NODE_FIELDS = ("node_start", "node_end", "node_parent", "node_level")


def route_gdn_states(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    gdn = conv = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == GDN:
            q = node.args[0]
            if q.meta["val"].shape[0] != 1:
                raise UnsupportedModelError(f"{where(node)}: GDN batch must be 1 on a tree batch")
            args = list(node.args)
            args[5:9] = [ctx.tree_input(f) for f in NODE_FIELDS]
            node.args = tuple(args)
            gdn += 1
        elif node.target == CONV:
            K = int(node.args[1].meta["val"].shape[1])
            if ctx.conv_width not in (None, K - 1):
                raise UnsupportedModelError(f"{where(node)}: causal convs of different kernel sizes "
                                            f"({ctx.conv_width + 1} and {K}) in one model")
            ctx.conv_width = K - 1
            args = list(node.args)
            args[3] = ctx.tree_input("conv_index", width=K - 1)
            node.args = tuple(args)
            conv += 1
    if gdn or conv:
        remove_dead_code(gm)
    return PassResult(gdn + conv, {"gdn": gdn, "conv": conv})
