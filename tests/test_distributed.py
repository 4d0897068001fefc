"""Data-parallel tree training: dealing, global normalization, DDP and FSDP2 on CPU/gloo == one process.

The distributed test starts 2 processes (gloo, file store, hard deadline); each runs the same global
steps under DDP, FSDP2 on the root only, and FSDP2 per layer + root, for every normalization, and
writes its gradients; this process compares them with the per-path reference run on *all* paths of
the step in one process (float64, 1e-9 relative).
"""

from __future__ import annotations

import copy
import itertools
import os
import random
import time

import pytest
import torch
import torch.multiprocessing as mp

import treecompile
from treecompile import NORMALIZATIONS, Tree, reference
from treecompile.models import DenseConfig, DenseForCausalLM
from treecompile.runtime.distributed import (TreeSampler, backward_step, deal, dummy_batch, rank_batches,
                                             work_items)
from treecompile.runtime.normalization import GlobalNorm, partition_batch, tree_batch

WORLD = 2
VOCAB = 11
CAPACITY = 12  # step "packed": the big tree is split into packed partitions of <= 12 tokens


def make_model() -> DenseForCausalLM:
    torch.manual_seed(0)
    return DenseForCausalLM(DenseConfig.tiny(vocab_size=VOCAB, tie_word_embeddings=True)).double()


def _tree_spec(rng: random.Random, n_paths: int, max_len: int, masks: bool, weights: bool):
    """Paths sharing random prefixes (each path extends a random prefix of an earlier one)."""
    paths = []
    for _ in range(n_paths):
        if paths and rng.random() < 0.8:
            base = rng.choice(paths)
            prefix = base[:rng.randint(1, len(base))]
        else:
            prefix = [rng.randrange(VOCAB)]
        paths.append(prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(0, max_len - len(prefix)))])
    m = [[0] + [rng.randint(0, 1) for _ in p[1:]] for p in paths] if masks else None
    w = [rng.choice([0.5, 1.0, 2.0, -1.0]) for _ in paths] if weights else None
    return paths, m, w


def make_steps():
    """Global steps: (name, trees as (paths, masks, weights), capacity)."""
    rng = random.Random(1234)
    uneven = [_tree_spec(rng, n, L, mk, wt) for n, L, mk, wt in
              [(6, 9, False, False), (5, 4, True, False), (4, 7, False, True), (1, 3, False, False),
               (3, 8, True, True)]]
    single = [_tree_spec(rng, 3, 6, False, False)]  # one tree, two ranks: rank 1 runs the dummy batch
    big = [_tree_spec(rng, 7, 8, True, False), _tree_spec(rng, 2, 4, False, False)]
    return [("uneven", uneven, None), ("single", single, None), ("packed", big, CAPACITY)]


def build_trees(spec):
    return [Tree.from_paths(p, loss_masks=m, path_weights=w) for p, m, w in spec]


def flat_paths(spec):
    paths, masks, weights = [], [], []
    for p, m, w in spec:
        paths += p
        masks += m if m is not None else [[0] + [1] * (len(x) - 1) for x in p]
        weights += w if w is not None else [1.0] * len(p)
    return paths, masks, weights


# ------------------------------------------------------------------------------ worker (spawned)
def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank: int, store: str, out_dir: str, compiled=None):
    """``compiled``: the pristine ``(make_model(), treecompile.compile(it))`` made before a fork; None
    (spawned): made here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    from treecompile.runtime.distributed import fully_shard_tree_model, global_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        results = {}
        # captured once; each wrap trains its own deep copy
        pristine, pristine_tm = (make_model(), None) if compiled is None else compiled
        pristine_tm = treecompile.compile(pristine) if pristine_tm is None else pristine_tm
        for wrap in ("ddp", "fsdp_root", "fsdp_layer"):
            model, tmodel = copy.deepcopy((pristine, pristine_tm))
            if wrap == "ddp":
                module = DDP(tmodel)
            else:
                mesh = init_device_mesh("cpu", (WORLD,))
                layers = list(model.model.layers) if wrap == "fsdp_layer" else []
                module = fully_shard_tree_model(tmodel, layers=layers, mesh=mesh)
                w = model.model.layers[0].mlp.up_proj.weight
                results[(wrap, "sharded")] = (type(w).__name__, tuple(w.to_local().shape), tuple(w.shape))
                gathered = results.setdefault((wrap, "gathered"), [])

                def record(mod, args, layers=list(model.model.layers), gathered=gathered):  # after FSDP's hook
                    gathered.append([not isinstance(m.mlp.up_proj.weight, DTensor) for m in layers])

                for m in model.model.layers:
                    m.register_forward_pre_hook(record)
            for name, spec, capacity in make_steps():
                trees = build_trees(spec)
                for normalize in NORMALIZATIONS:
                    norm = GlobalNorm.from_trees(trees, normalize, grad_scale=WORLD)
                    batches, items, loads = rank_batches(trees, norm, rank=rank, world_size=WORLD,
                                                         capacity=capacity, seed=3)
                    if capacity is None:  # whole trees: the counts can also come from the ranks' own trees
                        results[(wrap, name, normalize, "all_reduce")] = GlobalNorm.all_reduce(
                            [trees[it.tree] for it in items], normalize)
                    for p in tmodel.parameters():
                        p.grad = None
                    if (wrap, "gathered") in results:
                        results[(wrap, "gathered")].append(None)  # a step starts
                    local = backward_step(module, batches)
                    loss = global_loss(local, norm)
                    grads = {n: _full(p.grad).detach().clone() for n, p in tmodel.named_parameters()}
                    results[(wrap, name, normalize)] = dict(grads=grads, loss=float(loss), items=items,
                                                            loads=loads, num_batches=len(batches))
            results[(wrap, "dcp")] = _dcp_round_trip(module, tmodel)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _dcp_round_trip(module, tmodel):
    """torch.distributed.checkpoint's full state dict of the wrapped TreeModel (its keys, and whether each value is
    the full parameter), then the same after ``set_model_state_dict`` of every value + 1 (collectives)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    opts = StateDictOptions(full_state_dict=True)
    full = {n: _full(t).detach().clone() for n, t in tmodel.state_dict().items()}
    sd = get_model_state_dict(module, options=opts)
    got = {k: torch.equal(_full(v), full[k]) if k in full else False for k, v in sd.items()}
    set_model_state_dict(module, {k: _full(v) + 1 for k, v in sd.items()}, options=opts)
    after = {n: torch.equal(_full(t), full[n] + 1) for n, t in tmodel.state_dict().items()}
    return dict(keys=sorted(sd), expected=sorted(full), equal=got, set=after)


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    # Forked where the platform can (Linux): the ranks inherit this process's imports (torch, treecompile)
    # and one capture of the model made here, instead of each importing and capturing it again (measured
    # on 2 cores: the file's CPU time 42.8 s -> 22.9 s).  The ranks touch no CUDA and no thread pool (one
    # OMP thread), and this process holds no process group, so forking is safe; they still deep-copy, wrap
    # and train the model themselves.  Spawned, each rank compiling its own, where there is no fork or
    # where this process has initialized CUDA (a forked child cannot use it, nor autograd's device threads).
    if "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized():
        model = make_model()
        args, method = (str(d / "store"), str(d), (model, treecompile.compile(model))), "fork"
    else:
        args, method = (str(d / "store"), str(d)), "spawn"
    ctx = mp.start_processes(_worker, args=args, nprocs=WORLD, join=False, start_method=method)
    deadline = time.monotonic() + 150
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail("distributed workers did not finish within 150 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def references():
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    out = {}
    for name, spec, _ in make_steps():
        paths, masks, weights = flat_paths(spec)
        for normalize in NORMALIZATIONS:
            ref = reference.run(model, paths, loss_masks=masks, path_weights=weights, normalize=normalize)
            grads = torch.autograd.grad(ref.loss, list(model.parameters()))
            out[(name, normalize)] = (float(ref.loss.detach()), dict(zip(names, grads)))
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("step", ["uneven", "single", "packed"])
@pytest.mark.parametrize("wrap", ["ddp", "fsdp_root", "fsdp_layer"])
def test_distributed_grads_equal_single_process(dist_results, references, wrap, step, normalize):
    ref_loss, ref_grads = references[(step, normalize)]
    for rank, res in enumerate(dist_results):
        r = res[(wrap, step, normalize)]
        assert abs(r["loss"] - ref_loss) <= 1e-9 * abs(ref_loss), (rank, r["loss"], ref_loss)
        assert r["grads"].keys() == ref_grads.keys()
        g = torch.cat([r["grads"][n].flatten() for n in ref_grads])
        g_ref = torch.cat([ref_grads[n].flatten() for n in ref_grads])
        assert float(g_ref.norm()) > 0
        assert rel(g, g_ref) < 1e-9, (rank, rel(g, g_ref))


def test_distributed_work_is_uneven_and_complete(dist_results):
    """The steps really give ranks different work: different tree counts and tokens, a dummy batch on
    the rank without a tree, and the partitions of one tree on both ranks."""
    r0, r1 = (res[("ddp", "uneven", "sum")] for res in dist_results)
    assert len(r0["items"]) != len(r1["items"]) and r0["num_batches"] == r1["num_batches"]
    trees = build_trees(make_steps()[0][1])
    paths, tokens = ([sum(getattr(trees[it.tree], f) for it in r["items"]) for r in (r0, r1)]
                     for f in ("num_paths", "num_tokens"))
    assert paths[0] != paths[1] and tokens == r0["loads"]
    assert sorted(it.tree for it in r0["items"] + r1["items"]) == list(range(5))
    s0, s1 = (res[("ddp", "single", "sum")] for res in dist_results)
    assert len(s0["items"]) + len(s1["items"]) == 1 and s0["num_batches"] == s1["num_batches"] == 1
    p0, p1 = (res[("ddp", "packed", "sum")] for res in dist_results)
    assert any(it.partition is not None for it in p0["items"]) and any(it.partition is not None for it in p1["items"])


def test_global_norm_all_reduce_equals_whole_step(dist_results):
    for name, spec, capacity in make_steps():
        if capacity is None:
            for normalize in NORMALIZATIONS:
                want = GlobalNorm.from_trees(build_trees(spec), normalize, grad_scale=WORLD)
                assert all(res[("ddp", name, normalize, "all_reduce")] == want for res in dist_results)


def test_fsdp_per_layer_gathers_one_layer_at_a_time(dist_results):
    """In a step's first forward, each layer's FSDP hook gathers that layer alone (the others stay
    sharded; later micro-batches of the step keep the layers gathered, as ``backward_step`` asks of
    gradient accumulation); with root-only FSDP the whole model is gathered before the graph runs."""
    for res in dist_results:
        steps = _split_steps(res[("fsdp_layer", "gathered")])
        n = len(steps[0][0])
        assert len(steps) == 9 and n == 2
        for step in steps:
            assert [s for s in step[:n]] == [[i == k for i in range(n)] for k in range(n)], step
        assert all(all(state) for step in _split_steps(res[("fsdp_root", "gathered")]) for state in step)


def _split_steps(records):
    steps = []
    for r in records:
        if r is None:
            steps.append([])
        else:
            steps[-1].append(r)
    return steps


@pytest.mark.parametrize("wrap", ["fsdp_root", "fsdp_layer"])
def test_fsdp_parameters_are_sharded(dist_results, wrap):
    kind, local, full = dist_results[0][(wrap, "sharded")]
    assert kind == "DTensor" and local[0] * WORLD == full[0] and local[1:] == full[1:]


@pytest.mark.parametrize("wrap", ["ddp", "fsdp_root", "fsdp_layer"])
def test_distributed_checkpoint_state_dict_of_the_wrapped_tree_model(dist_results, wrap):
    """``get_model_state_dict`` / ``set_model_state_dict`` (torch.distributed.checkpoint) on a wrapped TreeModel
    whose model has a child called ``model`` (``tm.model`` is the user's module: DCP's walk by attribute failed
    there): the keys are the state dict's, each value the full tensor, and a set state dict is what every rank's
    model then holds."""
    for rank in dist_results:
        r = rank[(wrap, "dcp")]
        assert r["keys"] == r["expected"] and any(k.startswith("model.layers.") for k in r["keys"])
        assert all(r["equal"].values()) and all(r["set"].values())


# --------------------------------------------------------------------------- single-process pieces
@pytest.fixture(scope="module")
def compiled():
    model = make_model()
    return model, treecompile.compile(model)


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_global_weights_sum_to_single_process_loss(compiled, normalize):
    """Per-tree (and per-partition) batches with global weights sum to the loss of all paths at once;
    grad_scale multiplies it."""
    model, tmodel = compiled
    for name, spec, capacity in make_steps():
        trees = build_trees(spec)
        paths, masks, weights = flat_paths(spec)
        ref = float(reference.run(model, paths, loss_masks=masks, path_weights=weights, normalize=normalize).loss.detach())
        norm = GlobalNorm.from_trees(trees, normalize, grad_scale=3.0)
        items, plans = work_items(trees, capacity=capacity)
        with torch.no_grad():
            total = sum(float(tmodel(tree_batch(trees[it.tree], norm) if it.partition is None
                                     else partition_batch(plans[it.tree], it.partition, norm)).loss)
                        for it in items)
        assert abs(total - 3.0 * ref) <= 1e-9 * abs(ref), (name, total, ref)


def test_global_norm_counts():
    trees = build_trees(make_steps()[0][1])
    paths, masks, _ = flat_paths(make_steps()[0][1])
    n = GlobalNorm.from_trees(trees, "token_mean")
    assert n.num_paths == len(paths) and n.num_trained == sum(sum(m) for m in masks)
    with pytest.raises(ValueError, match="normalize"):
        GlobalNorm("mean", 1, 1.0)
    with pytest.raises(ValueError, match="at least one tree"):
        GlobalNorm.from_trees([], "sum")


@pytest.mark.parametrize("derive", ["replace_scale", "replace_counts", "copy", "with_normalize"])
def test_a_derived_global_norm_weighs_with_its_own_constants(derive):
    """A norm derived from another after that one weighed a tree (``dataclasses.replace``, ``copy.copy``,
    ``with_normalize``) weighs it with its own constants: its weight cache is its own."""
    import dataclasses

    from treecompile.runtime.normalization import tree_batch

    t = Tree.from_paths([[1, 2, 3], [1, 2, 4, 5]])
    norm = GlobalNorm.from_trees([t], "sum")
    tree_batch(t, norm)  # fills norm's cache for t
    derived = {"replace_scale": lambda: dataclasses.replace(norm, grad_scale=2.0),
               "replace_counts": lambda: dataclasses.replace(norm, normalize="token_mean", num_trained=7.0),
               "copy": lambda: copy.copy(norm),
               "with_normalize": lambda: norm.with_normalize("path_mean")}[derive]()
    fresh = GlobalNorm(derived.normalize, derived.num_paths, derived.num_trained, derived.grad_scale)
    assert torch.equal(derived.token_weights(t), fresh.token_weights(t))
    assert torch.equal(tree_batch(t, derived).loss_weight, tree_batch(t, fresh).loss_weight)
    assert derived._weights is not norm._weights


def test_dummy_batch_has_zero_gradient(compiled):
    model, tmodel = compiled
    out = tmodel(dummy_batch())
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    assert float(out.loss.detach()) == 0 and all(g is not None and float(g.abs().max()) == 0 for g in grads)


def test_deal_is_lpt_balanced_deterministic_and_complete():
    rng = random.Random(0)
    for trial in range(150):
        costs = [rng.randint(0, 50) for _ in range(rng.randint(0, 8))]
        W = rng.randint(1, 3)
        out = deal(costs, W, seed=trial, epoch=1)
        assert len(out) == W and sorted(i for o in out for i in o) == list(range(len(costs)))
        assert out == deal(costs, W, seed=trial, epoch=1)
        loads = [sum(costs[i] for i in o) for o in out]
        # Graham's bound against the exact optimum (brute force over all assignments)
        opt = min((max(sum(c for c, r in zip(costs, a) if r == k) for k in range(W))
                   for a in itertools.product(range(W), repeat=len(costs))), default=0)
        assert max(loads) <= (4 / 3 - 1 / (3 * W)) * opt + 1e-9, (costs, W, loads, opt)
        # greedy to the least loaded: the spread is at most one item
        assert max(loads) - min(loads) <= max(costs, default=0)
    with pytest.raises(ValueError, match="world_size"):
        deal([1], 0)
    with pytest.raises(ValueError, match="item 1"):
        deal([1, -2], 2)


def test_deal_tie_break_follows_seed_and_epoch():
    costs = [5] * 8
    assert deal(costs, 2, seed=0, epoch=0) == deal(costs, 2, seed=0, epoch=0)
    assert len({tuple(map(tuple, deal(costs, 2, seed=0, epoch=e))) for e in range(6)}) > 1


def test_sampler_covers_each_tree_once_per_epoch():
    s = TreeSampler(10, trees_per_step=3, seed=5)
    for epoch in range(3):
        s.set_epoch(epoch)
        steps = list(s)
        assert len(steps) == len(s) == 4 and sorted(i for st in steps for i in st) == list(range(10))
    s.set_epoch(0)
    a = list(s)
    s.set_epoch(1)
    assert a != list(s)
    assert len(list(TreeSampler(10, trees_per_step=3, drop_last=True))) == 3


def test_rank_batches_errors_and_dummy():
    trees = [Tree.from_paths([[1, 2, 3]])]
    norm = GlobalNorm.from_trees(trees, "sum", grad_scale=2)
    b0, i0, loads = rank_batches(trees, norm, rank=0, world_size=2)
    b1, i1, _ = rank_batches(trees, norm, rank=1, world_size=2)
    assert len(i0) == 1 and i1 == [] and len(b1) == 1 and float(b1[0].loss_weight.abs().sum()) == 0
    trees = [Tree.from_paths([[1, 2, 3]]), Tree.from_paths([[4, 5]]), Tree.from_paths([[6, 7]])]
    norm = GlobalNorm.from_trees(trees, "sum", grad_scale=2)
    counts = [len(rank_batches(trees, norm, rank=r, world_size=2)[0]) for r in range(2)]
    items = [len(rank_batches(trees, norm, rank=r, world_size=2)[1]) for r in range(2)]
    assert counts == [2, 2] and sorted(items) == [1, 2]
    assert loads == [3, 0]
    with pytest.raises(ValueError, match="rank"):
        rank_batches(trees, norm, rank=2, world_size=2)
    with pytest.raises(ValueError, match="tree 0"):
        work_items([Tree.from_paths([[1] * 20])], capacity=8)
    with pytest.raises(ValueError, match="at least one batch"):
        backward_step(torch.nn.Identity(), [])


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_batch_tokens_merges_trees_and_keeps_the_gradients(compiled, normalize):
    """``batch_tokens`` groups a rank's whole trees into merged forests of at most that many tokens
    (fewer batches); loss and gradients equal the per-path reference of all paths of the step."""
    model, tmodel = compiled
    params = list(model.parameters())
    name, spec, _ = make_steps()[0]
    trees = build_trees(spec)
    paths, masks, weights = flat_paths(spec)
    ref = reference.run(model, paths, loss_masks=masks, path_weights=weights, normalize=normalize)
    g_ref = torch.cat([g.flatten() for g in torch.autograd.grad(ref.loss, params)])
    ref_loss = float(ref.loss.detach())
    norm = GlobalNorm.from_trees(trees, normalize)
    sizes = sorted(t.num_tokens for t in trees)
    for batch_tokens, want in [(None, len(trees)), (sizes[-1] - 1, None), (sum(sizes), 1)]:
        batches, items, _ = rank_batches(trees, norm, rank=0, world_size=1, batch_tokens=batch_tokens)
        assert len(items) == len(trees)
        if want is not None:
            assert len(batches) == want
        else:
            assert 1 < len(batches) < len(trees)  # the largest tree alone, the rest grouped
        if batch_tokens is not None:
            assert all(b.num_tokens <= batch_tokens or b.num_tokens == sizes[-1] for b in batches)
        for p in params:
            p.grad = None
        prepared = []
        prepare = tmodel.prepare
        tmodel.prepare = lambda b: prepared.append((b, all(p.grad is not None for p in params))) or prepare(b)
        try:
            local = backward_step(tmodel, batches)
        finally:
            del tmodel.prepare
        # each batch after the first prepared once, after a backward (the gradients were set)
        assert [id(b) for b, _ in prepared] == [id(b) for b in batches[1:]] and all(a for _, a in prepared)
        g = torch.cat([p.grad.flatten() for p in params])
        assert abs(float(local) - ref_loss) <= 1e-9 * abs(ref_loss)
        assert rel(g, g_ref) < 1e-9


def test_tree_merge_keeps_paths_masks_and_weights():
    rng = random.Random(7)
    specs = [_tree_spec(rng, 4, 6, True, True), _tree_spec(rng, 3, 5, False, False), _tree_spec(rng, 2, 4, True, False)]
    trees = build_trees(specs)
    merged = Tree.merge(trees)
    paths, masks, weights = flat_paths(specs)
    assert merged.num_paths == len(paths) and [merged.path(p) for p in range(len(paths))] == paths
    assert merged.loss_mask.tolist() == [bool(x) for m in masks for x in m]
    assert merged.path_weights.tolist() == weights
    assert merged.num_tokens <= sum(t.num_tokens for t in trees)  # shared prefixes stored once
    with pytest.raises(ValueError, match="no trees"):
        Tree.merge([])
