"""treecompile: train LLMs on trajectory trees, computing every shared prefix once.

The public names below are imported on first use, so that ``import treecompile.cli`` (the
``treecompile`` command, ``--help`` included) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Tree": "treecompile.tree", "TreeBatch": "treecompile.tree", "NORMALIZATIONS": "treecompile.tree",
    "compile": "treecompile.compile", "TreeModel": "treecompile.compile", "TreeOutput": "treecompile.compile",
    "load": "treecompile.saved", "save": "treecompile.saved",
}
_SUBMODULES = ("reference",)
__all__ = ["Tree", "TreeBatch", "NORMALIZATIONS", "compile", "TreeModel", "TreeOutput", "reference", "load", "save"]

if TYPE_CHECKING:  # for readers and type checkers: the names as if imported eagerly
    from treecompile import reference
    from treecompile.compile import TreeModel, TreeOutput, compile
    from treecompile.saved import load, save
    from treecompile.tree import NORMALIZATIONS, Tree, TreeBatch


class _Package(types.ModuleType):
    def __getattr__(self, name: str):
        if name in _EXPORTS:
            value = getattr(importlib.import_module(_EXPORTS[name]), name)
        elif name in _SUBMODULES:
            value = importlib.import_module(f"{__name__}.{name}")
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        types.ModuleType.__setattr__(self, name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # importing the submodule treecompile.compile binds it on the package as `compile`; the public
        # `treecompile.compile` is the function, so that binding is skipped (__getattr__ gives the function)
        if name == "compile" and isinstance(value, types.ModuleType):
            return
        types.ModuleType.__setattr__(self, name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(__all__))


sys.modules[__name__].__class__ = _Package
