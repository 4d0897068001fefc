"""Causal sequence mixers along tree paths: ``tree_ancestors``, ``tree_shift``, ``tree_scan``.

On a DFS-serialised tree "the tokens before t" are t's path ancestors, reached through
``pred_index [T]`` (the path predecessor's DFS index, -1 at a root and at padding).  Each op here is
what a per-path run computes for every token, with the path in place of the sequence:

- ``tree_ancestors(pred_index, n, step)`` -> ``[T, n]`` int64: column j is the ``(j+1)*step``-th
  ancestor (-1 where the path is shorter).  Feeds ``tree_causal_conv1d``'s ``conv_index`` (step =
  the conv's dilation).  O(T * n * step) gathers.
- ``tree_shift(x, pred_index, k, dim)``: ``out[t] = x[k-th ancestor of t]`` along ``dim`` (zero where
  the path is shorter than k): the tree form of ``F.pad(x, (.., k, 0))[:, :-k]``.  O(T * k) gathers
  for the index; backward is one ``index_add``.
- ``tree_scan(x, pred_index, dim, op)``: inclusive prefix ``sum``/``prod``/``logsumexp`` along each
  token's path (``cumsum``/``cumprod``/``logcumsumexp``).  Pointer jumping: ceil(log2(depth)) rounds
  of one gather each (O(T log depth)), the same torch code on every device; the backward
  (``treecompile::tree_scan_backward``) runs the rounds in reverse with index_add (no division, so
  zeros of a product are fine).

Every op is a ``torch.library.custom_op`` with a fake implementation (shapes) and, where it is
differentiable, an autograd formula, so that rewritten graphs save and load by name.  The CPU
references that define the semantics one token at a time live in :mod:`treecompile.ops.tree_mixers_ref`.
Shapes: ``pred_index [T]`` int64; ``x`` any shape with ``x.shape[dim] == T``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treecompile.tree import ancestor_index  # the data model: every room may depend on it

__all__ = ["SCAN_OPS", "tree_ancestors", "tree_scan", "tree_shift"]

SCAN_OPS = ("sum", "prod", "logsumexp")


def _kth_ancestor(pred: Tensor, k: int) -> Tensor:
    """[T]: the k-th ancestor of every token (-1 where none); k gathers."""
    a = torch.arange(pred.numel(), device=pred.device)
    for _ in range(k):
        a = torch.where(a >= 0, pred[a.clamp(min=0)], a)
    return a


def _check_pred(pred_index: Tensor, T, what: str) -> None:
    if pred_index.dim() != 1 or pred_index.dtype != torch.long or pred_index.shape[0] != T:
        raise ValueError(f"{what}: pred_index must be int64 [T={T}], got {pred_index.dtype} {tuple(pred_index.shape)}")


# --------------------------------------------------------------------------- ancestors
@torch.library.custom_op("treecompile::tree_ancestors", mutates_args=())
def tree_ancestors(pred_index: Tensor, n: int, step: int = 1) -> Tensor:
    """``[T, n]``: column j = the ``(j+1)*step``-th ancestor along the path, -1 where none."""
    if n < 0 or step < 1:
        raise ValueError(f"tree_ancestors: need n >= 0 and step >= 1, got n={n}, step={step}")
    _check_pred(pred_index, pred_index.shape[0], "tree_ancestors")
    return ancestor_index(pred_index, n * step)[:, step - 1::step].contiguous()


@tree_ancestors.register_fake
def _(pred_index, n, step=1):
    return pred_index.new_empty((pred_index.shape[0], n))


# --------------------------------------------------------------------------- shift
def _shift(x: Tensor, src: Tensor, dim: int) -> Tensor:
    out = x.index_select(dim, src.clamp(min=0))
    keep = (src >= 0).to(x.dtype)
    shape = [1] * x.dim()
    shape[dim] = -1
    return out * keep.reshape(shape)


@torch.library.custom_op("treecompile::tree_shift", mutates_args=())
def tree_shift(x: Tensor, pred_index: Tensor, k: int, dim: int) -> Tensor:
    """``out`` along ``dim``: row t = row (k-th path ancestor of t) of ``x``, zero where none."""
    dim = dim % x.dim()
    _check_pred(pred_index, x.shape[dim], "tree_shift")
    if k < 1:
        raise ValueError(f"tree_shift: k must be >= 1, got {k}")
    return _shift(x, _kth_ancestor(pred_index, k), dim).contiguous()


@tree_shift.register_fake
def _(x, pred_index, k, dim):
    return x.new_empty(x.shape)


def _shift_setup(ctx, inputs, output):
    x, pred_index, k, dim = inputs
    ctx.save_for_backward(pred_index)
    ctx.k, ctx.dim = k, dim % x.dim()


def _shift_backward(ctx, grad):
    (pred_index,) = ctx.saved_tensors
    src = _kth_ancestor(pred_index, ctx.k)
    shape = [1] * grad.dim()
    shape[ctx.dim] = -1
    g = grad * (src >= 0).to(grad.dtype).reshape(shape)
    dx = torch.zeros_like(grad).index_add(ctx.dim, src.clamp(min=0), g)
    return dx, None, None, None


tree_shift.register_autograd(_shift_backward, setup_context=_shift_setup)


# --------------------------------------------------------------------------- scan
def _combine(op: str, earlier: Tensor, later: Tensor) -> Tensor:
    if op == "sum":
        return earlier + later
    if op == "prod":
        return earlier * later
    return torch.logaddexp(earlier, later)


def _rounds(pred_index: Tensor):
    """The pointer-jumping schedule: per round (live mask, source index); ceil(log2(depth)) rounds."""
    out, p = [], pred_index
    while True:
        live = p >= 0
        if not bool(live.any()):
            return out
        src = p.clamp(min=0)
        out.append((live, src))
        p = torch.where(live, p[src], p)


def _scan_rounds(xd: Tensor, rounds, op: str) -> list[Tensor]:
    """[y_0 = xd, y_1, ..., y_R]: y_r[t] combines x over the path segment (p_r[t], t]; each round
    prepends the segment that ends at p_r[t]."""
    ys = [xd]
    shape = (-1,) + (1,) * (xd.dim() - 1)
    for live, src in rounds:
        y = ys[-1]
        ys.append(torch.where(live.reshape(shape), _combine(op, y.index_select(0, src), y), y))
    return ys


@torch.library.custom_op("treecompile::tree_scan", mutates_args=())
def tree_scan(x: Tensor, pred_index: Tensor, dim: int, op: str) -> Tensor:
    """Inclusive ``op`` (``sum``/``prod``/``logsumexp``) of ``x`` along each token's path (``dim``)."""
    dim = dim % x.dim()
    _check_pred(pred_index, x.shape[dim], "tree_scan")
    if op not in SCAN_OPS:
        raise ValueError(f"tree_scan: op must be one of {SCAN_OPS}, got {op!r}")
    rounds = _rounds(pred_index)
    if not rounds:  # no token has a predecessor (one-token paths): each token's scan is itself, in a new tensor
        return x.clone(memory_format=torch.contiguous_format)
    return _scan_rounds(x.movedim(dim, 0), rounds, op)[-1].movedim(0, dim).contiguous()


@tree_scan.register_fake
def _(x, pred_index, dim, op):
    return x.new_empty(x.shape)


def _scan_setup(ctx, inputs, output):
    x, pred_index, dim, op = inputs
    ctx.save_for_backward(x, pred_index)
    ctx.dim, ctx.op = dim % x.dim(), op


@torch.library.custom_op("treecompile::tree_scan_backward", mutates_args=())
def tree_scan_backward(grad: Tensor, x: Tensor, pred_index: Tensor, dim: int, op: str) -> Tensor:
    """d(loss)/dx of :func:`tree_scan`: the rounds in reverse (an op of its own: the round count
    depends on the tree's depth)."""
    rounds = _rounds(pred_index)
    ys = _scan_rounds(x.movedim(dim, 0), rounds, op)  # no rounds: the scan was the identity (:func:`tree_scan`)
    g = grad.movedim(dim, 0)
    shape = (-1,) + (1,) * (g.dim() - 1)
    for r in range(len(rounds) - 1, -1, -1):
        live, src = rounds[r]
        live = live.reshape(shape)
        a, b, out = ys[r].index_select(0, src), ys[r], ys[r + 1]
        if op == "sum":
            da, db = g, g
        elif op == "prod":
            da, db = g * b, g * a
        else:  # logaddexp's weights exp(a - out), exp(b - out); none where out = -inf (both are -inf), as torch's
            empty = out == float("-inf")
            da = torch.where(empty, 0.0, g * torch.exp(a - out))
            db = torch.where(empty, 0.0, g * torch.exp(b - out))
        # rows that do not combine this round pass their gradient through; where (not a product with a 0/1 mask),
        # so that what the unused branch computed for them (inf, NaN) never reaches the sum
        da = torch.where(live, da, 0.0)
        db = torch.where(live, db, g)
        g = db.index_add(0, src, da)
    if op == "logsumexp":  # torch's logcumsumexp backward is NaN where the running value is -inf: the same here
        g = torch.where(ys[-1] == float("-inf"), float("nan"), g)
    out = g.movedim(0, dim).contiguous()
    # a new tensor also when nothing above made one (a custom op's output may not alias its input)
    return out.clone() if out.data_ptr() == grad.data_ptr() else out


@tree_scan_backward.register_fake
def _(grad, x, pred_index, dim, op):
    return x.new_empty(x.shape)


def _scan_backward(ctx, grad):
    x, pred_index = ctx.saved_tensors
    return tree_scan_backward(grad, x, pred_index, ctx.dim, ctx.op), None, None, None


tree_scan.register_autograd(_scan_backward, setup_context=_scan_setup)
