"""The key/value gradients of the varlen tree attention's gathered copies, summed per token (one Triton kernel).

The segments of :mod:`treecompile.ops.varlen_tree_attention` read each key row once per segment that sees it: the
gathered rows are a concatenation of intervals of the sequence (``key_index``: row ``first_m + i`` reads token
``lo_m + i``).  The kernel's key/value gradients come back per gathered row (``[G, Hkv, D]``); each token's gradient
is the sum over its copies.  ``index_add_`` into a zeroed float32 buffer did that in four passes over memory (a
float32 copy of the ``G`` rows, the zero fill, the read-modify-write of every copy, the rounding back), about 1 ms
per layer of a 32k-token tree on an H100.  Here the sequence is cut at every interval's ends into **runs** of tokens
that all have the same copies (the same intervals cover them), so token ``t`` of run ``r`` sums ``src[t + off]``
over the run's offsets ``off = first_m - lo_m``: contiguous rows, read once, summed in float32 (float64 for float64
inputs) in interval order (root first) and rounded once.  The runs (:class:`CopyRuns`) are built on the host with
the segment plan, once per batch.

Where Triton cannot run (CPU without ``TRITON_INTERPRET=1``) :func:`sum_copies` falls back to ``index_add_`` with
the same float32/float64 accumulation: the same sums, possibly in another order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from treecompile.host_values import to_device_async
# triton is None on CPU-only installs: sum_copies then uses index_add_
from treecompile.ops.triton_support import available, tl, triton, usable

__all__ = ["CopyRuns", "available", "copy_runs", "sum_copies", "sum_copies_index_add", "usable"]

BLOCK_T = 64  # tokens per program (a run is cut into tiles of at most this many)
BLOCK_C = 128  # channels (Hkv * D flattened) per program


@dataclass(frozen=True)
class CopyRuns:
    """Runs of tokens with the same copies, cut into tiles of at most ``BLOCK_T`` tokens (module docstring)."""

    tiles: Tensor  # [n_tiles, 4] int64, device: (first token, end token, first offset entry, end offset entry)
    offsets: Tensor  # [E] int64, device: gathered row - token, per run (CSR through tiles' entry columns)
    tokens: int  # the runs cover tokens [0, tokens)
    rows: int  # G: the gathered rows they read


def copy_runs(lo: Tensor, hi: Tensor, first: Tensor, device) -> CopyRuns:
    """The runs of the gathered layout whose interval ``m`` copies tokens ``[lo[m], hi[m])`` to rows
    ``[first[m], first[m] + hi[m] - lo[m])`` (host int64 tensors, the intervals covering ``[0, max(hi))``, each
    gathered row in exactly one interval).  Runs: the tokens between consecutive interval ends; a run's offsets
    are those of the intervals covering it, in interval order."""
    lo, hi, first = (x.to("cpu", torch.int64) for x in (lo, hi, first))
    keep = hi > lo
    lo, hi, first = lo[keep], hi[keep], first[keep]
    tokens = int(hi.max()) if hi.numel() else 0
    rows = int((hi - lo).sum())
    bounds = torch.unique(torch.cat([lo, hi, torch.tensor([0, tokens])]))  # sorted run boundaries
    r0 = torch.searchsorted(bounds, lo)
    r1 = torch.searchsorted(bounds, hi)  # interval m covers runs [r0, r1)
    n_cover = r1 - r0
    start = torch.cumsum(n_cover, 0) - n_cover
    entry_run = torch.repeat_interleave(r0 - start, n_cover) + torch.arange(int(n_cover.sum()))
    entry_off = torch.repeat_interleave(first - lo, n_cover)
    order = torch.sort(entry_run, stable=True).indices  # by run; within a run, interval order
    offsets = entry_off[order]
    n_runs = bounds.numel() - 1
    ptr = torch.zeros(n_runs + 1, dtype=torch.int64)
    torch.cumsum(torch.bincount(entry_run, minlength=n_runs), 0, out=ptr[1:])
    run_lo, run_hi = bounds[:-1], bounds[1:]
    per = (run_hi - run_lo + BLOCK_T - 1) // BLOCK_T  # tiles per run
    tile_run = torch.repeat_interleave(torch.arange(n_runs), per)
    tile_first = torch.cumsum(per, 0) - per
    t_lo = run_lo[tile_run] + (torch.arange(int(per.sum())) - tile_first[tile_run]) * BLOCK_T
    t_hi = torch.minimum(t_lo + BLOCK_T, run_hi[tile_run])
    tiles = torch.stack([t_lo, t_hi, ptr[:-1][tile_run], ptr[1:][tile_run]], 1)
    return CopyRuns(tiles=to_device_async(tiles, device), offsets=to_device_async(offsets, device), tokens=tokens,
                    rows=rows)


if triton is not None:

    @triton.jit
    def _sum_copies_kernel(src_ptr, out_ptr, tiles_ptr, off_ptr, C, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_C: tl.constexpr):
        """out[t] = sum over the run's offsets of src[t + off] (ACC), for the tile's tokens x BLOCK_C channels."""
        tile = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        t0 = tl.load(tiles_ptr + tile * 4)
        t1 = tl.load(tiles_ptr + tile * 4 + 1)
        e0 = tl.load(tiles_ptr + tile * 4 + 2)
        e1 = tl.load(tiles_ptr + tile * 4 + 3)
        rows = t0 + tl.arange(0, BLOCK_T)
        m2 = (rows < t1)[:, None] & cmask[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), ACC)
        for e in range(e0, e1):
            off = tl.load(off_ptr + e)
            acc += tl.load(src_ptr + (rows + off)[:, None] * C + cols[None, :], mask=m2, other=0.0).to(ACC)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m2)


def sum_copies_index_add(src: Tensor, key_index: Tensor, T: int) -> Tensor:
    """:func:`sum_copies` by ``index_add_`` into a zeroed float32 (float64) buffer, then rounded: where Triton cannot
    run, and the way the op summed before its kernel (``bench_fa4_attention``'s ``fa4_varlen_index_add``)."""
    acc_dtype = torch.promote_types(src.dtype, torch.float32)
    acc = torch.zeros((T,) + tuple(src.shape[1:]), dtype=acc_dtype, device=src.device)
    return acc.index_add_(0, key_index, src.to(acc_dtype)).to(src.dtype)


def sum_copies(src: Tensor, runs: CopyRuns, key_index: Tensor, T: int) -> Tensor:
    """``out [T, ...]`` in ``src``'s dtype: ``out[t]`` = the sum of ``src[g]`` over the gathered rows ``g`` with
    ``key_index[g] == t`` (``src [G, ...]``), accumulated in float32 (float64 for float64) and rounded once; rows the
    runs do not cover (``t >= runs.tokens``: the plan's tail) are zero."""
    G = src.shape[0]
    if G != runs.rows or key_index.numel() != G:
        raise ValueError(f"sum_copies: {G} gathered rows, the runs read {runs.rows} and key_index has "
                         f"{key_index.numel()}")
    if not usable(src):
        return sum_copies_index_add(src, key_index, T)
    acc_dtype = torch.promote_types(src.dtype, torch.float32)
    out = torch.empty((T,) + tuple(src.shape[1:]), dtype=src.dtype, device=src.device)
    if runs.tokens < T:
        out[runs.tokens:] = 0
    C = src[0].numel() if G else 0
    if G and C:
        src = src.contiguous()
        grid = (runs.tiles.shape[0], triton.cdiv(C, BLOCK_C))
        _sum_copies_kernel[grid](src, out, runs.tiles, runs.offsets, C,
                                 ACC=tl.float64 if acc_dtype == torch.float64 else tl.float32,
                                 BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
    return out
