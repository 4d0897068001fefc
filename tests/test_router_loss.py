"""MoE router load-balancing loss on trees (``compile(router_aux="batch" | "path")``).

- The tree formulas (share-count weighting; per-path sums through the ancestor structure) equal the
  per-path / packed computation exactly in float64, value and gradient, on any router logits.
- HF Qwen3-MoE and OLMoE (tiny, float64, ``output_router_logits=True``, ``router_aux_loss_coef > 0``):
  ``out.aux_loss`` and its parameter gradients (router weights included) equal the per-path computation
  within the per-path reference's own float32 rounding (HF computes RMSNorm in float32); the model's
  own aux loss is refused by default and never computed on the DFS sequence.
"""

from __future__ import annotations

import pytest
import torch

from treecompile import Tree
from treecompile.ops.router_loss import ancestor_sums, load_balancing_loss, router_statistics, router_z_loss
from helpers import cached_compile, cached_model, rel

transformers = pytest.importorskip("transformers")

PATHS = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [11, 12], [1, 2, 3, 4, 5], [1, 2, 3]]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, 1.5, 0.75]


def aux64(rls, top_k):
    """HF's load_balancing_loss_func over the rows of ``rls`` (one [rows, E] per layer), in float64."""
    E = rls[0].shape[-1]
    f = sum(torch.zeros(E, dtype=torch.float64).scatter_add(
        0, torch.topk(torch.softmax(r, -1), top_k, -1).indices.reshape(-1),
        torch.ones(r.shape[0] * top_k, dtype=torch.float64)) for r in rls)
    P = sum(torch.softmax(r, -1).to(torch.float64).sum(0) for r in rls)
    rows = len(rls) * rls[0].shape[0]
    return E * ((f / rows) * (P / rows)).sum()


def z64(rls):
    return sum((torch.logsumexp(r.double(), -1) ** 2).sum() for r in rls) / (len(rls) * rls[0].shape[0])


def per_path(rls_tree, tree):
    """The tree's per-token router logits read along each path (path-token order)."""
    idx = tree.path_index
    return [[r[idx[o:o + n]] for r in rls_tree] for o, n in zip(tree.path_offsets.tolist(), tree.path_lengths.tolist())]


def tree_inputs(tree, semantics):
    if semantics == "batch":
        return dict(share_count=tree.aggregate(torch.ones(tree.num_paths), torch.ones(tree.num_path_tokens)))
    return dict(subtree_end=tree.subtree_end, path_end=tree.path_end,
                path_coef=tree.path_weights.double() / tree.num_paths)


def flat_grads(loss, params):
    """Gradients of ``loss`` (0 for parameters the aux loss does not reach: lm_head, final norm)."""
    gs = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(gs, params)])


# ------------------------------------------------------------------ the formulas, exact
def test_ancestor_sums_equal_path_prefix_sums():
    tree = Tree.from_paths(PATHS)
    x = torch.randn(tree.num_tokens, 3, dtype=torch.float64)
    S = ancestor_sums(x, tree.subtree_end)
    for p in range(tree.num_paths):
        toks = tree.path_index[tree.path_offsets[p]:tree.path_offsets[p] + tree.path_lengths[p]]
        assert torch.allclose(S[tree.path_end[p]], x[toks].sum(0), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("semantics", ["batch", "path"])
@pytest.mark.parametrize("layers,E,k", [(1, 4, 1), (3, 6, 2)])
def test_tree_router_losses_equal_per_path_float64(semantics, layers, E, k):
    tree = Tree.from_paths(PATHS, path_weights=WEIGHTS)
    g = torch.Generator().manual_seed(layers * 10 + E)
    rls = [torch.randn(tree.num_tokens, E, generator=g, dtype=torch.float64).requires_grad_() for _ in range(layers)]
    probs, counts, z = router_statistics(rls, k)
    kw = tree_inputs(tree, semantics)
    got = load_balancing_loss(probs, counts, num_layers=layers, semantics=semantics, **kw)
    got_z = router_z_loss(z, num_layers=layers, semantics=semantics, **kw)
    paths = per_path(rls, tree)
    if semantics == "batch":  # all path rows packed together
        packed = [torch.cat([p[layer] for p in paths]) for layer in range(layers)]
        want, want_z = aux64(packed, k), z64(packed)
    else:
        c = tree.path_weights.double() / tree.num_paths
        want = sum(c[i] * aux64(p, k) for i, p in enumerate(paths))
        want_z = sum(c[i] * z64(p) for i, p in enumerate(paths))
    for a, w in ((got, want), (got_z, want_z)):
        assert abs(float(a - w)) <= 1e-13 * abs(float(w))
        assert rel(torch.cat([x.flatten() for x in torch.autograd.grad(a, rls, retain_graph=True)]),
                   torch.cat([x.flatten() for x in torch.autograd.grad(w, rls, retain_graph=True)])) < 1e-12
    # near miss: the unweighted DFS rows (what the model computes on the tree sequence) differ
    assert abs(float(aux64(rls, k) - want)) > 1e-6 * abs(float(want))


def test_float64_formula_is_hf_load_balancing_loss():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(3)
    rls = tuple(torch.randn(13, 5, generator=g, dtype=torch.float64) for _ in range(2))
    hf = load_balancing_loss_func(rls, 5, 2)  # accumulates in float32
    assert abs(float(hf) - float(aux64(rls, 2))) <= 4 * torch.finfo(torch.float32).eps * float(aux64(rls, 2))


# ------------------------------------------------------------------ HF MoE models
def hf_moe(kind, output_router_logits=True):
    common = dict(vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  output_router_logits=output_router_logits, router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=16, decoder_sparse_step=1)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**common))
    model.config._experts_implementation = "eager"  # the reference runs HF's own loop; grouped_mm refuses float64
    model = model.double()
    for layer in model.model.layers:  # HF initialises routers to zero-ish: spread them so top-k is not a tie
        torch.nn.init.normal_(layer.mlp.gate.weight, std=1.0)
    return model


def hf_moe_cached(kind, output_router_logits=True):
    """``hf_moe(...)``, captured once per process (``helpers.cached_model``): compile it with
    ``cached_compile`` (router_aux and boundary act in the passes, after the one torch.export)."""
    return cached_model(f"router-{kind}-{output_router_logits}", lambda: hf_moe(kind, output_router_logits))


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe"])
def moe(request):
    model = hf_moe_cached(request.param)
    return model, {s: cached_compile(model, router_aux=s) for s in ("batch", "path")}, {}


def path_router_logits(model, path):
    return [r.to(torch.float64) for r in model(torch.tensor([path])).router_logits]


@pytest.mark.parametrize("semantics", ["batch", "path"])
def test_hf_moe_tree_aux_loss_and_gradients_equal_per_path(moe, semantics):
    model, tms, _ = moe
    tm = tms[semantics]
    tree = Tree.from_paths(PATHS, path_weights=WEIGHTS)
    batch = tree.to_batch()
    params = list(model.parameters())
    out = tm(batch)
    k, coef = model.config.num_experts_per_tok, model.config.router_aux_loss_coef
    lm_loss = -(batch.loss_weight * out.logprobs).sum()
    assert abs(float(out.loss - lm_loss - coef * out.aux_loss)) <= 1e-14 * abs(float(out.loss))

    c = tree.path_weights.double() / tree.num_paths
    runs = [path_router_logits(model, p) for p in PATHS]

    def reference(rl_paths):
        if semantics == "batch":
            return aux64([torch.cat([r[layer] for r in rl_paths]) for layer in range(len(rl_paths[0]))], k)
        return sum(c[i] * aux64(r, k) for i, r in enumerate(rl_paths))

    ref = reference(runs)
    g_tree, g_ref = flat_grads(out.aux_loss, params), flat_grads(ref, params)
    # the same per-path loss with each unique token's router logits taken from one path's run only
    # (its last occurrence): mathematically equal, rounded differently in HF's float32 RMSNorm backward
    last = torch.empty(tree.num_tokens, dtype=torch.long)
    last[tree.path_index] = torch.arange(tree.path_index.numel())
    flat = [torch.cat([r[layer] for r in runs]) for layer in range(len(runs[0]))]
    noise_ref = reference(per_path([f[last] for f in flat], tree))
    g_noise = rel(flat_grads(noise_ref, params), g_ref)
    v_noise = abs(float(noise_ref - ref))
    assert abs(float(out.aux_loss - ref)) <= 10 * v_noise + 1e-12 * abs(float(ref))
    assert rel(g_tree, g_ref) <= 10 * g_noise + 1e-12
    gate = [i for i, (n, _) in enumerate(model.named_parameters()) if n.endswith("mlp.gate.weight")]
    assert gate and all(float(g.norm()) > 0 for g in torch.autograd.grad(out.aux_loss, [params[i] for i in gate]))
    # near miss: the model's own aux loss on the DFS rows is far from both semantics
    dfs = aux64([r[:tree.num_tokens] for r in tm.program.run(batch)[2:]], k)
    assert abs(float(dfs - ref)) > 1e3 * (v_noise + 1e-12 * abs(float(ref)))


def test_hf_moe_router_loss_is_refused_by_default_and_dropped_only_when_asked():
    model = hf_moe_cached("qwen3_moe")  # one torch.export of model: the refusal and the drop are the passes'
    with pytest.raises(Exception, match=r"modeling_qwen3_moe.py.*router auxiliary loss.*router_aux="):
        cached_compile(model)
    tm = cached_compile(model, router_aux="none")
    assert tm.pass_results["rewrite_router_loss"].info["dropped"] == ["aux_loss"]
    assert tm.pass_results["rewrite_loss"].info["dropped"] == []  # the router logits dropped as asked: no warning
    out = tm(Tree.from_paths(PATHS).to_batch())
    assert out.aux_loss is None and tm.router_aux is None
    # near miss: the same model without router logits computes no aux loss: compiled as is
    quiet_model = hf_moe_cached("qwen3_moe", output_router_logits=False)
    quiet = cached_compile(quiet_model)
    assert quiet.pass_results["rewrite_router_loss"].count == 0
    with pytest.raises(Exception, match="router_logits"):
        cached_compile(quiet_model, router_aux="path")
    with pytest.raises(Exception, match="router_aux"):
        cached_compile(model, router_aux="tokens")


def test_router_aux_refuses_partitions(moe):
    _, tms, _ = moe
    tree = Tree.from_paths(PATHS)
    batch = tree.to_batch()
    batch.extras["whole_tree"] = tree
    with pytest.raises(NotImplementedError, match="partitions"):
        tms["batch"](batch)


def memo(moe, key, compute):
    """``compute()`` once per module and HF model (the ``moe`` fixture's third item)."""
    cache = moe[2]
    if key not in cache:
        cache[key] = compute()
    return cache[key]


def step(model, tm, **options):
    """``train_step(tm, tree, **options)`` on the weighted tree: (result, flat gradients, 0 where none)."""
    from treecompile.runtime.train import train_step

    params = list(model.parameters())
    for p in params:
        p.grad = None
    res = train_step(tm, Tree.from_paths(PATHS, path_weights=WEIGHTS), **options)
    g = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params])
    for p in params:
        p.grad = None
    return res, g


def whole_tree(moe, router_aux):
    """The whole tree's loss, aux loss (None without a router loss) and flat gradients of the loss."""
    model, tms, _ = moe

    def compute():
        tm = tms[router_aux] if router_aux in tms else cached_compile(model, router_aux=router_aux)
        out = tm(Tree.from_paths(PATHS, path_weights=WEIGHTS).to_batch())
        aux = None if out.aux_loss is None else float(out.aux_loss)
        return float(out.loss), aux, flat_grads(out.loss, list(model.parameters()))

    return memo(moe, ("whole", router_aux), compute)


def sft_step(moe, **options):
    """The SFT-only step (``router_aux="none"``) on the same partitions: (loss, flat gradients)."""
    model = moe[0]

    def compute():
        tm = cached_compile(model, router_aux="none", boundary=options.get("mode") == "redundancy_free")
        res, g = step(model, tm, **options)
        return res.loss, g

    return memo(moe, ("sft", tuple(sorted(options.items()))), compute)


@pytest.mark.parametrize("budget", [None, 8])
def test_hf_moe_train_step_path_semantics_whole_and_packed(moe, budget):
    """``train_step`` adds ``coef * aux`` to the objective's loss; with ``router_aux="path"`` packed
    partitions each sum over the paths assigned to them, so the step's loss and gradients equal the
    whole tree's: to rounding, and HF's float32 RMSNorm rounds differently per partition, so the bound
    is 10x the disagreement of the SFT-only step (same partitions, no router loss) with the whole tree.
    (The whole-tree runs and the SFT-only steps are computed once per model, shared with the test below.)"""
    model, tms, _ = moe
    res, g = step(model, tms["path"], **({} if budget is None else dict(budget=budget, mode="packed")))
    loss, aux, g_whole = whole_tree(moe, "path")
    assert abs(res.loss - loss) <= 1e-12 * abs(loss)
    assert abs(res.metrics["aux_loss"] - aux) <= 1e-12 * abs(aux)
    _, g_sft = sft_step(moe, **({} if budget is None else dict(budget=budget, mode="packed")))
    noise = rel(g_sft, whole_tree(moe, "none")[2])
    assert rel(g, g_whole) <= 10 * noise + 1e-12
    if budget:
        assert res.metrics["partitions"] > 1


@pytest.mark.parametrize("semantics", ["batch", "path"])
@pytest.mark.parametrize("mode,budget", [("packed", 8), ("redundancy_free", 3)])
def test_hf_moe_partitioned_router_losses_equal_whole_tree(moe, semantics, mode, budget):
    """Partitions that cannot compute the router loss alone (``"batch"`` packed, either semantics
    redundancy-free) get the step's coefficients from the counting pre-pass (``"path"`` packed needs
    none: each path lies whole in a partition): the step's loss, aux loss
    and gradients equal the whole tree's (itself equal to the per-path computation, test above) within
    10x the disagreement of the SFT-only step (same partitions, no router loss) with the whole tree."""
    model, tms, _ = moe
    rf = mode == "redundancy_free"
    tm = cached_compile(model, router_aux=semantics, boundary=True) if rf else tms[semantics]
    res, g = step(model, tm, budget=budget, mode=mode)
    assert res.metrics["router_prepass"] == (rf or semantics == "batch") and res.metrics["partitions"] > 1
    loss, aux, g_whole = whole_tree(moe, semantics)
    sft_loss, g_sft = sft_step(moe, budget=budget, mode=mode)
    sft_whole, _, g_sft_whole = whole_tree(moe, "none")
    noise = rel(g_sft, g_sft_whole)
    v_noise = abs(sft_loss - sft_whole)
    assert abs(res.loss - loss) <= 10 * v_noise + 1e-12 * abs(loss)
    assert abs(res.metrics["aux_loss"] - aux) <= 10 * v_noise + 1e-12 * abs(aux)
    assert rel(g, g_whole) <= 10 * noise + 1e-12


# ------------------------------------------------------------------ our MoE reference model (float64, exact)
@pytest.fixture(scope="module")
def ours():
    from treecompile.models import HybridConfig, HybridForCausalLM

    def make():
        torch.manual_seed(0)
        # 2 layers (tiny's 4 halved: capture and every run cost half), both MoE, one GDN and one
        # attention layer: the aux loss still averages over layers of both kinds
        cfg = HybridConfig.tiny(vocab_size=31, num_experts=4, output_router_logits=True, router_aux_loss_coef=0.1,
                                num_hidden_layers=2, layer_types=("linear_attention", "full_attention"))
        return HybridForCausalLM(cfg).double()

    model = cached_model("router-hybrid-moe", make)  # one torch.export for both semantics
    return model, {s: cached_compile(model, router_aux=s) for s in ("batch", "path")}


@pytest.mark.parametrize("semantics", ["batch", "path"])
def test_reference_moe_model_tree_equals_per_path_float64(ours, semantics):
    """Whole tree: ``out.aux_loss``, ``out.loss`` (LM + coef * aux) and every parameter gradient (the
    routers' included) equal the per-path computation to float64 rounding."""
    from treecompile import reference
    from models.hybrid import load_balancing_loss

    model, tms = ours
    cfg = model.config
    tree = Tree.from_paths(PATHS, path_weights=WEIGHTS)
    params = list(model.parameters())
    out = tms[semantics](tree.to_batch())
    runs = [model(torch.tensor([p])) for p in PATHS]
    if semantics == "batch":
        L = len(runs[0].router_logits)
        ref_aux = load_balancing_loss([torch.cat([r.router_logits[i] for r in runs]) for i in range(L)],
                                      cfg.num_experts, cfg.num_experts_per_tok)
    else:
        ref_aux = sum(w * r.aux_loss for w, r in zip(WEIGHTS, runs)) / len(PATHS)
    ref_loss = reference.run(model, PATHS, path_weights=WEIGHTS).loss + cfg.router_aux_loss_coef * ref_aux
    assert abs(float(out.aux_loss - ref_aux)) <= 1e-12 * abs(float(ref_aux))
    assert abs(float(out.loss - ref_loss)) <= 1e-12 * abs(float(ref_loss))
    assert rel(flat_grads(out.aux_loss, params), flat_grads(ref_aux, params)) < 1e-9
    assert rel(flat_grads(out.loss, params), flat_grads(ref_loss, params)) < 1e-9
    gates = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(gates) == cfg.num_hidden_layers == 2  # every layer's router gets a gradient from the aux loss
    assert all(float(g.norm()) > 0 for g in torch.autograd.grad(out.aux_loss, gates))


def test_reference_moe_model_packed_path_semantics_float64(ours):
    """``train_step`` on packed partitions (router_aux="path"): loss and gradients equal the whole tree's."""
    from treecompile.runtime.train import train_step

    model, tms = ours
    tree = Tree.from_paths(PATHS, path_weights=WEIGHTS)
    params = list(model.parameters())
    for p in params:
        p.grad = None
    res = train_step(tms["path"], tree, budget=8)
    g = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    out = tms["path"](tree.to_batch())
    assert res.metrics["partitions"] > 1
    assert abs(res.loss - float(out.loss)) <= 1e-12 * abs(float(out.loss))
    assert rel(g, flat_grads(out.loss, params)) < 1e-9
