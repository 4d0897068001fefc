"""Data-parallel tree training under torch.distributed (DDP, FSDP2).

Three pieces, each usable alone:

**Dealing work to ranks.**  A global step is a list of trees.  Each tree is one work item (or, with a
token budget, each packed partition of a big tree is one, :func:`work_items`).  :func:`deal` gives the
items to ranks by greedy longest-processing-time on *computed tokens* (items by decreasing cost, each to
the least-loaded rank; ties broken by a permutation drawn from ``seed`` and ``epoch``), so every rank
derives the same assignment with no communication.  :class:`TreeSampler` draws the global steps of an
epoch (shuffled by ``seed + epoch``, like ``DistributedSampler``) and yields the same step lists on
every rank.

**Global loss normalization** (:mod:`treecompile.runtime.normalization`).  The loss of a global step
is the single-process loss of *all* its paths taken together, so a rank's batches carry weights built
with the step's path / trained-token counts (:class:`~treecompile.runtime.normalization.GlobalNorm`,
``GlobalNorm.from_trees`` or ``GlobalNorm.all_reduce``), never their own tree's.  DDP and FSDP2
*average* gradients over ranks (they divide the summed gradient by the world size), so the norm
multiplies every weight by ``grad_scale`` = world size: the averaged gradient is then exactly the
global loss's gradient.  (If you instead make the reduction a plain sum, e.g. an FSDP2
``set_gradient_divide_factor(1.0)`` or a DDP comm hook that does not divide, use ``grad_scale=1``.)
The per-rank loss values then sum, over ranks, to ``grad_scale`` times the global loss:
:func:`global_loss` all-reduces them back to the global loss for logging.

**Running a rank's share.**  :func:`rank_batches` builds the TreeBatches of one rank, padded with
zero-weight dummy batches to the same count on every rank (FSDP2 all-gathers in every forward and DDP
may broadcast buffers: ranks running different numbers of forwards would mismatch collectives and
hang; measured with FSDP2/gloo), and :func:`backward_step` runs forward/backward over them, gradient
sync only on the last (DDP ``no_sync``; FSDP2 ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)``).

**FSDP2 and the captured graph.**  ``TreeModel`` does not call its layer modules' ``forward``: it runs
one rewritten graph whose inputs are all parameters, looked up on the model at each call.  FSDP2's
per-module hooks (pre-forward all-gather, pre-backward re-gather, post-backward reduce-scatter) hang on
module ``forward`` calls, so ``fully_shard`` on a decoder layer alone never fires and the graph meets
sharded DTensor parameters (``aten.mul.Tensor got mixed torch.Tensor and DTensor``).
``fully_shard`` on the TreeModel root works as documented (root pre-forward all-gathers every
parameter it manages, the root is not resharded after forward, the root's post-backward callback
reduce-scatters).  :func:`fully_shard_tree_model` applies ``fully_shard`` per layer and then to the
root and adds a root pre-forward hook that unshards every layer group (all all-gathers issued, then
waited); the root's post-backward callback reduce-scatters and reshards each group (FSDP2 runs
``post_backward`` for every group whose own hook did not fire).  Storage at rest, gradients and
optimizer state are sharded per layer; *during* forward/backward the whole model is unsharded, as
with root-only sharding.  Layer-at-a-time gathering needs the graph itself split per layer (see
``notes/dist.md``).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn

from treecompile.runtime.normalization import GlobalNorm, partition_batch, tree_batch
from treecompile.runtime.partition import PackedPlan, first_fit_decreasing, pack
from treecompile.tree import DEFAULT_CONV_KERNEL, Tree, TreeBatch

__all__ = ["WorkItem", "work_items", "deal", "TreeSampler", "rank_batches", "dummy_batch", "backward_step",
           "global_loss", "fully_shard_tree_model"]


def dummy_batch(*, normalize: str = "sum", device=None) -> TreeBatch:
    """A two-token batch with zero loss weight: a rank with no work runs it to join the collectives
    (every parameter gets a zero gradient, so DDP's and FSDP's reductions see the same tensors)."""
    return Tree.from_paths([[0, 0]]).to_batch(normalize=normalize, weights=torch.zeros(2, dtype=torch.float64),
                                              device=device)


# ------------------------------------------------------------------------------------------ dealing
@dataclass(frozen=True)
class WorkItem:
    """One unit of work: tree ``tree`` of the step whole (``partition`` None) or one packed partition.
    ``cost``: tokens computed."""

    tree: int
    partition: int | None
    cost: int


def work_items(trees: Sequence[Tree], *, capacity: int | None = None) -> tuple[list[WorkItem], dict[int, PackedPlan]]:
    """The work items of a step: each tree whole, or, with ``capacity``, each packed partition of a
    tree larger than ``capacity`` tokens (``pack``: every path must fit).  Returns the items and the
    plans of the packed trees (keyed by tree index)."""
    items, plans = [], {}
    for j, t in enumerate(trees):
        if capacity is not None and t.num_tokens > capacity:
            try:
                plan = pack(t, capacity)
            except ValueError as e:
                raise ValueError(f"tree {j}: {e}") from None
            plans[j] = plan
            items += [WorkItem(j, p.index, p.num_tokens) for p in plan.partitions]
        else:
            items.append(WorkItem(j, None, t.num_tokens))
    return items, plans


def deal(costs: Sequence[int], world_size: int, *, seed: int = 0, epoch: int = 0) -> list[list[int]]:
    """Indices of ``costs`` per rank, balancing the summed cost (greedy longest processing time).

    Items go in decreasing cost, each to the rank with the least load so far (lowest rank on a tie);
    items of equal cost are ordered by a permutation drawn from ``(seed, epoch)``.  Each rank's list
    is in the items' original order.  The largest load is at most 4/3 of the optimum (Graham), and
    at most the optimum plus the largest item.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive integer, got {world_size!r}")
    for i, c in enumerate(costs):
        if c < 0:
            raise ValueError(f"item {i}: cost must be >= 0, got {c}")
    tie = list(range(len(costs)))
    random.Random(seed * 1_000_003 + epoch).shuffle(tie)
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], tie[i]))
    loads = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (loads[k], k))
        loads[r] += costs[i]
        out[r].append(i)
    return [sorted(o) for o in out]


class TreeSampler:
    """The global steps of an epoch: lists of dataset indices, identical on every rank.

    ``trees_per_step`` trees per global step (the last step is shorter unless ``drop_last``); the
    order is a permutation drawn from ``seed + epoch`` when ``shuffle``.  Which rank computes which
    tree of a step is decided afterwards by :func:`deal` on the trees' costs (:func:`rank_batches`).
    """

    def __init__(self, num_trees: int, *, trees_per_step: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        if num_trees < 1:
            raise ValueError(f"num_trees: expected at least one tree, got {num_trees}")
        if trees_per_step < 1:
            raise ValueError(f"trees_per_step: expected a positive integer, got {trees_per_step}")
        self.num_trees, self.trees_per_step = num_trees, trees_per_step
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n, k = self.num_trees, self.trees_per_step
        return n // k if self.drop_last else -(-n // k)

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            idx = torch.randperm(self.num_trees, generator=g).tolist()
        else:
            idx = list(range(self.num_trees))
        k = self.trees_per_step
        for s in range(len(self)):
            yield idx[s * k:(s + 1) * k]


def rank_batches(trees: Sequence[Tree], norm: GlobalNorm, *, rank: int, world_size: int,
                 capacity: int | None = None, batch_tokens: int | None = None, seed: int = 0, epoch: int = 0,
                 pad_to_multiple: int | None = None, device=None,
                 conv_kernel: int = DEFAULT_CONV_KERNEL) -> tuple[list[TreeBatch], list[WorkItem], list[int]]:
    """This rank's TreeBatches for the global step ``trees`` (the same list on every rank).

    Items (trees or, with ``capacity``, packed partitions) are dealt by :func:`deal`; each batch
    carries the global weights of ``norm``.  With ``batch_tokens``, a rank's whole trees are grouped
    (first-fit decreasing) into batches of at most that many tokens, each one merged tree
    (:meth:`Tree.merge`, a forest): fewer, larger steps; partitions and larger trees stay alone.
    Returns ``(batches, items, loads)``: ``items`` are this rank's, ``loads`` the computed tokens of
    every rank, and ``batches`` holds this rank's batches then :func:`dummy_batch` fillers, so that
    every rank gets the same number of batches (at least one): the collectives inside each forward
    (FSDP2 all-gathers, DDP buffer broadcasts) then match.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: expected 0 <= rank < world_size={world_size}, got {rank}")
    if batch_tokens is not None and batch_tokens < 1:
        raise ValueError(f"batch_tokens: expected a positive token count, got {batch_tokens}")
    items, plans = work_items(trees, capacity=capacity)
    dealt = deal([it.cost for it in items], world_size, seed=seed, epoch=epoch)
    loads = [sum(items[i].cost for i in d) for d in dealt]
    groups = [_group_items([items[i] for i in d], batch_tokens) for d in dealt]
    mine = [items[i] for i in dealt[rank]]
    kw = dict(pad_to_multiple=pad_to_multiple, device=device, conv_kernel=conv_kernel)
    batches = []
    for group in groups[rank]:
        it = group[0]
        if it.partition is not None:
            batches.append(partition_batch(plans[it.tree], it.partition, norm, **kw))
        elif len(group) == 1:
            batches.append(tree_batch(trees[it.tree], norm, **kw))
        else:
            batches.append(tree_batch(Tree.merge([trees[g.tree] for g in group]), norm, **kw))
    # Every rank runs the same number of forward/backward passes: FSDP2 all-gathers in each forward
    # (and DDP broadcasts buffers), so ranks with fewer batches pad with zero-weight dummy batches.
    count = max(1, max(len(g) for g in groups))
    batches += [dummy_batch(normalize=norm.normalize, device=device) for _ in range(count - len(batches))]
    return batches, mine, loads


def _group_items(items: list[WorkItem], batch_tokens: int | None) -> list[list[WorkItem]]:
    """Batches of one rank: each item alone, or whole trees grouped first-fit decreasing into at
    most ``batch_tokens`` tokens (partitions and trees above the budget stay alone), in item order."""
    if batch_tokens is None:
        return [[it] for it in items]
    small = [k for k, it in enumerate(items) if it.partition is None and it.cost <= batch_tokens]
    bins = [[small[j] for j in b] for b in first_fit_decreasing([items[k].cost for k in small], batch_tokens)]
    grouped = set(small)
    alone = [[k] for k in range(len(items)) if k not in grouped]
    return [[items[k] for k in sorted(b)] for b in sorted(bins + alone)]


# ------------------------------------------------------------------------------------------ running
def _no_sync(module: nn.Module):
    """Context that disables gradient synchronisation of a DDP or FSDP2 module (else a no-op)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return module.no_sync()
    if isinstance(module, FSDPModule):
        @contextlib.contextmanager
        def fsdp_no_sync():
            # keep the gathered parameters between accumulation steps (FSDP2's documented recipe)
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
                module.set_reshard_after_backward(True)
        return fsdp_no_sync()
    return contextlib.nullcontext()


def backward_step(module: nn.Module, batches: Sequence[TreeBatch]) -> torch.Tensor:
    """Forward and backward over ``batches``, accumulating gradients; gradients are synchronised
    (DDP all-reduce / FSDP2 reduce-scatter) on the last batch only.  ``module`` is a TreeModel, or a
    DDP or FSDP2 module around one; each batch after the first is prepared (``TreeModel.prepare``) after the
    backward of the one before.  Returns this rank's summed loss (detached)."""
    if not batches:
        raise ValueError("batches: every rank needs at least one batch (use dummy_batch) to join the collectives")
    from torch.nn.parallel import DistributedDataParallel

    # the next batch's host work while the GPU runs this backward (TreeModel.prepare; DDP wraps the TreeModel,
    # FSDP2 turns it into a subclass of itself)
    prepare = getattr(module.module if isinstance(module, DistributedDataParallel) else module, "prepare", None)
    total = None
    for k, b in enumerate(batches):
        ctx = _no_sync(module) if k < len(batches) - 1 else contextlib.nullcontext()
        with ctx:
            loss = module(b).loss
            loss.backward()
        if prepare is not None and k + 1 < len(batches):
            prepare(batches[k + 1])
        total = loss.detach() if total is None else total + loss.detach()
    return total


def global_loss(local_loss: torch.Tensor, norm: GlobalNorm, group=None) -> torch.Tensor:
    """The step's global loss from each rank's summed loss: all-reduce sum, divided by ``grad_scale``."""
    import torch.distributed as dist

    t = local_loss.detach().clone()
    dist.all_reduce(t, group=group)
    return t / norm.grad_scale


def fully_shard_tree_model(tmodel: nn.Module, *, layers: Sequence[nn.Module] = (), mesh=None, **fsdp_kwargs):
    """FSDP2 for a TreeModel: ``fully_shard`` each of ``layers`` (e.g. ``model.model.layers``), then
    the TreeModel root; returns the (now FSDP) TreeModel.

    The rewritten graph is one flat program that calls no layer's ``forward``, so it is split per
    layer (:meth:`TreeModel.split_at`): each layer's part runs through that layer's ``__call__``, and
    FSDP2's own hooks gather one layer at a time (all-gather before its forward, reshard after,
    again around its backward, then reduce-scatter), as with an ordinary model.  On CUDA each layer's
    segment is compiled on its own.  With ``layers=()`` this is plain root-level ``fully_shard``
    (the whole model is gathered for the step).  ``fsdp_kwargs`` go to every ``fully_shard`` call
    (``mp_policy``, ``reshard_after_forward``, ...).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layers = list(layers)
    tree_params = {id(p) for p in tmodel.parameters()}
    for i, layer in enumerate(layers):
        if any(id(p) not in tree_params for p in layer.parameters()):
            raise ValueError(f"layers[{i}] ({type(layer).__name__}) holds parameters that are not the TreeModel's")
    tmodel.split_at(layers)  # before sharding: a graph that cannot be split fails with nothing changed
    for layer in layers:
        if not isinstance(layer, FSDPModule):
            fully_shard(layer, mesh=mesh, **fsdp_kwargs)
    fully_shard(tmodel, mesh=mesh, **fsdp_kwargs)
    return tmodel
