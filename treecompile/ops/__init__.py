"""Kernels the rewritten graphs call, each a registered ``torch.library`` op with a CPU reference.

Importing this package registers every op (``treecompile::tree_attention``, ``::linear_logprobs``,
``::gather_logprobs``, ``::tree_gated_delta_rule``, ``::tree_causal_conv1d``, ``::tree_shift``, ``::tree_scan``,
``::tree_ancestors``, ``::tree_attention_biased``, ``::moe_experts`` and
the partition-boundary variants), so that saved programs that name them load.  The CUDA attention
path (``flex_tree_attention``) is imported only where it is used.
"""

from treecompile.ops import moe, tree_attention_past, tree_conv, tree_gdn, tree_mixers, tree_recurrent_past  # noqa: F401
from treecompile.ops.logprobs import gather_logprobs, linear_logprobs
from treecompile.ops.tree_attention import tree_attention, tree_attention_reference, tree_mask

__all__ = ["tree_attention", "tree_attention_reference", "tree_mask", "linear_logprobs", "gather_logprobs"]
