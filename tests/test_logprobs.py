"""``treecompile::linear_logprobs``: chunked lm_head + log-softmax + gather, forward and backward.

CPU float64: equal to log_softmax of the full logits to rounding, for chunks that do and do not divide
N, with and without bias, with gradients through both outputs (log-prob and log-sum-exp).  CUDA bf16:
the Triton row kernels against the torch path and an fp64 oracle.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CUDA
from treecompile.ops import logprobs as lpmod
from treecompile.ops.logprobs import linear_logprobs


def _inputs(N, D, V, dtype, device, bias, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    h = (torch.randn(N, D, generator=g, device=device) * 0.5).to(dtype).requires_grad_()
    W = (torch.randn(V, D, generator=g, device=device) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g, device=device) * 0.5).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g, device=device)
    glp = torch.randn(N, generator=g, device=device, dtype=torch.float64)
    glse = torch.randn(N, generator=g, device=device, dtype=torch.float64)
    return h, W, b, t, glp, glse


def _dense(h, W, b, t):
    logits = h.double() @ W.double().t()
    if b is not None:
        logits = logits + b.double()
    lse = logits.logsumexp(-1)
    return logits.gather(-1, t[:, None])[:, 0] - lse, lse


def _grads(fn, h, W, b, glp, glse):
    lp, lse = fn()[:2]
    params = [x for x in (h, W, b) if x is not None]
    gr = torch.autograd.grad((lp.double() * glp).sum() + (lse.double() * glse).sum(), params)
    return [lp.detach().double(), lse.detach().double(), *(x.double() for x in gr)]


@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N,V", [(16, 50), (60, 20)])  # backward over vocabulary slices / over row chunks
def test_linear_logprobs_equals_log_softmax_float64(chunk, bias, N, V):
    h, W, b, t, glp, glse = _inputs(N, 8, V, torch.float64, "cpu", bias)
    got = _grads(lambda: linear_logprobs(h, W, b, t, chunk), h, W, b, glp, glse)
    want = _grads(lambda: _dense(h, W, b, t), h, W, b, glp, glse)
    for name, a, w in zip(("lp", "lse", "dh", "dW", "db"), got, want):
        assert torch.allclose(a, w, rtol=1e-12, atol=1e-12), name


def test_backward_axis_keeps_the_smaller_accumulator(monkeypatch):
    """``vocab_slice``: slices when N < V and more than one row chunk, at the same logits budget; the
    sliced backward really runs (it is the only caller of ``chunk_dlogits`` with ``col0``) and every
    target is scattered once whether or not it falls in the first slice."""
    assert lpmod.vocab_slice(16, 50, 7) == 7 * 50 // 16
    assert lpmod.vocab_slice(16, 50, 16) is None  # one row chunk: nothing accumulates
    assert lpmod.vocab_slice(60, 20, 7) is None  # dW [V, D] is the smaller accumulator
    assert lpmod.vocab_slice(16384, 248320, 270) == 270 * 248320 // 16384
    assert lpmod.vocab_slice(3, 10**6, 1) == 10**6 // 3
    cols = []
    real = lpmod.chunk_dlogits
    monkeypatch.setattr(lpmod, "chunk_dlogits", lambda *a, **k: (cols.append(k.get("col0")), real(*a, **k))[1])
    h, W, b, t, glp, glse = _inputs(16, 8, 50, torch.float64, "cpu", True)
    t[0], t[1] = 0, 49  # the first and the last column
    got = _grads(lambda: linear_logprobs(h, W, b, t, 3), h, W, b, glp, glse)
    want = _grads(lambda: _dense(h, W, b, t), h, W, b, glp, glse)
    assert cols == list(range(0, 50, 3 * 50 // 16))
    for name, a, w in zip(("lp", "lse", "dh", "dW", "db"), got, want):
        assert torch.allclose(a, w, rtol=1e-12, atol=1e-12), name


def test_reference_op_is_pure_torch():
    """The reference op module never reaches the Triton fast path (issue 14): the CUDA lowering
    substitutes ``treecompile::linear_logprobs_triton`` for it."""
    import inspect

    src = inspect.getsource(lpmod)
    assert "triton" not in src.split('"""', 2)[2]  # the docstring may name it; the code does not


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (and triton)")
@pytest.mark.parametrize("N,V,chunk,bias", [(1000, 151936, 441, False), (257, 5000, 100, True), (3, 4097, 2, False),
                                           (3000, 1000, 128, True)])
def test_triton_row_kernels_vs_torch_path_and_fp64(N, V, chunk, bias):
    from treecompile.ops import logprobs_triton

    if not logprobs_triton.available():
        pytest.skip("triton is not importable")
    D = 256
    h, W, b, t, glp, glse = _inputs(N, D, V, torch.bfloat16, "cuda", bias)
    oracle = _grads(lambda: _dense(h, W, b, t), h, W, b, glp, glse)
    fused = _grads(lambda: logprobs_triton.linear_logprobs_triton(h, W, b, t, chunk), h, W, b, glp, glse)
    plain = _grads(lambda: linear_logprobs(h, W, b, t, chunk), h, W, b, glp, glse)
    u = torch.finfo(torch.bfloat16).eps / 2
    rel = lambda x, y: float((x - y).norm() / y.norm())  # noqa: E731
    for name, f, p, o in zip(("lp", "lse", "dh", "dW", "db"), fused, plain, oracle):
        ef, ep = rel(f, o), rel(p, o)
        assert ef <= 2 * ep + u, f"{name}: fused error {ef:.3g} > 2 * torch-path error {ep:.3g} + {u:.1g}"
