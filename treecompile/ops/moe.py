"""Routed mixture-of-experts MLP as one opaque op: ``treecompile::moe_experts``.

Hugging Face's experts modules (``Qwen3NextExperts``, ``Qwen3_5MoeExperts``, ... decorated with
``use_experts_implementation``) cannot be exported with a dynamic length: the eager forward loops
over the experts that were hit (a data-dependent count) and the ``grouped_mm`` default refuses
float64.  During capture only, the frontend swaps such a module's forward for
``treecompile.hf_adapters.hf_experts_forward``, which calls this op; the sparse dispatch (sort by expert, gather,
per-expert matmuls, scatter-add) happens inside the op, so the graph holds one node per MoE layer
whose shapes depend only on ``T``.

Shapes: ``hidden [T, D]``, ``top_k_index [T, k]`` int64 (entries in ``[0, E]``; ``E`` is HF's
expert-parallel sentinel and contributes nothing, as in HF's eager loop), ``top_k_weights [T, k]``,
``gate_up_proj [E, 2I, D]`` (rows ``[gate; up]``), ``down_proj [E, D, I]``.  Per routed pair
``(t, j)`` with ``e = top_k_index[t, j]``:

    out[t] += top_k_weights[t, j] * down_proj[e] @ (silu(gate_e x_t) * (up_e x_t))

This op is the reference: plain torch (any device, float64-capable, computes in the inputs' dtype), a
host loop over the experts that were hit (their offsets read on the host, one matmul pair per expert,
``index_add``).  Its backward is written out as ``treecompile::moe_experts_backward`` (activations
recomputed per expert) and returns gradients for ``hidden``, ``top_k_weights`` (hence the router)
and both expert weights.  The fast path is ``treecompile::moe_experts_grouped`` (``ops.moe_grouped``: the
same function through ``torch._grouped_mm``, no host sync), which ``passes.lower_cuda`` puts in its place on
Hopper for bfloat16 experts.  Ops are registered at import.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["moe_experts", "moe_experts_reference", "check_moe_args", "check_moe_index"]


def check_moe_args(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """Raise ValueError unless the arguments have the shapes of the module docstring."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected [T, D], got {tuple(hidden.shape)}")
    T, D = hidden.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != T or top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"top_k_index: expected int64 [T={T}, k], got {top_k_index.dtype} {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights: expected {tuple(top_k_index.shape)} like top_k_index, "
                         f"got {tuple(top_k_weights.shape)}")
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != D or gate_up_proj.shape[1] % 2:
        raise ValueError(f"gate_up_proj: expected [E, 2I, D={D}], got {tuple(gate_up_proj.shape)}")
    E, two_i, _ = gate_up_proj.shape
    if down_proj.shape != (E, D, two_i // 2):
        raise ValueError(f"down_proj: expected [E, D, I] = {(E, D, two_i // 2)}, got {tuple(down_proj.shape)}")


def check_moe_index(top_k_index: Tensor, E: int) -> None:
    """Raise ValueError naming the first entry of ``top_k_index`` outside ``[0, E]`` (reads the values:
    a host sync on CUDA)."""
    flat = top_k_index.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) > E):
        bad = int(((flat < 0) | (flat > E)).nonzero()[0, 0])
        k = top_k_index.shape[1]
        raise ValueError(f"top_k_index[{bad // k}, {bad % k}] = {int(flat[bad])} is outside [0, {E}] "
                         f"({E} experts; {E} is the skipped expert-parallel sentinel)")


def _dispatch(top_k_index: Tensor, E: int):
    """Routed pairs grouped by expert: (pair order sorted by expert, [E + 1] group offsets)."""
    flat = top_k_index.reshape(-1).long()
    check_moe_index(top_k_index, E)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E + 1)
    offsets = torch.zeros(E + 2, dtype=torch.long, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return order, offsets.tolist()


def _expert_pairs(hidden, top_k_index, E):
    """Yield (expert, pair rows into the flattened [T * k], token rows) for every expert with pairs."""
    k = top_k_index.shape[1]
    order, off = _dispatch(top_k_index, E)
    for e in range(E):
        if off[e + 1] > off[e]:
            rows = order[off[e]:off[e + 1]]
            yield e, rows, rows // k


@torch.library.custom_op("treecompile::moe_experts", mutates_args=())
def moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
                down_proj: Tensor) -> Tensor:
    """Routed SwiGLU experts, sparse dispatch (see module docstring). Returns ``[T, D]``."""
    check_moe_args(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    E = gate_up_proj.shape[0]
    out = torch.zeros_like(hidden)
    w = top_k_weights.reshape(-1)
    for e, rows, tok in _expert_pairs(hidden, top_k_index, E):
        gate, up = (hidden[tok] @ gate_up_proj[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ down_proj[e].T
        out.index_add_(0, tok, (y * w[rows, None]).to(out.dtype))
    return out


@moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return hidden.new_empty(hidden.shape)


@torch.library.custom_op("treecompile::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad_out: Tensor, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                         gate_up_proj: Tensor, down_proj: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(d_hidden, d_top_k_weights, d_gate_up_proj, d_down_proj)`` of :func:`moe_experts`.

    Per expert, with x the routed tokens, h = [g; u] = W_gu x, s = silu(g), a = s * u, y = W_d a,
    out += w * y:  dw = <dout, y>, dy = w * dout, dW_d = dy^T a, da = dy W_d,
    dg = da * u * silu'(g), du = da * s, dW_gu = [dg; du]^T x, dx = [dg; du] W_gu.
    """
    E = gate_up_proj.shape[0]
    w = top_k_weights.reshape(-1)
    d_hidden = torch.zeros_like(hidden)
    d_w = torch.zeros_like(w)
    d_gu = torch.zeros_like(gate_up_proj)
    d_down = torch.zeros_like(down_proj)
    for e, rows, tok in _expert_pairs(hidden, top_k_index, E):
        x = hidden[tok]
        gate, up = (x @ gate_up_proj[e].T).chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        s = gate * sig
        a = s * up
        y = a @ down_proj[e].T
        dout = grad_out[tok]
        d_w[rows] = (dout * y).sum(-1).to(d_w.dtype)
        dy = dout * w[rows, None]
        d_down[e] = dy.T @ a
        da = dy @ down_proj[e]
        dh = torch.cat([da * up * sig * (1 + gate * (1 - sig)), da * s], dim=-1)
        d_gu[e] = dh.T @ x
        d_hidden.index_add_(0, tok, dh @ gate_up_proj[e])
    return d_hidden, d_w.reshape(top_k_weights.shape).contiguous(), d_gu, d_down


@moe_experts_backward.register_fake
def _(grad_out, hidden, top_k_index, top_k_weights, gate_up_proj, down_proj):
    return (hidden.new_empty(hidden.shape), top_k_weights.new_empty(top_k_weights.shape),
            gate_up_proj.new_empty(gate_up_proj.shape), down_proj.new_empty(down_proj.shape))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    hidden, idx, w, gu, down = ctx.saved_tensors
    dh, dw, dgu, ddown = moe_experts_backward(grad.contiguous(), hidden, idx, w, gu, down)
    return dh, None, dw, dgu, ddown


moe_experts.register_autograd(_backward, setup_context=_setup_context)


def moe_experts_reference(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
                          down_proj: Tensor) -> Tensor:
    """The same function computed densely with autograd (every expert on every token): for tests."""
    E = gate_up_proj.shape[0]
    gate, up = torch.einsum("td,efd->tef", hidden, gate_up_proj).chunk(2, dim=-1)
    y = torch.einsum("tei,edi->ted", torch.nn.functional.silu(gate) * up, down_proj)  # [T, E, D]
    dense_w = hidden.new_zeros(hidden.shape[0], E + 1).scatter_add(1, top_k_index.long(), top_k_weights)
    return torch.einsum("te,ted->td", dense_w[:, :E], y)
