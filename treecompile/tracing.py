"""How treecompile runs ``torch.export``: the settings shared by capture and the saved program's re-export.

:func:`export_settings` (used by ``frontend.capture`` and ``saved._reexport``) turns FakeTensor's dispatch
cache off for the export.  The cache memoises a fake kernel's output per op and input metadata; with a
symbolic sequence length, building an entry and rebuilding a tensor from it costs more than running the
tiny fake kernels again.  Measured on torch 2.13 CPU, one thread, warm process (``treecompile.compile``,
capture and passes): the tiny dense model 1.6 s -> 1.1 s, HF Qwen3-Next MoE (tiny) 4.7 s -> 3.9 s.  The
graph is the same (tests/test_tracing.py).
The FakeTensorMode made during the export keeps the setting, so the passes that propagate fake
tensors through the captured graph run without the cache too.
"""

from __future__ import annotations

import contextlib

__all__ = ["export_settings"]


@contextlib.contextmanager
def export_settings():
    """Within this block, ``torch.export.export`` traces without FakeTensor's dispatch cache (restored after)."""
    import torch._dynamo.config

    with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):
        yield
