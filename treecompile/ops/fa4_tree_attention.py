"""Tree attention on Hopper through FlashAttention-4 (``flash-attn-4``, CuTe DSL; extra ``treecompile[hopper]``).

Two ways to run the FA4 kernels under the tree's interval BlockMask (``flex_tree_attention.tree_block_mask``):

* **flex FLASH** (what the CUDA lowering uses): torch's ``flex_attention(..., kernel_options={"BACKEND":
  "FLASH"})``.  Inductor renders the mask_mod (``k <= q < subtree_end[k]``, ``subtree_end`` a captured
  buffer) as a CuTe ``mask_mod`` reading an aux tensor, passes the BlockMask's kv lists to FA4's forward
  and its q lists to FA4's backward, and compiles the attention with the rest of the graph: no
  autograd Function, no graph break, the same BlockMask as the Triton flex path.
* **direct** (:func:`tree_attention_fa4_direct`, for the benchmark; the varlen op's block-sparse plan calls the
  same kernels with :func:`cute_tree_mask`, ops/varlen_tree_attention.py): ``flash_attn.cute.flash_attn_func``
  with a hand-written CuTe ``mask_mod`` reading ``subtree_end`` from ``aux_tensors`` and the BlockMask's
  lists as ``block_sparse_tensors`` / ``block_sparse_tensors_bwd``.  Same kernels; it is an autograd
  Function that dynamo cannot trace into, so inside a compiled graph it would split the graph at every
  attention layer.

Both reach the same FA4 kernels; benchmarks/bench_attention.py ``--fa4`` times them side by side
(benchmarks/results/HISTORY.md), and the lowering takes flex FLASH because it matches the direct call's speed
and keeps attention inside inductor's graph.

:func:`fa4_unusable_reason` says why FA4 cannot serve given inputs (None when it can): the lowering's
``attention_kernel="fa4"`` raises with it, ``"auto"`` falls back to the Triton flex kernel and warns.

Shapes: ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]``; the block mask has batch/head dims of size 1.
This module knows tensors and kernels only: it imports neither passes nor runtime, and imports
flash_attn lazily, never at import.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from .flex_tree_attention import check_tree_attention_inputs, tree_attention_flex

__all__ = [
    "FA4_KERNEL_OPTIONS",
    "FA4_HEAD_DIMS",
    "fa4_unusable_reason",
    "fa4_input_reason",
    "fa4_block_sparse_tensors",
    "tree_attention_fa4",
    "tree_attention_fa4_direct",
    "cute_tree_mask",
    "fa4_mask_end",
]

FA4_KERNEL_OPTIONS: dict = {"BACKEND": "FLASH"}
# head dims whose FA4 sm90 tiles fit the 128x128 sparse blocks (fwd tile_n 128, bwd tile_n 128); 256
# (Qwen3.5 attention) has fwd tile_n 80 and a 64-wide sparse backward: not this BlockMask.
FA4_HEAD_DIMS = (64, 128)
_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _import_reason() -> str | None:
    try:
        if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
            return "flash-attn-4 is not installed (pip install 'treecompile[hopper]')"
    except (ImportError, ValueError) as e:  # a broken flash_attn package
        return f"flash_attn.cute cannot be found ({type(e).__name__}: {e})"
    try:
        found = importlib.util.find_spec("torch._inductor.kernel.flex.flex_flash_attention") is not None
    except ImportError:
        found = False
    if not found:
        return f"torch {torch.__version__} has no FlexAttention FLASH backend (needs torch >= 2.11)"
    return None


@functools.lru_cache(maxsize=None)
def _device_reason(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"FlashAttention-4 needs sm_90 or newer, cuda:{index} is sm_{major}{minor}"
    return None


def fa4_input_reason(q: torch.Tensor, *, block_size=(128, 128)) -> str | None:
    """The checks on the inputs alone (CUDA, bf16/fp16, head dim in :data:`FA4_HEAD_DIMS`, 128x128
    sparse blocks): attribute reads only -- no imports, no device queries -- so dynamo traces it as
    plain Python on fake inputs."""
    if q.device.type != "cuda":
        return f"FlashAttention-4 runs on CUDA, the inputs are on {q.device}"
    if q.dtype not in _DTYPES:
        return f"FlashAttention-4 tree attention takes bf16/fp16, got {q.dtype}"
    if q.shape[-1] not in FA4_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} is not one of {FA4_HEAD_DIMS} (FA4's sm_90 tiles vs 128x128 sparse blocks)"
    if tuple(block_size) != (128, 128):
        return f"FA4 tree attention is built for 128x128 sparse blocks, got {tuple(block_size)}"
    return None


def fa4_unusable_reason(q: torch.Tensor | None = None, *, block_size=(128, 128)) -> str | None:
    """Why FA4 tree attention cannot serve ``q`` (``[B, H, T, D]``, real or fake), or None when it can.

    Checks: flash-attn-4 importable with torch's FLASH backend, a CUDA device of sm_90 or newer, then
    :func:`fa4_input_reason`.  ``q=None`` checks the installation and the current device only (call
    it outside traced code: it imports and queries the device).
    """
    reason = _import_reason()
    if reason:
        return reason
    if q is None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        return _device_reason(torch.cuda.current_device())
    reason = fa4_input_reason(q, block_size=block_size)
    if reason:
        return reason
    return _device_reason(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _check(q, k, v, block_mask, enable_gqa):
    check_tree_attention_inputs(q, k, v, block_mask, enable_gqa=enable_gqa)
    reason = fa4_unusable_reason(q, block_size=block_mask.BLOCK_SIZE)
    if reason:
        raise RuntimeError(f"FA4 tree attention: {reason}")


def tree_attention_fa4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask, *,
                       scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """FA4 under a tree block mask through compiled FlexAttention's FLASH backend; ``[B, H, T, D]``.

    For graphs that run eagerly (a compiled graph calls ``flex_attention`` with
    :data:`FA4_KERNEL_OPTIONS` itself).  Raises RuntimeError naming the reason when FA4 cannot run.
    """
    _check(q, k, v, block_mask, enable_gqa)
    return tree_attention_flex(q, k, v, block_mask, scale=scale, enable_gqa=enable_gqa,
                               kernel_options=dict(FA4_KERNEL_OPTIONS))


# ------------------------------------------------------------------------------------------ direct
def fa4_block_sparse_tensors(block_mask: BlockMask):
    """The BlockMask's tile lists as FA4 ``BlockSparseTensorsTorch``: (forward: kv lists per q block,
    backward: q lists per kv block), int32, ``block_size`` = the mask's (q, kv) block."""
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    bs = tuple(block_mask.BLOCK_SIZE)
    fwd = BlockSparseTensorsTorch(block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks,
                                  block_mask.full_kv_indices, block_size=bs)
    bwd = BlockSparseTensorsTorch(block_mask.q_num_blocks, block_mask.q_indices, block_mask.full_q_num_blocks,
                                  block_mask.full_q_indices, block_size=bs)
    return fwd, bwd


def fa4_mask_end(subtree_end: torch.Tensor, kv_block: int) -> torch.Tensor:
    """``subtree_end`` as :func:`cute_tree_mask`'s aux tensor: int32, padded with 0 to whole kv blocks (the kernel
    may evaluate the mask on columns past T in the last block; 0 hides them)."""
    T = subtree_end.numel()
    return F.pad(subtree_end.to(torch.int32), (0, -(-T // kv_block) * kv_block - T))


@functools.lru_cache(maxsize=1)
def cute_tree_mask():
    """The tree rule as a CuTe mask_mod: ``k <= q < subtree_end[k]``, ``subtree_end = aux_tensors[0]``."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def tree_mask(batch, head, m_idx, n_idx, seqlen_info, aux_tensors):
        se = aux_tensors[0]
        end = utils.scalar_to_ssa(se[n_idx[0]], cutlass.Int32)
        return (n_idx <= m_idx) & (m_idx < end)

    return tree_mask


def refuse_block_sparse_backward_if_deterministic(caller: str, instead: str) -> None:
    """Under ``torch.use_deterministic_algorithms(True)``, refuse a backward through FA4's block-sparse kernels, as
    torch's own non-deterministic ops are refused: RuntimeError naming ``caller`` and what to run ``instead``, or
    under ``warn_only=True`` a warning, and the caller runs it.  Their backward sums dQ by atomics; the
    deterministic form needs dQ write orders that treecompile does not build (and torch allows it only on sm100+
    for flex's FLASH backend).  Nothing outside that mode."""
    if not torch.are_deterministic_algorithms_enabled():
        return
    msg = (f"{caller}: FA4's block-sparse backward is not deterministic here (its deterministic form needs dQ write "
           f"orders), but torch.use_deterministic_algorithms(True) is set; {instead}")
    if not torch.is_deterministic_algorithms_warn_only_enabled():
        raise RuntimeError(msg)
    warnings.warn(msg + " (warn_only=True: running the non-deterministic backward)", stacklevel=3)


def tree_attention_fa4_direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, subtree_end: torch.Tensor,
                              block_mask: BlockMask, *, scale: float | None = None,
                              block_sparse=None) -> torch.Tensor:
    """``flash_attn.cute.flash_attn_func`` with the CuTe tree mask_mod; ``[B, H, T, D]`` (autograd native).

    ``subtree_end [T]`` as given to :func:`tree_block_mask`; ``block_sparse`` = the result of
    :func:`fa4_block_sparse_tensors` (built here when None).  GQA is native (``Hkv`` divides ``H``).  Its backward
    sums by atomics (FA4's deterministic block-sparse backward needs dQ write orders not built here): under
    ``torch.use_deterministic_algorithms(True)`` it raises, or warns under ``warn_only=True``.
    """
    refuse_block_sparse_backward_if_deterministic(
        "tree_attention_fa4_direct", "treecompile.ops.varlen_tree_attention.tree_attention_varlen runs the tree's "
        "segments deterministically")
    from flash_attn.cute import flash_attn_func

    _check(q, k, v, block_mask, enable_gqa=True)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    se = fa4_mask_end(subtree_end, block_mask.BLOCK_SIZE[1])
    fwd, bwd = block_sparse if block_sparse is not None else fa4_block_sparse_tensors(block_mask)
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          mask_mod=cute_tree_mask(), aux_tensors=[se], block_sparse_tensors=fwd,
                          block_sparse_tensors_bwd=bwd)
    if isinstance(out, tuple):  # (out, lse) in some versions
        out = out[0]
    return out.transpose(1, 2)
