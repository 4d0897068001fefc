"""``treecompile::experts_module``: an HF experts module that no treecompile op computes, run as one opaque call.

Hugging Face's experts modules (classes decorated with ``use_experts_implementation``) map
``(hidden [T, D], top_k_index [T, k], top_k_weights [T, k])`` to ``[T, D]`` token by token: token ``t``'s row
is a weighted sum of its routed experts applied to its own hidden row (the decorator's contract: its grouped,
batched and eager implementations are interchangeable).  Their eager forward loops over the experts that were
hit, a data-dependent count torch.export cannot capture with a dynamic length.  Where
``hf_adapters.hf_experts_supported`` finds a layout ``treecompile::moe_experts`` computes (SiLU, concatenated
``[gate; up]``, no biases), that op runs; every other one (gpt-oss's interleaved, biased, clamped SwiGLU,
ReLU^2 experts, ...) is captured as this op, which runs the module's own eager forward on the module's
parameters as the op receives them (so that gradients reach them).  The backward is an op of its own that
runs that forward again with autograd.

The module is named by a key of this process's registry: a program holding this op runs only where it was
compiled, and :func:`treecompile.saved.save` refuses it by name.  Nothing is lowered for CUDA: the eager loop
runs, with its host synchronisations.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from treecompile.ops.op_autograd import autograd_inside_op

__all__ = ["eager_forward", "experts_module", "register_experts_module"]

_REGISTRY: dict[str, tuple[weakref.ref, tuple[str, ...]]] = {}


def register_experts_module(module: torch.nn.Module) -> str:
    """The key :func:`experts_module` names ``module`` by (registered for the life of the module)."""
    key = f"{type(module).__qualname__}@{id(module):x}"
    _REGISTRY[key] = (weakref.ref(module), tuple(n for n, _ in module.named_parameters()))
    return key


def eager_forward(module: torch.nn.Module):
    """The eager forward of ``module``'s class: the one ``use_experts_implementation`` wraps (``__wrapped__``),
    not the dispatcher to grouped/batched kernels, nor an instance ``forward`` a capture swapped in."""
    forward = type(module).forward
    return getattr(forward, "__wrapped__", forward)


def _lookup(key: str):
    entry = _REGISTRY.get(key)
    module = entry[0]() if entry is not None else None
    if module is None:
        raise RuntimeError(f"treecompile::experts_module: no experts module {key!r} in this process (a program "
                           f"holding HF experts that treecompile has no op for runs only in the process that "
                           f"compiled it, while its model lives)")
    return module, entry[1]


def _run(key: str, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, params) -> Tensor:
    module, names = _lookup(key)
    if len(params) != len(names):
        raise ValueError(f"treecompile::experts_module {key!r}: {len(params)} parameters given, the module has "
                         f"{len(names)}")
    with torch.nn.utils.stateless._reparametrize_module(module, dict(zip(names, params))):
        out = eager_forward(module)(module, hidden, top_k_index, top_k_weights)
    if not isinstance(out, Tensor) or out.shape != hidden.shape:
        raise ValueError(f"treecompile::experts_module {key!r}: the module returned "
                         f"{getattr(out, 'shape', type(out).__name__)}, expected hidden's shape {tuple(hidden.shape)}")
    return out


@torch.library.custom_op("treecompile::experts_module", mutates_args=())
def experts_module(key: str, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                   params: list[Tensor]) -> Tensor:
    """The experts module named ``key`` on ``hidden [T, D]`` and its routing, with ``params`` as its parameters
    (in ``named_parameters`` order)."""
    with torch.no_grad():
        return _run(key, hidden, top_k_index, top_k_weights, params).to(hidden.dtype).clone()


@experts_module.register_fake
def _(key, hidden, top_k_index, top_k_weights, params):
    return torch.empty_like(hidden)


@torch.library.custom_op("treecompile::experts_module_backward", mutates_args=())
def experts_module_backward(key: str, grad: Tensor, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                            params: list[Tensor]) -> list[Tensor]:
    """``[d hidden, d top_k_weights, d params...]`` of :func:`experts_module` (zeros where a tensor does not
    reach the output, e.g. an expert no token was routed to)."""
    with autograd_inside_op():
        ins = [hidden.detach().requires_grad_(), top_k_weights.detach().requires_grad_(),
               *(p.detach().requires_grad_() for p in params)]
        out = _run(key, ins[0], top_k_index, ins[1], ins[2:])
        grads = torch.autograd.grad(out, ins, grad.to(out.dtype), allow_unused=True)
    return [torch.zeros_like(x) if g is None else g.to(x.dtype).contiguous() for x, g in zip(ins, grads)]


@experts_module_backward.register_fake
def _(key, grad, hidden, top_k_index, top_k_weights, params):
    return [torch.empty_like(hidden), torch.empty_like(top_k_weights), *(torch.empty_like(p) for p in params)]


def _setup(ctx, inputs, output):
    key, hidden, top_k_index, top_k_weights, params = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, *params)
    ctx.key = key


def _backward(ctx, grad):
    hidden, top_k_index, top_k_weights, *params = ctx.saved_tensors
    g_hidden, g_weights, *g_params = experts_module_backward(ctx.key, grad, hidden, top_k_index, top_k_weights,
                                                             params)
    return None, g_hidden, None, g_weights, g_params


experts_module.register_autograd(_backward, setup_context=_setup)
