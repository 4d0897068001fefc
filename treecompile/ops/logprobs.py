"""``treecompile::linear_logprobs``: fused lm_head + log-softmax + gather, chunked over tokens.

``logprobs[i] = log_softmax(h[i] @ W.T (+ b))[targets[i]]`` computed ``chunk`` rows at a time, so
at most ``[chunk, V]`` logits exist at once (in float32, or float64 for a float64 model), in forward
and backward alike (the backward recomputes each chunk's logits from the saved log-sum-exp).
Shapes: ``h [N, D]``, ``W [V, D]``, optional ``b [V]``, ``targets [N]`` int64; returns ``[N]``.

On CUDA with bf16/fp16 logits the per-chunk softmax work of the (opaque) forward runs as one Triton
kernel (one read of the chunk's logits: log-sum-exp and the target's log-prob) instead of a chain of
float32 ops over ``[chunk, V]``; an eager backward uses a second one (``d logits`` written over the
recomputed logits).  A compiled backward is traced from the torch ops below and fused by inductor.
The arithmetic (float32, the same formulas) is unchanged.  Elsewhere (CPU, float32/float64) torch ops.
"""

from __future__ import annotations

import torch

__all__ = ["linear_logprobs", "gather_logprobs", "default_chunk"]


def default_chunk(vocab: int, budget_bytes: int = 1 << 28) -> int:
    """Rows per chunk so that one chunk of float32 logits stays under ``budget_bytes``."""
    return max(1, budget_bytes // (4 * max(vocab, 1)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fused(logits: torch.Tensor) -> bool:
    """Whether the Triton row kernels serve logits like these: CUDA, half precision, triton importable, and
    real tensors.  The forward is an opaque op, so under torch.compile it runs here on real tensors;
    the backward formula is traced (AOTAutograd, fake tensors) and inductor fuses its torch ops."""
    if not (logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16)):
        return False
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(logits) or torch.compiler.is_compiling():
        return False
    from treecompile.ops import logprobs_triton

    return logprobs_triton.available()


def _chunk_logits(h, W, b):
    """One chunk's logits in the model's dtype (upcast by the caller, or read by the Triton kernels)."""
    logits = h @ W.t()
    return logits if b is None else logits + b


@torch.library.custom_op("treecompile::linear_logprobs", mutates_args=())
def linear_logprobs(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
                    chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(logprobs [N], lse [N])``; ``lse`` (log-sum-exp) is kept for the backward."""
    N = h.shape[0]
    acc = _acc_dtype(h.dtype)
    lp = torch.empty(N, dtype=acc, device=h.device)
    lse = torch.empty(N, dtype=acc, device=h.device)
    fused = _fused(h)  # the chunks' logits have h's dtype and device
    if fused:
        from treecompile.ops.logprobs_triton import lse_and_target

        targets = targets.contiguous()  # the kernel reads it as a flat vector
    for s in range(0, N, chunk):
        raw = _chunk_logits(h[s:s + chunk], W, b)
        if fused:
            lse_and_target(raw, targets[s:s + chunk], lp[s:s + chunk], lse[s:s + chunk])
            continue
        logits = raw.to(acc)
        lse[s:s + chunk] = torch.logsumexp(logits, -1)
        lp[s:s + chunk] = logits.gather(-1, targets[s:s + chunk, None])[:, 0] - lse[s:s + chunk]
    return lp, lse


@linear_logprobs.register_fake
def _(h, W, b, targets, chunk):
    acc = _acc_dtype(h.dtype)
    return h.new_empty(h.shape[0], dtype=acc), h.new_empty(h.shape[0], dtype=acc)


def _setup(ctx, inputs, output):
    h, W, b, targets, chunk = inputs
    ctx.save_for_backward(h, W, b, targets, output[1])
    ctx.chunk = chunk
    ctx.has_bias = b is not None


def _backward(ctx, grad_lp, grad_lse):
    h, W, b, targets, lse = ctx.saved_tensors
    acc = _acc_dtype(h.dtype)
    gh = torch.empty_like(h)
    gW = torch.zeros(W.shape, dtype=acc, device=W.device)
    gb = torch.zeros(W.shape[0], dtype=acc, device=W.device) if ctx.has_bias else None
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    fused = _fused(h)
    if fused:
        from treecompile.ops.logprobs_triton import dlogits_

        targets = targets.contiguous()
    for s in range(0, h.shape[0], ctx.chunk):
        hc = h[s:s + ctx.chunk]
        g = grad_lp[s:s + ctx.chunk].to(acc).contiguous()  # the grad of a sum is an expanded view
        gl = grad_lse[s:s + ctx.chunk].to(acc).contiguous()
        raw = _chunk_logits(hc, W, b)
        if fused:  # d logits written over the chunk's logits, in their dtype
            dl = dlogits_(raw, targets[s:s + ctx.chunk], lse[s:s + ctx.chunk], g, gl)
            dsum = dl.sum(0, dtype=acc) if gb is not None else None
        else:
            p = torch.exp(raw.to(acc) - lse[s:s + ctx.chunk, None])
            # d lp / d logits = onehot - p ; d lse / d logits = p
            dlogits = p * (gl - g)[:, None]
            dlogits.scatter_add_(-1, targets[s:s + ctx.chunk, None], g[:, None])
            dl = dlogits.to(h.dtype)
            dsum = dlogits.sum(0) if gb is not None else None
        gh[s:s + ctx.chunk] = dl @ W
        gW += (dl.t() @ hc).to(acc)
        if gb is not None:
            gb += dsum
    return gh, gW.to(W.dtype), (gb.to(b.dtype) if gb is not None else None), None, None


linear_logprobs.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("treecompile::gather_logprobs", mutates_args=())
def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits)[i, targets[i]]`` for already materialised ``logits [N, V]``, upcast one
    chunk of rows at a time.  Returns ``(logprobs [N], lse [N])``."""
    N = logits.shape[0]
    acc = _acc_dtype(logits.dtype)
    lp = torch.empty(N, dtype=acc, device=logits.device)
    lse = torch.empty(N, dtype=acc, device=logits.device)
    for s in range(0, N, chunk):
        c = logits[s:s + chunk].to(acc)
        lse[s:s + chunk] = torch.logsumexp(c, -1)
        lp[s:s + chunk] = c.gather(-1, targets[s:s + chunk, None])[:, 0] - lse[s:s + chunk]
    return lp, lse


@gather_logprobs.register_fake
def _(logits, targets, chunk):
    acc = _acc_dtype(logits.dtype)
    return logits.new_empty(logits.shape[0], dtype=acc), logits.new_empty(logits.shape[0], dtype=acc)


def _setup_g(ctx, inputs, output):
    logits, targets, chunk = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.chunk = chunk


def _backward_g(ctx, grad_lp, grad_lse):
    logits, targets, lse = ctx.saved_tensors
    acc = _acc_dtype(logits.dtype)
    out = torch.empty_like(logits)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    for s in range(0, logits.shape[0], ctx.chunk):
        p = torch.exp(logits[s:s + ctx.chunk].to(acc) - lse[s:s + ctx.chunk, None])
        g = grad_lp[s:s + ctx.chunk].to(acc)
        d = p * (grad_lse[s:s + ctx.chunk].to(acc) - g)[:, None]
        d.scatter_add_(-1, targets[s:s + ctx.chunk, None], g[:, None])
        out[s:s + ctx.chunk] = d.to(logits.dtype)
    return out, None, None


gather_logprobs.register_autograd(_backward_g, setup_context=_setup_g)
