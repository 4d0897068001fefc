"""``treecompile::tree_attention``: causal attention restricted to each token's own path.

In DFS order a key ``k``'s visible queries are one contiguous interval: query ``q`` sees key ``k``
iff ``k <= q < subtree_end[k]``.  Shapes: ``q [1, H, T, D]``, ``k``/``v`` ``[1, Hkv, T, D]`` with
``H % Hkv == 0`` (query head ``h`` reads kv head ``h // (H // Hkv)``, as SDPA's ``enable_gqa``),
``subtree_end [T]`` int64; returns ``[1, H, T, D]``.

This module holds the registered op and its CPU implementation (SDPA with a dense boolean tree
mask; torch refuses FlexAttention backward on CPU).  On CUDA the compiled graph does not call this
op: ``treecompile.compile`` lowers it to FlexAttention with a BlockMask built from the tree
(``treecompile.ops.flex_tree_attention``), so that inductor sees the kernel and its backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["tree_attention", "tree_mask", "tree_attention_reference"]


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
        return tree_attention_reference(q, k, v, subtree_end, scale).contiguous()


@tree_attention.register_fake
def _(q, k, v, subtree_end, scale=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


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
