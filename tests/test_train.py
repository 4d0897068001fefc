"""train_step == the whole-tree step == the per-path computation (float64, loss and every gradient).

For every objective: packed partitions at several budgets (including a budget that cuts the tree in
several partitions repeating shared prefixes), several trees in one step (one normalization over
all their paths), redundancy-free partitions for the linear objectives, a hybrid (GDN) model, and
torch optimizers.  The per-path side runs each path alone through the unmodified model and applies
each objective's own per-path formula (``test_objectives.per_path_loss``).
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch

import treecompile
from helpers import cached_compile, capture_once, shared_capture
from treecompile import NORMALIZATIONS, Tree
from treecompile.models import HybridConfig, HybridForCausalLM
from treecompile.runtime.data import TrajectoryTree
from treecompile.runtime.objectives import SFT, PolicyGradient, PPOClip, SequenceClip
from treecompile.runtime.partition import pack
from treecompile.runtime.train import train_step
from test_objectives import OBJECTIVES, Case, mixed_case, per_path_loss

REL = 1e-9
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bmodel(model):
    return cached_compile(model, boundary=True)


# ---------------------------------------------------------------------- helpers
def trajectories(case: Case, cuts=None) -> list[TrajectoryTree]:
    """The case's paths as TrajectoryTrees (split at ``cuts`` into several trees); old/ref log-probs
    NaN (null) at untrained tokens, as the JSONL reader gives them."""
    bounds = [0, *(cuts or []), len(case.paths)]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        masks = case.masks[lo:hi]

        def flat(per_path):
            return torch.tensor([x if m else math.nan for v, mk in zip(per_path[lo:hi], masks) for x, m in zip(v, mk)],
                                dtype=torch.float64)

        tree = Tree.from_paths(case.paths[lo:hi], loss_masks=masks, path_weights=case.weights[lo:hi])
        out.append(TrajectoryTree(tree_id=lo, tree=tree, source="case", lines=list(range(lo + 1, hi + 1)),
                                  advantages=torch.tensor(case.advantages[lo:hi], dtype=torch.float64),
                                  old_logprobs=flat(case.old), ref_logprobs=flat(case.ref)))
    return out


def step(tm, model, trees, obj, **kw):
    model.zero_grad(set_to_none=True)
    res = train_step(tm, trees, obj, **kw)
    g = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return res, g


def reference(model, obj, case, normalize):
    loss = per_path_loss(obj, model, case, normalize, fresh=True)
    names, params = zip(*model.named_parameters())
    if not loss.requires_grad:  # e.g. GSPO on paths that train nothing: a constant
        return loss.item(), {n: torch.zeros_like(p) for n, p in zip(names, params)}
    gs = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.item(), {n: (g if g is not None else torch.zeros_like(p)) for n, g, p in zip(names, gs, params)}


def assert_close(res, g, want_loss, want_g, what="", *, nonzero=True):
    assert abs(res.loss - want_loss) <= REL * abs(want_loss) + 1e-15, (what, res.loss, want_loss)
    total = math.sqrt(sum(float(x.norm()) ** 2 for x in want_g.values()))
    assert total > 0 or not nonzero, what
    for n in want_g:
        err = float((g[n] - want_g[n]).norm())
        assert err <= REL * float(want_g[n].norm()) + 1e-15 * (1 + total), (what, n, err, float(want_g[n].norm()))


# ---------------------------------------------------------------------- packed == whole == per path
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_packed_equals_whole_and_per_path(model, tmodel, name, normalize):
    """Mixed tree: path 0's trained tokens are path 1's untrained prompt, a duplicate path with
    another mask, a negative path weight, mixed-sign advantages; budgets from the longest path
    (several partitions that repeat shared prefixes) to the whole tree."""
    obj = OBJECTIVES[name]
    case = mixed_case(model)
    (tt,) = trajectories(case)
    want_loss, want_g = reference(model, obj, case, normalize)
    res, g = step(tmodel, model, tt, obj, normalize=normalize)
    assert res.metrics["partitions"] == 1 and res.metrics["err"] == pytest.approx(case.tree.por)
    assert_close(res, g, want_loss, want_g, "whole")
    longest = int(case.tree.path_lengths.max())
    for budget in (longest, longest + 1, case.tree.num_tokens):
        res, g = step(tmodel, model, tt, obj, budget=budget, normalize=normalize)
        assert res.metrics["partitions"] == len(pack(case.tree, budget))
        assert_close(res, g, want_loss, want_g, f"budget {budget}")
    assert len(pack(case.tree, longest)) >= 3  # the smallest budget really splits the tree


def test_step_prepares_each_batch_after_the_backward_before_it(model, tmodel, monkeypatch):
    """``train_step`` hands each batch after the first to ``TreeModel.prepare`` once the backward of the batch
    before it has run (the host then works while the GPU runs that backward), across partitions and trees, and
    runs the model on that same batch; the step's result is the one without preparing."""
    case = mixed_case(model)
    trees = trajectories(case, cuts=[2])
    want, want_g = step(tmodel, model, trees, SFT(), budget=9)
    events = []
    prepare, forward = tmodel.prepare, tmodel.forward

    def prepared(batch):
        events.append(("prepare", id(batch), any(p.grad is not None for p in model.parameters())))
        return prepare(batch)

    def forwarded(batch):
        events.append(("forward", id(batch), None))
        return forward(batch)
    monkeypatch.setattr(tmodel, "prepare", prepared)
    monkeypatch.setattr(tmodel, "forward", forwarded)
    res, g = step(tmodel, model, trees, SFT(), budget=9)
    n = res.metrics["partitions"]
    assert n > res.metrics["trees"] == 2 and len(events) == 2 * n - 1  # across partitions and trees
    assert [e[0] for e in events] == ["forward"] + ["prepare", "forward"] * (n - 1)
    for prep, fwd in zip(events[1::2], events[2::2]):
        assert prep[1] == fwd[1] and prep[2]  # the batch run next, prepared after a backward gave gradients
    assert res.loss == want.loss and all(torch.equal(g[k], want_g[k]) for k in g)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_several_trees_one_normalization(model, tmodel, name):
    """Two trees in one step (they even share a prefix): the loss is the per-path loss of all their
    paths together (N and the trained-token count of the whole step), whole and packed."""
    obj = OBJECTIVES[name]
    case = mixed_case(model)
    trees = trajectories(case, cuts=[2])
    k = list(OBJECTIVES).index(name)
    normalize = NORMALIZATIONS[k % 3]
    want_loss, want_g = reference(model, obj, case, normalize)
    for budget in (None, 9):
        res, g = step(tmodel, model, trees, obj, budget=budget, normalize=normalize)
        assert res.metrics["trees"] == 2 and res.metrics["paths"] == len(case.paths)
        assert_close(res, g, want_loss, want_g, f"budget {budget}")


def test_odd_trees_packed(model, tmodel):
    """Odd shapes (fan-out, duplicates, prefixes, forests) at the smallest budget, PPO-clip and GSPO."""
    from strategies import ODD_TREES

    for k, name in enumerate(sorted(ODD_TREES)):
        case = Case(model, ODD_TREES[name], seed=k)
        (tt,) = trajectories(case)
        budget = int(case.tree.path_lengths.max())
        for obj in (PPOClip(clip_low=0.1, clip_high=0.28), SequenceClip(clip_low=0.05, clip_high=0.08)):
            normalize = NORMALIZATIONS[k % 3]
            want_loss, want_g = reference(model, obj, case, normalize)
            if want_loss == 0:  # e.g. one-token paths: nothing is predicted
                continue
            res, g = step(tmodel, model, tt, obj, budget=budget, normalize=normalize)
            assert_close(res, g, want_loss, want_g, f"{name} {obj}", nonzero=False)  # GSPO may clip all


# ---------------------------------------------------------------------- redundancy-free
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_redundancy_free_sft_and_pg(model, tmodel, bmodel, normalize):
    """Every unique token once (ERR == POR), loss and gradients == whole-tree step == per path."""
    case = mixed_case(model)
    trees = trajectories(case)
    for obj in (SFT(), PolicyGradient()):
        want_loss, want_g = reference(model, obj, case, normalize)
        whole, gw = step(tmodel, model, trees, obj, normalize=normalize)
        assert_close(whole, gw, want_loss, want_g, "whole")
        for budget in (1, 3, 5, 100):
            res, g = step(bmodel, model, trees, obj, budget=budget, mode="redundancy_free", normalize=normalize)
            assert res.metrics["tokens_computed"] == case.tree.num_tokens
            assert res.metrics["err"] == pytest.approx(case.tree.por)
            assert_close(res, g, want_loss, want_g, f"{obj} budget {budget}")


def test_redundancy_free_several_trees(model, bmodel):
    case = mixed_case(model)
    want_loss, want_g = reference(model, SFT(), case, "token_mean")
    res, g = step(bmodel, model, trajectories(case, cuts=[3]), SFT(), budget=2, mode="redundancy_free",
                  normalize="token_mean")
    assert_close(res, g, want_loss, want_g)


# ---------------------------------------------------------------------- hybrid model
def test_hybrid_packed_ppo_and_rf_sft():
    torch.manual_seed(1)
    # tiny's 4 layers less one GDN layer (capture and runs cost 3/4): two GDN layers, each with its own
    # states across the partitions, and an attention layer
    model = HybridForCausalLM(HybridConfig.tiny(num_hidden_layers=3, layer_types=(
        "linear_attention", "linear_attention", "full_attention"))).double()
    case = mixed_case(model)
    (tt,) = trajectories(case)
    obj = PPOClip(clip_low=0.1, clip_high=0.28)
    want_loss, want_g = reference(model, obj, case, "path_mean")
    with capture_once(model):  # one torch.export for the whole and the partition graph
        tm, bm = treecompile.compile(model), treecompile.compile(model, boundary=True)
    res, g = step(tm, model, tt, obj, budget=9, normalize="path_mean")
    assert res.metrics["partitions"] >= 3
    assert_close(res, g, want_loss, want_g, "hybrid packed PPO")
    want_loss, want_g = reference(model, SFT(), case, "sum")
    res, g = step(bm, model, tt, SFT(), budget=3, mode="redundancy_free")
    assert_close(res, g, want_loss, want_g, "hybrid redundancy-free SFT")


# ---------------------------------------------------------------------- optimizers
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.Adam(ps, lr=1e-2)], ids=["sgd", "adam"])
def test_any_optimizer(model, tmodel, make_opt):
    """Two steps with the optimizer inside train_step == two per-path steps (zero_grad between:
    without it the second step would see accumulated gradients)."""
    case = mixed_case(model)
    (tt,) = trajectories(case)
    obj = PPOClip()
    start = copy.deepcopy(model.state_dict())
    opt = make_opt(list(model.parameters()))
    for _ in range(2):
        train_step(tmodel, tt, obj, opt, budget=9, normalize="token_mean")
    got = copy.deepcopy(model.state_dict())
    model.load_state_dict(start)
    opt = make_opt(list(model.parameters()))
    for _ in range(2):
        opt.zero_grad()
        per_path_loss(obj, model, case, "token_mean", fresh=True).backward()
        opt.step()
    want = copy.deepcopy(model.state_dict())
    model.load_state_dict(start)
    moved = 0.0
    for n in want:
        delta = float((want[n] - start[n]).norm())
        moved = max(moved, delta)
        assert float((got[n] - want[n]).norm()) <= 1e-9 * max(delta, 1e-3), n
    assert moved > 1e-4  # the optimizer really stepped


# ---------------------------------------------------------------------- metrics, progress, errors
def test_metrics_and_progress(model, tmodel, capsys):
    case = mixed_case(model)
    (tt,) = trajectories(case)
    res = train_step(tmodel, tt, SFT(), budget=9, progress=True)
    model.zero_grad(set_to_none=True)
    m = res.metrics
    plan = pack(case.tree, 9)
    assert m["tokens_computed"] == plan.cost > case.tree.num_tokens
    assert m["err"] == pytest.approx(plan.reuse().err) and m["err"] < m["por"] == pytest.approx(case.tree.por)
    assert m["peak_tokens"] == max(p.num_tokens for p in plan.partitions) <= 9
    assert m["seconds"] > 0 and m["grad_norm"] > 0 and m["mode"] == "packed"
    err = capsys.readouterr().err
    assert f"{len(plan)}/{len(plan)} batches" in err and "train_step [" in err


def test_errors(model, tmodel, bmodel):
    case = mixed_case(model)
    (tt,) = trajectories(case)
    with pytest.raises(ValueError, match="needs a token budget"):
        train_step(tmodel, tt, mode="packed")
    with pytest.raises(ValueError, match="mode: expected one of"):
        train_step(tmodel, tt, budget=9, mode="rf")
    with pytest.raises(ValueError, match=r"tree 0 \(case, lines 1-6\): path 1 has 9 tokens, more than the budget C=8"):
        train_step(tmodel, tt, budget=8)
    # PPOClip, KLPenalty and the path-level SequenceClip (linearized at a pre-pass's log-probs) run in
    # redundancy-free mode, equal to per-path (tests/test_objectives_modes.py); a path-level objective
    # still refuses a batch that does not hold its paths whole (below)
    assert train_step(bmodel, tt, SequenceClip(), budget=4, mode="redundancy_free").metrics["partitions"] > 1
    with pytest.raises(ValueError, match="boundary=True"):
        train_step(tmodel, tt, budget=4, mode="redundancy_free")
    with pytest.raises(ValueError, match="use mode='redundancy_free'"):
        train_step(bmodel, tt, budget=4)
    with pytest.raises(ValueError, match="advantages: not given"):
        train_step(tmodel, case.tree, PolicyGradient(), budget=9)
    with pytest.raises(TypeError, match="expected a treecompile.Tree"):
        train_step(tmodel, [case.paths])
    with pytest.raises(ValueError, match="no trees given"):
        train_step(tmodel, [])
    with pytest.raises(TypeError, match=r"got the class SFT, not an objective: pass SFT\(...\)"):
        train_step(tmodel, tt, SFT)
    # an id outside the vocabulary: the tree, and the path and position in it, in every mode (a partition's own
    # token index named a different token of the whole tree)
    V = tmodel.vocab_size
    bad = TrajectoryTree(tree_id="t7", tree=Tree.from_paths([[1, 3], [1, 2, 5, 6], [1, 2, V]]), source="f.jsonl",
                         lines=[4, 5, 6])
    where = rf"tree 't7' \(f.jsonl, lines 4-6\): .*path 2, position 2.*token id {V} is outside"
    for m, kw in ((tmodel, {}), (tmodel, dict(budget=4)), (bmodel, dict(budget=1, mode="redundancy_free"))):
        with pytest.raises(ValueError, match=where):
            train_step(m, bad, **kw)
    # a path-level objective on a partition that does not hold the path whole
    plan = pack(case.tree, 9)
    b = plan.batch(0)
    lp = torch.zeros(b.seq_len, dtype=torch.float64)
    A = torch.ones(case.tree.num_paths, dtype=torch.float64)
    old = torch.zeros(case.tree.num_tokens, dtype=torch.float64)
    missing = next(p for p in range(case.tree.num_paths) if p not in b.extras["paths"].tolist()
                   and not set(case.tree.path_index[int(case.tree.path_offsets[p]):int(case.tree.path_offsets[p + 1])]
                               .tolist()) <= set(b.extras["tokens"].tolist()))
    b.extras["paths"] = torch.tensor([missing])
    with pytest.raises(ValueError, match=f"SequenceClip: path {missing} is not whole in this partition"):
        SequenceClip().loss(lp, b, advantages=A, old_logprobs=old)
    del b.extras["paths"]
    with pytest.raises(ValueError, match=r"needs extras\['paths'\]"):
        SequenceClip().loss(lp, b, advantages=A, old_logprobs=old)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kw", [{}, dict(budget=4)], ids=["whole", "packed"])
def test_a_refused_step_leaves_no_gradient_behind(model, tmodel, kw):
    """A step refused by a later tree leaves ``.grad`` as it found it, so that a caller who catches the error and
    steps (or accumulates) applies nothing partial: ids are checked for every tree before the first backward (a
    step without an optimizer keeps the caller's own accumulated gradient); data missing for an objective is
    found mid-step, and the optimizer's step then leaves the gradients cleared, as it began."""
    V = tmodel.vocab_size
    good, bad_id = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5]]), Tree.from_paths([[1, 6, 7, V]])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=rf"tree 1: path 0, position 3: token id {V} is outside"):
        train_step(tmodel, [good, bad_id], optimizer=opt, **kw)
    assert all(p.grad is None for p in params)
    for p in params:  # gradient accumulation across steps, no optimizer: the caller's gradient is kept as it was
        p.grad = torch.full_like(p, 0.5)
    with pytest.raises(ValueError, match=r"tree 1: path 0, position 3"):
        train_step(tmodel, [good, bad_id], **kw)
    assert all(bool((p.grad == 0.5).all()) for p in params)
    model.zero_grad(set_to_none=True)
    no_adv = TrajectoryTree(tree_id="t", tree=good, source="f.jsonl", lines=[1, 2])
    with_adv = TrajectoryTree(tree_id="u", tree=good, source="f.jsonl", lines=[3, 4], advantages=torch.ones(2))
    with pytest.raises(ValueError, match=r"advantages: not given"):
        train_step(tmodel, [with_adv, no_adv], PolicyGradient(), optimizer=opt, **kw)
    assert all(p.grad is None for p in params)


# ---------------------------------------------------------------------- the example
def test_example_trains(tmp_path, capsys):
    """examples/train_sft.py's ``main(argv)``, in this process (no second torch import; the example's
    ``__main__`` is ``sys.exit(main())``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_sft_example", ROOT / "examples" / "train_sft.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data = tmp_path / "trees.jsonl"
    # the example's model (the tiny float32 dense one) is the architecture test_cli's rewrites and
    # test_readme's blocks capture: one torch.export per process for all of them (helpers.shared_capture);
    # the passes, training and checks run as usual
    with shared_capture():
        rc = example.main(["--data", str(data), "--make-data", "--steps", "6", "--budget", "40"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", out.out, re.M)]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses


def test_step_sums_and_grad_norm_read_back_once():
    """train_step's sums keep each value where it is and read them back once (``_Sums``); the gradient norm reads
    its per-tensor float64 norms back once per device (``_grad_norm``): both equal the float64 sums taken one by
    one, the way the step read them before (a wait for the GPU's queue per batch and per parameter)."""
    from treecompile.runtime.train import _grad_norm, _Sums

    g = torch.Generator().manual_seed(0)
    sums = _Sums()
    values = {"loss": [torch.randn((), generator=g), 0.25, torch.randn((), generator=g, dtype=torch.float64)],
              "aux": [torch.randn((), generator=g).bfloat16().requires_grad_()]}
    for name, xs in values.items():
        for x in xs:
            sums.add(name, x)
    got = sums.values()
    assert set(got) == {"loss", "aux"} and all(isinstance(v, float) for v in got.values())
    for name, xs in values.items():
        want = sum(float(x.detach().double()) if isinstance(x, torch.Tensor) else x for x in xs)
        assert got[name] == pytest.approx(want, rel=1e-15, abs=1e-300)
    assert _Sums().values() == {}

    grads = [torch.randn(7, 3, generator=g), torch.randn(5, generator=g, dtype=torch.float64),
             torch.randn(2, 2, generator=g).bfloat16()]
    want = math.sqrt(sum(float(x.double().norm()) ** 2 for x in grads))
    assert _grad_norm(grads) == pytest.approx(want, rel=1e-14) and _grad_norm([]) == 0.0


# ---------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["packed", "redundancy_free"])
def test_cuda_step_equals_float64_cpu_step(mode):
    """On CUDA (float32, the runtime's non-blocking host tables, sums read back once per step): the step's loss,
    metrics and every gradient equal the same step of a float64 copy on the CPU (itself == per path, above).
    Packed: PPO with a KL penalty and an entropy bonus over two trees' partitions (old/ref log-probs and advantages
    reach the device through the objectives); redundancy-free: SFT over partitions that read their parents' K/V.
    Bound: float32 rounding of a 2-layer model (eps 1.2e-7 times the forward/backward's ~1e2 accumulated
    roundings), loss 1e-5 relative, gradients 1e-4 relative in norm -- as the redundancy-free CUDA test."""
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.runtime.objectives import EntropyBonus, KLPenalty

    torch.manual_seed(0)
    ref = DenseForCausalLM(DenseConfig.tiny(vocab_size=97, hidden_size=64, head_dim=16)).double()
    dev = copy.deepcopy(ref).float().cuda()
    g = torch.Generator().manual_seed(1)
    paths = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (300, 250, 40, 120)]
    paths[1][:120] = paths[0][:120]
    paths[2][:30] = paths[0][:30]
    paths[3][:100] = paths[1][:100]
    masks = [[0] * 20 + [1] * (len(p) - 20) for p in paths]
    case = Case(ref, paths, masks, weights=[1.0, 0.5, 2.0, 1.0], advantages=[1.2, -0.4, 0.7, -1.5], seed=3)
    trees = trajectories(case, cuts=[2])
    boundary = mode == "redundancy_free"
    obj = SFT() if boundary else (PPOClip(), KLPenalty(0.1), EntropyBonus(0.01))
    opts = dict(boundary=boundary, entropy=not boundary)
    results, grads = {}, {}
    for name, m in (("cpu", ref), ("cuda", dev)):
        tm = treecompile.compile(m, attention_kernel="flex", **opts)  # the CPU copy runs unlowered: no kernel option
        results[name], grads[name] = step(tm, m, trees, obj, budget=100 if boundary else 320, mode=mode,
                                          normalize="token_mean")
    got, want = results["cuda"], results["cpu"]
    assert got.metrics["partitions"] == want.metrics["partitions"] >= (4 if boundary else 2)
    assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (got.loss, want.loss)
    for key in ("grad_norm",) + (() if boundary else ("entropy",)):
        assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-5), key
    for n, w in grads["cpu"].items():
        err = float((grads["cuda"][n].double().cpu() - w).norm())
        assert err <= 1e-4 * float(w.norm()) + 1e-9, (n, err, float(w.norm()))
