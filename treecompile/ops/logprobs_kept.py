"""``treecompile::linear_logprobs_kept``: the fused head that keeps its logits for the backward.

Same arguments (but ``chunk``) and the same first three results as ``treecompile::linear_logprobs``
(:mod:`treecompile.ops.logprobs`), plus a fourth: the logits ``h @ W.T (+ b)`` in the model's dtype,
``[N, V]``.  The chunked heads bound their memory to one ``[chunk, V]`` block and pay for it in the backward:
each chunk's logits are recomputed (a fourth head GEMM per token where a full-logits model runs three) and the
float32 ``dW [V, D]`` is read and written once per chunk.  This op runs the head as the unmodified model does:
one logits GEMM forward, and backward one ``dh = dL @ W`` and one ``dW = dL.T @ h`` GEMM over all rows,
``dW`` accumulated in float32 and rounded once (as the chunked heads do).  It costs ``N x V`` elements of
memory from the forward to the head's backward; the CUDA lowering chooses it (``head_logits``,
:mod:`treecompile.passes.lower_cuda`), nothing in the rewritten graph does.

The backward overwrites the saved logits with their gradient (no second ``[N, V]`` buffer) and bumps their
version counter, so a second backward through the same graph (``retain_graph=True``) raises autograd's
"modified by an inplace operation" error instead of reading gradients as logits.

The row statistics and the logits' gradient are the reference formulas (``chunk_stats``,
``chunk_dlogits``, upcast ``default_chunk(V)`` rows at a time, the reference head's own bound) on any
device, and the Triton row kernels of :mod:`treecompile.ops.logprobs_triton` on CUDA half precision (one
launch over all rows).
"""

from __future__ import annotations

import torch

from treecompile.ops import logprobs_triton
from treecompile.ops.logprobs import _acc_dtype, chunk_dlogits, chunk_logits, chunk_stats, default_chunk
from treecompile.ops.triton_support import usable

__all__ = ["linear_logprobs_kept", "logits_bytes"]

HALF = (torch.bfloat16, torch.float16)


def logits_bytes(n: int, vocab: int, dtype: torch.dtype) -> int:
    """The memory this op keeps from the forward to the backward: ``n x vocab`` logits of ``dtype``."""
    return n * vocab * dtype.itemsize


def _triton(h: torch.Tensor) -> bool:
    return h.dtype in HALF and usable(h)


def _weight_grad(dl: torch.Tensor, h: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """``dl.T @ h`` accumulated in float32 (float64 for a float64 model) and rounded once to ``W``'s dtype.

    Not ``logprobs.accumulate_weight_grad`` into a zeroed float32 buffer: with one GEMM there is nothing to
    accumulate into, and the zero fill and read of ``[V, D]`` float32 cost 1.8 ms of 24 on the MoE head (H100,
    ``benchmarks/results/h100_s25/dw.jsonl``)."""
    if dl.is_cuda and dl.dtype in HALF:
        return torch.mm(dl.t(), h, out_dtype=torch.float32).to(W.dtype)
    acc = _acc_dtype(dl.dtype)
    return (dl.t().to(acc) @ h.to(acc)).to(W.dtype)


@torch.library.custom_op("treecompile::linear_logprobs_kept", mutates_args=())
def linear_logprobs_kept(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
                         entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs [N], lse [N], entropy [N] if entropy else [0], logits [N, V])``; the first three as
    ``treecompile::linear_logprobs`` returns them (float32, or float64 for a float64 model).  The logits are
    the backward's working buffer: its backward overwrites them with their gradient, so a caller reads them
    before the backward or not at all (``passes.lower_cuda._fused_head`` drops them)."""
    N = h.shape[0]
    acc = _acc_dtype(h.dtype)
    logits = chunk_logits(h, W, b)
    lp = torch.empty(N, dtype=acc, device=h.device)
    lse = torch.empty(N, dtype=acc, device=h.device)
    ent = torch.empty(N if entropy else 0, dtype=acc, device=h.device)
    if _triton(h):
        logprobs_triton.stats_(logits, targets.contiguous(), lp, lse, ent if entropy else None)
        return lp, lse, ent, logits
    rows = default_chunk(W.shape[0])
    for s in range(0, N, rows):
        sl = slice(s, s + rows)
        c_lp, c_lse, c_ent = chunk_stats(logits[sl].to(acc), targets[sl], entropy)
        lp[sl], lse[sl] = c_lp, c_lse
        if entropy:
            ent[sl] = c_ent
    return lp, lse, ent, logits


@linear_logprobs_kept.register_fake
def _(h, W, b, targets, entropy=False):
    N = h.shape[0]
    acc = _acc_dtype(h.dtype)
    return (h.new_empty(N, dtype=acc), h.new_empty(N, dtype=acc), h.new_empty(N if entropy else 0, dtype=acc),
            h.new_empty(N, W.shape[0]))


@torch.library.custom_op("treecompile::linear_logprobs_kept_backward", mutates_args=())
def linear_logprobs_kept_backward(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None,
                                  targets: torch.Tensor, lse: torch.Tensor, ent: torch.Tensor,
                                  logits: torch.Tensor, grad_lp: torch.Tensor, grad_lse: torch.Tensor,
                                  grad_ent: torch.Tensor | None
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d h, d W, d b or [0])`` of :func:`linear_logprobs_kept`; ``grad_ent`` None: the entropy is not
    differentiated.

    ``logits`` is the forward's own fourth result, which nothing but this backward reads: it is overwritten
    with d(loss)/d(logits) in place (a mutation the schema does not declare: no other op reads the tensor) and
    its version counter is bumped, so any later read through autograd raises."""
    acc = _acc_dtype(h.dtype)
    targets = targets.contiguous()
    g, gl = grad_lp.to(acc).contiguous(), grad_lse.to(acc).contiguous()
    ge = None if grad_ent is None else grad_ent.to(acc).contiguous()
    e = None if ge is None else ent
    if _triton(h):
        logprobs_triton.dlogits_(logits, targets, lse, g, gl, e, ge)
    else:
        rows = default_chunk(W.shape[0])
        for s in range(0, h.shape[0], rows):
            sl = slice(s, s + rows)
            logits[sl] = chunk_dlogits(logits[sl].to(acc), targets[sl], lse[sl], g[sl], gl[sl],
                                       None if e is None else e[sl], None if ge is None else ge[sl])
    torch.autograd.graph.increment_version(logits)
    dl = logits
    gh = dl @ W
    gW = _weight_grad(dl, h, W)
    gb = dl.sum(0, dtype=acc).to(b.dtype) if b is not None else W.new_empty(0)
    return gh, gW, gb


@linear_logprobs_kept_backward.register_fake
def _(h, W, b, targets, lse, ent, logits, grad_lp, grad_lse, grad_ent):
    return torch.empty_like(h), torch.empty_like(W), W.new_empty(W.shape[0] if b is not None else 0)


def _setup(ctx, inputs, output):
    h, W, b, targets, *rest = inputs
    ctx.save_for_backward(h, W, b, targets, output[1], output[2], output[3])
    ctx.has_bias = b is not None
    ctx.entropy = bool(rest[0]) if rest else False
    ctx.mark_non_differentiable(output[3])
    # else autograd hands the backward a zero [N, V] "gradient" of the logits (and zeros for unused outputs):
    # as much memory as the kept logits, and a memset of it (H100, the MoE head: peak +7.1 GiB)
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_lp, grad_lse, grad_ent, _grad_logits):
    h, W, b, targets, lse, ent, logits = ctx.saved_tensors  # _grad_logits: None (non-differentiable)
    grad_lp = torch.zeros_like(lse) if grad_lp is None else grad_lp
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    gh, gW, gb = linear_logprobs_kept_backward(h, W, b, targets, lse, ent, logits, grad_lp, grad_lse,
                                               grad_ent if ctx.entropy else None)
    return gh, gW, (gb if ctx.has_bias else None), None, None


linear_logprobs_kept.register_autograd(_backward, setup_context=_setup)
