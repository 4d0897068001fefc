"""Reference models in plain PyTorch with no tree logic: they stand for the user's unmodified code.

Nothing here imports treecompile.
"""

from .dense import DenseConfig, DenseForCausalLM
from .hybrid import HybridConfig, HybridForCausalLM

__all__ = ["DenseConfig", "DenseForCausalLM", "HybridConfig", "HybridForCausalLM"]
