"""treecompile: train LLMs on trajectory trees, computing every shared prefix once."""

from treecompile import reference
from treecompile.compile import TreeModel, TreeOutput, compile
from treecompile.saved import load, save
from treecompile.tree import NORMALIZATIONS, Tree, TreeBatch

__all__ = ["Tree", "TreeBatch", "NORMALIZATIONS", "compile", "TreeModel", "TreeOutput", "reference", "load", "save"]
__version__ = "0.1.0"
