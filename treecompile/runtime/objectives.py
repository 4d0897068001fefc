"""Training objectives on a tree, each exactly equal to its per-path computation.

Notation: paths ``p``, their tokens ``t``; ``lp[t]`` = log p(token t | path prefix), the model's
per-token DFS output (``out.logprobs``), which is the same number on every path through ``t``;
``m[p,t]`` the loss mask; ``c_p = tree.path_coefficients(normalize)`` (path weight times the
normalization: ``sum`` 1/N, ``path_mean`` 1/(N * trained tokens of p), ``token_mean`` 1/(all
trained tokens)).  A per-path loss ``sum_p c_p sum_t m[p,t] f(lp[t], A_p, data[t])`` becomes a sum
over *unique* tokens once the per-path factors are aggregated over the paths through each token
(``tree.aggregate``): that is all every token-level objective here does.

==================  ==============================================================================
objective           per-path loss (what the tree loss equals)
==================  ==============================================================================
``SFT``             ``-sum_p c_p sum_t m lp``   (= ``-(batch.loss_weight * lp).sum()``)
``PolicyGradient``  ``-sum_p c_p A_p sum_t m lp``   (REINFORCE / GRPO at ratio 1)
``PPOClip``         ``-sum_p c_p sum_t m min(r A_p, clip(r, 1-eps_lo, 1+eps_hi) A_p)``,
                    ``r = exp(lp - old)``; on the tree ``-sum_t S+ min(r, 1+eps_hi) + S- max(r, 1-eps_lo)``
                    with ``S+- = sum_p c_p m[p,t] max/min(A_p, 0)``
``KLPenalty``       ``beta sum_p c_p sum_t m k(lp, ref)``, ``k3 = exp(ref-lp) - (ref-lp) - 1``
                    (also ``k1 = lp - ref``, ``k2 = (lp - ref)^2 / 2``)
``SequenceClip``    GSPO-style, path level: ``-sum_p (w_p/N) min(s_p A_p, clip(s_p) A_p)``,
                    ``s_p = exp(mean over trained t of (lp - old))``; through ``batch.path_logprobs``
==================  ==============================================================================

Each objective is a frozen dataclass whose one method ``loss(logprobs, batch, ...)`` returns the
scalar loss (float64; add several objectives' losses to combine them).  Per-path advantages and
per-token DFS old/ref log-probs are keyword arguments; left out, they are read from
``batch.extras`` (``advantages`` [P], ``old_logprobs``/``ref_logprobs`` [T], as
:meth:`treecompile.runtime.data.TrajectoryTree.to_batch` fills them).  Per-token data that comes
per path is put in DFS order with :func:`treecompile.runtime.data.scatter_to_dfs`.

The token-level objectives need only per-token weights computed from the tree (no model), so a
partitioned tree can compute them once for the whole tree and slice them per partition; the
path-level ``SequenceClip`` needs every token of a path in one batch.

Entropy is not provided: ``out.logprobs`` holds only the sampled token's log-probability, and the
entropy needs the whole distribution (``[T, vocab]`` logits), which the compiled model does not
return.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from treecompile.tree import NORMALIZATIONS, Tree, TreeBatch

__all__ = ["SFT", "PolicyGradient", "PPOClip", "KLPenalty", "SequenceClip", "KL_ESTIMATORS",
           "token_coefficients", "grpo_advantages"]

KL_ESTIMATORS = ("k1", "k2", "k3")


def token_coefficients(tree: Tree, normalize: str, per_path: torch.Tensor | None = None) -> torch.Tensor:
    """``sum over paths p through t of c_p * per_path[p] * m[p,t]`` for each unique token, DFS
    order, float64 ``[tree.num_tokens]`` (``per_path`` None means 1: the SFT weights)."""
    c = tree.path_coefficients(normalize)
    return tree.aggregate(c if per_path is None else c * per_path.to(torch.float64).cpu())


# ---------------------------------------------------------------------- argument checks
def _normalize(normalize: str | None, batch: TreeBatch) -> str:
    n = batch.normalize if normalize is None else normalize
    if n not in NORMALIZATIONS:
        raise ValueError(f"normalize: expected one of {NORMALIZATIONS} or None (the batch's), got {n!r}")
    return n


def _check_logprobs(logprobs: torch.Tensor, batch: TreeBatch) -> None:
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 1 or logprobs.numel() != batch.seq_len:
        shape = tuple(logprobs.shape) if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__
        raise ValueError(f"logprobs: expected a tensor of shape [{batch.seq_len}] (the batch's tokens, DFS "
                         f"order), got {shape}")


def _pad(x: torch.Tensor, batch: TreeBatch, like: torch.Tensor) -> torch.Tensor:
    """A DFS tensor over the tree's tokens -> ``[seq_len]`` (0 at padding) on ``like``'s device."""
    x = x.to(device=like.device, dtype=torch.float64)
    if x.numel() == batch.seq_len:
        return x
    return torch.cat([x, x.new_zeros(batch.seq_len - x.numel())])


def _per_path(value, batch: TreeBatch, name: str) -> torch.Tensor:
    if value is None:
        if name not in batch.extras:
            raise ValueError(f"{name}: not given and not in batch.extras (pass {name}=..., or give it in the data)")
        value = batch.extras[name]
    v = torch.as_tensor(value, dtype=torch.float64).cpu()
    if v.dim() != 1 or v.numel() != batch.num_paths:
        raise ValueError(f"{name}: expected shape [{batch.num_paths}] (one per path), got {tuple(v.shape)}")
    bad = torch.nonzero(~torch.isfinite(v)).flatten()
    if bad.numel():
        raise ValueError(f"{name}: path {int(bad[0])}: not finite ({v[int(bad[0])].item()})")
    return v


def _per_token(value, batch: TreeBatch, name: str, like: torch.Tensor) -> torch.Tensor:
    if value is None:
        if name not in batch.extras:
            raise ValueError(f"{name}: not given and not in batch.extras (pass {name}=..., or give it in the data)")
        value = batch.extras[name]
    v = torch.as_tensor(value)
    if v.dim() != 1 or v.numel() not in (batch.num_tokens, batch.seq_len):
        raise ValueError(f"{name}: expected DFS order, shape [{batch.num_tokens}] or [{batch.seq_len}], got "
                         f"{tuple(v.shape)} (scatter per-path values with data.scatter_to_dfs)")
    v = _pad(v, batch, like)
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name}: DFS token {int(torch.nonzero(~torch.isfinite(v))[0])}: not finite")
    return v


# ---------------------------------------------------------------------- token-level objectives
@dataclass(frozen=True)
class SFT:
    """``-sum_t w(t) lp[t]`` with ``w`` the SFT token weights of ``normalize`` (None: the batch's,
    whose ``loss_weight`` already holds them)."""

    normalize: str | None = None

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        n = _normalize(self.normalize, batch)
        w = batch.loss_weight if n == batch.normalize else token_coefficients(batch.tree, n)
        return -(_pad(w, batch, logprobs) * logprobs).sum()


@dataclass(frozen=True)
class PolicyGradient:
    """``-sum_p c_p A_p sum_t m[p,t] lp[t]`` = ``-sum_t (sum_p c_p A_p m[p,t]) lp[t]``."""

    normalize: str | None = None

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, advantages=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        A = _per_path(advantages, batch, "advantages")
        w = token_coefficients(batch.tree, _normalize(self.normalize, batch), A)
        return -(_pad(w, batch, logprobs) * logprobs).sum()


@dataclass(frozen=True)
class PPOClip:
    """PPO's clipped surrogate with per-path advantages and per-token old log-probs.

    ``clip_low``/``clip_high`` are eps of ``clip(r, 1 - clip_low, 1 + clip_high)`` (equal: PPO;
    larger ``clip_high``: DAPO's clip-higher).  The ratio ``r = exp(lp - old)`` of a shared token is
    one number, so the paths through it reduce to ``S+ min(r, 1+clip_high) + S- max(r, 1-clip_low)``.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    normalize: str | None = None

    def __post_init__(self):
        if not (0 <= self.clip_low < 1) or not (self.clip_high >= 0) or math.isinf(self.clip_high):
            raise ValueError(f"PPOClip: need 0 <= clip_low < 1 and finite clip_high >= 0, got "
                             f"clip_low={self.clip_low}, clip_high={self.clip_high}")

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, advantages=None, old_logprobs=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        A = _per_path(advantages, batch, "advantages")
        old = _per_token(old_logprobs, batch, "old_logprobs", logprobs)
        n = _normalize(self.normalize, batch)
        s_pos = _pad(token_coefficients(batch.tree, n, A.clamp(min=0)), batch, logprobs)
        s_neg = _pad(token_coefficients(batch.tree, n, A.clamp(max=0)), batch, logprobs)
        # tokens no path trains carry no old log-prob (0): keep exp() away from them entirely
        active = (s_pos != 0) | (s_neg != 0)
        r = torch.exp(torch.where(active, logprobs - old, torch.zeros_like(old)))
        surrogate = s_pos * r.clamp(max=1 + self.clip_high) + s_neg * r.clamp(min=1 - self.clip_low)
        return -surrogate.sum()


@dataclass(frozen=True)
class KLPenalty:
    """``beta * sum_p c_p sum_t m[p,t] k(lp[t], ref[t])`` with the estimator ``k`` of KL(pi || ref)
    on tokens sampled from pi: ``k3 = exp(ref - lp) - (ref - lp) - 1`` (default; >= 0, unbiased),
    ``k1 = lp - ref``, ``k2 = (lp - ref)^2 / 2``."""

    beta: float
    estimator: str = "k3"
    normalize: str | None = None

    def __post_init__(self):
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"KLPenalty.estimator: expected one of {KL_ESTIMATORS}, got {self.estimator!r}")
        if not math.isfinite(self.beta):
            raise ValueError(f"KLPenalty.beta: expected a finite number, got {self.beta}")

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, ref_logprobs=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        ref = _per_token(ref_logprobs, batch, "ref_logprobs", logprobs)
        n = _normalize(self.normalize, batch)
        w = batch.loss_weight if n == batch.normalize else token_coefficients(batch.tree, n)
        w = _pad(w, batch, logprobs)
        d = torch.where(w != 0, ref - logprobs, torch.zeros_like(ref))  # untrained tokens have no ref (0)
        if self.estimator == "k3":
            k = torch.exp(d) - d - 1
        elif self.estimator == "k2":
            k = 0.5 * d * d
        else:
            k = -d
        return self.beta * (w * k).sum()


# ---------------------------------------------------------------------- path-level objective
@dataclass(frozen=True)
class SequenceClip:
    """GSPO-style sequence-level clipped objective, an example of a path-level loss.

    ``s_p = exp(sum_t m[p,t] (lp[t] - old[t]) / sum_t m[p,t])`` (1 for a path with no trained
    token); loss ``-sum_p (w_p / N) min(s_p A_p, clip(s_p, 1 - clip_low, 1 + clip_high) A_p)``
    with ``w_p`` the path weights.  Each path's tokens are read with ``batch.path_logprobs`` and
    autograd sums the contributions of shared tokens; every token of every path must be in the
    batch (a partition holding whole paths).
    """

    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def __post_init__(self):
        if not (0 <= self.clip_low < 1) or not (self.clip_high >= 0) or math.isinf(self.clip_high):
            raise ValueError(f"SequenceClip: need 0 <= clip_low < 1 and finite clip_high >= 0, got "
                             f"clip_low={self.clip_low}, clip_high={self.clip_high}")

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, advantages=None, old_logprobs=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        tree = batch.tree
        A = _per_path(advantages, batch, "advantages").to(logprobs.device)
        old = _per_token(old_logprobs, batch, "old_logprobs", logprobs)
        lp_paths = torch.cat(batch.path_logprobs(logprobs)).to(torch.float64)  # flat, path order
        old_paths = old[tree.path_index.to(logprobs.device)]
        mask = tree.loss_mask.to(device=logprobs.device, dtype=torch.float64)
        seg = torch.repeat_interleave(torch.arange(tree.num_paths, device=logprobs.device),
                                      tree.path_lengths.to(logprobs.device))
        P = tree.num_paths
        diff = torch.zeros(P, dtype=torch.float64, device=logprobs.device).index_add(
            0, seg, mask * (lp_paths - old_paths))
        count = torch.zeros(P, dtype=torch.float64, device=logprobs.device).index_add(0, seg, mask)
        s = torch.exp(diff / count.clamp(min=1))
        clipped = s.clamp(1 - self.clip_low, 1 + self.clip_high)
        w = tree.path_weights.to(logprobs.device) / P
        return -(w * torch.minimum(s * A, clipped * A)).sum()


# ---------------------------------------------------------------------- advantages
def grpo_advantages(rewards, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-relative advantages over one tree's paths: ``(r - mean) / (std + eps)``
    (``std`` unbiased, as TRL; ``scale=False``: ``r - mean`` only, as Dr. GRPO).  A single path
    gets 0."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("rewards: empty")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards: path {int(torch.nonzero(~torch.isfinite(r))[0])}: not finite")
    A = r - r.mean()
    if scale and r.numel() > 1:
        A = A / (r.std() + eps)
    return A
