"""MoE router losses of a step that no single batch can compute: a counting pre-pass, then
coefficients linear in each batch's tokens.

The load-balancing loss ``aux = E * sum_e f_e P_e`` (per step or per path, :mod:`treecompile.router_aux`)
takes its gradient only through ``P_e``, a weighted sum of router probabilities over tokens; ``f_e``
(top-k counts) has none.  Once the step's counts are known, the loss is therefore linear in the
tokens: ``aux = sum_t sum_e probs[t, e] * aux_coef[t, e]`` (``probs`` summed over layers) with

- ``"batch"``: ``aux_coef[t, e] = s * n_t * E * f_e / (L * N)``, ``f_e = sum_t n_t counts[t, e] / (L * N)``
  over every tree of the step, ``n_t`` the share count, ``N = sum_t n_t`` the step's path tokens;
- ``"path"``: ``aux_coef[t, e] = sum_{paths p through t} c_p * E * A[p, e] / (L * len_p)^2``, ``A[p]`` the
  counts summed over p's tokens, ``c_p = s * w_p / (paths of the step)``;

and the z-loss (no counts) ``z = sum_t z[t] * z_coef[t]`` with ``z_coef = s * n_t / (L * N)`` or
``sum_p c_p / (L * len_p)``; ``s`` is the step's ``grad_scale``.  Each batch (a packed partition, one of
several trees, a redundancy-free partition) then adds its tokens' share (a packed partition: the
tokens it owns), so the batches' losses and gradients sum to the step's.

Needed (:func:`needs_counts`) with ``router_aux="batch"`` on packed partitions or on several trees,
and with either semantics in redundancy-free mode.  Cost: one extra forward without gradient per
batch of the step (:func:`count_routes`; redundancy-free partitions keep only their boundary rows for
descendants, as in training).  Skipped for one whole tree (its forward has every count) and for
``"path"`` on whole trees or packed partitions (each path lies whole in one batch).  The training pass
compares its own counts with the pre-pass's (``RoutingMismatchError`` if routing was not deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from treecompile.host_values import host_copy, repeat_counts
from treecompile.ops.router_loss import ancestor_sums
from treecompile.router_aux import RouterAux, RouterWeights
from treecompile.runtime.normalization import GlobalNorm
from treecompile.traced_modules import check_unchanged
from treecompile.tree import Tree

__all__ = ["TreeRouterWeights", "needs_counts", "count_routes", "step_router_weights"]


@dataclass(frozen=True)
class TreeRouterWeights:
    """One tree's coefficients in its step's router losses, whole-tree DFS order (float64):
    ``aux_coef [T, E]``, ``z_coef [T]``, and the pre-pass's layer-summed top-k ``counts [T, E]``."""

    aux_coef: torch.Tensor
    z_coef: torch.Tensor
    counts: torch.Tensor

    def take(self, tokens: torch.Tensor | None = None, owned: torch.Tensor | None = None,
             num_tokens: int | None = None) -> RouterWeights:
        """A batch's :class:`RouterWeights`: rows ``tokens`` (whole-tree DFS indices; None: every token),
        zero coefficients on the tokens it does not own (``owned [n]`` bool; None: all); ``num_tokens``
        cuts ``tokens`` to the batch's real tokens."""
        if tokens is None:
            tokens = torch.arange(self.counts.shape[0])
        tokens = host_copy(tokens)[:num_tokens]  # a moved batch's: its host values, no wait for the GPU
        owned = torch.ones(tokens.numel(), dtype=torch.bool) if owned is None else host_copy(owned)[:tokens.numel()]
        return RouterWeights(aux_coef=self.aux_coef[tokens] * owned[:, None], z_coef=self.z_coef[tokens] * owned,
                             counts=self.counts[tokens], checked=owned)


def needs_counts(router: RouterAux | None, mode: str | None, num_trees: int) -> bool:
    """Whether a step needs the counting pre-pass (module docstring)."""
    if router is None:
        return False
    if mode == "redundancy_free":
        return True
    return router.semantics == "batch" and (mode == "packed" or num_trees > 1)


def count_routes(tmodel, tree: Tree, plan=None, *, conv_kernel: int) -> torch.Tensor:
    """Layer-summed top-k expert counts of every token of ``tree`` (float64 ``[T, E]``, DFS order), from
    forwards without gradient: the whole tree (``plan`` None), each packed partition (a token counted in
    the partition that owns it) or the redundancy-free plan's partitions."""
    from treecompile.runtime.partition import PackedPlan, RedundancyFreePlan
    from treecompile.runtime.redundancy_free import prepass_redundancy_free

    if isinstance(plan, RedundancyFreePlan):
        return prepass_redundancy_free(tmodel, plan).counts
    counts = torch.zeros(tree.num_tokens, tmodel.router_aux.num_experts, dtype=torch.float64)
    batches = [tree.to_batch(conv_kernel=conv_kernel)] if plan is None else \
        [plan.batch(i, conv_kernel=conv_kernel) for i in range(len(plan))]
    if plan is not None and not isinstance(plan, PackedPlan):
        raise TypeError(f"count_routes: expected a PackedPlan or RedundancyFreePlan, got {type(plan).__name__}")
    check_unchanged(tmodel)  # the program runs directly here: the TreeModel's own call-time check
    for k, batch in enumerate(batches):
        try:
            batch.check_ids(tmodel.vocab_size)
        except ValueError as e:
            if plan is None:
                raise
            raise ValueError(f"packed partition {k}: {e}") from None
        with torch.no_grad():
            c = tmodel.router_counts(tmodel.program.run(batch), batch.num_tokens)
        if plan is None:
            counts = c
        else:
            tok, own = batch.extras["tokens"][:batch.num_tokens].cpu(), batch.extras["owned"][:batch.num_tokens].cpu()
            counts[tok[own]] = c[own]
    return counts


def _paths_to_tokens(tree: Tree, per_path: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum of per_path[p] over the paths p through t`` (``per_path [P, ...]`` float64)."""
    per = repeat_counts(per_path, tree.path_lengths)
    return torch.zeros((tree.num_tokens, *per_path.shape[1:]), dtype=torch.float64).index_add_(0, tree.path_index, per)


def step_router_weights(router: RouterAux, trees: Sequence[Tree], counts: Sequence[torch.Tensor],
                        norm: GlobalNorm) -> list[TreeRouterWeights]:
    """Every tree's coefficients (module docstring) from the pre-pass counts of all trees of the step."""
    E, k = router.num_experts, router.top_k
    L = int(round(float(counts[0][0].sum()) / k))  # every token has top_k slots per MoE layer
    s = norm.grad_scale
    out = []
    if router.semantics == "batch":
        share = [t.aggregate(torch.ones(t.num_paths, dtype=torch.float64),
                             torch.ones(t.num_path_tokens, dtype=torch.float64)) for t in trees]
        rows = L * sum(float(n.sum()) for n in share)
        f = sum((n[:, None] * c).sum(0) for n, c in zip(share, counts)) / rows
        for n, c in zip(share, counts):
            out.append(TreeRouterWeights(aux_coef=(s * E / rows) * n[:, None] * f[None, :], z_coef=(s / rows) * n,
                                         counts=c))
        return out
    for t, c in zip(trees, counts):
        cp = t.path_weights.to(torch.float64) * (s / norm.num_paths)
        length = L * t.path_lengths.to(torch.float64)
        A = ancestor_sums(c, t.subtree_end)[t.path_end]  # [P, E] counts along each path (integers: exact)
        out.append(TreeRouterWeights(aux_coef=_paths_to_tokens(t, (cp * E / length ** 2)[:, None] * A),
                                     z_coef=_paths_to_tokens(t, cp / length), counts=c))
    return out
