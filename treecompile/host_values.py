"""Host values of a batch's device tensors, and copies to the device that do not block the host.

The plans of the CUDA ops (the fla GDN call plan, the conv tables, the varlen attention's segments) are built
on the host from the batch's tree tensors, inside the step, at the first layer that needs one.  Reading a CUDA
tensor on the host is a blocking copy: the host waits for everything queued on the GPU, and the GPU then idles
while the host builds the plan.  So :func:`to_device_with_host` (what ``TreeBatch.to`` uses) remembers the
host values of what it copies, and :func:`host_copy` returns them for that same device tensor while it is
unchanged (same object, same version counter), with no copy and no wait; any other tensor is copied as
before.

That host work runs :func:`single_threaded`: torch's intra-op threads sleep between steps, and waking them for
one small parallel kernel costs milliseconds.  :func:`repeat_counts` is ``torch.repeat_interleave`` without its
one-element grain, for the same reason, wherever it is called from.  Part of the data model: imports only torch.
"""

from __future__ import annotations

import functools
import math
import weakref
from array import array
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["to_device_async", "to_device_tables", "to_device", "to_device_with_host", "host_copy", "remember_host",
           "remembered_host", "repeat_counts", "single_threaded", "single_threaded_for", "SINGLE_THREAD_ROWS"]

# id(device tensor) -> (weak reference to it, its version counter when remembered, its values on the host)
_HOST: dict[int, tuple[weakref.ref, int, Tensor]] = {}


def _staged(t: Tensor, device: torch.device, *, private: bool) -> Tensor:
    """The host tensor a copy of ``t`` to ``device`` starts from: pinned memory for CUDA (a pageable source
    would make the copy block); ``private``: never ``t`` itself (``pin_memory()`` returns an already pinned
    tensor, such as a DataLoader's pinned batch, unchanged)."""
    if device.type != "cuda":
        return t.clone() if private else t
    if private and t.is_pinned():
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.pin_memory()


def to_device_async(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without blocking the host (through pinned memory when it is CUDA).

    A plain ``.to("cuda")`` of pageable memory (or ``torch.tensor(list, device="cuda")``) synchronises the
    stream: the host waits until the GPU has run everything queued before it.  The plans are made inside the
    graph (at the first layer that needs one), where that wait would drain the GPU's queue."""
    device = torch.device(device)
    return _staged(t, device, private=False).to(device, non_blocking=True)


# where one staging buffer puts each of its tables: the CUDA caching allocator's block alignment (512 bytes), so that
# a table's device view is aligned as a tensor of its own would be (kernels may specialise on pointer alignment)
STAGING_ALIGN = 512


def to_device_tables(tables: Sequence[Sequence[int] | Tensor], device: torch.device,
                     int32: Sequence[int] = ()) -> tuple[Tensor, ...]:
    """A plan's integer tables on ``device`` in one copy that does not block the host: each result is a view of
    one buffer, at an offset aligned to :data:`STAGING_ALIGN` bytes.  A table is a list of ints (1-D int64 on
    ``device``; int32 where its index is in ``int32``) or an int64 host tensor (its shape kept).

    A plan's host time is tensor-op dispatch, 3-7 us an op whatever its size (ops/varlen_tree_attention.py, "The
    plan's host time"), so the lists reach the staging buffer as one ``array`` of bytes (one copy, no op per list)
    and each result is one view; the tensors are copied in one op each.  For CUDA the buffer is pinned and crosses
    in one ``cudaMemcpyAsync``, which saves per table the pinned copy's own allocation and ``is_pinned`` query and a
    copy (about 60 us a table on the H200's host, session 47's ``h200_s47/prof_plan.txt``).  Any other device gets
    the buffer itself (CPU) or its copy."""
    device = torch.device(device)
    if bad := [i for i in int32 if not (0 <= i < len(tables)) or isinstance(tables[i], Tensor)]:
        raise ValueError(f"to_device_tables: int32 names tables {bad}, which are not lists of the {len(tables)} "
                         "given (a tensor table keeps its own dtype, int64)")
    head = bytearray()  # the lists' bytes, each from an aligned offset
    lists, tensors = [], []  # per table: (its index, byte offset, dtype, shape)
    for i, t in enumerate(tables):
        if isinstance(t, Tensor):
            continue
        code, dtype = ("i", torch.int32) if i in int32 else ("q", torch.int64)
        try:
            data = array(code, t)
        except (OverflowError, TypeError) as e:
            raise ValueError(f"to_device_tables: table {i} is not a list of {dtype} values ({e})") from None
        lists.append((i, len(head), dtype, (len(data),)))
        head += data.tobytes()
        head += bytes(-len(head) % STAGING_ALIGN)
    total = len(head)  # the tensors after the lists
    for i, t in enumerate(tables):
        if not isinstance(t, Tensor):
            continue
        if t.device.type != "cpu" or t.dtype != torch.int64:
            raise ValueError(f"to_device_tables: table {i}: expected an int64 host tensor, got {t.dtype} on {t.device}")
        tensors.append((i, total, torch.int64, tuple(t.shape)))
        total += -(-t.numel() * 8 // STAGING_ALIGN) * STAGING_ALIGN
    staged = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    if head:
        staged[:len(head)].copy_(torch.frombuffer(head, dtype=torch.uint8))
    words = staged.view(torch.int64)
    for i, o, _, shape in tensors:
        words[o // 8:o // 8 + tables[i].numel()].view(shape).copy_(tables[i])
    moved = staged if device.type == "cpu" else staged.to(device, non_blocking=True)
    views = {torch.int64: moved.view(torch.int64), torch.int32: moved.view(torch.int32)}
    out: list = [None] * len(tables)
    for i, o, dtype, shape in lists + tensors:
        n, w = math.prod(shape), views[dtype]
        k = o // w.element_size()
        out[i] = w[k:k + n] if len(shape) == 1 else w[k:k + n].view(shape)
    return tuple(out)


def to_device(t: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` (cast to ``dtype`` first, on its own device) on ``device``: from the host through
    :func:`to_device_async` (no wait for the GPU's queue), any other move a plain ``.to``.  For the host tables
    (weights, counts, indices) that per-batch runtime code sends to the model's device."""
    device = torch.device(device)
    t = t if dtype is None else t.to(dtype)
    return to_device_async(t, device) if t.device.type == "cpu" and device.type != "cpu" else t.to(device)


def remember_host(t: Tensor, host: Tensor) -> Tensor:
    """Record ``host`` (a CPU tensor equal to ``t``, which nobody else may write) as ``t``'s host values;
    returns ``t``.  The record goes when ``t`` is freed."""
    if t.device.type == "cpu":
        return t
    if host.device.type != "cpu" or host.shape != t.shape or host.dtype != t.dtype:
        raise ValueError(f"remember_host: expected a CPU tensor of shape {tuple(t.shape)} and dtype {t.dtype}, got "
                         f"{host.device} {tuple(host.shape)} {host.dtype}")
    key = id(t)
    _HOST[key] = (weakref.ref(t, lambda _, key=key: _HOST.pop(key, None)), t._version, host)
    return t


def to_device_with_host(t: Tensor, device: torch.device) -> Tensor:
    """:func:`to_device_async` of a host tensor that also remembers its values (:func:`host_copy` of the result
    reads them, with no device copy).  The remembered copy is private (the pinned staging copy on CUDA, a
    clone otherwise), so later writes to ``t`` do not reach it."""
    device = torch.device(device)
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    staged = _staged(t, device, private=True)
    return remember_host(staged.to(device, non_blocking=True), staged)


def remembered_host(t: Tensor) -> Tensor | None:
    """The host values :func:`remember_host` recorded for ``t`` while it is unchanged, else None (no copy)."""
    rec = _HOST.get(id(t))
    return rec[2] if rec is not None and rec[0]() is t and rec[1] == t._version else None


def host_copy(t: Tensor) -> Tensor:
    """``t``'s values on the host: ``t`` itself on the CPU; the values :func:`to_device_with_host` remembered
    while ``t`` is that same tensor, unchanged (its version counter; a write that bypasses it, such as a
    custom kernel writing into the batch's tree tensors, is not seen: the tree tensors are inputs the
    program only reads); else a copy (which waits for the device).  The result must not be written to."""
    if t.device.type == "cpu":
        return t
    host = remembered_host(t)
    return host if host is not None else t.detach().cpu()


def repeat_counts(values: Tensor, counts: Tensor, total: int | None = None) -> Tensor:
    """``torch.repeat_interleave(values, counts, dim=0)`` of host tensors (``total``: ``counts.sum()``, checked, when the
    caller knows it), for the plans built on the host inside a step.

    The CPU kernel of ``repeat_interleave`` splits its work over the counts with a grain of one, so every call
    wakes all of torch's intra-op threads, however small.  Between two steps those threads sleep; on a
    16-core GPU host, waking them while the GPU works cost about 5 ms a call (session 39: 48 ms of a 0.6B
    agentic step's 155 ms host time in the attention plan's nine calls, 1 ms with 4 threads).  Here the same
    values come from one scatter of the group starts, a running sum and one gather: sequential kernels, or
    split in 32k-element grains, which small plans never reach."""
    if values.dim() < 1 or counts.dim() != 1 or values.shape[0] != counts.numel():
        raise ValueError(f"repeat_counts: expected values [n, ...] and counts [n], got {tuple(values.shape)} and "
                         f"{tuple(counts.shape)}")
    counts = counts.to(torch.int64)
    ends = counts.cumsum(0)
    given = int(ends[-1]) if ends.numel() else 0
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError(f"repeat_counts: negative count {int(counts.min())} at {int(counts.argmin())}")
    if total is not None and total != given:
        raise ValueError(f"repeat_counts: total {total} but the counts sum to {given}")
    total = given
    if total == 0:
        return values.new_empty((0, *values.shape[1:]))
    # index_select: serial on the CPU (``values[group]`` splits above a few thousand rows)
    return values.index_select(0, group_index(ends, total))


def group_index(ends: Tensor, total: int) -> Tensor:
    """``[total]`` int64: the group of each element, for consecutive groups ending at ``ends`` (host int64, the running
    sum of non-negative counts, ``ends[-1] == total``; unchecked: :func:`repeat_counts` checks its counts).  Group
    ``j`` starts at ``ends[j - 1]``: one step there (zero counts: several steps at one element, past the empty
    groups), then a running sum."""
    starts = ends[:-1]  # (an empty last group's start is ``total``: a step past the elements, dropped)
    return torch.zeros(total + 1, dtype=torch.int64).index_add_(0, starts, torch.ones_like(starts))[:total].cumsum_(0)


@functools.cache
def _openmp() -> bool:
    """Whether torch's intra-op threads are OpenMP's (their count settable per call, :func:`single_threaded`)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


# above this many rows a plan's kernels take long enough that threads pay for their wake-up (2-core CPU, threads asleep
# between calls: a 65,536-token batch 4.7 ms on one thread, 9.7 on two; 131,072 tokens 7.9 against 5.4)
SINGLE_THREAD_ROWS = 1 << 16


@contextmanager
def single_threaded(rows: int | None = None):
    """Run the enclosed host work with one intra-op thread (torch's count restored after), when it concerns at
    most :data:`SINGLE_THREAD_ROWS` rows (``rows``: the batch's tokens; None: always).  A no-op at one thread.

    A step's host plans (the tree batch, the ops' segment and conv plans, the padding) are many small CPU
    kernels run while the GPU works, after the host's intra-op threads have gone to sleep.  Any of those
    kernels that splits its work (``aten.index`` above a few thousand rows, ``searchsorted`` above 200,
    every elementwise op above 32,768 elements) wakes them, and waits for the slowest: about 5 ms a wake on
    this repository's 2-core CPU and on the 16-core H200 host (session 39), for kernels that take 10-400 us
    on one thread.  Setting and restoring the count takes a few microseconds.

    Never around a compiled region's entry: dynamo guards the thread count, so a call made with another count
    recompiles.  Plans built inside the graph's ops (``LastBatch``) restore it before the op returns.

    Only with torch's OpenMP backend (Linux and Windows wheels), where the count is the calling thread's own
    (one exception: a thread whose first torch call falls inside the block starts at one thread); torch's native
    pool cannot change its size once used (it warns), so there this is a no-op."""
    n = torch.get_num_threads()
    if n == 1 or (rows is not None and rows > SINGLE_THREAD_ROWS) or not _openmp():
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def single_threaded_for(rows_of):
    """Decorator: the function runs :func:`single_threaded` ``(rows_of(*args, **kwargs))``."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with single_threaded(rows_of(*args, **kwargs)):
                return fn(*args, **kwargs)

        return run

    return wrap
