"""The FLOP model behind the work bound (baseline FLOPs / tree FLOPs) of the harness.

Training step = forward + backward (no optimizer).  Per token, every ``nn.Linear`` costs
``2 * in * out`` FLOPs forward (lm_head included, embeddings are lookups and cost nothing) and twice
that backward: ``linear = 3 * 2 * sum(in * out) * tokens``.  Routed experts (a module with an
``experts`` child and a top-k) count the k experts a token is routed to, not all of them: HF's fused
experts (3-D ``gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``, transformers 5) cost
``2 * k * (2I*D + D*I)`` per token, a ``ModuleList`` of expert MLPs (ours) ``k / E`` of their linears'
sum (our MoE reference computes every expert densely: the model counts the work a sparse dispatch
does, as every contender's would); the router counts as a linear (``nn.Linear``, or HF's router
module's 2-D ``weight [E, D]``).  Attention costs ``4 * H * D`` FLOPs per
*unmasked* (query, key) entry forward per full-attention layer (QK^T and PV) and 2.5x that backward
(recomputing P, dP, dS, dQ, dK, dV as flash kernels do): ``attention = 3.5 * 4 * H * D * entries``.
Gated DeltaNet layers (hybrid) are linear in tokens; their recurrence is charged ``3 * 4 * Hv * Dk *
Dv`` per token (state read and rank-1 update, fwd + 2x bwd); short convs, norms, activations,
softmax/loss and RoPE are left out (memory-bound, a few % of the total, equal per token in both).

Entries: a path of L tokens has ``L (L + 1) / 2`` (causal); a tree token at depth d sees its d
ancestors and itself, so a tree has ``sum_t (depth_t + 1)`` (a sliding layer of window W: ``min(., W)``
per token) — the same entries the per-path runs
compute once per path, counted once.  Packed baselines with a document mask compute the per-path
entries; their FLOPs equal the per-path ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

__all__ = ["FlopModel", "path_attention_entries", "tree_attention_entries"]

LINEAR_TRAIN = 3.0  # fwd + bwd (dX and dW)
ATTENTION_TRAIN = 3.5  # fwd + 2.5x bwd


def path_attention_entries(lengths: Sequence[int], window: int | None = None) -> int:
    """Unmasked entries of causal attention over each path alone; within a sliding ``window`` (query ``q`` sees
    key ``k`` iff ``0 <= q - k < window``) a token sees at most ``window`` keys."""
    if window is None:
        return sum(L * (L + 1) // 2 for L in lengths)
    w = int(window)
    return sum(L * (L + 1) // 2 if L <= w else w * (w + 1) // 2 + (L - w) * w for L in lengths)


def tree_attention_entries(position_ids: torch.Tensor, window: int | None = None) -> int:
    """``position_ids``: depths of the tree's tokens (no padding); a token sees its ancestors and itself, within a
    sliding ``window`` the nearest ``window`` of them."""
    seen = position_ids.to(torch.int64) + 1
    return int((seen if window is None else seen.clamp(max=int(window))).sum())


def _expert_modules(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(MoE block, its ``experts``) for every block with an ``experts`` child."""
    return [(m, m.experts) for m in model.modules() if isinstance(getattr(m, "experts", None), nn.Module)]


def _top_k(block: nn.Module, model: nn.Module) -> int:
    for owner in (block, getattr(block, "gate", None), getattr(block, "router", None)):
        k = getattr(owner, "top_k", None)
        if isinstance(k, int):
            return k
    k = getattr(model.config, "num_experts_per_tok", None)
    if not isinstance(k, int):
        raise ValueError(f"FlopModel: no top-k found for the MoE block {type(block).__name__}")
    return k


def linear_macs(model: nn.Module) -> int:
    """Multiply-adds per token of every ``nn.Linear`` outside routed experts, plus routers that are not
    ``nn.Linear`` (a 2-D ``weight`` on the block's ``gate`` / ``router``)."""
    inside = {id(m) for _, experts in _expert_modules(model) for m in experts.modules()}
    macs = sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, nn.Linear) and id(m) not in inside)
    for block, _ in _expert_modules(model):
        for name in ("gate", "router"):
            r = getattr(block, name, None)
            w = getattr(r, "weight", None)
            is_router = isinstance(r, nn.Module) and not isinstance(r, nn.Linear)
            if is_router and isinstance(w, torch.Tensor) and w.dim() == 2:
                macs += w.numel()
    return macs


def active_expert_macs(model: nn.Module) -> int:
    """Multiply-adds per token of the experts a token is routed to (top-k of each MoE block)."""
    macs = 0
    for block, experts in _expert_modules(model):
        k = _top_k(block, model)
        gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == down.dim() == 3:
            macs += k * (gu[0].numel() + down[0].numel())  # HF fused experts: one expert's matrices
        elif isinstance(experts, nn.ModuleList) and len(experts):
            per = sum(m.in_features * m.out_features for m in experts.modules() if isinstance(m, nn.Linear))
            if per % len(experts):
                raise ValueError("FlopModel: experts of unequal sizes")
            macs += k * per // len(experts)
        else:
            raise ValueError(f"FlopModel: unknown experts layout {type(experts).__name__}")
    return macs


@dataclass(frozen=True)
class FlopModel:
    linear_per_token: float  # forward FLOPs of all nn.Linear per token
    attention_per_entry: float  # forward FLOPs per unmasked entry, summed over full-attention layers
    recurrent_per_token: float  # forward FLOPs of the GDN recurrences per token
    # (window, forward FLOPs per unmasked entry summed over the sliding layers of that window), by window
    windowed: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> "FlopModel":
        cfg = model.config
        lin = 2.0 * (linear_macs(model) + active_expert_macs(model))
        types = getattr(cfg, "layer_types", None) or ("full_attention",) * cfg.num_hidden_layers
        n_gdn = sum(t == "linear_attention" for t in types)
        per_layer = 4.0 * cfg.num_attention_heads * cfg.head_dim
        windows = _model_windows(model)
        n_attn = sum(w is None for w in windows)
        windowed = tuple((w, per_layer * sum(x == w for x in windows)) for w in sorted({w for w in windows if w}))
        rec = 0.0
        if n_gdn:
            rec = 4.0 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * n_gdn
        return cls(lin, per_layer * n_attn, rec, windowed)

    def train(self, tokens: int, entries) -> float:
        """FLOPs of one training step (fwd + bwd) over ``tokens`` tokens; ``entries``: the unmasked entries of
        causal attention, or ``entries(window)`` giving them for a sliding ``window`` (None: full causal), which a
        model with sliding layers needs."""
        if callable(entries):
            attn = self.attention_per_entry * entries(None) + sum(f * entries(w) for w, f in self.windowed)
        elif self.windowed:
            raise ValueError("FlopModel.train: this model has sliding-window layers; give entries(window)")
        else:
            attn = self.attention_per_entry * entries
        return (LINEAR_TRAIN * (self.linear_per_token + self.recurrent_per_token) * tokens
                + ATTENTION_TRAIN * attn)


def _model_windows(model: nn.Module) -> list:
    """Each attention layer's sliding window, None for full causal (``hf_models.model_windows``)."""
    try:
        from benchmarks.hf_models import model_windows
    except ImportError:
        from hf_models import model_windows
    return model_windows(model)
