"""The tree's short convolution as shifted products that inductor fuses: :func:`tree_causal_conv1d_shifts`,
what ``lower_cuda`` runs in place of ``treecompile::tree_causal_conv1d`` in a compiled CUDA graph
(``conv_kernel="shifts"``; same arguments, same result).

``conv_index [T, K-1]`` (``ops.tree_conv``) names, for every token, the K-1 tokens before it on its path.
Almost every entry is the plain shift ``t - j - 1`` (the token before it in DFS order continues its chain);
only the first K-1 tokens of a node that does not follow its parent in DFS order read rows elsewhere.

* Forward: ``y[t] = bias + w[:, K-1] x[t] + sum_j w[:, K-2-j] x[conv_index[t, j]]`` as gathers that inductor
  fuses into one pointwise kernel with the activation (no gathered context tensor is materialised).
* Backward: the gradient of a gather is a scatter-add (colliding atomics over ``T x (K-1)`` rows: what made the
  torch op's backward slow).  Split per entry instead: an entry equal to ``t - j - 1`` sends its gradient to
  ``t - j - 1``, so those are shifted products of ``dy`` masked by "entry is the shift" (pointwise, fused);
  the other entries (the exceptions, a few per branching node) go through
  ``treecompile::tree_conv_context_grad``: an ``index_add`` over the exceptions alone, from a table made on
  the host once per batch (one copy of ``conv_index``, kept while the tensor is unchanged: every GDN layer of a
  step reuses it).  The weight and bias gradients are reductions inductor fuses with the rest.
  That is :func:`tree_causal_conv1d_shifts_inductor` (``conv_kernel="shifts_inductor"``).  Where Triton runs,
  :func:`tree_causal_conv1d_shifts` runs the same split as Triton kernels instead
  (``treecompile::tree_conv_shifts_backward``, ``ops.tree_conv_triton``: the pre-activation gradient written once
  rather than recomputed at every shifted row, the same exceptions table).

The split is per entry, so the result equals the torch op for every ``conv_index`` it accepts (any mix of shifts,
other rows and negative entries), not only for DFS trees.  H100, bf16, C = 6,144, 16k tokens, fwd+bwd
(benchmarks/bench_tree_conv.py): inductor's backward 3.9-4.2 ms, fla's varlen conv (``ops.fla_conv``, what ran before in
compiled graphs) 3.3-3.6, the Triton backward 2.7-2.8.  In the hybrid model's compiled step the shifted products fuse
with their neighbours and cost no host work per call: the agentic step 11.5 % faster than with fla's conv, a GPU-bound
32k synthetic step 2 % slower (Session 18), and 1.4 % faster again with the Triton backward (benchmarks/results/HISTORY.md, Session 19).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from treecompile.ops import tree_conv_triton
from treecompile.host_values import host_copy, to_device_async
from treecompile.ops.last_batch import LastBatch
from treecompile.ops.tree_conv import check_conv_args, silu_backward

__all__ = ["tree_causal_conv1d_shifts", "tree_causal_conv1d_shifts_inductor", "tree_conv_context_grad",
           "ContextExceptions", "context_exceptions", "prepare"]


@dataclass(frozen=True)
class ContextExceptions:
    """The entries of one ``conv_index [T, K-1]`` that are not the shift ``t - j - 1`` and not -1, on its device."""

    token: Tensor  # [E] the token t whose context the entry is
    column: Tensor  # [E] j: the entry's column (offset j + 1, weight column K-2-j)
    slot: Tensor  # [E] the row it reads, conv_index[t, j], as its place in ``sources``
    sources: Tensor  # [U] the distinct rows read, increasing
    # the same entries grouped by the row they read (for ``ops.tree_conv_triton``): source u's entries are
    # ``source_ptr[u]:source_ptr[u+1]`` of ``source_token``/``source_column``; ``source_slot [T]`` is u at row
    # ``sources[u]``, -1 at rows no exception reads
    source_ptr: Tensor  # [U + 1]
    source_token: Tensor  # [E]
    source_column: Tensor  # [E]
    source_slot: Tensor  # [T]


def context_exceptions(conv_index: Tensor) -> ContextExceptions:
    """:class:`ContextExceptions` of ``conv_index`` (one host copy of it; the tables go back without blocking)."""
    ci = host_copy(conv_index)
    T, k1 = ci.shape
    bad = ci >= T  # (a negative entry means "no context", as in the registered op)
    if bad.any():  # the kernels would read outside x: say where (the host copy is here anyway)
        t, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"conv_index[{t}, {j}] = {int(ci[t, j])} is past the last row {T - 1} (T = {T} tokens)")
    shift = torch.arange(T)[:, None] - torch.arange(1, k1 + 1)[None, :]
    token, column = ((ci >= 0) & (ci != shift)).nonzero(as_tuple=True)
    sources, slot = torch.unique(ci[token, column], return_inverse=True)
    slot = slot.reshape(-1)
    order = torch.argsort(slot, stable=True)
    ptr = torch.zeros(sources.numel() + 1, dtype=torch.long)
    ptr[1:] = torch.bincount(slot, minlength=sources.numel()).cumsum(0)
    source_slot = torch.full((T,), -1, dtype=torch.long)
    source_slot[sources] = torch.arange(sources.numel())
    dev = conv_index.device
    return ContextExceptions(*(to_device_async(t, dev) for t in (token, column, slot, sources, ptr, token[order],
                                                                column[order], source_slot)))


_EXCEPTIONS = LastBatch()  # the exceptions of the last batch's conv_index


def _cached_exceptions(conv_index: Tensor) -> ContextExceptions:
    return _EXCEPTIONS.get((conv_index,), None, lambda: context_exceptions(conv_index))


def prepare(conv_index: Tensor) -> None:
    """Make the exceptions table of the batch's ``conv_index`` now (``TreeProgram`` calls it before a step's graph
    runs, where the other host-side plans are made): otherwise the first conv backward makes it, and its copy of
    ``conv_index`` to the host would wait there for the whole forward to finish on the GPU."""
    _cached_exceptions(conv_index)


@torch.library.custom_op("treecompile::tree_conv_context_grad", mutates_args=())
def tree_conv_context_grad(dpre: Tensor, weight: Tensor, conv_index: Tensor) -> Tensor:
    """The part of a tree conv's input gradient that flows through ``conv_index``'s exceptions (entries that are
    neither the shift ``t - j - 1`` nor -1): ``dx[conv_index[t, j]] += dpre[:, t] * weight[:, K-2-j]`` for each of
    them, zero elsewhere.  ``dpre [B, T, C]`` (the pre-activation's gradient, row layout), ``weight [C, K]``;
    returns ``[B, T, C]`` in dpre's dtype.  A source read by several entries (a node's last tokens, read by the
    first tokens of each of its children) sums them in float32 (float64 stays) and is rounded once."""
    out = torch.zeros(dpre.shape, dtype=dpre.dtype, device=dpre.device)
    if conv_index.numel() == 0:
        return out
    exc = _cached_exceptions(conv_index)
    if exc.token.numel():
        K = weight.shape[1]
        acc_dtype = torch.promote_types(dpre.dtype, torch.float32)
        w_ctx = weight[:, :K - 1].flip(1).T.to(acc_dtype)  # [K-1, C], row j = weight[:, K-2-j]
        sent = dpre.index_select(1, exc.token).to(acc_dtype) * w_ctx.index_select(0, exc.column)
        acc = sent.new_zeros(dpre.shape[0], exc.sources.numel(), dpre.shape[2]).index_add_(1, exc.slot, sent)
        out.index_copy_(1, exc.sources, acc.to(dpre.dtype))
    return out


@tree_conv_context_grad.register_fake
def _(dpre, weight, conv_index):
    return dpre.new_empty(dpre.shape)


def _context(xt: Tensor, conv_index: Tensor, j: int) -> Tensor:
    """xt [B, T, C] -> the rows at ``conv_index[:, j]`` (zero where -1)."""
    idx = conv_index[:, j]
    rows = xt.index_select(1, idx.clamp(min=0))
    return torch.where((idx >= 0)[None, :, None], rows, rows.new_zeros(()))


def _contexts(xt: Tensor, conv_index: Tensor) -> list[Tensor]:
    """Column j of ``conv_index`` as rows of xt [B, T, C] (zero where -1), one tensor per column."""
    return [_context(xt, conv_index, j) for j in range(conv_index.shape[1])]


def _preact(xt: Tensor, weight: Tensor, bias: Optional[Tensor], ctxs: list[Tensor]) -> Tensor:
    """``bias + w[:, K-1] xt + sum_j w[:, K-2-j] ctxs[j]`` (ctxs: :func:`_contexts`)."""
    K = weight.shape[1]
    y = xt * weight[:, K - 1]
    for j, c in enumerate(ctxs):
        y = y + c * weight[:, K - 2 - j]
    return y + bias if bias is not None else y


class _TreeConvShifts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, conv_index, activation, triton_backward):
        ctx.save_for_backward(x, weight, bias, conv_index)
        ctx.activation = activation
        ctx.triton_backward = triton_backward
        xt = x.transpose(1, 2).to(weight.dtype)
        y = _preact(xt, weight, bias, _contexts(xt, conv_index))
        if activation is not None:
            y = F.silu(y)
        return y.to(x.dtype).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, conv_index = ctx.saved_tensors
        if ctx.triton_backward and tree_conv_triton.usable(x):
            dx, dw, dbias = tree_conv_triton.tree_conv_shifts_backward(
                grad.transpose(1, 2), x.transpose(1, 2), weight, bias, conv_index, ctx.activation is not None)
            return dx.transpose(1, 2), dw, dbias if bias is not None else None, None, None, None
        K, T = weight.shape[1], x.shape[2]
        xt = x.transpose(1, 2).to(weight.dtype)
        dpre = grad.transpose(1, 2).to(weight.dtype)  # [B, T, C]
        ctxs = _contexts(xt, conv_index)  # gathered once: the pre-activation and the weight gradient read them
        if ctx.activation is not None:
            dpre = silu_backward(dpre, _preact(xt, weight, bias, ctxs))
        dx = dpre * weight[:, K - 1]
        cols = [None] * K
        cols[K - 1] = (dpre * xt).sum((0, 1))
        pos = torch.arange(T, device=conv_index.device)
        for j in range(K - 1):
            shift = j + 1
            cols[K - 2 - j] = (dpre * ctxs[j]).sum((0, 1))
            # entries that are the shift send token t's gradient to t - shift
            is_shift = (conv_index[:, j] == pos - shift)[None, :, None]
            sent = torch.where(is_shift, dpre, dpre.new_zeros(())) * weight[:, K - 2 - j]
            dx = dx + F.pad(sent[:, shift:], (0, 0, 0, min(shift, T)))
        dx = dx + tree_conv_context_grad(dpre, weight, conv_index)
        dw = torch.stack(cols, 1)
        dbias = dpre.sum((0, 1)).to(bias.dtype) if bias is not None else None
        return dx.to(x.dtype).transpose(1, 2), dw, dbias, None, None, None


def tree_causal_conv1d_shifts(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor,
                              activation: Optional[str] = None) -> Tensor:
    """``treecompile::tree_causal_conv1d`` (``x [B, C, T]``, ``weight [C, K]``, ``conv_index [T, K-1]``) as
    shifted products (module docstring); returns ``[B, C, T]`` as the transpose of a ``[B, T, C]``.  Its backward
    is ``treecompile::tree_conv_shifts_backward`` (``ops.tree_conv_triton``) where Triton runs, else the traced
    shifted products of :func:`tree_causal_conv1d_shifts_inductor`."""
    check_conv_args(x, weight, bias, conv_index, activation)
    return _TreeConvShifts.apply(x, weight, bias, conv_index, activation, True)


def tree_causal_conv1d_shifts_inductor(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor,
                                       activation: Optional[str] = None) -> Tensor:
    """:func:`tree_causal_conv1d_shifts` with the backward traced as shifted products that inductor fuses (session
    18's; ``conv_kernel="shifts_inductor"``)."""
    check_conv_args(x, weight, bias, conv_index, activation)
    return _TreeConvShifts.apply(x, weight, bias, conv_index, activation, False)
