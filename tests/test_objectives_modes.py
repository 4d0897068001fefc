"""Every objective in every mode: ``train_step`` whole, packed and redundancy-free == the per-path
computation (float64 dense model; loss and every parameter gradient to 1e-9 relative).

The per-path side is ``tests/test_objectives.py``'s: each objective's own formula, path by path, on
every path run alone.  Redundancy-free partitions cut paths: the token-level objectives (SFT, policy
gradient, PPO-clip, KL) run there; the path-level ``SequenceClip`` is refused by name.
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
    if mode == "redundancy_free" and name == "gspo":
        with pytest.raises(ValueError, match="SequenceClip needs every token of a path in one batch"):
            train_step(tm, traj, obj, normalize=normalize, **MODES[mode])
        return
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
