"""``treecompile::tree_attention_past``: tree attention over [boundary ; local] keys.

A partition of a redundancy-free plan (``treecompile.runtime.partition``) holds some tokens of a
tree; its tokens also attend to *boundary* tokens computed in earlier partitions, whose keys and
values come in as inputs.  Query ``q`` sees boundary entry ``j`` iff ``j < past_visible[q]``, and
local key ``k`` iff ``k <= q < subtree_end[k]`` (the usual DFS tree rule).  The softmax runs over
both sets together, so the result equals the whole tree's attention for that token.

Shapes: ``q [1, H, T, D]``, ``k [1, Hkv, T, D]``, ``v [1, Hkv, T, Dv]``, ``subtree_end [T]`` int64,
``past_k [1, Hkv, B, D]``, ``past_v [1, Hkv, B, Dv]`` (B may be 0), ``past_visible [T]`` int64 in
``[0, B]``; ``H % Hkv == 0`` (GQA as SDPA's ``enable_gqa``).  Returns ``[1, H, T, Dv]``.

CPU reference (runs on any device torch runs on): SDPA with a dense ``[T, B + T]`` boolean mask.
The backward recomputes the reference under autograd and returns gradients for ``q, k, v`` and for
``past_k, past_v`` (they flow back into the partition that computed the boundary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treecompile.ops.tree_attention import tree_mask

__all__ = ["tree_attention_past", "tree_attention_past_reference", "past_tree_mask"]


def past_tree_mask(subtree_end: torch.Tensor, past_visible: torch.Tensor, num_past: int) -> torch.Tensor:
    """Dense ``[T, B + T]`` bool mask: columns ``0..B-1`` the boundary (``j < past_visible[q]``),
    then the local tree mask (``k <= q < subtree_end[k]``)."""
    j = torch.arange(num_past, device=subtree_end.device)
    return torch.cat([j[None, :] < past_visible[:, None], tree_mask(subtree_end)], 1)


def tree_attention_past_reference(q, k, v, subtree_end, past_k, past_v, past_visible, scale=None):
    """Differentiable dense-mask implementation (any device)."""
    B = past_k.shape[2]
    keys = torch.cat([past_k, k], 2)
    vals = torch.cat([past_v, v], 2)
    enable_gqa = int(q.shape[1]) != int(k.shape[1])
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=past_tree_mask(subtree_end, past_visible, B),
                                          scale=scale, enable_gqa=enable_gqa)


def _check(q, k, v, subtree_end, past_k, past_v, past_visible):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"tree_attention_past: expected q [1,H,T,D], k/v [1,Hkv,T,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"tree_attention_past: {q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")
    if past_k.dim() != 4 or past_k.shape[:2] != k.shape[:2] or past_k.shape[3] != k.shape[3]:
        raise ValueError(f"tree_attention_past: past_k must be [1, Hkv={k.shape[1]}, B, D={k.shape[3]}], "
                         f"got {tuple(past_k.shape)}")
    if past_v.dim() != 4 or past_v.shape[:3] != past_k.shape[:3] or past_v.shape[3] != v.shape[3]:
        raise ValueError(f"tree_attention_past: past_v must be [1, Hkv, B={past_k.shape[2]}, Dv={v.shape[3]}], "
                         f"got {tuple(past_v.shape)}")
    T = q.shape[2]
    for name, t in (("subtree_end", subtree_end), ("past_visible", past_visible)):
        if t.shape != (T,) or t.dtype != torch.long:
            raise ValueError(f"tree_attention_past: {name} must be int64 [T={T}], got {t.dtype} {tuple(t.shape)}")


@torch.library.custom_op("treecompile::tree_attention_past", mutates_args=())
def tree_attention_past(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                        past_k: torch.Tensor, past_v: torch.Tensor, past_visible: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    _check(q, k, v, subtree_end, past_k, past_v, past_visible)
    with torch.no_grad():
        return tree_attention_past_reference(q, k, v, subtree_end, past_k, past_v, past_visible, scale).contiguous()


@tree_attention_past.register_fake
def _(q, k, v, subtree_end, past_k, past_v, past_visible, scale=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _setup(ctx, inputs, output):
    q, k, v, subtree_end, past_k, past_v, past_visible, scale = inputs
    ctx.save_for_backward(q, k, v, subtree_end, past_k, past_v, past_visible)
    ctx.scale = scale


def _backward(ctx, grad):
    q, k, v, subtree_end, past_k, past_v, past_visible = ctx.saved_tensors
    with torch.enable_grad():
        xs = [t.detach().requires_grad_() for t in (q, k, v, past_k, past_v)]
        out = tree_attention_past_reference(xs[0], xs[1], xs[2], subtree_end, xs[3], xs[4], past_visible, ctx.scale)
        gq, gk, gv, gpk, gpv = torch.autograd.grad(out, xs, grad)
    return gq, gk, gv, None, gpk, gpv, None, None


tree_attention_past.register_autograd(_backward, setup_context=_setup)
