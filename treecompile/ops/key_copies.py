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

One program per tile of a run (at most ``BLOCK_T`` tokens) and block of channels; a program finds its run by a
binary search over the runs' running tile counts, so the host sends one row per run, not per tile (session 54: the
tiles' expansion was about 13 of a 64k plan's 100 host tensor ops; session 55 timed the kernel with its search at
0.084 ms a layer on parallel-tools' plan, as without it, ``benchmarks/results/h200_s55``).  Which block width,
program order and warp count (:data:`CONFIGS`) is Triton's autotuner's choice on the GPU, timed at the first call
for each channel count; every config sums in the same order, so the values do not depend on it.  (Added in
session 38 without a GPU to time it: the first config is the kernel as it was, so the choice matches or beats it
within the timing's noise; if the autotuner fails, every call runs that first config, with one warning.)

Where Triton cannot run (CPU without ``TRITON_INTERPRET=1``) :func:`sum_copies` falls back to ``index_add_`` with
the same float32/float64 accumulation: the same sums, possibly in another order.

Grouped-query K/V expanded to the query heads (``varlen_tree_attention.KV_HEADS``: "auto" expands groups of two):
:func:`gather_keys` gathers the rows with each kv head repeated for its query heads (one kernel, each source row
read once; :func:`gather_key_values`, the keys and the values in one launch), and ``sum_copies(rep=)`` sums a group's
heads with the copies in the same accumulator.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from itertools import accumulate, chain

import torch
from torch import Tensor

from treecompile.host_values import to_device_tables
# triton is None on CPU-only installs: sum_copies then uses index_add_
from treecompile.ops.triton_support import available, interpreting, tl, triton, usable

__all__ = ["CopyRuns", "available", "copy_runs", "copy_run_lists", "gather_key_values", "gather_keys", "sum_copies",
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

    # [R, 5] int64, device, per run: (its first token less BLOCK_T times its first tile's index, its end token, its
    # first and end offset entries, the tiles of the runs up to and including it)
    runs: Tensor
    offsets: Tensor  # [E] int64, device: gathered row - token, per run (CSR through the runs' entry columns)
    tokens: int  # the runs cover tokens [0, tokens)
    rows: int  # G: the gathered rows they read
    n_tiles: int  # the runs' tiles: the kernel's programs per column block

    def tiles(self) -> Tensor:
        """``[n_tiles, 4]`` int64 on the host: each tile's (first token, end token, first and end offset entry), as
        the kernel finds them (tests, introspection)."""
        runs = self.runs.cpu()
        r = torch.searchsorted(runs[:, 4].contiguous(), torch.arange(self.n_tiles), right=True)  # each tile's run
        t0 = runs[r, 0] + BLOCK_T * torch.arange(self.n_tiles)
        return torch.stack([t0, torch.minimum(t0 + BLOCK_T, runs[r, 1]), runs[r, 2], runs[r, 3]], 1)


def copy_runs(lo: Tensor, hi: Tensor, first: Tensor, device) -> CopyRuns:
    """The runs of the gathered layout whose interval ``m`` copies tokens ``[lo[m], hi[m])`` to rows
    ``[first[m], first[m] + hi[m] - lo[m])`` (host int64 tensors, the intervals covering ``[0, max(hi))``, each
    gathered row in exactly one interval).  Runs: the tokens between consecutive interval ends; a run's offsets
    are those of the intervals covering it, in interval order."""
    runs, offsets, tokens, rows, n_tiles = copy_run_lists(lo, hi, first)
    runs, offsets = to_device_tables((runs, offsets), device)
    return CopyRuns(runs=runs.view(-1, 5), offsets=offsets, tokens=tokens, rows=rows, n_tiles=n_tiles)


def copy_run_lists(lo, hi, first) -> tuple[list, list, int, int, int]:
    """:func:`copy_runs`' tables on the host as lists, ``(runs, offsets, tokens, rows, n_tiles)`` (``runs``: the
    :class:`CopyRuns` table's rows one after the other), from host tensors or lists of ints ``lo``, ``hi``,
    ``first``; a caller that sends several tables to the device in one copy (``host_values.to_device_tables``)
    builds its :class:`CopyRuns` from them.  Python over the intervals and runs (a plan has a few hundred of each,
    where a tensor op costs 3-7 us of dispatch on the host whatever its size)."""
    lo, hi, first = (x.tolist() if isinstance(x, Tensor) else x for x in (lo, hi, first))
    kept = [(a, b, f - a) for a, b, f in zip(lo, hi, first) if b > a]  # (lo, hi, offset) of each non-empty interval
    if not kept:
        return [], [], 0, 0, 0
    bounds = sorted({0, *(a for a, _, _ in kept), *(b for _, b, _ in kept)})  # run boundaries, from token 0
    run_at = {x: r for r, x in enumerate(bounds)}
    per_run: list[list[int]] = [[] for _ in range(len(bounds) - 1)]  # each run's offsets, in interval order
    for a, b, off in kept:
        for offs in per_run[run_at[a]:run_at[b]]:
            offs.append(off)
    ptr = list(accumulate(map(len, per_run), initial=0))  # run r's offsets are entries [ptr[r], ptr[r + 1])
    per = [(y - x + BLOCK_T - 1) // BLOCK_T for x, y in zip(bounds, bounds[1:])]  # tiles per run
    tile_end = list(accumulate(per))
    base = [x - BLOCK_T * (e - k) for x, k, e in zip(bounds, per, tile_end)]  # first token - BLOCK_T * first tile
    runs = list(chain.from_iterable(zip(base, bounds[1:], ptr, ptr[1:], tile_end)))
    return runs, list(chain.from_iterable(per_run)), bounds[-1], sum(b - a for a, b, _ in kept), tile_end[-1]


if triton is not None:

    @triton.jit(do_not_specialize=["n_tiles", "R", "STEPS"])  # counts that change with every batch: one kernel
    def _sum_copies_kernel(src_ptr, out_ptr, runs_ptr, off_ptr, C, n_tiles, R, STEPS, SC, D, ACC: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, COLS_FIRST: tl.constexpr,
                           REP: tl.constexpr = 1):
        """out[t] = sum over the run's offsets of src[t + off] (ACC), for the tile's tokens x BLOCK_C channels.
        One program per (tile, column block), on a 1-D grid: ``COLS_FIRST``, the column blocks of one tile on
        consecutive programs; else one column block of consecutive tiles.  The tile's run: the first of the ``R``
        runs whose running tile count (``runs[r, 4]``) passes the tile, by ``STEPS`` >= log2(R + 1) halvings.
        ``REP`` > 1: a source row holds ``REP`` heads of ``D`` channels for each output head (``SC = REP * C``
        channels; the key/value rows expanded to the query heads), summed too: out[t, h, d] = the sum of
        src[t + off, h * REP + p, d] over the copies (in interval order) and, within each copy, over p."""
        pid = tl.program_id(0).to(tl.int64)
        n_cblk = tl.cdiv(C, BLOCK_C)
        if COLS_FIRST:
            tile = pid // n_cblk
            cblk = pid % n_cblk
        else:
            tile = pid % n_tiles
            cblk = pid // n_tiles
        lo = tile * 0  # the run: [lo, hi) holds it, lo the first run whose tile count passes the tile
        hi = lo + R
        for _ in range(STEPS):
            mid = (lo + hi) // 2
            inside = lo < hi
            passed = tl.load(runs_ptr + mid * 5 + 4, mask=inside, other=0) > tile
            hi = tl.where(inside & passed, mid, hi)
            lo = tl.where(inside & (passed == 0), mid + 1, lo)
        cols = cblk * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        if REP == 1:
            scols = cols
        else:  # output channel h * D + d reads source channels (h * REP + p) * D + d
            scols = (cols // D) * (REP * D) + cols % D
        t0 = tl.load(runs_ptr + lo * 5) + BLOCK_T * tile
        t1 = tl.minimum(t0 + BLOCK_T, tl.load(runs_ptr + lo * 5 + 1))
        e0 = tl.load(runs_ptr + lo * 5 + 2)
        e1 = tl.load(runs_ptr + lo * 5 + 3)
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
    def _gather_rows(src_ptr, idx_ptr, out_ptr, G, D, s_t, s_h, front_ptr, F, f_t, f_h, h, H, REP: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """One block of rows of kv head ``h`` (``H`` output heads): out[g, h * REP + p] = row ``idx[g]`` of
        ``[front ; src]`` for p < REP: ``front[idx[g]]`` where ``idx[g] < F``, else ``src[idx[g] - F]``."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        m = (rows < G)[:, None] & (d < D)[None, :]
        tok = tl.load(idx_ptr + rows, mask=rows < G, other=0).to(tl.int64)
        front = (tok < F)[:, None]
        x = tl.load(front_ptr + tok[:, None] * f_t + h * f_h + d[None, :], mask=m & front)
        y = tl.load(src_ptr + (tok - F)[:, None] * s_t + h * s_h + d[None, :], mask=m & ~front)
        x = tl.where(front, x, y)
        for p in tl.static_range(REP):
            tl.store(out_ptr + rows[:, None] * (H * D) + (h * REP + p) * D + d[None, :], x, mask=m)

    @triton.jit
    def _gather_keys_kernel(src_ptr, idx_ptr, out_ptr, G, D, s_t, s_h, front_ptr, F, f_t, f_h, REP: tl.constexpr,
                            BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[g, h * REP + p] = row ``idx[g]`` of ``[front ; src]``, kv head ``h``, for p < REP (F = 0: no front
        rows).  One program per block of rows and kv head ``h``, each source row read once where it lies and written
        REP times (out contiguous ``[G, Hkv * REP, D]``)."""
        h = tl.program_id(1).to(tl.int64)
        _gather_rows(src_ptr, idx_ptr, out_ptr, G, D, s_t, s_h, front_ptr, F, f_t, f_h, h,
                     tl.num_programs(1).to(tl.int64) * REP, REP, BLOCK_G, BLOCK_D)

    @triton.jit
    def _gather_key_values_kernel(k_ptr, v_ptr, idx_ptr, ok_ptr, ov_ptr, G, Dk, Dv, k_t, k_h, v_t, v_h,
                                  fk_ptr, fv_ptr, F, fk_t, fk_h, fv_t, fv_h, REP: tl.constexpr, BLOCK_G: tl.constexpr,
                                  BLOCK_D: tl.constexpr):
        """:func:`_gather_keys_kernel` of the keys and of the values under one index, in one launch: programs
        ``[0, Hkv)`` of axis 1 gather key heads, ``[Hkv, 2 Hkv)`` value heads."""
        j = tl.program_id(1).to(tl.int64)
        Hkv = tl.num_programs(1).to(tl.int64) // 2
        if j < Hkv:
            _gather_rows(k_ptr, idx_ptr, ok_ptr, G, Dk, k_t, k_h, fk_ptr, F, fk_t, fk_h, j, Hkv * REP, REP, BLOCK_G,
                         BLOCK_D)
        else:
            _gather_rows(v_ptr, idx_ptr, ov_ptr, G, Dv, v_t, v_h, fv_ptr, F, fv_t, fv_h, j - Hkv, Hkv * REP, REP,
                         BLOCK_G, BLOCK_D)

    def _bench(kernel_call, quantiles):  # the autotuner's timing: short (the step's first backward waits for it)
        return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)

    # every config writes the same sums (each token's copies in interval order, rounded once): the autotuner's
    # repeated launches only overwrite ``out`` with the same values
    _sum_copies_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_C": c, "COLS_FIRST": f}, num_warps=w) for c, f, w in CONFIGS],
        key=["C", "SC"], do_bench=_bench)(_sum_copies_kernel)


GATHER_BLOCK_G = 32  # rows per program of the expanded gather


def gather_keys(src: Tensor, index: Tensor, rep: int = 1, front: Tensor | None = None) -> Tensor:
    """The gathered key/value rows: ``src [T, Hkv, D]`` -> ``[G, Hkv * rep, D]`` with ``out[g, h * rep + p] =
    src[index[g], h]`` (``index [G]`` int64): each kv head repeated for the ``rep`` query heads of its group, so a
    kernel reads them as plain multi-head keys.  ``front [F, Hkv, D]``: the index reads the rows of ``[front ;
    src]`` (a redundancy-free partition's boundary rows, then its own: ``ops/varlen_boundary_attention.py``), each
    where it lies.  ``rep`` 1 without a front: ``index_select``.  Else one Triton kernel where it runs (each source
    row read once); else ``index_select`` (of the concatenation) then one copy of the broadcast rows."""
    front = _checked_front(src, index, rep, front)
    if rep == 1 and front is None:
        return src.index_select(0, index)
    index = index.to(torch.int64).contiguous()  # the kernel reads it as a dense int64 vector
    G, (_, Hkv, D) = index.numel(), src.shape
    if not _kernel_reads(src, front):
        rows = (src if front is None else torch.cat([front, src])).index_select(0, index)
        return rows if rep == 1 else rows[:, :, None].expand(G, Hkv, rep, D).reshape(G, Hkv * rep, D)
    out = torch.empty((G, Hkv * rep, D), dtype=src.dtype, device=src.device)
    f = src if front is None else front  # F = 0: never read
    if G and Hkv and D:
        _gather_keys_kernel[(triton.cdiv(G, GATHER_BLOCK_G), Hkv)](
            src, index, out, G, D, src.stride(0), src.stride(1), f, 0 if front is None else front.shape[0],
            f.stride(0), f.stride(1), REP=rep, BLOCK_G=GATHER_BLOCK_G, BLOCK_D=triton.next_power_of_2(D))
    return out


def gather_key_values(k: Tensor, v: Tensor, index: Tensor, rep: int = 1,
                      front: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(gather_keys(k, index, rep, front[0]), gather_keys(v, index, rep, front[1]))``, the same rows, in one
    Triton launch where the kernel gathers both: one launch fewer in each varlen op's forward and, where the rows
    were not kept, in its backward (a compiled redundancy-free step of Qwen3-0.6B at T/4 made 2,494 Triton launches
    through the JIT's Python launcher, 1,232 of them gathers: 0.19 s of its host time under cProfile, session 56).
    Keys and values may differ in head dim and strides, not in kv heads or front rows."""
    fk, fv = (None, None) if front is None else front
    fk, fv = _checked_front(k, index, rep, fk), _checked_front(v, index, rep, fv)
    F = 0 if fk is None else fk.shape[0]
    # (past the checks, rep > 1 or a front means [T, Hkv, D] rows; rep 1 without fronts is index_select's)
    one_launch = (rep > 1 or fk is not None) and F == (0 if fv is None else fv.shape[0]) \
        and k.shape[1] == v.shape[1] and k.device == v.device and _kernel_reads(k, fk) and _kernel_reads(v, fv)
    if not one_launch:
        return gather_keys(k, index, rep, fk), gather_keys(v, index, rep, fv)
    index = index.to(torch.int64).contiguous()
    G, Hkv, Dk, Dv = index.numel(), k.shape[1], k.shape[2], v.shape[2]
    ok = torch.empty((G, Hkv * rep, Dk), dtype=k.dtype, device=k.device)
    ov = torch.empty((G, Hkv * rep, Dv), dtype=v.dtype, device=v.device)
    fk, fv = (k, v) if F == 0 else (fk, fv)  # F = 0: never read
    if G and Hkv and max(Dk, Dv):
        _gather_key_values_kernel[(triton.cdiv(G, GATHER_BLOCK_G), 2 * Hkv)](
            k, v, index, ok, ov, G, Dk, Dv, k.stride(0), k.stride(1), v.stride(0), v.stride(1), fk, fv, F,
            fk.stride(0), fk.stride(1), fv.stride(0), fv.stride(1), REP=rep, BLOCK_G=GATHER_BLOCK_G,
            BLOCK_D=triton.next_power_of_2(max(Dk, Dv)))
    return ok, ov


def _checked_front(src: Tensor, index: Tensor, rep: int, front: Tensor | None) -> Tensor | None:
    """:func:`gather_keys`' argument checks; the front rows, None where there are none."""
    if index.dim() != 1:
        raise ValueError(f"gather_keys: index must be 1-D, got shape {tuple(index.shape)}")
    if rep < 1 or (rep > 1 or front is not None) and src.dim() != 3:
        raise ValueError(f"gather_keys: rep {rep} needs src [T, Hkv, D], got {tuple(src.shape)}")
    if front is not None and (front.dim() != 3 or front.shape[1:] != src.shape[1:] or front.dtype != src.dtype
                              or front.device != src.device):
        raise ValueError(f"gather_keys: front rows {front.dtype} {tuple(front.shape)} on {front.device} do not "
                         f"continue src {src.dtype} {tuple(src.shape)} on {src.device}")
    return front if front is not None and front.shape[0] else None


def _kernel_reads(src: Tensor, front: Tensor | None) -> bool:
    """Whether the gather kernel reads ``src`` and ``front`` (Triton runs there; rows of unit channel stride)."""
    return usable(src) and src.stride(-1) == 1 and (front is None or front.stride(-1) == 1)


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
    """``_sum_copies_kernel``'s positional arguments: ``C`` output channels, the runs and the halvings that find a
    tile's run among them, the source rows' ``SC = C * rep`` channels and (``rep`` > 1) their head dim ``D``."""
    R = runs.runs.shape[0]
    return (src, out, runs.runs, runs.offsets, C, runs.n_tiles, R, R.bit_length(), C * rep,
            src.shape[-1] if rep > 1 else 1)


def _launch_tuned(src: Tensor, out: Tensor, runs: CopyRuns, C: int, acc, rep: int = 1) -> None:
    """The kernel under the autotuner's config for ``C`` output channels (and ``rep``: :func:`sum_copies`'), timed
    at the first call with those channel counts."""
    n_tiles = runs.n_tiles
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
        n_tiles = runs.n_tiles
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
