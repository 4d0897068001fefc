"""Whether and where the Triton kernels of ``treecompile.ops`` run (one place for the import and the checks).

``triton`` / ``tl`` are the modules, or ``None`` on CPU-only installs (the kernels' modules define their
``@triton.jit`` functions only when ``triton`` is not ``None``).  Kernels run on CUDA tensors, or on any tensor
under Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before triton is imported): the tests run them there.
"""

from __future__ import annotations

import os

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = tl = None

__all__ = ["triton", "tl", "available", "interpreting", "usable"]


def available() -> bool:
    """Triton imports."""
    return triton is not None


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def usable(t: Tensor) -> bool:
    """Triton kernels can run on ``t``'s device: CUDA with Triton, or anywhere under Triton's CPU interpreter."""
    return triton is not None and (t.is_cuda or interpreting())
