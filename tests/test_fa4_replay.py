"""ops/fa4_replay.py: FA4's varlen calls recorded once per plan and replayed for the later layers.

CPU: stand-in interfaces (compile caches, "kernels" whose writes torch does not see, as CuTe launches') show what is
replayed and each refusal.  The forward's stand-in writes the caller's out / lse in one launch (a combine launch
after it replays too); the backward's has FA4's shape: it allocates its dk / dv results and scratch buffers (empty,
zero-filled, a view of one passed on), and makes five launches.  Replayed: the recorded kernels on the later call's
tensors and new buffers, the interface not run, results equal to the interface's.  Refused (the interface runs
every time, same results): a torch write, a device read, a keyword launch, another use of a cache, a tensor the
call did not pass as given, one tensor in two places, an argument sharing a tensor's storage, a tensor that is
neither the call's, its buffer's nor the owner's, a fill of part of a buffer, a buffer no launch takes as a
tensor, a result from elsewhere.  Also the keys (owner alive, caller key, kind, layout), that a record holds no
tensor of its first call, another thread's launches, and the switches.  GPU: tests/test_varlen_tree_attention.py (``test_fa4_forward_replay_is_bitwise_the_
interface``, ``test_fa4_backward_replay_is_bitwise_the_interface``).
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
    m.scratch = torch.zeros(1, dtype=torch.float64)

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
        if how.get("global"):  # a tensor neither the call's nor the owner's: its first value would be replayed
            aux = Aux(tensors=(m.scratch,))
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
                      owned=(plan.cu,), interface=m)
    return out, lse


def _expected(m, plan, seed, scale=0.5, **kw):
    q, k, v, out, lse = _tensors(seed, **kw)
    m._flash_attn_fwd(q, k, v, softmax_scale=scale, cu=plan.cu, out=out, lse=lse)
    return out, lse


def _counts(recorded=0, replayed=0, refused=0, kind="forward"):
    other = {"recorded": 0, "replayed": 0, "refused": 0}
    return {k: ({"recorded": recorded, "replayed": replayed, "refused": refused} if k == kind else dict(other))
            for k in fa4_replay.KINDS}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(fa4_replay, "_records", {})
    monkeypatch.setattr(fa4_replay, "counts", _counts())
    monkeypatch.setattr(fa4_replay, "ENABLED", True)
    monkeypatch.setattr(fa4_replay, "BACKWARD", True)


def test_later_calls_replay_the_recorded_launch_with_their_tensors():
    m, plan = make_interface(), Plan()
    results = [_call(m, plan, _tensors(seed)) for seed in range(4)]
    assert m.calls == 1  # the interface ran for the first call only
    assert fa4_replay.counts == _counts(recorded=1, replayed=3)
    ref = make_interface()
    for seed, (out, lse) in enumerate(results):
        e_out, e_lse = _expected(ref, plan, seed)
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse)


@pytest.mark.parametrize("how", ["write", "read", "odd_cache", "copy_q", "alias", "twice", "keywords", "global"])
def test_calls_that_cannot_be_shown_to_be_the_recorded_one_run_the_interface(how):
    m, plan = make_interface(**{how: True}), Plan()
    results = [_call(m, plan, _tensors(seed)) for seed in range(3)]
    assert m.calls == 3
    assert fa4_replay.counts == _counts(refused=3)
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
    assert m.calls == 5 and fa4_replay.counts == _counts(recorded=5)
    out, lse = _call(m, plan, _tensors(5, transpose_q=True))
    assert m.calls == 5 and fa4_replay.counts == _counts(recorded=5, replayed=1)
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
    assert m.calls == 3 and fa4_replay._records == {} and fa4_replay.counts == _counts()


def test_a_combine_launch_after_the_kernel_replays_too():
    """A split forward's second launch (FA4's combine) is one more recorded step."""
    m, plan = make_interface(combine=True), Plan()
    results = [_call(m, plan, _tensors(seed)) for seed in range(3)]
    assert m.calls == 1 and fa4_replay.counts == _counts(recorded=1, replayed=2)
    ref = make_interface(combine=True)
    for seed, (out, lse) in enumerate(results):
        e_out, e_lse = _expected(ref, plan, seed)
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        fa4_replay.launch(Plan(), (), _tensors(0), lambda: None, kind="sideways")



# ---------------------------------------------------------------- the backward: buffers it allocates, five launches
def _pre(out, dout, dpsum, lse, dq_accum, cu):
    with _disable_current_modes():
        dpsum.copy_((out * dout).sum(-1).T - lse + cu.sum())
        dq_accum.zero_()


def _main(q, k, v, dout, dpsum, dq_accum, dk_accum, dv_accum, scale, cu):
    """Accumulates into its buffers: the result depends on dk / dv accum starting at zero."""
    with _disable_current_modes():
        T = q.shape[0]
        D = q.shape[-1]  # the first D entries of each head's row are padding
        dq_accum[:, D:].view(q.shape[1], T, D).add_((q * dpsum.T[..., None] * scale).transpose(0, 1) + 1)
        Hk = k.shape[1]
        per_kv_head = dout.unflatten(1, (Hk, -1)).sum(2) * scale  # [T, Hk, D]
        dk_accum[:, : T * k.shape[-1]].add_(per_kv_head.transpose(0, 1).reshape(Hk, -1))
        dv_accum.add_(v.transpose(0, 1).reshape(v.shape[1], -1) * 0.5)


def _post(accum, grad, scale):
    with _disable_current_modes():
        if accum.dim() == 3:  # dQ's: a [T, H, D] view of its buffer
            grad.copy_(accum * scale)
        else:
            grad.copy_((accum.reshape(-1)[: grad.numel()] * scale).view(grad.transpose(0, 1).shape).transpose(0, 1))


def make_bwd_interface(**how):
    """A module with the shape of FA4's varlen backward: its dk / dv results and scratch buffers allocated in the
    call (dq too unless given), dk / dv accumulators zero-filled, five launches from three compile caches, a view of
    a buffer passed to the dQ conversion."""
    m = types.ModuleType("stand_in_bwd_interface")
    m.calls = 0
    m.scratch = torch.zeros(2, 3, dtype=torch.float64)

    def _flash_attn_bwd(q, k, v, out, dout, lse, scale, causal, *, cu, dq=None):
        m.calls += 1
        (T, H, D), (Tk, Hk, Dv) = q.shape, v.shape
        dq = torch.empty_like(q) if dq is None else dq
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        dq_accum = torch.empty(H, (T + 1) * D, dtype=torch.float64)
        dpsum = torch.empty(H, T, dtype=torch.float64)
        dk_accum = torch.zeros(Hk, Tk * D, dtype=torch.float64)
        dv_accum = q.new_zeros((Hk, Tk * Dv))
        if how.get("partial_zero"):
            dk_accum[:, :1].zero_()
        if how.get("fill"):
            dv_accum.fill_(0.0)
        if how.get("unread_buffer"):  # a buffer no launch takes as a tensor (as if passed by raw pointer)
            m.pointer = torch.empty(3, dtype=torch.float64).data_ptr()
        for name, fn in (("pre", _pre), ("main", _main), ("post", _post)):
            cache = getattr(m, f"_bwd_{name}").compile_cache
            if name not in cache:
                cache[name] = fn
        m._bwd_pre.compile_cache["pre"](out, dout, dpsum, lse, dq_accum, cu)
        m._bwd_main.compile_cache["main"](q, k, v, dout, dpsum, dq_accum, dk_accum, dv_accum, scale, cu)
        post = m._bwd_post.compile_cache["post"]
        post(dq_accum[:, D:].view(H, T, D).transpose(0, 1), dq, scale)
        post(dk_accum, dk, 1.0)
        post(dv_accum, dv, 1.0)
        if how.get("elsewhere"):
            return dq, dk, m.scratch
        return dq, dk, dv

    for name in ("_flash_attn_bwd", "_bwd_pre", "_bwd_main", "_bwd_post"):
        fn = _flash_attn_bwd if name == "_flash_attn_bwd" else (lambda: None)
        fn.compile_cache = {}
        setattr(m, name, fn)
    return m


def _bwd_tensors(seed, T=6, H=2, Hk=1, D=3, dq=False):
    g = torch.Generator().manual_seed(seed)
    q, out, dout = (torch.randn(T, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = (torch.randn(T + 2, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    lse = torch.randn(H, T, generator=g, dtype=torch.float64)
    return (q, k, v, out, dout, lse) + ((torch.empty(T, H, D, dtype=torch.float64),) if dq else ())


def _bwd_call(m, plan, tensors, scale=0.5):
    q, k, v, out, dout, lse, *dq = tensors
    return fa4_replay.launch(
        plan, (scale, False), tensors,
        lambda: m._flash_attn_bwd(q, k, v, out, dout, lse, scale, True, cu=plan.cu, dq=dq[0] if dq else None),
        kind="backward", owned=(plan.cu,), interface=m)


@pytest.mark.parametrize("dq", [False, True], ids=["dq_allocated", "dq_given"])
def test_backward_replays_its_buffers_and_launches(dq):
    m, plan = make_bwd_interface(), Plan()
    got = [_bwd_call(m, plan, _bwd_tensors(seed, dq=dq)) for seed in range(4)]
    assert m.calls == 1 and fa4_replay.counts == _counts(recorded=1, replayed=3, kind="backward")
    ref = make_bwd_interface()
    for seed, grads in enumerate(got):
        tensors = _bwd_tensors(seed, dq=dq)
        expected = ref._flash_attn_bwd(*tensors[:6], 0.5, True, cu=plan.cu, dq=tensors[6] if dq else None)
        assert len(grads) == 3 and all(torch.equal(a, b) for a, b in zip(grads, expected))
    if dq:  # the given dq is written in place, as the interface does
        t = _bwd_tensors(9, dq=True)
        assert _bwd_call(m, plan, t)[0] is t[6]
    # each replay's buffers are its own: the results of different calls do not share storage
    storages = {g.untyped_storage().data_ptr() for grads in got for g in grads}
    assert len(storages) == 3 * len(got)


@pytest.mark.parametrize("how", ["partial_zero", "fill", "elsewhere", "unread_buffer"])
def test_backward_calls_that_cannot_be_shown_to_replay_run_the_interface(how):
    m, plan = make_bwd_interface(**{how: True}), Plan()
    got = [_bwd_call(m, plan, _bwd_tensors(seed)) for seed in range(3)]
    assert m.calls == 3 and fa4_replay.counts == _counts(refused=3, kind="backward")
    ref = make_bwd_interface(**{how: True})
    for seed, grads in enumerate(got):
        expected = ref._flash_attn_bwd(*_bwd_tensors(seed), 0.5, True, cu=plan.cu)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_backward_replay_off_runs_the_backward_interface_only(monkeypatch):
    monkeypatch.setattr(fa4_replay, "BACKWARD", False)
    m, plan = make_bwd_interface(), Plan()
    for seed in range(3):
        _bwd_call(m, plan, _bwd_tensors(seed))
    fm = make_interface()
    for seed in range(3):
        _call(fm, plan, _tensors(seed))
    assert m.calls == 3 and fm.calls == 1
    assert fa4_replay.counts == _counts(recorded=1, replayed=2, kind="forward")


def test_the_forward_and_backward_of_one_plan_keep_separate_records():
    m, bm, plan = make_interface(), make_bwd_interface(), Plan()
    for seed in range(2):
        _call(m, plan, _tensors(seed))
        _bwd_call(bm, plan, _bwd_tensors(seed))
    assert m.calls == 1 and bm.calls == 1 and len(fa4_replay._records) == 2


def test_another_threads_launches_are_not_recorded():
    import threading

    steps, odd = [], []
    rec = fa4_replay._Recording({"k": _kernel}, "c", steps, odd, threading.get_ident())
    got = []
    th = threading.Thread(target=lambda: got.append(rec["k"]))
    th.start()
    th.join()
    assert got == [_kernel] and rec["k"] is not _kernel and not steps
