"""Tree attention on CUDA: FlexAttention with a BlockMask built directly from the tree's intervals.

A DFS-serialised tree batch says which keys each query sees with one tensor, ``subtree_end [T]``:
query ``q`` sees key ``k`` iff ``k <= q < subtree_end[k]``.  In DFS order the queries that see a key
form one contiguous interval (the key's subtree), so a ``(q-block, kv-block)`` tile can be classified
from two numbers per kv block, the minimum and maximum ``subtree_end`` over its keys:

* empty   iff the kv block starts at or after the q block ends, or no key's interval reaches the
            block's first query (``max subtree_end <= q_start``);
* full    iff every key of the kv block is at or before the first query (``k_end - 1 <= q_start``)
            and every key's interval covers the last query (``min subtree_end >= q_end``);
* partial otherwise; only partial tiles evaluate the mask_mod.

(A key block that overlaps the query block is never empty: its diagonal entries are visible.)
That is O(T) work for the per-block reductions and O(num_q_blocks * num_kv_blocks) for the
classification, all tensor ops on the tensor's device, with no host synchronisation unless
``validate=True`` -- never a mask_mod evaluated over T^2 entries, never ``create_block_mask``.

``tree_attention_flex`` runs compiled FlexAttention (``torch.compile(flex_attention)`` made once, on
first use) with kernel options tuned for Hopper where they apply.  It is autograd native; inside a
graph that is itself compiled, call ``flex_attention`` with the same block mask and
``kernel_options_for(q)``.

Shapes: ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]`` (``Hkv`` divides ``H`` with ``enable_gqa=True``).
The block mask has batch and head dimensions of size 1 (one tree, shared by every head).

This module knows tensors and kernels only; it never imports the CPU reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "HOPPER_KERNEL_OPTIONS",
    "block_mask_from_classes",
    "block_pair",
    "check_subtree_end",
    "check_tree_attention_inputs",
    "compiled_flex",
    "kernel_options_for",
    "tree_block_mask",
    "tree_block_classes",
    "tree_mask_mod",
    "tree_window_block_mask",
    "tree_window_mask_mod",
    "tree_attention_flex",
    "window_kernel_options_for",
]

DEFAULT_BLOCK_SIZE = (128, 128)  # (q block, kv block) of the sparse block mask

# Kernel options for Hopper (sm_90), bf16/fp16, head_dim 128.  Chosen by the sweep in
# benchmarks/bench_attention.py (numbers in benchmarks/results/HISTORY.md).  Other dtypes, head sizes and
# devices use torch's own defaults (None).
# ROWS_GUARANTEED_SAFE is NOT set: the kernel then skips the -inf guard of its online softmax, which
# needs every row to see something in the FIRST tile it visits, not merely somewhere; a padding token or
# a second root sees nothing in tile 0 and its row became NaN (caught by the CUDA test).
HOPPER_KERNEL_OPTIONS: dict = {
    "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 8,
}


def block_pair(block_size) -> tuple[int, int]:
    """``(q_block, kv_block)`` from an int or a pair; ValueError unless powers of two >= 16."""
    if isinstance(block_size, int):
        block_size = (block_size, block_size)
    try:
        qb, kb = (int(b) for b in block_size)
    except (TypeError, ValueError):
        raise ValueError(f"block_size: expected an int or a (q, kv) pair of ints, got {block_size!r}") from None
    for b in (qb, kb):
        if b < 16 or b & (b - 1):
            raise ValueError(f"block_size: each block size must be a power of two >= 16, got {block_size!r}")
    return qb, kb


def check_subtree_end(subtree_end: torch.Tensor) -> None:
    """Raise ValueError naming the first token whose interval [k, subtree_end[k]) is not in [k+1, T]."""
    T = subtree_end.numel()
    k = torch.arange(T, device=subtree_end.device)
    bad = (subtree_end <= k) | (subtree_end > T)
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0])
        raise ValueError(f"subtree_end: token {t} has subtree_end {int(subtree_end[t])}, expected a value in "
                         f"[{t + 1}, {T}] (every token sees itself; no interval leaves the sequence)")


def tree_mask_mod(subtree_end: torch.Tensor):
    """mask_mod of the tree: query q sees key k iff k <= q < subtree_end[k].

    ``subtree_end`` may be longer than the sequence (padded to whole kv blocks): the kernel may
    evaluate the mask_mod on indices past the end of the last partial block.
    """

    def tree_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    return tree_mask


def tree_block_classes(subtree_end: torch.Tensor, *, block_size=DEFAULT_BLOCK_SIZE):
    """Block classification of the tree mask: bool ``(partial, full)``, each ``[num_q_blocks, num_kv_blocks]``.

    Exact: a tile is ``full`` iff all its in-range entries are visible, ``partial`` iff some but
    not all are (or it holds out-of-range keys of the last kv block and some visible entry).
    """
    qb, kb = block_pair(block_size)
    if subtree_end.dim() != 1:
        raise ValueError(f"subtree_end: expected a 1-D tensor [T], got shape {tuple(subtree_end.shape)}")
    T = subtree_end.numel()
    if T == 0:
        raise ValueError("subtree_end: empty sequence")
    dev = subtree_end.device
    se = subtree_end.to(torch.int64)
    nq, nk = -(-T // qb), -(-T // kb)
    # pad to whole kv blocks with 0: ignored by the max (real keys have subtree_end >= 1), and it makes
    # the min 0 in a ragged last block, which is then never full (its out-of-range keys are not visible)
    blocks = F.pad(se, (0, nk * kb - T)).view(nk, kb)
    mx = blocks.amax(1)
    mn = blocks.amin(1)
    q_start = torch.arange(nq, device=dev, dtype=torch.int64) * qb
    q_end = (q_start + qb).clamp(max=T)
    k_start = torch.arange(nk, device=dev, dtype=torch.int64) * kb
    k_last = k_start + (kb - 1)
    nonempty = (k_start[None, :] < q_end[:, None]) & (mx[None, :] > q_start[:, None])
    full = (k_last[None, :] <= q_start[:, None]) & (mn[None, :] >= q_end[:, None])
    return nonempty & ~full, full


def _ordered(dense: torch.Tensor):
    """[..., rows, cols] bool -> (count [..., rows] int32, indices [..., rows, cols] int32), set entries first.

    Both outputs are contiguous: the kernels index them assuming row-major layout (a transposed,
    strided index tensor gives wrong backward gradients on CUDA).
    """
    d = dense.to(torch.int32, memory_format=torch.contiguous_format)
    num = d.sum(-1, dtype=torch.int32).contiguous()
    idx = torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32, memory_format=torch.contiguous_format)
    return num, idx


def tree_block_mask(subtree_end: torch.Tensor, *, block_size=DEFAULT_BLOCK_SIZE,
                    validate: bool = True) -> BlockMask:
    """BlockMask of a DFS-serialised tree (``q`` sees ``k`` iff ``k <= q < subtree_end[k]``).

    Args:
        subtree_end: ``[T]`` integer tensor on the device the attention runs on.  Padding tokens of a
            TreeBatch have ``subtree_end[t] = t + 1`` (they see only themselves); T need not be a
            multiple of the block size.
        block_size: ``(q_block, kv_block)`` of the sparse mask (or one int); powers of two; the
            kernel's BLOCK_M / BLOCK_N must divide them.
        validate: check ``k < subtree_end[k] <= T`` (one host synchronisation) and raise ValueError
            naming the first bad token.

    Returns a BlockMask with batch/head dims of size 1, kv- and q-side indices for partial and full
    tiles, and ``tree_mask_mod`` for the partial tiles.
    """
    qb, kb = block_pair(block_size)
    if subtree_end.dim() != 1:
        raise ValueError(f"subtree_end: expected a 1-D tensor [T], got shape {tuple(subtree_end.shape)}")
    if subtree_end.dtype.is_floating_point or subtree_end.dtype == torch.bool:
        raise ValueError(f"subtree_end: expected an integer tensor, got dtype {subtree_end.dtype}")
    T = subtree_end.numel()
    if validate and T:
        check_subtree_end(subtree_end)
    partial, full = tree_block_classes(subtree_end, block_size=(qb, kb))
    mask_se = F.pad(subtree_end.to(torch.int64), (0, partial.shape[1] * kb - T))
    return block_mask_from_classes(partial, full, seq_lengths=(T, T), block_size=(qb, kb),
                                   mask_mod=tree_mask_mod(mask_se))


def tree_window_mask_mod(subtree_end: torch.Tensor, position_ids: torch.Tensor, window: int):
    """mask_mod of the tree under a sliding window of ``window`` tokens along each path: query q sees key k iff
    ``k <= q < subtree_end[k]`` and ``position_ids[q] - position_ids[k] < window`` (both padded past T)."""

    def tree_window_mask(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])
                & (position_ids[q_idx] - position_ids[kv_idx] < window))

    return tree_window_mask


def tree_window_block_mask(subtree_end: torch.Tensor, position_ids: torch.Tensor, window: int, *,
                           block_size=DEFAULT_BLOCK_SIZE, validate: bool = True) -> BlockMask:
    """BlockMask of a DFS-serialised tree under a sliding window along each path (see
    :func:`tree_window_mask_mod`; ``position_ids [T]`` the tokens' depths).  The tree's non-empty tiles, less those
    whose every query is at least ``window`` deeper than every key; full are the tree's full tiles whose deepest
    query is less than ``window`` deeper than their shallowest key (the window cuts no pair), the others evaluate
    the mask_mod."""
    qb, kb = block_pair(block_size)
    if window < 1:
        raise ValueError(f"window: expected a positive number of tokens, got {window}")
    T = subtree_end.numel()
    if position_ids.shape != subtree_end.shape:
        raise ValueError(f"position_ids: expected shape {tuple(subtree_end.shape)} like subtree_end, got "
                         f"{tuple(position_ids.shape)}")
    if validate and T:
        check_subtree_end(subtree_end)
    partial, full = tree_block_classes(subtree_end, block_size=(qb, kb))
    nq, nk = partial.shape
    pos = position_ids.to(torch.int64)
    # pad with the extremes that never prune: the deepest query at least, the shallowest key at most
    q_pos = F.pad(pos, (0, nq * qb - T), value=2 ** 40).view(nq, qb)  # padding never prunes a tile
    k_pos = F.pad(pos, (0, nk * kb - T), value=-2 ** 40).view(nk, kb)
    reach = (q_pos.amin(1)[:, None] - k_pos.amax(1)[None, :]) < window
    # padding in a tile makes it not `within` (its pad values are the extremes): such a tile stays partial
    within = (q_pos.amax(1)[:, None] - k_pos.amin(1)[None, :]) < window
    n = max(nq * qb, nk * kb)
    mask_se = F.pad(subtree_end.to(torch.int64), (0, n - T))
    mask_pos = F.pad(pos, (0, n - T))
    return block_mask_from_classes((partial | (full & ~within)) & reach, full & within, seq_lengths=(T, T),
                                   block_size=(qb, kb), mask_mod=tree_window_mask_mod(mask_se, mask_pos, window))


def block_mask_from_classes(partial: torch.Tensor, full: torch.Tensor, *, seq_lengths: tuple[int, int],
                            block_size: tuple[int, int], mask_mod) -> BlockMask:
    """A BlockMask (batch/head dims of size 1) from bool tile classes ``partial, full [nq, nk]``:
    kv- and q-side index lists of both, ``mask_mod`` evaluated on the partial tiles only."""
    kv = torch.stack([partial, full])[:, None]  # [2, 1, nq, nk]: (class, head) batch dims
    kv_num, kv_idx = _ordered(kv)
    q_num, q_idx = _ordered(kv.transpose(-2, -1))
    # each index tensor its own contiguous [1, 1, ...] storage (no views into the stacked results)
    kv_num, kv_idx, q_num, q_idx = (t.split(1) for t in (kv_num, kv_idx, q_num, q_idx))
    own = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731
    return BlockMask(
        seq_lengths=tuple(seq_lengths),
        kv_num_blocks=own(kv_num[0]),
        kv_indices=own(kv_idx[0]),
        full_kv_num_blocks=own(kv_num[1]),
        full_kv_indices=own(kv_idx[1]),
        q_num_blocks=own(q_num[0]),
        q_indices=own(q_idx[0]),
        full_q_num_blocks=own(q_num[1]),
        full_q_indices=own(q_idx[1]),
        BLOCK_SIZE=tuple(block_size),
        mask_mod=mask_mod,
    )


def kernel_options_for(q: torch.Tensor) -> dict | None:
    """The kernel options ``tree_attention_flex`` uses for ``q``: tuned on Hopper (bf16/fp16, D=128)."""
    if (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] == 128
            and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return dict(HOPPER_KERNEL_OPTIONS)
    return None


# Kernel options of the windowed tree mask (tree_window_mask_mod) on Hopper, bf16/fp16, head_dim 128: the
# HOPPER_KERNEL_OPTIONS need 233,472 bytes of shared memory once the mask_mod also reads the depths (an H100 has
# 232,448).  Two stages instead of three: benchmarks/bench_window_attention.py --configs on an H100 (session 30,
# benchmarks/results/HISTORY.md) put it 1-4 % ahead of torch's defaults forward (fwd+bwd within 1 %) on 16k and 32k trees.
WINDOW_KERNEL_OPTIONS: dict = {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8}


def window_kernel_options_for(q: torch.Tensor) -> dict:
    """Kernel options for the windowed tree mask and ``q``: :data:`WINDOW_KERNEL_OPTIONS` where
    :func:`kernel_options_for` tunes the plain tree mask, else torch's defaults (``{}``)."""
    return dict(WINDOW_KERNEL_OPTIONS) if kernel_options_for(q) is not None else {}


def check_tree_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, *,
                                enable_gqa: bool = False) -> None:
    """Raise ValueError unless q ``[B, H, T, D]``, k, v ``[B, Hkv, T, D]`` fit each other and ``block_mask``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected [B, H, T, D] tensors, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    T = q.shape[2]
    if k.shape[2] != T or v.shape[2] != T:
        raise ValueError(f"q, k, v: sequence lengths differ ({T}, {k.shape[2]}, {v.shape[2]})")
    if tuple(block_mask.seq_lengths) != (T, T):
        raise ValueError(f"block_mask: built for seq_lengths {tuple(block_mask.seq_lengths)}, the inputs have T={T}")
    if k.shape[1] != q.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads, k/v have {k.shape[1]}: pass enable_gqa=True")


_COMPILED = None
RECOMPILE_LIMIT = 64  # distinct (shape, kernel options) the eager entry points compile before dynamo refuses


def compiled_flex():
    """``torch.compile(flex_attention, dynamic=False, fullgraph=True)``, made once on first use, called
    with dynamo's ``recompile_limit`` raised to at least :data:`RECOMPILE_LIMIT` for the call only (each
    distinct length compiles once; with the default 8, a ninth length failed with
    ``FailOnRecompileLimitHit``)."""
    global _COMPILED
    if _COMPILED is None:  # made on first use, never at import
        _COMPILED = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _call_compiled


def _call_compiled(*args, **kwargs):
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    with torch._dynamo.config.patch(recompile_limit=limit):
        return _COMPILED(*args, **kwargs)


def tree_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, *,
                        scale: float | None = None, enable_gqa: bool = False,
                        kernel_options: dict | None = None) -> torch.Tensor:
    """Compiled FlexAttention under a tree block mask; returns ``[B, H, T, D]`` (autograd native).

    Args:
        q: ``[B, H, T, D]``; k, v: ``[B, Hkv, T, D]`` (``Hkv == H`` unless ``enable_gqa``).
        block_mask: from :func:`tree_block_mask` for this ``T``.
        scale: softmax scale, default ``1/sqrt(D)``.
        kernel_options: FlexAttention kernel options; None means :func:`kernel_options_for` ``(q)``.

    Each distinct T compiles once (``dynamic=False``): bucket sequence lengths upstream.
    """
    check_tree_attention_inputs(q, k, v, block_mask, enable_gqa=enable_gqa)
    if kernel_options is None:
        kernel_options = kernel_options_for(q)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                            kernel_options=kernel_options)
