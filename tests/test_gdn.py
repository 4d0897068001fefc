"""The GDN reference: chunked == recurrent, varlen == separate runs, explicit backward == autograd,
and agreement with HF's pure-torch kernels within their own float32 rounding."""

import pytest
import torch

from treecompile.ops import gdn
from tests.conftest import DEVICES

F64 = torch.float64


def make_inputs(B, T, Hk, Hv, Dk, Dv, *, seed=0, device="cpu", dtype=F64, f32_exact=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    u = lambda *s: torch.rand(*s, generator=gen)
    xs = [r(B, T, Hk, Dk), r(B, T, Hk, Dk), r(B, T, Hv, Dv), -u(B, T, Hv) * 0.5, u(B, T, Hv), r(B, Hv, Dk, Dv)]
    if f32_exact:  # values exactly representable in float32, so HF's input cast is exact
        xs = [x.float() for x in xs]
    return [x.to(device=device, dtype=dtype) for x in xs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (129, 64), (63, 16), (129, 7), (40, 1)],
                         ids=lambda x: str(x))
def test_chunked_equals_recurrent(device, T, chunk):
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 4, 8, 6, device=device)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, s1 = gdn.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, **kw)
    o2, s2 = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o1.dtype == F64 and o1.shape == v.shape and s1.shape == h0.shape
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-12)


def test_chunked_gradients_equal_recurrent():
    xs = [x.requires_grad_() for x in make_inputs(1, 37, 1, 2, 4, 3, seed=1)]
    outs = []
    for fn in (lambda *a, **k: gdn.chunk_gated_delta_rule(*a, chunk_size=8, **k), gdn.recurrent_gated_delta_rule):
        o, s = fn(*xs[:5], initial_state=xs[5], output_final_state=True, use_qk_l2norm_in_kernel=True)
        w = torch.linspace(-1, 1, o.numel(), dtype=F64).reshape(o.shape)
        outs.append(torch.autograd.grad((o * w).sum() + s.sum(), xs))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_varlen_equals_separate_runs():
    lengths = [5, 1, 17, 9]
    T = sum(lengths)
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 2, 4, 5, seed=2)
    h0 = torch.randn(len(lengths), 2, 4, 5, dtype=F64)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    o, s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      chunk_size=4, use_qk_l2norm_in_kernel=True)
    for i in range(len(lengths)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        oi, si = gdn.recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                                initial_state=h0[i:i + 1], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, sl], oi, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(s[i:i + 1], si, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_explicit_backward_equals_autograd(chunk):
    q, k, v, g, beta, h0 = make_inputs(2, 23, 2, 2, 4, 3, seed=3)
    q, k = gdn.prepare_qk(q, k, 2, scale=None, use_qk_l2norm_in_kernel=True)
    xs = [x.detach().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, s = gdn.core_forward_recurrent(*xs)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    want = torch.autograd.grad((o * do).sum() + (s * ds).sum(), xs)
    got = gdn.core_backward(*[x.detach() for x in xs], do, ds, chunk_size=chunk)
    for name, a, b in zip("q k v g beta h0".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_l2norm_backward():
    x = torch.randn(5, 7, dtype=F64, requires_grad=True)
    dy = torch.randn(5, 7, dtype=F64)
    (want,) = torch.autograd.grad((gdn.l2norm(x) * dy).sum(), x)
    torch.testing.assert_close(gdn.l2norm_backward(x.detach(), dy), want, rtol=1e-12, atol=1e-14)


def test_matches_hf_within_its_float32_rounding():
    """HF's kernels compute in float32 whatever the input dtype.  With float32-exact inputs, HF's
    error is its internal rounding; its chunked and recurrent kernels are two mathematically equal
    float32 computations, so their difference measures that rounding.  Our float64 result must lie
    within a small multiple of it (a wrong decay or a leaked state is O(1) off)."""
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 4, 8, 8, seed=4, f32_exact=True)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_c, s_c = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    o_r, s_r = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kw)
    ours_o, ours_s = gdn.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    budget_o = (o_c.double() - o_r.double()).abs().max()
    budget_s = (s_c.double() - s_r.double()).abs().max()
    assert 0 < budget_o < 1e-4
    assert (ours_o - o_c.double()).abs().max() <= 4 * budget_o
    assert (ours_o - o_r.double()).abs().max() <= 4 * budget_o
    assert (ours_s - s_c.double()).abs().max() <= 4 * budget_s


def test_bad_shapes_raise():
    q, k, v, g, beta, h0 = make_inputs(1, 8, 2, 3, 4, 4)
    with pytest.raises(ValueError, match="multiple"):
        gdn.chunk_gated_delta_rule(q, k, v, g, beta)
    q, k, v, g, beta, h0 = make_inputs(1, 8, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="g: expected"):
        gdn.chunk_gated_delta_rule(q, k, v, g[:, :5], beta)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gdn.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 4, 8]))
    with pytest.raises(ValueError, match="initial_state"):
        gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0[:, :1])
