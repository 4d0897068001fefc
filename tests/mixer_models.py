"""Tiny plain-PyTorch causal LMs whose only token mixing is one hand-written mixer (tests of the
mixer rewrites).  Each takes ``ids [1, T]`` and returns logits ``[1, T, V]``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

V, C = 23, 8


class MixerLM(nn.Module):
    """emb -> h + W(mix(h)) -> norm -> head; subclasses define ``mix``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.proj = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)
        self.head = nn.Linear(C, V)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.proj(torch.tanh(self.mix(h)))
        return self.head(self.norm(h))


class ShiftPad(MixerLM):
    def __init__(self, k=1):
        super().__init__()
        self.k = k

    def mix(self, h):
        return F.pad(h, (0, 0, self.k, 0))[:, :-self.k]


class ShiftCat(MixerLM):
    def __init__(self, k=3):
        super().__init__()
        self.k = k

    def mix(self, h):
        return torch.cat([h.new_zeros(1, self.k, h.shape[2]), h], 1)[:, :h.shape[1]]


class ShiftRollMask(MixerLM):
    def mix(self, h):
        keep = (torch.arange(h.shape[1]) >= 2)[None, :, None]
        return torch.where(keep, torch.roll(h, 2, 1), 0.0)


class ShiftMaskedPast(MixerLM):
    """A shift whose rows from position 80 on are zeroed: a plain shift at every length up to 80 (the shift
    rewrite sampled 13, 29, 64 and dropped the mask until it also probed one past every number in the region)."""

    def mix(self, h):
        keep = (torch.arange(h.shape[1]) < 80)[None, :, None]
        return torch.where(keep, F.pad(h, (0, 0, 1, 0))[:, :-1], 0.0)


class ShiftMaskedPastFloat(MixerLM):
    """The same with a float threshold past FLOAT_LITERAL_LIMIT (fill values such as -1e4 are not thresholds;
    9000.0 compared with positions is)."""

    def mix(self, h):
        keep = (torch.arange(h.shape[1]).to(h.dtype) < 9000.0)[None, :, None]
        return torch.where(keep, F.pad(h, (0, 0, 1, 0))[:, :-1], 0.0)


class ShiftFuture(MixerLM):  # near miss: reads the next token
    def mix(self, h):
        return F.pad(h, (0, 0, 0, 1))[:, 1:]


class RollWrap(MixerLM):  # near miss: wrap-around roll
    def mix(self, h):
        return torch.roll(h, 1, 1)


class ConvPadded(MixerLM):
    """nn.Conv1d(padding=K-1), first T outputs (Mamba-style)."""

    def __init__(self, K=4, bias=True):
        super().__init__()
        self.conv = nn.Conv1d(C, C, K, padding=K - 1, groups=C, bias=bias)

    def mix(self, h):
        return self.conv(h.transpose(1, 2))[..., :h.shape[1]].transpose(1, 2)


class ConvLeftPad(MixerLM):
    """F.pad left by (K-1)*d, then a dilated depthwise conv without bias."""

    def __init__(self, K=3, dilation=2):
        super().__init__()
        self.K, self.d = K, dilation
        self.weight = nn.Parameter(torch.randn(C, 1, K) / K)

    def mix(self, h):
        x = F.pad(h.transpose(1, 2), ((self.K - 1) * self.d, 0))
        return F.conv1d(x, self.weight, dilation=self.d, groups=C).transpose(1, 2)


class ConvDense(MixerLM):  # near miss: not depthwise
    def __init__(self, K=3):
        super().__init__()
        self.conv = nn.Conv1d(C, C, K, padding=K - 1)

    def mix(self, h):
        return self.conv(h.transpose(1, 2))[..., :h.shape[1]].transpose(1, 2)


class ConvCentred(MixerLM):  # near miss: 'same' padding reads the future
    def __init__(self, K=3):
        super().__init__()
        self.conv = nn.Conv1d(C, C, K, padding=K // 2, groups=C)

    def mix(self, h):
        return self.conv(h.transpose(1, 2)).transpose(1, 2)


class Scans(MixerLM):
    """cumsum, cumprod and logcumsumexp along the sequence, and positions from a cumsum of ones."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(64, C)

    def mix(self, h):
        pos = torch.ones_like(h[..., 0], dtype=torch.long).cumsum(-1) - 1
        a = torch.cumsum(h, dim=1) / 4
        b = torch.cumprod(torch.sigmoid(h) + 0.5, dim=1)
        c = torch.logcumsumexp(h, dim=1)
        return a + b + c + self.pos(pos)


class CumsumFeatures(MixerLM):  # near miss: a cumsum over features mixes no tokens
    def mix(self, h):
        return torch.cumsum(h, dim=-1)


class HandAttention(MixerLM):
    """q @ k^T * scale, optional soft-capping (Gemma 2), triu mask by masked_fill(-inf), optional ALiBi, optional
    sliding window, optional attention sinks (a learned logit per head in the softmax, its probability dropped),
    softmax, @ v."""

    def __init__(self, heads=2, alibi=None, causal=True, window=None, softcap=None, sinks=False, hide_self=False,
                 row_max=False):
        super().__init__()
        self.H, self.alibi, self.causal, self.window, self.row_max = heads, alibi, causal, window, row_max
        self.softcap, self.hide_self = softcap, hide_self
        self.qkv = nn.Linear(C, 3 * C)
        self.register_buffer("slopes", torch.tensor([0.5 ** (i + 1) for i in range(heads)]), persistent=False)
        self.sinks = nn.Parameter(torch.randn(heads)) if sinks else None

    def mix(self, h):
        T, H, D = h.shape[1], self.H, C // self.H
        q, k, v = self.qkv(h).view(1, T, 3, H, D).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        if self.softcap:
            s = torch.tanh(s / self.softcap) * self.softcap
        pos = torch.arange(T)
        if self.alibi == "relative":  # slope * (k_pos - q_pos)
            s = s + self.slopes[:, None, None] * (pos[None, :] - pos[:, None])
        elif self.alibi == "key":  # slope * k_pos (BLOOM's form)
            s = s + self.slopes[:, None, None] * pos[None, None, :]
        elif self.alibi == "per_length":  # near miss: depends on the sequence length, not only positions
            s = s + self.slopes[:, None, None] * pos[None, None, :] / T
        if self.causal:
            s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        if self.window:  # keys less than `window` tokens back
            s = s.masked_fill(torch.tril(torch.ones(T, T, dtype=torch.bool), -self.window), float("-inf"))
        if self.hide_self:  # near miss: a query does not see itself (neither causal nor a window)
            s = s.masked_fill(torch.eye(T, dtype=torch.bool), float("-inf"))
        if self.sinks is not None:
            s = torch.cat([s, self.sinks.view(1, H, 1, 1).expand(1, H, T, 1)], -1)
            if self.row_max:  # gpt-oss: the row maximum subtracted before the softmax
                s = s - s.max(dim=-1, keepdim=True).values
            o = torch.softmax(s, -1)[..., :-1] @ v
        else:
            o = torch.softmax(s, -1) @ v
        return o.transpose(1, 2).reshape(1, T, C)


class AdditiveMaskAttention(MixerLM):
    """One head, additive -inf mask from tril, scale by multiplication."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)

    def mix(self, h):
        T = h.shape[1]
        q, k, v = self.qkv(h).split(C, -1)
        mask = torch.zeros(T, T).masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf"))
        return torch.softmax(q @ k.transpose(1, 2) * C ** -0.5 + mask, dim=-1) @ v


class AllMixers(HandAttention):
    """A shift, a causal conv, a scan and ALiBi attention in one model (saved-program test)."""

    def __init__(self):
        super().__init__(alibi="key")
        self.conv = nn.Conv1d(C, C, 4, padding=3, groups=C)

    def mix(self, h):
        h = h + F.pad(h, (0, 0, 2, 0))[:, :-2]
        h = self.conv(h.transpose(1, 2))[..., :h.shape[1]].transpose(1, 2) + torch.cumsum(h, 1) / 8
        return super().mix(h)
