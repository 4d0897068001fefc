"""Dense decompositions of tree attention (treecompile/ops/dense_tree_attention.py).

On CPU the cuDNN / flash entry points are replaced by float64 math with the same contracts (output
and natural-log log-sum-exp of the scaled scores forward; gradients from a given output and
log-sum-exp backward), so what is checked is the decomposition itself: the segment plan, the key
gathers, the log-sum-exp merge, the split backward and the scatter-add of key gradients, against the
dense tree mask to float64 rounding.  On CUDA the real kernels run against an fp64 oracle.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from treecompile.ops import dense_tree_attention as dta
from tests.conftest import CUDA
from tests.strategies import ODD_TREES, path_sets
from tests.test_flex_tree_attention import ancestor_mask, random_paths, tree_batch
from treecompile import Tree
from treecompile.ops.tree_attention import tree_attention_reference


def _mask(lq, lk, causal):
    """cuDNN's dense causal mask is top-left aligned; varlen (flash) is bottom-right aligned."""
    m = torch.ones(lq, lk, dtype=torch.bool)
    return m.tril() if causal else m


def _math_fwd(q, k, v, mask, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = s.logsumexp(-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def _math_bwd(do, q, k, v, out, lse, mask, scale):
    s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse[..., None])
    ds = p * (do @ v.transpose(-1, -2) - (do * out).sum(-1, keepdim=True))
    return (ds @ k) * scale, (ds.transpose(-1, -2) @ q) * scale, p.transpose(-1, -2) @ do


def fake_dense_fwd(q, k, v, causal, scale):
    o, lse = _math_fwd(q, k, v, _mask(q.shape[2], k.shape[2], causal), scale)
    return o, lse[..., None], torch.tensor(0), torch.tensor(0)  # lse [1, H, m, 1] as cuDNN returns it


def fake_dense_bwd(do, q, k, v, out, lse, seed, offset, causal, scale):
    assert lse.shape == (*q.shape[:3], 1)
    return _math_bwd(do, q, k, v, out, lse[..., 0], _mask(q.shape[2], k.shape[2], causal), scale)


def _varlen_loop(plan):
    cu_q, cu_k = plan.bounds_q, plan.bounds_k
    for j in range(plan.num_segments):
        yield slice(cu_q[j], cu_q[j + 1]), slice(cu_k[j], cu_k[j + 1])


def fake_varlen_fwd(q, k, v, plan, scale):  # q [T, H, D], k/v [N, Hkv, D]: GQA, bottom-right causal
    rep = q.shape[1] // k.shape[1]
    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], dtype=q.dtype)
    for sq, sk in _varlen_loop(plan):
        qs, ks, vs = q[sq].transpose(0, 1), k[sk].transpose(0, 1), v[sk].transpose(0, 1)
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        m = dta._bottom_right_causal(qs.shape[1], ks.shape[1], q.device)
        o, l_ = _math_fwd(qs, ks, vs, m, scale)
        out[sq], lse[:, sq] = o.transpose(0, 1), l_
    return out, lse, (None, None)


def fake_varlen_bwd(do, q, k, v, out, lse, rng, plan, scale):
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for sq, sk in _varlen_loop(plan):
        t = lambda x: x.transpose(0, 1)  # noqa: E731
        ks, vs = t(k[sk]).repeat_interleave(rep, 0), t(v[sk]).repeat_interleave(rep, 0)
        m = dta._bottom_right_causal(sq.stop - sq.start, sk.stop - sk.start, q.device)
        gq, gk, gv = _math_bwd(t(do[sq]), t(q[sq]), ks, vs, t(out[sq]), lse[:, sq], m, scale)
        dq[sq] = t(gq)
        dk[sk] = t(gk.unflatten(0, (k.shape[1], rep)).sum(1))
        dv[sk] = t(gv.unflatten(0, (v.shape[1], rep)).sum(1))
    return dq, dk, dv


@pytest.fixture
def math_kernels(monkeypatch):
    monkeypatch.setattr(dta, "_cudnn_dense_fwd", fake_dense_fwd)
    monkeypatch.setattr(dta, "_cudnn_dense_bwd", fake_dense_bwd)
    monkeypatch.setitem(dta.KERNELS, "math", (fake_varlen_fwd, fake_varlen_bwd))


def _trees():
    yield from ((name, tree_batch(p).subtree_end) for name, p in ODD_TREES.items())
    yield "random300", tree_batch(random_paths(300, seed=3)).subtree_end
    yield "padded200->256", tree_batch(random_paths(200, seed=4), 256).subtree_end
    # one-token segments, a lone root, a forest, padding: every special case of the segmented pieces
    yield "lone_tokens", tree_batch([[1, 2, 3], [1, 2, 4], [1, 5], [6], [7, 8], [7, 9, 10], [7, 9, 11]], 16).subtree_end


TREES = dict(_trees())


def _run(fn, se, H=4, Hkv=2, D=8, seed=0):
    T = se.numel()
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, T, D, dtype=torch.float64, generator=g).requires_grad_() for h in (H, Hkv, Hkv))
    do = torch.randn(1, H, T, D, dtype=torch.float64, generator=g)
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), do)]


def _assert_matches_dense(fn, se, seed=0):
    want = _run(lambda q, k, v: tree_attention_reference(q, k, v, se), se, seed=seed)
    got = _run(fn, se, seed=seed)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        # relative to the largest entry, absolute where the gradient is ~0 (a lone token's dq is exactly 0)
        err = float((a - b).abs().max() / b.abs().max().clamp(min=1.0))
        assert err < 1e-12, f"{name}: error {err:.3g}"


def _plan_mask(plan: dta.VarlenTreePlan) -> torch.Tensor:
    """The [T, T] mask the plan implies: segment queries see their keys bottom-right causally."""
    T = plan.seq_len
    m = torch.zeros(T, T, dtype=torch.bool)
    cu_q, cu_k = plan.bounds_q, plan.bounds_k
    for j in range(plan.num_segments):
        keys = plan.kv_index[cu_k[j]:cu_k[j + 1]]
        lq, lk = cu_q[j + 1] - cu_q[j], keys.numel()
        m[cu_q[j]:cu_q[j + 1]][:, keys] = dta._bottom_right_causal(lq, lk, "cpu")
    return m


@pytest.mark.parametrize("name", sorted(TREES))
def test_plan_is_the_tree_mask(name):
    b_se = TREES[name]
    plan = dta.tree_varlen_plan(b_se, max_matrix_entries=64)  # tiny chunks: the chunked path is exercised
    assert plan.cu_q[0] == 0 and plan.cu_q[-1] == b_se.numel()
    T = b_se.numel()
    k = torch.arange(T)
    dense = (k[None, :] <= k[:, None]) & (k[:, None] < b_se[None, :])
    assert torch.equal(_plan_mask(plan), dense)
    assert plan.path_tokens == int(dense.sum(1)[plan.cu_q[1:].long() - 1].sum())  # keys = each leaf's path


@settings(max_examples=40, deadline=None)
@given(path_sets())
def test_plan_matches_path_ancestors(paths):
    b = Tree.from_paths(paths).to_batch()
    plan = dta.tree_varlen_plan(b.subtree_end)
    assert torch.equal(_plan_mask(plan), ancestor_mask(b.pred_index))


@pytest.mark.parametrize("name", sorted(TREES))
def test_reference_loop_equals_dense_mask(name):
    se = TREES[name]
    plan = dta.tree_varlen_plan(se)
    _assert_matches_dense(lambda q, k, v: dta.varlen_tree_attention_reference(q, k, v, plan), se)


@pytest.mark.parametrize("name", sorted(TREES))
def test_segmented_decomposition_is_exact(name, math_kernels):
    se = TREES[name]
    plan = dta.tree_varlen_plan(se)
    _assert_matches_dense(lambda q, k, v: dta.segmented_tree_attention(q, k, v, plan), se)


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("native_gqa", [True, False])
def test_varlen_gather_and_scatter_are_exact(name, native_gqa, math_kernels):
    se = TREES[name]
    plan = dta.tree_varlen_plan(se)
    _assert_matches_dense(lambda q, k, v: dta.varlen_tree_attention(q, k, v, plan, backend="math",
                                                                     native_gqa=native_gqa), se)


def test_segment_pieces_cover_each_segment_once():
    se = TREES["lone_tokens"]
    plan = dta.tree_varlen_plan(se)
    segs = dta._segment_pieces(plan)
    lone = [(s, e) for s, e, pieces in segs if not pieces]
    assert lone and all(e - s == 1 for s, e in lone)  # tokens that see only themselves
    for s, e, pieces in segs:
        if e - s > 1:
            assert pieces[0] == (s, e, True)  # the segment itself, causally; then its prefix, fully


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name,T,pad", [("tree3000", 3000, None), ("padded1000", 1000, 1024)])
def test_segmented_cudnn_vs_fp64_oracle(name, T, pad):
    b = tree_batch(random_paths(T, seed=T), pad).to("cuda")
    se = b.subtree_end
    plan = dta.tree_varlen_plan(se)
    H, Hkv, D, dtype = 16, 8, 128, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, se.numel(), D, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv))
    do = torch.randn(1, H, se.numel(), D, device="cuda", generator=g).to(dtype)

    def run(fn, dt):
        qq, kk, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
        o = fn(qq, kk, vv)
        o.backward(do.to(dt))
        return [o.detach(), qq.grad, kk.grad, vv.grad]

    oracle = run(lambda a, b_, c: tree_attention_reference(a, b_, c, se), torch.float64)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = run(lambda a, b_, c: tree_attention_reference(a, b_, c, se), dtype)
    got = run(lambda a, b_, c: dta.segmented_tree_attention(a, b_, c, plan), dtype)
    u = torch.finfo(dtype).eps / 2
    rel = lambda x, y: float((x.double() - y).norm() / y.norm())  # noqa: E731
    for nm, f, r, o in zip(("out", "dq", "dk", "dv"), got, ref, oracle):
        ef, er = rel(f, o), rel(r, o)
        assert ef <= 2 * er + u, f"{nm}: segmented error {ef:.3g} > 2 * dense bf16 error {er:.3g} + {u:.1g}"
