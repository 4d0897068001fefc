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

One program per tile of a run and block of channels.  Which block width, program order and warp count
(:data:`CONFIGS`) is Triton's autotuner's choice on the GPU, timed at the first call for each channel count; every
config sums in the same order, so the values do not depend on it.  (Added in session 38 without a GPU to time
it: the first config is the kernel as it was, so the choice matches or beats it within the timing's noise; if the
autotuner fails, every call runs that first config, with one warning.)

Where Triton cannot run (CPU without ``TRITON_INTERPRET=1``) :func:`sum_copies` falls back to ``index_add_`` with
the same float32/float64 accumulation: the same sums, possibly in another order.

Grouped-query K/V expanded to the query heads (``varlen_tree_attention.KV_HEADS``: "auto" expands groups of two):
:func:`gather_keys` gathers the rows with each kv head repeated for its query heads (one kernel, each source row
read once), and ``sum_copies(rep=)`` sums a group's heads with the copies in the same accumulator.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from treecompile.host_values import group_index, to_device_async
# triton is None on CPU-only installs: sum_copies then uses index_add_
from treecompile.ops.triton_support import available, interpreting, tl, triton, usable

__all__ = ["CopyRuns", "available", "copy_runs", "copy_run_tables", "gather_keys", "sum_copies",
           "sum_copies_index_add", "usable", "CONFIGS"]

BLOCK_T = 64  # tokens per program (a run is cut into tiles of at most this many)
# The kernel's configs, (channels per program, column blocks of one tile on consecutive programs, warps), among
# which Triton's autotuner picks per channel count on the GPU (at the first call, by timing them).  The first is the
# only config before session 38: one column block of consecutive tiles on consecutive programs, 128 channels, 4 warps.
# Session 38's profile had it at 52 % of an H200's memory bandwidth (2.48 TB/s; Qwen3-0.6B at 16k tree tokens,
# `benchmarks/results/h200_s38/`): neighbouring programs read 256-byte pieces of rows 2 KiB apart.  With the
# column blocks of a tile on consecutive programs, neighbours read whole rows between them.
_TUNING_FAILED: list[str] = []  # why the autotuner failed in this process (then every call runs CONFIGS[0])
CONFIGS = ((128, False, 4), (128, True, 4), (128, True, 8), (256, True, 8), (256, True, 4), (256, False, 8))


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
    tiles, offsets, tokens, rows = copy_run_tables(lo, hi, first)
    return CopyRuns(tiles=to_device_async(tiles, device), offsets=to_device_async(offsets, device), tokens=tokens,
                    rows=rows)


def copy_run_tables(lo: Tensor, hi: Tensor, first: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """:func:`copy_runs`' tables on the host, ``(tiles, offsets, tokens, rows)`` (a caller that sends several
    tables to the device in one copy builds its :class:`CopyRuns` from them)."""
    lo, hi, first = (x.to("cpu", torch.int64) for x in (lo, hi, first))
    keep = hi > lo
    if not bool(keep.all()):
        lo, hi, first = lo[keep], hi[keep], first[keep]
    if not lo.numel():
        return torch.zeros((0, 4), dtype=torch.int64), lo.new_zeros(0), 0, 0
    m = lo.numel()
    # sorted run boundaries, from token 0 (lo, hi, then 0)
    bounds, where = torch.unique(torch.cat([lo, hi, lo.new_zeros(1)]), return_inverse=True)
    tokens, runs = int(bounds[-1]), bounds.numel() - 1
    r0 = where[:m]
    n_cover = where[m:2 * m].sub_(r0)  # interval m covers runs [r0, r0 + n_cover)
    ends = n_cover.cumsum(0)
    entries = int(ends[-1])  # (interval, run) pairs
    interval = group_index(ends, entries)  # each entry's interval, in interval order
    entry_run = torch.arange(entries).add_((r0 - ends + n_cover).index_select(0, interval))
    order = torch.sort(entry_run, stable=True).indices  # by run; within a run, interval order
    offsets = (first - lo).index_select(0, interval.index_select(0, order))
    ptr = torch.zeros(runs + 1, dtype=torch.int64)  # run r's offsets are entries [ptr[r], ptr[r + 1])
    torch.cumsum(torch.bincount(entry_run, minlength=runs), 0, out=ptr[1:])
    run_lo, run_hi = bounds[:-1], bounds[1:]
    per = (run_hi - run_lo).add_(BLOCK_T - 1).div_(BLOCK_T, rounding_mode="floor")  # tiles per run
    tile_end = per.cumsum(0)
    n_tiles = int(tile_end[-1])
    tile_run = group_index(tile_end, n_tiles)
    t_lo = torch.arange(n_tiles).sub_((tile_end - per).index_select(0, tile_run)).mul_(BLOCK_T)
    t_lo += run_lo.index_select(0, tile_run)
    t_hi = torch.minimum(t_lo + BLOCK_T, run_hi.index_select(0, tile_run))
    tiles = torch.stack([t_lo, t_hi, ptr.index_select(0, tile_run), ptr.index_select(0, tile_run + 1)], 1)
    return tiles, offsets, tokens, int((hi - lo).sum())


if triton is not None:

    @triton.jit(do_not_specialize=["n_tiles"])  # a count that changes with every batch: one compiled kernel
    def _sum_copies_kernel(src_ptr, out_ptr, tiles_ptr, off_ptr, C, n_tiles, SC, D, ACC: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, COLS_FIRST: tl.constexpr,
                           REP: tl.constexpr = 1):
        """out[t] = sum over the run's offsets of src[t + off] (ACC), for the tile's tokens x BLOCK_C channels.
        One program per (tile, column block), on a 1-D grid: ``COLS_FIRST``, the column blocks of one tile on
        consecutive programs; else one column block of consecutive tiles.  ``REP`` > 1: a source row holds
        ``REP`` heads of ``D`` channels for each output head (``SC = REP * C`` channels; the key/value rows
        expanded to the query heads), summed too: out[t, h, d] = the sum of src[t + off, h * REP + p, d] over the
        copies (in interval order) and, within each copy, over p."""
        pid = tl.program_id(0).to(tl.int64)
        n_cblk = tl.cdiv(C, BLOCK_C)
        if COLS_FIRST:
            tile = pid // n_cblk
            cblk = pid % n_cblk
        else:
            tile = pid % n_tiles
            cblk = pid // n_tiles
        cols = cblk * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        if REP == 1:
            scols = cols
        else:  # output channel h * D + d reads source channels (h * REP + p) * D + d
            scols = (cols // D) * (REP * D) + cols % D
        t0 = tl.load(tiles_ptr + tile * 4)
        t1 = tl.load(tiles_ptr + tile * 4 + 1)
        e0 = tl.load(tiles_ptr + tile * 4 + 2)
        e1 = tl.load(tiles_ptr + tile * 4 + 3)
        rows = t0 + tl.arange(0, BLOCK_T)
        m2 = (rows < t1)[:, None] & cmask[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), ACC)
        for e in range(e0, e1):
            off = tl.load(off_ptr + e)
            base = src_ptr + (rows + off)[:, None] * SC
            for p in tl.static_range(REP):
                acc += tl.load(base + (scols + p * D)[None, :], mask=m2, other=0.0).to(ACC)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _gather_keys_kernel(src_ptr, idx_ptr, out_ptr, G, D, s_t, s_h, REP: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_D: tl.constexpr):
        """out[g, h * REP + p] = src[idx[g], h] for p < REP: one program per block of rows and kv head ``h``, each
        source row read once and written REP times (out contiguous ``[G, Hkv * REP, D]``)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        h = tl.program_id(1).to(tl.int64)
        H = tl.num_programs(1).to(tl.int64) * REP
        d = tl.arange(0, BLOCK_D)
        m = (rows < G)[:, None] & (d < D)[None, :]
        tok = tl.load(idx_ptr + rows, mask=rows < G, other=0).to(tl.int64)
        x = tl.load(src_ptr + tok[:, None] * s_t + h * s_h + d[None, :], mask=m)
        for p in tl.static_range(REP):
            tl.store(out_ptr + rows[:, None] * (H * D) + (h * REP + p) * D + d[None, :], x, mask=m)

    def _bench(kernel_call, quantiles):  # the autotuner's timing: short (the step's first backward waits for it)
        return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)

    # every config writes the same sums (each token's copies in interval order, rounded once): the autotuner's
    # repeated launches only overwrite ``out`` with the same values
    _sum_copies_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_C": c, "COLS_FIRST": f}, num_warps=w) for c, f, w in CONFIGS],
        key=["C", "SC"], do_bench=_bench)(_sum_copies_kernel)


GATHER_BLOCK_G = 32  # rows per program of the expanded gather


def gather_keys(src: Tensor, index: Tensor, rep: int = 1) -> Tensor:
    """The gathered key/value rows: ``src [T, Hkv, D]`` -> ``[G, Hkv * rep, D]`` with ``out[g, h * rep + p] =
    src[index[g], h]`` (``index [G]`` int64): each kv head repeated for the ``rep`` query heads of its group, so a
    kernel reads them as plain multi-head keys.  ``rep`` 1: ``index_select``.  One Triton kernel where it runs (each
    source row read once); else ``index_select`` then one copy of the broadcast rows."""
    if index.dim() != 1:
        raise ValueError(f"gather_keys: index must be 1-D, got shape {tuple(index.shape)}")
    if rep == 1:
        return src.index_select(0, index)
    if rep < 1 or src.dim() != 3:
        raise ValueError(f"gather_keys: rep {rep} needs src [T, Hkv, D], got {tuple(src.shape)}")
    index = index.to(torch.int64).contiguous()  # the kernel reads it as a dense int64 vector
    G, (_, Hkv, D) = index.numel(), src.shape
    if not usable(src) or src.stride(-1) != 1:
        return src.index_select(0, index)[:, :, None].expand(G, Hkv, rep, D).reshape(G, Hkv * rep, D)
    out = torch.empty((G, Hkv * rep, D), dtype=src.dtype, device=src.device)
    if G and Hkv and D:
        _gather_keys_kernel[(triton.cdiv(G, GATHER_BLOCK_G), Hkv)](
            src, index, out, G, D, src.stride(0), src.stride(1), REP=rep, BLOCK_G=GATHER_BLOCK_G,
            BLOCK_D=triton.next_power_of_2(D))
    return out


def sum_copies_index_add(src: Tensor, key_index: Tensor, T: int, rep: int = 1) -> Tensor:
    """:func:`sum_copies` by ``index_add_`` into a zeroed float32 (float64) buffer, then rounded: where Triton cannot
    run, and the way the op summed before its kernel (``bench_fa4_attention``'s ``fa4_varlen_index_add``).
    ``rep``: as :func:`sum_copies`' (the head groups summed in the same buffer before the rounding)."""
    acc_dtype = torch.promote_types(src.dtype, torch.float32)
    acc = torch.zeros((T,) + tuple(src.shape[1:]), dtype=acc_dtype, device=src.device)
    acc.index_add_(0, key_index, src.to(acc_dtype))
    if rep > 1:
        acc = acc.unflatten(1, (src.shape[1] // rep, rep)).sum(2)
    return acc.to(src.dtype)


def _kernel_args(src: Tensor, out: Tensor, runs: CopyRuns, C: int, rep: int) -> tuple:
    """``_sum_copies_kernel``'s positional arguments: ``C`` output channels, the source rows' ``SC = C * rep``
    channels and (``rep`` > 1) their head dim ``D``."""
    return src, out, runs.tiles, runs.offsets, C, runs.tiles.shape[0], C * rep, src.shape[-1] if rep > 1 else 1


def _launch_tuned(src: Tensor, out: Tensor, runs: CopyRuns, C: int, acc, rep: int = 1) -> None:
    """The kernel under the autotuner's config for ``C`` output channels (and ``rep``: :func:`sum_copies`'), timed
    at the first call with those channel counts."""
    n_tiles = runs.tiles.shape[0]
    _sum_copies_tuned[lambda meta: (n_tiles * triton.cdiv(C, meta["BLOCK_C"]),)](
        *_kernel_args(src, out, runs, C, rep), ACC=acc, BLOCK_T=BLOCK_T, REP=rep)


def sum_copies(src: Tensor, runs: CopyRuns, key_index: Tensor, T: int, config: tuple | None = None, *,
               zero_tail: bool = True, rep: int = 1) -> Tensor:
    """``out [T, ...]`` in ``src``'s dtype: ``out[t]`` = the sum of ``src[g]`` over the gathered rows ``g`` with
    ``key_index[g] == t`` (``src [G, ...]``), accumulated in float32 (float64 for float64) and rounded once; rows the
    runs do not cover (``t >= runs.tokens``: the plan's tail) are zero, or, with ``zero_tail=False``, left for the
    caller to write (uninitialised where the kernel runs).  ``rep`` > 1: ``src [G, Hkv * rep, D]`` holds each kv
    head's ``rep`` query heads (the rows :func:`gather_keys` expanded), summed into ``out [T, Hkv, D]`` in the same
    accumulator.  ``config``: one of :data:`CONFIGS` (tests, benchmarks); None: the autotuner's pick on CUDA, the
    first config under Triton's interpreter (no timing there).  Every config gives the same values."""
    G = src.shape[0]
    if G != runs.rows or key_index.numel() != G:
        raise ValueError(f"sum_copies: {G} gathered rows, the runs read {runs.rows} and key_index has "
                         f"{key_index.numel()}")
    if rep < 1 or (rep > 1 and (src.dim() != 3 or src.shape[1] % rep)):
        raise ValueError(f"sum_copies: rep {rep} needs src [G, heads, D] with heads a multiple of it, got "
                         f"{tuple(src.shape)}")
    if not usable(src):
        return sum_copies_index_add(src, key_index, T, rep)
    acc_dtype = torch.promote_types(src.dtype, torch.float32)
    out_shape = (T, src.shape[1] // rep, *src.shape[2:])
    out = torch.empty(out_shape, dtype=src.dtype, device=src.device)
    if runs.tokens < T and zero_tail:
        out[runs.tokens:] = 0
    if config is not None and config not in CONFIGS:
        raise ValueError(f"sum_copies: config {config!r} is not one of {CONFIGS}")
    C = math.prod(out_shape[1:]) if G else 0
    if G and C:
        src = src.contiguous()
        n_tiles = runs.tiles.shape[0]
        acc = tl.float64 if acc_dtype == torch.float64 else tl.float32
        if config is None and not interpreting() and not _TUNING_FAILED and _tuned(src, out, runs, C, acc, rep):
            return out
        block_c, cols_first, warps = config or CONFIGS[0]  # the interpreter has no clock to tune by
        _sum_copies_kernel[(n_tiles * triton.cdiv(C, block_c),)](
            *_kernel_args(src, out, runs, C, rep), ACC=acc, BLOCK_T=BLOCK_T, BLOCK_C=block_c,
            COLS_FIRST=cols_first, REP=rep, num_warps=warps)
    return out


def _tuned(src: Tensor, out: Tensor, runs: CopyRuns, C: int, acc, rep: int = 1) -> bool:
    """:func:`_launch_tuned`; False, with one warning per process, where the autotuner fails (its timing's buffers
    on a full device, a config that cannot launch): the caller then runs the first config, as every later call."""
    try:
        _launch_tuned(src, out, runs, C, acc, rep)
        return True
    except (torch.OutOfMemoryError, RuntimeError) as e:
        _TUNING_FAILED.append(repr(e))
        warnings.warn(f"treecompile: the key copies' kernel could not be autotuned ({e!r}); it runs its first "
                      f"config {CONFIGS[0]} from now on", stacklevel=3)
        return False
