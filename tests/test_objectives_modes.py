"""Every objective in every mode: ``train_step`` whole, packed and redundancy-free == the per-path
computation (float64 dense model; loss and every parameter gradient to 1e-9 relative).

The per-path side is ``tests/test_objectives.py``'s: each objective's own formula, path by path, on
every path run alone.  Redundancy-free partitions cut paths: the token-level objectives (SFT, policy
gradient, PPO-clip, KL, entropy bonus) run on each partition's tokens; the path-level ``SequenceClip``
is linearized at the log-probs of a pre-pass (``treecompile.runtime.path_level``), exact as well.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import cached_compile
from treecompile.runtime.data import TrajectoryTree
from treecompile.runtime.train import train_step
from test_objectives import OBJECTIVES, REL, Case, grads, mixed_case, per_path_loss

MODES = {"whole": dict(), "packed": dict(budget=10, mode="packed"), "redundancy_free": dict(budget=3, mode="redundancy_free")}


@pytest.fixture(scope="module")
def boundary_model(model):
    return cached_compile(model, boundary=True)


def trajectory(case: Case) -> TrajectoryTree:
    P = len(case.paths)
    return TrajectoryTree(tree_id=0, tree=case.tree, source="test", lines=list(range(1, P + 1)),
                          advantages=torch.tensor(case.advantages, dtype=torch.float64),
                          old_logprobs=torch.tensor([x for v in case.old for x in v], dtype=torch.float64),
                          ref_logprobs=torch.tensor([x for v in case.ref for x in v], dtype=torch.float64))


def step_grads(model, tm, traj, obj, normalize, kw):
    for p in model.parameters():
        p.grad = None
    res = train_step(tm, traj, obj, normalize=normalize, **kw)
    g = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return res, g


@pytest.mark.parametrize("normalize", ["sum", "token_mean"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_objective_in_every_mode_equals_per_path(model, tmodel, boundary_model, name, mode, normalize):
    obj = OBJECTIVES[name]
    case = mixed_case(model)
    traj = trajectory(case)
    tm = boundary_model if mode == "redundancy_free" else tmodel
    res, gt = step_grads(model, tm, traj, obj, normalize, MODES[mode])
    lr = per_path_loss(obj, model, case, normalize)
    gr = grads(model, lr)
    assert abs(res.loss - lr.item()) <= REL * abs(lr.item()) + 1e-15, (res.loss, lr.item())
    total = math.sqrt(sum(float(g.norm()) ** 2 for g in gr.values()))
    assert total > 0
    for n in gr:
        err = float((gt[n] - gr[n]).norm())
        assert err <= REL * float(gr[n].norm()) + 1e-15 * (1 + total), (n, err, float(gr[n].norm()))
    if mode != "whole":
        assert res.metrics["partitions"] > 1


def test_redundancy_free_objective_losses_sum_over_partitions(model, boundary_model):
    """A tuple of objectives (PPO-clip + KL, as GRPO trains) in redundancy-free mode: the sum of the two
    per-path losses, and more than one partition per path (paths are cut)."""
    case = mixed_case(model)
    objs = (OBJECTIVES["ppo_clip_higher"], OBJECTIVES["kl_k3"])
    res, gt = step_grads(model, boundary_model, trajectory(case), objs, "path_mean", MODES["redundancy_free"])
    lr = sum(per_path_loss(o, model, case, "path_mean") for o in objs)
    gr = grads(model, lr)
    assert abs(res.loss - lr.item()) <= REL * abs(lr.item())
    for n in gr:
        assert float((gt[n] - gr[n]).norm()) <= REL * float(gr[n].norm()) + 1e-15
    assert res.metrics["partitions"] >= max(len(p) for p in case.paths) // 3


@pytest.fixture(scope="module")
def entropy_models(model):
    return {"whole": cached_compile(model, entropy=True),
            "redundancy_free": cached_compile(model, boundary=True, entropy=True)}


@pytest.mark.parametrize("normalize", ["sum", "path_mean"])
@pytest.mark.parametrize("mode", list(MODES))
def test_entropy_bonus_in_every_mode_equals_per_path(model, entropy_models, mode, normalize):
    """``(PPOClip, EntropyBonus)``: the entropy comes from each batch's fused head (redundancy-free
    partitions included, ``compile(boundary=True, entropy=True)``); loss, gradients and the entropy
    metric equal the per-path computation (each path's softmax entropy, run alone)."""
    from test_entropy import per_path_entropy
    from test_objectives import path_coefs
    from treecompile.runtime.objectives import EntropyBonus

    case = mixed_case(model)
    bonus = EntropyBonus(0.05)
    objs = (OBJECTIVES["ppo_clip"], bonus)
    tm = entropy_models["redundancy_free" if mode == "redundancy_free" else "whole"]
    res, gt = step_grads(model, tm, trajectory(case), objs, normalize, MODES[mode])
    c = path_coefs(case.masks, case.weights, normalize)
    H = [per_path_entropy(model, p) for p in case.paths]
    masks = [torch.tensor(m, dtype=torch.float64) for m in case.masks]
    ent = -bonus.coef * sum(c[p] * (masks[p] * H[p]).sum() for p in range(len(case.paths)))
    lr = per_path_loss(objs[0], model, case, normalize) + ent
    gr = grads(model, lr)
    assert abs(res.loss - lr.item()) <= REL * abs(lr.item())
    for n in gr:
        assert float((gt[n] - gr[n]).norm()) <= REL * float(gr[n].norm()) + 1e-15, n
    mean_h = sum(float((m * h).sum()) for m, h in zip(masks, H)) / sum(float(m.sum()) for m in masks)
    assert abs(res.metrics["entropy"] - mean_h) <= 1e-12 * abs(mean_h)
    if mode != "whole":
        assert res.metrics["partitions"] > 1


def test_sequence_clip_redundancy_free_checks_the_linearization_point(model, boundary_model, monkeypatch):
    """SequenceClip on redundancy-free partitions uses the pre-pass log-probs: the step is refused when a
    partition's log-probs differ from them (a forward that is not deterministic), naming the token."""
    import treecompile.runtime.train as train_mod
    from treecompile.runtime.path_level import LogprobMismatchError, linearize

    def shifted(objectives, tree, logprobs, norm, **kw):
        lp = logprobs.clone()
        lp[5] += 1e-12  # what a nondeterministic kernel would do to one token
        return linearize(objectives, tree, lp, norm, **kw)

    monkeypatch.setattr(train_mod, "linearize", shifted)
    with pytest.raises(LogprobMismatchError, match="whole-tree token 5 .*not deterministic"):
        train_step(boundary_model, trajectory(mixed_case(model)), OBJECTIVES["gspo"], **MODES["redundancy_free"])


def test_a_redundancy_free_partition_is_refused_by_a_whole_tree_program(model, tmodel):
    """A partition of a redundancy-free plan reads context from the partitions above it: a whole-tree program ran
    it without that context (its losses summed to 5.96 against the tree's 14.0), now it refuses it by name."""
    from treecompile import Tree
    from treecompile.runtime.partition import partition_redundancy_free

    tree = Tree.from_paths([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 9, 10]])
    plan = partition_redundancy_free(tree, 4)
    fed = [i for i in range(len(plan)) if len(plan.batch(i).extras.get("boundary_index", ()))]
    assert fed, "the plan has no partition below another: the test proves nothing"
    with pytest.raises(ValueError, match="redundancy-free partition whose tokens read context"):
        tmodel(plan.batch(fed[0]))


def test_train_step_takes_a_logprob_tolerance(model, tmodel):
    """Paths that share a trained token give old log-probs 1e-5 apart: refused at the default tolerance, naming
    the option; accepted with ``logprob_atol`` (the first path's value), as ``TrajectoryTree.to_batch`` already
    allowed."""
    from treecompile import Tree
    from treecompile.runtime.objectives import PPOClip

    tree = Tree.from_paths([[1, 2, 3], [1, 2, 4]])
    old = torch.tensor([0, -1.0, -2.0, 0, -1.00001, -2.0], dtype=torch.float64)
    traj = TrajectoryTree(tree_id=0, tree=tree, source="t.jsonl", lines=[1, 2],
                          advantages=torch.ones(2, dtype=torch.float64), old_logprobs=old)
    with pytest.raises(ValueError, match=r"differ by 1e-05 > atol 1e-06"):
        train_step(tmodel, traj, PPOClip())
    res = train_step(tmodel, traj, PPOClip(), logprob_atol=1e-4)
    assert math.isfinite(float(res.loss))
    for p in model.parameters():
        p.grad = None


def test_nan_old_or_ref_logprob_at_a_trained_token_is_refused(model, tmodel):
    """NaN means "not given", which only an untrained token may be: a ``TrajectoryTree`` built in code with NaN at
    a trained token read it as 0 (PPO trained against old log-probs of 0, KL against ref 0) with no error."""
    from treecompile import Tree
    from treecompile.runtime.objectives import KLPenalty, PPOClip

    tree = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5]])
    nan = float("nan")
    good = torch.tensor([nan, -1.0, -2.0, -2.5, nan, -1.0, -3.0], dtype=torch.float64)  # the first tokens untrained
    bad = good.clone()
    bad[2] = nan
    for key, objective in (("old_logprobs", PPOClip()), ("ref_logprobs", KLPenalty(0.1))):
        ok = TrajectoryTree(tree_id=7, tree=tree, source="t.jsonl", lines=[1, 2],
                            advantages=torch.ones(2, dtype=torch.float64), **{key: good})
        assert math.isfinite(float(train_step(tmodel, ok, objective).loss))
        traj = TrajectoryTree(tree_id=7, tree=tree, source="t.jsonl", lines=[1, 2],
                              advantages=torch.ones(2, dtype=torch.float64), **{key: bad})
        with pytest.raises(ValueError, match=rf"tree 7 \(t.jsonl\): '{key}': .*token 2 is trained \(loss mask 1\) "
                                             rf"but has no value \(NaN\)"):
            train_step(tmodel, traj, objective)
    for p in model.parameters():
        p.grad = None
