"""``treecompile::tree_attention_boundary``: tree attention over [boundary ; local] keys.

A partition of a redundancy-free plan (``treecompile.runtime.partition``) holds some tokens of a
tree; its tokens also attend to *boundary* tokens computed in earlier partitions, whose keys and
values come in as inputs.  Query ``q`` sees boundary entry ``j`` iff ``j < boundary_visible[q]``, and
local key ``k`` iff ``k <= q < subtree_end[k]`` (the usual DFS tree rule).  The softmax runs over
both sets together, so the result equals the whole tree's attention for that token.

Shapes: ``q [1, H, T, D]``, ``k [1, Hkv, T, D]``, ``v [1, Hkv, T, Dv]``, ``subtree_end [T]`` int64,
``boundary_k [1, Hkv, B, D]``, ``boundary_v [1, Hkv, B, Dv]`` (B may be 0), ``boundary_visible [T]``
int64 in ``[0, B]``; ``H % Hkv == 0`` (GQA as SDPA's ``enable_gqa``).  Returns ``[1, H, T, Dv]``.

CPU reference (runs on any device torch runs on): SDPA with a dense ``[T, B + T]`` boolean mask.  On
CUDA the lowering (``passes/lower_cuda.py``) replaces the op by FlexAttention over ``[boundary ;
local]`` keys under a BlockMask built from the intervals (``ops/flex_tree_attention_boundary.py``).
The backward recomputes the reference under autograd and returns gradients for ``q, k, v`` and for
``boundary_k, boundary_v`` (they flow back into the partition that computed the boundary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from treecompile.ops.tree_attention import tree_mask

__all__ = ["tree_attention_boundary", "tree_attention_boundary_reference", "boundary_tree_mask"]


def boundary_tree_mask(subtree_end: torch.Tensor, boundary_visible: torch.Tensor, num_boundary: int) -> torch.Tensor:
    """Dense ``[T, B + T]`` bool mask: columns ``0..B-1`` the boundary (``j < boundary_visible[q]``),
    then the local tree mask (``k <= q < subtree_end[k]``)."""
    j = torch.arange(num_boundary, device=subtree_end.device)
    return torch.cat([j[None, :] < boundary_visible[:, None], tree_mask(subtree_end)], 1)


def tree_attention_boundary_reference(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible, scale=None):
    """Differentiable dense-mask implementation (any device)."""
    B = boundary_k.shape[2]
    keys = torch.cat([boundary_k, k], 2)
    vals = torch.cat([boundary_v, v], 2)
    enable_gqa = int(q.shape[1]) != int(k.shape[1])
    mask = boundary_tree_mask(subtree_end, boundary_visible, B)
    return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def _check(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"tree_attention_boundary: expected q [1,H,T,D], k/v [1,Hkv,T,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"tree_attention_boundary: {q.shape[1]} query heads is not a multiple of "
                         f"{k.shape[1]} kv heads")
    if boundary_k.dim() != 4 or boundary_k.shape[:2] != k.shape[:2] or boundary_k.shape[3] != k.shape[3]:
        raise ValueError(f"tree_attention_boundary: boundary_k must be [1, Hkv={k.shape[1]}, B, D={k.shape[3]}], "
                         f"got {tuple(boundary_k.shape)}")
    if boundary_v.dim() != 4 or boundary_v.shape[:3] != boundary_k.shape[:3] or boundary_v.shape[3] != v.shape[3]:
        raise ValueError(f"tree_attention_boundary: boundary_v must be [1, Hkv, B={boundary_k.shape[2]}, "
                         f"Dv={v.shape[3]}], got {tuple(boundary_v.shape)}")
    T = q.shape[2]
    for name, t in (("subtree_end", subtree_end), ("boundary_visible", boundary_visible)):
        if t.shape != (T,) or t.dtype != torch.long:
            raise ValueError(f"tree_attention_boundary: {name} must be int64 [T={T}], got {t.dtype} {tuple(t.shape)}")


@torch.library.custom_op("treecompile::tree_attention_boundary", mutates_args=())
def tree_attention_boundary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                            boundary_k: torch.Tensor, boundary_v: torch.Tensor, boundary_visible: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
    _check(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible)
    with torch.no_grad():
        return tree_attention_boundary_reference(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible,
                                                 scale).contiguous()


@tree_attention_boundary.register_fake
def _(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible, scale=None):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))


def _setup(ctx, inputs, output):
    q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible, scale = inputs
    ctx.save_for_backward(q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible)
    ctx.scale = scale


def _backward(ctx, grad):
    q, k, v, subtree_end, boundary_k, boundary_v, boundary_visible = ctx.saved_tensors
    with torch.enable_grad():
        xs = [t.detach().requires_grad_() for t in (q, k, v, boundary_k, boundary_v)]
        out = tree_attention_boundary_reference(xs[0], xs[1], xs[2], subtree_end, xs[3], xs[4], boundary_visible,
                                                ctx.scale)
        gq, gk, gv, gpk, gpv = torch.autograd.grad(out, xs, grad)
    return gq, gk, gv, None, gpk, gpv, None, None


tree_attention_boundary.register_autograd(_backward, setup_context=_setup)
