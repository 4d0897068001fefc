"""ops/fa4_replay.py: FA4's forward launch recorded once per plan and replayed for the later layers.

CPU: a stand-in interface (a compile cache, a "kernel" whose writes torch does not see, as a CuTe launch's) shows
what is replayed (the recorded kernel, the later call's tensors in their places, the interface not run) and each
refusal (two launches, a torch write, a keyword launch, a tensor the call did not pass as given, a tensor in two
places, an argument sharing a tensor's storage, another use of the cache, a device read), the keys (owner alive,
caller key, layout) and that a record holds no tensor of its first call.  GPU: tests/test_varlen_tree_attention.py
(``test_fa4_forward_replay_is_bitwise_the_interface``).
"""

from __future__ import annotations

import gc
import types
import weakref
from typing import NamedTuple

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from treecompile.ops import fa4_replay


class Aux(NamedTuple):
    tensors: tuple | None = None
    scalars: tuple | None = None


def _kernel(q, k, v, out, lse, scale, cu, aux, *more):
    """A launch: writes out and lse from its tensor arguments, unseen by torch's dispatch (as a CuTe kernel's)."""
    with _disable_current_modes():
        out.copy_(q * scale + k[: q.shape[0]] - v[: q.shape[0]] + cu.sum())
        lse.copy_(q.sum(-1).T)


def _combine(out):
    with _disable_current_modes():
        out.mul_(2)


def make_interface(**how):
    """A module with FA4's shape: ``_flash_attn_fwd`` and ``_fwd_combine`` with compile caches; ``how`` picks the
    call's oddity (module docstring)."""
    m = types.ModuleType("stand_in_interface")
    m.calls = 0

    def _flash_attn_fwd(q, k, v, *, softmax_scale, cu, out, lse):
        m.calls += 1
        cache = m._flash_attn_fwd.compile_cache
        key = (q.dtype, q.shape[-1])
        if key not in cache:
            cache[key] = _kernel
        if how.get("write"):
            out.zero_()
        if how.get("read"):
            int(cu[0])
        if how.get("odd_cache"):
            cache.clear
        q_call = q
        if how.get("copy_q"):  # a copy the watch does not see: only the argument search can refuse it
            with _disable_current_modes():
                q_call = q.clone()
        aux = Aux(tensors=(out[:1],)) if how.get("alias") else Aux()
        args = [q_call, k, v, out.detach(), lse, softmax_scale, cu, aux]
        if how.get("twice"):
            args.append(k)
        if how.get("keywords"):
            cache[key](*args[:-1], aux=aux)
        else:
            cache[key](*args)
        if how.get("combine"):
            ccache = m._fwd_combine.compile_cache
            if "c" not in ccache:
                ccache["c"] = _combine
            ccache["c"](out)
    _flash_attn_fwd.compile_cache = {}
    m._flash_attn_fwd = _flash_attn_fwd

    def _fwd_combine():
        pass
    _fwd_combine.compile_cache = {}
    m._fwd_combine = _fwd_combine
    return m


class Plan:
    """An owner: the cu tensor its calls share."""

    def __init__(self, T=6):
        self.cu = torch.tensor([0, 2, T], dtype=torch.float64)


def _tensors(seed, T=6, H=2, D=3, transpose_q=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    if transpose_q:
        q = q.transpose(0, 1).contiguous().transpose(0, 1)
    k, v = (torch.randn(T + 2, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.empty(T, H, D, dtype=torch.float64), torch.empty(H, T, dtype=torch.float64)


def _call(m, plan, tensors, scale=0.5):
    q, k, v, out, lse = tensors
    fa4_replay.launch(plan, (scale,), tensors,
                      lambda: m._flash_attn_fwd(q, k, v, softmax_scale=scale, cu=plan.cu, out=out, lse=lse),
                      interface=m)
    return out, lse


def _expected(m, plan, seed, scale=0.5, **kw):
    q, k, v, out, lse = _tensors(seed, **kw)
    m._flash_attn_fwd(q, k, v, softmax_scale=scale, cu=plan.cu, out=out, lse=lse)
    return out, lse


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(fa4_replay, "_records", {})
    monkeypatch.setattr(fa4_replay, "counts", {"recorded": 0, "replayed": 0, "refused": 0})
    monkeypatch.setattr(fa4_replay, "ENABLED", True)


def test_later_calls_replay_the_recorded_launch_with_their_tensors():
    m, plan = make_interface(), Plan()
    results = [_call(m, plan, _tensors(seed)) for seed in range(4)]
    assert m.calls == 1  # the interface ran for the first call only
    assert fa4_replay.counts == {"recorded": 1, "replayed": 3, "refused": 0}
    ref = make_interface()
    for seed, (out, lse) in enumerate(results):
        e_out, e_lse = _expected(ref, plan, seed)
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse)


@pytest.mark.parametrize("how", ["write", "read", "odd_cache", "copy_q", "alias", "twice", "keywords", "combine"])
def test_calls_that_cannot_be_shown_to_be_the_recorded_one_run_the_interface(how):
    m, plan = make_interface(**{how: True}), Plan()
    results = [_call(m, plan, _tensors(seed)) for seed in range(3)]
    assert m.calls == 3
    assert fa4_replay.counts == {"recorded": 0, "replayed": 0, "refused": 3}
    ref = make_interface(**{how: True})
    for seed, (out, lse) in enumerate(results):
        e_out, e_lse = _expected(ref, plan, seed)
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse)


def test_a_recording_puts_the_interface_caches_back_and_keeps_their_kernels():
    m, plan = make_interface(combine=True), Plan()
    caches = (m._flash_attn_fwd.compile_cache, m._fwd_combine.compile_cache)
    _call(m, plan, _tensors(0))
    assert (m._flash_attn_fwd.compile_cache, m._fwd_combine.compile_cache) == caches
    assert all(type(c) is dict and len(c) == 1 for c in caches)


def test_another_owner_key_or_layout_records_again():
    m, plan = make_interface(), Plan()
    _call(m, plan, _tensors(0))
    _call(m, Plan(), _tensors(1))  # another plan
    _call(m, plan, _tensors(2), scale=0.25)  # another caller key
    _call(m, plan, _tensors(3, T=5))  # another shape
    _call(m, plan, _tensors(4, transpose_q=True))  # the same shape, other strides
    assert m.calls == 5 and fa4_replay.counts["recorded"] == 5 and fa4_replay.counts["replayed"] == 0
    out, lse = _call(m, plan, _tensors(5, transpose_q=True))
    assert m.calls == 5 and fa4_replay.counts["replayed"] == 1
    e_out, e_lse = _expected(make_interface(), plan, 5, transpose_q=True)
    assert torch.equal(out, e_out) and torch.equal(lse, e_lse)


def test_records_die_with_their_owner_and_hold_no_tensor_of_their_first_call():
    m, plan = make_interface(), Plan()
    first = _tensors(0)
    _call(m, plan, first)
    refs = [weakref.ref(t) for t in first]
    del first
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(fa4_replay._records) == 1
    del plan
    gc.collect()
    assert fa4_replay._records == {}


def test_disabled_always_runs_the_interface(monkeypatch):
    monkeypatch.setattr(fa4_replay, "ENABLED", False)
    m, plan = make_interface(), Plan()
    for seed in range(3):
        _call(m, plan, _tensors(seed))
    assert m.calls == 3 and fa4_replay._records == {}
