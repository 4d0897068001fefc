"""Autograd recorded inside a custom op's implementation (ops whose backward recomputes their forward)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["autograd_inside_op"]

_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView,
                  torch._C.DispatchKey.AutogradOther, torch._C.DispatchKey.AutogradCPU,
                  torch._C.DispatchKey.AutogradCUDA)


@contextlib.contextmanager
def autograd_inside_op():
    """The dispatcher runs a custom op's implementation with the autograd keys excluded (its tensors would not
    require grad): re-include them for the block, keeping the rest of the thread-local dispatch state."""
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield
