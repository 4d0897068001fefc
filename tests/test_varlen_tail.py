"""The varlen tree attention's tail (ops/varlen_tail.py): the tokens after the segments that see only themselves.

Against a softmax written out over each token's one key (float64), the torch path on the CPU and the Triton kernels
under Triton's CPU interpreter: every shape of group (one, three and four query heads per kv head), head dims that
are not powers of two and differ between keys and values, strided inputs, an empty tail and a tail that is the whole
sequence; rows before the tail are never written.
"""

import pytest
import torch

from tests.helpers import run_interpreted
from treecompile.ops import varlen_tail
from treecompile.ops.varlen_tree_attention import _lse_rows


def one_key_softmax(q_t, k_t, v_t, dout_t, n, scale):
    """(out, lse, dq, dk, dv) of rows [n, T), each token attending to itself alone, by autograd in float64."""
    q, k, v = (x[n:].double().detach().requires_grad_() for x in (q_t, k_t, v_t))
    r = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = (q * kk).sum(-1, keepdim=True) * scale  # [m, H, 1]: one score per query head
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) * vv
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout_t[n:].double())
    return out.detach(), lse.detach().T, dq, dk, dv


def inputs(T, H, Hkv, D, Dv, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)

    def make(h, d):
        if strided:  # [T, h, d] views of [h, T, d] storage
            return torch.randn(h, T, d, generator=g, dtype=torch.float64).to(dtype).transpose(0, 1)
        return torch.randn(T, h, d, generator=g, dtype=torch.float64).to(dtype)
    return make(H, D), make(Hkv, D), make(Hkv, Dv), make(H, Dv)


def sentinels(T, H, Hkv, D, Dv, dtype):
    """Output buffers full of NaN: a row the tail functions should not write stays NaN."""
    nan = float("nan")
    return (torch.full((T, H, Dv), nan, dtype=dtype), torch.full((H, T), nan),
            torch.full((T, H, D), nan, dtype=dtype), torch.full((T, Hkv, D), nan, dtype=dtype),
            torch.full((T, Hkv, Dv), nan, dtype=dtype))


CASES = [  # T, H, Hkv, D, Dv, n, strided
    (9, 4, 4, 40, 24, 5, False), (9, 6, 2, 40, 24, 5, True), (7, 8, 2, 16, 16, 0, False), (6, 3, 1, 8, 5, 6, True),
    (11, 4, 1, 33, 40, 10, False),
]


@pytest.mark.parametrize("T,H,Hkv,D,Dv,n,strided", CASES)
def test_tail_torch_path_is_the_one_key_softmax_and_writes_only_the_tail(T, H, Hkv, D, Dv, n, strided, monkeypatch):
    monkeypatch.setattr(varlen_tail, "usable", lambda t: False)  # the torch path (as on a CPU without the interpreter)
    q, k, v, do = inputs(T, H, Hkv, D, Dv, torch.float64, seed=T + n, strided=strided)
    out, lse, dq, dk, dv = sentinels(T, H, Hkv, D, Dv, torch.float64)
    varlen_tail.tail_forward(q, k, v, out, lse, n, 0.3)
    varlen_tail.tail_backward(do, dq, dk, dv, n)
    want = one_key_softmax(q, k, v, do, n, 0.3)
    for got, ref, rows in zip((out, lse, dq, dk, dv), want, (0, 1, 0, 0, 0)):
        tail = got[n:] if rows == 0 else got[:, n:]
        head = got[:n] if rows == 0 else got[:, :n]
        assert head.isnan().all()  # rows before the tail untouched
        # the float64 result is exact up to the dot product's rounding (lse, against float32 storage)
        tol = 1e-6 if rows == 1 else 1e-14
        torch.testing.assert_close(tail.double(), ref, rtol=tol, atol=tol)
    assert (dq[n:] == 0).all() and (dk[n:] == 0).all()


def test_lse_rows_are_read_in_place_where_fa4_takes_them():
    """FA4's backward copies an lse whose rows are not 16-byte aligned (``maybe_contiguous``), a copy that keeps its
    call from being replayed: those get one contiguous copy here, the others are the forward's lse itself."""
    aligned, odd = torch.zeros(4, 12), torch.zeros(4, 10)  # rows of 48 and 40 bytes
    rows = _lse_rows(aligned, 7)
    assert rows.data_ptr() == aligned.data_ptr() and rows.stride() == (12, 1) and rows.shape == (4, 7)
    rows = _lse_rows(odd, 7)
    assert rows.is_contiguous() and rows.data_ptr() != odd.data_ptr() and torch.equal(rows, odd[:, :7])
    assert _lse_rows(odd, 10).data_ptr() == odd.data_ptr()  # no tail: the contiguous whole, as it is
    shifted = torch.zeros(4 * 12 + 1)[1:].view(4, 12)  # rows of 48 bytes from a start 4 bytes off
    rows = _lse_rows(shifted, 7)
    assert rows.is_contiguous() and torch.equal(rows, shifted[:, :7])
    every_other = torch.zeros(4, 24)[:, ::2]  # [4, 12], aligned rows, a last dim that is not contiguous
    assert _lse_rows(every_other, 7).is_contiguous()


def op_against_reference(dtypes=(torch.float64, torch.bfloat16)) -> dict:
    """The op (forward and every gradient) on padded, unpadded and all-padding batches, GQA groups of 1, 2 and 4,
    keeping the gathered rows or not, under ``torch.use_deterministic_algorithms(True)``: every tensor made by
    ``empty`` is NaN-filled there, so a row nobody writes is a NaN in the results.  Returns the worst float64 error
    against the dense reference and whether any result held a NaN."""
    from tests.helpers import deterministic_algorithms
    from treecompile import Tree
    from treecompile.ops.tree_attention import tree_attention_reference
    from treecompile.ops.varlen_tree_attention import tree_attention_varlen

    paths = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]
    batches = {"padded": Tree.from_paths(paths).to_batch(pad_to_multiple=16).subtree_end,
               "unpadded": Tree.from_paths(paths).to_batch().subtree_end, "all padding": torch.arange(1, 10)}
    worst = {"float64": 0.0, "nan": 0}
    with deterministic_algorithms():
        for se in batches.values():
            for (H, Hkv), dtype, keep in ((hs, dt, kp) for hs in ((4, 1), (4, 2), (2, 2)) for dt in dtypes
                                           for kp in ("none", "all")):
                T = se.numel()
                g = torch.Generator().manual_seed(T + H)
                q, k, v = (torch.randn(1, T, h, 24, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)
                           .requires_grad_() for h in (H, Hkv, Hkv))
                do = torch.randn(1, H, T, 24, generator=g, dtype=torch.float64).to(dtype)
                out = tree_attention_varlen(q, k, v, se, scale=0.3, keep=keep)
                got = (out, *torch.autograd.grad(out, (q, k, v), do))
                worst["nan"] += sum(int(x.detach().isnan().any()) for x in got)
                if dtype == torch.float64:
                    ref = tree_attention_reference(q, k, v, se, scale=0.3)
                    ref = (ref, *torch.autograd.grad(ref, (q, k, v), do))
                    errors = (float((x - r).detach().abs().max()) for x, r in zip(got, ref))
                    worst["float64"] = max(worst["float64"], *errors)
    return worst


def test_op_writes_every_row_torch_path():
    """The op's torch paths (a CPU without Triton's interpreter: the key sums by ``index_add_``, the tail by torch
    ops) with uninitialised memory NaN-filled: no NaN, float64 equal to the dense reference."""
    worst = op_against_reference()
    assert worst["nan"] == 0 and worst["float64"] < 1e-12, worst


_INTERPRETED = r"""
import torch
from tests.helpers import count_launches
from tests.test_varlen_tail import CASES, inputs, one_key_softmax, sentinels
from treecompile.ops import varlen_tail

fwd = count_launches(varlen_tail, "_tail_fwd_kernel")
bwd = count_launches(varlen_tail, "_tail_bwd_kernel")
def mx(x):
    return float(x.max()) if x.numel() else 0.0


worst = {"float64": 0.0, "lse": 0.0, "bf16_ulps": 0.0, "head_written": 0.0, "grads_nonzero": 0.0}
for i, (T, H, Hkv, D, Dv, n, strided) in enumerate(CASES):
    for dtype in (torch.float64, torch.bfloat16):
        q, k, v, do = inputs(T, H, Hkv, D, Dv, dtype, seed=i, strided=strided)
        out, lse, dq, dk, dv = sentinels(T, H, Hkv, D, Dv, dtype)
        varlen_tail.tail_forward(q, k, v, out, lse, n, 0.3)
        varlen_tail.tail_backward(do, dq, dk, dv, n)
        ref = one_key_softmax(q, k, v, do, n, 0.3)
        worst["head_written"] += sum(int(not x[:n].isnan().all()) for x in (out, dq, dk, dv))
        worst["head_written"] += int(not lse[:, :n].isnan().all())
        worst["grads_nonzero"] += int((dq[n:] != 0).any()) + int((dk[n:] != 0).any())
        # lse: accumulated in float32 (float64), stored float32
        worst["lse"] = max(worst["lse"], mx((lse[:, n:].double() - ref[1]).abs() / ref[1].abs().clamp(min=1)))
        if dtype == torch.float64:
            for got, want in ((out[n:], ref[0]), (dv[n:], ref[4])):
                worst["float64"] = max(worst["float64"], mx((got - want).abs()))
        else:  # the value rows exact; the group sums accumulated in float32 and rounded once (truncated here)
            worst["float64"] = max(worst["float64"], mx((out[n:].double() - ref[0]).abs()))
            want = ref[4]
            ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=1e-30))) - 7)
            worst["bf16_ulps"] = max(worst["bf16_ulps"], mx((dv[n:].double() - want).abs() / ulp))
assert len(fwd) == len(bwd) == 2 * sum(T > n for T, _, _, _, _, n, _ in CASES), (len(fwd), len(bwd))
# the kernels index last dims as contiguous: any other layout is refused, not misread
q, k, v, do = inputs(9, 4, 2, 8, 8, torch.float64, seed=0)
out, lse, dq, dk, dv = sentinels(9, 4, 2, 8, 8, torch.float64)
refused = 0
for args in ((q.transpose(1, 2).contiguous().transpose(1, 2), k, v, out, lse), (q, k, v, out, lse.T.contiguous().T)):
    try:
        varlen_tail.tail_forward(*args, 5, 0.3)
    except ValueError:
        refused += 1
try:
    varlen_tail.tail_backward(do, dq, dk.transpose(1, 2).contiguous().transpose(1, 2), dv, 5)
except ValueError:
    refused += 1
worst["refused"] = refused
# the op with the kernels, uninitialised memory NaN-filled (the key sums leave the rows after the segments to the
# tail kernel)
from tests.test_varlen_tail import op_against_reference
op = op_against_reference()
worst["op_nan"], worst["op_float64"] = op["nan"], op["float64"]
print(worst)
"""


def test_tail_kernels_in_interpreter():
    """The Triton kernels (Triton's CPU interpreter) on every case above, float64 and bf16: the value rows copied
    exactly, the group sums within one bf16 unit of the float64 sum (float32 accumulation rounded once; the
    interpreter truncates), the lse within float32's rounding, zero query / key gradients, nothing before the tail."""
    pytest.importorskip("triton")
    worst = run_interpreted(_INTERPRETED)
    assert worst["head_written"] == 0 and worst["grads_nonzero"] == 0 and worst["refused"] == 3
    assert worst["op_nan"] == 0 and worst["op_float64"] < 1e-12, worst
    assert worst["float64"] <= 1e-14 and worst["lse"] <= 1e-6 and worst["bf16_ulps"] <= 1.0, worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tail_kernels_on_cuda(dtype):
    """The Triton kernels on the GPU, every case above: nothing written before the tail, the value rows exact, the
    scores and the group sums within float32 accumulation's error (a float32 unit of the sum of the terms'
    magnitudes per term) plus one rounding to the stored dtype (half a unit: the GPU rounds to nearest) of the
    float64 results."""
    for i, (T, H, Hkv, D, Dv, n, strided) in enumerate(CASES):
        q, k, v, do = (x.cuda() for x in inputs(T, H, Hkv, D, Dv, dtype, seed=i, strided=strided))
        out, lse, dq, dk, dv = (x.cuda() for x in sentinels(T, H, Hkv, D, Dv, dtype))
        varlen_tail.tail_forward(q, k, v, out, lse, n, 0.3)
        varlen_tail.tail_backward(do, dq, dk, dv, n)
        ref = one_key_softmax(q, k, v, do, n, 0.3)
        assert all(x[:n].isnan().all() for x in (out, dq, dk, dv)) and lse[:, :n].isnan().all()
        assert (dq[n:] == 0).all() and (dk[n:] == 0).all() and torch.equal(out[n:].double(), ref[0])
        r = H // Hkv
        # the scores: D products summed in float32, then stored as float32
        qk = 0.3 * (q[n:].double() * k[n:].double().repeat_interleave(r, 1)).abs().sum(-1).T
        assert ((lse[:, n:].double() - ref[1]).abs() <= D * 2.0 ** -24 * qk + 2.0 ** -24 * ref[1].abs()).all()
        bits = 7 if dtype == torch.bfloat16 else 23  # mantissa bits of the stored dtype
        ulp = torch.exp2(torch.floor(torch.log2(ref[4].abs().clamp(min=1e-30))) - bits)
        magnitude = do[n:].double().abs().unflatten(1, (Hkv, r)).sum(2)
        assert ((dv[n:].double() - ref[4]).abs() <= 0.5 * ulp + (r - 1) * 2.0 ** -24 * magnitude + 1e-30).all()


def test_backward_refuses_key_sums_that_do_not_cover_the_segments():
    """The backward leaves the key sums' rows from the segments' end to the tail kernel: sums that stopped short of
    the segments (a plan whose copies disagree with its tail) would leave rows unwritten, so it raises instead."""
    import dataclasses

    from treecompile import Tree
    from treecompile.ops import varlen_tree_attention as vta

    b = Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch(pad_to_multiple=8)
    plan = vta.segment_plan(b.subtree_end)
    assert 0 < plan.tail < b.seq_len and plan.copies.tokens == plan.tail
    T, g = b.seq_len, torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, T, 4, generator=g, dtype=torch.float64) for _ in range(4))
    out, lse, *_ = vta._forward(q, k, v, plan, 0.5)
    vta._backward_grads(q, k, v, out, lse, do, plan, 0.5)  # the plan as built
    short = dataclasses.replace(plan, copies=dataclasses.replace(plan.copies, tokens=plan.tail - 1))
    with pytest.raises(AssertionError, match="key copies cover"):
        vta._backward_grads(q, k, v, out, lse, do, short, 0.5)
