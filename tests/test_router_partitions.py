"""MoE router losses on every kind of step: whole tree, packed partitions, redundancy-free partitions,
several trees per step, both semantics, with the load-balancing loss and the router z-loss.

Reference: the per-path computation of our MoE model (float64): every path of the step run alone,
the LM loss ``reference.run`` over the concatenated paths, plus ``coef * aux (+ z_coef * z)`` with

- ``"batch"``: ``load_balancing_loss`` / ``router_z_loss`` over all the step's path rows packed together;
- ``"path"``: ``sum_p (w_p / N) aux(p)`` (and z), N the step's paths.

``train_step``'s loss, ``metrics["aux_loss"]`` / ``["z_loss"]`` and every parameter gradient (routers
included) equal it to 1e-9 relative.  Partitioned steps run the counting pre-pass (checked: it ran only
where needed); a batch whose routing differs from its pre-pass is refused.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from treecompile import Tree, reference
from treecompile.router_aux import ROUTER_WEIGHTS, RoutingMismatchError
from treecompile.runtime.train import train_step
from helpers import cached_compile, cached_model

REL = 1e-9
TREES = [
    ([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [1, 2, 8, 9, 10, 11, 12], [13, 14], [1, 2, 3, 4, 5, 6], [1, 2, 3]],
     [1.0, 0.5, 2.0, 1.0, 1.5, 0.75]),
    ([[20, 21, 22, 23], [20, 21, 24, 25, 26], [20, 27]], [1.0, 1.0, 0.5]),
]
STEPS = {
    "whole": dict(),
    "packed": dict(budget=9, mode="packed"),
    "redundancy_free": dict(budget=3, mode="redundancy_free"),
}


def make_model(z: float):
    from treecompile.models import HybridConfig, HybridForCausalLM

    torch.manual_seed(0)
    # 2 layers (tiny's 4 halved: capture and every run cost half), still one GDN layer (its conv and
    # recurrent state cross partition boundaries) and one attention layer, both MoE (the router losses
    # average over layers)
    cfg = HybridConfig.tiny(vocab_size=31, num_experts=4, output_router_logits=True, router_aux_loss_coef=0.1,
                            router_z_loss_coef=z, num_hidden_layers=2,
                            layer_types=("linear_attention", "full_attention"))
    model = HybridForCausalLM(cfg).double()
    for layer in model.model.layers:  # spread the routers: no near-ties in top-k
        if hasattr(layer.mlp, "gate"):
            torch.nn.init.normal_(layer.mlp.gate.weight, std=1.0)
    return model


def moe_model(z: float):
    """``make_model(z)``, captured once per process and z (``helpers.cached_model``)."""
    return cached_model(f"router-moe-spread-z{z}", lambda: make_model(z))


@pytest.fixture(scope="module")
def moes():
    """z -> (model, {(semantics, boundary): TreeModel}, per-path references); one model per z for the
    whole module (every test reads its pristine weights: none steps an optimizer), built on first use."""
    built = {}

    def get(z):
        if z not in built:
            model = moe_model(z)
            tms = {(s, rf): cached_compile(model, router_aux=s, boundary=rf) for s in ("batch", "path") for rf in (False, True)}
            built[z] = (model, tms, PerPath(model))
        return built[z]

    return get


@pytest.fixture(scope="module", params=[0.0, 0.02], ids=["aux", "aux+z"])
def moe(request, moes):
    return moes(request.param)


class PerPath:
    """The per-path reference of a step of ``TREES[:num_trees]``, computed once per number of trees for
    both semantics (the paths run alone and the LM loss are shared; only the router losses' grouping
    differs) and reused by every step kind: ``self(num_trees, semantics)`` -> (loss, aux, z, gradients
    of loss by parameter name).  The tensors keep their graphs (``z``'s gradients are taken later)."""

    def __init__(self, model):
        self.model, self.memo = model, {}

    def __call__(self, num_trees, semantics):
        if num_trees not in self.memo:
            params = dict(self.model.named_parameters())
            refs = per_path(self.model, TREES[:num_trees])
            self.memo[num_trees] = {
                s: (loss, aux, z, dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True,
                                                                        retain_graph=True))))
                for s, (loss, aux, z) in refs.items()}
        return self.memo[num_trees][semantics]


def per_path(model, trees):
    """The step's per-path loss (LM + router losses) and its aux and z parts, by semantics."""
    from models.hybrid import load_balancing_loss, router_z_loss

    cfg = model.config
    paths = [p for ps, _ in trees for p in ps]
    weights = [w for _, ws in trees for w in ws]
    runs = [model(torch.tensor([p])) for p in paths]
    L = len(runs[0].router_logits)
    lm = reference.run(model, paths, path_weights=weights).loss
    rows = [torch.cat([r.router_logits[i] for r in runs]) for i in range(L)]
    parts = {
        "batch": (load_balancing_loss(rows, cfg.num_experts, cfg.num_experts_per_tok), router_z_loss(rows)),
        "path": (sum(w * r.aux_loss for w, r in zip(weights, runs)) / len(paths),
                 sum(w * router_z_loss(r.router_logits) for w, r in zip(weights, runs)) / len(paths)),
    }
    out = {}
    for semantics, (aux, z) in parts.items():
        loss = lm + cfg.router_aux_loss_coef * aux
        if cfg.router_z_loss_coef:
            loss = loss + cfg.router_z_loss_coef * z
        out[semantics] = (loss, aux, z)
    return out


def grads_of(model, fn):
    for p in model.parameters():
        p.grad = None
    res = fn()
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return res, g


def check(model, res, ref_loss, ref_aux, ref_z):
    cfg = model.config
    assert abs(res.loss - float(ref_loss)) <= REL * abs(float(ref_loss))
    assert abs(res.metrics["aux_loss"] - float(ref_aux)) <= REL * abs(float(ref_aux))
    if cfg.router_z_loss_coef:
        assert abs(res.metrics["z_loss"] - float(ref_z)) <= REL * abs(float(ref_z))
    else:
        assert res.metrics["z_loss"] is None


def compare_grads(model, got, want):
    """``got``: the step's gradients by parameter name; ``want``: the reference's (None: not reached)."""
    params = dict(model.named_parameters())
    worst = 0.0
    for n, w in want.items():
        if w is None:
            assert n not in got or float(got[n].norm()) == 0
            continue
        err = float((got[n] - w).norm()) / max(float(w.norm()), 1e-300)
        worst = max(worst, err)
        assert err <= REL, (n, err)
    gates = [n for n in params if n.endswith("mlp.gate.weight")]
    assert gates and all(float(got[n].norm()) > 0 for n in gates)
    return worst


@pytest.mark.parametrize("semantics", ["batch", "path"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("num_trees", [1, 2])
def test_router_losses_every_step_equal_per_path(moe, semantics, step, num_trees):
    model, tms, refs = moe
    trees = TREES[:num_trees]
    tm = tms[(semantics, step == "redundancy_free")]
    batch_trees = [Tree.from_paths(ps, path_weights=ws) for ps, ws in trees]
    res, g = grads_of(model, lambda: train_step(tm, batch_trees if num_trees > 1 else batch_trees[0], **STEPS[step]))
    ref_loss, ref_aux, ref_z, ref_grads = refs(num_trees, semantics)
    check(model, res, ref_loss, ref_aux, ref_z)
    compare_grads(model, g, ref_grads)
    # the counting pre-pass ran exactly where a batch cannot compute its router loss alone
    needed = step == "redundancy_free" or (semantics == "batch" and (step == "packed" or num_trees > 1))
    assert res.metrics["router_prepass"] == needed
    if step != "whole":
        assert res.metrics["partitions"] > num_trees


def test_pre_pass_counts_equal_training_counts_and_a_mismatch_is_refused(moe):
    """The coefficients' counts are the training pass's own (checked on every batch); counts that differ
    (here: one token's forged) raise RoutingMismatchError naming the token."""
    from treecompile.runtime.partition import pack
    from treecompile.runtime.router_step import count_routes, step_router_weights
    from treecompile.runtime.normalization import GlobalNorm, partition_batch

    model, tms, _ = moe
    tm = tms[("batch", False)]
    tree = Tree.from_paths(TREES[0][0], path_weights=TREES[0][1])
    plan = pack(tree, 9)
    counts = count_routes(tm, tree, plan, conv_kernel=4)
    whole = tm.router_counts(tm.program.run(tree.to_batch()), tree.num_tokens)
    assert torch.equal(counts, whole)  # owned tokens counted in their partitions == the whole tree's routing
    assert torch.equal(counts.sum(-1), torch.full((tree.num_tokens,), 2.0 * model.config.num_experts_per_tok))
    norm = GlobalNorm.of_tree(tree, "sum")
    (rw,) = step_router_weights(tm.router_aux, [tree], [counts], norm)
    forged = counts.clone()
    owned_by_1 = plan.batch(1).extras["tokens"][plan.batch(1).extras["owned"]]
    t = int(owned_by_1[0])
    forged[t] = forged[t].roll(1)
    assert not torch.equal(forged[t], counts[t])
    for i, cs in ((0, forged), (1, counts), (1, forged)):
        batch = partition_batch(plan, i, norm, conv_kernel=4)
        batch.extras[ROUTER_WEIGHTS] = dataclasses.replace(rw, counts=cs).take(
            batch.extras["tokens"], batch.extras["owned"], batch.num_tokens)
        if i == 1 and cs is forged:
            with pytest.raises(RoutingMismatchError, match=f"whole-tree token {t} .*not deterministic"):
                tm(batch)
        else:
            tm(batch)  # token t not owned by partition 0: not checked there; true counts pass


def test_partition_without_step_coefficients_is_refused(moe):
    model, tms, _ = moe
    from treecompile.runtime.partition import pack, partition_redundancy_free
    from treecompile.runtime.redundancy_free import run_redundancy_free

    tree = Tree.from_paths(TREES[0][0], path_weights=TREES[0][1])
    with pytest.raises(NotImplementedError, match="partitions holding part of the step's tokens"):
        tms[("batch", False)](pack(tree, 9).batch(0))
    for s in ("batch", "path"):
        with pytest.raises(NotImplementedError, match="partitions that cut paths"):
            run_redundancy_free(tms[(s, True)], partition_redundancy_free(tree, 3))


# ------------------------------------------------------------------ the router z-loss of our MoE model
@pytest.mark.parametrize("semantics", ["batch", "path"])
def test_z_loss_whole_tree_equals_per_path(moes, semantics):
    """``router_z_loss_coef > 0``: the model returns ``z_loss`` (dropped from the graph like ``aux_loss``);
    ``out.z_loss``, ``out.loss`` and the gradients of the z-loss (routers included) equal the per-path
    computation; the z-loss of the unweighted DFS rows (what the model computes on the tree) differs."""
    from models.hybrid import router_z_loss

    model, tms, refs = moes(0.02)
    tm = tms[(semantics, False)]
    assert tm.pass_results["rewrite_router_loss"].info["dropped"] == ["aux_loss", "z_loss"]
    assert tm.router_aux.z_coef == 0.02
    paths, weights = TREES[0]
    tree = Tree.from_paths(paths, path_weights=weights)
    out = tm(tree.to_batch())
    ref_loss, ref_aux, ref_z, _ = refs(1, semantics)
    assert abs(float(out.z_loss - ref_z)) <= 1e-12 * abs(float(ref_z))
    assert abs(float(out.loss - ref_loss)) <= 1e-12 * abs(float(ref_loss))
    params = list(model.parameters())
    gz = torch.autograd.grad(out.z_loss, params, allow_unused=True, retain_graph=True)
    wz = torch.autograd.grad(ref_z, params, allow_unused=True, retain_graph=True)
    for n, a, w in zip([n for n, _ in model.named_parameters()], gz, wz):
        assert (a is None) == (w is None), n
        if w is not None:
            assert float((a - w).norm()) <= 1e-10 * float(w.norm()), n
    gates = [a for (n, _), a in zip(model.named_parameters(), gz) if n.endswith("mlp.gate.weight")]
    assert gates and all(float(a.norm()) > 0 for a in gates)
    # near miss: the z-loss over the DFS rows, each shared token once
    dfs = router_z_loss([r[:tree.num_tokens] for r in tm.program.run(tree.to_batch())[2:]])
    assert abs(float(dfs - ref_z)) > 1e-6 * abs(float(ref_z))


def test_z_loss_off_by_default_leaves_the_model_unchanged(moes):
    """``router_z_loss_coef = 0`` (the default): no ``z_loss`` output, the same graph as before."""
    model, tms, _ = moes(0.0)
    assert model(torch.tensor([[1, 2, 3]])).z_loss is None
    tm = tms[("batch", False)]
    assert tm.pass_results["rewrite_router_loss"].info["dropped"] == ["aux_loss"]
    assert tm.router_aux.z_coef == 0.0
    out = tm(Tree.from_paths([[1, 2, 3], [1, 2, 4]]).to_batch())
    assert out.z_loss is None


def test_redundancy_free_pre_pass_counts_are_checked(moe):
    """Redundancy-free partitions: the pre-pass counts equal the whole tree's routing, and a partition
    whose routing differs from its step's counts (one token's forged) is refused by name."""
    import dataclasses as dc

    from treecompile.runtime.normalization import GlobalNorm
    from treecompile.runtime.partition import partition_redundancy_free
    from treecompile.runtime.redundancy_free import prepass_redundancy_free, run_redundancy_free
    from treecompile.runtime.router_step import step_router_weights

    _, tms, _ = moe
    tree = Tree.from_paths(TREES[0][0], path_weights=TREES[0][1])
    plan = partition_redundancy_free(tree, 3)
    pre = prepass_redundancy_free(tms[("path", True)], plan)
    whole = tms[("path", False)]
    assert torch.equal(pre.counts, whole.router_counts(whole.program.run(tree.to_batch()), tree.num_tokens))
    (rw,) = step_router_weights(tms[("path", True)].router_aux, [tree], [pre.counts], GlobalNorm.of_tree(tree, "sum"))
    forged = pre.counts.clone()
    forged[7] = forged[7].roll(1)
    assert not torch.equal(forged[7], pre.counts[7])
    with pytest.raises(RoutingMismatchError, match="whole-tree token 7 "):
        run_redundancy_free(tms[("path", True)], plan, router=dc.replace(rw, counts=forged))
