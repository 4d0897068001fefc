"""FA4's varlen forward launched again without its Python interface, for the layers that share one plan.

``flash_attn.cute.interface._flash_attn_fwd`` works out its kernel's configuration in Python on every call:
tile sizes, the scheduler, a ~60-entry compile key, the argument list.  On the lent H200's host that is 111-154 us
a call; the recorded launch below takes 24-46 us (benchmarks/results/h200_s42).  Where the forward is host-bound
(Qwen3-0.6B on a 10k-token agentic tree: the host needs about as long as the GPU for each layer), every such
microsecond is GPU idle time.  The varlen tree attention makes this call once per layer under one plan, with the
same ``cu_seqlens``, maximum lengths, scale, window, shapes and dtypes.  Only q, k, v and the out / lse buffers
differ.

:func:`launch` records the first such call: it swaps the interface's compile caches for recording ones while the
call runs.  A later call with the same key then launches the recorded kernel with its own five tensors put in
the recorded places.  It replays only a call it can show is the recorded one:

* the recorded call made exactly one kernel launch, the forward kernel's (a split-KV forward adds a combine
  launch: never replayed), with positional arguments only;
* no torch op of the call wrote memory or read a device value: only allocations and views ran (a
  ``TorchDispatchMode`` watches; ``maybe_contiguous``'s copy of a misaligned input, a memset of a scratch
  buffer, an ``.item()`` each make the call unreplayable);
* each of the five tensors sits at exactly one top-level place of the argument list (same data pointer, shape,
  strides, dtype), and no other argument tensor, nested ones included, shares its storage;
* the later call has the same owner (the plan, alive: the record dies with it; its ``cu_seqlens``, maximum
  lengths and window are the recorded call's), the same caller key (the scale), the same CUDA stream, and tensors
  of the same layout (shape, strides, dtype, device, 16-byte alignment).

Anything else runs the interface.  Settings that the interface reads from the process (FA4's environment
variables, its log level) are read once per plan, not once per layer.  ``ENABLED = False`` turns replay off (the
benchmarks time both).  :data:`counts` says how many calls were recorded, replayed, and run through the
interface after a record was refused.  The GPU test in tests/test_varlen_tree_attention.py checks replayed
results bitwise against the interface's.

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

__all__ = ["launch", "ENABLED", "counts", "pop_counts", "FORWARD_CACHE"]

ENABLED = True
FORWARD_CACHE = "_flash_attn_fwd"  # the interface function whose compile cache holds the forward kernel
counts = {"recorded": 0, "replayed": 0, "refused": 0}  # refused: calls run through the interface, no record
_ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach"})
_MAX_RECORDS = 256


@dataclass(frozen=True)
class _Record:
    kernel: Callable  # the compiled forward kernel
    args: tuple  # the recorded call's arguments, None in the five slots (no reference to its tensors)
    slots: tuple[int, ...]  # where q, k, v, out, lse go


_records: dict = {}  # (id(owner), key, stream, layout) -> (weakref to owner, _Record or None)
_lock = threading.Lock()  # one recording at a time: the interface's caches are module state


def launch(owner, key, tensors: tuple[Tensor, ...], call: Callable[[], object], interface=None) -> None:
    """Run ``call()`` (FA4's forward interface on ``tensors`` = ``(q, k, v, out, lse)``, writing out and lse), or
    its recorded launch with these tensors (module docstring).  ``owner``: the object the call's other arguments
    belong to (the plan; held weakly); ``key``: the caller's scalars; ``interface``: the module holding the compile
    caches (``flash_attn.cute.interface``; a stand-in for the CPU tests)."""
    if not ENABLED or len(tensors) != 5:
        call()
        return
    rkey = (id(owner), key, _stream(tensors[0]), _layout(tensors))
    hit = _records.get(rkey)
    if hit is not None and hit[0]() is owner:
        record = hit[1]
        if record is None:
            counts["refused"] += 1
            call()
            return
        args = list(record.args)
        for slot, t in zip(record.slots, tensors):
            args[slot] = t
        record.kernel(*args)
        counts["replayed"] += 1
        return
    if interface is None:
        from flash_attn.cute import interface
    record = _record(interface, tensors, call)
    counts["recorded" if record is not None else "refused"] += 1
    with _lock:
        if len(_records) >= _MAX_RECORDS:
            _records.clear()
        _records[rkey] = (weakref.ref(owner), record)
    weakref.finalize(owner, _records.pop, rkey, None)


def pop_counts() -> dict:
    """:data:`counts` since the last pop (then zeroed)."""
    got = dict(counts)
    for name in counts:
        counts[name] = 0
    return got


def _stream(t: Tensor):
    return torch._C._cuda_getCurrentStream(t.device.index) if t.is_cuda else None


def _layout(tensors) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors)


class _Recording:
    """A compile cache that records the launches of the kernels it hands out; any use other than ``in``, ``[]`` and
    ``[]=`` marks the recording unusable (and is passed on)."""

    def __init__(self, cache, name: str, launches: list, odd: list):
        self._cache, self._name, self._launches, self._odd = cache, name, launches, odd

    def __contains__(self, key) -> bool:
        return key in self._cache

    def __setitem__(self, key, value) -> None:
        self._cache[key] = value

    def __getitem__(self, key):
        kernel = self._cache[key]

        def recorded(*args, **kwargs):
            self._launches.append((self._name, kernel, args, kwargs))
            return kernel(*args, **kwargs)
        return recorded

    def __getattr__(self, name):
        self._odd.append(f"{self._name}.compile_cache.{name}")
        return getattr(self._cache, name)


class _Writes(TorchDispatchMode):
    """Notes every torch op that is not an allocation or a view (what a replay would skip)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (name in _ALLOCATIONS or (func.is_view and not func._schema.is_mutable)):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _record(interface, tensors, call) -> _Record | None:
    caches = {name: fn for name, fn in vars(interface).items() if hasattr(fn, "compile_cache")}
    launches, odd, saved = [], [], {}
    writes = _Writes()
    with _lock:
        try:
            for name, fn in caches.items():
                saved[name] = fn.compile_cache
                fn.compile_cache = _Recording(fn.compile_cache, name, launches, odd)
            with writes:
                call()
        finally:
            for name, cache in saved.items():
                caches[name].compile_cache = cache
    if odd or writes.ops or len(launches) != 1:
        return None
    name, kernel, args, kwargs = launches[0]
    if name != FORWARD_CACHE or kwargs:
        return None
    slots = []
    for t in tensors:
        found = [i for i, a in enumerate(args) if isinstance(a, Tensor) and _same(a, t)]
        if len(found) != 1:
            return None
        slots.append(found[0])
    if len(set(slots)) != len(slots):
        return None
    mine = {t.untyped_storage().data_ptr() for t in tensors}
    others = [a for i, a in enumerate(args) if i not in slots]
    if any(t.untyped_storage().data_ptr() in mine for t in _tensors_in(others)):
        return None
    kept = list(args)
    for slot in slots:
        kept[slot] = None
    return _Record(kernel=kernel, args=tuple(kept), slots=tuple(slots))


def _same(a: Tensor, t: Tensor) -> bool:
    return a.data_ptr() == t.data_ptr() and a.shape == t.shape and a.stride() == t.stride() and a.dtype == t.dtype


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
