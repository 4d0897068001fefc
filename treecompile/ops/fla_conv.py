"""The tree's short convolution through flash-linear-attention's varlen ``causal_conv1d``:
``treecompile::tree_causal_conv1d_fla``, what ``lower_cuda`` puts in place of
``treecompile::tree_causal_conv1d`` when the GDN kernel is fla (same arguments, same result).

The torch op (:mod:`treecompile.ops.tree_conv`) gathers each token's K-1 path predecessors and scatter-adds
them back in the backward: on an H100 (bf16, C = 6,144, 32k tokens) its backward's ``index_add`` alone took
~4.6 ms per layer, ~10 % of a 24-layer hybrid step.  But along a chain of tokens each token's predecessors
are the tokens just before it, so the tree conv is an ordinary causal conv over *segments* (maximal runs
of consecutive tokens that continue one another), each started from an initial state that holds the K-1
rows its first token reads (``conv_index`` of that token; zero where -1).  fla's varlen kernel takes
exactly that: ``cu_seqlens`` and one ``initial_state [N, C, K]`` per segment, and returns the state's
gradient; the state is gathered from x and its gradient scatter-added back (N x (K-1) rows).

A token starts a new segment unless its ``conv_index`` row is its predecessor's shifted by one
(``conv_index[t] == [t-1, conv_index[t-1, :-1]]``): tree nodes, padding tokens and any other index
become segments of their own, so the result equals the torch op for every ``conv_index`` the torch op
accepts.  The segments are found on the host (one copy of ``conv_index`` per batch, cached while the
tensor is unchanged: every GDN layer of a step reuses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from treecompile.ops.fla_gdn import host_chunk_indices
from treecompile.host_values import host_copy, to_device_async
from treecompile.ops.last_batch import LastBatch
from treecompile.ops.tree_conv import check_conv_args, conv_setup_context

__all__ = ["tree_causal_conv1d_fla", "ConvSegments", "conv_segments", "prepare", "CHUNK_SIZE"]

CHUNK_SIZE = 64  # fla's default time tile of the conv kernels (forward and backward must agree)


@dataclass(frozen=True)
class ConvSegments:
    """The varlen view of one ``conv_index`` over ``B`` batch rows flattened to ``B * T`` rows."""

    cu_seqlens: Tensor  # [N + 1] int64 on the device
    cu_seqlens_cpu: Tensor  # the same on the host
    chunk_indices: Tensor  # [NT, 2] (segment, chunk within it), as fla's prepare_chunk_indices builds them
    context: Tensor  # [N, K-1] flattened row each segment's first token reads at offset j + 1 (0 where none)
    valid: Tensor  # [N, K-1] 1 where context is a real row, 0 where the path has none (x's dtype set on use)


def _segment_starts(ci: Tensor) -> Tensor:
    """Host: bool [T], True where a token does not continue the token before it (see module docstring)."""
    T = ci.shape[0]
    starts = torch.ones(T, dtype=torch.bool)
    if ci.shape[1] == 0:  # kernel size 1: no context, every token continues the one before it
        starts[1:] = False
    elif T > 1:
        cont = ci[1:, 0] == torch.arange(T - 1)
        if ci.shape[1] > 1:
            cont &= (ci[1:, 1:] == ci[:-1, :-1]).all(1)
        starts[1:] = ~cont
    return starts


def conv_segments(conv_index: Tensor, batch: int, chunk_size: int = CHUNK_SIZE) -> ConvSegments:
    """Segments of ``conv_index [T, K-1]`` for ``batch`` rows sharing it (read on the host: no device copy for a
    moved batch's own tensor, :func:`treecompile.host_values.host_copy`)."""
    ci = host_copy(conv_index)
    T, k1 = ci.shape
    dev = conv_index.device
    if T == 0 or batch == 0:  # no rows: no segments
        z = torch.zeros(1, dtype=torch.long)
        return ConvSegments(cu_seqlens=z.to(dev), cu_seqlens_cpu=z, chunk_indices=z.new_zeros(0, 2).to(dev),
                            context=z.new_zeros(0, k1).to(dev), valid=torch.zeros(0, k1, dtype=torch.bool, device=dev))
    first = _segment_starts(ci).nonzero().flatten()
    ends = torch.cat([first[1:], torch.tensor([T])])
    lengths = (ends - first).tolist()
    offs = torch.arange(batch)[:, None].expand(-1, len(first)).reshape(-1) * T  # segment n of batch row b: rows + b * T
    starts = first.repeat(batch) + offs
    cu = torch.cat([starts, torch.tensor([batch * T])])
    ctx = ci[first].repeat(batch, 1)
    valid = ctx >= 0
    ctx = torch.where(valid, ctx + offs[:, None], torch.zeros_like(ctx))
    return ConvSegments(cu_seqlens=to_device_async(cu, dev), cu_seqlens_cpu=cu,
                        chunk_indices=to_device_async(host_chunk_indices(lengths * batch, chunk_size), dev),
                        context=to_device_async(ctx, dev), valid=to_device_async(valid, dev))


_SEGMENTS = LastBatch()  # the segments of the last batch: every GDN layer's conv of a step reads the same index


def _cached_segments(conv_index: Tensor, batch: int) -> ConvSegments:
    return _SEGMENTS.get((conv_index,), batch, lambda: conv_segments(conv_index, batch))


def prepare(conv_index: Tensor, batch: int) -> None:
    """Build now, and keep, the segments the op will read for ``batch`` rows sharing ``conv_index``: its next call
    with the same tensor, unchanged, finds them (``lower_cuda.prepare_plans``, for ``TreeModel.prepare``)."""
    _cached_segments(conv_index, batch)


def _fla():
    try:
        from fla.modules.causal_conv1d import causal_conv1d_bwd, causal_conv1d_fwd
    except ImportError as e:
        raise ImportError("tree_causal_conv1d_fla needs flash-linear-attention (pip install 'treecompile[gpu]')") from e
    return causal_conv1d_fwd, causal_conv1d_bwd


def _initial_state(x1: Tensor, seg: ConvSegments, K: int) -> Tensor:
    """x1 [1, R, C] -> [N, C, K]: column K-1-j holds the row at offset j + 1 before the segment (column 0 unused)."""
    N, C = seg.context.shape[0], x1.shape[-1]
    rows = x1[0].index_select(0, seg.context.reshape(-1)).view(N, K - 1, C) * seg.valid[..., None].to(x1.dtype)
    state = x1.new_zeros(N, K, C)
    state[:, 1:] = rows.flip(1)
    return state.transpose(1, 2).contiguous()


def _flat(x: Tensor, dtype) -> Tensor:
    """[B, C, T] -> [1, B * T, C] in ``dtype`` (a view when x is the transpose of a contiguous [B, T, C])."""
    B, C, T = x.shape
    return x.transpose(1, 2).to(dtype).reshape(1, B * T, C)


@torch.library.custom_op("treecompile::tree_causal_conv1d_fla", mutates_args=())
def tree_causal_conv1d_fla(x: Tensor, weight: Tensor, bias: Optional[Tensor], conv_index: Tensor,
                           activation: Optional[str] = None) -> Tensor:
    """``treecompile::tree_causal_conv1d`` through fla's varlen conv (module docstring).  Returns ``[B, C, T]``
    as the transpose of a contiguous ``[B, T, C]`` (the layout the GDN layer reads next)."""
    check_conv_args(x, weight, bias, conv_index, activation)
    B, C, T = x.shape
    K = weight.shape[1]
    if B * T == 0:
        return x.new_empty(B, T, C).transpose(1, 2)
    fwd, _ = _fla()
    seg = _cached_segments(conv_index, B)
    x1 = _flat(x, weight.dtype)
    out, _ = fwd(x=x1, weight=weight, bias=bias, residual=None, initial_state=_initial_state(x1, seg, K),
                 output_final_state=False, activation=activation, cu_seqlens=seg.cu_seqlens,
                 cu_seqlens_cpu=seg.cu_seqlens_cpu, chunk_indices=seg.chunk_indices, chunk_size=CHUNK_SIZE)
    return out.view(B, T, C).to(x.dtype).transpose(1, 2)


@tree_causal_conv1d_fla.register_fake
def _(x, weight, bias, conv_index, activation=None):
    check_conv_args(x, weight, bias, conv_index, activation)
    B, C, T = x.shape
    return x.new_empty(B, T, C).transpose(1, 2)


@torch.library.custom_op("treecompile::tree_causal_conv1d_fla_backward", mutates_args=())
def tree_causal_conv1d_fla_backward(grad: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                                    conv_index: Tensor, activation: Optional[str] = None
                                    ) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` of :func:`tree_causal_conv1d_fla` (dbias zeros without a bias); an op of its own
    so that a compiled graph's backward calls it as it is (fla's kernels and the host-side segments are not
    traceable)."""
    B, C, T = x.shape
    K = weight.shape[1]
    if B * T == 0:
        return torch.zeros_like(x), torch.zeros_like(weight), weight.new_zeros(C)
    _, bwd = _fla()
    seg = _cached_segments(conv_index, B)
    x1 = _flat(x, weight.dtype)
    dy = _flat(grad, weight.dtype)
    state = _initial_state(x1, seg, K)
    dx, dw, db, _, dstate = bwd(x=x1, dy=dy, dht=None, weight=weight, bias=bias, residual=None,
                                initial_state=state, activation=activation, cu_seqlens=seg.cu_seqlens,
                                cu_seqlens_cpu=seg.cu_seqlens_cpu, chunk_indices=seg.chunk_indices,
                                chunk_size=CHUNK_SIZE)
    # the state's rows came from x: their gradient goes back to those rows (column K-1-j <- offset j + 1)
    drows = dstate[:, :, 1:].flip(2).transpose(1, 2) * seg.valid[..., None].to(dstate.dtype)  # [N, K-1, C]
    dx = dx.reshape(B * T, C).index_add(0, seg.context.reshape(-1), drows.reshape(-1, C).to(dx.dtype))
    dbias = db.to(weight.dtype) if db is not None else weight.new_zeros(C)
    return dx.view(B, T, C).to(x.dtype).transpose(1, 2), dw.to(weight.dtype), dbias


@tree_causal_conv1d_fla_backward.register_fake
def _(grad, x, weight, bias, conv_index, activation=None):
    B, C, T = x.shape
    return x.new_empty(B, T, C).transpose(1, 2), torch.empty_like(weight), weight.new_empty(C)


def _backward(ctx, grad):
    x, weight, bias, conv_index = ctx.saved_tensors
    dx, dw, db = tree_causal_conv1d_fla_backward(grad, x, weight, bias, conv_index, ctx.activation)
    return dx, dw, None if bias is None else db.to(bias.dtype), None, None


tree_causal_conv1d_fla.register_autograd(_backward, setup_context=conv_setup_context)
