"""A value built from one batch's tensors, kept while the same tensors come back (host-side plans).

Every layer of a step gets the same tree tensors, so a plan built on the host from them is built once per
batch, not once per layer: the fla GDN call plan (``fla_gdn``), the conv segments (``fla_conv``, ``tree_conv_shifts``)
and the varlen attention's segment walk and plan (``varlen_tree_attention``) each keep one.

The plans read the tree tensors through :func:`treecompile.host_values.host_copy` (no device copy for a
batch's own tensors) and reach the device through :func:`treecompile.host_values.to_device_async`.  They are
built :func:`treecompile.host_values.single_threaded` up to its size bound (small CPU kernels: waking torch's
intra-op threads for them costs more than their work).
"""

from __future__ import annotations

import torch
from torch import Tensor

from treecompile.host_values import single_threaded

__all__ = ["LastBatch", "current_stream", "device_stream"]


class LastBatch:
    """A value built from one batch's tensors, kept while the same tensor objects come back unchanged.

    Keyed on the tensors' identity (the entry holds them, so their ids cannot pass
    to other tensors), their version counters (an in-place change rebuilds), a ``key``, and for CUDA tensors the
    current stream: a value's device tables are written on the stream current when it is built (a batch prepared
    ahead on a side stream), and a call on another stream builds its own rather than read them unordered."""

    def __init__(self):
        self._entry: tuple = ()

    def get(self, tensors: tuple[Tensor, ...], key, build):
        versions = tuple(t._version for t in tensors)
        stream = current_stream(tensors)
        e = self._entry
        if (e and len(e[0]) == len(tensors) and all(a is b for a, b in zip(e[0], tensors))
                and e[1] == versions and e[2] == key and e[4] == stream):
            return e[3]
        with single_threaded(max((t.numel() for t in tensors), default=0)):
            value = build()
        self._entry = (tuple(tensors), versions, key, value, stream)
        return value

    def clear(self) -> None:
        self._entry = ()


def current_stream(tensors) -> tuple | None:
    """:func:`device_stream` of the first CUDA tensor's device, None when none is on CUDA."""
    return next((device_stream(t.device) for t in tensors if t.is_cuda), None)


def device_stream(device: torch.device) -> tuple | None:
    """The current stream of a CUDA ``device`` (its id triple: cheaper than a Stream object), None off CUDA."""
    return torch._C._cuda_getCurrentStream(device.index) if device.type == "cuda" else None
