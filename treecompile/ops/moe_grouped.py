"""Routed experts through grouped GEMMs, without host syncs: ``treecompile::moe_experts_grouped``.

The same function, signature and sentinel rule as ``treecompile::moe_experts`` (``ops.moe``, whose module
docstring gives the shapes and the math), computed with ``torch._grouped_mm`` (CUTLASS grouped GEMM on
sm90/sm100 in bfloat16; a per-group ``mm`` loop elsewhere, which reads the offsets on the host).
``passes.lower_cuda`` puts it in place of ``moe_experts`` on Hopper for bfloat16 experts.

Dispatch, all on the device (``P = T * k`` routed pairs, ``e(p)`` the expert of pair ``p``):

1. ``perm``: the pairs stably sorted by expert; the sentinel ``E`` ("skip this pair") is routed to
   expert ``E - 1`` with its weight forced to 0.  ``offs [E]`` int32 = end of each expert's group
   (``searchsorted`` of the sorted experts: the cumulative counts; no ``bincount``, which reads its
   maximum on the host on CUDA).
2. ``x = hidden[perm // k]``; ``h = x @ gate_up_proj[e]^T`` (grouped); ``a = silu(gate) * up``;
   ``y = (w * a) @ down_proj[e]^T`` (grouped: the routing weight scales the ``[P, I]`` activation, which
   is exact up to rounding since the down projection is linear, and a zero weight gives exactly 0 for a
   finite activation).
3. ``out[t] = sum_j y[inv[t * k + j]]`` with ``inv`` the inverse permutation: a gather and a sum over
   ``k`` in a fixed order, deterministic and free of atomics (``index_add`` on CUDA is neither).

Where Triton runs (CUDA; the CPU under its interpreter) the elementwise work between the GEMMs (the activation
and routing weight, its backward with ``d_w``) and the sum over ``k`` are one Triton kernel each, in float32,
rounded once (:mod:`treecompile.ops.moe_triton`); elsewhere the torch ops below.

Backward (``treecompile::moe_experts_grouped_backward``; activations recomputed as in ``moe_experts``'s):
``g = dout @ down_proj[e]`` (grouped), ``d_w = <g, a>`` (equal to ``<dout, y>``; 0 for sentinel
pairs), ``da = w * g``, ``dh = [da * u * silu'(gate); da * silu(gate)]``, ``d_down[e] = dout_e^T (w a)_e``
and ``d_gate_up[e] = dh_e^T x_e`` (grouped over the contraction: ``_grouped_mm(A.t(), B, offs)``), and
``d_x = dh @ gate_up_proj[e]`` gathered back and summed over ``k`` like the forward's output.

``_grouped_mm`` requirements met here: both operands of one dtype in {float32, bfloat16, float16} (no
float64: use ``moe_experts``), row strides multiples of 16 bytes (``D`` and ``I`` times the element size;
checked, ValueError), int32 offsets, at most 1023 groups on CUDA.  The contraction-grouped GEMMs take
``A`` column-major and ``B`` row-major, the layout whose CUDA kernel accepts empty groups; an expert with
no pair gets an exactly zero weight gradient: the CPU loop's ``mm`` over an empty contraction writes
zeros, the sm90 kernel writes zeros (checked by the GPU test), and elsewhere on CUDA (Blackwell kernels
were reported to leave them unwritten, pytorch#172439) they are zeroed explicitly.

Bad indices: on CPU the ValueError of ``moe_experts``; on CUDA a device-side assert
(``torch._assert_async``: reading the indices on the host is the sync this op avoids), which fails the
next synchronizing call as torch's own indexing kernels do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from treecompile.ops import moe_triton
from treecompile.ops.moe import check_moe_args, check_moe_index

__all__ = ["moe_experts_grouped", "moe_experts_grouped_backward", "GROUPED_DTYPES"]

GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes


def _check_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    check_moe_args(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    dtypes = {hidden.dtype, gate_up_proj.dtype, down_proj.dtype}
    if len(dtypes) != 1 or hidden.dtype not in GROUPED_DTYPES:
        raise ValueError(f"moe_experts_grouped: hidden, gate_up_proj and down_proj must share one dtype of "
                         f"{GROUPED_DTYPES} (torch._grouped_mm), got {hidden.dtype}, {gate_up_proj.dtype}, "
                         f"{down_proj.dtype}; treecompile::moe_experts takes any dtype")
    D, I = hidden.shape[1], down_proj.shape[2]
    if (D * hidden.element_size()) % 16 or (I * hidden.element_size()) % 16:
        raise ValueError(f"moe_experts_grouped: D={D} and I={I} must be multiples of "
                         f"{16 // hidden.element_size()} for {hidden.dtype} (torch._grouped_mm: 16-byte strides)")


def _check_index(top_k_index: Tensor, E: int) -> None:
    """Entries in ``[0, E]``: ValueError on CPU, a device-side assert on other devices (no host sync)."""
    if top_k_index.device.type == "cpu":
        check_moe_index(top_k_index, E)
    elif top_k_index.numel():
        ok = ((top_k_index >= 0) & (top_k_index <= E)).all()
        torch._assert_async(ok, f"moe_experts_grouped: top_k_index outside [0, {E}]")


def _kernel_zeroes_empty_groups(device: torch.device) -> bool:
    """Whether ``_grouped_mm(A.t(), B, offs)`` writes zeros for a group with an empty contraction:
    CPU (per-group ``mm``) and sm90 (checked on H100 by the GPU test); elsewhere it is not relied on."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _routing(top_k_index: Tensor, top_k_weights: Tensor, E: int):
    """(perm [P], inv [P], offs [E] int32, w [P] in sorted order (0 at sentinels), valid [P] sorted)."""
    flat = top_k_index.reshape(-1).long()
    valid = flat < E
    keys, perm = torch.sort(flat.clamp(max=E - 1), stable=True)
    offs = torch.searchsorted(keys, torch.arange(E, device=keys.device), right=True, out_int32=True)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    valid = valid.index_select(0, perm)
    w = torch.where(valid, top_k_weights.reshape(-1).index_select(0, perm), 0)
    return perm, inv, offs, w, valid


def _sum_over_k(rows: Tensor, inv: Tensor, T: int, k: int) -> Tensor:
    """``[P, D]`` rows in expert order -> ``[T, D]``: token t sums its k pairs (fixed order)."""
    if moe_triton.usable(rows):
        return moe_triton.sum_over_k(rows, inv, T, k)  # the gather and the sum in one pass
    per_pair = rows.index_select(0, inv)
    return per_pair if k == 1 else per_pair.view(T, k, -1).sum(1)


def _activation_backward(h: Tensor, g: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(dh, w a, <g, a>)`` by torch ops (where :mod:`moe_triton`'s kernel cannot run): ``h = [gate, up]``,
    ``a = silu(gate) * up``, ``g = dL/d(w a)``; ``dh = [da * up * silu'(gate), da * silu(gate)]``, ``da = w g``."""
    gate, up = h.chunk(2, dim=-1)
    s = torch.nn.functional.silu(gate)
    a = s * up
    d_w = (g * a).sum(-1)
    da = g.mul_(w[:, None])
    dh = torch.empty_like(h)
    dgate, dup = dh.chunk(2, dim=-1)
    torch.mul(da, s, out=dup)
    sig = torch.sigmoid(gate)
    dsilu = gate * (1 - sig)
    torch.mul(dsilu.add_(1).mul_(sig).mul_(up), da, out=dgate)
    return dh, a.mul_(w[:, None]), d_w


@torch.library.custom_op("treecompile::moe_experts_grouped", mutates_args=())
def moe_experts_grouped(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
                        down_proj: Tensor) -> Tensor:
    """``treecompile::moe_experts`` through grouped GEMMs (module docstring). Returns ``[T, D]``."""
    _check_grouped(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    (T, k), E = top_k_index.shape, gate_up_proj.shape[0]
    _check_index(top_k_index, E)
    if T * k == 0 or E == 0:
        return torch.zeros_like(hidden)
    perm, inv, offs, w, _ = _routing(top_k_index, top_k_weights, E)
    x = hidden.index_select(0, perm // k)
    h = torch._grouped_mm(x, gate_up_proj.transpose(-2, -1), offs=offs)
    if moe_triton.usable(h):
        a = moe_triton.activation(h, w)  # w * silu(gate) * up, one pass
    else:
        gate, up = h.chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate).mul_(up).mul_(w[:, None])  # w * silu(gate) * up, in place
    return _sum_over_k(torch._grouped_mm(a, down_proj.transpose(-2, -1), offs=offs), inv, T, k)


@moe_experts_grouped.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("treecompile::moe_experts_grouped_backward", mutates_args=())
def moe_experts_grouped_backward(grad_out: Tensor, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                                 gate_up_proj: Tensor, down_proj: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(d_hidden, d_top_k_weights, d_gate_up_proj, d_down_proj)`` of :func:`moe_experts_grouped`."""
    (T, k), E = top_k_index.shape, gate_up_proj.shape[0]
    if T * k == 0 or E == 0:
        return (torch.zeros_like(hidden), torch.zeros_like(top_k_weights), torch.zeros_like(gate_up_proj),
                torch.zeros_like(down_proj))
    perm, inv, offs, w, valid = _routing(top_k_index, top_k_weights, E)
    x = hidden.index_select(0, perm // k)
    h = torch._grouped_mm(x, gate_up_proj.transpose(-2, -1), offs=offs)  # recomputed
    dout = grad_out.index_select(0, perm // k)
    g = torch._grouped_mm(dout, down_proj, offs=offs)  # [P, I]: dL/d(w a)
    if moe_triton.usable(h):  # dh, w a and <g, a> in one pass
        dh, aw, d_w = moe_triton.activation_backward(h, g, w)
    else:
        dh, aw, d_w = _activation_backward(h, g, w)
    d_w = torch.where(valid, d_w, 0)
    d_down = torch._grouped_mm(dout.t(), aw, offs=offs)  # [E, D, I]
    d_gu = torch._grouped_mm(dh.t(), x, offs=offs)  # [E, 2I, D]
    if not _kernel_zeroes_empty_groups(hidden.device):
        nonempty = torch.diff(offs, prepend=offs.new_zeros(1)) > 0
        d_down = torch.where(nonempty[:, None, None], d_down, 0)
        d_gu = torch.where(nonempty[:, None, None], d_gu, 0)
    d_hidden = _sum_over_k(torch._grouped_mm(dh, gate_up_proj, offs=offs), inv, T, k)
    d_w = d_w.index_select(0, inv).view(T, k).to(top_k_weights.dtype)
    return d_hidden, d_w, d_gu, d_down


@moe_experts_grouped_backward.register_fake
def _(grad_out, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return (hidden.new_empty(hidden.shape), top_k_weights.new_empty(top_k_weights.shape),
            gate_up_proj.new_empty(gate_up_proj.shape), down_proj.new_empty(down_proj.shape))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    hidden, idx, w, gu, down = ctx.saved_tensors
    dh, dw, dgu, ddown = moe_experts_grouped_backward(grad.contiguous(), hidden, idx, w, gu, down)
    return dh, None, dw, dgu, ddown


moe_experts_grouped.register_autograd(_backward, setup_context=_setup_context)
