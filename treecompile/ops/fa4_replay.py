"""FA4's varlen calls launched again without their Python interface, for the layers that share one plan.

``flash_attn.cute.interface._flash_attn_fwd`` / ``_flash_attn_bwd`` work out their kernels' configuration in Python
on every call: tile sizes, the scheduler, ~60-entry compile keys, the argument lists, the backward's scratch
buffers.  On the lent H200's host the forward's is 111-154 us a call and its recorded launch 24-46 us
(benchmarks/results/h200_s42); the backward's interface is several times the forward's (five launches: preprocess,
the kernel, three postprocess conversions).  Where a step is host-bound (Qwen3-0.6B on a 10k-token agentic tree:
the host needs about as long as the GPU for each layer, forward and backward), every such microsecond is GPU idle
time.  The varlen tree attention makes these calls once per layer under one plan, with the same ``cu_seqlens``,
maximum lengths, scale, window, shapes and dtypes.  Only the per-layer tensors differ (q, k, v, out, lse; the
backward's dout and dq too).

:func:`launch` records the first such call of a plan: it swaps the interface's compile caches for recording ones
and watches torch's dispatch while the call runs.  The record is the call's steps in order: buffers it allocated
(``empty``-like, or zero-filled), whole-buffer zero fills, and kernel launches.  A later call with the same key
runs the steps again: new buffers of the recorded shapes, strides and dtypes, the recorded kernels launched on its
own tensors and those buffers, in the recorded places; the result is built the same way.  It replays only a call
it can show is the recorded one:

* every launch took positional arguments only; every tensor argument is one of the call's tensors (same data
  pointer, shape, strides, dtype), a view of a buffer the call allocated, or a tensor the owner holds (``owned``:
  the plan's ``cu_seqlens``), at the top level of the argument list; a nested tensor must be the owner's;
* no torch op of the call wrote memory or read a device value: only allocations, views and zero fills of whole
  buffers it allocated ran (a ``TorchDispatchMode`` watches; ``maybe_contiguous``'s copy of a misaligned input, a
  write into a caller's tensor, an ``.item()`` each make the call unreplayable);
* no two of the call's tensors share storage, every buffer reaches a launch or the result as a tensor, and the
  result is made of the call's tensors and its buffers;
* the later call has the same owner (the plan, alive: the record dies with it; its ``cu_seqlens``, maximum
  lengths and window are the recorded call's), the same caller key (kind, scale, deterministic mode), the same
  CUDA stream, and tensors of the same layout (shape, strides, dtype, device, 16-byte alignment).

Anything else runs the interface.  Settings that the interface reads from the process (FA4's environment
variables, its log level) are read once per plan, not once per layer.  ``ENABLED = False`` turns replay off,
``BACKWARD = False`` the backward's alone (the benchmarks time them).  :data:`counts` says per kind how many calls
were recorded, replayed, and run through the interface after a record was refused.  The GPU tests in
tests/test_varlen_tree_attention.py check replayed results bitwise against the interface's.

A hand-written launch path around a library's interface, chosen over the interface for host time alone; it
holds no copy of FA4's decisions (the interface makes them, once per plan).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["launch", "ENABLED", "BACKWARD", "KINDS", "counts", "pop_counts"]

ENABLED = True
BACKWARD = True  # replay the backward's calls too (ENABLED turns both off)
KINDS = ("forward", "backward")
counts = {kind: {"recorded": 0, "replayed": 0, "refused": 0} for kind in KINDS}  # refused: run through the interface
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_ZEROS = frozenset({"zeros", "zeros_like", "new_zeros"})
_MAX_RECORDS = 256


@dataclass(frozen=True)
class _Buffer:
    """A buffer the recorded call allocated: made again, empty or zero-filled, on every replay."""

    size: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    zero: bool


@dataclass(frozen=True)
class _Ref:
    """Where a launch argument or a result comes from: the call's tensor ``index`` (``buffer`` False) as given, or a
    view ``(size, stride, offset from its storage offset)`` of buffer ``index``."""

    buffer: bool
    index: int
    view: tuple | None = None


@dataclass(frozen=True)
class _Record:
    steps: tuple  # ("buffer", _Buffer) | ("zero", buffer index) | ("launch", kernel, args, ((position, _Ref), ...))
    result: object  # the call's result with a _Ref for each tensor (tuples and lists kept)


_records: dict = {}  # (id(owner), kind, key, stream, layout) -> (weakref to owner, _Record or None)
_lock = threading.Lock()  # one recording at a time: the interface's caches are module state


def launch(owner, key: tuple, tensors: tuple[Tensor, ...], call: Callable[[], object], *, kind: str = "forward",
           owned: tuple[Tensor, ...] = (), interface=None):
    """``call()`` (an FA4 interface call on ``tensors``), or its recorded steps with these tensors (module
    docstring); returns what ``call()`` returns.  ``owner``: the object the call's other arguments belong to (the
    plan; held weakly); ``key``: the caller's scalars; ``kind``: one of :data:`KINDS` (the counts'); ``owned``: the
    owner's tensors the call passes as they are (the ``cu_seqlens``); ``interface``: the module holding the compile
    caches (``flash_attn.cute.interface``; a stand-in for the CPU tests)."""
    if kind not in KINDS:
        raise ValueError(f"fa4_replay.launch: kind must be one of {KINDS}, got {kind!r}")
    if not ENABLED or (kind == "backward" and not BACKWARD):
        return call()
    count = counts[kind]
    rkey = (id(owner), kind, key, _stream(tensors[0]), _layout(tensors))
    hit = _records.get(rkey)
    if hit is not None and hit[0]() is owner:
        if hit[1] is None:
            count["refused"] += 1
            return call()
        count["replayed"] += 1
        return _replay(hit[1], tensors)
    if interface is None:
        from flash_attn.cute import interface
    result, record = _record(interface, tensors, owned, call)
    count["recorded" if record is not None else "refused"] += 1
    with _lock:
        if len(_records) >= _MAX_RECORDS:
            _records.clear()
        _records[rkey] = (weakref.ref(owner), record)
    weakref.finalize(owner, _records.pop, rkey, None)
    return result


def pop_counts() -> dict:
    """:data:`counts` since the last pop, per kind (then zeroed)."""
    got = {kind: dict(c) for kind, c in counts.items()}
    for c in counts.values():
        for name in c:
            c[name] = 0
    return got


def _replay(record: _Record, tensors: tuple[Tensor, ...]):
    buffers: list[Tensor] = []
    for step in record.steps:
        if step[0] == "launch":
            _, kernel, args, refs = step
            args = list(args)
            for position, ref in refs:
                args[position] = _build(ref, tensors, buffers)
            kernel(*args)
        elif step[0] == "buffer":
            b = step[1]
            t = torch.empty_strided(b.size, b.stride, dtype=b.dtype, device=b.device)
            buffers.append(t.zero_() if b.zero else t)
        else:
            buffers[step[1]].zero_()
    return _nested_map(record.result, lambda x: _build(x, tensors, buffers) if isinstance(x, _Ref) else x)


def _build(ref: _Ref, tensors, buffers) -> Tensor:
    if not ref.buffer:
        return tensors[ref.index]
    base = buffers[ref.index]
    if ref.view is None:
        return base
    size, stride, offset = ref.view
    return base.as_strided(size, stride, base.storage_offset() + offset)


def _nested_map(x, fn):
    """``x`` with ``fn`` applied to each item of its nested tuples and lists (kept as they are)."""
    if isinstance(x, (tuple, list)):
        return type(x)(_nested_map(y, fn) for y in x)
    return fn(x)


def _stream(t: Tensor):
    return torch._C._cuda_getCurrentStream(t.device.index) if t.is_cuda else None


def _layout(tensors) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)


class _Recording:
    """A compile cache that records the launches of the kernels it hands out (made on the recording thread); any
    use other than ``in``, ``[]`` and ``[]=`` marks the recording unusable (and is passed on)."""

    def __init__(self, cache, name: str, steps: list, odd: list, thread: int):
        self._cache, self._name, self._steps, self._odd, self._thread = cache, name, steps, odd, thread

    def __contains__(self, key) -> bool:
        return key in self._cache

    def __setitem__(self, key, value) -> None:
        self._cache[key] = value

    def __getitem__(self, key):
        kernel = self._cache[key]
        if threading.get_ident() != self._thread:  # another thread's call: not this recording's
            return kernel

        def recorded(*args, **kwargs):
            self._steps.append(("launch", self._name, kernel, args, kwargs))
            return kernel(*args, **kwargs)
        return recorded

    def __getattr__(self, name):
        self._odd.append(f"{self._name}.compile_cache.{name}")
        return getattr(self._cache, name)


class _Watch(TorchDispatchMode):
    """Notes the call's allocations and whole-buffer zero fills as steps; any other torch op that is not a view goes
    to ``ops`` (what a replay would skip)."""

    def __init__(self, steps: list):
        super().__init__()
        self.steps, self.ops = steps, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _EMPTY or name in _ZEROS:
            self.steps.append(("buffer", out, name in _ZEROS))
        elif name == "zero_":
            self.steps.append(("zero", args[0]))
        elif not (func.is_view and not func._schema.is_mutable) and name != "detach":
            self.ops.append(str(func))
        return out


def _record(interface, tensors, owned, call):
    """``call()``'s result and its :class:`_Record`, or None where the call cannot be shown to replay (module
    docstring)."""
    caches = {name: fn for name, fn in vars(interface).items() if hasattr(fn, "compile_cache")}
    steps, odd, saved = [], [], {}
    watch = _Watch(steps)
    with _lock:
        try:
            for name, fn in caches.items():
                saved[name] = fn.compile_cache
                fn.compile_cache = _Recording(fn.compile_cache, name, steps, odd, threading.get_ident())
            with watch:
                result = call()
        finally:
            for name, cache in saved.items():
                caches[name].compile_cache = cache
    if odd or watch.ops:
        return result, None
    return result, _steps_record(steps, tensors, owned, result)


class _Refused(Exception):
    pass


def _steps_record(steps, tensors, owned, result) -> _Record | None:
    storages = [_storage(t) for t in tensors]
    if len(set(storages)) != len(storages):
        return None
    buffers: list[Tensor] = []  # the call's allocations, in order
    kept = []

    def ref(a: Tensor) -> _Ref:
        for i, t in enumerate(tensors):
            if _same(a, t):
                return _Ref(buffer=False, index=i)
        s = _storage(a)
        for j, b in enumerate(buffers):
            if s == _storage(b):
                if a.dtype != b.dtype:
                    raise _Refused
                if _same(a, b):
                    return _Ref(buffer=True, index=j)
                return _Ref(buffer=True, index=j, view=(tuple(a.shape), a.stride(),
                                                        a.storage_offset() - b.storage_offset()))
        raise _Refused

    def foreign(a: Tensor) -> bool:
        """Not the call's tensors nor its buffers: must be the owner's (a tensor of the call's first run, kept
        in the record, would be read by every replay)."""
        s = _storage(a)
        if s in storages or any(s == _storage(b) for b in buffers):
            return False
        if not any(s == _storage(o) for o in owned):
            raise _Refused
        return True

    try:
        for step in steps:
            if step[0] == "buffer":
                out, zero = step[1], step[2]
                if not isinstance(out, Tensor) or _storage(out) in storages:
                    raise _Refused
                buffers.append(out)
                kept.append(("buffer", _Buffer(tuple(out.shape), out.stride(), out.dtype, out.device, zero)))
            elif step[0] == "zero":
                j = next((j for j, b in enumerate(buffers) if _same(step[1], b)), None)
                if j is None:  # a fill of a caller's tensor, or of part of a buffer
                    raise _Refused
                kept.append(("zero", j))
            else:
                _, _, kernel, args, kwargs = step
                if kwargs:
                    raise _Refused
                refs = []
                seen = set()
                for position, a in enumerate(args):
                    if isinstance(a, Tensor):
                        if not foreign(a):
                            r = ref(a)
                            if not r.buffer:
                                if r.index in seen:  # one of the call's tensors in two places
                                    raise _Refused
                                seen.add(r.index)
                            refs.append((position, r))
                    elif any(not foreign(t) for t in _tensors_in(a)):
                        raise _Refused
                placed = {p for p, _ in refs}
                template = tuple(None if position in placed else a for position, a in enumerate(args))
                kept.append(("launch", kernel, template, tuple(refs)))
        read = {(r.buffer, r.index) for s in kept if s[0] == "launch" for _, r in s[3]}
        if any((False, i) not in read for i in range(len(tensors))):
            raise _Refused  # a tensor of the call that no launch read as given (a copy was made of it, say)
        result_refs = _nested_map(result, lambda x: _result_ref(x, ref, read))
        if any((True, j) not in read for j in range(len(buffers))):
            # a buffer that no launch took as a tensor, nor the result: it may have reached a kernel some other way
            # (a raw pointer), which a replay would not give the new buffer
            raise _Refused
        return _Record(steps=tuple(kept), result=result_refs)
    except _Refused:
        return None


def _result_ref(x, ref, read: set):
    """An item of the call's result as the record keeps it: a tensor's :class:`_Ref` (noted in ``read``), a plain
    value as it is; anything else refuses the record."""
    if isinstance(x, Tensor):
        r = ref(x)
        read.add((r.buffer, r.index))
        return r
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise _Refused


def _storage(t: Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def _same(a: Tensor, t: Tensor) -> bool:
    return (a.data_ptr() == t.data_ptr() and a.shape == t.shape and a.stride() == t.stride() and a.dtype == t.dtype
            and a.device == t.device)


def _tensors_in(x, depth: int = 0):
    """The tensors in ``x``: nested tuples, lists, dicts and objects' attributes, four levels deep."""
    if isinstance(x, Tensor):
        yield x
    elif depth < 4:
        if isinstance(x, dict):
            items = x.values()
        elif isinstance(x, (tuple, list)):
            items = x
        else:
            items = [*getattr(x, "__dict__", {}).values(),
                     *(getattr(x, s, None) for s in getattr(type(x), "__slots__", ()))]
        for item in items:
            yield from _tensors_in(item, depth + 1)
