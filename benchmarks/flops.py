"""The FLOP model behind the work bound (baseline FLOPs / tree FLOPs) of the harness.

Training step = forward + backward (no optimizer).  Per token, every ``nn.Linear`` costs
``2 * in * out`` FLOPs forward (lm_head included, embeddings are lookups and cost nothing) and twice
that backward: ``linear = 3 * 2 * sum(in * out) * tokens``.  Attention costs ``4 * H * D`` FLOPs per
*unmasked* (query, key) entry forward per full-attention layer (QK^T and PV) and 2.5x that backward
(recomputing P, dP, dS, dQ, dK, dV as flash kernels do): ``attention = 3.5 * 4 * H * D * entries``.
Gated DeltaNet layers (hybrid) are linear in tokens; their recurrence is charged ``3 * 4 * Hv * Dk *
Dv`` per token (state read and rank-1 update, fwd + 2x bwd); short convs, norms, activations,
softmax/loss and RoPE are left out (memory-bound, a few % of the total, equal per token in both).

Entries: a path of L tokens has ``L (L + 1) / 2`` (causal); a tree token at depth d sees its d
ancestors and itself, so a tree has ``sum_t (depth_t + 1)`` — the same entries the per-path runs
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


def path_attention_entries(lengths: Sequence[int]) -> int:
    return sum(L * (L + 1) // 2 for L in lengths)


def tree_attention_entries(position_ids: torch.Tensor) -> int:
    """``position_ids``: depths of the tree's tokens (no padding)."""
    return int((position_ids.to(torch.int64) + 1).sum())


@dataclass(frozen=True)
class FlopModel:
    linear_per_token: float  # forward FLOPs of all nn.Linear per token
    attention_per_entry: float  # forward FLOPs per unmasked entry, summed over full-attention layers
    recurrent_per_token: float  # forward FLOPs of the GDN recurrences per token

    @classmethod
    def of(cls, model: nn.Module) -> "FlopModel":
        cfg = model.config
        lin = 2.0 * sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
        types = getattr(cfg, "layer_types", None) or ("full_attention",) * cfg.num_hidden_layers
        n_attn = sum(t == "full_attention" for t in types)
        n_gdn = sum(t == "linear_attention" for t in types)
        attn = 4.0 * cfg.num_attention_heads * cfg.head_dim * n_attn
        rec = 0.0
        if n_gdn:
            rec = 4.0 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * n_gdn
        return cls(lin, attn, rec)

    def train(self, tokens: int, entries: int) -> float:
        """FLOPs of one training step (fwd + bwd) over ``tokens`` tokens and ``entries`` unmasked entries."""
        return (LINEAR_TRAIN * (self.linear_per_token + self.recurrent_per_token) * tokens
                + ATTENTION_TRAIN * self.attention_per_entry * entries)
