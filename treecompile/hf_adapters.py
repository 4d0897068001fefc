"""Capture adapters: drop-ins for Hugging Face kernel functions that call treecompile's tree ops.

``frontend.kernel_swaps`` swaps them in for the duration of a capture only, so that each Gated
DeltaNet layer becomes one ``treecompile::tree_gated_delta_rule`` node and each short convolution
one ``treecompile::tree_causal_conv1d`` node with a dynamic length; the passes then re-point their
node/context inputs at the batch's (``passes.route_gdn_states``).  They run one plain sequence per
batch row ("a tree of root nodes"): outside a capture they compute what HF's functions compute.
"""

from __future__ import annotations

from torch import Tensor

from treecompile.ops.tree_conv import chain_conv_index, tree_causal_conv1d
from treecompile.ops.tree_gdn import sequence_nodes, tree_gated_delta_rule

__all__ = ["hf_chunk_gated_delta_rule", "hf_causal_conv1d_fn"]


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
