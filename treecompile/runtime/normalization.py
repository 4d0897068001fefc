"""The normalization of a training step: its constants, the token weights they give, and the batches
that carry them.

The loss of a step is the single-process loss of *all* its paths taken together (``reference.run``
on the concatenated path list, the paths of every tree of the step, on every rank):

    L = sum_p c_p sum_t m[p,t] l(t),   c_p = tree.path_coefficients(...)  (the formula)

with ``sum``: ``c_p = w_p / N``, ``path_mean``: ``w_p / (N * trained_p)``, ``token_mean``:
``w_p / (trained tokens of the step)``, N the paths of the whole step.  A batch (one tree, one packed
partition, or a forest of merged trees) must therefore carry weights built with the step's N and
token count (:class:`GlobalNorm`), never its own tree's.  For one tree alone,
``GlobalNorm.of_tree(tree, normalize)`` gives exactly ``tree.path_coefficients(normalize)``.

``grad_scale`` multiplies every weight: DDP and FSDP2 *average* gradients over ranks, so a
data-parallel step uses ``grad_scale`` = world size and the averaged gradient is the global loss's
(:mod:`treecompile.runtime.distributed`); a single process uses 1.

:func:`tree_batch` and :func:`partition_batch` build the batches of a step (``Tree.to_batch`` /
``plan.batch`` with the step's weights); objectives take the same :class:`GlobalNorm` as their
``norm`` argument (:mod:`treecompile.runtime.objectives`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from treecompile.tree import DEFAULT_CONV_KERNEL, NORMALIZATIONS, Tree, TreeBatch, path_coefficients

if TYPE_CHECKING:
    from treecompile.runtime.partition import PackedPlan

__all__ = ["GlobalNorm", "token_coefficients", "tree_batch", "partition_batch"]


@dataclass(frozen=True)
class GlobalNorm:
    """The normalization constants of a step, shared by every batch (and rank) of it.

    ``num_paths``: paths of all trees of the step; ``num_trained``: trained tokens (loss-mask ones)
    of all its paths; ``grad_scale``: factor on every weight (the world size when DDP/FSDP average
    gradients over ranks, 1 when they sum or in one process).
    """

    normalize: str
    num_paths: int
    num_trained: float
    grad_scale: float = 1.0
    # token weights per tree (no per-path factor), kept for the step: every partition of a tree reads them.  Not an
    # init field: a norm derived with dataclasses.replace (another grad_scale, normalize...) or copied starts empty,
    # rather than returning the weights of the constants it was derived from
    _weights: dict = field(default_factory=dict, init=False, compare=False, repr=False, hash=False)

    def __post_init__(self):
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize: expected one of {NORMALIZATIONS}, got {self.normalize!r}")
        if self.num_paths < 1:
            raise ValueError(f"num_paths: a global step needs at least one path, got {self.num_paths}")
        if self.num_trained < 0:
            raise ValueError(f"num_trained: expected a count >= 0, got {self.num_trained}")

    @classmethod
    def from_trees(cls, trees: Sequence[Tree], normalize: str, *, grad_scale: float = 1.0) -> "GlobalNorm":
        """Constants of the step made of ``trees`` (every rank passes the same, whole step)."""
        if not trees:
            raise ValueError("trees: a global step needs at least one tree")
        n = sum(t.num_paths for t in trees)
        tok = sum(float(t.trained_counts().sum()) for t in trees)
        return cls(normalize, n, tok, float(grad_scale))

    @classmethod
    def of_tree(cls, tree: Tree, normalize: str) -> "GlobalNorm":
        """The normalization of ``tree`` alone (its coefficients are ``tree.path_coefficients``)."""
        return cls.from_trees([tree], normalize)

    @classmethod
    def all_reduce(cls, local_trees: Sequence[Tree], normalize: str, *, grad_scale: float | None = None,
                   group=None) -> "GlobalNorm":
        """Constants from each rank's own trees, summed with one all-reduce (ranks may hold none).

        ``grad_scale`` defaults to the group's world size (DDP/FSDP average gradients).
        """
        import torch.distributed as dist

        counts = torch.tensor([float(sum(t.num_paths for t in local_trees)),
                               float(sum(float(t.trained_counts().sum()) for t in local_trees))],
                              dtype=torch.float64)
        backend = dist.get_backend(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        counts = counts.to(dev)
        dist.all_reduce(counts, group=group)
        scale = float(dist.get_world_size(group)) if grad_scale is None else float(grad_scale)
        return cls(normalize, int(counts[0].item()), float(counts[1].item()), scale)

    def with_normalize(self, normalize: str | None) -> "GlobalNorm":
        """The same step under another normalization (None or the same: this object)."""
        if normalize is None or normalize == self.normalize:
            return self
        return dataclasses.replace(self, normalize=normalize)

    def __copy__(self) -> "GlobalNorm":
        """A copy with its own (empty) weight cache."""
        return dataclasses.replace(self)

    def path_coefficients(self, tree: Tree) -> torch.Tensor:
        """Per-path factor on ``mask * log p`` in the step's loss, times ``grad_scale``."""
        counts = None if self.normalize == "sum" else tree.trained_counts()
        c = path_coefficients(self.normalize, tree.path_weights, num_paths=self.num_paths,
                              trained_counts=counts, num_trained=self.num_trained)
        return c * self.grad_scale

    def token_weights(self, tree: Tree, per_path: torch.Tensor | None = None) -> torch.Tensor:
        """``sum over paths p through t of c_p * per_path[p] * m[p,t]`` for every unique token of
        ``tree`` (DFS order, float64); ``per_path`` None means 1 (the SFT weights, kept per tree)."""
        if per_path is not None:
            return tree.aggregate(self.path_coefficients(tree) * per_path.to(torch.float64).cpu())
        hit = self._weights.get(id(tree))
        if hit is None or hit[0] is not tree:
            hit = (tree, tree.aggregate(self.path_coefficients(tree)))
            self._weights[id(tree)] = hit
        return hit[1]


def token_coefficients(tree: Tree, normalize: str, per_path: torch.Tensor | None = None) -> torch.Tensor:
    """``sum over paths p through t of c_p * per_path[p] * m[p,t]`` for each unique token of ``tree``
    alone, DFS order, float64 ``[tree.num_tokens]`` (``per_path`` None means 1: the SFT weights)."""
    return GlobalNorm.of_tree(tree, normalize).token_weights(tree, per_path)


def tree_batch(tree: Tree, norm: GlobalNorm, *, pad_to_multiple: int | None = None, device=None,
               conv_kernel: int = DEFAULT_CONV_KERNEL) -> TreeBatch:
    """``tree`` as one TreeBatch whose weights are its share of the step's loss; ``extras["norm"]`` keeps ``norm``
    (what an objective called without ``norm=`` normalizes by)."""
    batch = tree.to_batch(normalize=norm.normalize, weights=norm.token_weights(tree),
                          pad_to_multiple=pad_to_multiple, device=device, conv_kernel=conv_kernel)
    batch.extras["norm"] = norm
    return batch


def partition_batch(plan: "PackedPlan", i: int, norm: GlobalNorm, *, pad_to_multiple: int | None = None,
                    device=None, conv_kernel: int = DEFAULT_CONV_KERNEL) -> TreeBatch:
    """Packed partition ``i`` of ``plan``: the step's weight on the tokens it owns, 0 elsewhere (``extras["norm"]``:
    ``norm``)."""
    batch = plan.batch(i, normalize=norm.normalize, weights=norm.token_weights(plan.tree),
                       pad_to_multiple=pad_to_multiple, device=device, conv_kernel=conv_kernel)
    batch.extras["norm"] = norm
    return batch
