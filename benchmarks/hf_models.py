"""Hugging Face transformers models in the benchmark harness (``ModelSpec`` kind ``"hf"``).

- :class:`HFConfig`: a transformers config by class name and keyword arguments, so that listing the
  harness's specs never imports transformers (it is imported when an ``hf`` model is built, with a
  clear error where it is missing).
- :func:`qwen3_30b_a3b_config`: the Qwen3-30B-A3B layer shape (HF ``Qwen3MoeForCausalLM``: 128 experts,
  top 8, expert width 768, 32 query / 4 KV heads of 128) with fewer layers; the single source for the
  harness's ``qwen3-30b-a3b-<N>l`` specs and ``benchmarks/gpu_checks.py --moe``.
- :func:`qwen3_5_35b_a3b_config`: the Qwen3.5-35B-A3B text layer shape (HF ``Qwen3_5MoeForCausalLM``: 3 GDN : 1
  gated attention, 256 experts top 8 + a shared expert) with fewer layers: the harness's MoE hybrid specs.
- :func:`build_hf`: ``AutoModelForCausalLM.from_config`` built on the device in the run's dtype, seeded,
  matrices, embeddings and expert stacks ~ N(0, 0.02); experts through HF's own loop (``"eager"``) on
  CPU (``grouped_mm`` refuses float64), HF's default (``grouped_mm``) elsewhere.
- :func:`causal_attention`: a context manager under which the model's attention layers call
  ``F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True, enable_gqa=True)`` (no mask
  built): what HF does itself outside tracing for one unpadded sequence, but under ``torch.compile``
  with torch < 2.14 HF builds an explicit bool causal mask and repeats K/V instead, which keeps the
  causal kernels (cuDNN, flash, FA4) off and would hand the packed baselines' SDPA replacements a
  mask they must not ignore.  The baselines run HF models under it; the tree compiles the stock model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["HFConfig", "QWEN3_30B_A3B_LAYER", "QWEN3_5_35B_A3B_LAYER", "build_hf", "causal_attention",
           "qwen3_30b_a3b_config", "qwen3_5_35b_a3b_config", "require_transformers"]

# Qwen3-30B-A3B's layer shape (config.json of Qwen/Qwen3-30B-A3B); the layer count is the spec's
QWEN3_30B_A3B_LAYER = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    max_position_embeddings=40960)

# Qwen3.5-35B-A3B's text layer shape (Qwen3_5MoeTextConfig's defaults in transformers 5.23); the layer count
# (and with it the 3 GDN : 1 attention layer types) is the spec's
QWEN3_5_35B_A3B_LAYER = dict(
    vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, rms_norm_eps=1e-6, tie_word_embeddings=False)

# Qwen3-0.6B's shape as DenseConfig.qwen3_0_6b() (tied embeddings), as an HF Qwen3Config
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=True, max_position_embeddings=40960)

_ATTENTION = "treecompile_bench_causal_sdpa"


def require_transformers():
    """The ``transformers`` module, or an ImportError that says what to install."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("the harness's 'hf' models need Hugging Face transformers >= 5 "
                          "(pip install 'transformers>=5')") from e
    return transformers


@dataclass(frozen=True)
class HFConfig:
    """A transformers config by name: ``config_class`` (e.g. ``"Qwen3MoeConfig"``) and its keyword
    arguments as sorted ``(name, value)`` pairs (hashable: specs are frozen)."""

    config_class: str
    kwargs: tuple

    @classmethod
    def of(cls, config_class: str, **kwargs) -> "HFConfig":
        return cls(config_class, tuple(sorted(kwargs.items())))

    def __getattr__(self, name):  # the harness reads vocab_size (and the like) before anything is built
        kw = dict(object.__getattribute__(self, "kwargs"))
        if name in kw:
            return kw[name]
        raise AttributeError(name)

    def build(self):
        return getattr(require_transformers(), self.config_class)(**dict(self.kwargs))


def qwen3_5_35b_a3b_config(num_layers: int = 8) -> HFConfig:
    """The Qwen3.5-35B-A3B text layer shape (HF ``Qwen3_5MoeForCausalLM``; the layer fields are
    ``Qwen3_5MoeTextConfig``'s defaults, spelled out here so that a transformers release changing its defaults
    does not change the benchmark; RoPE is the config's default, partial rotary 0.25) with ``num_layers``
    layers, every fourth full attention."""
    if num_layers < 1:
        raise ValueError(f"num_layers: expected >= 1, got {num_layers}")
    return HFConfig.of("Qwen3_5MoeTextConfig", num_hidden_layers=num_layers, full_attention_interval=4,
                       **QWEN3_5_35B_A3B_LAYER)


def qwen3_30b_a3b_config(num_layers: int = 4) -> HFConfig:
    """The Qwen3-30B-A3B layer shape with ``num_layers`` layers (every layer MoE)."""
    return HFConfig.of("Qwen3MoeConfig", num_hidden_layers=num_layers, **QWEN3_30B_A3B_LAYER)


def build_hf(config: HFConfig, device, dtype, *, std: float = 0.02) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config`` on ``device`` in ``dtype`` (seed 0), every parameter of two or
    more dimensions (matrices, embeddings, expert stacks ``[E, out, in]``) ~ N(0, ``std``), norms as built;
    eval mode is not set (dropout is 0 in these configs)."""
    transformers = require_transformers()
    device = torch.device(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config.build(), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    if device.type == "cpu" and hasattr(model, "set_experts_implementation") and _has_experts(model):
        model.set_experts_implementation("eager")  # grouped_mm refuses float64; HF's loop is its reference
    return model


def _has_experts(model) -> bool:
    return any(hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") for m in model.modules())


def _causal_sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF attention function: HF's own SDPA path with no mask (so ``is_causal=True``); refuses a layer
    that needs more than a causal mask (a sliding window, a non-causal layer) rather than drop it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise NotImplementedError("causal_attention: the model built a mask (expected none)")
    if getattr(module, "sliding_window", None) is not None or not getattr(module, "is_causal", True):
        raise NotImplementedError(f"causal_attention: {type(module).__name__} is not plain causal attention "
                                  f"(sliding_window={getattr(module, 'sliding_window', None)}, "
                                  f"is_causal={getattr(module, 'is_causal', True)})")
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


@contextlib.contextmanager
def causal_attention(model):
    """Within: ``model``'s attention layers run HF's SDPA path without building a mask (``is_causal=True``,
    GQA through ``enable_gqa``); the model's attention implementation is restored on exit."""
    require_transformers().AttentionInterface.register(_ATTENTION, _causal_sdpa)  # idempotent: a dict update
    subs = [getattr(model.config, k, None) for k in getattr(model.config, "sub_configs", {})]
    configs = [model.config] + [c for c in subs if c is not None]
    before = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = _ATTENTION
        yield
    finally:
        for c, b in zip(configs, before):
            c._attn_implementation = b
