"""One training step over trees: plan partitions, run them with gradient accumulation, step.

    from treecompile.runtime.train import train_step
    from treecompile.runtime.objectives import PPOClip

    tmodel = treecompile.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for trees in steps:                              # Trees or data.TrajectoryTrees
        res = train_step(tmodel, trees, PPOClip(), opt, budget=8192, mode="packed", normalize="token_mean")
        print(res.loss, res.metrics["err"], res.metrics["seconds"])

What a step computes.  The loss of a step is the loss of *all its paths taken together*, as if every
path were run alone (``reference.run`` on the concatenated path list): with several trees the
normalization counts the paths / trained tokens of the whole step
(:class:`~treecompile.runtime.normalization.GlobalNorm`, passed to the objective as ``norm``), not
each tree's.  Each tree is run

- whole (``budget=None``): one batch per tree;
- ``mode="packed"`` (default when a budget is given): :func:`~treecompile.runtime.partition.pack`,
  prefix-closed partitions of <= ``budget`` tokens.  Every partition batch carries the whole tree
  (``extras["whole_tree"]``), its token map and ownership, and the whole tree's per-path advantages and
  per-token old/ref log-probs; each objective computes the *whole tree's* per-token weights and keeps
  them on the tokens the partition owns (each token owned once), so the partition losses sum to the
  whole-tree loss and the accumulated gradients are the whole-tree gradient.  Path-level objectives
  (``SequenceClip``) sum over the paths assigned to each partition (each lies whole in it);
- ``mode="redundancy_free"``: :func:`~treecompile.runtime.partition.partition_redundancy_free` run by
  :func:`~treecompile.runtime.redundancy_free.run_redundancy_free` (a model compiled with
  ``boundary=True``); every unique token computed once, the chains of partitions alive at once within
  ``budget`` where every path fits it (the planner's ``bound="auto"``).  One objective linear in the log-probs that
  says its weights (``objective.token_weights(tree, norm, data)``: ``SFT``, ``PolicyGradient``) runs
  as the partition graph's own loss ``-(loss_weight * lp).sum()``; any other token-level objective
  (``PPOClip``, ``KLPenalty``, a tuple of objectives) is evaluated on each partition's log-probs with
  the whole tree's coefficients (``run_redundancy_free(loss_fn=...)``), each token in exactly one
  partition (``EntropyBonus`` reads the partition graph's entropy, ``compile(boundary=True,
  entropy=True)``).  Path-level objectives (``SequenceClip``: a partition cuts paths) are linearized
  at the log-probs of a pre-pass (one forward without gradient per partition), which gives their exact
  value and gradient (:mod:`treecompile.runtime.path_level`).

MoE router losses (``compile(router_aux=...)``) are added to the step's loss as per-path training has
them.  A batch that holds all the statistics it needs computes its router loss alone (one whole tree;
``"path"`` on packed partitions, each summing the paths assigned to it); otherwise (``"batch"`` on
packed partitions or several trees, either semantics in redundancy-free mode) the step first counts
every token's routed experts in one forward without gradient per batch, then gives each batch its
coefficients in the step's loss (:mod:`treecompile.runtime.router_step`).

Partitions run one after another, forward then backward, so at most one partition's activations
(packed) or one chain of partitions (redundancy-free) are alive.  With an ``optimizer`` the step
calls ``optimizer.zero_grad()`` first and ``optimizer.step()`` last; without one, gradients
accumulate into ``.grad`` (zero them yourself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from treecompile.host_values import single_threaded_for
from treecompile.runtime.data import DEFAULT_LOGPROB_ATOL, TrajectoryTree
from treecompile.runtime.metrics import Reuse, dataset_reuse
from treecompile.runtime.normalization import GlobalNorm, partition_batch, tree_batch
from treecompile.runtime.objectives import SFT, trained_counts
from treecompile.runtime.partition import MODES, pack, partition_redundancy_free
from treecompile.runtime.progress import Progress
from treecompile.runtime.path_level import linearize
from treecompile.runtime.redundancy_free import prepass_redundancy_free, run_redundancy_free
from treecompile.runtime.router_step import count_routes, needs_counts, step_router_weights
from treecompile.router_aux import ROUTER_WEIGHTS
from treecompile.tree import DEFAULT_CONV_KERNEL, NORMALIZATIONS, Tree

__all__ = ["train_step", "StepResult", "MODES"]


@dataclass
class StepResult:
    """``loss``: the step's loss (float, == the per-path loss of all its paths); ``metrics``:
    ``trees``, ``paths``, ``partitions``, ``path_tokens``, ``unique_tokens``, ``tokens_computed``,
    ``por``, ``err`` (1 - computed / path tokens), ``peak_tokens`` (largest batch, or chain of
    partitions alive at once), ``seconds``, ``tokens_per_s`` (computed tokens), ``grad_norm``
    (before the optimizer step), ``mode``, ``entropy`` (mean entropy of the predicting distribution over
    all trained path tokens, as per-path training would log it; None unless the model was compiled
    with ``entropy=True``), ``aux_loss`` (the MoE router loss of ``compile(router_aux=...)``, summed
    over the step's batches and added to the loss times the model's coefficient; else None),
    ``z_loss`` (the router z-loss likewise, when the model has one), ``router_prepass`` (whether the
    step ran the counting pre-pass of :mod:`~treecompile.runtime.router_step`)."""

    loss: float
    metrics: dict = field(default_factory=dict)


@dataclass
class _Item:
    tree: Tree
    extras: dict  # advantages [P], old_logprobs / ref_logprobs [T] (whole-tree DFS)
    label: str  # how errors name the tree


def _items(tree_or_trees, logprob_atol: float = DEFAULT_LOGPROB_ATOL) -> list[_Item]:
    trees = [tree_or_trees] if isinstance(tree_or_trees, (Tree, TrajectoryTree)) else list(tree_or_trees)
    if not trees:
        raise ValueError("train_step: no trees given")
    out = []
    for k, t in enumerate(trees):
        if isinstance(t, Tree):
            out.append(_Item(t, {}, f"tree {k}"))
        elif isinstance(t, TrajectoryTree):
            ex = {}
            if t.advantages is not None:
                ex["advantages"] = t.advantages
            for key in ("old_logprobs", "ref_logprobs"):
                if getattr(t, key) is not None:
                    ex[key] = t.dfs(key, atol=logprob_atol)
            out.append(_Item(t.tree, ex, f"tree {t.tree_id!r} ({t.source}, lines {t.lines[0]}-{t.lines[-1]})"))
        else:
            raise TypeError(f"train_step: tree {k}: expected a treecompile.Tree or a data.TrajectoryTree, "
                            f"got {type(t).__name__}")
    return out


def _objectives(objective) -> tuple:
    """``objective``: one objective or a tuple/list of them (their losses are added)."""
    objs = tuple(objective) if isinstance(objective, (tuple, list)) else (SFT() if objective is None else objective,)
    if not objs:
        raise ValueError("objective: an empty list of objectives")
    for o in objs:
        if isinstance(o, type):
            raise TypeError(f"objective: got the class {o.__name__}, not an objective: pass {o.__name__}(...)")
        if not hasattr(o, "loss"):
            raise TypeError(f"objective: expected an objective with .loss(logprobs, batch), got {type(o).__name__}")
    return objs


@single_threaded_for(lambda objectives, out, batch, norm: batch.seq_len)  # the objectives' host tables (host_values)
def _objective_loss(objectives: tuple, out, batch, norm: GlobalNorm) -> torch.Tensor:
    total = 0
    for o in objectives:
        if getattr(o, "uses_entropy", False):
            if out.entropy is None:
                raise ValueError(f"{type(o).__name__} needs the entropy: compile the model with "
                                 f"treecompile.compile(model, entropy=True)")
            total = total + o.loss(out.logprobs, batch, norm=norm, entropy=out.entropy)
        else:
            total = total + o.loss(out.logprobs, batch, norm=norm)
    return total


def _router_scale(tmodel, tree: Tree, norm: GlobalNorm) -> float:
    """Factor from ``out.aux_loss`` of a batch without step coefficients (the batch's tree alone: the
    step's only tree under ``"batch"``) to the step's: ``"path"`` averages over the step's paths
    (``w_p grad_scale / N_step`` instead of ``w_p / N_tree``)."""
    if tmodel.router_aux.semantics == "batch":
        return norm.grad_scale
    return tree.num_paths * norm.grad_scale / norm.num_paths


@contextlib.contextmanager
def _named(it):
    """A ValueError raised within names the tree it concerns (``it.label``: its id, file and lines)."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{it.label}: {e}") from None


def train_step(tmodel, tree_or_trees: Tree | TrajectoryTree | Sequence[Tree | TrajectoryTree], objective=None,
               optimizer: torch.optim.Optimizer | None = None, *, budget: int | None = None,
               mode: str | None = None, normalize: str = "sum", progress: bool = False,
               logprob_atol: float = DEFAULT_LOGPROB_ATOL) -> StepResult:
    """One optimizer step over ``tree_or_trees`` (see the module docstring).

    ``tmodel``: ``treecompile.compile(model)`` (``compile(model, boundary=True)`` for
    ``mode="redundancy_free"``).  ``objective``: one of :mod:`treecompile.runtime.objectives`
    (default ``SFT()``) or a tuple of them (losses added, e.g. ``(PPOClip(), EntropyBonus(0.01))``); its
    per-path/per-token data come from the TrajectoryTrees (``advantage``, ``old_logprobs``, ``ref_logprobs``
    in the JSONL); each is called as ``objective.loss(logprobs, batch, norm=step_norm)`` with the step's
    :class:`~treecompile.runtime.normalization.GlobalNorm`.  ``budget``: tokens per partition (None: each
    tree whole).  ``mode``: ``"packed"`` (default with a budget) or ``"redundancy_free"``.
    ``normalize``: the step's normalization (an objective's own ``normalize`` wins).  ``progress``:
    a progress bar on stderr.  ``logprob_atol``: how far the ``old_logprobs``/``ref_logprobs`` that paths
    sharing a token give for it may differ (``data.TrajectoryTree.dfs``; beyond it the step refuses, naming both
    lines).
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize: expected one of {NORMALIZATIONS}, got {normalize!r}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES} or None, got {mode!r}")
    if mode is not None and budget is None:
        raise ValueError(f"mode={mode!r} needs a token budget (budget=...)")
    if budget is not None and mode is None:
        mode = "packed"
    objectives = _objectives(objective)
    objective = objectives[0]
    linear = len(objectives) == 1 and hasattr(objective, "token_weights")
    path_level = tuple(o for o in objectives if getattr(o, "path_level", False))
    token_level = tuple(o for o in objectives if not getattr(o, "path_level", False))
    if mode == "redundancy_free":
        if tmodel.program.boundary is None:
            raise ValueError("mode='redundancy_free' needs a model compiled with treecompile.compile(model, boundary=True)")
    elif tmodel.program.boundary is not None:
        raise ValueError(f"this model was compiled with boundary=True: use mode='redundancy_free' (got mode={mode!r})")

    items = _items(tree_or_trees, logprob_atol)
    norm = GlobalNorm.from_trees([it.tree for it in items], normalize)
    t0 = time.perf_counter()
    # plan every tree first (cheap), so that the progress bar knows the total
    plans = []
    for it in items:
        try:
            if mode == "packed":
                plans.append(pack(it.tree, budget))
            elif mode == "redundancy_free":
                plan = partition_redundancy_free(it.tree, budget)
                if linear:  # the weights of the graph's own loss
                    plan = dataclasses.replace(plan, token_weights=objective.token_weights(it.tree, norm, it.extras))
                plans.append(plan)
            else:
                plans.append(None)
        except ValueError as e:
            raise ValueError(f"{it.label}: {e}") from None
    total = sum(1 if p is None else len(p) for p in plans)
    # batches whose router loss needs the step's routed counts: count them first (one forward each, no grad)
    router = getattr(tmodel, "router_aux", None)
    router_weights = None
    bar = Progress(total, "train_step", enabled=progress, unit="batches")

    # batches carry conv_index at the model's own width (else program.run rebuilds it every step)
    width = tmodel.program.conv_width
    conv_kernel = DEFAULT_CONV_KERNEL if width is None else width + 1
    # every tree's ids before the first backward: a bad id in a later tree would leave the earlier trees'
    # gradients accumulated in .grad when the step is refused
    vocab = getattr(tmodel, "vocab_size", None)
    for it in items:
        with _named(it):
            it.tree.check_ids(vocab)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    # the loss, the router losses and the entropy metric's sums (over trained path tokens, and their count),
    # accumulated where each batch's values are and read back once after the step (_Sums)
    sums = _Sums()
    computed, peak, reuses = 0, 0, []
    try:
        # pre-passes (forwards without gradient) for what no batch has before its backward
        pre = [None] * len(items)
        if mode == "redundancy_free" and (path_level or router is not None):
            for j, (it, plan) in enumerate(zip(items, plans)):
                with _named(it):
                    pre[j] = prepass_redundancy_free(tmodel, plan)
        if needs_counts(router, mode, len(items)):
            counts = []
            for it, plan, pp in zip(items, plans, pre):
                with _named(it):
                    counts.append(pp.counts if pp is not None else
                                  count_routes(tmodel, it.tree, plan, conv_kernel=conv_kernel))
            router_weights = step_router_weights(router, [it.tree for it in items], counts, norm)
        if mode == "redundancy_free":
            for j, (it, plan) in enumerate(zip(items, plans)):
                tree = it.tree
                rw = None if router_weights is None else router_weights[j]
                with _named(it):  # missing objective data, bad ids: name the tree (file and lines)
                    lin = linearize(path_level, tree, pre[j].logprobs, norm, data=it.extras) if path_level else None
                    if linear:
                        res = run_redundancy_free(tmodel, plan, normalize=normalize, router=rw)
                    else:
                        res = run_redundancy_free(
                            tmodel, plan, normalize=normalize, data=it.extras, router=rw,
                            loss_fn=lambda out, b: (_objective_loss(token_level, out, b, norm) if token_level else 0)
                            + (lin.loss(out.logprobs, b) if lin is not None else 0))
                if lin is not None:
                    sums.add("loss", lin.value)
                if res.aux_loss is not None:
                    sums.add("aux", res.aux_loss)
                if res.z_loss is not None:
                    sums.add("z", res.z_loss)
                if res.entropy is not None:
                    n = tree.aggregate(torch.ones(tree.num_paths, dtype=torch.float64))
                    sums.add("entropy", (n * res.entropy).sum())
                    sums.add("entropy_count", n.sum())
                sums.add("loss", res.loss)
                computed += res.tokens_computed
                peak = max(peak, res.peak_alive_tokens)
                reuses.append(res.reuse)
                bar.done += len(plan) - 1
                bar.update(res.tokens_computed)
        else:
            def batches():  # (item index, batch): every tree's batches in order, built as they are reached
                for j, (it, plan) in enumerate(zip(items, plans)):
                    rw = None if router_weights is None else router_weights[j]
                    for i in range(1 if plan is None else len(plan)):
                        batch = tree_batch(it.tree, norm, conv_kernel=conv_kernel) if plan is None \
                            else partition_batch(plan, i, norm, conv_kernel=conv_kernel)
                        batch.extras.update(it.extras)
                        if rw is not None:  # this batch's coefficients in the step's router losses
                            batch.extras[ROUTER_WEIGHTS] = rw.take(batch.extras.get("tokens"),
                                                                   batch.extras.get("owned"), batch.num_tokens)
                        yield j, batch

            n_tree = [0] * len(items)
            upcoming = batches()
            nxt = next(upcoming, None)
            while nxt is not None:
                j, batch = nxt
                it, tree = items[j], items[j].tree
                with _named(it):  # missing or malformed objective data, bad ids: name the tree (file and lines)
                    out = tmodel(batch)
                    loss = _objective_loss(objectives, out, batch, norm)
                if out.aux_loss is not None:  # the MoE router losses (compile(router_aux=...)), as out.loss has them
                    scale = 1.0 if router_weights is not None else _router_scale(tmodel, tree, norm)
                    aux = out.aux_loss * scale
                    z = None if out.z_loss is None else out.z_loss * scale
                    loss = loss + router.weighted(aux, z)
                    sums.add("aux", aux)
                    if z is not None:
                        sums.add("z", z)
                if out.entropy is not None:
                    ent = out.entropy.detach().to(torch.float64)
                    n = trained_counts(batch).to(ent.device)
                    sums.add("entropy", (n * ent).sum())
                    sums.add("entropy_count", n.sum())
                if loss.requires_grad:
                    loss.backward()
                sums.add("loss", loss)
                # the next batch's host work (move, padding, attention plans) while the GPU runs this backward
                nxt = next(upcoming, None)
                if nxt is not None:
                    with _named(items[nxt[0]]):
                        tmodel.prepare(nxt[1])
                n_tree[j] += batch.num_tokens
                peak = max(peak, batch.num_tokens)
                bar.update(batch.num_tokens)
                del out, loss
            for it, n in zip(items, n_tree):
                computed += n
                reuses.append(Reuse(it.tree.num_path_tokens, it.tree.num_tokens, n))
    except BaseException:
        if optimizer is not None:  # refused mid-step (objective data, ...): no gradient, as after the zero_grad above
            optimizer.zero_grad(set_to_none=True)
        raise
    finally:
        bar.close()

    params = [p for p in tmodel.parameters() if p.grad is not None]
    grad_norm = _grad_norm([p.grad for p in params])
    total_sums = sums.values()  # the step's one read-back of its sums
    ent_count = total_sums.get("entropy_count", 0.0)
    if optimizer is not None:
        optimizer.step()
    seconds = time.perf_counter() - t0
    r = dataset_reuse(reuses)
    metrics = {
        "mode": mode or "whole", "trees": len(items), "paths": sum(it.tree.num_paths for it in items),
        "partitions": total, "path_tokens": r.path_tokens, "unique_tokens": r.unique_tokens,
        "tokens_computed": computed, "por": r.por, "err": r.err, "peak_tokens": peak,
        "seconds": seconds, "tokens_per_s": computed / seconds if seconds > 0 else float("inf"),
        "grad_norm": grad_norm,
        "entropy": total_sums["entropy"] / ent_count if ent_count > 0 else None,
        "aux_loss": None if router is None else total_sums.get("aux", 0.0),
        "z_loss": None if router is None or not router.z_coef else total_sums.get("z", 0.0),
        "router_prepass": router_weights is not None,
    }
    return StepResult(loss=total_sums.get("loss", 0.0), metrics=metrics)


class _Sums:
    """Named float64 sums of a step's values, kept where each value is (a CUDA loss stays on the GPU), read back
    once by :meth:`values`: a ``float()`` per batch would wait for the GPU's queue (after a forward, before its
    backward is launched; after a backward, before the next batch's forward is)."""

    def __init__(self):
        self._sums: dict[str, list] = {}

    def add(self, name: str, x) -> None:
        x = x.detach().to(torch.float64) if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)
        self._sums.setdefault(name, []).append(x.reshape(()))

    def values(self) -> dict[str, float]:
        """Each sum as a Python float (:func:`_read_back`)."""
        names = [name for name, xs in self._sums.items() for _ in xs]
        out = dict.fromkeys(self._sums, 0.0)
        for name, v in zip(names, _read_back([x for xs in self._sums.values() for x in xs])):
            out[name] += v
        return out


def _read_back(xs: list[torch.Tensor]) -> list[float]:
    """The values of 0-d float64 tensors, in order, with one copy to the host per device that holds some."""
    out = [0.0] * len(xs)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(xs):
        by_device.setdefault(x.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([xs[i] for i in idx]).tolist()):
            out[i] = v
    return out


def _grad_norm(grads: list) -> float:
    """The 2-norm of all gradients, each tensor's norm taken in float64: plain tensors' norms read back once per
    device (:func:`_read_back`); anything else (a sharded DTensor) one by one, as ``float`` of its norm reduces it."""
    squares = [float(g.detach().double().norm()) ** 2 for g in grads if type(g) is not torch.Tensor]
    norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float64) for g in grads if type(g) is torch.Tensor]
    return math.sqrt(sum(squares) + sum(v * v for v in _read_back(norms)))
