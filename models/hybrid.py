"""A hybrid Gated DeltaNet / full-attention decoder (Qwen3.5 / Qwen3-Next shape), plain PyTorch.

No tree logic: this stands for the user's unmodified model.  Parameter names match Hugging Face
checkpoints of ``Qwen3_5ForCausalLM`` (``model_type="qwen3_5_text"``: ``linear_attn.in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``) and ``Qwen3NextForCausalLM`` (``model_type="qwen3_next"``:
``linear_attn.in_proj_qkvz``, ``in_proj_ba`` with Qwen3-Next's per-key-head interleaving), dense MLP
or MoE (``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_expert``,
``mlp.shared_expert_gate``, as HF writes them to safetensors).

Math (copied from transformers 5.x, computed in the model's dtype throughout; HF upcasts parts to
float32): GDN layer = projections -> depthwise causal conv1d (kernel 4) + SiLU over [q|k|v] ->
L2-normalised q, k -> ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` -> chunked
gated delta rule -> gated RMSNorm ``rms(o) * weight * silu(z)`` -> ``out_proj``.  Full attention =
q (with a per-head output gate) / k / v projections, zero-centred q/k RMSNorm (``1 + weight``),
partial RoPE (``partial_rotary_factor`` of the head dim, rotate-half), causal SDPA with GQA,
``o * sigmoid(gate)``, ``o_proj``.

Kernel hooks, swapped by treecompile's frontend during capture only: every
:class:`GatedDeltaNet` holds ``self.chunk_gated_delta_rule`` and ``self.causal_conv1d_fn`` (instance
attributes, defaulting to this module's :func:`torch_chunk_gated_delta_rule` and
:func:`causal_conv1d_fn`, with HF's signatures).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .dense import MLP, CausalLM

LAYOUTS = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


@dataclass(frozen=True)
class HybridConfig:
    model_type: str = "qwen3_5_text"  # GDN projection layout and checkpoint flavour (see LAYOUTS)
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] | None = None  # default: every 4th layer full attention
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # MoE (0 experts = dense MLP everywhere)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # router load-balancing loss (HF names): forward returns MoeOutput(logits, aux_loss, router_logits)
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    # router z-loss (ST-MoE): > 0 adds MoeOutput.z_loss (:func:`router_z_loss`); 0 leaves the output as it was
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        if self.model_type not in LAYOUTS:
            raise ValueError(f"model_type: expected one of {sorted(LAYOUTS)}, got {self.model_type!r}")
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", tuple(
                "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(self.num_hidden_layers)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types: expected {self.num_hidden_layers} entries, got {len(self.layer_types)}")
        for i, t in enumerate(self.layer_types):
            if t not in ("linear_attention", "full_attention"):
                raise ValueError(f"layer_types[{i}]: expected 'linear_attention' or 'full_attention', got {t!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_experts and self.model_type == "qwen3_5_text":
            raise ValueError("Qwen3_5ForCausalLM is dense: use model_type='qwen3_next' for an MoE MLP")

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @classmethod
    def tiny(cls, **kw) -> "HybridConfig":
        """4 layers (3 GDN + 1 attention), every width a few units: for float64 CPU tests."""
        base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                    linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
                    linear_num_value_heads=4)
        if kw.get("num_experts"):
            base.update(model_type="qwen3_next", num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=24)
        return cls(**{**base, **kw})

    @classmethod
    def qwen3_5_9b(cls) -> "HybridConfig":
        """transformers' default ``Qwen3_5TextConfig`` (documented there as Qwen3.5-9B style), every field equal."""
        return cls()

    @classmethod
    def qwen3_next_80b_a3b(cls) -> "HybridConfig":
        """transformers' default ``Qwen3NextConfig`` (Qwen3-Next-80B-A3B)."""
        return cls(model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                   num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, num_experts=512,
                   num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512)

    def to_hf_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta"),
                                "partial_rotary_factor": d.pop("partial_rotary_factor")}
        d.update(architectures=[LAYOUTS[self.model_type]], hidden_act="silu", attention_bias=False,
                 max_position_embeddings=32768)
        if self.model_type == "qwen3_5_text":
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                      "output_router_logits", "router_aux_loss_coef", "router_z_loss_coef"):
                d.pop(k)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "HybridConfig":
        mt = d.get("model_type")
        if mt not in LAYOUTS:
            raise ValueError(f"config.json: model_type {mt!r} is not a hybrid text model (expected one of "
                             f"{sorted(LAYOUTS)}; a Qwen3_5ForConditionalGeneration checkpoint needs its text part)")
        rope = dict(d.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_type {rope['rope_type']!r} is not supported (only 'default')")
        if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias", False):
            raise ValueError("config.json: only hidden_act='silu' and attention_bias=False are supported")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["rope_theta"] = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        kw["partial_rotary_factor"] = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
        kw.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        return cls(**kw)


# ----------------------------------------------------------------------------- kernels (swappable)
def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, **kwargs) -> torch.Tensor:
    """Depthwise causal conv1d. hidden_states [B, C, T], weight [C, K] -> [B, C, T] (HF's signature)."""
    T = hidden_states.shape[-1]
    out = F.conv1d(hidden_states.to(weight.dtype), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                   groups=hidden_states.shape[1])[..., :T]
    if activation is not None:
        out = F.silu(out)
    return out.to(hidden_states.dtype)


def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                                 output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                                 **kwargs):
    """Chunked gated delta rule with HF's signature: query/key [B, T, Hk, Dk], value [B, T, Hv, Dv],
    g/beta [B, T, Hv]; returns (o [B, T, Hv, Dv], final state [B, Hv, Dk, Dv] or None).
    Half-precision inputs are computed in float32 (as HF does); float32/float64 in their own dtype."""
    out_dtype = value.dtype
    ct = torch.float32 if value.dtype in (torch.float16, torch.bfloat16) else value.dtype
    query, key, value, g, beta = (x.to(ct) for x in (query, key, value, g, beta))
    B, T, Hk, Dk = key.shape
    Hv, Dv = value.shape[-2:]
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query), l2norm(key)
    if Hv != Hk:
        query = query.repeat_interleave(Hv // Hk, dim=2)
        key = key.repeat_interleave(Hv // Hk, dim=2)
    q, k, v = (x.transpose(1, 2) for x in (query * Dk ** -0.5, key, value))  # [B, H, T, D]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)
    C = chunk_size
    pad = (-T) % C
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    q, k, v = (x.reshape(B, Hv, n, C, -1) for x in (q, k, v))
    g, beta = g.reshape(B, Hv, n, C), beta.reshape(B, Hv, n, C)
    cum = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    A = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    unit = A + torch.eye(C, dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(unit, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(unit, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    S = (torch.zeros(B, Hv, Dk, Dv, dtype=v.dtype, device=v.device) if initial_state is None
         else initial_state.to(v.dtype))
    outs = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ S
        outs.append(q_dec[:, :, i] @ S + attn[:, :, i] @ v_new)
        S = S * cum[:, :, i, -1].exp()[..., None, None] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(B, Hv, n * C, Dv)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), (S if output_final_state else None)


# ----------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """Zero-centred RMSNorm of Qwen3.5 / Qwen3-Next: ``rms(x) * (1 + weight)``, weight init 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class RMSNormGated(nn.Module):
    """``rms(x) * weight * silu(gate)`` (weight init 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight * F.silu(gate)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rotary(x, cos, sin):
    """x [B, H, T, D]; cos/sin [T, R] with R <= D: rotate the first R dims, pass the rest."""
    R = cos.shape[-1]
    xr, xp = x[..., :R], x[..., R:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)


class Attention(nn.Module):
    """Full attention with a per-head sigmoid output gate (q_proj emits [query | gate] per head)."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.cfg = cfg
        H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, H * D * 2, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, KV * D, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, KV * D, bias=False)
        self.o_proj = nn.Linear(H * D, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        cfg = self.cfg
        q, gate = self.q_proj(x).view(B, T, cfg.num_attention_heads, 2 * cfg.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(B, T, -1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=cfg.num_key_value_heads != cfg.num_attention_heads)
        o = o.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate)
        return self.o_proj(o)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer.  Kernel hooks: ``self.causal_conv1d_fn``, ``self.chunk_gated_delta_rule``."""

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.cfg = cfg
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        K = cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, K, groups=self.conv_dim, bias=False, padding=K - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log())
        self.norm = RMSNormGated(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        if cfg.model_type == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        # the kernel hooks (see module docstring)
        self.causal_conv1d_fn = causal_conv1d_fn
        self.chunk_gated_delta_rule = torch_chunk_gated_delta_rule

    def _project(self, x):
        """-> mixed_qkv [B, T, conv_dim], z [B, T, Hv, Dv], b, a [B, T, Hv]."""
        B, T, _ = x.shape
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if self.cfg.model_type == "qwen3_next":  # per key head: [q | k | v (r heads) | z (r heads)]
            r = Hv // Hk
            qkvz = self.in_proj_qkvz(x).view(B, T, Hk, 2 * Dk + 2 * r * Dv)
            q, k, v, z = torch.split(qkvz, [Dk, Dk, r * Dv, r * Dv], dim=3)
            b, a = torch.split(self.in_proj_ba(x).view(B, T, Hk, 2 * r), [r, r], dim=3)
            mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
            return mixed, z.reshape(B, T, Hv, Dv), b.reshape(B, T, Hv), a.reshape(B, T, Hv)
        z = self.in_proj_z(x).reshape(B, T, Hv, Dv)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)

    def forward(self, x):
        B, T, _ = x.shape
        mixed, z, b, a = self._project(x)
        mixed = self.causal_conv1d_fn(mixed.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                      activation="silu").transpose(1, 2)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.exp() * F.softplus(a + self.dt_bias)
        o, _ = self.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                           use_qk_l2norm_in_kernel=True)
        o = self.norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(o.reshape(B, T, -1))


class SparseMoeBlock(nn.Module):
    """Top-k softmax router over experts plus a sigmoid-gated shared expert (Qwen3-Next).

    The routed sum is computed densely (every expert on every token, weighted by the router's top-k
    weights scattered into ``[tokens, experts]``, zeros elsewhere): equal to the sparse dispatch,
    with no data-dependent shapes, so it exports with a dynamic length.  Costs ``num_experts`` times
    the routed FLOPs: a reference, not a fast MoE.
    """

    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x, router_logits: list | None = None):
        """``router_logits``: a list that receives this layer's ``[B * T, E]`` router logits."""
        logits = self.gate(x)
        if router_logits is not None:
            router_logits.append(logits.reshape(-1, logits.shape[-1]))
        probs = torch.softmax(logits, dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        dense_w = torch.zeros_like(probs).scatter(-1, top_i, top_w)
        routed = sum(dense_w[..., e, None] * expert(x) for e, expert in enumerate(self.experts))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, i: int):
        super().__init__()
        self.layer_type = cfg.layer_types[i]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, router_logits: list | None = None):
        h = self.input_layernorm(x)
        h = self.linear_attn(h) if self.layer_type == "linear_attention" else self.self_attn(h, cos, sin)
        x = x + h
        h = self.post_attention_layernorm(x)
        if router_logits is not None and isinstance(self.mlp, SparseMoeBlock):
            return x + self.mlp(h, router_logits)
        return x + self.mlp(h)


class HybridModel(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class MoeOutput:
    """``HybridForCausalLM`` output with ``output_router_logits``: ``logits [B, T, V]``, the router
    load-balancing loss (:func:`load_balancing_loss`), each MoE layer's ``[B * T, E]`` router logits, and
    the router z-loss (:func:`router_z_loss`) when ``router_z_loss_coef > 0`` (else None: no output).
    The training loss of a user is ``lm + router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss``."""

    logits: torch.Tensor
    aux_loss: torch.Tensor
    router_logits: tuple[torch.Tensor, ...]
    z_loss: torch.Tensor | None = None


torch.utils._pytree.register_dataclass(MoeOutput)  # torch.export flattens it field by field


def load_balancing_loss(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style load balancing as HF's ``load_balancing_loss_func`` (no attention mask), in the
    logits' dtype: ``E * sum_e f_e P_e`` over all layers' rows, ``f_e`` the fraction of top-k slots routed
    to ``e`` and ``P_e`` the mean router probability."""
    probs = [torch.softmax(r, dim=-1) for r in router_logits]
    rows = sum(p.shape[0] for p in probs)
    f = sum(F.one_hot(torch.topk(p, top_k, dim=-1).indices, num_experts).sum((0, 1)).to(p.dtype) for p in probs) / rows
    P = sum(p.sum(0) for p in probs) / rows
    return num_experts * (f * P).sum()


def router_z_loss(router_logits) -> torch.Tensor:
    """ST-MoE router z-loss: the mean over all layers' rows of ``logsumexp(router_logits)^2``."""
    rows = sum(r.shape[0] for r in router_logits)
    return sum((torch.logsumexp(r, dim=-1) ** 2).sum() for r in router_logits) / rows


class HybridForCausalLM(CausalLM):
    """``forward(input_ids [B, T]) -> logits [B, T, V]``, or a :class:`MoeOutput` when the config
    says ``output_router_logits`` (MoE layers only)."""

    config_class = HybridConfig

    def __init__(self, cfg: HybridConfig):
        super().__init__(cfg, HybridModel(cfg))

    def forward(self, input_ids: torch.Tensor):
        cfg = self.config
        if not (cfg.output_router_logits and cfg.num_experts):
            return super().forward(input_ids)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(input_ids.shape[1], x.device, x.dtype)
        router_logits: list[torch.Tensor] = []
        for layer in self.model.layers:
            x = layer(x, cos, sin, router_logits)
        logits = self.lm_head(self.model.norm(x))
        aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok)
        z = router_z_loss(router_logits) if cfg.router_z_loss_coef > 0 else None
        return MoeOutput(logits=logits, aux_loss=aux, router_logits=tuple(router_logits), z_loss=z)

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates the first ``head_dim * partial_rotary_factor`` dims (even)."""
        return int(self.config.head_dim * self.config.partial_rotary_factor)
