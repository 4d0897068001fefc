"""rewrite_causal_convs: a depthwise causal conv along the sequence becomes the tree conv.

Mamba/Hyena-style short convolutions are ``nn.Conv1d(C, C, K, groups=C)`` on ``[B, C, T]``, made
causal either by ``padding=K-1`` and keeping the first T outputs, or by ``F.pad(x, (K-1, 0))`` and
``padding=0``.  Per path, output t is ``bias + sum_j w[:, K-1-j] x[t - j*d]`` (zero before the
start).  On a tree the preceding tokens are t's path ancestors, possibly several nodes up:
``treecompile::tree_causal_conv1d(x, w[:, 0, :], bias, tree_ancestors(pred_index, K-1, d))`` (the
GDN conv op; ``d`` = dilation).

Site: an ``aten.conv1d``/``aten.convolution`` (1-D, not transposed) with weight ``[C, 1, K]`` and
``groups == C``; the region around it is the pads before it and the slices/narrows after it along
the token axis.  The region is evaluated at a few lengths (and one past every number it holds) with random
input, weight and bias and must equal the causal conv above; else it is left alone (non-depthwise convs, centred "same"
padding, strides: the verifier refuses them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

import treecompile.ops.tree_conv  # noqa: F401  (registers treecompile::tree_causal_conv1d)
import treecompile.ops.tree_mixers  # noqa: F401  (registers treecompile::tree_ancestors)
from treecompile.passes.base import PassContext, PassResult, remove_dead_code
from treecompile.passes.rewrite_token_shifts import COPIES, moves_tokens
from treecompile.passes.token_axis import bound_args
from treecompile.passes.token_probe import Probe, chain_batch, lengths_past_literals, token_dims

aten = torch.ops.aten
CONVS = {aten.conv1d.default, aten.convolution.default}
TREE_CONV = torch.ops.treecompile.tree_causal_conv1d.default
ANCESTORS = torch.ops.treecompile.tree_ancestors.default
PROBE_LENGTHS = (5, 13, 29)


def _through(node: fx.Node, ctx: PassContext) -> bool:
    return node.op == "call_function" and (node.target in COPIES or moves_tokens(node, ctx))


def rewrite_causal_convs(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    probe = Probe(ctx)
    count, kernels = 0, []
    for conv in list(gm.graph.nodes):
        if conv.op != "call_function" or conv.target not in CONVS:
            continue
        a = bound_args(conv)
        w, b = a["weight"], a.get("bias")
        wv = w.meta["val"]
        if a.get("transposed", False) or wv.dim() != 3 or wv.shape[1] != 1 or a.get("groups", 1) != wv.shape[0]:
            continue  # not a depthwise 1-D conv with one filter per channel
        dil = a.get("dilation", [1])
        dil = int(dil[0] if isinstance(dil, (list, tuple)) else dil)
        x = a["input"]
        while _through(x, ctx) and len(x.users) == 1:  # the pads in front
            x = x.args[0]
        y = conv
        while len(y.users) == 1 and _through(next(iter(y.users)), ctx) and next(iter(y.users)).args[0] is y:
            y = next(iter(y.users))  # the slices behind
        xv = x.meta["val"]
        if xv.dim() != 3 or token_dims(xv, ctx) != [2] or str(xv.shape) != str(y.meta["val"].shape):
            continue
        if not _is_causal_conv(probe, x, w, b, y, dil):
            continue
        K = int(wv.shape[2])
        with gm.graph.inserting_before(y):
            w2 = ctx.call(aten.select.int, (w, 1, 0), like=conv)
            idx = ctx.call(ANCESTORS, (ctx.tree_input("pred_index"), K - 1, dil), like=conv)
            new = ctx.call(TREE_CONV, (x, w2, b, idx, None), like=conv)
        y.replace_all_uses_with(new)
        count += 1
        kernels.append(K)
    if count:
        remove_dead_code(gm)
    return PassResult(count, {"kernel": kernels} if kernels else {})


def _is_causal_conv(probe: Probe, x, w, b, y, dil: int) -> bool:
    lengths = lengths_past_literals(PROBE_LENGTHS, y, [x, w, *([b] if isinstance(b, fx.Node) else [])], probe.ctx)
    if lengths is None:
        return False
    gen = torch.Generator().manual_seed(0)
    for T in lengths:
        given = {x: probe.random(x, T, gen), w: probe.random(w, T, gen)}
        if isinstance(b, fx.Node):
            given[b] = probe.random(b, T, gen)
        out = probe.run([y], chain_batch(T), given)
        if out is None:
            return False
        xv, wv = given[x].double(), given[w].double()
        K = wv.shape[2]
        want = F.conv1d(F.pad(xv, ((K - 1) * dil, 0)), wv, given[b].double() if b in given else None,
                        dilation=dil, groups=wv.shape[0])
        got = out[0].double()
        tol = max(1e-9, 1e3 * torch.finfo(out[0].dtype).eps) if out[0].dtype.is_floating_point else 1e-9
        if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol):
            return False
    return True
