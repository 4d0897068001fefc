"""Kernels the rewritten graphs call, each a registered ``torch.library`` op with a CPU reference.

Importing this package registers the ops (``treecompile::tree_attention``,
``treecompile::linear_logprobs``, ...), so that saved programs that name them load.
"""

from treecompile.ops.logprobs import linear_logprobs
from treecompile.ops.tree_attention import tree_attention, tree_attention_reference, tree_mask

__all__ = ["tree_attention", "tree_attention_reference", "tree_mask", "linear_logprobs"]
