"""``treecompile::tree_attention``: causal attention restricted to each token's own path.

In DFS order a key ``k``'s visible queries are one contiguous interval: query ``q`` sees key ``k``
iff ``k <= q < subtree_end[k]``.  Shapes: ``q [1, H, T, D]``, ``k``/``v`` ``[1, Hkv, T, D]`` with
``H % Hkv == 0`` (query head ``h`` reads kv head ``h // (H // Hkv)``, as SDPA's ``enable_gqa``),
``subtree_end [T]`` int64; returns ``[1, H, T, D]``.

``treecompile::tree_attention_windowed`` adds a sliding window along each path (HF's sliding-window layers:
Mistral, Gemma 2/3, Cohere 2, ...): ``k`` also less than ``window`` tokens above ``q``, read from the depths
``position_ids``.  The CUDA lowering turns it into FlexAttention under a window BlockMask fed with the batch
(``passes.lower_cuda``); called as an op on CUDA it runs FlexAttention itself (the same BlockMask, built per call,
and a backward that recomputes the forward), the dense reference elsewhere.

``treecompile::tree_attention_biased`` is the sibling for hand-written attention (matmul, mask,
softmax, matmul) with an additive score bias (ALiBi and other position biases, computed by the
model's own ops from the tree's depth positions) and the softmax dtype the model asked for; it runs
its dense ``[*, T, T]`` reference on every device (the CUDA lowering leaves it as it is).

This module holds the registered ops and its CPU implementation (SDPA with a dense boolean tree
mask; torch refuses FlexAttention backward on CPU).  On CUDA the compiled graph does not call this
op: ``treecompile.compile`` lowers it to FlexAttention with a BlockMask built from the tree
(``treecompile.ops.flex_tree_attention``), so that inductor sees the kernel and its backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treecompile.ops.op_autograd import autograd_inside_op

__all__ = ["tree_attention", "tree_mask", "tree_attention_reference", "tree_attention_windowed", "tree_window_mask",
           "tree_attention_windowed_reference", "tree_attention_biased", "tree_attention_biased_reference"]


def tree_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """Dense ``[T, T]`` bool mask, ``mask[q, k] = k <= q < subtree_end[k]``."""
    T = subtree_end.numel()
    idx = torch.arange(T, device=subtree_end.device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < subtree_end[None, :])


def tree_attention_reference(q, k, v, subtree_end, scale=None):
    """Differentiable dense-mask implementation (CPU reference; any device)."""
    enable_gqa = int(q.shape[1]) != int(k.shape[1])  # head counts are static; avoid a SymBool
    return F.scaled_dot_product_attention(q, k, v, attn_mask=tree_mask(subtree_end), scale=scale,
                                          enable_gqa=enable_gqa)


def _check(q, k, v, subtree_end):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"tree_attention: expected q [1,H,T,D], k/v [1,Hkv,T,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"tree_attention: {q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")


@torch.library.custom_op("treecompile::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                   scale: float | None = None) -> torch.Tensor:
    _check(q, k, v, subtree_end)
    if q.device.type != "cpu":
        raise RuntimeError(
            "treecompile::tree_attention was called eagerly on a non-CPU device; TreeModel lowers it to "
            "FlexAttention on CUDA (use treecompile.compile), or call tree_attention_reference explicitly")
    with torch.no_grad():
        return _sdpa_layout(q, v).copy_(tree_attention_reference(q, k, v, subtree_end, scale))


def _sdpa_layout(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An empty ``[B, H, T, Dv]`` result laid out as ``[B, T, H, Dv]`` (a transposed view), as torch's SDPA
    kernels return it (CPU flash, CUDA flash/cuDNN): the model's code after the attention was captured against
    that layout, and a ``.transpose(1, 2).view(B, T, -1)`` there (AfmoeForCausalLM) needs it."""
    B, H, T = q.shape[:3]
    return q.new_empty((B, T, H, v.shape[-1])).transpose(1, 2)


@tree_attention.register_fake
def _(q, k, v, subtree_end, scale=None):
    return _sdpa_layout(q, v)


def _setup(ctx, inputs, output):
    q, k, v, subtree_end, scale = inputs
    ctx.save_for_backward(q, k, v, subtree_end)
    ctx.scale = scale


def _backward(ctx, grad):
    q, k, v, subtree_end = ctx.saved_tensors
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = tree_attention_reference(qq, kk, vv, subtree_end, ctx.scale)
        gq, gk, gv = torch.autograd.grad(out, (qq, kk, vv), grad)
    return gq, gk, gv, None, None


tree_attention.register_autograd(_backward, setup_context=_setup)


# --------------------------------------------------------------------------- sliding window along each path
def tree_window_mask(subtree_end: torch.Tensor, position_ids: torch.Tensor, window: int) -> torch.Tensor:
    """Dense ``[T, T]`` bool: :func:`tree_mask` and ``position_ids[q] - position_ids[k] < window``."""
    pos = position_ids.to(torch.int64)
    return tree_mask(subtree_end) & ((pos[:, None] - pos[None, :]) < window)


def tree_attention_windowed_reference(q, k, v, subtree_end, position_ids, window: int, scale=None):
    """Differentiable dense-mask implementation of :func:`tree_attention_windowed` (any device)."""
    enable_gqa = int(q.shape[1]) != int(k.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=tree_window_mask(subtree_end, position_ids, window),
                                          scale=scale, enable_gqa=enable_gqa)


def _windowed(q, k, v, subtree_end, position_ids, window, scale, block_mask=None):
    """Differentiable: FlexAttention under :func:`~treecompile.ops.flex_tree_attention.tree_window_block_mask` on
    CUDA (tiles past the window skipped; ``block_mask``: that mask, built once by a caller that keeps it), the
    dense reference elsewhere."""
    if not q.is_cuda:
        return tree_attention_windowed_reference(q, k, v, subtree_end, position_ids, window, scale)
    from treecompile.ops.flex_tree_attention import (tree_attention_flex, tree_window_block_mask,
                                                     window_kernel_options_for)
    if block_mask is None:
        block_mask = tree_window_block_mask(subtree_end, position_ids, window, validate=False)
    return tree_attention_flex(q, k, v, block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                               kernel_options=window_kernel_options_for(q))


@torch.library.custom_op("treecompile::tree_attention_windowed", mutates_args=())
def tree_attention_windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                            position_ids: torch.Tensor, window: int, scale: float | None = None) -> torch.Tensor:
    """Sliding-window attention on the tree: :func:`tree_attention` where query ``q`` also needs key ``k`` less
    than ``window`` tokens above it on its path (``position_ids``: the depths; ``k`` is on ``q``'s path, so the
    depth difference is their distance along it).  The per-path run's ``q - k < window`` of HF's sliding
    layers."""
    _check(q, k, v, subtree_end)
    with torch.no_grad():
        return _sdpa_layout(q, v).copy_(_windowed(q, k, v, subtree_end, position_ids, window, scale))


@tree_attention_windowed.register_fake
def _(q, k, v, subtree_end, position_ids, window, scale=None):
    return _sdpa_layout(q, v)


@torch.library.custom_op("treecompile::tree_attention_windowed_backward", mutates_args=())
def tree_attention_windowed_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     subtree_end: torch.Tensor, position_ids: torch.Tensor, window: int,
                                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`tree_attention_windowed`: the forward recomputed with autograd, then its
    backward.  An op of its own, so that a graph compiled around the forward (AOTAutograd traces the backward)
    sees one opaque call, not the compiled FlexAttention inside it."""
    with autograd_inside_op():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = _windowed(qq, kk, vv, subtree_end, position_ids, window, scale)
        grads = torch.autograd.grad(out, (qq, kk, vv), grad)
    # laid out as the inputs (the fake's empty_like): q/k/v are often transposed views of [B, T, H, D]
    return tuple(torch.empty_like(t).copy_(g) for t, g in zip((q, k, v), grads))


@tree_attention_windowed_backward.register_fake
def _(grad, q, k, v, subtree_end, position_ids, window, scale=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _windowed_setup(ctx, inputs, output):
    q, k, v, subtree_end, position_ids, window, scale = inputs
    ctx.save_for_backward(q, k, v, subtree_end, position_ids)
    ctx.window, ctx.scale = window, scale


def _windowed_backward(ctx, grad):
    q, k, v, subtree_end, position_ids = ctx.saved_tensors
    gq, gk, gv = tree_attention_windowed_backward(grad, q, k, v, subtree_end, position_ids, ctx.window, ctx.scale)
    return gq, gk, gv, None, None, None, None


tree_attention_windowed.register_autograd(_windowed_backward, setup_context=_windowed_setup)


# --------------------------------------------------------------------------- biased (hand-written attention)
def tree_attention_biased_reference(q, k, v, subtree_end, bias=None, *, scale: float = 1.0, softmax_dtype=None,
                                    position_ids=None, window: int | None = None, softcap: float | None = None,
                                    sinks=None):
    """``softmax(scale * q @ k^T + bias, masked to the tree) @ v``, dense and differentiable.

    ``q [*, T, D]``, ``k [*, T, D]``, ``v [*, T, Dv]`` (leading dims broadcast as ``torch.matmul``),
    ``bias`` broadcastable to ``[*, T, T]`` or None, ``softmax_dtype`` the dtype the softmax runs in
    (its result is cast back to ``v.dtype``).  Returns ``[*, T, Dv]``.  Options, as models write them:
    ``softcap``: the scores are ``softcap * tanh(scale * q @ k^T / softcap)`` before the bias (Gemma 2);
    ``window`` (with ``position_ids``, the depths): keys less than ``window`` above the query on its path;
    ``sinks`` broadcastable to ``[*, T, 1]``: one more logit per query row in the softmax's denominator, whose
    probability is dropped (gpt-oss-style attention sinks).
    """
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias
    mask = tree_mask(subtree_end) if window is None else tree_window_mask(subtree_end, position_ids, window)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.expand(*s.shape[:-1], 1).to(s.dtype)], -1)
    p = torch.softmax(s, -1, dtype=softmax_dtype)
    if sinks is not None:
        p = p[..., :-1]
    return torch.matmul(p.to(v.dtype), v)


@torch.library.custom_op("treecompile::tree_attention_biased", mutates_args=())
def tree_attention_biased(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                          bias: torch.Tensor | None, scale: float, softmax_dtype: torch.dtype | None = None,
                          position_ids: torch.Tensor | None = None, window: int | None = None,
                          softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Hand-written causal attention on the tree (see :func:`tree_attention_biased_reference`)."""
    with torch.no_grad():
        return tree_attention_biased_reference(q, k, v, subtree_end, bias, scale=scale, softmax_dtype=softmax_dtype,
                                               position_ids=position_ids, window=window, softcap=softcap,
                                               sinks=sinks).contiguous()


@tree_attention_biased.register_fake
def _(q, k, v, subtree_end, bias, scale, softmax_dtype=None, position_ids=None, window=None, softcap=None,
      sinks=None):
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return q.new_empty(tuple(lead) + (q.shape[-2], v.shape[-1]), dtype=v.dtype)


def _biased_setup(ctx, inputs, output):
    q, k, v, subtree_end, bias, scale, softmax_dtype, position_ids, window, softcap, sinks = inputs
    ctx.save_for_backward(q, k, v, subtree_end, bias, position_ids, sinks)
    ctx.scale, ctx.softmax_dtype, ctx.window, ctx.softcap = scale, softmax_dtype, window, softcap


def _biased_backward(ctx, grad):
    q, k, v, subtree_end, bias, position_ids, sinks = ctx.saved_tensors
    bias_grad = bias is not None and ctx.needs_input_grad[4]
    sinks_grad = sinks is not None and ctx.needs_input_grad[10]
    with torch.enable_grad():
        ins = [t.detach().requires_grad_() for t in (q, k, v)]
        bb = bias.detach().requires_grad_() if bias_grad else bias
        ss = sinks.detach().requires_grad_() if sinks_grad else sinks
        out = tree_attention_biased_reference(*ins, subtree_end, bb, scale=ctx.scale, softmax_dtype=ctx.softmax_dtype,
                                              position_ids=position_ids, window=ctx.window, softcap=ctx.softcap,
                                              sinks=ss)
        grads = list(torch.autograd.grad(out, ins + ([bb] if bias_grad else []) + ([ss] if sinks_grad else []),
                                         grad))
    gq, gk, gv = grads[:3]
    gb = grads.pop(3) if bias_grad else None
    gs = grads[3] if sinks_grad else None
    return gq, gk, gv, None, gb, None, None, None, None, None, gs


tree_attention_biased.register_autograd(_biased_backward, setup_context=_biased_setup)
