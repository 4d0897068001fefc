"""Boundary tree attention as varlen attention over node segments (treecompile/ops/varlen_boundary_attention.py).

CPU: the plan expands to exactly the ``[boundary ; local]`` mask (hypothesis trees, forests, padding, boundary lengths
constant per subtree as a redundancy-free partition has them and arbitrary per token); the op (plan, gather of both
sources, the copy sums into boundary and local rows, the tail, autograd) equals the dense-mask reference in float64
to rounding, both K/V head forms, opcheck and AOT autograd; bad inputs are refused naming the token or the shape;
redundancy-free partitions through the lowering's varlen boundary attention equal the whole tree (loss, log-probs,
every gradient), and partitions whose segments would gather too much run the flex lowering.  GPU (``-m gpu``,
flash-attn-4 on sm_90+): FA4's varlen kernel through the op within 2x the bf16 dense kernel's error against a
float64 oracle, and a redundancy-free step on CUDA through it equal to the whole tree.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import ODD_TREES, path_sets
from tests.test_fa4_tree_attention import forest_paths
from tests.test_varlen_tree_attention import plan_mask
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta
from treecompile.ops.tree_attention_boundary import boundary_tree_mask, tree_attention_boundary_reference
from treecompile.ops.varlen_boundary_attention import (
    boundary_segment_plan,
    boundary_segments_fit,
    tree_attention_boundary_varlen,
)


def piece_visible(subtree_end: torch.Tensor, B: int, rng: random.Random, pad_from: int | None = None) -> torch.Tensor:
    """A boundary length per top-level subtree (a token no earlier token sees starts one), as a partition has them:
    every token of a subtree hangs below the same boundary token; 0 from ``pad_from`` on (the bucket's padding)."""
    se = subtree_end.tolist()
    out, reach, cur = [], 0, 0
    for t, e in enumerate(se):
        if t >= reach:  # a new top-level subtree
            cur = rng.randint(0, B)
        reach = max(reach, e)
        out.append(0 if pad_from is not None and t >= pad_from else cur)
    return torch.tensor(out, dtype=torch.int64)


def _batch(paths, pad_to=None):
    return Tree.from_paths(paths).to_batch(pad_to_multiple=pad_to)


def _inputs(T, B, H, Hkv, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    # the model's layout: [1, T, H, D] storage viewed as [1, H, T, D]; the boundary rows as the executor feeds them
    q, k, v = (torch.randn(1, T, h, D, generator=g, dtype=dtype).transpose(1, 2) for h in (H, Hkv, Hkv))
    bk, bv = (torch.randn(1, Hkv, B, D, generator=g, dtype=dtype) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v, bk, bv)]


def assert_op_is_the_reference(subtree_end, visible, T, B, H, Hkv, seed=0):
    xs = _inputs(T, B, H, Hkv, 8, seed)
    do = torch.randn(1, H, T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    outs = []
    for fn in (tree_attention_boundary_varlen, tree_attention_boundary_reference):
        ys = [x.detach().clone().requires_grad_() for x in xs]
        o = fn(ys[0], ys[1], ys[2], subtree_end, ys[3], ys[4], visible, 0.3)
        o.backward(do)
        outs.append([o.detach()] + [y.grad for y in ys])
    for name, got, want in zip(("out", "dq", "dk", "dv", "d boundary_k", "d boundary_v"), *outs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=name)


# ---------------------------------------------------------------------------- the plan
@settings(max_examples=60, deadline=None)
@given(path_sets(max_paths=8, max_len=10), st.sampled_from([None, 8, 13]), st.integers(0, 12), st.integers(0, 5),
       st.booleans(), st.integers(0, 2**31))
def test_plan_is_the_boundary_mask_hypothesis(paths, pad_to, B, extra_rows, per_token, seed):
    """Every query sees exactly its boundary prefix and its path: boundary lengths per subtree (padding 0) or
    arbitrary per token (segments cut where the length changes, tail tokens that see the boundary made segments),
    boundary K/V rows padded past B (``extra_rows``: a bucket's zero rows, seen by nobody)."""
    b = _batch(paths, pad_to)
    T, rng = b.seq_len, random.Random(seed)
    if per_token:
        visible = torch.tensor([rng.randint(0, B) for _ in range(T)], dtype=torch.int64)
    else:
        visible = piece_visible(b.subtree_end, B, rng, pad_from=Tree.from_paths(paths).num_tokens)
    Bs = B + extra_rows
    plan = boundary_segment_plan(b.subtree_end, visible, Bs)
    assert torch.equal(plan_mask(plan, T, Bs), boundary_tree_mask(b.subtree_end, visible, Bs))
    assert plan.copies.tokens == (Bs + plan.tail if plan.tail else 0)
    # the whole-tree plan's tail, less the tokens up to the last one that sees boundary rows (the padding stays)
    seen = visible.nonzero()
    assert plan.tail == max(vta.segment_plan(b.subtree_end).tail, int(seen[-1, 0]) + 1 if seen.numel() else 0)


def test_a_partition_with_no_boundary_is_the_whole_tree_plan():
    b = _batch(forest_paths(300, 3, seed=2), 16)
    T = b.seq_len
    plan = boundary_segment_plan(b.subtree_end, torch.zeros(T, dtype=torch.int64), 0)
    whole = vta.segment_plan(b.subtree_end)
    assert plan.cu_seqlens_q_host == whole.cu_seqlens_q_host and plan.cu_seqlens_k_host == whole.cu_seqlens_k_host
    assert torch.equal(plan.key_index, whole.key_index) and plan.tail == whole.tail


# ---------------------------------------------------------------------------- the op, float64
@pytest.mark.parametrize("kv_heads", ["grouped", "expanded"])
@pytest.mark.parametrize("name,H,Hkv,B,pad_to,per_token", [
    ("forest", 6, 2, 37, 16, False), ("one_token_nodes", 4, 2, 5, 8, True), ("prefix_of_other", 2, 2, 0, None, False),
    ("single_token", 2, 1, 3, 4, True), ("forest", 4, 4, 64, None, True), ("duplicates", 4, 2, 1, 13, False)])
def test_op_equals_the_dense_reference_float64(name, H, Hkv, B, pad_to, per_token, kv_heads, monkeypatch):
    """Out and the gradients of q, k, v and both boundary tensors equal the dense-mask reference's to rounding; the
    rows no query sees (boundary rows past every query's length) get zero gradients."""
    monkeypatch.setattr(vta, "KV_HEADS", kv_heads)
    paths = forest_paths(200, 3, seed=1) if name == "forest" else ODD_TREES[name]
    b = _batch(paths, pad_to)
    T, rng = b.seq_len, random.Random(B + H)
    visible = (torch.tensor([rng.randint(0, B) for _ in range(T)], dtype=torch.int64) if per_token else
               piece_visible(b.subtree_end, B, rng))
    assert_op_is_the_reference(b.subtree_end, visible, T, B, H, Hkv)


@settings(max_examples=25, deadline=None)
@given(path_sets(max_paths=6, max_len=8), st.sampled_from([None, 8]), st.integers(0, 9), st.integers(0, 2**31),
       st.sampled_from([(2, 1), (4, 2), (2, 2)]))
def test_op_equals_the_dense_reference_hypothesis(paths, pad_to, B, seed, heads):
    b = _batch(paths, pad_to)
    visible = piece_visible(b.subtree_end, B, random.Random(seed), pad_from=Tree.from_paths(paths).num_tokens)
    assert_op_is_the_reference(b.subtree_end, visible, b.seq_len, B, *heads, seed=seed % 1000)


def test_opcheck_and_aot_autograd():
    b = _batch(forest_paths(40, 2, seed=3), 8)
    T = b.seq_len
    visible = piece_visible(b.subtree_end, 6, random.Random(0), pad_from=T - 3)
    q, k, v, bk, bv = _inputs(T, 6, 4, 2, 8, seed=0)
    torch.library.opcheck(torch.ops.treecompile.tree_attention_boundary_varlen_fwd.default,
                          (q, k, v, b.subtree_end, bk, bv, visible, 0.35))
    f = torch.compile(lambda *xs: (tree_attention_boundary_varlen(*xs[:3], b.subtree_end, *xs[3:], visible, 0.35)
                                   * 1.5).sum(), backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(f(q, k, v, bk, bv), (q, k, v, bk, bv))
    ref = torch.autograd.grad((tree_attention_boundary_reference(q, k, v, b.subtree_end, bk, bv, visible, 0.35)
                               * 1.5).sum(), (q, k, v, bk, bv))
    for x, r in zip(got, ref):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12)


def test_bad_inputs_are_named():
    b = _batch([[1, 2, 3], [1, 4]])
    T = b.seq_len
    q, k, v, bk, bv = (x.detach() for x in _inputs(T, 4, 2, 1, 8, seed=0))
    ok = torch.tensor([1, 1, 2, 2], dtype=torch.int64)[:T]
    with pytest.raises(ValueError, match=r"boundary_visible\[2\] = 5: expected 0 <= boundary_visible\[t\] <= 4"):
        tree_attention_boundary_varlen(q, k, v, b.subtree_end, bk, bv, torch.tensor([0, 1, 5, 2])[:T])
    with pytest.raises(ValueError, match=r"boundary_visible\[0\] = -1"):
        tree_attention_boundary_varlen(q, k, v, b.subtree_end, bk, bv, torch.tensor([-1, 1, 1, 2])[:T])
    with pytest.raises(ValueError, match="boundary_visible must be int64"):
        tree_attention_boundary_varlen(q, k, v, b.subtree_end, bk, bv, ok.int())
    with pytest.raises(ValueError, match=r"boundary_k must be \[1, 1, B, 8\]"):
        tree_attention_boundary_varlen(q, k, v, b.subtree_end, bk[:, :, :, :4], bv, ok)
    with pytest.raises(ValueError, match="4 boundary key rows, 3 value rows"):
        tree_attention_boundary_varlen(q, k, v, b.subtree_end, bk, bv[:, :, :3], ok)
    bad_se = b.subtree_end.clone()
    bad_se[1] = T + 1
    with pytest.raises(ValueError, match=r"subtree_end\[1\]"):
        tree_attention_boundary_varlen(q, k, v, bad_se, bk, bv, ok)


def test_a_deep_partition_below_a_long_boundary_does_not_fit():
    """Many one-token segments that each read a long boundary: past ``VARLEN_GATHER_LIMIT`` x the rows the lowering
    takes flex (``boundary_segments_fit``); a partition whose segments read little fits."""
    comb = [list(range(i + 1)) + [100 + i] for i in range(40)]  # a spine with a leaf at every token
    b = _batch(comb)
    T, B = b.seq_len, 400
    assert not boundary_segments_fit(b.subtree_end, torch.full((T,), B, dtype=torch.int64), B)
    assert boundary_segments_fit(b.subtree_end, torch.zeros(T, dtype=torch.int64), B)


def test_fit_check_and_plan_lay_out_a_partition_once(monkeypatch):
    """``TreeProgram``'s fit check and the op's plan of the same partition tensors share one layout (host work per
    partition, not per layer); the plan is kept for every layer; another partition builds its own."""
    from treecompile.ops import varlen_boundary_attention as vba

    calls = []
    layout = vba._layout
    monkeypatch.setattr(vba, "_layout", lambda *a: calls.append(a) or layout(*a))
    monkeypatch.setattr(vba, "_LAYOUTS", vba.LastBatch())
    monkeypatch.setattr(vba, "_PLANS", vba.LastBatch())
    b = _batch(forest_paths(50, 2, seed=6), 8)
    visible = piece_visible(b.subtree_end, 7, random.Random(2), pad_from=b.num_tokens)
    assert boundary_segments_fit(b.subtree_end, visible, 7)
    xs = [x.detach() for x in _inputs(b.seq_len, 7, 2, 1, 8, seed=0)]
    for _ in range(3):  # three layers
        tree_attention_boundary_varlen(*xs[:3], b.subtree_end, *xs[3:], visible)
    assert len(calls) == 1
    tree_attention_boundary_varlen(*xs[:3], b.subtree_end, *xs[3:], visible.clone())
    assert len(calls) == 2


def test_auto_runs_partitions_the_segments_cannot_take_through_the_flex_lowering(monkeypatch):
    """The per-batch choice of ``TreeProgram`` for a boundary program under "auto": a partition whose segments fit
    runs the varlen lowering, one of many short segments below a long boundary the flex lowering, with one warning.
    The two lowerings are real (CPU, reference kernels); their runners report which one ran."""
    import warnings

    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile.passes import lower_cuda as lc
    from treecompile.program import _CudaState

    prog = cached_compile(cached_model("dense-tiny", tiny_dense), boundary=True).program
    monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q=None: None)
    monkeypatch.setattr(lc, "HALF", lc.HALF + (torch.float64,))  # the tiny float64 model as a half one
    monkeypatch.setattr(lc, "AUTO_SEGMENTS_HEAD_DIMS", (8,))  # its head dim as one FA4's varlen kernel takes
    options = lc.CudaOptions(compile_cuda=False, bucket=False, gdn_kernel="reference")
    for varlen, name in ((True, "varlen"), (False, "flex")):
        low = lc.lower_cuda(prog.graph_module, options, boundary=True, varlen=varlen)
        assert (low.boundary_varlen > 0) == varlen and (low.attention > 0) != varlen
        monkeypatch.setattr(prog, "_cuda" if varlen else "_cuda_flex",
                            _CudaState(low, lambda *args, name=name: (name,)))

    def call(batch, B, visible):
        ins = []
        for kind, layer in prog.boundary.inputs:
            if kind in ("boundary_k", "boundary_v"):
                ins.append(torch.zeros(1, 2, B, 8, dtype=torch.float64))  # tiny: 2 kv heads of 8
            elif kind == "boundary_visible":
                ins.append(visible)
            else:
                ins.append(torch.zeros(1, 1, dtype=torch.float64))
        return prog._run_cuda(batch, ins)

    forest = Tree.from_paths([[t % 97 for t in p] for p in forest_paths(60, 2, seed=4)]).to_batch()
    comb = Tree.from_paths([list(range(1, i + 1)) + [50 + i] for i in range(1, 41)]).to_batch()
    monkeypatch.setattr(lc, "_WARNED", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert call(forest, 3, torch.full((forest.seq_len,), 3)) == ("varlen",)
        assert call(comb, 400, torch.full((comb.seq_len,), 400)) == ("flex",)
        assert call(comb, 400, torch.full((comb.seq_len,), 400)) == ("flex",)
        assert call(comb, 400, torch.zeros(comb.seq_len, dtype=torch.int64)) == ("varlen",)
    assert len([w for w in caught if "redundancy-free partition" in str(w.message)]) == 1  # once


# ---------------------------------------------------------------------------- GPU
def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from treecompile.ops import fa4_tree_attention as fa4

    return fa4.fa4_unusable_reason()


GPU_CASES = [(300, 1, 128, 200, 4, 2, 128), (2900, 3, 3072, 1500, 16, 8, 128), (1000, 2, None, 700, 8, 8, 64),
             (700, 1, 1024, 0, 4, 2, 128)]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("kv_heads", ["grouped", "expanded"])
@pytest.mark.parametrize("T,roots,pad_to,B,H,Hkv,D", GPU_CASES,
                         ids=[f"T{c[0]}_r{c[1]}_pad{c[2]}_B{c[3]}_H{c[4]}kv{c[5]}_D{c[6]}" for c in GPU_CASES])
def test_fa4_varlen_boundary_vs_fp64_oracle(T, roots, pad_to, B, H, Hkv, D, kv_heads, monkeypatch):
    """FA4's varlen kernel through the op, bf16: the output and the gradients of q, k, v and both boundary tensors
    within 2x the bf16 dense kernel's error (SDPA's math kernel under the same ``[T, B + T]`` mask) against a
    float64 oracle, plus half a bf16 unit."""
    from tests.test_flex_tree_attention import rel_err

    monkeypatch.setattr(vta, "KV_HEADS", kv_heads)
    b = Tree.from_paths(forest_paths(T, roots, seed=T + D)).to_batch(pad_to_multiple=pad_to, device="cuda")
    L = b.seq_len
    visible = piece_visible(b.subtree_end.cpu(), B, random.Random(T), pad_from=b.num_tokens).cuda()
    g = torch.Generator(device="cuda").manual_seed(T)
    xs = [torch.randn(1, L, h, D, device="cuda", generator=g).transpose(1, 2) for h in (H, Hkv, Hkv)]
    xs += [torch.randn(1, Hkv, B, D, device="cuda", generator=g) for _ in range(2)]
    do = torch.randn(1, H, L, D, device="cuda", generator=g)
    scale = D ** -0.5

    def run(fn, dt):
        ys = [x.detach().to(dt).requires_grad_() for x in xs]
        o = fn(ys[0], ys[1], ys[2], b.subtree_end, ys[3], ys[4], visible, scale)
        o.backward(do.to(dt))
        return [o.detach()] + [y.grad for y in ys]

    oracle = run(tree_attention_boundary_reference, torch.float64)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = run(tree_attention_boundary_reference, torch.bfloat16)
    got = run(tree_attention_boundary_varlen, torch.bfloat16)
    u = torch.finfo(torch.bfloat16).eps / 2
    for name, f, r, o in zip(("out", "dq", "dk", "dv", "d boundary_k", "d boundary_v"), got, ref, oracle):
        assert torch.isfinite(f).all(), name
        if o.numel() == 0:
            continue
        ef, er = rel_err(f, o), rel_err(r, o)
        assert ef <= 2 * er + u, f"{name}: varlen boundary error {ef:.3g} > 2 * dense bf16 error {er:.3g} + {u:.1g}"


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("compile_cuda", [False, True], ids=["eager_graph", "compiled_graph"])
def test_cuda_partitions_through_fa4_varlen_equal_whole_tree(compile_cuda):
    """A bf16 model of head dim 64 under "auto" (FA4's varlen op for the whole tree and for every partition's
    boundary attention): redundancy-free partitions, padded to buckets, against a float64 oracle (the same bf16
    weights in float64 on the CPU, whose whole tree equals the per-path model to 1e-9 there).  Their loss, log-probs
    and gradients are within 2x the bf16 whole tree's own error, plus one rounding of the compared values (float32
    log-probs, bf16 gradients), and the loss within what its log-probs' errors allow: the partitions lose nothing
    the whole tree keeps."""
    import copy

    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.runtime.partition import partition_redundancy_free
    from treecompile.runtime.redundancy_free import run_redundancy_free

    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny(vocab_size=97, hidden_size=256, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=64)).cuda().bfloat16()
    oracle = copy.deepcopy(model).cpu().double()
    opts = dict(compile_cuda=compile_cuda)
    tmodel, bmodel = treecompile.compile(model, **opts), treecompile.compile(model, boundary=True, **opts)
    g = torch.Generator().manual_seed(1)
    paths = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (300, 250, 40, 180)]
    paths[1][:120] = paths[0][:120]
    paths[2][:30] = paths[0][:30]
    paths[3][:200] = paths[0][:200]
    tree = Tree.from_paths(paths)
    params = list(model.parameters())

    def flat(grads):
        return torch.cat([x.detach().double().cpu().flatten() for x in grads])

    want = treecompile.compile(oracle)(tree.to_batch(normalize="token_mean"))
    g_want = flat(torch.autograd.grad(want.loss, list(oracle.parameters())))
    out = tmodel(tree.to_batch(normalize="token_mean"))
    g_whole = flat(torch.autograd.grad(out.loss, params))
    plan = partition_redundancy_free(tree, 100)
    assert len(plan) > 3 and max(p.parent for p in plan.partitions) >= 0
    for p in params:
        p.grad = None
    res = run_redundancy_free(bmodel, plan, normalize="token_mean")
    g_rf = flat(p.grad for p in params)
    low = bmodel.program._cuda.lowering  # the lowering that ran: varlen boundary attention, bucketed
    assert (low.boundary_varlen, low.attention, low.boundary, low.bucket) == (2, 0, True, True)
    assert low.dynamic == compile_cuda
    assert tmodel.program._cuda.lowering.attention_varlen == 2
    u32, u16 = torch.finfo(torch.float32).eps / 2, torch.finfo(torch.bfloat16).eps / 2

    def err(x, ref, how):
        d = (x.detach().double().cpu() - ref.detach().double().cpu()).abs()
        return float(d.max() if how == "max" else d.mean() if how == "mean" else d.norm() / ref.norm())

    errors = {(name, how): (err(rf, ref, how), err(whole, ref, how), u)
              for name, rf, whole, ref, hows, u in (
                  ("logprobs", res.logprobs, out.logprobs, want.logprobs, ("max", "mean"),
                   u32 * float(want.logprobs.abs().max())),
                  ("grad", g_rf, g_whole, g_want, ("rel",), u16))
              for how in hows}
    # the loss is -sum(w * logprobs) (float32): its error is at most the weighted log-prob errors plus the sum's
    # rounding (log2(T) float32 roundings of sum |w * logprobs|: a pairwise sum) -- derived, not a second 2x test on
    # one scalar, whose error cancels by chance (the whole tree's was 3e-6 relative, the partitions' 1.8e-5)
    w = tree.to_batch(normalize="token_mean").loss_weight.double()
    lp = want.logprobs.detach().double()
    loss_bound = float((w * (res.logprobs.double().cpu() - lp).abs()).sum()
                       + math.ceil(math.log2(len(w))) * u32 * (w * lp).abs().sum())
    e_loss = abs(float(res.loss) - float(want.loss))
    print({"loss": (e_loss, loss_bound), **errors})
    for (name, how), (e_rf, e_whole, u) in errors.items():
        assert e_rf <= 2 * e_whole + u, f"{name} ({how}): partitions' error {e_rf:.3g} > 2 x whole tree's {e_whole:.3g}"
    assert e_loss <= loss_bound, (e_loss, loss_bound)


_INTERPRETED = r"""
import random
import torch
from treecompile import Tree
from treecompile.ops import key_copies, varlen_tail
from treecompile.ops import varlen_tree_attention as vta
from treecompile.ops.tree_attention_boundary import tree_attention_boundary_reference
from treecompile.ops.varlen_boundary_attention import tree_attention_boundary_varlen
from tests.test_fa4_tree_attention import forest_paths
from tests.test_varlen_boundary_attention import _inputs, piece_visible
from tests.helpers import count_launches

gathers = count_launches(key_copies, "_gather_key_values_kernel")  # keys and values, one launch
sums = count_launches(key_copies, "_sum_copies_kernel")
tails = count_launches(varlen_tail, "_tail_bwd_kernel")
torch.use_deterministic_algorithms(True)  # every new tensor NaN-filled: a row no kernel writes would show
worst = 0.0
for kv_heads, B in (("grouped", 40), ("expanded", 40), ("expanded", 0)):
    vta.KV_HEADS = kv_heads
    b = Tree.from_paths(forest_paths(70, 2, seed=5)).to_batch(pad_to_multiple=16)
    T = b.seq_len
    # boundary rows 30-39 seen by no query: their gradients are the sums' empty runs (zero)
    visible = piece_visible(b.subtree_end, min(B, 30), random.Random(1), pad_from=b.num_tokens)
    xs = _inputs(T, B, 4, 2, 8, seed=3)
    do = torch.randn(1, 4, T, 8, dtype=torch.float64)
    res = []
    for fn in (tree_attention_boundary_varlen, tree_attention_boundary_reference):
        ys = [x.detach().clone().requires_grad_() for x in xs]
        o = fn(ys[0], ys[1], ys[2], b.subtree_end, ys[3], ys[4], visible, 0.3)
        o.backward(do)
        res.append([o.detach()] + [y.grad for y in ys])
    for x, r in zip(*res):
        worst = max(worst, float((x - r).abs().max()) if x.numel() else 0.0)
print({"worst": worst, "gathers": len(gathers), "sums": len(sums), "tails": len(tails)})
"""


def test_op_with_its_triton_kernels_in_interpreter():
    """The op through its Triton kernels (Triton's CPU interpreter: the gather reading the boundary rows in place, the
    copy sums over ``[boundary ; local]`` rows with runs no query reads, the tail), in float64 with every new tensor
    NaN-filled, equals the dense-mask reference: out and the gradients of q, k, v and both boundary tensors."""
    from tests.helpers import run_interpreted

    pytest.importorskip("triton")
    got = run_interpreted(_INTERPRETED)
    assert got["worst"] < 1e-12 and got["gathers"] >= 6 and got["sums"] >= 6 and got["tails"] >= 3, got
