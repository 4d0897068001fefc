"""treecompile: train LLMs on trajectory trees, computing every shared prefix once."""

from treecompile.tree import NORMALIZATIONS, Tree, TreeBatch

__all__ = ["Tree", "TreeBatch", "NORMALIZATIONS"]
__version__ = "0.1.0"
