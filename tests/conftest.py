import os

import pytest
import torch
from hypothesis import settings

# Tiny float64 models: one thread avoids oversubscription on small CI machines.
torch.set_num_threads(1)

# CI runs the same hypothesis examples every time (a failure there reproduces locally with CI=1);
# local runs keep exploring new examples.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device"))]


@pytest.fixture(scope="module")
def model():
    """The tiny dense reference model in float64 (one per test module: its own copy, pristine weights)."""
    from helpers import cached_model, tiny_dense

    return cached_model("dense-tiny", tiny_dense)


@pytest.fixture(scope="module")
def tmodel(model):
    """``treecompile.compile(model)``; captured once per process (``helpers.cached_compile``)."""
    from helpers import cached_compile

    return cached_compile(model)
