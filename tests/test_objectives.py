"""Objectives on a tree == the same objective computed path by path (float64, loss and every grad).

The tree side runs the compiled TreeModel (``treecompile.compile(model)``) once on the tree and
evaluates each objective on its DFS log-probs.  The per-path side runs every path alone through the
unmodified model (``reference.path_logprobs``) and evaluates each objective with its own formula,
path by path, token by token.  (Objectives on partitions and several trees: ``test_train.py``.)
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treecompile import NORMALIZATIONS, Tree, reference
from treecompile.models import DenseConfig
from treecompile.runtime.data import scatter_to_dfs
from treecompile.runtime.normalization import GlobalNorm, token_coefficients, tree_batch
from treecompile.runtime.objectives import SFT, KLPenalty, PolicyGradient, PPOClip, SequenceClip, grpo_advantages
from strategies import ODD_TREES, weighted_path_sets

REL = 1e-9
VOCAB = DenseConfig.tiny().vocab_size


# ---------------------------------------------------------------------- the two sides
def path_coefs(masks, weights, normalize):
    """c_p written out from the normalization formulas (independent of Tree.path_coefficients)."""
    N = len(masks)
    counts = [sum(m) for m in masks]
    if normalize == "sum":
        return [w / N for w in weights]
    if normalize == "path_mean":
        return [w / (N * n) if n else 0.0 for w, n in zip(weights, counts)]
    total = sum(counts)
    return [w / total if total else 0.0 for w in weights]


class Case:
    """A tree with masks, weights, mixed-sign advantages and per-path old/ref log-probs."""

    def __init__(self, model, paths, masks=None, weights=None, advantages=None, seed=0):
        rng = random.Random(seed)
        self.paths = [list(p) for p in paths]
        P = len(paths)
        self.masks = masks if masks is not None else [[0] + [1] * (len(p) - 1) for p in paths]
        self.weights = weights if weights is not None else [1.0] * P
        self.advantages = advantages if advantages is not None else [rng.uniform(-2, 2) for _ in range(P)]
        self.tree = Tree.from_paths(self.paths, loss_masks=masks, path_weights=weights)
        # old/ref log-probs: a function of the prefix (so shared tokens agree) on trained tokens;
        # different garbage on every untrained occurrence (must never be read)
        self.lps = [reference.path_logprobs(model, p) for p in self.paths]  # one forward per path
        self.lp0 = [lp.detach() for lp in self.lps]
        noise_old, noise_ref = {}, {}
        self.old, self.ref = [], []
        for p, m, lp in zip(self.paths, self.masks, self.lp0):
            o, r = [], []
            for i in range(len(p)):
                key = tuple(p[: i + 1])
                if m[i]:
                    o.append(float(lp[i]) + noise_old.setdefault(key, rng.gauss(0, 0.3)))
                    r.append(float(lp[i]) + noise_ref.setdefault(key, rng.gauss(0, 0.5)))
                else:
                    o.append(rng.uniform(-9, 9))
                    r.append(rng.uniform(-9, 9))
            self.old.append(o)
            self.ref.append(r)

    def dfs(self, per_path):
        given = torch.tensor([bool(x) for m in self.masks for x in m])
        return scatter_to_dfs(self.tree, torch.tensor([x for v in per_path for x in v], dtype=torch.float64), given=given)


def tree_loss(obj, tmodel, case: Case, normalize):
    batch = case.tree.to_batch(normalize=normalize)
    lp = tmodel(batch).logprobs
    if isinstance(obj, SFT):
        return obj.loss(lp, batch)
    if isinstance(obj, PolicyGradient):
        return obj.loss(lp, batch, advantages=torch.tensor(case.advantages, dtype=torch.float64))
    if isinstance(obj, KLPenalty):
        return obj.loss(lp, batch, ref_logprobs=case.dfs(case.ref))
    return obj.loss(lp, batch, advantages=torch.tensor(case.advantages, dtype=torch.float64), old_logprobs=case.dfs(case.old))


def per_path_loss(obj, model, case: Case, normalize, *, fresh=False):
    """Each objective's own formula, path by path, on every path's own log-probs."""
    if isinstance(obj, SFT) and fresh:
        return reference.run(model, case.paths, loss_masks=case.masks, path_weights=case.weights,
                             normalize=normalize).loss
    c = path_coefs(case.masks, case.weights, normalize)
    N = len(case.paths)
    total = torch.zeros((), dtype=torch.float64)
    for p, path in enumerate(case.paths):
        lp = reference.path_logprobs(model, path) if fresh else case.lps[p]  # [|p|], this path alone
        m = torch.tensor(case.masks[p], dtype=torch.float64)
        old = torch.tensor(case.old[p], dtype=torch.float64)
        ref = torch.tensor(case.ref[p], dtype=torch.float64)
        A = case.advantages[p]
        if isinstance(obj, PolicyGradient):
            total = total - c[p] * A * (m * lp).sum()
        elif isinstance(obj, PPOClip):
            r = torch.exp(lp - old)
            total = total - c[p] * (m * torch.min(r * A, torch.clamp(r, 1 - obj.clip_low, 1 + obj.clip_high) * A)).sum()
        elif isinstance(obj, KLPenalty):
            d = ref - lp
            k = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - d - 1}[obj.estimator]
            total = total + obj.beta * c[p] * (m * k).sum()
        elif isinstance(obj, SFT):
            total = total - c[p] * (m * lp).sum()
        elif isinstance(obj, SequenceClip):
            n = m.sum()
            s = torch.exp((m * (lp - old)).sum() / n) if n > 0 else torch.ones((), dtype=torch.float64)
            clipped = torch.clamp(s, 1 - obj.clip_low, 1 + obj.clip_high)
            total = total - case.weights[p] / N * torch.min(s * A, clipped * A)
    return total


def grads(model, loss):
    names, params = zip(*model.named_parameters())
    if not loss.requires_grad:  # e.g. a tree of one-token paths: nothing is predicted
        return {n: torch.zeros_like(p) for n, p in zip(names, params)}
    gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for n, g, p in zip(names, gs, params)}


def assert_equal_loss_and_grads(obj, model, tmodel, case, normalize, *, expect_nonzero=False, fresh=False):
    """``fresh``: the per-path side runs its own forwards (else it reuses the case's per-path ones)."""
    lt = tree_loss(obj, tmodel, case, normalize)
    gt = grads(model, lt)
    lr = per_path_loss(obj, model, case, normalize, fresh=fresh)
    gr = grads(model, lr)
    assert lt.dtype == torch.float64
    assert abs(lt.item() - lr.item()) <= REL * abs(lr.item()) + 1e-15, (lt.item(), lr.item())
    total = math.sqrt(sum(float(g.norm()) ** 2 for g in gr.values()))
    for n in gr:
        err = float((gt[n] - gr[n]).norm())
        assert err <= REL * float(gr[n].norm()) + 1e-15 * (1 + total), (n, err, float(gr[n].norm()))
    if expect_nonzero:
        assert lr.item() != 0 and total > 0


OBJECTIVES = {
    "sft": SFT(),
    "pg": PolicyGradient(),
    "ppo_clip": PPOClip(),
    "ppo_clip_higher": PPOClip(clip_low=0.1, clip_high=0.28),
    "kl_k3": KLPenalty(beta=0.3),
    "kl_k1": KLPenalty(beta=0.3, estimator="k1"),
    "kl_k2": KLPenalty(beta=0.3, estimator="k2"),
    "gspo": SequenceClip(clip_low=0.05, clip_high=0.08),
}


def mixed_case(model):
    """Path 0's trained tokens (4 5 6) are path 1's untrained prompt; path 3 duplicates path 0 with
    another mask; advantages of both signs; one path trains nothing."""
    paths = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 5, 6],
             [1, 2, 3, 4, 5, 6, 7, 10], [1, 2]]
    masks = [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0],
             [0, 0, 0, 0, 1, 1, 1, 1], [0, 0]]
    weights = [1.0, 0.5, 2.0, 1.0, -0.75, 1.0]
    advantages = [1.5, -0.7, 0.3, -2.0, 0.9, 1.0]
    return Case(model, paths, masks, weights, advantages, seed=1)


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_mixed_tree(model, tmodel, name, normalize):
    assert_equal_loss_and_grads(OBJECTIVES[name], model, tmodel, mixed_case(model), normalize, expect_nonzero=True,
                                fresh=True)


@pytest.mark.parametrize("tree", list(ODD_TREES))
def test_odd_trees(model, tmodel, tree):
    """Every objective on every odd shape; the normalization rotates with objective and tree, so
    over the trees each objective meets every normalization (all pairs run in test_mixed_tree)."""
    k = sorted(ODD_TREES).index(tree)
    case = Case(model, ODD_TREES[tree], seed=k)
    for i, obj in enumerate(OBJECTIVES.values()):
        assert_equal_loss_and_grads(obj, model, tmodel, case, NORMALIZATIONS[(i + k) % len(NORMALIZATIONS)])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=weighted_path_sets(max_paths=6, max_len=8), seed=st.integers(0, 10**6),
       normalize=st.sampled_from(NORMALIZATIONS))
def test_random_trees_all_objectives(model, tmodel, data, seed, normalize):
    paths, masks, weights = data
    case = Case(model, paths, masks, weights, seed=seed)
    for obj in OBJECTIVES.values():
        assert_equal_loss_and_grads(obj, model, tmodel, case, normalize)


def test_ppo_clip_on_policy_ratio_one(model, tmodel):
    """old == current log-probs (ratio exactly 1, the first PPO step): still equal."""
    case = mixed_case(model)
    case.old = [[float(x) for x in lp] for lp in case.lp0]
    assert_equal_loss_and_grads(PPOClip(), model, tmodel, case, "token_mean", expect_nonzero=True)


def test_ppo_clip_needs_split_advantages(model, tmodel):
    """Negative control: summing the paths' advantages before the min (one A per token) is wrong
    with mixed signs; the S+/S- split is what makes the tree loss equal."""
    case = mixed_case(model)
    batch = case.tree.to_batch(normalize="sum")
    lp = tmodel(batch).logprobs.detach()
    old = case.dfs(case.old)
    A = torch.tensor(case.advantages, dtype=torch.float64)
    w = token_coefficients(case.tree, "sum", A)  # sum_p c_p A_p m[p,t]
    r = torch.exp(lp - old)
    naive = -torch.minimum(r * w, r.clamp(0.8, 1.2) * w).sum()
    right = PPOClip().loss(lp, batch, advantages=A, old_logprobs=old)
    assert abs(naive.item() - right.item()) > 1e-3
    assert abs(right.item() - per_path_loss(PPOClip(), model, case, "sum").item()) < 1e-9 * abs(right.item())


def test_padded_batch_and_override_normalize(model, tmodel):
    """A padded batch (logprobs 0 at padding) and an objective normalize that differs from the batch's."""
    case = mixed_case(model)
    batch = case.tree.to_batch(normalize="sum", pad_to_multiple=16)
    assert batch.seq_len > case.tree.num_tokens
    lp_pad = tmodel(batch).logprobs  # 0 at padding
    A = torch.tensor(case.advantages, dtype=torch.float64)
    for n in NORMALIZATIONS:
        for obj, kw in [(SFT(normalize=n), {}), (PolicyGradient(normalize=n), dict(advantages=A)),
                        (PPOClip(normalize=n), dict(advantages=A, old_logprobs=case.dfs(case.old))),
                        (KLPenalty(0.5, normalize=n), dict(ref_logprobs=case.dfs(case.ref)))]:
            want = per_path_loss(obj, model, case, n).item()
            got = obj.loss(lp_pad, batch, **kw).item()
            assert abs(got - want) <= REL * abs(want), (obj, n, got, want)


def test_argument_errors(model):
    case = mixed_case(model)
    batch = case.tree.to_batch()
    lp = torch.zeros(batch.seq_len, dtype=torch.float64)
    with pytest.raises(ValueError, match="logprobs: expected a tensor of shape"):
        SFT().loss(lp[:-1], batch)
    with pytest.raises(ValueError, match="advantages: not given and not in batch.extras"):
        PolicyGradient().loss(lp, batch)
    with pytest.raises(ValueError, match=r"advantages: expected shape \[6\]"):
        PolicyGradient().loss(lp, batch, advantages=torch.ones(5))
    with pytest.raises(ValueError, match="advantages: path 2: not finite"):
        PolicyGradient().loss(lp, batch, advantages=torch.tensor([1, 1, math.nan, 1, 1, 1]))
    with pytest.raises(ValueError, match="old_logprobs: expected DFS order"):
        PPOClip().loss(lp, batch, advantages=torch.ones(6), old_logprobs=torch.zeros(case.tree.num_path_tokens))
    with pytest.raises(ValueError, match="normalize: expected one of"):
        SFT(normalize="mean").loss(lp, batch)
    with pytest.raises(ValueError, match="KLPenalty.estimator"):
        KLPenalty(0.1, estimator="k4")
    for beta in (True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="KLPenalty.beta: expected a finite number"):
            KLPenalty(beta)
    with pytest.raises(ValueError, match="PPOClip: need"):
        PPOClip(clip_low=1.0)


def test_grpo_advantages():
    A = grpo_advantages([1.0, 0.0, 0.0, 1.0])
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    assert torch.allclose(A, (r - 0.5) / (r.std() + 1e-6), rtol=0, atol=1e-15)
    assert grpo_advantages([3.0, 1.0], scale=False).tolist() == [1.0, -1.0]
    assert grpo_advantages([2.0]).tolist() == [0.0]
    with pytest.raises(ValueError, match="rewards: path 1: not finite"):
        grpo_advantages([0.0, math.inf])
    # one tree's rewards: [1, P] and [P, 1] are that; [groups, P] (several trees at once) would mix the groups
    assert grpo_advantages([[3.0, 1.0]], scale=False).tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match=r"rewards: expected one reward per path of one tree, got shape \(2, 2\)"):
        grpo_advantages([[1.0, 0.0], [0.0, 1.0]])
    with pytest.raises(ValueError, match="rewards: expected numbers, got bools"):
        grpo_advantages([True, False])


def test_bool_advantages_are_refused():
    """Advantages are numbers per path: bools (taken as 1/0) are refused, as path weights refuse them."""
    tree = Tree.from_paths([[1, 2, 3], [1, 4]])
    with pytest.raises(ValueError, match="advantages: expected numbers, one per path, got bools"):
        PolicyGradient().token_weights(tree, GlobalNorm.from_trees([tree], "sum"), advantages=[True, False])


def test_untrained_tokens_cannot_poison_the_loss(model, tmodel):
    """A token no path trains has weight 0 and no old/ref value: an extreme log-prob there (exp
    would overflow) must leave loss and gradient finite and unchanged."""
    case = mixed_case(model)
    batch = case.tree.to_batch()
    lp = tmodel(batch).logprobs.detach()
    untrained = torch.nonzero(batch.loss_weight == 0).flatten()
    assert untrained.numel() > 0
    A = torch.tensor(case.advantages, dtype=torch.float64)
    for obj, kw in [(PPOClip(), dict(advantages=A, old_logprobs=case.dfs(case.old))),
                    (KLPenalty(1.0), dict(ref_logprobs=case.dfs(case.ref)))]:
        base = lp.clone().requires_grad_(True)
        extreme = lp.clone()
        extreme[untrained] = -800.0
        extreme.requires_grad_(True)
        l0, l1 = obj.loss(base, batch, **kw), obj.loss(extreme, batch, **kw)
        (g0,), (g1,) = torch.autograd.grad(l0, base), torch.autograd.grad(l1, extreme)
        assert l1.item() == l0.item() and torch.isfinite(g1).all() and torch.equal(g0, g1)


def test_linear_objectives_say_their_token_weights_and_take_a_typed_norm(model):
    """``token_weights`` of SFT / PolicyGradient are the weights their loss uses; a step's GlobalNorm
    given as ``norm`` scales them exactly as it scales the batch built with it; the normalization of
    one tree alone is ``Tree.path_coefficients`` to the bit (one formula)."""
    case = mixed_case(model)
    tree = case.tree
    A = torch.tensor(case.advantages, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    lp = -torch.rand(tree.num_tokens, generator=g, dtype=torch.float64)
    for n in NORMALIZATIONS:
        one = GlobalNorm.of_tree(tree, n)
        assert torch.equal(one.path_coefficients(tree), tree.path_coefficients(n))
        assert torch.equal(SFT().token_weights(tree, one), tree.token_weights(n))
        assert torch.equal(PolicyGradient().token_weights(tree, one, {"advantages": A}),
                           token_coefficients(tree, n, A))
        # a step of two copies of the tree, grad_scale 3: half the "sum"/"token_mean" weights, times 3
        step = GlobalNorm.from_trees([tree, tree], n, grad_scale=3.0)
        batch = tree_batch(tree, step)
        for obj, kw in [(SFT(), {}), (PolicyGradient(), dict(advantages=A))]:
            w = obj.token_weights(tree, step, {"advantages": A})
            got = obj.loss(lp, batch, norm=step, **kw)
            assert torch.equal(got, -(w * lp).sum()), (obj, n)
        assert torch.equal(batch.loss_weight, SFT().token_weights(tree, step))
        assert torch.equal(SFT(normalize="sum").token_weights(tree, step), step.with_normalize("sum").token_weights(tree))
    with pytest.raises(TypeError, match="GlobalNorm"):
        SFT().loss(lp, tree.to_batch(), norm="sum")
    with pytest.raises(ValueError, match="advantages: not given"):
        PolicyGradient().token_weights(tree, GlobalNorm.of_tree(tree, "sum"), {})


def test_objectives_without_norm_take_the_batch_own():
    """A batch built with a step's normalization (``tree_batch(tree, step)``): every objective called without
    ``norm=`` normalizes by that step, as SFT's ``loss_weight`` does (PolicyGradient took the tree alone: 3x here,
    and a PPO + KL sum was mis-weighted)."""
    t1 = Tree.from_paths([[1, 2, 3], [1, 2, 4]])
    t2 = Tree.from_paths([[5, 6, 7], [5, 8], [9, 9, 9], [3, 3]])
    step = GlobalNorm.from_trees([t1, t2], "sum")
    b = tree_batch(t1, step)
    lp = -torch.arange(1.0, b.seq_len + 1, dtype=torch.float64) / 7
    ones = torch.ones(2, dtype=torch.float64)
    sft = SFT().loss(lp, b)
    assert torch.allclose(sft, SFT().loss(lp, b, norm=step), rtol=1e-15)
    assert torch.allclose(PolicyGradient().loss(lp, b, advantages=ones), sft, rtol=1e-15)
    alone = t1.to_batch()  # no step: the tree alone, as before
    assert torch.allclose(PolicyGradient().loss(lp, alone, advantages=ones), SFT().loss(lp, alone), rtol=1e-15)
    assert not torch.allclose(SFT().loss(lp, alone), sft)


def test_ambiguous_per_token_values_of_a_padded_partition_are_refused():
    """A partition padded to as many tokens as the whole tree: values of that length could be either; they were
    read as the whole tree's (a PPO loss of 0.39 instead of -0.14)."""
    from treecompile.runtime.partition import pack

    tree = Tree.from_paths([[1, 2, 3, 4], [1, 5, 6, 7], [1, 5, 8]])
    plan = pack(tree, 4)
    step = GlobalNorm.of_tree(tree, "sum")
    b = plan.batch(1, normalize="sum", weights=step.token_weights(tree), pad_to_multiple=tree.num_tokens)
    assert b.seq_len == tree.num_tokens and b.num_tokens < b.seq_len
    lp = torch.zeros(b.seq_len, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"old_logprobs: 8 values are as many as the whole tree's tokens and as "
                                         r"this partition's padded length"):
        PPOClip().loss(lp, b, advantages=torch.ones(3), old_logprobs=torch.zeros(tree.num_tokens))
    PPOClip().loss(lp, b, advantages=torch.ones(3), old_logprobs=torch.zeros(b.num_tokens))  # the partition's own


def test_objectives_on_a_moved_partition_read_its_host_values_not_the_device():
    """A partition batch moved to the GPU (``TreeBatch.to``) keeps its extras' host values; the objectives read
    ``tokens`` / ``owned`` through them (no wait for the GPU's queue after the forward). Meta tensors stand in for
    the device ones: any read of them fails. Every loss equals the one on the host batch."""
    import dataclasses

    from treecompile.host_values import remember_host
    from treecompile.runtime.partition import pack

    tree = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5], [1, 6, 7, 8, 9], [1, 6, 10]])
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    for batch in pack(tree, 6).batches(normalize="sum"):
        lp = -torch.rand(batch.seq_len, generator=g, dtype=torch.float64)
        old = lp + 0.1 * torch.randn(batch.seq_len, generator=g, dtype=torch.float64)
        moved = {k: remember_host(torch.empty(v.shape, dtype=v.dtype, device="meta"), v)
                 for k, v in batch.extras.items() if k in ("tokens", "owned")}
        meta_batch = dataclasses.replace(batch, extras={**batch.extras, **moved})
        for obj, kw in ((SFT(), {}), (PPOClip(), dict(advantages=adv, old_logprobs=old)),
                        (SequenceClip(), dict(advantages=adv, old_logprobs=old))):
            want = obj.loss(lp, batch, **kw)
            assert torch.equal(obj.loss(lp, meta_batch, **kw), want), type(obj).__name__
