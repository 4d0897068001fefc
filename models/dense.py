"""A dense decoder of the Llama / Qwen3 family, plain PyTorch, no tree logic.

RoPE positions come from ``torch.arange`` inside ``forward``; attention is causal SDPA with native
GQA; RMSNorm, optional q/k norm (Qwen3), SwiGLU MLP, optional tied embeddings.  Parameter names
match Hugging Face checkpoints (``model.layers.0.self_attn.q_proj.weight``, ...).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import hf_io


@dataclass(frozen=True)
class DenseConfig:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    qk_norm: bool = True
    tie_word_embeddings: bool = True

    @classmethod
    def tiny(cls, **kw) -> "DenseConfig":
        base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                    tie_word_embeddings=False)
        return cls(**{**base, **kw})

    @classmethod
    def qwen3_0_6b(cls) -> "DenseConfig":
        return cls()

    @classmethod
    def qwen3_1_7b(cls) -> "DenseConfig":
        return cls(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                   num_attention_heads=16, num_key_value_heads=8)

    @classmethod
    def qwen3_4b(cls) -> "DenseConfig":
        return cls(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8)

    @classmethod
    def qwen3_8b(cls) -> "DenseConfig":
        return cls(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        qk = d.pop("qk_norm")
        d.update(model_type="qwen3" if qk else "llama",
                 architectures=["Qwen3ForCausalLM" if qk else "LlamaForCausalLM"],
                 hidden_act="silu", attention_bias=False, max_position_embeddings=40960)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DenseConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        kw["qk_norm"] = d.get("model_type", "qwen3") == "qwen3"
        return cls(**kw)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [T, D] (halves repeated, rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DenseConfig):
        super().__init__()
        self.cfg = cfg
        H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, H * D, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, KV * D, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, KV * D, bias=False)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.num_attention_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=cfg.num_key_value_heads != cfg.num_attention_heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DenseConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DenseModel(nn.Module):
    def __init__(self, cfg: DenseConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def rope_cos_sin(T: int, rotary_dim: int, theta: float, device, dtype):
    """cos/sin ``[T, rotary_dim]`` for positions ``arange(T)`` (angles in float64, halves repeated)."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float64) / rotary_dim))
    pos = torch.arange(T, device=device)
    ang = pos[:, None].to(torch.float64) * inv[None, :]
    ang = torch.cat((ang, ang), dim=-1)
    return ang.cos().to(dtype), ang.sin().to(dtype)


class CausalLM(nn.Module):
    """Shared top of the reference models: embed -> layers(x, cos, sin) -> norm -> lm_head, and
    HF-format checkpoints.  Subclasses set ``config_class``, pass the config and the body
    (``embed_tokens``, ``layers``, ``norm``) to ``__init__`` (which adds ``lm_head``, tied when the
    config says so), and say how many head dims RoPE rotates."""

    config_class: type

    def __init__(self, cfg, body: nn.Module):
        super().__init__()
        self.config = cfg
        self.model = body
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def rotary_dim(self) -> int:
        return self.config.head_dim

    def rope(self, T: int, device, dtype):
        return rope_cos_sin(T, self.rotary_dim, self.config.rope_theta, device, dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(input_ids.shape[1], x.device, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        hf_io.save_checkpoint(self, self.config.to_hf_dict(), directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, dtype=None):
        cfg = cls.config_class.from_hf_dict(hf_io.read_config(directory))
        model = cls(cfg)
        hf_io.load_state(model, directory, tied=cfg.tie_word_embeddings)
        return model.to(dtype) if dtype is not None else model


class DenseForCausalLM(CausalLM):
    """``forward(input_ids [B, T]) -> logits [B, T, V]``."""

    config_class = DenseConfig

    def __init__(self, cfg: DenseConfig):
        super().__init__(cfg, DenseModel(cfg))
