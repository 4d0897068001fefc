"""Capture adapters: drop-ins for Hugging Face kernel functions that call treecompile's tree ops.

``frontend.kernel_swaps`` swaps them in for the duration of a capture only, so that each Gated
DeltaNet layer becomes one ``treecompile::tree_gated_delta_rule`` node and each short convolution
one ``treecompile::tree_causal_conv1d`` node with a dynamic length; the passes then re-point their
node/context inputs at the batch's (``passes.route_gdn_states``).  HF experts modules get their
instance ``forward`` swapped for :func:`hf_experts_forward` (one ``treecompile::moe_experts`` node per
MoE layer) where :func:`hf_experts_supported` says it computes them exactly, else for
:func:`hf_experts_module_forward` (one ``treecompile::experts_module`` node running the module's own eager
forward).  They run one plain sequence per batch row ("a tree of root nodes"): outside a capture they compute
what HF's functions compute.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from treecompile.ops.experts_module import eager_forward, experts_module, register_experts_module
from treecompile.ops.moe import moe_experts
from treecompile.ops.tree_conv import chain_conv_index, tree_causal_conv1d
from treecompile.ops.tree_gdn import sequence_nodes, tree_gated_delta_rule

__all__ = ["hf_chunk_gated_delta_rule", "hf_causal_conv1d_fn", "hf_experts_forward", "hf_experts_module_forward",
           "hf_experts_supported"]


def hf_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = 64, initial_state=None,
                              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                              cu_seqlens=None, **kwargs):
    """Drop-in for HF's ``torch_chunk_gated_delta_rule`` (same signature and ``(o, state)`` return):
    each batch row is one root node of the tree op.  Training capture only: ``output_final_state``,
    ``cu_seqlens`` and a batched ``initial_state`` are refused."""
    if output_final_state:
        raise ValueError("hf_chunk_gated_delta_rule: output_final_state=True is not supported (capture with "
                         "use_cache=False)")
    if cu_seqlens is not None:
        raise ValueError("hf_chunk_gated_delta_rule: cu_seqlens (packed sequences) is not supported")
    B, T = query.shape[:2]
    if initial_state is not None and initial_state.shape[0] != 1:
        raise ValueError(f"hf_chunk_gated_delta_rule: initial_state must have batch 1, got {tuple(initial_state.shape)}")
    nodes = sequence_nodes(B, T, device=query.device)
    flat = [x.reshape((1, B * T) + tuple(x.shape[2:])) for x in (query, key, value, g, beta)]
    o = tree_gated_delta_rule(*flat, *nodes, None if initial_state is None else initial_state[0],
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
    return o.reshape(value.shape), None


def hf_causal_conv1d_fn(hidden_states: Tensor, weight: Tensor, bias: Tensor | None = None,
                        activation: str | None = None, **kwargs) -> Tensor:
    """Drop-in for HF's ``causal_conv1d_fn`` (same signature): the tree op on a plain sequence, so
    that the conv pass only re-points ``conv_index`` at the batch's.  ``seq_idx`` (packed sequences)
    is refused."""
    if kwargs.get("seq_idx") is not None:
        raise ValueError("hf_causal_conv1d_fn: seq_idx (packed sequences) is not supported")
    T = hidden_states.shape[-1]
    return tree_causal_conv1d(hidden_states, weight, bias, chain_conv_index(T, weight.shape[1],
                                                                            hidden_states.device), activation)


def hf_experts_supported(module: torch.nn.Module) -> str | None:
    """None if ``module`` is an HF experts module :func:`hf_experts_forward` computes exactly, else why not.

    Supported: the layout of ``use_experts_implementation``'s defaults (concatenated ``[gate; up]``,
    optionally transposed weights), SiLU gate, default ``_apply_gate``, no biases, no post-expert norm,
    not expert-parallel.
    """
    from transformers.activations import SiLUActivation  # only reached for HF modules
    from transformers.integrations.moe import _default_apply_gate

    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == down.dim() == 3):
        return "no 3-D gate_up_proj / down_proj"
    checks = {"has_gate": True, "has_bias": False, "is_concatenated": True, "has_post_expert_norm": False,
              "_is_expert_parallel": False}
    for name, want in checks.items():
        if getattr(module, name, want) != want:
            return f"{name}={getattr(module, name)!r} (supported: {want!r})"
    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return "a custom _apply_gate"
    act = getattr(module, "act_fn", None)
    if not isinstance(act, (torch.nn.SiLU, SiLUActivation)):
        return f"activation {type(act).__name__} (supported: SiLU)"
    return None


def hf_experts_module_forward(module: torch.nn.Module, *args, **kwargs) -> Tensor:
    """An HF experts module :func:`hf_experts_supported` refuses, as one ``treecompile::experts_module`` call that
    runs the module's own eager forward (``ops.experts_module``).  Takes the arguments as that forward does
    (``hidden_states, top_k_index, top_k_weights`` or the module's own names, by position or keyword)."""
    bound = inspect.signature(eager_forward(module)).bind(module, *args, **kwargs)
    values = list(bound.arguments.values())[1:]
    if len(values) != 3 or not all(isinstance(v, Tensor) for v in values):
        raise ValueError(f"{type(module).__name__}: expected the experts call (hidden_states, top_k_index, "
                         f"top_k_weights), got {len(values)} argument(s)")
    key = register_experts_module(module)
    return experts_module(key, *values, list(module.parameters()))


def hf_experts_forward(module: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                       top_k_weights: Tensor) -> Tensor:
    """HF experts ``forward(hidden_states [T, D], top_k_index [T, k], top_k_weights [T, k])`` as one op."""
    gu, down = module.gate_up_proj, module.down_proj
    if getattr(module, "is_transposed", False):  # stored [E, D, 2I] / [E, I, D]
        gu, down = gu.transpose(1, 2), down.transpose(1, 2)
    out = moe_experts(hidden_states, top_k_index, top_k_weights.to(hidden_states.dtype), gu, down)
    return out.to(hidden_states.dtype)
