"""Graph passes that rewrite a captured causal LM for tree batches; see pipeline.py for the order."""

from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError
from treecompile.passes.pipeline import PASSES, PassError, run_passes

__all__ = ["PASSES", "PassContext", "PassError", "PassResult", "UnsupportedModelError", "run_passes"]
