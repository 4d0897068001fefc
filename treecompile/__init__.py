"""treecompile: train LLMs on trajectory trees, computing every shared prefix once."""

from treecompile import reference
from treecompile.compile import TreeModel, TreeOutput, compile
from treecompile.tree import NORMALIZATIONS, Tree, TreeBatch

__all__ = ["Tree", "TreeBatch", "NORMALIZATIONS", "compile", "TreeModel", "TreeOutput", "reference"]
__version__ = "0.1.0"
