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
  built; a sliding layer calls :func:`windowed_sdpa`, which hands its window to an SDPA replacement that takes
  one, else applies a window mask): what HF does itself outside tracing for one unpadded sequence, but under
  ``torch.compile`` with torch < 2.14 HF builds an explicit bool causal mask and repeats K/V instead, which keeps the
  causal kernels (cuDNN, flash, FA4) off and would hand the packed baselines' SDPA replacements a
  mask they must not ignore.  The baselines run HF models under it; the tree compiles the stock model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["HFConfig", "QWEN3_30B_A3B_LAYER", "QWEN3_5_35B_A3B_LAYER", "attention_window", "build_hf",
           "causal_attention", "model_windows", "qwen3_30b_a3b_config", "qwen3_5_35b_a3b_config",
           "require_transformers", "window_mask", "windowed_sdpa"]

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

# the same shape as an HF MistralConfig (Mistral has no q/k norms; the rest is Qwen3-0.6B's)
MISTRAL_0_6B = {k: v for k, v in QWEN3_0_6B.items() if k != "rope_theta"}

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

    def build(self):  # tuples (hashable here) are lists to transformers' configs (layer_types)
        kw = {k: list(v) if isinstance(v, tuple) else v for k, v in self.kwargs}
        return getattr(require_transformers(), self.config_class)(**kw)


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


# keyword arguments of HF's attention interface that change the scores: refused by the baselines' attention
# rather than dropped (HF's sdpa_attention_forward ignores some of them)
_SCORE_CHANGING = ("softcap", "s_aux", "sinks", "position_bias")


def attention_window(module, sliding_window=None) -> int | None:
    """The sliding window of an HF attention call (``sliding_window`` as the layer passes it to the attention
    interface, else the module's attribute), or None for full causal attention.  HF's convention: query ``q``
    sees key ``k`` iff ``0 <= q - k < window``."""
    w = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise ValueError(f"{type(module).__name__}: sliding_window must be a positive int, got {w!r}")
    return w


def window_mask(n: int, window: int, device) -> torch.Tensor:
    """``[n, n]`` bool: query ``q`` sees key ``k`` iff ``0 <= q - k < window``."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


def windowed_sdpa(query, key, value, window: int, scale):
    """Causal attention within ``window`` (``[B, H, T, D]``, GQA through ``enable_gqa``): the SDPA in force when it
    takes a window itself (its ``takes_window`` attribute: the FA4 baselines' replacements, whose kernels skip the
    tiles outside it), else SDPA under an explicit window mask (what HF's own SDPA path builds)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if getattr(sdpa, "takes_window", False):
        return sdpa(query, key, value, is_causal=True, scale=scale, enable_gqa=True, window=window)
    return sdpa(query, key, value, attn_mask=window_mask(query.shape[2], window, query.device), scale=scale,
                enable_gqa=True)


def _causal_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                 **kwargs):
    """HF attention function: HF's own SDPA path with no mask (so ``is_causal=True``), or, for a sliding layer,
    :func:`windowed_sdpa`; refuses what it would otherwise drop (a mask, a non-causal layer, dropout in a
    windowed layer, keyword arguments that change the scores: softcapping, sinks, position biases)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise NotImplementedError("causal_attention: the model built a mask (expected none)")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise NotImplementedError(f"causal_attention: {type(module).__name__} is not causal attention")
    changing = sorted(k for k in _SCORE_CHANGING if kwargs.get(k) is not None)
    if changing:
        raise NotImplementedError(f"causal_attention: {type(module).__name__} passes {changing} to its attention: "
                                  "the baselines run plain (windowed) causal attention only")
    window = attention_window(module, sliding_window)
    if window is None:
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise NotImplementedError(f"causal_attention: dropout {dropout} in a windowed layer")
    return windowed_sdpa(query, key, value, window, scaling).transpose(1, 2).contiguous(), None


def model_windows(model) -> list[int | None]:
    """Each attention layer's sliding window (None: full causal) from ``model.config``: ``layer_types``
    (``"sliding_attention"`` takes ``config.sliding_window``), else every layer windowed when the config sets a
    ``sliding_window`` (and does not turn it off with ``use_sliding_window``); GDN layers are left out.  Other
    layer types are refused by name."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None)
    w = getattr(cfg, "sliding_window", None)
    if types is None:
        on = w is not None and getattr(cfg, "use_sliding_window", True)
        return [w if on else None] * cfg.num_hidden_layers
    out = []
    for i, t in enumerate(types):
        if t == "full_attention":
            out.append(None)
        elif t == "sliding_attention":
            if w is None:
                raise ValueError(f"layer {i} is sliding_attention but the config sets no sliding_window")
            out.append(w)
        elif t != "linear_attention":
            raise NotImplementedError(f"layer {i}: layer type {t!r} (only full, sliding and linear attention)")
    return out


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
