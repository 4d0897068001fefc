"""Causal mixers with an exact tree form: token shifts, depthwise causal convs, scans, hand-written
attention (ALiBi, HF BLOOM).  Each rewrite: it fired (count), loss / per-token log-probs / every
parameter gradient equal the per-path reference in float64, and it does not fire on a near miss."""

from __future__ import annotations


import pytest
import torch

import mixer_models as mm
import treecompile
from helpers import flat_grads, rel
from treecompile import Tree, reference
from treecompile.frontend import capture
from treecompile.ops.tree_attention import tree_attention_biased, tree_attention_reference
from treecompile.ops.tree_mixers import tree_ancestors, tree_scan, tree_shift
from treecompile.ops.tree_mixers_ref import (tree_ancestors_reference, tree_scan_reference,
                                             tree_shift_reference)
from treecompile.passes import PassContext, PassError, run_passes
from treecompile.passes.pipeline import PASSES
from tests.conftest import DEVICES

# odd shapes: a path that is a prefix of another, a duplicate, 1-token nodes, fan-out 4 at token 10,
# nodes shorter than the shift k=3 and than the conv kernels (context spans several ancestors), a
# second root with a 2-token path
PATHS = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 9], [1, 2, 3, 9], [1, 2, 10],
         [1, 2, 10, 11, 12, 13, 14, 15], [1, 2, 10, 16], [1, 2, 10, 17, 18], [1, 2, 10, 19], [20, 21],
         [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
EXACT = 1e-9

# (id, model factory, pass, expected count)
REWRITES = [
    ("shift_pad_k1", lambda: mm.ShiftPad(1), "rewrite_token_shifts", 1),
    ("shift_pad_k3", lambda: mm.ShiftPad(3), "rewrite_token_shifts", 1),
    ("shift_cat_k3", lambda: mm.ShiftCat(3), "rewrite_token_shifts", 1),
    ("shift_roll_mask", mm.ShiftRollMask, "rewrite_token_shifts", 1),
    ("conv_padded_k4", mm.ConvPadded, "rewrite_causal_convs", 1),
    ("conv_padded_k6_nobias", lambda: mm.ConvPadded(6, bias=False), "rewrite_causal_convs", 1),
    ("conv_leftpad_dilated", mm.ConvLeftPad, "rewrite_causal_convs", 1),
    ("scans", mm.Scans, "rewrite_scans", 4),
    ("attention", mm.HandAttention, "rewrite_causal_attention", 1),
    ("attention_alibi_relative", lambda: mm.HandAttention(alibi="relative"), "rewrite_causal_attention", 1),
    ("attention_alibi_key", lambda: mm.HandAttention(alibi="key"), "rewrite_causal_attention", 1),
    ("attention_additive_mask", mm.AdditiveMaskAttention, "rewrite_causal_attention", 1),
    ("attention_sliding_window", lambda: mm.HandAttention(window=2), "rewrite_causal_attention", 1),
    ("attention_softcap", lambda: mm.HandAttention(softcap=0.3), "rewrite_causal_attention", 1),
    ("attention_sinks", lambda: mm.HandAttention(sinks=True), "rewrite_causal_attention", 1),
    ("attention_softcap_window_sinks", lambda: mm.HandAttention(softcap=0.5, window=3, sinks=True),
     "rewrite_causal_attention", 1),
    ("attention_sinks_row_max_window", lambda: mm.HandAttention(sinks=True, row_max=True, window=4),
     "rewrite_causal_attention", 1),
    ("attention_softcap_sinks_alibi", lambda: mm.HandAttention(softcap=0.5, sinks=True, alibi="relative"),
     "rewrite_causal_attention", 1),
]

NEAR_MISSES = [
    ("shift_toward_future", mm.ShiftFuture, "rewrite_token_shifts"),
    ("roll_wraps_around", mm.RollWrap, "rewrite_token_shifts"),
    ("conv_not_depthwise", mm.ConvDense, "rewrite_causal_convs"),
    ("conv_centred_padding", mm.ConvCentred, "rewrite_causal_convs"),
    ("cumsum_over_features", mm.CumsumFeatures, "rewrite_scans"),
    ("attention_without_mask", lambda: mm.HandAttention(causal=False), "rewrite_causal_attention"),
    ("attention_hiding_the_query", lambda: mm.HandAttention(hide_self=True), "rewrite_causal_attention"),
    ("attention_bias_per_length", lambda: mm.HandAttention(alibi="per_length"), "rewrite_causal_attention"),
]


_ATEN = torch.ops.aten
_MIXERS = {_ATEN.softmax.int, _ATEN.triu.default, _ATEN.tril.default, _ATEN.matmul.default, _ATEN.bmm.default,
           _ATEN.baddbmm.default, _ATEN.cumsum.default, _ATEN.cumprod.default, _ATEN.logcumsumexp.default,
           _ATEN.conv1d.default, _ATEN.roll.default, _ATEN.pad.default, _ATEN.cat.default}


def _assert_mixers_gone(gm):
    """No sequence mixer of the model (nor its mask subgraph) is left in the rewritten graph."""
    left = [f"{n.name} ({n.target})" for n in gm.graph.nodes if n.op == "call_function" and n.target in _MIXERS
            and any("s" in str(d) for d in getattr(n.meta.get("val"), "shape", ()))]
    assert not left, left


def _compare(model, tmodel, paths=PATHS):
    batch = Tree.from_paths(paths).to_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    out = tmodel(batch)
    ref = reference.run(model, paths)
    lp = max(float((a - r.detach()).abs().max())
             for a, r in zip(batch.path_logprobs(out.logprobs.detach()), ref.logprobs))
    return (rel(out.loss.detach(), ref.loss.detach()), lp,
            rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)))


@pytest.mark.parametrize("factory,name,count", [r[1:] for r in REWRITES], ids=[r[0] for r in REWRITES])
def test_rewrite_fires_and_is_exact(factory, name, count):
    torch.manual_seed(0)
    model = factory().double()
    tmodel = treecompile.compile(model)
    assert tmodel.pass_results[name].count == count
    _assert_mixers_gone(tmodel.graph_module)
    loss, lp, grads = _compare(model, tmodel)
    assert loss <= EXACT and lp <= EXACT and grads <= EXACT, (loss, lp, grads)


def _passes_through(name):
    names = [n for n, _ in PASSES]
    return PASSES[:names.index(name) + 1]


@pytest.mark.parametrize("factory,name", [r[1:] for r in NEAR_MISSES], ids=[r[0] for r in NEAR_MISSES])
def test_rewrite_does_not_fire_on_near_miss(factory, name):
    torch.manual_seed(0)
    captured = capture(factory().double())
    gm = captured.program.graph_module
    ctx = PassContext(gm, captured.input_name)
    results = run_passes(gm, ctx, passes=_passes_through(name))
    assert results[name].count == 0
    assert not any(str(n.target).startswith("treecompile.") and "tree_" in str(n.target)
                   and n.target != torch.ops.treecompile.tree_attention.default for n in gm.graph.nodes)


@pytest.mark.parametrize("factory", [mm.ShiftPad, mm.ConvPadded, mm.Scans, mm.HandAttention],
                         ids=["shift", "conv", "scan", "attention"])
def test_partition_boundary_refuses_mixers_by_name(factory):
    with pytest.raises(PassError, match=r"expose_boundary.*treecompile::tree_\w+ has no partition-boundary form"):
        treecompile.compile(factory().double(), boundary=True)


def test_saved_program_with_every_mixer_loads_and_stays_exact(tmp_path):
    torch.manual_seed(0)
    model = mm.AllMixers().double()
    tmodel = treecompile.compile(model)
    counts = {k: v.count for k, v in tmodel.pass_results.items()}
    assert [counts[k] for k in ("rewrite_token_shifts", "rewrite_causal_convs", "rewrite_scans",
                                "rewrite_causal_attention")] == [1, 1, 1, 1]
    treecompile.save(tmodel, tmp_path / "prog")
    loaded = treecompile.load(tmp_path / "prog")
    batch = Tree.from_paths(PATHS).to_batch()
    a, b = tmodel(batch), loaded(batch)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logprobs, b.logprobs)
    loss, lp, grads = _compare(model, tmodel)
    assert loss <= EXACT and lp <= EXACT and grads <= EXACT, (loss, lp, grads)


# --------------------------------------------------------------------------- ops against references
@pytest.fixture(scope="module")
def batch():
    return Tree.from_paths(PATHS).to_batch()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_tree_shift_equals_per_token_reference(batch, k, device):
    x = torch.randn(2, batch.seq_len, 3, dtype=torch.float64, requires_grad=True)
    r = tree_shift_reference(x, batch.pred_index, k, 1)
    xd = x.detach().to(device).requires_grad_()
    y = tree_shift(xd, batch.pred_index.to(device), k, 1)
    assert torch.equal(y.cpu(), r)
    g = torch.randn_like(r)
    gy = torch.autograd.grad(y, xd, g.to(device))[0].cpu()
    assert rel(gy, torch.autograd.grad(r, x, g)[0]) <= 1e-15  # sum order differs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["sum", "prod", "logsumexp"])
def test_tree_scan_equals_per_token_reference(batch, op, device):
    x = torch.randn(batch.seq_len, 2, dtype=torch.float64)
    x[5, 0] = 0.0  # a zero inside a product
    x.requires_grad_()
    r = tree_scan_reference(x, batch.pred_index, 0, op)
    xd = x.detach().to(device).requires_grad_()
    y = tree_scan(xd, batch.pred_index.to(device), 0, op)
    assert rel(y.detach().cpu(), r.detach()) <= 1e-14
    g = torch.randn_like(r)
    gy = torch.autograd.grad(y, xd, g.to(device))[0].cpu()
    assert rel(gy, torch.autograd.grad(r, x, g)[0]) <= 1e-14


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_log_scan_gradient_where_every_running_value_is_minus_inf(batch, dtype):
    """``logsumexp`` scans of masked scores (``-inf`` entries, paths whose running value stays ``-inf``) and of
    values far apart (``exp`` of their difference overflows float32): the gradient is torch's own per path.  That
    is NaN exactly where a token's running value is ``-inf`` (torch's ``logcumsumexp`` backward), and finite
    everywhere else (a product with a 0/1 mask carried the unused branch's ``inf``/NaN into the sums)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch.seq_len, 3, dtype=torch.float64, generator=gen)
    x[torch.rand(x.shape, generator=gen) < 0.4] = float("-inf")
    x[:3, 0] = float("-inf")  # a root whose first tokens see only -inf
    # finite and far apart: in the second tree's rows, which do not combine with the first root in the first
    # rounds, exp(first root - row) overflows float32
    x[:, 2] = torch.randn(batch.seq_len, dtype=torch.float64, generator=gen)
    roots = torch.nonzero(batch.pred_index < 0).flatten().tolist()
    assert len(roots) == 2 and roots[0] == 0
    x[0, 2], x[roots[1]:, 2] = 300.0, x[roots[1]:, 2] - 300.0
    x = x.to(dtype).requires_grad_()
    r = tree_scan_reference(x, batch.pred_index, 0, "logsumexp")
    y = tree_scan(x, batch.pred_index, 0, "logsumexp")
    assert torch.equal(torch.isinf(y), torch.isinf(r)) and rel(y[torch.isfinite(r)], r[torch.isfinite(r)]) <= 1e-6
    g = torch.randn(r.shape, dtype=dtype, generator=gen)
    gy, gr = torch.autograd.grad(y, x, g)[0], torch.autograd.grad(r, x, g)[0]
    nan = r.detach() == float("-inf")
    assert nan.any() and (~nan).any()
    assert torch.equal(gr.isnan(), nan) and torch.equal(gy.isnan(), nan)
    assert rel(gy[~nan].double(), gr[~nan].double()) <= (1e-14 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("op", ["sum", "prod", "logsumexp"])
def test_scan_of_one_token_paths_is_a_new_tensor(op):
    """A batch where no token has a predecessor (every path one token: a partition can be that): the scan is the
    identity, returned (and its gradient) as a new tensor, as a custom op must (it may not alias its input)."""
    b = Tree.from_paths([[7], [1], [2]]).to_batch()
    x = torch.randn(2, b.seq_len, 3, dtype=torch.float64, requires_grad=True)
    y = tree_scan(x, b.pred_index, 1, op)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    g = torch.randn_like(y)
    assert torch.equal(torch.autograd.grad(y, x, g)[0], g)
    torch.library.opcheck(tree_scan, (x, b.pred_index, 1, op))


def test_model_with_scans_on_one_token_paths_equals_per_path():
    """A model with cumsum / cumprod / logcumsumexp along the sequence on trees of one-token paths (the partition
    that a one-token path gets to itself), compiled: the per-path loss, log-probs and gradients."""
    torch.manual_seed(0)
    model = mm.Scans().double()
    tmodel = treecompile.compile(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for paths in ([[7]], [[1], [2], [3]]):  # nothing to predict: a zero loss, zero gradients, as per path
        out, ref = tmodel(Tree.from_paths(paths).to_batch()), reference.run(model, paths)
        assert float(out.loss) == float(ref.loss) == 0.0
        assert not flat_grads(out.loss, params).any() and not flat_grads(ref.loss, params).any()
    loss, lp, grads = _compare(model, tmodel, [[7], [1, 2]])
    assert loss <= EXACT and lp <= EXACT and grads <= EXACT, (loss, lp, grads)


def test_tree_ancestors_equals_reference(batch):
    for n, step in [(0, 1), (3, 1), (2, 2), (5, 3)]:
        assert torch.equal(tree_ancestors(batch.pred_index, n, step),
                           tree_ancestors_reference(batch.pred_index, n, step))


@pytest.mark.parametrize("device", DEVICES)
def test_tree_attention_biased_without_bias_equals_tree_attention(batch, device):
    T = batch.seq_len
    q, k, v = (torch.randn(1, 2, T, 4, dtype=torch.float64) for _ in range(3))
    got = tree_attention_biased(q.to(device), k.to(device), v.to(device), batch.subtree_end.to(device), None, 0.5)
    assert rel(got.cpu(), tree_attention_reference(q, k, v, batch.subtree_end, 0.5)) <= 1e-14


def test_tree_attention_biased_bias_equals_per_path_attention(batch):
    """With an ALiBi bias on depth positions, each token's output is plain causal attention on its path."""
    T, tree = batch.seq_len, batch.tree
    q, k, v = (torch.randn(1, 2, T, 4, dtype=torch.float64) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)[:, None, None]
    bias = slopes * (batch.position_ids[None, :] - batch.position_ids[:, None])  # [2, T, T]
    got = tree_attention_biased(q, k, v, batch.subtree_end, bias, 0.5, torch.float64)
    starts = torch.cumsum(tree.path_lengths, 0) - tree.path_lengths
    for p, L in enumerate(tree.path_lengths.tolist()):
        idx = tree.path_index[int(starts[p]):int(starts[p]) + L]
        pos = torch.arange(L, dtype=torch.float64)
        s = (q[..., idx, :] @ k[..., idx, :].transpose(-1, -2)) * 0.5 + slopes * (pos[None, :] - pos[:, None])
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        assert rel(got[..., idx, :], torch.softmax(s, -1) @ v[..., idx, :]) <= 1e-14


@pytest.mark.parametrize("op,args", [
    ("tree_shift", lambda b, x: (x, b.pred_index, 2, 1)),
    ("tree_scan", lambda b, x: (x, b.pred_index, 1, "prod")),
    ("tree_ancestors", lambda b, x: (b.pred_index, 3, 2)),
    ("tree_attention_biased", lambda b, x: (x, x, x, b.subtree_end, torch.randn(
        2, 1, b.seq_len, dtype=torch.float64, requires_grad=True), 0.3, torch.float32)),
])
def test_ops_registration(batch, op, args):
    x = torch.randn(2, batch.seq_len, 3, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(getattr(torch.ops.treecompile, op).default, args(batch, x))


# --------------------------------------------------------------------------- HF BLOOM (ALiBi, eager)
transformers = pytest.importorskip("transformers")


def test_bloom_alibi_attention_equals_per_path():
    torch.manual_seed(0)
    cfg = transformers.BloomConfig(vocab_size=37, hidden_size=32, n_layer=2, n_head=4, attention_dropout=0.0,
                                   hidden_dropout=0.0)
    model = transformers.BloomForCausalLM(cfg).double().eval()
    tmodel = treecompile.compile(model)  # BLOOM has no SDPA path: capture keeps its own attention
    res = tmodel.pass_results["rewrite_causal_attention"]
    assert res.count == 2 and res.info["with_bias"] == 2  # one ALiBi attention per layer
    _assert_mixers_gone(tmodel.graph_module)
    batch = Tree.from_paths(PATHS).to_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    out = tmodel(batch)
    ref = reference.run(model, PATHS)
    # BLOOM's softmax runs in float32 even in a float64 model; the tree sums each row's float32 exps
    # in other SIMD lanes than the path does.  Bound: the reference's own float32 rounding, i.e. its
    # distance to the same per-path run with a float64 softmax.
    real = torch.nn.functional.softmax
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("transformers.models.bloom.modeling_bloom.F.softmax",
                   lambda x, dim=None, dtype=None, **kw: real(x, dim=dim))
        ref64 = reference.run(model, PATHS)
    g_ref = flat_grads(ref.loss, params)
    loss_noise = abs(float((ref64.loss - ref.loss).detach()))
    g_noise = rel(flat_grads(ref64.loss, params), g_ref)
    lp_noise = max(float((a - r).detach().abs().max()) for a, r in zip(ref64.logprobs, ref.logprobs))
    assert 0 < loss_noise < 1e-9 and 0 < g_noise < 1e-7  # the float32 softmax is really there, and small
    assert abs(float((out.loss - ref.loss).detach())) <= 10 * loss_noise
    assert rel(flat_grads(out.loss, params), g_ref) <= 10 * g_noise
    lp = max(float((a - r.detach()).abs().max())
             for a, r in zip(batch.path_logprobs(out.logprobs.detach()), ref.logprobs))
    assert lp <= 10 * lp_noise


def test_masked_scores_are_mask_values_only():
    """A score counts as masked at -inf or a mask value at most -1e4 (a dtype's min, also scaled after it was
    added: CodeGen's float32 ``finfo.min / sqrt(d)``; a written-out -1e9 or -1e4); never at a float16 value a
    visible entry may have (-7)."""
    from treecompile.passes.rewrite_causal_attention import _allowed
    f32 = torch.tensor([torch.finfo(torch.float32).min / 8 ** 0.5, -1e4 + 3, -1e9, -999.0, float("-inf")])
    assert _allowed(f32).tolist() == [False, False, False, True, False]
    f16 = torch.tensor([-7.0, torch.finfo(torch.float16).min], dtype=torch.float16)
    assert _allowed(f16).tolist() == [True, False]
