"""``treecompile::moe_experts_grouped`` (grouped GEMMs, no host sync) against ``treecompile::moe_experts``.

CPU: float32 (``torch._grouped_mm`` takes no float64).  Both the grouped op and the reference op run in
float32 on the same inputs and are compared with the float64 reference op (and the dense
``moe_experts_reference``): the grouped op's error, forward and all four gradients, must stay within
4x the float32 reference op's own error plus 2 float32 ulp of the result's norm (for the routing
weights' gradient, of its dot products' terms: the two ops contract it over different axes).
Triton's CPU interpreter (``TRITON_INTERPRET=1``, where triton imports): the op with its Triton kernels
(``ops/moe_triton.py``: the activation, its backward, the sum over ``k``) within the same bounds, and each kernel
against the torch ops it replaces (float32: to rounding of the order of the sums; bfloat16: within one bf16 ulp of
float64 math on the same inputs, rounded once).
GPU (``-m gpu``, sm90): bfloat16 at a Qwen3-30B-A3B layer shape against the op in float32, within 2x
the bfloat16 reference op's error, no host sync, exact zeros for experts without tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import run_interpreted
from treecompile.ops import moe, moe_grouped, moe_triton

OPS = torch.ops.treecompile
EPS32 = torch.finfo(torch.float32).eps


def moe_case(T, D, I, E, k, sentinels=0.0, unused=0, seed=0, dtype=torch.float64, device="cpu"):
    """Inputs ``(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)``: top-k of random router
    logits with the last ``unused`` experts never routed to, and a fraction ``sentinels`` of the pairs set to
    the sentinel ``E``; drawn in float64 on ``device``, then cast to ``dtype``."""
    f64 = dict(generator=torch.Generator(device=device).manual_seed(seed), dtype=torch.float64, device=device)
    logits = torch.randn(T, E, **f64)
    logits[:, E - unused:] = -torch.inf
    w, idx = logits.softmax(-1).topk(k, dim=-1)
    idx[torch.rand(T, k, **f64) < sentinels] = E
    ins = (torch.randn(T, D, **f64), idx, w, torch.randn(E, 2 * I, D, **f64) / D ** 0.5,
           torch.randn(E, D, I, **f64) / I ** 0.5)
    return [x.to(dtype) if x.is_floating_point() else x for x in ins]


def run(op, ins, grad_out):
    """``op`` forward and its four gradients (hidden, weights, gate_up_proj, down_proj)."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in ins]
    out = op(*leaves)
    grads = torch.autograd.grad(out, [x for x in leaves if x.requires_grad], grad_out.to(out.dtype))
    return [out.detach(), *grads]


NAMES = ["out", "d_hidden", "d_weights", "d_gate_up_proj", "d_down_proj"]


def error(a, oracle):
    return float((a.double() - oracle).norm())


def d_weights_terms(ins, grad_out):
    """``[T, k]``: sum_i |g_i a_i| + sum_d |dout_d y_d| per routed pair, ``g = dout @ down_proj[e]``: the
    magnitudes of the two dot products ``d_w = <g, a> = <dout, y>`` (the grouped op contracts over I, the
    reference op over D, so their float32 rounding is set by different cancellations)."""
    hidden, idx, _, gu, down = ins
    e = idx.clamp(max=gu.shape[0] - 1)
    gate, up = torch.einsum("td,tkfd->tkf", hidden, gu[e]).chunk(2, dim=-1)
    a = torch.nn.functional.silu(gate) * up
    g = torch.einsum("td,tkdi->tki", grad_out, down[e])
    y = torch.einsum("tki,tkdi->tkd", a, down[e])
    return (g * a).abs().sum(-1) + (grad_out[:, None] * y).abs().sum(-1)


def check_within_float32_rounding(ins64, grad_out):
    """The grouped op in float32 vs the reference op in float32, both against float64 oracles: the grouped
    op's error at most 4x the reference op's plus 2 ulp of float32 (4 unit roundoffs) of the result's norm,
    or for ``d_w`` of its dot products' terms (:func:`d_weights_terms`)."""
    ins32 = [x.float() if x.is_floating_point() else x for x in ins64]
    oracles = run(moe.moe_experts, ins64, grad_out), run(moe.moe_experts_reference, ins64, grad_out)
    ref32 = run(moe.moe_experts, ins32, grad_out)
    got = run(OPS.moe_experts_grouped, ins32, grad_out)
    w_terms = float(d_weights_terms(ins64, grad_out).norm())
    for name, g, r, *os_ in zip(NAMES, got, ref32, *oracles):
        for o in os_:
            floor = 2 * EPS32 * (w_terms if name == "d_weights" else float(o.norm()))
            assert error(g, o) <= 4 * error(r, o) + floor, (name, error(g, o), error(r, o), floor)
    return got


@settings(max_examples=15, deadline=None)
@given(T=st.integers(0, 12), k=st.integers(1, 3), E=st.integers(1, 6), D=st.sampled_from([4, 8, 12]),
       I=st.sampled_from([4, 8]), sentinels=st.sampled_from([0.0, 0.3]), unused=st.integers(0, 2),
       seed=st.integers(0, 2 ** 16))
def test_grouped_op_equals_reference_within_float32_rounding(T, k, E, D, I, sentinels, unused, seed):
    """Random shapes (T = 0 and 1, k = 1, duplicates, experts without tokens, sentinels): forward and all
    four gradients within the float32 reference's own rounding; unused experts' and sentinel pairs'
    gradients exactly 0."""
    k, unused = min(k, E), min(unused, E - min(k, E))
    ins = moe_case(T, D, I, E, k, sentinels=sentinels, unused=unused, seed=seed)
    go = torch.randn(T, D, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    _, _, d_w, d_gu, d_down = check_within_float32_rounding(ins, go)
    idx = ins[1]
    assert torch.all(d_w[idx == E] == 0)
    used = torch.zeros(E + 1, dtype=torch.bool)
    used[idx.reshape(-1)] = True
    assert torch.all(d_gu[~used[:E]] == 0) and torch.all(d_down[~used[:E]] == 0)


def test_grouped_op_fixed_cases():
    """A busy expert, one token routed twice to one expert, an idle expert, sentinels; T = 1 with k = 1."""
    ins = moe_case(16, 8, 4, 5, 2, unused=1, seed=3)
    ins[1][:6, 0] = 1
    ins[1][7] = torch.tensor([2, 2])
    ins[1][9, 1] = 5
    go = torch.randn(16, 8, dtype=torch.float64)
    check_within_float32_rounding(ins, go)
    check_within_float32_rounding(moe_case(1, 4, 4, 3, 1, seed=4), torch.randn(1, 4, dtype=torch.float64))


def test_empty_groups_zeroed_where_the_kernel_is_not_relied_on(monkeypatch):
    """The explicit zeroing of idle experts' weight gradients (taken off sm90 on CUDA) keeps the result."""
    ins = [x.float() if x.is_floating_point() else x for x in moe_case(10, 8, 4, 6, 2, unused=2, seed=5)]
    go = torch.randn(10, 8)
    want = run(OPS.moe_experts_grouped, ins, go)
    monkeypatch.setattr(moe_grouped, "_kernel_zeroes_empty_groups", lambda device: False)
    got = run(OPS.moe_experts_grouped, ins, go)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.all(got[3][4:] == 0) and torch.all(got[4][4:] == 0)


def test_grouped_op_opcheck():
    ins = [x.float() if x.is_floating_point() else x for x in moe_case(9, 8, 4, 4, 2, sentinels=0.2, seed=6)]
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in ins]
    torch.library.opcheck(OPS.moe_experts_grouped.default, tuple(leaves))
    torch.library.opcheck(OPS.moe_experts_grouped_backward.default, (torch.randn(9, 8), *ins))


def test_grouped_op_bad_arguments():
    hidden, idx, w, gu, down = [x.float() if x.is_floating_point() else x for x in moe_case(13, 8, 4, 4, 2)]
    bad = idx.clone()
    bad[7, 0] = 5
    with pytest.raises(ValueError, match=r"top_k_index\[7, 0\] = 5 is outside \[0, 4\]"):
        moe_grouped.moe_experts_grouped(hidden, bad, w, gu, down)
    bad[7, 0] = -1
    with pytest.raises(ValueError, match=r"top_k_index\[7, 0\] = -1 is outside \[0, 4\]"):
        moe_grouped.moe_experts_grouped(hidden, bad, w, gu, down)
    with pytest.raises(ValueError, match="down_proj"):
        moe_grouped.moe_experts_grouped(hidden, idx, w, gu, down[:, :, :-1])
    with pytest.raises(ValueError, match="share one dtype"):
        moe_grouped.moe_experts_grouped(hidden.double(), idx, w, gu.double(), down.double())
    with pytest.raises(ValueError, match="share one dtype"):
        moe_grouped.moe_experts_grouped(hidden, idx, w, gu.bfloat16(), down)
    with pytest.raises(ValueError, match="D=6 and I=4 must be multiples of 4"):
        moe_grouped.moe_experts_grouped(hidden[:, :6], idx, w, gu[:, :, :6], down[:, :6])


_INTERPRETED = r"""
import torch
from tests.helpers import count_launches
from tests.test_moe_grouped import check_within_float32_rounding, moe_case
from treecompile.ops import moe_grouped, moe_triton

launched = {name: count_launches(moe_triton, name)
            for name in ("_activation_kernel", "_activation_bwd_kernel", "_sum_over_k_kernel")}
worst = {"f32": 0.0, "bf16_ulps": 0.0}

# the whole op (forward and its four gradients) within the float32 reference op's rounding, as on the torch path
for seed, (T, D, I, E, k, sentinels, unused) in enumerate([(13, 8, 4, 5, 2, 0.3, 1), (40, 136, 132, 7, 3, 0.1, 2),
                                                         (1, 4, 4, 3, 1, 0.0, 0), (0, 8, 4, 2, 2, 0.0, 0)]):
    ins = moe_case(T, D, I, E, k, sentinels=sentinels, unused=unused, seed=seed)
    go = torch.randn(T, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    check_within_float32_rounding(ins, go)
assert all(launched.values()), {n: len(v) for n, v in launched.items()}

# each kernel against the torch ops it replaces, float32: P and I not multiples of the blocks
g = torch.Generator().manual_seed(1)
P, I, D, T, k = 37, 140, 133, 9, 4
h = torch.randn(P, 2 * I, generator=g) * 3
w = torch.rand(P, generator=g)
w[5] = 0
gr = torch.randn(P, I, generator=g)
gate, up = h.chunk(2, dim=-1)
want = [torch.nn.functional.silu(gate) * up * w[:, None], *moe_grouped._activation_backward(h, gr.clone(), w)]
got = [moe_triton.activation(h, w), *moe_triton.activation_backward(h, gr, w)]
rows = torch.randn(T * k, D, generator=g)
inv = torch.randperm(T * k, generator=g)
want.append(rows.index_select(0, inv).view(T, k, D).sum(1))
got.append(moe_triton.sum_over_k(rows, inv, T, k))
for x, r in zip(got, want):
    worst["f32"] = max(worst["f32"], float((x - r).abs().max() / r.abs().max()))

# bfloat16 inputs: float32 math rounded once, against float64 math on the same inputs
def ulps(x, exact):
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=1e-30))) - 7)
    return float(((x.double() - exact).abs() / (ulp + 1e-6 * exact.abs().max())).max())

hb, wb, gb, rb = h.bfloat16(), w.bfloat16(), gr.bfloat16(), rows.bfloat16()
gd, ud = hb.double().chunk(2, dim=-1)
sig = torch.sigmoid(gd)
a = gd * sig * ud
da = gb.double() * wb.double()[:, None]
exact = [a * wb.double()[:, None], torch.cat([da * ud * sig * (1 + gd * (1 - sig)), da * gd * sig], 1),
         a * wb.double()[:, None], rb.double().index_select(0, inv).view(T, k, D).sum(1)]
dh, aw, dw = moe_triton.activation_backward(hb, gb, wb)
for x, e in zip([moe_triton.activation(hb, wb), dh, aw, moe_triton.sum_over_k(rb, inv, T, k)], exact):
    worst["bf16_ulps"] = max(worst["bf16_ulps"], ulps(x, e))
worst["bf16_dw"] = float(((dw.double() - (gb.double() * a).sum(-1)).abs() / (gb.double() * a).abs().sum(-1)).max())
print(repr(worst))
"""


@pytest.mark.skipif(not moe_triton.triton, reason="triton is not importable")
def test_triton_kernels_in_interpreter():
    """The op with its Triton kernels (Triton's CPU interpreter): forward and all four gradients within the float32
    reference op's rounding (random cases with sentinels, idle experts, k = 1, T = 0; I and D not multiples of the
    blocks); each kernel equal to the torch ops it replaces in float32 to the rounding of a sum's order, and in
    bfloat16 within one bf16 ulp of float64 math on the same inputs (float32 math, rounded once; the interpreter
    truncates where the GPU rounds to nearest), ``<g, a>`` to float32 rounding of its terms."""
    worst = run_interpreted(_INTERPRETED)
    assert worst["f32"] <= 8 * EPS32, worst  # a few float32 ulps of the largest value: the same math reordered
    assert worst["bf16_ulps"] <= 1, worst
    assert worst["bf16_dw"] <= 140 * EPS32, worst  # float32 sum of I = 140 terms, relative to their magnitudes


# ---------------------------------------------------------------- GPU (sm90)
def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs a CUDA device of compute capability 9.x (Hopper)")
def test_grouped_op_bf16_qwen3_30b_a3b_shape():
    """T=2048 tokens through one Qwen3-30B-A3B MoE layer (D=2048, I=768, E=128, top-8), bfloat16, 8 idle
    experts and 1% sentinel pairs: the grouped op vs the reference op in float32 on the same inputs, forward
    and all four gradients within 2x the bfloat16 reference op's own error; idle experts' gradients exactly
    0; neither op of the pair synchronizes with the host."""
    T, D, I, E, k = 2048, 2048, 768, 128, 8
    ins = moe_case(T, D, I, E, k, sentinels=0.01, unused=8, seed=0, dtype=torch.bfloat16, device="cuda")
    go = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    oracle = run(moe.moe_experts, [x.float() if x.is_floating_point() else x for x in ins], go.float())
    ref = run(moe.moe_experts, ins, go)
    got = run(OPS.moe_experts_grouped, ins, go)
    for name, g, r, o in zip(NAMES, got, ref, oracle):
        rel_g, rel_r = error(g, o.double()) / float(o.norm()), error(r, o.double()) / float(o.norm())
        print(f"{name}: grouped {rel_g:.3e} reference {rel_r:.3e} (relative to the float32 op)")
        assert rel_g <= 2 * rel_r, (name, rel_g, rel_r)
    assert torch.all(got[3][E - 8:] == 0) and torch.all(got[4][E - 8:] == 0)
    assert torch.all(got[2][ins[1] == E] == 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = OPS.moe_experts_grouped(*ins)
        OPS.moe_experts_grouped_backward(go, *ins)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(out, got[0])


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs a CUDA device of compute capability 9.x (Hopper)")
def test_compiled_hf_moe_model_with_grouped_experts(monkeypatch):
    """A tiny HF Qwen3-Next MoE model compiled and run on CUDA (torch.compile, length buckets) in float32,
    once with its experts lowered to moe_experts_grouped (float32 admitted: ``_grouped_mm``'s per-group loop)
    and once with the reference op: loss and every parameter's gradient within 4x the reference lowering's
    error against the float64 per-path oracle on CPU (+ 2 float32 ulp of the norm)."""
    pytest.importorskip("transformers")
    import copy

    import treecompile
    import treecompile.passes.lower_cuda as tc_cuda
    import transformers
    from treecompile import Tree, reference
    from treecompile.models import HybridConfig

    # test_compile_hybrid's tiny Qwen3-Next MoE, with head_dim 16: flex attention on CUDA needs >= 16
    d = HybridConfig.tiny(vocab_size=37, model_type="qwen3_next", num_experts=4, head_dim=16).to_hf_dict()
    cfg = transformers.Qwen3NextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    cfg._experts_implementation = "eager"  # the float64 oracle runs HF's own loop
    torch.manual_seed(0)
    model64 = transformers.Qwen3NextForCausalLM(cfg).double()
    paths = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 8, 9], [1, 2, 10], [11, 12, 13]]
    # HF's GDN function runs fla's kernel whenever fla imports, whatever the device (transformers 5.17 on the lent
    # GPU: a Triton "cpu tensor?" error here): the float64 oracle on the CPU runs the torch function it wraps
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next

    with monkeypatch.context() as mp:
        for name in ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"):
            fn = getattr(hf_qwen3_next, name, None)
            if callable(fn) and hasattr(fn, "__wrapped__"):
                mp.setattr(hf_qwen3_next, name, fn.__wrapped__)
        oracle = reference.run(model64, paths)
    names = [n for n, _ in model64.named_parameters()]
    want = [oracle.loss.detach()] + list(torch.autograd.grad(oracle.loss, list(model64.parameters())))
    got = {}
    for grouped in (True, False):
        with monkeypatch.context() as mp:
            if grouped:
                mp.setattr(tc_cuda, "MOE_GROUPED_DTYPES", (torch.float32,))
            else:
                mp.setattr(tc_cuda, "moe_grouped_unusable_reason", lambda: "the reference run")
            model = copy.deepcopy(model64).float().cuda()
            tm = treecompile.compile(model, gdn_kernel="reference", attention_kernel="flex")
            out = tm(Tree.from_paths(paths).to_batch())
            assert tm.program._cuda_state().lowering.moe_grouped == (model.config.num_hidden_layers if grouped else 0)
            got[grouped] = [out.loss.detach()] + list(torch.autograd.grad(out.loss, list(model.parameters())))
    for name, g, r, o in zip(["loss"] + names, got[True], got[False], want):
        floor = 2 * EPS32 * float(o.norm())
        assert error(g.cpu(), o) <= 4 * error(r.cpu(), o) + floor, (name, error(g.cpu(), o), error(r.cpu(), o))
