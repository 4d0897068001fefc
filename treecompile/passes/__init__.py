"""Graph passes that rewrite a captured causal LM for tree batches; see pipeline.py for the order."""

from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError
from treecompile.passes.pipeline import PASSES, PassError, UnverifiedGraphWarning, run_passes
from treecompile.passes.verify_token_locality import TokenMixingSite

__all__ = ["PASSES", "PassContext", "PassError", "PassResult", "TokenMixingSite", "UnsupportedModelError",
           "UnverifiedGraphWarning", "run_passes"]
