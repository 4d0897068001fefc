"""treecompile.compile on hybrid (Gated DeltaNet) models: tree == each path run alone.

Our ``HybridForCausalLM`` (pure float64): loss, per-token logprobs and every parameter gradient to
1e-9 relative.  Unmodified HF ``Qwen3_5ForCausalLM``, ``Qwen3NextForCausalLM`` (dense and MoE) and
``Qwen3_5MoeForCausalLM``: within the per-path reference's own float32 rounding (HF computes the GDN
kernel, RMSNorm, the decay g, rotary and the router softmax in float32 even in a float64 model; the
tree runs the GDN kernel in float64).  That rounding is measured, not guessed, as the disagreement of
mathematically equal per-path computations: (a)-(c) of ``helpers.equal_per_path_computations`` and
(d) the reference with HF's GDN kernel in its token-by-token recurrent form instead of chunked.
A GDN pass switched off (sibling state leaks) is >1e3x above that noise.

HF MoE experts (data-dependent loop; grouped_mm refuses float64) are swapped during capture for
``treecompile::moe_experts``; its op tests are at the end.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import treecompile
from treecompile import NORMALIZATIONS, Tree, reference
from treecompile.models import HybridConfig, HybridForCausalLM
from treecompile import hf_adapters
from treecompile.ops import moe
from helpers import capture_once, equal_per_path_computations
from strategies import ODD_TREES

transformers = pytest.importorskip("transformers")
V = 37
OPS = torch.ops.treecompile
MOE = dict(num_experts=4)
# tiny's 4 layers (3 GDN + 1 attention) less one GDN layer: capture and every run cost 3/4, and the models
# still chain two GDN layers (the second fed by the first's tree output) into an attention layer
LAYERS = dict(num_hidden_layers=3, layer_types=("linear_attention", "linear_attention", "full_attention"))


# ---------------------------------------------------------------- trees
@st.composite
def chain_trees(draw, max_paths: int = 6, vocab: int = V):
    """Trees whose nodes are mostly 1-3 tokens (conv context K-1 = 3 crosses several ancestors),
    grown deep (often from the newest path) and wide (branching anywhere in the last 3 tokens)."""
    tok = st.integers(0, vocab - 1)
    paths = [draw(st.lists(tok, min_size=2, max_size=6))]
    for _ in range(draw(st.integers(1, max_paths - 1))):
        base = paths[-1] if draw(st.booleans()) else draw(st.sampled_from(paths))
        keep = draw(st.integers(max(1, len(base) - 3), len(base)))
        paths.append(base[:keep] + draw(st.lists(tok, min_size=1, max_size=3)))
    masks = [[0] + [draw(st.integers(0, 1)) for _ in p[1:]] for p in paths]
    weights = [draw(st.floats(-2, 2, allow_nan=False, allow_infinity=False)) for _ in paths]
    return paths, masks, weights


FIXED = {  # fixed trees: chains of 1-2 token nodes, a deep chain, and wide fan-out
    "short_node_chain": [[1, 2], [1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 7, 8, 9, 10],
                         [1, 2, 3, 7, 8, 11], [1, 2, 3, 7, 12]],
    "deep_chain": ODD_TREES["deep_chain"],
    "one_token_nodes": ODD_TREES["one_token_nodes"],
    "wide_fanout_16": [[7, 7, 7, i % 30 + 1, i] for i in range(16)],
}


# ---------------------------------------------------------------- models
def hf_model(kind: str) -> torch.nn.Module:
    """A tiny random HF model (float64, eager experts for the per-path reference), norms perturbed
    away from identity so that their math is exercised."""
    if kind == "qwen3_5_moe":
        d = HybridConfig.tiny(vocab_size=V, model_type="qwen3_next", **LAYERS, **MOE).to_hf_dict()
        cls, cfg_cls = transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig
    else:
        moe_kw = MOE if kind == "qwen3_next_moe" else {}
        model_type = "qwen3_5_text" if kind == "qwen3_5" else "qwen3_next"
        d = HybridConfig.tiny(vocab_size=V, model_type=model_type, **LAYERS, **moe_kw).to_hf_dict()
        cls, cfg_cls = ((transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig) if kind == "qwen3_5"
                        else (transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig))
    cfg = cfg_cls(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    cfg._experts_implementation = "eager"  # the reference runs HF's own loop; grouped_mm refuses float64
    torch.manual_seed(0)
    m = cls(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) + 0.5 if "linear_attn.norm" in n else torch.randn_like(p) * 0.3)
    return m.double()


HF_KINDS = ["qwen3_5", "qwen3_next", "qwen3_next_moe", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=["dense", "moe"])
def ours(request):
    torch.manual_seed(0)
    model = HybridForCausalLM(HybridConfig.tiny(vocab_size=V, **LAYERS, **(MOE if request.param == "moe" else {}))).double()
    return model, treecompile.compile(model)


_HF: dict = {}  # kind -> hf's value, built once per module


@pytest.fixture(scope="module", params=HF_KINDS)
def hf(request):
    """(kind, model, tree model, the model's state before compile: state_dict, logits, flags).

    Built once per kind for the whole module: pytest builds a module-scoped fixture again for a test that
    parametrizes it indirectly (test_gdn_pass_disabled_..., test_hf_moe_lowering_...), which would capture
    the same model again (Qwen3-Next MoE: ~7 s).  No test changes the model or the tree model."""
    if request.param not in _HF:
        model = hf_model(request.param)
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        with torch.no_grad():
            before = ({k: v.clone() for k, v in model.state_dict().items()}, model(ids).logits, flags(model))
        with capture_once(model):  # test_gdn_pass_disabled_... compiles this model twice more
            _HF[request.param] = request.param, model, treecompile.compile(model), before
    return _HF[request.param]


def flags(model):
    return model.training, model.config._experts_implementation, model.config._attn_implementation


@contextlib.contextmanager
def hf_recurrent_gdn(model):
    """HF's GDN kernel in its token-by-token recurrent form (mathematically equal to the chunked one)."""
    mods = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
    with contextlib.ExitStack() as stack:
        for mod in mods:
            rec = mod.torch_recurrent_gated_delta_rule

            def chunk_as_recurrent(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                   output_final_state=False, use_qk_l2norm_in_kernel=False, _rec=rec, **kw):
                return _rec(query, key, value, g, beta, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

            stack.enter_context(mock.patch.object(mod, "torch_chunk_gated_delta_rule", chunk_as_recurrent))
        yield


# ---------------------------------------------------------------- comparison
def grads(loss, named, retain=False):
    return dict(zip([n for n, _ in named], torch.autograd.grad(loss, [p for _, p in named], allow_unused=True,
                                                                retain_graph=retain)))


def norm(d):
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in d.values())))


def diff(a, b):
    return {n: a[n] - b[n] for n in a}


def run_both(model, tmodel, paths, masks, weights, normalize):
    batch = Tree.from_paths(paths, loss_masks=masks, path_weights=weights).to_batch(normalize=normalize)
    out = tmodel(batch)
    ref = reference.run(model, paths, loss_masks=masks, path_weights=weights, normalize=normalize)
    named = list(model.named_parameters())
    lp_err = max(float((a - r).detach().abs().max()) for a, r in zip(batch.path_logprobs(out.logprobs), ref.logprobs))
    # ref's graph is kept: hf_noise's computation (a) reads ref's log-probs instead of running every path again
    return batch, out, ref, named, lp_err, grads(out.loss, named), grads(ref.loss, named, retain=True)


def check_ours(model, tmodel, paths, masks, weights, normalize):
    batch, out, ref, named, lp_err, g_tree, g_ref = run_both(model, tmodel, paths, masks, weights, normalize)
    assert lp_err < 1e-12, lp_err
    assert abs(float(out.loss - ref.loss)) <= 1e-9 * abs(float(ref.loss)) + 1e-15
    total = norm(g_ref)
    if total == 0:  # every trained token masked out
        assert norm(g_tree) == 0
        return 0.0
    assert norm(diff(g_tree, g_ref)) <= 1e-9 * total
    worst = 0.0
    for n in g_ref:  # every parameter on its own (A_log, dt_bias, conv weights, experts, router ...)
        err, scale = float((g_tree[n] - g_ref[n]).norm()), float(g_ref[n].norm())
        assert err <= 1e-9 * scale + 1e-14 * total, (n, err, scale)
        worst = max(worst, err / max(scale, 1e-300))
    return worst


_F32 = {}


def float32_copy(model):
    if id(model) not in _F32:
        _F32[id(model)] = copy.deepcopy(model).float()
    return _F32[id(model)]


def hf_noise(model, paths, masks, weights, batch, ref, named, g_ref, enough=None):
    """The reference's own rounding, two ways: ``equal`` = max disagreement of four per-path
    computations mathematically equal to it ((a)-(c) of ``equal_per_path_computations``; (d) HF's
    GDN kernel in its recurrent form), ``f32`` = its distance to the same model run all in float32,
    which rounds at a superset of the places where HF64 rounds (the GDN kernel's float32 *input*
    rounding, which (d) shares with the reference, included).
    Returns {"equal"|"f32": (loss noise, logprob noise, {param: gradient noise}, relative gradient noise)}.

    The five are made one at a time: f32, (d), (a), (b) (every path run twice), then (c).  ``enough(noise)
    -> bool``: a check that only gets easier as the noise grows; the rest are skipped once it holds.
    Every figure is a max over the computations made, so it only grows as they are added, and the
    check's verdict is the one it has on all five.  (On this file's HF checks with the CI examples, f32
    and (d) settle all 22: the tree's decay gradients, dt_bias and A_log, sit at (d)'s distance.)
    Leave ``enough`` None where the noise is a floor that something must exceed (the near miss)."""
    total = max(norm(g_ref), 1e-300)
    noise = {key: (0.0, 0.0, {n: 0.0 for n in g_ref}, 0.0) for key in ("equal", "f32")}

    def add(key, loss, params, lps=None):  # one more computation into noise[key]; True once enough holds
        g = {n: x.double() for n, x in grads(loss, params).items()}
        lp = 0.0 if lps is None else max(float((a.double() - r).detach().abs().max())
                                         for a, r in zip(lps, ref.logprobs))
        loss_noise, lp_noise, g_noise, rel_noise = noise[key]
        noise[key] = (max(loss_noise, abs(float(loss.detach().double() - ref.loss.detach()))), max(lp_noise, lp),
                      {n: max(g_noise[n], float((g[n] - g_ref[n]).norm())) for n in g_ref},
                      max(rel_noise, norm(diff(g, g_ref)) / total))
        return enough is not None and enough(noise)

    m32 = float32_copy(model)
    ref_d = reference.run(m32, paths, loss_masks=masks, path_weights=weights, normalize="sum")
    if add("f32", ref_d.loss, list(m32.named_parameters()), ref_d.logprobs):
        return noise
    with hf_recurrent_gdn(model):
        ref_c = reference.run(model, paths, loss_masks=masks, path_weights=weights, normalize="sum")
    if add("equal", ref_c.loss, named, ref_c.logprobs):  # (a)'s log-probs are ref's own, (b)'s, (c)'s not compared
        return noise
    for loss in equal_per_path_computations(model, paths, masks, weights, batch, ref=ref):
        if add("equal", loss, named):
            break
    return noise


def hf_figures(model, tmodel, paths, masks, weights, enough=None):
    """Tree-vs-reference errors next to the reference's own noise (see :func:`hf_noise`; ``enough(figures,
    noise) -> bool`` as there), and the reference's gradients (``g_ref``: {name: gradient})."""
    batch, out, ref, named, lp_err, g_tree, g_ref = run_both(model, tmodel, paths, masks, weights, "sum")
    total = norm(g_ref)
    w = batch.loss_weight.to(out.logprobs.dtype)
    f = dict(lp=lp_err, loss=abs(float(out.loss - ref.loss)), ref_loss=abs(float(ref.loss)),
             # the loss is -(w * logprobs).sum(): its own arithmetic, and the bound the log-probs' imply
             loss_vs_logprobs=abs(float(out.loss + (w * out.logprobs).sum())), weight_l1=float(w.abs().sum()),
             grad=norm(diff(g_tree, g_ref)) / max(total, 1e-300), total=total, tree_norm=norm(g_tree),
             params={n: (float((g_tree[n] - g_ref[n]).norm()), float(g_ref[n].norm())) for n in g_ref}, g_ref=g_ref)
    f["noise"] = hf_noise(model, paths, masks, weights, batch, ref, named, g_ref,
                          enough=None if enough is None else (lambda noise: enough(f, noise)))
    return f


def budget(noise, i, name=None):
    """10x the equal computations' disagreement or 2x the float32 run's distance, whichever is larger."""
    e, f = noise["equal"][i], noise["f32"][i]
    return max(10 * (e if name is None else e[name]), 2 * (f if name is None else f[name]))


F32_TINY = torch.finfo(torch.float32).tiny  # 1.2e-38


def hf_violations(f, nz) -> list:
    """The bounds of :func:`check_hf` that ``f``'s errors exceed under the noise ``nz``, each with its
    figures (empty: all hold; the bounds grow with the noise)."""
    bad = []
    if not f["lp"] <= budget(nz, 1) + 1e-12:
        bad.append(("logprobs", f["lp"], nz["equal"][1], nz["f32"][1]))
    # The loss is linear in the log-probs: within the log-probs' budget, its error is at most sum |w| times
    # that budget.  The loss computations' own disagreement can be smaller than that by cancellation (seen:
    # two trained tokens, loss noise 5e-10 against log-prob noise 1.8e-8, a tree loss error of 2.6e-9), so
    # either bound holds it, and the loss must be its log-probs' weighted sum to float64 rounding.
    if not f["loss_vs_logprobs"] <= 1e-12 * max(f["ref_loss"], 1.0):
        bad.append(("loss is not -(w * logprobs).sum()", f["loss_vs_logprobs"]))
    if not f["loss"] <= max(budget(nz, 0), f["weight_l1"] * budget(nz, 1)) + 1e-12 * f["ref_loss"]:
        bad.append(("loss", f["loss"], nz["equal"][0], nz["f32"][0], f["weight_l1"]))
    if f["total"] == 0:  # every trained token masked out: no gradient to compare (check_hf checks the tree's is 0)
        return bad
    if not f["grad"] <= budget(nz, 3) + 1e-12:
        bad.append(("gradient", f["grad"], nz["equal"][3], nz["f32"][3]))
    for n, (err, scale) in f["params"].items():
        # + float32's smallest normal number: HF computes GDN in float32, so a gradient it rounds there
        # cannot be resolved below it (seen: dt_bias gradient 0 per path vs a 1.2e-45 subnormal on the tree)
        if not err <= budget(nz, 2, n) + 1e-12 * scale + 1e-14 * f["total"] + F32_TINY:
            bad.append((n, err, scale, nz["equal"][2][n], nz["f32"][2][n]))
    return bad


def check_hf(model, tmodel, paths, masks, weights, *, all_noise=False):
    """Tree vs reference within the reference's own rounding (1e-12 relative floor for float64).
    ``all_noise``: make all four noise computations (a near miss compares against the noise)."""
    f = hf_figures(model, tmodel, paths, masks, weights,
                   enough=None if all_noise else (lambda f, noise: not hf_violations(f, noise)))
    bad = hf_violations(f, f["noise"])
    assert not bad, bad
    if f["total"] == 0:
        assert f["tree_norm"] == 0
    return f


# ---------------------------------------------------------------- our hybrid model: 1e-9
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain_trees(max_paths=7), st.sampled_from(NORMALIZATIONS), st.booleans())
def test_ours_tree_equals_per_path(ours, pmw, normalize, use_masks):
    paths, masks, weights = pmw
    check_ours(*ours, paths, masks if use_masks else None, weights, normalize)


@pytest.mark.parametrize("name", sorted(FIXED) + ["wide_fanout_64"])
def test_ours_fixed_trees(ours, name):
    paths = [[t % V for t in p] for p in (ODD_TREES[name] if name in ODD_TREES else FIXED[name])]
    check_ours(*ours, paths, None, None, "token_mean")


# ---------------------------------------------------------------- unmodified HF models: reference rounding
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain_trees(max_paths=5))
# two trained tokens: the loss computations agreed to 5e-10, closer than their log-probs (1.8e-8)
@example(([[12, 11, 34], [12, 0], [12, 0, 0], [12, 11, 34, 2, 19, 20]],
          [[0, 0, 0], [0, 0], [0, 0, 0], [0, 0, 0, 1, 0, 1]], [0, 0, 0, 1]))
def test_hf_tree_equals_per_path_within_reference_rounding(hf, pmw):
    _, model, tmodel, _ = hf
    check_hf(model, tmodel, *pmw)


@pytest.mark.parametrize("name", ["deep_chain", "wide_fanout_16"])  # short_node_chain: near-miss test
def test_hf_fixed_trees(hf, name):
    _, model, tmodel, _ = hf
    check_hf(model, tmodel, FIXED[name], None, None)


def test_hf_capture_graph_and_model_unchanged(hf):
    """One GDN op, one conv op per GDN layer and one moe_experts op per MoE layer; no data-dependent
    op left; the model is unchanged by compile (no instance forward left on experts modules)."""
    kind, model, tmodel, (state, logits, before_flags) = hf
    cfg = model.config
    n_gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    n_moe = cfg.num_hidden_layers if "moe" in kind else 0
    targets = [n.target for n in tmodel.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count(OPS.tree_gated_delta_rule.default) == n_gdn
    assert targets.count(OPS.tree_causal_conv1d.default) == n_gdn
    assert targets.count(OPS.moe_experts.default) == n_moe
    assert torch.ops.aten.nonzero.default not in targets
    assert tmodel.pass_results["route_gdn_states"].info == {"gdn": n_gdn, "conv": n_gdn}
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert len(experts) == n_moe
    assert all("forward" not in vars(m) for m in experts)
    assert flags(model) == before_flags
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([[1, 2, 3, 4, 5]])).logits, logits)


@pytest.mark.parametrize("hf", ["qwen3_5", "qwen3_next_moe"], indirect=True)
def test_gdn_pass_disabled_leaks_sibling_state_far_above_noise(hf):
    """Near miss: without route_gdn_states every GDN layer runs the DFS order as one sequence, so a
    branch starts from its sibling's state: the gradient error is >1e3x the reference's noise."""
    kind, model, tmodel, _ = hf
    paths = FIXED["short_node_chain"]
    f = check_hf(model, tmodel, paths, None, None, all_noise=True)  # the full noise: a floor to exceed below
    with capture_once(model):  # the fixture's capture of this unmodified model, deep-copied: same graph, same passes
        with pytest.raises(treecompile.passes.PassError, match=r"(?s)verify_token_locality.*sequence length as a value"):
            treecompile.compile(model, disable=("route_gdn_states",))  # the verifier catches the chain node tensors
        with pytest.warns(treecompile.passes.UnverifiedGraphWarning):
            broken = treecompile.compile(model, disable=("route_gdn_states", "verify_token_locality"))
    assert "route_gdn_states" not in broken.pass_results
    named = list(model.named_parameters())
    batch = Tree.from_paths(paths).to_batch()
    g_ref = f["g_ref"]  # check_hf's reference.run(model, paths) ("sum", no masks or weights)
    g_broken = grads(broken(batch).loss, named)
    assert norm(diff(g_broken, g_ref)) / norm(g_ref) > 1e3 * budget(f["noise"], 3)


# ---------------------------------------------------------------- treecompile::moe_experts
def moe_inputs(T=13, D=6, I=5, E=4, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(dtype=torch.float64)
    hidden = torch.randn(T, D, generator=gen, **f64)
    logits = torch.randn(T, E, generator=gen, **f64)
    w, idx = logits.softmax(-1).topk(k, dim=-1)
    return (hidden, idx, w, torch.randn(E, 2 * I, D, generator=gen, **f64) * 0.5,
            torch.randn(E, D, I, generator=gen, **f64) * 0.5)


def test_moe_op_equals_dense_reference_forward_and_backward():
    ins = moe_inputs()
    ins[1][3] = torch.tensor([2, 2])  # the same expert twice for one token
    ins[1][:5, 0] = 1  # a busy expert; expert 3 may be unused: its gradient must be zero in both
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in ins]
    out = moe.moe_experts(*leaves)
    ref = moe.moe_experts_reference(*leaves)
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-14)
    go = torch.randn_like(out)
    diffable = [x for x in leaves if x.requires_grad]
    for a, b in zip(torch.autograd.grad(out, diffable, go), torch.autograd.grad(ref, diffable, go)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_moe_op_equals_hf_eager_experts():
    model = hf_model("qwen3_next_moe")
    experts = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextExperts")
    assert hf_adapters.hf_experts_supported(experts) is None
    hidden, idx, w, _, _ = moe_inputs(D=experts.hidden_dim, E=experts.num_experts)
    hidden, w = hidden.requires_grad_(), w.requires_grad_()
    params = [hidden, w, experts.gate_up_proj, experts.down_proj]
    want = experts(hidden, idx, w)  # HF's own eager loop
    got = hf_adapters.hf_experts_forward(experts, hidden, idx, w)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    go = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, params, go), torch.autograd.grad(want, params, go)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_moe_op_sentinel_and_bad_index():
    hidden, idx, w, gu, down = moe_inputs(E=4)
    sent = idx.clone()
    sent[0, 1] = 4  # HF's expert-parallel sentinel: contributes nothing
    keep = w.clone()
    keep[0, 1] = 0
    torch.testing.assert_close(moe.moe_experts(hidden, sent, w, gu, down),
                               moe.moe_experts_reference(hidden, idx, keep, gu, down), rtol=1e-13, atol=1e-14)
    bad = idx.clone()
    bad[7, 0] = 5
    with pytest.raises(ValueError, match=r"top_k_index\[7, 0\] = 5 is outside \[0, 4\]"):
        moe.moe_experts(hidden, bad, w, gu, down)
    with pytest.raises(ValueError, match="down_proj"):
        moe.moe_experts(hidden, idx, w, gu, down[:, :, :-1])


def test_moe_op_opcheck():
    hidden, idx, w, gu, down = moe_inputs(T=9)
    torch.library.opcheck(OPS.moe_experts.default,
                          (hidden.requires_grad_(), idx, w.requires_grad_(), gu.requires_grad_(), down.requires_grad_()))


@pytest.mark.parametrize("hf", ["qwen3_next_moe"], indirect=True)
def test_hf_moe_lowering_on_the_captured_graph(hf, monkeypatch):
    """The CUDA lowering of a captured HF MoE graph: one moe_experts_grouped per MoE layer where the dtype is
    admitted (its arguments as captured: the op computes the same function, tests/test_moe_grouped.py), none
    for this float64 graph as it is (the grouped GEMM takes no float64)."""
    import treecompile.passes.lower_cuda as tc_cuda

    _, model, tmodel, _ = hf
    options = tc_cuda.CudaOptions(gdn_kernel="reference", attention_kernel="flex")
    monkeypatch.setattr(tc_cuda, "moe_grouped_unusable_reason", lambda: None)
    low = tc_cuda.lower_cuda(tmodel.graph_module, options)
    assert low.moe_grouped == 0 and low.attention > 0
    monkeypatch.setattr(tc_cuda, "MOE_GROUPED_DTYPES", (torch.float64,))
    low = tc_cuda.lower_cuda(tmodel.graph_module, options)
    targets = [n.target for n in low.graph_module.graph.nodes if n.op == "call_function"]
    assert low.moe_grouped == model.config.num_hidden_layers == targets.count(OPS.moe_experts_grouped.default)
    assert OPS.moe_experts.default not in targets


def test_unsupported_experts_run_their_own_forward():
    """An experts module the op would not compute exactly (here: a GELU activation) is swapped for
    ``treecompile::experts_module``, one opaque call running the module's own eager forward: within the
    reference's own rounding on a tree, gradients reaching its parameters through the op's backward."""
    model = hf_model("qwen3_next_moe")
    experts = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextExperts")
    experts.act_fn = torch.nn.GELU()
    assert "activation GELU" in hf_adapters.hf_experts_supported(experts)
    from treecompile.frontend import kernel_swaps
    n_gdn_swaps = len(kernel_swaps(hf_model("qwen3_next")))
    assert len(kernel_swaps(model)) == n_gdn_swaps + model.config.num_hidden_layers
    tmodel = treecompile.compile(model)
    targets = [n.target for n in tmodel.graph_module.graph.nodes if n.op == "call_function"]
    assert targets.count(OPS.experts_module.default) == 1
    assert targets.count(OPS.moe_experts.default) == model.config.num_hidden_layers - 1
    check_hf(model, tmodel, FIXED["deep_chain"], None, None)


def check_conv_as_shifts(model, tm):
    """The CUDA lowering's tree conv (``ops.tree_conv_shifts``, conv_kernel "shifts") put in the rewritten graph in
    place of ``treecompile::tree_causal_conv1d`` and run on CPU in float64: loss, log-probs and every parameter's
    gradient equal the graph with the registered op (the shapes and layouts HF and our models hand the conv)."""
    import torch.fx as fx

    from treecompile.ops.tree_conv_shifts import tree_causal_conv1d_shifts
    from treecompile.passes.lower_cuda import TREE_CONV

    prog = tm.program
    gm = prog.graph_module
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    convs = [n for n in graph.nodes if n.op == "call_function" and n.target == TREE_CONV]
    assert convs
    for n in convs:
        n.target = tree_causal_conv1d_shifts
    shifted = fx.GraphModule(gm, graph)
    batch = Tree.from_paths(FIXED["short_node_chain"] + FIXED["wide_fanout_16"][:4]).to_batch(
        conv_kernel=prog.conv_width + 1)
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    for g in (gm, shifted):
        loss, logprobs = g(*prog.inputs(batch))[:2]
        results.append([loss, logprobs, *torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_conv_as_shifts_in_ours(ours):
    check_conv_as_shifts(*ours)


@pytest.mark.parametrize("hf", ["qwen3_5"], indirect=True)
def test_conv_as_shifts_in_hf(hf):
    _, model, tm, _ = hf
    check_conv_as_shifts(model, tm)
