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
  ``boundary=True``); every unique token computed once.  The partition graph computes the loss
  ``-(loss_weight * lp).sum()`` itself, so this mode takes the objectives *linear* in the
  log-probs, whose per-token weights are fixed before the forward and which say them
  (``objective.token_weights(tree, norm, data)``: ``SFT``, ``PolicyGradient``).  Others are refused
  (their weights depend on the log-probs being computed).

Partitions run one after another, forward then backward, so at most one partition's activations
(packed) or one chain of partitions (redundancy-free) are alive.  With an ``optimizer`` the step
calls ``optimizer.zero_grad()`` first and ``optimizer.step()`` last; without one, gradients
accumulate into ``.grad`` (zero them yourself).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from treecompile.runtime.data import TrajectoryTree
from treecompile.runtime.metrics import Reuse, dataset_reuse
from treecompile.runtime.normalization import GlobalNorm, partition_batch, tree_batch
from treecompile.runtime.objectives import SFT
from treecompile.runtime.partition import pack, partition_redundancy_free
from treecompile.runtime.progress import Progress
from treecompile.runtime.redundancy_free import run_redundancy_free
from treecompile.tree import NORMALIZATIONS, Tree

__all__ = ["train_step", "StepResult", "MODES"]

MODES = ("packed", "redundancy_free")  # partitioned modes; None: each tree whole (stats calls it "whole")


@dataclass
class StepResult:
    """``loss``: the step's loss (float, == the per-path loss of all its paths); ``metrics``:
    ``trees``, ``paths``, ``partitions``, ``path_tokens``, ``unique_tokens``, ``tokens_computed``,
    ``por``, ``err`` (1 - computed / path tokens), ``peak_tokens`` (largest batch, or chain of
    partitions alive at once), ``seconds``, ``tokens_per_s`` (computed tokens), ``grad_norm``
    (before the optimizer step), ``mode``."""

    loss: float
    metrics: dict = field(default_factory=dict)


@dataclass
class _Item:
    tree: Tree
    extras: dict  # advantages [P], old_logprobs / ref_logprobs [T] (whole-tree DFS)
    label: str  # how errors name the tree


def _items(tree_or_trees) -> list[_Item]:
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
                    ex[key] = t.dfs(key)
            out.append(_Item(t.tree, ex, f"tree {t.tree_id!r} ({t.source}, lines {t.lines[0]}-{t.lines[-1]})"))
        else:
            raise TypeError(f"train_step: tree {k}: expected a treecompile.Tree or a data.TrajectoryTree, "
                            f"got {type(t).__name__}")
    return out




def train_step(tmodel, tree_or_trees: Tree | TrajectoryTree | Sequence[Tree | TrajectoryTree], objective=None,
               optimizer: torch.optim.Optimizer | None = None, *, budget: int | None = None,
               mode: str | None = None, normalize: str = "sum", progress: bool = False) -> StepResult:
    """One optimizer step over ``tree_or_trees`` (see the module docstring).

    ``tmodel``: ``treecompile.compile(model)`` (``compile(model, boundary=True)`` for
    ``mode="redundancy_free"``).  ``objective``: one of :mod:`treecompile.runtime.objectives`
    (default ``SFT()``); its per-path/per-token data come from the TrajectoryTrees (``advantage``,
    ``old_logprobs``, ``ref_logprobs`` in the JSONL); it is called as ``objective.loss(logprobs, batch,
    norm=step_norm)`` with the step's :class:`~treecompile.runtime.normalization.GlobalNorm`.  ``budget``: tokens per partition (None: each
    tree whole).  ``mode``: ``"packed"`` (default with a budget) or ``"redundancy_free"``.
    ``normalize``: the step's normalization (an objective's own ``normalize`` wins).  ``progress``:
    a progress bar on stderr.
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize: expected one of {NORMALIZATIONS}, got {normalize!r}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES} or None, got {mode!r}")
    if mode is not None and budget is None:
        raise ValueError(f"mode={mode!r} needs a token budget (budget=...)")
    if budget is not None and mode is None:
        mode = "packed"
    objective = SFT() if objective is None else objective
    if not hasattr(objective, "loss"):
        raise TypeError(f"objective: expected an objective with .loss(logprobs, batch), got {type(objective).__name__}")
    if mode == "redundancy_free":
        if not hasattr(objective, "token_weights"):
            raise ValueError(f"mode='redundancy_free' runs objectives linear in the log-probs, those with "
                             f"token_weights (SFT, PolicyGradient); {type(objective).__name__} is not (use mode='packed')")
        if getattr(tmodel, "boundary", None) is None:
            raise ValueError("mode='redundancy_free' needs a model compiled with treecompile.compile(model, boundary=True)")
    elif getattr(tmodel, "boundary", None) is not None:
        raise ValueError(f"this model was compiled with boundary=True: use mode='redundancy_free' (got mode={mode!r})")

    items = _items(tree_or_trees)
    norm = GlobalNorm.from_trees([it.tree for it in items], normalize)
    t0 = time.perf_counter()
    # plan every tree first (cheap), so that the progress bar knows the total
    plans = []
    for it in items:
        try:
            if mode == "packed":
                plans.append(pack(it.tree, budget))
            elif mode == "redundancy_free":
                w = objective.token_weights(it.tree, norm, it.extras)
                plans.append(dataclasses.replace(partition_redundancy_free(it.tree, budget), token_weights=w))
            else:
                plans.append(None)
        except ValueError as e:
            raise ValueError(f"{it.label}: {e}") from None
    total = sum(1 if p is None else len(p) for p in plans)
    bar = Progress(total, "train_step", enabled=progress, unit="batches")

    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    loss_sum = torch.zeros((), dtype=torch.float64)
    computed, peak, reuses = 0, 0, []
    try:
        for it, plan in zip(items, plans):
            tree = it.tree
            if mode == "redundancy_free":
                res = run_redundancy_free(tmodel, plan, normalize=normalize)
                loss_sum += res.loss
                computed += res.tokens_computed
                peak = max(peak, res.peak_alive_tokens)
                reuses.append(res.reuse)
                bar.done += len(plan) - 1
                bar.update(res.tokens_computed)
                continue
            n_tree = 0
            for i in range(1 if plan is None else len(plan)):
                batch = tree_batch(tree, norm) if plan is None else partition_batch(plan, i, norm)
                batch.extras.update(it.extras)
                out = tmodel(batch)
                loss = objective.loss(out.logprobs, batch, norm=norm)
                if loss.requires_grad:
                    loss.backward()
                loss_sum += loss.detach().to(torch.float64).cpu()
                n_tree += batch.num_tokens
                peak = max(peak, batch.num_tokens)
                bar.update(batch.num_tokens)
                del out, loss
            computed += n_tree
            reuses.append(Reuse(tree.num_path_tokens, tree.num_tokens, n_tree))
    finally:
        bar.close()

    params = [p for p in tmodel.parameters() if p.grad is not None]
    grad_norm = math.sqrt(sum(float(p.grad.detach().double().norm()) ** 2 for p in params)) if params else 0.0
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
    }
    return StepResult(loss=float(loss_sum), metrics=metrics)
