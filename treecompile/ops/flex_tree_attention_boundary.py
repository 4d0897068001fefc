"""Boundary tree attention on CUDA: FlexAttention over ``[boundary ; local]`` keys under one BlockMask.

The CUDA form of ``treecompile::tree_attention_boundary`` (``ops/tree_attention_boundary.py``): the
queries of a partition attend to the boundary's keys (computed in earlier partitions) and to their own
keys under the tree rule, with one softmax over both.  Query ``q`` sees boundary entry ``j`` iff
``j < boundary_visible[q]`` and local key ``k`` iff ``k <= q < subtree_end[k]``.

Key layout: ``[boundary (B rows) ; zeros (Bp - B rows) ; local (T rows)]`` with ``Bp`` = B rounded up
to whole kv blocks, so that the local key blocks are exactly the tree's and their tile classes are
``flex_tree_attention.tree_block_classes`` unchanged.  The zero rows are never visible
(``boundary_visible <= B``) and no tile of them is listed unless it also holds boundary keys.

Tile classes of the boundary blocks come from two numbers per q block, the min and max of
``boundary_visible`` over its queries: a kv block ``[js, js + kb)`` is *empty* iff
``js >= max``, *full* iff ``js + kb <= min`` (then it holds no zero rows), *partial* otherwise.  O(T)
tensor work, no host synchronisation unless ``validate``, never a ``[T, B + T]`` mask.

Memory: FlexAttention takes one key and one value tensor, so each call concatenates
``[boundary ; zeros ; local]`` once per layer (one copy of ``Bp + T`` rows of K and of V; none when
B = 0, the local tensors are then used as they are).  Flex saves the concatenation for its backward in
place of the local ``k, v``, so next to the local rows it costs ``2 * Hkv * Bp * D * itemsize`` bytes
per layer: what the reference path keeps anyway (its saved ``boundary_k/v``).  What it no longer has is
the ``[T, B + T]`` mask and the dense attention of the reference backward.  Reading the ancestors' rows
in place would need a kernel that takes several key tensors (or one K/V store shared by the
partitions of a chain); see ``runtime/redundancy_free.py``.

Shapes: ``q [1, H, T, D]``, ``k [1, Hkv, T, D]``, ``v [1, Hkv, T, Dv]``, ``boundary_k [1, Hkv, B, D]``,
``boundary_v [1, Hkv, B, Dv]`` (B may be 0), ``subtree_end, boundary_visible [T]`` int64;
``H % Hkv == 0`` (GQA with ``enable_gqa``).  The BlockMask has ``seq_lengths == (T, Bp + T)``.

This module knows tensors and kernels only; it never imports the CPU reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from .flex_tree_attention import (
    DEFAULT_BLOCK_SIZE,
    block_mask_from_classes,
    block_pair,
    check_subtree_end,
    compiled_flex,
    kernel_options_for,
    tree_block_classes,
)

__all__ = [
    "boundary_block_classes",
    "boundary_block_mask",
    "boundary_keys",
    "boundary_tree_mask_mod",
    "padded_boundary_length",
    "tree_attention_boundary_flex",
]


def padded_boundary_length(num_boundary: int, kv_block: int) -> int:
    """``Bp``: the boundary length rounded up to whole kv blocks (0 stays 0)."""
    return -(-num_boundary // kv_block) * kv_block


def boundary_tree_mask_mod(key_end: torch.Tensor, boundary_visible: torch.Tensor, boundary_len: int):
    """mask_mod over ``[boundary ; zeros ; local]`` keys: ``kv < boundary_visible[q]`` (a boundary key) or
    ``kv - Bp <= q < key_end[kv]`` (a local key under the tree rule).

    ``key_end`` is indexed by key: 0 over the ``Bp`` boundary rows (no local query passes ``q < 0``), then
    the local ``subtree_end``, padded to whole kv blocks; ``boundary_visible`` padded to whole q blocks (the
    kernel may evaluate the mask past the ends of the last blocks); ``boundary_len`` = ``Bp``.  Only
    comparisons, ``&``, ``|``, ``+`` and one gather per tensor: FA4's mask_mod (inductor's CuteDSL template
    for ``BACKEND="FLASH"``) renders no ``clamp``/``maximum``.
    """

    def boundary_tree_mask(b, h, q_idx, kv_idx):
        seen_local = (kv_idx <= q_idx + boundary_len) & (q_idx < key_end[kv_idx])
        return (kv_idx < boundary_visible[q_idx]) | seen_local

    return boundary_tree_mask


def boundary_block_classes(subtree_end: torch.Tensor, boundary_visible: torch.Tensor, num_boundary: int, *,
                           block_size=DEFAULT_BLOCK_SIZE):
    """Bool ``(partial, full)``, each ``[num_q_blocks, Bp / kv_block + num_local_kv_blocks]`` (module
    docstring); exact: a tile is full iff every in-range entry is visible, empty iff none is."""
    qb, kb = block_pair(block_size)
    T = subtree_end.numel()
    partial_local, full_local = tree_block_classes(subtree_end, block_size=(qb, kb))
    nq = partial_local.shape[0]
    nb = padded_boundary_length(num_boundary, kb) // kb
    vis = boundary_visible.to(torch.int64)
    vmin = F.pad(vis, (0, nq * qb - T), value=num_boundary).view(nq, qb).amin(1)  # over real queries only
    vmax = F.pad(vis, (0, nq * qb - T), value=0).view(nq, qb).amax(1)
    js = torch.arange(nb, device=vis.device, dtype=torch.int64) * kb
    nonempty = js[None, :] < vmax[:, None]
    full = (js + kb)[None, :] <= vmin[:, None]
    return torch.cat([nonempty & ~full, partial_local], 1), torch.cat([full, full_local], 1)


def boundary_block_mask(subtree_end: torch.Tensor, boundary_visible: torch.Tensor, num_boundary: int, *,
                        block_size=DEFAULT_BLOCK_SIZE, validate: bool = True) -> BlockMask:
    """BlockMask of a partition's queries ``[T]`` over ``[boundary ; zeros ; local]`` keys ``[Bp + T]``.

    Args:
        subtree_end: ``[T]`` int64 local tree intervals (a TreeBatch's, padding tokens included).
        boundary_visible: ``[T]`` int64 in ``[0, num_boundary]``.
        num_boundary: B, the boundary's length (the keys fed have B rows; ``Bp - B`` zero rows follow).
        validate: check both tensors (one host synchronisation) and raise ValueError naming the first
            bad token.
    Built once per partition batch and shared by every layer.
    """
    qb, kb = block_pair(block_size)
    T = subtree_end.numel()
    if subtree_end.dim() != 1 or boundary_visible.shape != subtree_end.shape or T == 0:
        raise ValueError(f"boundary_block_mask: subtree_end and boundary_visible must be [T] with T > 0, got "
                         f"{tuple(subtree_end.shape)} and {tuple(boundary_visible.shape)}")
    for name, t in (("subtree_end", subtree_end), ("boundary_visible", boundary_visible)):
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name}: expected an integer tensor, got dtype {t.dtype}")
    if num_boundary < 0:
        raise ValueError(f"num_boundary: expected >= 0, got {num_boundary}")
    if validate:
        check_subtree_end(subtree_end)
        bad = (boundary_visible < 0) | (boundary_visible > num_boundary)
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0])
            raise ValueError(f"boundary_visible: token {t} sees {int(boundary_visible[t])} boundary entries, "
                             f"expected a value in [0, {num_boundary}]")
    partial, full = boundary_block_classes(subtree_end, boundary_visible, num_boundary, block_size=(qb, kb))
    Bp = padded_boundary_length(num_boundary, kb)
    nq, nk_local = partial.shape[0], partial.shape[1] - Bp // kb
    mask_mod = boundary_tree_mask_mod(F.pad(subtree_end.to(torch.int64), (Bp, nk_local * kb - T)),
                                      F.pad(boundary_visible.to(torch.int64), (0, nq * qb - T)), Bp)
    return block_mask_from_classes(partial, full, seq_lengths=(T, Bp + T), block_size=(qb, kb), mask_mod=mask_mod)


def boundary_keys(boundary: torch.Tensor, local: torch.Tensor, padded_len: int) -> torch.Tensor:
    """``[boundary ; zeros ; local]`` along dim 2 in one ``cat``: ``[1, Hkv, padded_len + T, D]``
    (``local`` itself, no copy, when there is no boundary)."""
    pad = padded_len - boundary.shape[2]
    if pad < 0:
        raise ValueError(f"boundary_keys: {boundary.shape[2]} boundary rows do not fit {padded_len}")
    if padded_len == 0:
        return local
    parts = [boundary, local] if pad == 0 else [boundary, local.new_zeros(local.shape[:2] + (pad, local.shape[3])),
                                                local]
    return torch.cat(parts, 2)


def _check(q, k, v, boundary_k, boundary_v, block_mask, enable_gqa):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or boundary_k.dim() != 4 or boundary_v.dim() != 4:
        raise ValueError(f"q, k, v, boundary_k, boundary_v: expected 4-D tensors, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(boundary_k.shape)}, {tuple(boundary_v.shape)}")
    T, B = q.shape[2], boundary_k.shape[2]
    if k.shape[2] != T or v.shape[2] != T:
        raise ValueError(f"q, k, v: sequence lengths differ ({T}, {k.shape[2]}, {v.shape[2]})")
    if boundary_k.shape[:2] != k.shape[:2] or boundary_k.shape[3] != k.shape[3] or \
            boundary_v.shape[:3] != boundary_k.shape[:3] or boundary_v.shape[3] != v.shape[3]:
        raise ValueError(f"boundary_k/v: expected [1, Hkv={k.shape[1]}, B, D] matching k/v, got "
                         f"{tuple(boundary_k.shape)}, {tuple(boundary_v.shape)}")
    Bp = padded_boundary_length(B, block_mask.BLOCK_SIZE[1])
    if tuple(block_mask.seq_lengths) != (T, Bp + T):
        raise ValueError(f"block_mask: built for seq_lengths {tuple(block_mask.seq_lengths)}, the inputs need "
                         f"(T={T}, Bp+T={Bp + T}) for B={B} boundary rows")
    if k.shape[1] != q.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads, k/v have {k.shape[1]}: pass enable_gqa=True")


def tree_attention_boundary_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundary_k: torch.Tensor,
                                 boundary_v: torch.Tensor, block_mask: BlockMask, *, scale: float | None = None,
                                 enable_gqa: bool = False, kernel_options: dict | None = None,
                                 flex=None) -> torch.Tensor:
    """FlexAttention over ``[boundary ; local]`` keys; returns ``[1, H, T, Dv]`` (autograd native).

    Args:
        block_mask: :func:`boundary_block_mask` of this partition (one per batch, shared by the layers).
        scale: softmax scale, default ``1/sqrt(D)``.
        kernel_options: FlexAttention kernel options; None means ``kernel_options_for(q)``.
        flex: the ``flex_attention`` to call: None = the separately compiled one (``compiled_flex()``),
            or ``torch.nn.attention.flex_attention.flex_attention`` inside a graph that is itself compiled.
    Gradients flow to ``q, k, v, boundary_k, boundary_v``.
    """
    _check(q, k, v, boundary_k, boundary_v, block_mask, enable_gqa)
    Bp = block_mask.seq_lengths[1] - q.shape[2]
    if kernel_options is None:
        kernel_options = kernel_options_for(q)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    keys, values = boundary_keys(boundary_k, k, Bp), boundary_keys(boundary_v, v, Bp)
    return (flex or compiled_flex())(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                                     kernel_options=kernel_options)
