"""Capture: ``torch.export`` (non-strict) of an unmodified causal LM with a dynamic sequence length.

The model's forward must take ``input_ids [1, T]`` and return logits ``[1, T, V]`` or an object with
``.logits`` (Hugging Face ``CausalLMOutput``).  Hugging Face models are captured with
``use_cache=False`` and, for the duration of the capture only, with ``config._attn_implementation =
"sdpa"`` so that attention arrives as one SDPA node.  Kernels that cannot be traced as one piece
(Gated DeltaNet, causal conv, HF MoE experts) are swapped for registered ops during capture by
:func:`kernel_swaps` (the drop-ins live in ``treecompile.hf_adapters``).  The model object is unchanged
afterwards: its training flag, config and attributes are restored.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.export import Dim, ExportedProgram

__all__ = ["Captured", "capture", "CaptureError", "kernel_swaps"]

# Kernel hooks that are swapped, during capture only, for registered tree ops (so that each Gated
# DeltaNet layer is one node and the length stays dynamic).  HF transformers (Qwen3.5, Qwen3-Next)
# call module globals; treecompile.models' hybrid model holds them as instance attributes.
GDN_HOOKS = ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")
CONV_HOOKS = ("causal_conv1d_fn",)


@contextlib.contextmanager
def _patched(obj, name, value):
    had = name in vars(obj) if not isinstance(obj, type(contextlib)) else hasattr(obj, name)
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def kernel_swaps(model: torch.nn.Module) -> list:
    """Context managers that swap Gated DeltaNet / causal-conv hooks for tree ops during capture.

    A module is taken for a GDN layer when it (or the module its class is defined in) exposes one of
    ``GDN_HOOKS`` and one of ``CONV_HOOKS`` as callables.  HF experts modules (classes decorated with
    ``use_experts_implementation``: their eager loop is data-dependent, ``grouped_mm`` refuses float64)
    get their instance ``forward`` swapped for ``treecompile::moe_experts`` when
    :func:`treecompile.ops.moe.hf_experts_supported` says it computes them exactly; others are left
    as they are.  Returns [] for models without such layers.
    """
    import sys
    import types

    from treecompile.hf_adapters import hf_causal_conv1d_fn, hf_chunk_gated_delta_rule
    from treecompile.ops.moe import hf_experts_forward, hf_experts_supported

    swaps, done = [], set()
    for m in model.modules():
        if hasattr(m, "is_concatenated") and hasattr(m, "gate_up_proj") and hf_experts_supported(m) is None:
            swaps.append(_patched(m, "forward", types.MethodType(hf_experts_forward, m)))
        for owner in (m, sys.modules.get(type(m).__module__)):
            if owner is None or id(owner) in done:
                continue
            space = vars(owner)
            gdn = [n for n in GDN_HOOKS if callable(space.get(n))]
            conv = [n for n in CONV_HOOKS if callable(space.get(n))]
            if gdn and conv:
                done.add(id(owner))
                swaps += [_patched(owner, n, hf_chunk_gated_delta_rule) for n in gdn]
                swaps += [_patched(owner, n, hf_causal_conv1d_fn) for n in conv]
    return swaps


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the message says what to change."""


@dataclass
class Captured:
    program: ExportedProgram
    input_name: str  # the user input placeholder (input_ids)


def _is_hf(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return cfg is not None and hasattr(cfg, "use_cache") and hasattr(cfg, "_attn_implementation")


@contextlib.contextmanager
def _hf_capture_settings(model):
    cfg = model.config
    saved = cfg._attn_implementation
    try:
        if saved != "sdpa":
            cfg._attn_implementation = "sdpa"
        yield
    finally:
        if cfg._attn_implementation != saved:
            cfg._attn_implementation = saved


def capture(model: torch.nn.Module, *, example_len: int = 16, max_len: int = 1 << 20,
            swaps: list | None = None) -> Captured:
    """Export ``model`` for tree rewriting.  ``swaps``: context managers entered during capture."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"treecompile.compile expects an nn.Module, got {type(model).__name__}")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    vocab = _vocab_size(model)
    ids = torch.randint(0, vocab, (1, example_len), device=device)
    is_hf = _is_hf(model)
    seq = Dim("seq", min=2, max=max_len)
    was_training = model.training
    if swaps is None:
        swaps = kernel_swaps(model)
    with contextlib.ExitStack() as stack:
        if is_hf:
            stack.enter_context(_hf_capture_settings(model))
        for s in swaps:
            stack.enter_context(s)
        try:
            if is_hf:
                ep = torch.export.export(model, (), {"input_ids": ids, "use_cache": False},
                                         dynamic_shapes={"input_ids": {1: seq}, "use_cache": None},
                                         strict=False)
            else:
                ep = torch.export.export(model, (ids,), dynamic_shapes=({1: seq},), strict=False)
        except Exception as e:
            raise CaptureError(f"torch.export could not capture {type(model).__name__} with a dynamic "
                               f"sequence length: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                               ) from e
        finally:
            model.train(was_training)
    sig = ep.graph_signature
    user = [s.arg.name for s in sig.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT
            and s.arg.name == "input_ids"] or sig.user_inputs[:1]
    return Captured(program=ep, input_name=user[0])


def _vocab_size(model) -> int:
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if emb is None:
        raise CaptureError(f"{type(model).__name__}: cannot find the vocabulary size (no config.vocab_size "
                           f"and no nn.Embedding)")
    return emb.num_embeddings
