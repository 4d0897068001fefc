"""Training objectives on a tree, each exactly equal to its per-path computation.

Notation: paths ``p``, their tokens ``t``; ``lp[t]`` = log p(token t | path prefix), the model's
per-token DFS output (``out.logprobs``), which is the same number on every path through ``t``;
``m[p,t]`` the loss mask; ``c_p`` = path weight times the normalization (``sum`` 1/N, ``path_mean``
1/(N * trained tokens of p), ``token_mean`` 1/(all trained tokens); N and the token count are the
step's: :class:`~treecompile.runtime.normalization.GlobalNorm`, by default the one the batch was built with
(``extras["norm"]``), else the batch's tree alone,
``tree.path_coefficients(normalize)``).  A per-path loss ``sum_p c_p sum_t m[p,t] f(lp[t], A_p, data[t])`` becomes a sum
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

Each objective is a frozen dataclass whose method ``loss(logprobs, batch, *, norm=None, ...)`` returns
the scalar loss (float64; add several objectives' losses to combine them); ``norm`` is the step's
:class:`~treecompile.runtime.normalization.GlobalNorm` (None: the batch's own, ``extras["norm"]`` of
``normalization.tree_batch``/``partition_batch``, else the batch's tree alone; with the objective's ``normalize``
or else the batch's).  Objectives *linear* in the log-probs (``SFT``,
``PolicyGradient``) also say their token weights, ``token_weights(tree, norm, data) -> w [T]``
(whole-tree DFS, loss ``-sum_t w(t) lp[t]``), which is what ``train_step``'s redundancy-free mode
runs.  Per-path advantages and
per-token DFS old/ref log-probs are keyword arguments; left out, they are read from
``batch.extras`` (``advantages`` [P], ``old_logprobs``/``ref_logprobs`` [T], as
:meth:`treecompile.runtime.data.TrajectoryTree.to_batch` fills them).  Per-token data that comes
per path is put in DFS order with :func:`treecompile.runtime.data.scatter_to_dfs`.

**Partitions and several trees.**  The token-level objectives need only per-token weights computed
from the tree (no model).  A batch that is one partition of a bigger tree says so in ``extras``:
``whole_tree`` (the :class:`Tree` it belongs to), ``tokens`` (partition token -> whole-tree DFS index)
and ``owned`` (bool per partition token: the partition that carries the token's weight; each
whole-tree token is owned by exactly one partition).  The weights are then the *whole tree's*,
restricted to the partition's tokens and zeroed where not owned, so the partition losses sum to the
whole-tree loss; per-path advantages are the whole tree's ``[P]``; per-token old/ref log-probs may
be given over the whole tree ``[whole T]`` (sliced here) or over the partition.  A step made of
several trees passes its ``norm``.  :meth:`treecompile.runtime.partition.PackedPlan.batch` fills
``whole_tree``/``tokens``/``owned``/``paths``.  The path-level ``SequenceClip`` needs every token of
a path in one batch: on a packed partition it sums over the paths assigned to it (``extras["paths"]``,
each lying whole in it).

**Entropy.**  ``EntropyBonus(coef)`` is ``-coef * sum_p c_p sum_t m[p,t] H[t]`` with ``H`` the
entropy of each token's predicting distribution (``out.entropy`` of a model compiled with
``treecompile.compile(model, entropy=True)``; the fused head computes it from its logits chunks).
Its loss takes ``entropy=`` (``train_step`` passes ``out.entropy`` to objectives whose
``uses_entropy`` is true); add it to another objective by giving ``train_step`` a tuple of objectives.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Mapping

import torch

from treecompile.host_values import host_copy, repeat_counts, to_device
from treecompile.runtime.normalization import GlobalNorm
from treecompile.tree import NORMALIZATIONS, Tree, TreeBatch

__all__ = ["SFT", "PolicyGradient", "PPOClip", "KLPenalty", "SequenceClip", "EntropyBonus", "KL_ESTIMATORS",
           "grpo_advantages", "trained_counts"]

KL_ESTIMATORS = ("k1", "k2", "k3")


# ---------------------------------------------------------------------- whole tree / partition
def _whole(batch: TreeBatch) -> Tree:
    """The tree whose paths the objective sums over: ``extras["whole_tree"]`` for a partition."""
    tree = batch.extras.get("whole_tree", batch.tree)
    if tree is None:
        raise ValueError("batch has no tree (a redundancy-free partition?): objectives need batch.tree or "
                         "extras['whole_tree'] with extras['tokens'] and extras['owned']")
    return tree


def _is_partition(batch: TreeBatch) -> bool:
    return "whole_tree" in batch.extras


def _step_norm(batch: TreeBatch, normalize: str, norm: GlobalNorm | None) -> GlobalNorm:
    """The step's normalization under ``normalize``: ``norm`` if given, else the one the batch was built with
    (``extras["norm"]``: ``normalization.tree_batch`` / ``partition_batch``), else the batch's tree alone.  (SFT
    weights read off a batch's ``loss_weight`` are that same normalization's: every objective agrees.)"""
    if norm is None:
        norm = batch.extras.get("norm")
    if norm is None:
        return GlobalNorm.of_tree(_whole(batch), normalize)
    if not isinstance(norm, GlobalNorm):
        raise TypeError(f"norm: expected a treecompile.runtime.normalization.GlobalNorm, got {type(norm).__name__}")
    return norm.with_normalize(normalize)


def _restrict(w: torch.Tensor, batch: TreeBatch, like: torch.Tensor) -> torch.Tensor:
    """Whole-tree DFS weights -> the batch's (owned) tokens, padded to ``seq_len`` on ``like``'s device."""
    if _is_partition(batch):
        ex = batch.extras
        tok, owned = host_copy(ex["tokens"]), host_copy(ex["owned"])  # a moved batch's: its host values, no wait
        w = torch.where(owned, w[tok], torch.zeros((), dtype=torch.float64))
    return _pad(w, batch, like)


def _sft_weights(batch: TreeBatch, normalize: str, norm: GlobalNorm | None, like: torch.Tensor) -> torch.Tensor:
    """The SFT weights: the batch's own ``loss_weight`` when it has that normalization (and no step's
    ``norm`` is given), else the step's weights restricted to the batch."""
    if norm is None and normalize == batch.normalize:
        return _pad(batch.loss_weight, batch, like)
    return _restrict(_step_norm(batch, normalize, norm).token_weights(_whole(batch)), batch, like)


# ---------------------------------------------------------------------- argument checks
def _normalize(normalize: str | None, batch: TreeBatch) -> str:
    n = batch.normalize if normalize is None else normalize
    if n not in NORMALIZATIONS:
        raise ValueError(f"normalize: expected one of {NORMALIZATIONS} or None (the batch's), got {n!r}")
    return n


def _check_clip(name: str, clip_low: float, clip_high: float) -> None:
    if not (0 <= clip_low < 1) or not (clip_high >= 0) or math.isinf(clip_high):
        raise ValueError(f"{name}: need 0 <= clip_low < 1 and finite clip_high >= 0, got "
                         f"clip_low={clip_low}, clip_high={clip_high}")


def _check_logprobs(logprobs: torch.Tensor, batch: TreeBatch) -> None:
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 1 or logprobs.numel() != batch.seq_len:
        shape = tuple(logprobs.shape) if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__
        raise ValueError(f"logprobs: expected a tensor of shape [{batch.seq_len}] (the batch's tokens, DFS "
                         f"order), got {shape}")


def _pad(x: torch.Tensor, batch: TreeBatch, like: torch.Tensor) -> torch.Tensor:
    """A DFS tensor over the tree's tokens -> ``[seq_len]`` (0 at padding) on ``like``'s device."""
    x = to_device(x, like.device, torch.float64)  # no wait for the GPU's queue (the forward)
    if x.numel() == batch.seq_len:
        return x
    return torch.cat([x, x.new_zeros(batch.seq_len - x.numel())])


def _per_path(value, data: Mapping, P: int, name: str) -> torch.Tensor:
    """A per-path tensor ``[P]``: ``value``, or ``data[name]`` (a batch's extras, a tree's data)."""
    if value is None:
        if name not in data:
            raise ValueError(f"{name}: not given and not in batch.extras (pass {name}=..., or give it in the data)")
        value = data[name]
    v = torch.as_tensor(value)
    if v.dtype == torch.bool:  # True/False would pass as 1/0 (path weights refuse bools the same way)
        raise ValueError(f"{name}: expected numbers, one per path, got bools")
    v = v.to(torch.float64).cpu()
    if v.dim() != 1 or v.numel() != P:
        raise ValueError(f"{name}: expected shape [{P}] (one per path), got {tuple(v.shape)}")
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
    if _is_partition(batch) and v.dim() == 1 and v.numel() == _whole(batch).num_tokens:
        tok = batch.extras["tokens"].to(v.device)
        own = v.numel() in (batch.num_tokens, batch.seq_len)
        if own and not torch.equal(tok, torch.arange(tok.numel(), device=v.device)):
            raise ValueError(f"{name}: {v.numel()} values are as many as the whole tree's tokens and as this "
                             f"partition's {'padded ' if v.numel() != batch.num_tokens else ''}length: which "
                             f"tokens they belong to is not known; give the partition's {batch.num_tokens} tokens "
                             f"in its DFS order (or build it without padding)")
        v = v[tok]  # whole-tree DFS values -> the partition's tokens
    if v.dim() != 1 or v.numel() not in (batch.num_tokens, batch.seq_len):
        shapes = f"[{batch.num_tokens}]" + (f" or [{batch.seq_len}]" if batch.seq_len != batch.num_tokens else "")
        raise ValueError(f"{name}: expected DFS order, shape {shapes}, got "
                         f"{tuple(v.shape)} (scatter per-path values with data.scatter_to_dfs)")
    # checked where the values are (host values: no wait for the GPU), then moved
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{name}: DFS token {int(torch.nonzero(~torch.isfinite(v))[0])}: not finite")
    return _pad(v, batch, like)


# ---------------------------------------------------------------------- token-level objectives
@dataclass(frozen=True)
class SFT:
    """``-sum_t w(t) lp[t]`` with ``w`` the SFT token weights of ``normalize`` (None: the batch's,
    whose ``loss_weight`` already holds them)."""

    normalize: str | None = None

    def token_weights(self, tree: Tree, norm: GlobalNorm, data: Mapping = {}) -> torch.Tensor:
        """Whole-tree DFS weights ``w [T]`` of the loss ``-sum_t w(t) lp[t]`` under the step's ``norm``."""
        return norm.with_normalize(self.normalize).token_weights(tree)

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, norm: GlobalNorm | None = None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        w = _sft_weights(batch, _normalize(self.normalize, batch), norm, logprobs)
        return -(w * logprobs).sum()


@dataclass(frozen=True)
class PolicyGradient:
    """``-sum_p c_p A_p sum_t m[p,t] lp[t]`` = ``-sum_t (sum_p c_p A_p m[p,t]) lp[t]``."""

    normalize: str | None = None

    def token_weights(self, tree: Tree, norm: GlobalNorm, data: Mapping = {}, *, advantages=None) -> torch.Tensor:
        """Whole-tree DFS weights ``sum_p c_p A_p m[p,t]``; ``A`` = ``advantages`` or ``data["advantages"]``."""
        A = _per_path(advantages, data, tree.num_paths, "advantages")
        return norm.with_normalize(self.normalize).token_weights(tree, A)

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, norm: GlobalNorm | None = None,
             advantages=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        tree = _whole(batch)
        w = self.token_weights(tree, _step_norm(batch, _normalize(self.normalize, batch), norm), batch.extras,
                               advantages=advantages)
        return -(_restrict(w, batch, logprobs) * logprobs).sum()


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
        _check_clip("PPOClip", self.clip_low, self.clip_high)

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, norm: GlobalNorm | None = None,
             advantages=None, old_logprobs=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        tree = _whole(batch)
        A = _per_path(advantages, batch.extras, tree.num_paths, "advantages")
        old = _per_token(old_logprobs, batch, "old_logprobs", logprobs)
        step = _step_norm(batch, _normalize(self.normalize, batch), norm)
        s_pos = _restrict(step.token_weights(tree, A.clamp(min=0)), batch, logprobs)
        s_neg = _restrict(step.token_weights(tree, A.clamp(max=0)), batch, logprobs)
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
        if isinstance(self.beta, bool) or not isinstance(self.beta, numbers.Real) or not math.isfinite(self.beta):
            raise ValueError(f"KLPenalty.beta: expected a finite number, got {self.beta!r}")

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, norm: GlobalNorm | None = None,
             ref_logprobs=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        ref = _per_token(ref_logprobs, batch, "ref_logprobs", logprobs)
        w = _sft_weights(batch, _normalize(self.normalize, batch), norm, logprobs)
        d = torch.where(w != 0, ref - logprobs, torch.zeros_like(ref))  # untrained tokens have no ref (0)
        if self.estimator == "k3":
            k = torch.exp(d) - d - 1
        elif self.estimator == "k2":
            k = 0.5 * d * d
        else:
            k = -d
        return self.beta * (w * k).sum()


@dataclass(frozen=True)
class EntropyBonus:
    """``-coef * sum_p c_p sum_t m[p,t] H[t]``: rewards the policy's entropy (``coef > 0``) on the
    trained tokens, with the SFT token weights of ``normalize``.  ``H`` = ``out.entropy`` of a model
    compiled with ``entropy=True``, a differentiable ``[T]`` in DFS order."""

    coef: float
    normalize: str | None = None
    uses_entropy = True  # train_step passes entropy=out.entropy

    def __post_init__(self):
        if not math.isfinite(self.coef):
            raise ValueError(f"EntropyBonus.coef: expected a finite number, got {self.coef}")

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, norm: GlobalNorm | None = None,
             entropy=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        if entropy is None:
            raise ValueError("EntropyBonus: no entropy given (compile the model with treecompile.compile(model, "
                             "entropy=True) and pass entropy=out.entropy)")
        _check_logprobs(entropy, batch)
        w = _sft_weights(batch, _normalize(self.normalize, batch), norm, entropy)
        return -self.coef * (w * entropy).sum()


def trained_counts(batch: TreeBatch) -> torch.Tensor:
    """Per token, the number of paths that train it (``sum_p m[p,t]``), float64 ``[seq_len]``, on
    the batch's owned tokens of a partition (0 elsewhere): ``(counts * x).sum() / counts.sum()``
    over a step's batches is the mean of ``x`` over all trained path tokens (``train_step``'s
    ``entropy`` metric)."""
    tree = _whole(batch)
    return _restrict(tree.aggregate(torch.ones(tree.num_paths, dtype=torch.float64)), batch, batch.loss_weight)


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
    path_level = True  # needs every token of a path in one batch (not on redundancy-free partitions)

    def __post_init__(self):
        _check_clip("SequenceClip", self.clip_low, self.clip_high)

    def loss(self, logprobs: torch.Tensor, batch: TreeBatch, *, norm: GlobalNorm | None = None,
             advantages=None, old_logprobs=None) -> torch.Tensor:
        _check_logprobs(logprobs, batch)
        tree = _whole(batch)
        dev = logprobs.device
        A = _per_path(advantages, batch.extras, tree.num_paths, "advantages")
        old = _per_token(old_logprobs, batch, "old_logprobs", logprobs)
        if _is_partition(batch):  # the whole paths assigned to this partition
            if "paths" not in batch.extras:
                raise ValueError("SequenceClip on a partition needs extras['paths'] (the paths lying whole in it, "
                                 "as packed partitions give them); redundancy-free partitions cut paths")
            paths = torch.as_tensor(batch.extras["paths"], dtype=torch.long).cpu()
        else:
            paths = torch.arange(tree.num_paths)
        lengths = tree.path_lengths[paths]
        seg = repeat_counts(torch.arange(paths.numel()), lengths)
        starts = tree.path_offsets[paths] - (torch.cumsum(lengths, 0) - lengths)
        flat = starts[seg] + torch.arange(seg.numel())  # the paths' tokens in path-token order
        pos = tree.path_index[flat]  # whole-tree DFS
        if _is_partition(batch):
            tok = host_copy(batch.extras["tokens"])
            g = pos
            pos = torch.searchsorted(tok, g).clamp(max=max(tok.numel() - 1, 0))
            bad = torch.nonzero(tok[pos] != g).flatten() if tok.numel() else torch.arange(g.numel())
            if bad.numel():
                raise ValueError(f"SequenceClip: path {int(paths[seg[int(bad[0])]])} is not whole in this partition "
                                 f"(its DFS token {int(g[int(bad[0])])} is missing)")
        pos, seg = to_device(pos, dev), to_device(seg, dev)
        mask = to_device(tree.loss_mask[flat], dev, torch.float64)
        n = paths.numel()
        diff = torch.zeros(n, dtype=torch.float64, device=dev).index_add(
            0, seg, mask * (logprobs[pos].to(torch.float64) - old[pos]))
        count = torch.zeros(n, dtype=torch.float64, device=dev).index_add(0, seg, mask)
        s = torch.exp(diff / count.clamp(min=1))
        clipped = s.clamp(1 - self.clip_low, 1 + self.clip_high)
        A = to_device(A[paths], dev)
        w = to_device(_step_norm(batch, "sum", norm).path_coefficients(tree)[paths], dev)  # w_p / N
        return -(w * torch.minimum(s * A, clipped * A)).sum()


# ---------------------------------------------------------------------- advantages
def grpo_advantages(rewards, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-relative advantages over one tree's paths: ``(r - mean) / (std + eps)``
    (``std`` unbiased, as TRL; ``scale=False``: ``r - mean`` only, as Dr. GRPO).  A single path
    gets 0."""
    r = torch.as_tensor(rewards)
    if r.dim() > 1 and r.numel() != max(r.shape):  # [groups, paths]: one call per tree's group, not all at once
        raise ValueError(f"rewards: expected one reward per path of one tree, got shape {tuple(r.shape)} (call "
                         "grpo_advantages once per tree)")
    if r.dtype == torch.bool:
        raise ValueError("rewards: expected numbers, got bools")
    r = r.to(torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("rewards: empty")
    if not bool(torch.isfinite(r).all()):
        raise ValueError(f"rewards: path {int(torch.nonzero(~torch.isfinite(r))[0])}: not finite")
    A = r - r.mean()
    if scale and r.numel() > 1:
        A = A / (r.std() + eps)
    return A
