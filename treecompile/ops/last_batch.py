"""A value built from one batch's tensors, kept while the same tensors come back (host-side plans), and
:func:`to_device_async`, how those plans reach the device.

Every layer of a step gets the same tree tensors, so a plan built on the host from them (one host sync) is
built once per batch, not once per layer: the fla GDN call plan (``fla_gdn``), the conv segments
(``fla_conv``) and the varlen attention's segment walk and plan (``varlen_tree_attention``) each keep one.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["LastBatch", "to_device_async"]


def to_device_async(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without blocking the host (through pinned memory when it is CUDA).

    A plain ``.to("cuda")`` of pageable memory (or ``torch.tensor(list, device="cuda")``) synchronises the
    stream: the host waits until the GPU has run everything queued before it.  The plans are made inside the
    graph (at the first layer that needs one), where that wait would drain the GPU's queue."""
    device = torch.device(device)
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


class LastBatch:
    """A value built from one batch's tensors, kept while the same tensor objects come back unchanged.

    Keyed on the tensors' identity (the entry holds them, so their ids cannot pass
    to other tensors), their version counters (an in-place change rebuilds) and a ``key``."""

    def __init__(self):
        self._entry: tuple = ()

    def get(self, tensors: tuple[Tensor, ...], key, build):
        versions = tuple(t._version for t in tensors)
        e = self._entry
        if (e and len(e[0]) == len(tensors) and all(a is b for a, b in zip(e[0], tensors))
                and e[1] == versions and e[2] == key):
            return e[3]
        value = build()
        self._entry = (tuple(tensors), versions, key, value)
        return value

    def clear(self) -> None:
        self._entry = ()
