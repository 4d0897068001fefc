"""``treecompile::materialize``: a value computed once into a buffer of its own, opaque to inductor.

``lower_cuda`` puts it where a value that depends only on the tree's positions (RoPE's ``cos``/``sin``
tables, computed from ``position_ids`` and constants) meets the rest of the graph.  Without it inductor
inlines the whole position computation (``pow``, ``sin``/``cos``, in float64 where the model asks for it)
into every consumer, once per element of each layer's ``[T, H, D]`` query/key in forward and again in
backward (measured: ~110 ms of a 557 ms Qwen3-0.6B tree step at 32k tokens on an H100).  An opaque op's
output is a buffer: computed once per step, read by every layer.  Its value is ``x`` (a copy); its
gradient is the incoming gradient.
"""

from __future__ import annotations

import torch

__all__ = ["materialize"]


@torch.library.custom_op("treecompile::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@materialize.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad


materialize.register_autograd(_backward)
