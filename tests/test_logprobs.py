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
@pytest.mark.parametrize("N,V", [(16, 50), (60, 20)])  # fewer / more rows than the vocabulary
def test_linear_logprobs_equals_log_softmax_float64(chunk, bias, N, V):
    h, W, b, t, glp, glse = _inputs(N, 8, V, torch.float64, "cpu", bias)
    got = _grads(lambda: linear_logprobs(h, W, b, t, chunk), h, W, b, glp, glse)
    want = _grads(lambda: _dense(h, W, b, t), h, W, b, glp, glse)
    for name, a, w in zip(("lp", "lse", "dh", "dW", "db"), got, want):
        assert torch.allclose(a, w, rtol=1e-12, atol=1e-12), name


def test_chunk_zero_is_the_ops_default_and_bad_chunks_are_refused():
    """``rewrite_loss`` writes chunk 0 when the user sets no ``logits_chunk``: each head op then runs its own
    default (same values and gradients as that chunk given explicitly); a negative chunk raises rather than
    looping over nothing, and ``compile`` refuses a bad ``logits_chunk`` before capturing anything."""
    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM

    assert lpmod.resolve_chunk(0, 50) == lpmod.default_chunk(50) and lpmod.resolve_chunk(7, 50) == 7
    assert lpmod.resolve_chunk(0, 151936, 1 << 30) == (1 << 30) // (4 * 151936)
    h, W, b, t, glp, glse = _inputs(16, 8, 50, torch.float64, "cpu", True)
    got = _grads(lambda: linear_logprobs(h, W, b, t, 0), h, W, b, glp, glse)
    want = _grads(lambda: linear_logprobs(h, W, b, t, lpmod.default_chunk(50)), h, W, b, glp, glse)
    assert all(torch.equal(a, w) for a, w in zip(got, want))
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        linear_logprobs(h, W, b, t, -3)
    model = DenseForCausalLM(DenseConfig.tiny())
    for bad in (-1, 0, True, 2.5):
        with pytest.raises(ValueError, match="logits_chunk must be a positive number of rows"):
            treecompile.compile(model, logits_chunk=bad)


def test_rewrite_loss_leaves_the_chunk_to_the_op_unless_set(tmodel, model):
    """The graph holds chunk 0 by default (the op picks at run time) and the user's ``logits_chunk`` when set."""
    from helpers import cached_compile

    def head_chunks(tm):
        return [n.args[4] for n in tm.graph_module.graph.nodes
                if n.target is torch.ops.treecompile.linear_logprobs.default]

    assert tmodel.pass_results["rewrite_loss"].info["chunk"] == 0 and head_chunks(tmodel) == [0]
    tm5 = cached_compile(model, logits_chunk=5)  # the fixture's capture, its passes run with logits_chunk=5
    assert tm5.pass_results["rewrite_loss"].info["chunk"] == 5 and head_chunks(tm5) == [5]


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
