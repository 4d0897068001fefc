"""Kernels the rewritten graphs call, each a registered ``torch.library`` op with a CPU reference.

Importing this package registers every op (``treecompile::tree_attention``, ``::tree_attention_windowed``,
``::linear_logprobs``,
``::gather_logprobs``, ``::tree_gated_delta_rule``, ``::tree_causal_conv1d``, ``::moe_experts``,
``::experts_module`` (an HF experts module run as one opaque call), the
sequence mixers ``::tree_shift``, ``::tree_scan``, ``::tree_ancestors``, ``::tree_attention_biased`` and
the partition-boundary variants ``::tree_attention_boundary``, ``::tree_gated_delta_rule_boundary``,
``::tree_causal_conv1d_boundary``), so that saved programs that name them load; also
``::moe_experts_grouped``, the routed experts as ``lower_cuda`` runs them on Hopper, and ``::materialize``,
where ``lower_cuda`` has inductor compute a position-only value (RoPE's tables) once, and
``::tree_attention_varlen_fwd`` / ``_bwd``, tree attention as FA4 varlen over the tree's segments, or per
batch FA4's block-sparse kernels where the segments would gather too much (``attention_kernel="fa4_varlen"``,
and what ``"auto"`` takes where FA4 runs), and ``::tree_attention_boundary_varlen_fwd`` / ``_bwd``, a
redundancy-free partition's boundary attention on the same kernel.  The CUDA attention paths (``flex_tree_attention``,
``flex_tree_attention_boundary``) are imported only where they are used.
"""

from treecompile.ops import (  # noqa: F401
    experts_module, materialize, moe, moe_grouped, tree_attention_boundary, tree_conv, tree_conv_boundary, tree_gdn,
    tree_gdn_boundary, tree_mixers, varlen_boundary_attention, varlen_tree_attention)
from treecompile.ops.logprobs import gather_logprobs, linear_logprobs
from treecompile.ops.tree_attention import tree_attention, tree_attention_reference, tree_mask

__all__ = ["tree_attention", "tree_attention_reference", "tree_mask", "linear_logprobs", "gather_logprobs"]
