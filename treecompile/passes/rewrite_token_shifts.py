"""rewrite_token_shifts: a shift by k tokens toward the past becomes the k-th path ancestor.

A token shift (RWKV's time-mix, "previous token" features) reads, at row t, the input row t-k and
zeros for t < k.  It is spelled many ways (``F.pad(x, (0, 0, k, 0))[:, :-k]``,
``cat([zeros, x], 1)[:, :T]``, ``roll`` then a zeroing mask, ...), so the pass finds it by what it
computes, not by its spelling:

1. a *region* grows backwards from a node through data-movement ops that act on a token axis (pad,
   slice, narrow, cat, roll, slice_scatter along a dim whose size is a function of T) and through
   masking ops whose other operands do not depend on input values (``* mask``, ``where``,
   ``masked_fill`` with a mask built from shapes or positions; copies);
2. the region must read exactly one value input ``x`` whose shape equals the region's result and
   has one dim of size T;
3. the region is evaluated on random ``x`` at several lengths, one past every number it holds among them
   (:class:`token_probe.Probe`, :func:`token_probe.lengths_past_literals`): if the
   result is ``x`` shifted by the same k >= 1 along that dim every time (zeros in front), the region
   becomes ``treecompile::tree_shift(x, pred_index, k, dim)``.
Anything else (a shift toward the future, a wrap-around roll, a reversal) is left alone: the
verifier refuses it.  Candidates are tried from the end of the graph, so the largest region wins.
"""

from __future__ import annotations

import torch
from torch import fx

import treecompile.ops.tree_mixers  # noqa: F401  (registers treecompile::tree_shift)
from treecompile.passes.base import PassContext, PassResult, remove_dead_code
from treecompile.passes.token_probe import (Probe, chain_batch, involves_tokens, lengths_past_literals, token_dims,
                                           value_nodes)

aten = torch.ops.aten
TREE_SHIFT = torch.ops.treecompile.tree_shift.default
MOVES = {aten.pad.default, aten.constant_pad_nd.default, aten.slice.Tensor, aten.narrow.default,
         aten.cat.default, aten.roll.default, aten.slice_scatter.default}
COPIES = {aten.clone.default, aten.contiguous.default, aten.alias.default}
MASKS = {aten.mul.Tensor, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf,
         aten.masked_fill.Scalar}
PROBE_LENGTHS = (13, 29, 64)


def _dim_sizes(node: fx.Node, dim) -> list:
    val = node.meta["val"]
    return [val.shape[dim % val.dim()]] if isinstance(dim, int) else []


def moves_tokens(node: fx.Node, ctx: PassContext) -> bool:
    """A data-movement op acting on a token axis of its input."""
    if node.op != "call_function" or node.target not in MOVES:
        return False
    t, a = node.target, node.args
    if t in (aten.slice.Tensor, aten.narrow.default):
        dim = a[1] if len(a) > 1 else node.kwargs.get("dim", 0)
        return any(involves_tokens(s, ctx) for s in _dim_sizes(a[0], dim))
    if t == aten.slice_scatter.default:
        dim = a[2] if len(a) > 2 else node.kwargs.get("dim", 0)
        return any(involves_tokens(s, ctx) for s in _dim_sizes(a[0], dim))
    if t in (aten.pad.default, aten.constant_pad_nd.default):
        val, pad = a[0].meta["val"], list(a[1])
        if (len(a) > 2 and a[2] not in ("constant", None)) or node.kwargs.get("mode", "constant") != "constant":
            return False
        return any((pad[2 * i], pad[2 * i + 1]) != (0, 0) and involves_tokens(val.shape[val.dim() - 1 - i], ctx)
                   for i in range(len(pad) // 2))
    if t == aten.cat.default:
        dim = a[1] if len(a) > 1 else node.kwargs.get("dim", 0)
        return any(involves_tokens(s, ctx) for x in a[0] if isinstance(x, fx.Node) for s in _dim_sizes(x, dim))
    # roll
    dims = list(a[2]) if len(a) > 2 else list(node.kwargs.get("dims", []))
    val = a[0].meta["val"]
    return not dims or any(involves_tokens(val.shape[d % val.dim()], ctx) for d in dims)


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _member(node: fx.Node, ctx: PassContext, values: set) -> bool:
    if node.op != "call_function":
        return False
    if node.target in MOVES:
        return moves_tokens(node, ctx)
    if node.target in COPIES:
        return True
    if node.target in MASKS:
        ins = _tensor_inputs(node)
        return sum(a in values for a in ins) == 1 and len(ins) >= 2  # one value operand, the rest masks
    return False


def find_region(y: fx.Node, ctx: PassContext, values: set):
    """(members, leaves) of the region ending at ``y``, or None if it moves no token axis."""
    members, leaves, stack = [], [], [y]
    seen = {y}
    while stack:
        n = stack.pop()
        if _member(n, ctx, values):
            members.append(n)
            for a in _tensor_inputs(n):
                if a not in seen:
                    seen.add(a)
                    stack.append(a)
        else:
            leaves.append(n)
    if not any(moves_tokens(n, ctx) for n in members):
        return None
    return members, leaves


def shift_of(x: torch.Tensor, y: torch.Tensor, dim: int) -> int | None:
    """The k >= 1 with ``y = x`` shifted by k rows along ``dim`` (zeros in front); T if y is all zero
    (any k >= T); None if no such k."""
    if y.shape != x.shape or y.dtype != x.dtype:
        return None
    T = x.shape[dim]
    xd, yd = x.movedim(dim, 0), y.movedim(dim, 0)
    if not bool((yd == 0).all()):
        k = int((yd != 0).reshape(T, -1).any(1).nonzero()[0])  # x has no zeros: k zero rows in front
        ok = k >= 1 and torch.equal(yd[k:], xd[:T - k]) and bool((yd[:k] == 0).all())
        return k if ok else None
    return T


def rewrite_token_shifts(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    values = value_nodes(gm.graph)
    probe = Probe(ctx)
    done: set[fx.Node] = set()
    count, shifts = 0, []
    for y in reversed(list(gm.graph.nodes)):
        if y in done or not _member(y, ctx, values) or y.op != "call_function":
            continue
        region = find_region(y, ctx, values)
        if region is None:
            continue
        members, leaves = region
        xs = [n for n in leaves if n in values]
        if len(xs) != 1:
            continue
        (x,) = xs
        dims = token_dims(x.meta["val"], ctx)
        if len(dims) != 1 or str(x.meta["val"].shape) != str(y.meta["val"].shape):
            continue
        dim = dims[0]
        k = _probe_shift(probe, x, y, dim)
        if k is None:
            continue
        with gm.graph.inserting_before(y):
            new = ctx.call(TREE_SHIFT, (x, ctx.tree_input("pred_index"), k, dim), like=y)
        y.replace_all_uses_with(new)
        done.update(members)
        count += 1
        shifts.append(k)
    if count:
        remove_dead_code(gm)
    return PassResult(count, {"k": shifts} if shifts else {})


def _probe_shift(probe: Probe, x: fx.Node, y: fx.Node, dim: int) -> int | None:
    """The shift k (>= 1) that ``y`` applies to ``x`` at every probe length (:data:`PROBE_LENGTHS` and one past
    every number the region holds), or None."""
    lengths = lengths_past_literals(PROBE_LENGTHS, y, [x], probe.ctx)
    if lengths is None:
        return None
    gen = torch.Generator().manual_seed(0)
    found = []
    for T in lengths:
        xv = probe.random(x, T, gen)
        if xv.dtype.is_floating_point:
            xv = xv + 3.0  # no zero entries: a zero row in y then means "no source row"
        else:
            xv = xv + 1
        out = probe.run([y], chain_batch(T), {x: xv})
        if out is None:
            return None
        k = shift_of(xv, out[0], dim)
        if k is None:
            return None
        found.append((T, k))
    exact = {k for T, k in found if k < T}
    if len(exact) != 1:
        return None
    (k,) = exact
    return k if all(kk == k or (kk == T and k >= T) for T, kk in found) else None
