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

With the model's ``router_z_loss_coef`` > 0 (our MoE model; no HF causal MoE model in transformers 5.23
has a router z-loss) the z-loss ``mean_t logsumexp(logits_t)^2`` is computed with the same semantics,
added times its coefficient and returned as ``out.z_loss``.

A batch is one whole tree, or a packed partition of one (``extras["whole_tree"]``, ``["tokens"]``,
``["paths"]``: the paths lying whole in it) for ``"path"``, whose loss then sums over the paths
assigned to the partition (the partition losses add up to the tree's).  ``N`` is the tree's path count
(``train_step`` rescales to the step's paths).

Any other batch (a packed partition under ``"batch"``, one tree of several, a redundancy-free
partition) needs the step's routed counts before its backward: its losses are then *linear* in its
tokens' router probabilities (the counts ``f`` carry no gradient), ``aux = sum_t sum_e probs[t, e] *
aux_coef[t, e]`` and ``z = sum_t z[t] * z_coef[t]``, with coefficients the step computed from a counting
pre-pass (:mod:`treecompile.runtime.router_step`) and handed in as ``extras[ROUTER_WEIGHTS]``
(:class:`RouterWeights`).  The batch's own top-k counts must equal the pre-pass's (routing is
deterministic); a difference raises :class:`RoutingMismatchError`.  Without coefficients such a batch
is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treecompile.host_values import host_copy, to_device
from treecompile.ops.router_loss import SEMANTICS, load_balancing_loss, router_statistics, router_z_loss
from treecompile.tree import TreeBatch

__all__ = ["RouterAux", "RouterWeights", "RoutingMismatchError", "ROUTER_WEIGHTS"]

ROUTER_WEIGHTS = "router_weights"  # batch.extras key of a RouterWeights


class RoutingMismatchError(RuntimeError):
    """A batch routed tokens differently from the counting pre-pass of its step."""


@dataclass(frozen=True)
class RouterWeights:
    """A batch's coefficients in its step's router losses (module docstring); rows = the batch's tokens.

    ``aux_coef [n, E]``: factor on each token's router probabilities summed over layers; ``z_coef [n]``:
    factor on its ``sum_l logsumexp(logits_l)^2``; ``counts [n, E]``: the layer-summed top-k counts of the
    pre-pass; ``checked [n]`` (bool): the tokens whose counts entered the coefficients (a packed
    partition's owned tokens), compared with this batch's own counts.  All float64 except ``checked``.
    """

    aux_coef: torch.Tensor
    z_coef: torch.Tensor
    counts: torch.Tensor
    checked: torch.Tensor


@dataclass(frozen=True)
class RouterAux:
    semantics: str  # "batch" | "path"
    num_experts: int
    top_k: int
    coef: float  # added to out.loss: coef * aux
    z_coef: float = 0.0  # the model's router_z_loss_coef: coef * z added to out.loss when > 0

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
        z = float(getattr(cfg, "router_z_loss_coef", 0.0) or 0.0)
        return cls(semantics, int(E), int(k), float(coef), z)

    def weighted(self, aux: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """``coef * aux (+ z_coef * z)``: what the router losses add to a batch's loss."""
        return self.coef * aux if z is None else self.coef * aux + self.z_coef * z

    def _logits(self, router_logits, n: int) -> list:
        logits = [rl[:n] for rl in router_logits]
        if logits[0].shape[-1] != self.num_experts:
            raise ValueError(f"router_aux: router logits have {logits[0].shape[-1]} experts, the config says "
                             f"{self.num_experts}")
        return logits

    def counts(self, router_logits, n: int) -> torch.Tensor:
        """Layer-summed top-k counts of the first ``n`` rows (float64 ``[n, E]``, CPU, no gradient)."""
        with torch.no_grad():
            return router_statistics(self._logits(router_logits, n), self.top_k)[1].cpu()

    def loss(self, router_logits, batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's ``(aux, z)`` (float64 scalars; ``z`` None without a z-loss) from the graph's
        ``router_logits`` (``[T, E]`` each)."""
        n = batch.num_tokens
        logits = self._logits(router_logits, n)
        probs, counts, z = router_statistics(logits, self.top_k)
        L = len(logits)
        weights = batch.extras.get(ROUTER_WEIGHTS)
        if weights is not None:
            return self._linear(probs, counts, z, weights, batch)
        partition = "whole_tree" in batch.extras
        cuts = "paths" not in batch.extras if partition else batch.tree is None
        if cuts or partition and self.semantics == "batch":
            raise NotImplementedError(
                f"router_aux={self.semantics!r} on "
                + ("partitions that cut paths (redundancy-free)" if cuts else "partitions holding part of the step's tokens (the statistics are products of sums over "
                        "all of them)")
                + ": their coefficients need the step's routed counts (extras[ROUTER_WEIGHTS]); run the step "
                  "through treecompile.runtime.train.train_step, which counts them first")
        tree = batch.extras.get("whole_tree", batch.tree)
        zl = None
        if self.semantics == "batch":
            share = tree.aggregate(torch.ones(tree.num_paths, dtype=torch.float64),
                                   torch.ones(tree.num_path_tokens, dtype=torch.float64))
            kw = dict(semantics="batch", share_count=share)
        else:
            scale = 1.0 / tree.num_paths
            if partition:  # the paths assigned to this partition, located among its tokens
                paths = torch.as_tensor(batch.extras["paths"], dtype=torch.long)
                tok = host_copy(batch.extras["tokens"])  # a moved batch's: its host values, no wait for the GPU
                end = torch.searchsorted(tok, tree.path_end[paths])
                subtree_end = host_copy(batch.subtree_end)[:n]
            else:
                paths, end, subtree_end = torch.arange(tree.num_paths), tree.path_end, tree.subtree_end
            coef = tree.path_weights.to(torch.float64)[paths] * scale
            kw = dict(semantics="path", subtree_end=subtree_end, path_end=end, path_coef=coef)
        aux = load_balancing_loss(probs, counts, num_layers=L, **kw)
        if self.z_coef:
            zl = router_z_loss(z, num_layers=L, **kw)
        return aux, zl

    def _linear(self, probs, counts, z, w: RouterWeights, batch: TreeBatch):
        """The losses linear in the batch's tokens, with the step's coefficients (module docstring)."""
        n = probs.shape[0]
        if w.aux_coef.shape != (n, self.num_experts) or w.z_coef.shape != (n,):
            raise ValueError(f"extras[{ROUTER_WEIGHTS!r}]: coefficients of shape {tuple(w.aux_coef.shape)}, "
                             f"{tuple(w.z_coef.shape)} for a batch of {n} tokens and {self.num_experts} experts")
        got = counts.detach().cpu()
        bad = (got != w.counts).any(-1) & w.checked
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0])
            tok = batch.extras.get("tokens")
            name = f"whole-tree token {int(tok[t])}" if tok is not None else f"token {t}"
            raise RoutingMismatchError(
                f"router_aux: {name} routed to experts with layer-summed counts {got[t].tolist()} here but "
                f"{w.counts[t].tolist()} in the counting pre-pass of the step: routing is not deterministic "
                f"(nondeterministic kernels, active dropout, or parameters changed between the passes), so the "
                f"step's statistics would not be the ones trained on")
        aux = (probs * to_device(w.aux_coef, probs.device)).sum()
        zl = (z * to_device(w.z_coef, z.device)).sum() if self.z_coef else None
        return aux, zl
