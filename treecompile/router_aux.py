"""The MoE router auxiliary loss of a compiled model, computed on the tree (``compile(router_aux=...)``).

:class:`RouterAux` says which loss the model computes (read from its config, HF names:
``num_experts`` or ``num_local_experts``, ``num_experts_per_tok``, ``router_aux_loss_coef``) and which
semantics the user chose; :meth:`RouterAux.loss` turns the graph's router-logits outputs and the
batch's tree into the loss (:mod:`treecompile.ops.router_loss`).  The runner adds ``coef * loss`` to
``out.loss`` (as HF adds ``router_aux_loss_coef * aux_loss`` when labels are given) and returns the
loss as ``out.aux_loss``.

- ``"batch"``: every path token counted once per path through it (its share count): HF's
  ``load_balancing_loss_func`` over all the batch's paths packed together (attention mask excluding
  padding);
- ``"path"``: ``sum_p (w_p / N) aux(p)``, ``aux(p)`` HF's loss of path p run alone, ``w_p`` the path
  weights, ``N`` the number of paths (the path mean of ``normalize="sum"`` / ``"path_mean"``).

A batch is one whole tree, or a packed partition of one (``extras["whole_tree"]``, ``["tokens"]``,
``["paths"]``: the paths lying whole in it) for ``"path"``, whose loss then sums over the paths
assigned to the partition (the partition losses add up to the tree's).  ``N`` is the tree's path count
(``train_step`` rescales to the step's paths).  Refused: ``"batch"`` on a partition (its statistics are products of sums over all the step's tokens, which no partition has
before its backward) and partitions that cut paths (redundancy-free).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treecompile.ops.router_loss import SEMANTICS, load_balancing_loss, router_statistics
from treecompile.tree import TreeBatch

__all__ = ["RouterAux"]


@dataclass(frozen=True)
class RouterAux:
    semantics: str  # "batch" | "path"
    num_experts: int
    top_k: int
    coef: float  # added to out.loss: coef * aux

    @classmethod
    def from_model(cls, model: torch.nn.Module, semantics: str) -> "RouterAux":
        if semantics not in SEMANTICS:
            raise ValueError(f"router_aux: expected one of {SEMANTICS}, got {semantics!r}")
        cfg = getattr(model, "config", None)
        E = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        k = getattr(cfg, "num_experts_per_tok", None)
        coef = getattr(cfg, "router_aux_loss_coef", None)
        if not E or not k or coef is None:
            raise ValueError(f"router_aux={semantics!r}: {type(model).__name__}'s config does not say num_experts, "
                             f"num_experts_per_tok and router_aux_loss_coef")
        return cls(semantics, int(E), int(k), float(coef))

    def loss(self, router_logits, batch: TreeBatch) -> torch.Tensor:
        """The tree's aux loss (float64 scalar) from the graph's ``router_logits`` (``[T, E]`` each)."""
        partition = "whole_tree" in batch.extras
        if partition and (self.semantics == "batch" or "paths" not in batch.extras):
            raise NotImplementedError(
                f"router_aux={self.semantics!r} on a partition that "
                + ("cuts paths (redundancy-free)" if "paths" not in batch.extras else
                   "holds part of the step's tokens: the statistics are products of sums over all of them")
                + "; use router_aux='path' with packed partitions, or run each tree whole")
        tree = batch.extras.get("whole_tree", batch.tree)
        n = batch.num_tokens
        logits = [rl[:n] for rl in router_logits]
        if logits[0].shape[-1] != self.num_experts:
            raise ValueError(f"router_aux: router logits have {logits[0].shape[-1]} experts, the config says "
                             f"{self.num_experts}")
        probs, counts, _ = router_statistics(logits, self.top_k)
        L = len(logits)
        if self.semantics == "batch":
            share = tree.aggregate(torch.ones(tree.num_paths, dtype=torch.float64),
                                   torch.ones(tree.num_path_tokens, dtype=torch.float64))
            return load_balancing_loss(probs, counts, num_layers=L, semantics="batch", share_count=share)
        scale = 1.0 / tree.num_paths
        if partition:  # the paths assigned to this partition, located among its tokens
            paths = torch.as_tensor(batch.extras["paths"], dtype=torch.long)
            tok = batch.extras["tokens"].cpu()
            end = torch.searchsorted(tok, tree.path_end[paths])
            subtree_end = batch.subtree_end[:n].cpu()
        else:
            paths, end, subtree_end = torch.arange(tree.num_paths), tree.path_end, tree.subtree_end
        coef = tree.path_weights.to(torch.float64)[paths] * scale
        return load_balancing_loss(probs, counts, num_layers=L, semantics="path", subtree_end=subtree_end,
                                   path_end=end, path_coef=coef)
