"""``treecompile::linear_logprobs_kept``: the fused head that keeps its logits for the backward.

Same arguments (but ``chunk``) and the same first three results as ``treecompile::linear_logprobs``
(:mod:`treecompile.ops.logprobs`), plus a fourth: the logits ``h @ W.T (+ b)`` of the kept rows in the model's
dtype, ``[M, V]``.  The chunked heads bound their memory to one ``[chunk, V]`` block and pay for it in the
backward: each chunk's logits are recomputed (a fourth head GEMM per token where a full-logits model runs three)
and the float32 ``dW [V, D]`` is read and written once per chunk.  This op runs the kept rows as the unmodified
model does: one logits GEMM forward, and backward one ``dh = dL @ W`` and one ``dW = dL.T @ h`` GEMM over them,
``dW`` accumulated in float32 and rounded once (as the chunked heads do).  It costs ``M x V`` elements of memory
from the forward to the head's backward; the CUDA lowering chooses it (``head_logits``,
:mod:`treecompile.passes.lower_cuda`), nothing in the rewritten graph does.

Which rows are kept (``keep``):

- ``"all"``: every row, ``M = N`` (``head_logits="kept"``).
- ``"fit"``: the leading rows whose logits fit in the memory the device has left *when the forward runs*
  (:func:`fit_rows`; ``head_logits="auto"``).  The head is the forward's last large op, so the step's
  activations are already held; what fits is the device's free memory plus the caching allocator's cached,
  unused bytes, less the head backward's own buffers (:func:`head_backward_bytes`) and a margin of
  ``1 / FIT_MARGIN_FRACTION`` of the device's memory.  The rows past ``M`` run chunked in the same op
  (their logits recomputed in the backward), so memory never decides between all or nothing: a tree whose
  logits fit keeps them all, one that only just fits keeps what it can.  ``M`` is known only at run time: under
  ``torch.compile`` the fourth result has an unbacked row count, so one compiled graph serves every ``M``
  (no recompile when the memory left changes).  Off CUDA the device's memory is not tracked: every row is
  kept.  The headroom counts cached blocks that may be split too finely for one ``[M, V]`` buffer; where the
  allocator then cannot serve it, ``M`` is halved until it can (down to none), with one warning per process
  (:func:`_kept_logits`).

The backward overwrites the saved logits with their gradient (no second ``[M, V]`` buffer) and bumps their
version counter, so a second backward through the same graph (``retain_graph=True``) raises autograd's
"modified by an inplace operation" error instead of reading gradients as logits.

The row statistics and the logits' gradient are the reference formulas (``chunk_stats``,
``chunk_dlogits``, upcast ``default_chunk(V)`` rows at a time, the reference head's own bound) on any
device, and the Triton row kernels of :mod:`treecompile.ops.logprobs_triton` on CUDA half precision (one
launch over the kept rows, one per chunk of the others).
"""

from __future__ import annotations

import time
import warnings
from typing import NamedTuple

import torch

from treecompile.ops import logprobs_triton
from treecompile.ops.logprobs import (_acc_dtype, accumulate_bias_grad, accumulate_chunk_grads, chunk_dlogits,
                                      chunk_logits, chunk_stats, default_chunk, resolve_chunk)
from treecompile.ops.triton_support import usable

__all__ = ["linear_logprobs_kept", "logits_bytes", "fit_rows", "head_backward_bytes", "headroom_bytes",
           "allocator_bytes", "AllocatorBytes", "DRIVER_READ_S", "KEEP", "FIT_MARGIN_FRACTION", "fit_margin_bytes",
           "last_fit", "pop_last_fit"]

HALF = (torch.bfloat16, torch.float16)
KEEP = ("all", "fit")
# "fit" leaves this fraction of the device's memory unclaimed (4.4 GiB on an H200, 2.5 GiB on an H100 80GB): for
# the allocator's rounding and fragmentation, and what the step allocates between the head's forward and its
# backward (the loss, objectives' [T] vectors, autograd's bookkeeping).
FIT_MARGIN_FRACTION = 32
# The last "fit" decision of this process, for benchmarks and logs: {"rows": N, "kept": M, "headroom": bytes}
# (empty until a "fit" call ran).  Diagnostics only: nothing reads it to decide anything.  Replaced whole by each
# decision (never mutated), so a reader sees one call's record even with heads running on several threads.
last_fit: dict[str, int] = {}


def logits_bytes(n: int, vocab: int, dtype: torch.dtype) -> int:
    """The memory this op keeps from the forward to the backward for ``n`` kept rows: ``n x vocab`` logits of
    ``dtype``."""
    return n * vocab * dtype.itemsize


def _triton(h: torch.Tensor) -> bool:
    return h.dtype in HALF and usable(h)


def _chunk(h: torch.Tensor, vocab: int) -> int:
    """Rows per chunk of the rows that are not kept: the chunked head's own default for this device/dtype."""
    return resolve_chunk(0, vocab, logprobs_triton.DEFAULT_BUDGET) if _triton(h) else default_chunk(vocab)


def head_backward_bytes(n: int, vocab: int, dim: int, dtype: torch.dtype, *, chunk_rows: int, bias: bool,
                        triton: bool, entropy: bool = False) -> int:
    """What the head's backward allocates beside the kept logits: ``dh [n, D]`` in the model's dtype, ``dW`` in
    the accumulation dtype and rounded (``[V, D]`` each), ``db`` likewise, the ``[n]`` vectors (gradients and
    their float copies), and per ``[chunk_rows, V]`` block: on the ``triton`` path one block of recomputed logits
    in the model's dtype (the row kernels overwrite it with its gradient in place); on the torch path also the
    float temporaries of ``chunk_dlogits`` (the upcast row block, ``x - lse``, ``p`` and the gradient: three live
    at once, four with the entropy's gradient), which it makes for the kept rows too, one row block at a time."""
    acc = _acc_dtype(dtype).itemsize
    item = dtype.itemsize
    per_element = item if triton else item + (4 if entropy else 3) * acc
    return (n * dim * item + vocab * dim * (acc + item) + (vocab * (acc + item) if bias else 0)
            + chunk_rows * vocab * per_element + 6 * n * acc)


class AllocatorBytes(NamedTuple):
    """One read of the caching allocator's statistics on a CUDA device (:func:`allocator_bytes`)."""

    allocated: int
    reserved: int
    tight: int = 0  # allocation retries and out-of-memory errors so far: memory ran short where it moved


def allocator_bytes(device: torch.device) -> AllocatorBytes:
    """(allocated, reserved, tight) of the caching allocator on CUDA ``device``, from one read of its statistics
    table.  ``torch.cuda.memory_allocated`` and ``memory_reserved`` each read it and flatten all of it into a sorted
    dict first: ~0.3-0.5 ms a call on the H200's host, several per forward (benchmarks/results/h200_s42)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    if not stats:  # CUDA not initialised: nothing allocated
        return AllocatorBytes(0, 0, 0)
    return AllocatorBytes(stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"],
                          stats.get("num_alloc_retries", 0) + stats.get("num_ooms", 0))


# The driver's count of the device's free memory (``cudaMemGetInfo``) is the one read here that the allocator
# cannot answer.  On the lent H200 every profiled tree step left the GPU idle 0.44-0.70 ms inside it (the varlen
# op's "fit" decision, in a host-bound forward: benchmarks/results/h200_s42, h200_s43).  Between two driver reads
# the allocator's own reservations and releases move bytes between "free" and "reserved" one for one, so
# ``free + reserved`` only changes when something outside this process's caching allocator takes or returns device
# memory (another process, NCCL's buffers, a library's own cudaMalloc, kernel modules loading).  A read is reused
# for DRIVER_READ_S seconds, unless the allocator has had to retry or has failed an allocation since (``tight``);
# 0 reads the driver at every decision.  What another process takes within that second is not seen: the same race
# a read at every decision has in a shorter window, and the "fit" margin (``FIT_MARGIN_FRACTION``) is for it.
DRIVER_READ_S = 1.0
_driver_reads: dict = {}  # device index -> (monotonic time of the read, free + reserved then, ``tight`` then)


def _free_plus_reserved(device: torch.device, reserved: int, tight: int) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    now = time.monotonic()
    read = _driver_reads.get(index)
    if read is not None and now - read[0] < DRIVER_READ_S and read[2] == tight:
        return read[1]
    free, _total = torch.cuda.mem_get_info(device)
    _driver_reads[index] = (now, free + reserved, tight)
    return free + reserved


def headroom_bytes(device: torch.device, allocator: AllocatorBytes | tuple | None = None) -> int | None:
    """Bytes that tensors on ``device`` could still take: the device's free memory plus what the caching
    allocator holds unused, and no more than the process's cap (``torch.cuda.set_per_process_memory_fraction``)
    leaves; None off CUDA, where memory is not tracked.  ``allocator``: :func:`allocator_bytes` when the caller has
    just read it (one statistics read less).  The device's free memory is the driver's, read at most once per
    :data:`DRIVER_READ_S` seconds (see there)."""
    if device.type != "cuda":
        return None
    allocated, reserved, tight = allocator_bytes(device) if allocator is None else AllocatorBytes(*allocator)
    headroom = _free_plus_reserved(device, reserved, tight) - allocated
    query = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # not in every torch
    fraction = query(device) if query is not None else 1.0
    if 0.0 < fraction < 1.0:  # 1.0: no cap was set
        headroom = min(headroom, int(fraction * _device_total(device)) - allocated)
    return headroom


def _device_total(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def fit_margin_bytes(device: torch.device) -> int:
    """What every "fit" decision leaves unclaimed on ``device``: ``1 / FIT_MARGIN_FRACTION`` of its memory (the
    head's here, the varlen attention's kept rows: ``ops.varlen_tree_attention.keeps_keys``)."""
    return _device_total(device) // FIT_MARGIN_FRACTION


def fit_rows(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, entropy: bool = False) -> int:
    """How many leading rows of ``h`` keep their logits under ``keep="fit"``: as many as the device's headroom
    (:func:`headroom_bytes`) holds after the head backward's own buffers (:func:`head_backward_bytes`) and
    ``1 / FIT_MARGIN_FRACTION`` of the device's memory; all of them off CUDA."""
    N, D = h.shape
    V = W.shape[0]
    headroom = headroom_bytes(h.device)
    if headroom is None:
        rows = N
    else:
        need = head_backward_bytes(N, V, D, h.dtype, chunk_rows=min(N, _chunk(h, V)), bias=b is not None,
                                   triton=_triton(h), entropy=entropy)
        spare = headroom - need - fit_margin_bytes(h.device)
        rows = max(0, min(N, spare // max(1, logits_bytes(1, V, h.dtype))))
    _record(rows=N, kept=rows, headroom=-1 if headroom is None else headroom)
    return rows


def _record(**fit: int) -> None:
    global last_fit
    last_fit = fit


def pop_last_fit() -> dict[str, int]:
    """:data:`last_fit`, which is then empty until the next "fit" decision (benchmarks: one record per row)."""
    global last_fit
    fit, last_fit = last_fit, {}
    return fit


def _kept_logits(h, W, b, M: int, *, fit: bool) -> tuple[torch.Tensor, int]:
    """The logits of the first ``M`` rows and ``M``.  Under ``fit``, an allocation the allocator cannot serve (its
    cached memory split into blocks too small for one ``[M, V]`` buffer, which :func:`headroom_bytes` counts as
    free) halves ``M`` until one can, down to none, with one warning per process: the rows left out run chunked
    as under ``head_logits="chunked"``.  Under ``"all"`` an out-of-memory error is the caller's (they asked
    for every row)."""
    while True:
        try:
            return chunk_logits(h[:M], W, b), M
        except torch.OutOfMemoryError:
            if not fit or M == 0:
                raise
            M //= 2
            _record(**{**last_fit, "kept": M})
            if not _WARNED_FRAGMENTED:
                _WARNED_FRAGMENTED.append(True)
                warnings.warn("treecompile: the fused head's kept logits did not fit in the memory the allocator "
                              "reported as free (fragmented cached blocks); it keeps fewer rows and chunks the rest. "
                              "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids the fragmentation, "
                              "head_logits='chunked' keeps no logits.", stacklevel=2)


_WARNED_FRAGMENTED: list[bool] = []


def _stats_rows(logits, targets, lp, lse, ent, entropy: bool, acc) -> None:
    """Fill ``lp``, ``lse`` (and ``ent``) of the rows of ``logits`` (model dtype, ``[n, V]``)."""
    if _triton(logits):
        logprobs_triton.stats_(logits, targets, lp, lse, ent if entropy else None)
        return
    rows = default_chunk(logits.shape[1])
    for s in range(0, logits.shape[0], rows):
        sl = slice(s, s + rows)
        c_lp, c_lse, c_ent = chunk_stats(logits[sl].to(acc), targets[sl], entropy)
        lp[sl], lse[sl] = c_lp, c_lse
        if entropy:
            ent[sl] = c_ent


def _check_dtypes(h, W, b) -> None:
    """One dtype for ``h``, ``W`` and ``b``: the kept logits and their gradient are buffers of that dtype (the
    reference op ``treecompile::linear_logprobs`` promotes mixed ones; ``passes.lower_cuda._fused_head`` sends
    such calls there)."""
    for name, t in (("W", W), ("b", b)):
        if t is not None and t.dtype != h.dtype:
            raise ValueError(f"treecompile::linear_logprobs_kept: {name} is {t.dtype}, h is {h.dtype} (one dtype "
                             f"for all three; treecompile::linear_logprobs takes mixed ones)")


def _check_keep(keep: str) -> None:
    if keep not in KEEP:
        raise ValueError(f"treecompile::linear_logprobs_kept: keep must be one of {KEEP}, got {keep!r}")


@torch.library.custom_op("treecompile::linear_logprobs_kept", mutates_args=())
def linear_logprobs_kept(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
                         entropy: bool = False, keep: str = "all"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs [N], lse [N], entropy [N] if entropy else [0], logits [M, V])``; the first three as
    ``treecompile::linear_logprobs`` returns them (float32, or float64 for a float64 model).  ``keep``: which
    rows keep their logits (module docstring); ``M = N`` under ``"all"``.  The logits are the backward's working
    buffer: its backward overwrites them with their gradient, so a caller reads them before the backward or not
    at all (``passes.lower_cuda._fused_head`` drops them)."""
    _check_keep(keep)
    N, V = h.shape[0], W.shape[0]
    _check_dtypes(h, W, b)
    M = N if keep == "all" else fit_rows(h, W, b, entropy)
    acc = _acc_dtype(h.dtype)
    targets = targets.contiguous()
    lp = torch.empty(N, dtype=acc, device=h.device)
    lse = torch.empty(N, dtype=acc, device=h.device)
    ent = torch.empty(N if entropy else 0, dtype=acc, device=h.device)
    logits, M = _kept_logits(h, W, b, M, fit=keep == "fit")
    _stats_rows(logits, targets[:M], lp[:M], lse[:M], ent[:M], entropy, acc)
    chunk = _chunk(h, V)
    for s in range(M, N, chunk):  # the rows that are not kept: one [chunk, V] block at a time
        sl = slice(s, s + chunk)
        _stats_rows(chunk_logits(h[sl], W, b), targets[sl], lp[sl], lse[sl], ent[sl], entropy, acc)
    return lp, lse, ent, logits


@linear_logprobs_kept.register_fake
def _(h, W, b, targets, entropy=False, keep="all"):
    _check_keep(keep)
    N = h.shape[0]
    M = N if keep == "all" else torch.library.get_ctx().new_dynamic_size()
    acc = _acc_dtype(h.dtype)
    return (h.new_empty(N, dtype=acc), h.new_empty(N, dtype=acc), h.new_empty(N if entropy else 0, dtype=acc),
            h.new_empty(M, W.shape[0]))


def _weight_grad(dl: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``dl.T @ h`` in the accumulation dtype (float32, float64 for a float64 model), for the rows after it to
    accumulate into and to round once.

    Not ``accumulate_weight_grad`` into a zeroed float32 buffer when rows are kept: their one GEMM writes the
    buffer, and the zero fill and read of ``[V, D]`` float32 cost 1.8 ms of 24 on the MoE head (H100,
    ``benchmarks/results/h100_s25/dw.jsonl``)."""
    if dl.is_cuda and dl.dtype in HALF:
        return torch.mm(dl.t(), h, out_dtype=torch.float32)
    acc = _acc_dtype(dl.dtype)
    return dl.t().to(acc) @ h.to(acc)


@torch.library.custom_op("treecompile::linear_logprobs_kept_backward", mutates_args=())
def linear_logprobs_kept_backward(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None,
                                  targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                                  logits: torch.Tensor, grad_lp: torch.Tensor, grad_lse: torch.Tensor,
                                  grad_ent: torch.Tensor | None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d h, d W, d b or [0])`` of :func:`linear_logprobs_kept`; ``grad_ent`` None: the entropy is not
    differentiated.

    ``logits`` is the forward's own fourth result (the first ``M = logits.shape[0]`` rows), which nothing but
    this backward reads: it is overwritten with d(loss)/d(logits) in place (a mutation the schema does not
    declare: no other op reads the tensor) and its version counter is bumped, so any later read through autograd
    raises.  The rows past ``M`` recompute their logits one chunk at a time, as the chunked heads do."""
    acc = _acc_dtype(h.dtype)
    N, M, V = h.shape[0], logits.shape[0], W.shape[0]
    targets = targets.contiguous()
    g, gl = grad_lp.to(acc).contiguous(), grad_lse.to(acc).contiguous()
    ge = None if grad_ent is None else grad_ent.to(acc).contiguous()
    e = None if ge is None else ent

    def dlogits_(x, sl):  # x [n, V] (model dtype) of rows sl, overwritten by its gradient
        if _triton(x):
            return logprobs_triton.dlogits_(x, targets[sl], lse[sl], g[sl], gl[sl], None if e is None else e[sl],
                                            None if ge is None else ge[sl])
        rows, n = default_chunk(V), x.shape[0]
        for s in range(0, n, rows):
            r = slice(sl.start + s, sl.start + min(s + rows, n))
            x[s:s + rows] = chunk_dlogits(x[s:s + rows].to(acc), targets[r], lse[r], g[r], gl[r],
                                          None if e is None else e[r], None if ge is None else ge[r])
        return x

    gh = torch.empty_like(h)
    dl = dlogits_(logits, slice(0, M))
    torch.autograd.graph.increment_version(logits)
    torch.mm(dl, W, out=gh[:M])
    gW = _weight_grad(dl, h[:M]) if M else torch.zeros(W.shape, dtype=acc, device=W.device)
    gb = torch.zeros(V, dtype=acc, device=W.device) if b is not None else None
    if gb is not None:
        accumulate_bias_grad(gb, dl)
    chunk = _chunk(h, V)
    for s in range(M, N, chunk):  # the rows that were not kept: their logits again, one chunk at a time
        sl = slice(s, s + chunk)
        hc = h[sl]
        dc = dlogits_(chunk_logits(hc, W, b), sl)
        accumulate_chunk_grads(dc, hc, W, gh[sl], gW, gb)
        del dc  # else it lives on while the next chunk's logits are made: two blocks, not one
    return gh, gW.to(W.dtype), (gb.to(b.dtype) if b is not None else W.new_empty(0))


@linear_logprobs_kept_backward.register_fake
def _(h, W, b, targets, lse, ent, logits, grad_lp, grad_lse, grad_ent):
    return torch.empty_like(h), torch.empty_like(W), W.new_empty(W.shape[0] if b is not None else 0)


def _setup(ctx, inputs, output):
    h, W, b, targets, *rest = inputs
    ctx.save_for_backward(h, W, b, targets, output[1], output[2], output[3])
    ctx.has_bias = b is not None
    ctx.entropy = bool(rest[0]) if rest else False
    ctx.mark_non_differentiable(output[3])
    # else autograd hands the backward a zero [M, V] "gradient" of the logits (and zeros for unused outputs):
    # as much memory as the kept logits, and a memset of it (H100, the MoE head: peak +7.1 GiB)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_lp, grad_lse, grad_ent, _grad_logits):
    h, W, b, targets, lse, ent, logits = ctx.saved_tensors  # _grad_logits: None (non-differentiable)
    grad_lp = torch.zeros_like(lse) if grad_lp is None else grad_lp
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    gh, gW, gb = linear_logprobs_kept_backward(h, W, b, targets, lse, ent, logits, grad_lp, grad_lse,
                                               grad_ent if ctx.entropy else None)
    return gh, gW, (gb if ctx.has_bias else None), None, None, None


linear_logprobs_kept.register_autograd(_backward, setup_context=_setup)
