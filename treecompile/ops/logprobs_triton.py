"""``treecompile::linear_logprobs_triton``: the CUDA half-precision fast path of ``linear_logprobs``.

Same signature and results as the reference op in :mod:`treecompile.ops.logprobs` (which it never
imports): the chunk loop and the ``[chunk, V]`` matmul are the same, and the per-chunk softmax work
runs as Triton row kernels on the chunk's bf16/fp16 logits, in float32:

- forward ``_stats_kernel``: one read of each row, online max / sum of ``exp(x - m)`` and, with
  ``ENTROPY``, of ``exp(x - m) (x - m)`` (rescaled as ``m`` grows), giving
  ``lse = m + log(a)``, ``lp = x[target] - lse`` and ``entropy = log(a) - s / a``;
- backward ``_dlogits_kernel`` (op ``treecompile::linear_logprobs_triton_backward``): one read and
  one write of each row, ``d = p (grad_lse - grad_lp - grad_ent (x - lse + entropy)) + [col == target]
  grad_lp`` written over the recomputed logits.

Both are opaque ops (fake implementations for tracing), so under ``torch.compile`` forward and backward
run the same kernels as eagerly.  The CUDA lowering (not this module) decides where this op replaces
the reference; it refuses inputs that are not CUDA bf16/fp16 rather than falling back.
"""

from __future__ import annotations

import torch

from treecompile.ops.logprobs import accumulate_chunk_grads, chunk_logits, resolve_chunk
# triton is None on CPU-only installs: the lowering keeps the reference op
from treecompile.ops.triton_support import available, interpreting, tl, triton

__all__ = ["available", "stats_", "dlogits_", "linear_logprobs_triton"]

BLOCK = 4096
# Bytes of float32-equivalent logits per chunk when the program leaves the chunk to the op (chunk 0): 4x
# the torch head's, i.e. 512 MiB of bf16 logits.  The backward reads and writes the float32 dW [V, D] once
# per chunk, so fewer, larger chunks pay: H100, 16,384 rows, fwd+bwd of this op: V 248,320 x D 1,024
# 119 -> 66 ms (peak +2.5 GiB), V 151,936 x D 2,048 96 -> 69 ms (+1.0 GiB); Qwen3-1.7B tree step
# 0.469 -> 0.448 s (benchmarks/results/HISTORY.md, session 7).
DEFAULT_BUDGET = 1 << 30


if triton is not None:

    @triton.jit
    def _stats_kernel(X, T, LP, LSE, ENT, V, stride, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride
        m = tl.full((), float("-inf"), tl.float32)
        a = tl.zeros((), tl.float32)  # sum exp(x - m)
        s = tl.zeros((), tl.float32)  # sum exp(x - m) (x - m)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            scale = tl.exp(m - m_new)
            e = tl.exp(x - m_new)
            if ENTROPY:
                # sum_old exp(x - m_new)(x - m_new) = scale * (s + a (m - m_new)); m = -inf only while a = 0
                shift = tl.where(a > 0, m - m_new, 0.0)
                s = scale * (s + a * shift) + tl.sum(tl.where(cols < V, e * (x - m_new), 0.0), 0)
            a = a * scale + tl.sum(e, 0)
            m = m_new
        log_a = tl.log(a)
        lse = m + log_a
        t = tl.load(T + row)
        xt = tl.load(x_row + t).to(tl.float32)
        tl.store(LSE + row, lse)
        tl.store(LP + row, xt - lse)
        if ENTROPY:
            tl.store(ENT + row, log_a - s / a)

    @triton.jit
    def _dlogits_kernel(X, T, LSE, G, GL, ENT, GE, V, stride, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride
        lse = tl.load(LSE + row)
        g = tl.load(G + row)
        coef = tl.load(GL + row) - g
        t = tl.load(T + row)
        if ENTROPY:
            ge = tl.load(GE + row)
            mu = lse - tl.load(ENT + row)  # sum_v p x
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = cols < V
            x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
            c = coef
            if ENTROPY:
                c = coef - ge * (x - mu)
            d = tl.exp(x - lse) * c + tl.where(cols == t, g, 0.0)
            tl.store(x_row + cols, d.to(X.dtype.element_ty), mask=ok)


def _check(logits, *vecs):
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits: expected a row-major [n, V] tensor, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    n = logits.shape[0]
    for v in vecs:
        if v.shape != (n,) or not v.is_contiguous():
            raise ValueError(f"expected contiguous [{n}] vectors, got {tuple(v.shape)}")


def stats_(logits: torch.Tensor, targets: torch.Tensor, lp_out: torch.Tensor, lse_out: torch.Tensor,
           ent_out: torch.Tensor | None = None) -> None:
    """``lse_out[i] = logsumexp(logits[i])``, ``lp_out[i] = logits[i, targets[i]] - lse_out[i]``, and
    ``ent_out[i]`` the entropy of ``softmax(logits[i])`` unless ``ent_out`` is None (float32)."""
    entropy = ent_out is not None
    _check(logits, targets, lp_out, lse_out, *([ent_out] if entropy else []))
    n, V = logits.shape
    if n:
        _stats_kernel[(n,)](logits, targets, lp_out, lse_out, ent_out if entropy else lse_out, V, logits.stride(0),
                            BLOCK=BLOCK, ENTROPY=entropy, num_warps=8)


def dlogits_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_lp: torch.Tensor,
             grad_lse: torch.Tensor, ent: torch.Tensor | None = None, grad_ent: torch.Tensor | None = None
             ) -> torch.Tensor:
    """Overwrite ``logits`` with d(loss)/d(logits) and return it (``grad_ent`` None: the entropy is
    not differentiated)."""
    entropy = grad_ent is not None
    _check(logits, targets, lse, grad_lp, grad_lse, *([ent, grad_ent] if entropy else []))
    n, V = logits.shape
    if n:
        _dlogits_kernel[(n,)](logits, targets, lse, grad_lp, grad_lse, ent if entropy else lse,
                              grad_ent if entropy else lse, V, logits.stride(0), BLOCK=BLOCK, ENTROPY=entropy,
                              num_warps=8)
    return logits


# ---------------------------------------------------------------- the op
def _check_inputs(h, W, b, targets):
    if not available():
        raise RuntimeError("treecompile::linear_logprobs_triton: triton is not importable")
    if not (h.is_cuda or interpreting()) or h.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"treecompile::linear_logprobs_triton: CUDA bf16/fp16 hidden states only, got "
                         f"{h.dtype} on {h.device} (the reference op treecompile::linear_logprobs serves the rest)")
    for name, t in (("W", W), ("b", b)):
        if t is not None and t.dtype != h.dtype:
            raise ValueError(f"treecompile::linear_logprobs_triton: {name} is {t.dtype}, h is {h.dtype}")


@torch.library.custom_op("treecompile::linear_logprobs_triton", mutates_args=())
def linear_logprobs_triton(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
                           chunk: int, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs [N], lse [N], entropy [N] if entropy else [0])``, float32; as the reference op."""
    _check_inputs(h, W, b, targets)
    N = h.shape[0]
    chunk = resolve_chunk(chunk, W.shape[0], DEFAULT_BUDGET)
    lp = torch.empty(N, dtype=torch.float32, device=h.device)
    lse = torch.empty(N, dtype=torch.float32, device=h.device)
    ent = torch.empty(N if entropy else 0, dtype=torch.float32, device=h.device)
    targets = targets.contiguous()
    for s in range(0, N, chunk):
        stats_(chunk_logits(h[s:s + chunk], W, b), targets[s:s + chunk], lp[s:s + chunk], lse[s:s + chunk],
               ent[s:s + chunk] if entropy else None)
    return lp, lse, ent


@linear_logprobs_triton.register_fake
def _(h, W, b, targets, chunk, entropy=False):
    N = h.shape[0]
    return (h.new_empty(N, dtype=torch.float32), h.new_empty(N, dtype=torch.float32),
            h.new_empty(N if entropy else 0, dtype=torch.float32))


@torch.library.custom_op("treecompile::linear_logprobs_triton_backward", mutates_args=())
def linear_logprobs_triton_backward(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
                                    lse: torch.Tensor, ent: torch.Tensor, grad_lp: torch.Tensor,
                                    grad_lse: torch.Tensor, grad_ent: torch.Tensor | None, chunk: int
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(d h, d W, d b or [0])`` of :func:`linear_logprobs_triton`; ``grad_ent`` None: entropy not
    differentiated.  Each chunk's logits are recomputed and overwritten by their gradient."""
    _check_inputs(h, W, b, targets)
    chunk = resolve_chunk(chunk, W.shape[0], DEFAULT_BUDGET)
    gh = torch.empty_like(h)
    gW = torch.zeros(W.shape, dtype=torch.float32, device=W.device)
    gb = torch.zeros(W.shape[0] if b is not None else 0, dtype=torch.float32, device=W.device)
    targets = targets.contiguous()
    vecs = [v.float().contiguous() for v in (grad_lp, grad_lse)]
    ge = None if grad_ent is None else grad_ent.float().contiguous()
    for s in range(0, h.shape[0], chunk):
        hc = h[s:s + chunk]
        sl = slice(s, s + chunk)
        dl = dlogits_(chunk_logits(hc, W, b), targets[sl], lse[sl], vecs[0][sl], vecs[1][sl],
                      None if ge is None else ent[sl], None if ge is None else ge[sl])
        accumulate_chunk_grads(dl, hc, W, gh[sl], gW, gb if b is not None else None)
        del dl  # else it lives on while the next chunk's logits are made: two [chunk, V] blocks, not one
    return gh, gW.to(W.dtype), gb.to(W.dtype)


@linear_logprobs_triton_backward.register_fake
def _(h, W, b, targets, lse, ent, grad_lp, grad_lse, grad_ent, chunk):
    return torch.empty_like(h), torch.empty_like(W), W.new_empty(W.shape[0] if b is not None else 0)


def _setup(ctx, inputs, output):
    h, W, b, targets, chunk, *rest = inputs
    ctx.save_for_backward(h, W, b, targets, output[1], output[2])
    ctx.chunk, ctx.has_bias = chunk, b is not None
    ctx.entropy = bool(rest[0]) if rest else False


def _backward(ctx, grad_lp, grad_lse, grad_ent):
    h, W, b, targets, lse, ent = ctx.saved_tensors
    grad_lp = torch.zeros_like(lse) if grad_lp is None else grad_lp
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    gh, gW, gb = linear_logprobs_triton_backward(h, W, b, targets, lse, ent, grad_lp, grad_lse,
                                                 grad_ent if ctx.entropy else None, ctx.chunk)
    return gh, gW, (gb if ctx.has_bias else None), None, None, None


linear_logprobs_triton.register_autograd(_backward, setup_context=_setup)
