"""``treecompile::linear_logprobs``: fused lm_head + log-softmax + gather (+ entropy), chunked over tokens.

``logprobs[i] = log_softmax(h[i] @ W.T (+ b))[targets[i]]`` computed ``chunk`` rows at a time (``chunk``
0: the op's own default, :func:`resolve_chunk`), so at most ``[chunk, V]`` logits exist at once (in
float32, or float64 for a float64 model), in forward and backward alike (the backward recomputes each
chunk's logits from the saved log-sum-exp).
With ``entropy=True`` the same chunks also give ``entropy[i] = -sum_v p[i, v] log p[i, v]`` of the
row's softmax ``p``, and its gradient (``d entropy / d logits = -p * (logits - sum_v p logits)``).
Shapes: ``h [N, D]``, ``W [V, D]``, optional ``b [V]``, ``targets [N]`` int64; returns
``(logprobs [N], lse [N], entropy [N] or [0])``.

This module is the reference: plain torch ops on any device.  The CUDA half-precision fast path
(Triton row kernels, the same formulas in one read of each chunk) is a separate op,
``treecompile::linear_logprobs_triton`` in :mod:`treecompile.ops.logprobs_triton`, which the CUDA
lowering substitutes for this one; nothing here chooses it.
"""

from __future__ import annotations

import torch

__all__ = ["linear_logprobs", "gather_logprobs", "default_chunk", "resolve_chunk", "chunk_logits", "chunk_stats",
           "chunk_dlogits", "accumulate_weight_grad", "accumulate_bias_grad", "accumulate_chunk_grads"]


DEFAULT_BUDGET = 1 << 28  # bytes of float32 logits per chunk in this (torch) head


def default_chunk(vocab: int, budget_bytes: int = DEFAULT_BUDGET) -> int:
    """Rows per chunk so that one chunk of float32 logits stays under ``budget_bytes``."""
    return max(1, budget_bytes // (4 * max(vocab, 1)))


def resolve_chunk(chunk: int, vocab: int, budget_bytes: int = DEFAULT_BUDGET) -> int:
    """The rows per chunk an op runs with: ``chunk`` as given, or with ``chunk == 0`` (what
    ``rewrite_loss`` writes when the user set no ``logits_chunk``) the op's own default for
    ``budget_bytes``, so a saved program gets the chunk of the head that runs it."""
    if chunk < 0:
        raise ValueError(f"linear_logprobs: chunk must be >= 0 (0: the op's default), got {chunk}")
    return chunk if chunk > 0 else default_chunk(vocab, budget_bytes)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_logits(h, W, b):
    """One chunk's logits ``h @ W.T (+ b)`` in the model's dtype (upcast by the caller).  With one dtype for all
    three the bias is added in the GEMM (one ``[n, V]`` buffer, not two); mixed dtypes promote, as ``+`` does."""
    if b is None:
        return h @ W.t()
    if h.dtype == W.dtype == b.dtype:
        return torch.addmm(b, h, W.t())
    return h @ W.t() + b


def accumulate_weight_grad(gW: torch.Tensor, dl: torch.Tensor, hc: torch.Tensor) -> None:
    """``gW += dl.T @ hc`` with ``gW`` in the accumulation dtype and ``dl``, ``hc`` in the model's.

    On CUDA with bf16/fp16 operands the GEMM accumulates straight into the float32 ``gW`` (cuBLAS
    epilogue with beta=1, ``addmm(out_dtype=float32)``): no ``[V, H]`` product in the model's dtype,
    no upcast copy and no separate add per chunk (those three passes over ``V x H`` cost ~16 % of a
    Qwen3-1.7B tree step at 16k tokens on an H100).  Elsewhere: product, upcast, add.
    """
    if gW.is_cuda and gW.dtype == torch.float32 and dl.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(gW, dl.t(), hc, out_dtype=torch.float32, out=gW)
    else:
        gW += (dl.t() @ hc).to(gW.dtype)


def accumulate_bias_grad(gb: torch.Tensor, dl: torch.Tensor) -> None:
    """``gb += dl.sum(0)`` with ``gb`` in the accumulation dtype and ``dl [n, V]`` in the model's.

    On CUDA with bf16/fp16 ``dl`` the column sums are a ``[1, n] @ [n, V]`` GEMM of ones accumulating straight
    into the float32 ``gb`` (as :func:`accumulate_weight_grad`): the reduction kernel behind ``dl.sum(0,
    dtype=float32)`` stages partial sums in a float32 buffer of 256 x V (149 MiB at V = 151,936, whatever n is;
    H200, ``benchmarks/results/h200_s38/probe_head_memory.txt``), which the head's memory estimate does not hold.
    Elsewhere: the sum, then the add."""
    if gb.is_cuda and gb.dtype == torch.float32 and dl.dtype in (torch.bfloat16, torch.float16):
        row = gb[None]
        torch.addmm(row, dl.new_ones(1, dl.shape[0]), dl, out_dtype=torch.float32, out=row)
    else:
        gb += dl.sum(0, dtype=gb.dtype)


def accumulate_chunk_grads(dl: torch.Tensor, hc: torch.Tensor, W: torch.Tensor, gh_rows: torch.Tensor,
                           gW: torch.Tensor, gb: torch.Tensor | None) -> None:
    """One row block's share of the head's gradients, ``dl [n, V]`` (the logits' gradient) in the model's dtype:
    ``gh_rows = dl @ W``, ``gW += dl.T @ hc`` and ``gb += dl.sum(0)`` (``gb`` None: no bias) in the accumulation
    dtype (:func:`accumulate_weight_grad`, :func:`accumulate_bias_grad`)."""
    torch.mm(dl, W, out=gh_rows)
    accumulate_weight_grad(gW, dl, hc)
    if gb is not None:
        accumulate_bias_grad(gb, dl)


def chunk_stats(logits: torch.Tensor, targets: torch.Tensor, entropy: bool):
    """``(lp [n], lse [n], entropy [n] or None)`` of upcast ``logits [n, V]``.

    The entropy is computed from the row shifted by its max ``m`` (``z = x - m``, ``a = sum exp(z)``):
    ``H = log(a) - sum exp(z) z / a``, so its rounding does not grow with the logits' offset (as
    ``lse - sum p x`` would); the Triton head computes the same sums online."""
    if not entropy:
        lse = torch.logsumexp(logits, -1)
        return logits.gather(-1, targets[:, None])[:, 0] - lse, lse, None
    m = logits.amax(-1, keepdim=True)
    z = logits - m
    e = torch.exp(z)
    a = e.sum(-1)
    log_a = torch.log(a)
    lse = m[:, 0] + log_a
    lp = logits.gather(-1, targets[:, None])[:, 0] - lse
    return lp, lse, log_a - (e * z).sum(-1) / a


def chunk_dlogits(logits, targets, lse, g, gl, ent=None, ge=None):
    """d(loss)/d(logits) of one upcast chunk given the gradients of its log-probs ``g``, log-sum-exps
    ``gl`` and entropies ``ge`` (``[n]`` each; ``ge`` None: the entropy is not differentiated).

    ``d lp / d x = onehot - p``, ``d lse / d x = p``, ``d H / d x = -p (x - lse + H)``."""
    p = torch.exp(logits - lse[:, None])
    coef = (gl - g)[:, None]
    if ge is not None:
        coef = coef - ge[:, None] * (logits - lse[:, None] + ent[:, None])
    d = p * coef
    d.scatter_add_(-1, targets[:, None], g[:, None])
    return d


def _empty_entropy(like: torch.Tensor, n: int, entropy: bool) -> torch.Tensor:
    return like.new_empty(n if entropy else 0, dtype=_acc_dtype(like.dtype))


@torch.library.custom_op("treecompile::linear_logprobs", mutates_args=())
def linear_logprobs(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
                    chunk: int, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(logprobs [N], lse [N], entropy [N] if entropy else [0])``; ``lse`` is kept for the
    backward."""
    N = h.shape[0]
    chunk = resolve_chunk(chunk, W.shape[0])
    acc = _acc_dtype(h.dtype)
    lp = torch.empty(N, dtype=acc, device=h.device)
    lse = torch.empty(N, dtype=acc, device=h.device)
    ent = _empty_entropy(h, N, entropy)
    for s in range(0, N, chunk):
        c_lp, c_lse, c_ent = chunk_stats(chunk_logits(h[s:s + chunk], W, b).to(acc), targets[s:s + chunk], entropy)
        lp[s:s + chunk], lse[s:s + chunk] = c_lp, c_lse
        if entropy:
            ent[s:s + chunk] = c_ent
    return lp, lse, ent


@linear_logprobs.register_fake
def _(h, W, b, targets, chunk, entropy=False):
    acc = _acc_dtype(h.dtype)
    N = h.shape[0]
    return h.new_empty(N, dtype=acc), h.new_empty(N, dtype=acc), _empty_entropy(h, N, entropy)


def _setup(ctx, inputs, output):
    h, W, b, targets, chunk, *rest = inputs
    ctx.save_for_backward(h, W, b, targets, output[1], output[2])
    ctx.chunk = resolve_chunk(chunk, W.shape[0])
    ctx.has_bias = b is not None
    ctx.entropy = bool(rest[0]) if rest else False


def _slices(N, chunk, *vecs):
    for s in range(0, N, chunk):
        yield s, [None if v is None else v[s:s + chunk] for v in vecs]


def _backward(ctx, grad_lp, grad_lse, grad_ent):
    h, W, b, targets, lse, ent = ctx.saved_tensors
    acc = _acc_dtype(h.dtype)
    gh = torch.empty_like(h)
    gW = torch.zeros(W.shape, dtype=acc, device=W.device)
    gb = torch.zeros(W.shape[0], dtype=acc, device=W.device) if ctx.has_bias else None
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if not ctx.entropy:
        grad_ent = ent = None
    # the grad of a sum is an expanded view: make the per-row vectors real
    g_all, gl_all = grad_lp.to(acc).contiguous(), grad_lse.to(acc).contiguous()
    ge_all = None if grad_ent is None else grad_ent.to(acc).contiguous()
    for s, (hc, t, l, g, gl, e, ge) in _slices(h.shape[0], ctx.chunk, h, targets, lse, g_all, gl_all, ent, ge_all):
        dlogits = chunk_dlogits(chunk_logits(hc, W, b).to(acc), t, l, g, gl, e, ge)
        dl = dlogits.to(h.dtype)
        gh[s:s + ctx.chunk] = dl @ W
        accumulate_weight_grad(gW, dl, hc)
        if gb is not None:
            gb += dlogits.sum(0)
    return gh, gW.to(W.dtype), (gb.to(b.dtype) if gb is not None else None), None, None, None


linear_logprobs.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("treecompile::gather_logprobs", mutates_args=())
def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int,
                    entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``log_softmax(logits)[i, targets[i]]`` for already materialised ``logits [N, V]``, upcast one
    chunk of rows at a time.  Returns ``(logprobs [N], lse [N], entropy [N] if entropy else [0])``."""
    N = logits.shape[0]
    chunk = resolve_chunk(chunk, logits.shape[-1])
    acc = _acc_dtype(logits.dtype)
    lp = torch.empty(N, dtype=acc, device=logits.device)
    lse = torch.empty(N, dtype=acc, device=logits.device)
    ent = _empty_entropy(logits, N, entropy)
    for s in range(0, N, chunk):
        c_lp, c_lse, c_ent = chunk_stats(logits[s:s + chunk].to(acc), targets[s:s + chunk], entropy)
        lp[s:s + chunk], lse[s:s + chunk] = c_lp, c_lse
        if entropy:
            ent[s:s + chunk] = c_ent
    return lp, lse, ent


@gather_logprobs.register_fake
def _(logits, targets, chunk, entropy=False):
    acc = _acc_dtype(logits.dtype)
    N = logits.shape[0]
    return logits.new_empty(N, dtype=acc), logits.new_empty(N, dtype=acc), _empty_entropy(logits, N, entropy)


def _setup_g(ctx, inputs, output):
    logits, targets, chunk, *rest = inputs
    ctx.save_for_backward(logits, targets, output[1], output[2])
    ctx.chunk = resolve_chunk(chunk, logits.shape[-1])
    ctx.entropy = bool(rest[0]) if rest else False


def _backward_g(ctx, grad_lp, grad_lse, grad_ent):
    logits, targets, lse, ent = ctx.saved_tensors
    acc = _acc_dtype(logits.dtype)
    out = torch.empty_like(logits)
    if grad_lp is None:
        grad_lp = torch.zeros_like(lse)
    if grad_lse is None:
        grad_lse = torch.zeros_like(lse)
    if not ctx.entropy:
        grad_ent = ent = None
    g_all, gl_all = grad_lp.to(acc).contiguous(), grad_lse.to(acc).contiguous()
    ge_all = None if grad_ent is None else grad_ent.to(acc).contiguous()
    for s, (x, t, l, g, gl, e, ge) in _slices(logits.shape[0], ctx.chunk, logits, targets, lse, g_all, gl_all,
                                              ent, ge_all):
        out[s:s + ctx.chunk] = chunk_dlogits(x.to(acc), t, l, g, gl, e, ge).to(logits.dtype)
    return out, None, None, None


gather_logprobs.register_autograd(_backward_g, setup_context=_setup_g)
