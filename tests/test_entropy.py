"""Token entropy from the fused head: ``out.entropy`` and its gradient equal the per-path softmax
entropy in float64; the Triton head's entropy (run in Triton's CPU interpreter when triton is
importable) against the torch reference op.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

import treecompile
from treecompile import Tree
from treecompile.models import DenseConfig, DenseForCausalLM
from treecompile.ops import triton_support
from treecompile.ops.logprobs import gather_logprobs, linear_logprobs
from helpers import capture_once, flat_grads, rel, run_interpreted
from strategies import ODD_TREES
from tests.conftest import CUDA


# ------------------------------------------------------------------ the ops, float64
def _dense_entropy(logits):
    lsm = torch.log_softmax(logits, -1)
    return -(lsm.exp() * lsm).sum(-1)


def _inputs(N, D, V, dtype, bias, seed=0, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    W = (torch.randn(V, D, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g)
    cot = [torch.randn(N, generator=g, dtype=torch.float64) for _ in range(3)]
    return h, W, b, t, cot


def _all(outs, params, cot):
    """Values and the gradient of ``sum_k <outs[k], cot[k]>`` w.r.t. ``params`` (float64)."""
    total = sum((o.double() * c).sum() for o, c in zip(outs, cot))
    return [o.detach().double() for o in outs] + [g.double() for g in torch.autograd.grad(total, params)]


@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("N,V", [(16, 50), (60, 20)])  # fewer / more rows than the vocabulary
def test_linear_logprobs_entropy_equals_softmax_entropy_float64(chunk, bias, N, V):
    h, W, b, t, cot = _inputs(N, 8, V, torch.float64, bias)
    params = [x for x in (h, W, b) if x is not None]
    got = _all(linear_logprobs(h, W, b, t, chunk, True), params, cot)

    logits = h @ W.t() + (b if b is not None else 0)
    lse = logits.logsumexp(-1)
    want = _all((logits.gather(-1, t[:, None])[:, 0] - lse, lse, _dense_entropy(logits)), params, cot)
    for name, a, w in zip(("lp", "lse", "entropy", "dh", "dW", "db"), got, want):
        assert rel(a, w) < 1e-13, name


@pytest.mark.parametrize("chunk", [3, 100])
def test_gather_logprobs_entropy_float64(chunk):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(11, 40, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t = torch.randint(0, 40, (11,), generator=g)
    cot = [torch.randn(11, generator=g, dtype=torch.float64) for _ in range(3)]
    got = _all(gather_logprobs(logits, t, chunk, True), [logits], cot)
    lse = logits.logsumexp(-1)
    want = _all((logits.gather(-1, t[:, None])[:, 0] - lse, lse, _dense_entropy(logits)), [logits], cot)
    for name, a, w in zip(("lp", "lse", "entropy", "dlogits"), got, want):
        assert rel(a, w) < 1e-13, name


def test_entropy_off_returns_an_empty_tensor_and_same_logprobs():
    h, W, b, t, _ = _inputs(9, 8, 30, torch.float64, True)
    lp0, lse0, e0 = linear_logprobs(h, W, b, t, 4)
    lp1, lse1, e1 = linear_logprobs(h, W, b, t, 4, True)
    assert e0.shape == (0,) and e1.shape == (9,)
    assert torch.equal(lp0, lp1) and torch.equal(lse0, lse1)


def test_entropy_rounding_does_not_grow_with_the_logits_offset():
    """Float32 rows with a large common offset (entropy is shift-invariant): the entropy is computed
    from the max-shifted row, so its error stays at float32 rounding of O(log V) numbers, where
    ``lse - sum p x`` would lose ``offset * eps``."""
    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, 1000, generator=g, dtype=torch.float64) * 3
    base[:3, 0] += 15  # three peaked rows
    t = torch.zeros(6, dtype=torch.long)
    for offset in (0.0, 1e3, -3e4):
        x = (base + offset).float()
        want = _dense_entropy(x.double())  # of the float32 logits as given
        got = gather_logprobs(x, t, 4, True)[2].double()
        assert float((got - want).abs().max()) < 1e-5, offset
        naive = torch.logsumexp(x, -1) - (torch.softmax(x, -1) * x).sum(-1)
        if offset == -3e4:  # the near miss: the unshifted formula loses offset * eps
            assert float((naive.double() - want).abs().max()) > 1e-4


# ------------------------------------------------------------------ compiled models, float64
def per_path_entropy(model, path):
    """Entropy of the softmax that predicts each token of ``path`` run alone (entry 0: 0)."""
    ids = torch.as_tensor(path)[None]
    logits = model(ids)
    logits = logits if isinstance(logits, torch.Tensor) else logits.logits
    H = _dense_entropy(logits[0])
    return torch.cat([H.new_zeros(1), H[:-1]])


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny(vocab_size=13)).double()
    with capture_once(model):  # plain compiles of this model below reuse the capture
        return model, treecompile.compile(model, entropy=True)


TREES = {**ODD_TREES, "mixed": [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [11, 12], [1, 2, 3, 4, 5]]}


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("normalize", ["sum", "path_mean", "token_mean"])
def test_tree_entropy_and_gradient_equal_per_path(dense, name, normalize):
    model, tmodel = dense
    paths = [[t % 13 for t in p] for p in TREES[name]]
    weights = [1.0 + 0.25 * (i % 3) for i in range(len(paths))]
    tree = Tree.from_paths(paths, path_weights=weights)
    batch = tree.to_batch(normalize=normalize, pad_to_multiple=8)
    out = tmodel(batch)
    assert out.entropy.shape == (batch.seq_len,) and out.entropy.dtype == torch.float64
    assert bool((out.entropy[batch.pred_index < 0] == 0).all())  # roots and padding
    ref = [per_path_entropy(model, p) for p in paths]
    for p, (got, want) in enumerate(zip(batch.path_logprobs(out.entropy), ref)):
        assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max().clamp(min=1)), f"path {p}"

    # the entropy bonus's per-path form: sum_p c_p sum_t m[p,t] H_p[t]
    c = tree.path_coefficients(normalize)
    masks = [torch.cat([torch.zeros(1), torch.ones(len(p) - 1)]).double() for p in paths]
    loss_ref = sum(c[p] * (masks[p] * ref[p]).sum() for p in range(len(paths)))
    loss_tree = (batch.loss_weight * out.entropy).sum()
    params = list(model.parameters())
    assert abs(float(loss_tree - loss_ref)) <= 1e-12 * max(abs(float(loss_ref)), 1e-300)
    g_ref = flat_grads(loss_ref, params)
    if float(g_ref.norm()) == 0:
        assert float(flat_grads(loss_tree, params).norm()) == 0
        return
    assert rel(flat_grads(loss_tree, params), g_ref) < 1e-10


def test_entropy_is_off_by_default_and_graph_outputs_unchanged(dense):
    model, tmodel = dense
    with capture_once(model):
        plain = treecompile.compile(model)
    batch = Tree.from_paths([[1, 2, 3], [1, 2, 4]]).to_batch()
    out0, out1 = plain(batch), tmodel(batch)
    assert out0.entropy is None
    assert torch.equal(out0.logprobs, out1.logprobs) and torch.equal(out0.loss, out1.loss)
    assert plain.pass_results["rewrite_loss"].info["entropy"] is False
    assert tmodel.pass_results["rewrite_loss"].info["entropy"] is True


def test_entropy_without_fused_head(dense):
    """A model whose logits do not come straight from a linear layer: the gather op's entropy."""
    model, _ = dense

    class Scaled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids) * 1.5

    wrapped = Scaled(model)
    tm = treecompile.compile(wrapped, entropy=True)
    assert tm.pass_results["rewrite_loss"].info["fused_lm_head"] is False
    paths = [[1, 2, 3, 4], [1, 2, 5]]
    batch = Tree.from_paths(paths).to_batch()
    out = tm(batch)
    for got, p in zip(batch.path_logprobs(out.entropy), paths):
        assert torch.allclose(got, per_path_entropy(wrapped, p), rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------ the Triton head
_INTERPRETED = textwrap.dedent("""
    import torch
    from treecompile.ops.logprobs import linear_logprobs
    from treecompile.ops.logprobs_triton import linear_logprobs_triton
    torch.manual_seed(0)
    worst = {}
    for N, V, chunk, bias, dtype in [(7, 5000, 3, True, torch.bfloat16), (5, 4097, 5, False, torch.float16),
                                     (4, 300, 4, False, torch.bfloat16), (40, 30, 7, True, torch.bfloat16),
                                     (9, 300, 0, True, torch.bfloat16)]:  # 0: the op picks
        D = 16
        h = (torch.randn(N, D, dtype=torch.float64) * 1.5).to(dtype).requires_grad_()
        W = (torch.randn(V, D, dtype=torch.float64) * 1.5).to(dtype).requires_grad_()
        b = (torch.randn(V, dtype=torch.float64)).to(dtype).requires_grad_() if bias else None
        t = torch.randint(0, V, (N,))
        cot = [torch.randn(N, dtype=torch.float64) for _ in range(3)]
        params = [x for x in (h, W, b) if x is not None]
        def run(op):
            outs = op(h, W, b, t, chunk, True)
            total = sum((o.double() * c).sum() for o, c in zip(outs, cot))
            return [o.detach().double() for o in outs] + [g.double() for g in torch.autograd.grad(total, params)]
        tri, ref = run(linear_logprobs_triton), run(linear_logprobs)
        for name, a, r in zip(("lp", "lse", "entropy", "dh", "dW", "db"), tri, ref):
            worst[name] = max(worst.get(name, 0.0), float((a - r).norm() / r.norm()))
    print(repr(worst))
""")


@pytest.mark.skipif(not triton_support.available(), reason="triton is not importable")
def test_triton_head_in_interpreter_matches_reference_op():
    """The Triton head (kernels run by Triton's CPU interpreter) against the reference op on the same
    half-precision inputs: float32 statistics agree to float32 rounding; gradients (both written in the
    half dtype) to the half dtype's rounding."""
    worst = run_interpreted(_INTERPRETED)
    for name in ("lp", "lse", "entropy"):
        assert worst[name] < 1e-5, (name, worst)
    for name in ("dh", "dW", "db"):
        assert worst[name] < 2 * torch.finfo(torch.bfloat16).eps, (name, worst)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (and triton)")
@pytest.mark.parametrize("N,V,chunk,bias", [(1000, 151936, 441, False), (257, 5000, 100, True), (3, 4097, 2, False),
                                           (3000, 1000, 128, True)])
def test_triton_head_entropy_vs_torch_path_and_fp64(N, V, chunk, bias):
    """On GPU: the Triton head's log-probs, entropies and gradients against the fp64 oracle, within
    twice the reference op's own error plus half an ulp of bf16."""
    from treecompile.ops.logprobs_triton import linear_logprobs_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(N, 256, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_()
    W = (torch.randn(V, 256, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_()
    b = (torch.randn(V, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g, device="cuda")
    cot = [torch.randn(N, generator=g, device="cuda", dtype=torch.float64) for _ in range(3)]
    params = [x for x in (h, W, b) if x is not None]

    def oracle():
        logits = h.double() @ W.double().t() + (b.double() if b is not None else 0)
        lse = logits.logsumexp(-1)
        return logits.gather(-1, t[:, None])[:, 0] - lse, lse, _dense_entropy(logits)

    want = _all(oracle(), params, cot)
    fused = _all(linear_logprobs_triton(h, W, b, t, chunk, True), params, cot)
    plain = _all(linear_logprobs(h, W, b, t, chunk, True), params, cot)
    u = torch.finfo(torch.bfloat16).eps / 2
    for name, f, p, o in zip(("lp", "lse", "entropy", "dh", "dW", "db"), fused, plain, want):
        ef, ep = rel(f, o), rel(p, o)
        assert ef <= 2 * ep + u, f"{name}: fused error {ef:.3g} > 2 * torch-path error {ep:.3g} + {u:.1g}"


@pytest.mark.parametrize("dtype,fast", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)])
def test_cuda_lowering_picks_the_triton_head_for_half_precision(monkeypatch, dtype, fast):
    """The choice of the Triton head lives in the CUDA lowering (the reference op never makes it):
    half-precision heads are swapped for ``linear_logprobs_triton`` (same arguments, entropy flag
    included); a float32 head (the near miss) and an install without triton keep the reference op."""
    from treecompile.ops import logprobs_triton
    from treecompile.passes.lower_cuda import CudaOptions, lower_cuda

    torch.manual_seed(0)
    # one decoder layer (tiny's 2 halved: the capture, one per dtype, costs about half): only the head matters
    tm = treecompile.compile(DenseForCausalLM(DenseConfig.tiny(num_hidden_layers=1)).to(dtype), entropy=True)
    ref_op = torch.ops.treecompile.linear_logprobs.default
    fast_op = torch.ops.treecompile.linear_logprobs_triton.default
    for avail in (True, False):
        monkeypatch.setattr(logprobs_triton, "available", lambda avail=avail: avail)
        # "chunked": the op itself (what head_logits="auto" runs where it does not keep the logits; test_logprobs_kept)
        lowering = lower_cuda(tm.graph_module, CudaOptions(gdn_kernel="reference", head_logits="chunked"))
        heads = [n for n in lowering.graph_module.graph.nodes if n.op == "call_function" and n.target in (ref_op, fast_op)]
        assert len(heads) == 1 and lowering.triton_head == int(fast and avail)
        assert heads[0].target == (fast_op if fast and avail else ref_op)
        assert heads[0].args[-1] is True  # entropy requested
    assert [n.target for n in tm.graph_module.graph.nodes].count(ref_op) == 1  # the CPU graph is untouched


# ------------------------------------------------------------------ objectives and train_step
@pytest.mark.parametrize("budget", [None, 6])
@pytest.mark.parametrize("normalize", ["sum", "token_mean"])
def test_entropy_bonus_in_train_step_equals_per_path(dense, budget, normalize):
    """``train_step(..., (SFT(), EntropyBonus(coef)))``, whole and packed into partitions: loss,
    gradients and the entropy metric equal the per-path computation."""
    from treecompile import reference
    from treecompile.runtime.objectives import SFT, EntropyBonus
    from treecompile.runtime.train import train_step

    model, tmodel = dense
    paths = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 2, 7, 8, 9, 10], [11, 12, 3], [1, 2, 3, 4, 5, 6]]
    coef = 0.3
    tree = Tree.from_paths(paths)
    params = list(model.parameters())
    for p in params:
        p.grad = None
    res = train_step(tmodel, tree, (SFT(), EntropyBonus(coef)), budget=budget, normalize=normalize)
    g_tree = torch.cat([p.grad.flatten() for p in params])

    ref = reference.run(model, paths, normalize=normalize)
    c = tree.path_coefficients(normalize)
    H = [per_path_entropy(model, p) for p in paths]
    bonus = -coef * sum(c[i] * H[i][1:].sum() for i in range(len(paths)))
    loss_ref = ref.loss + bonus
    g_ref = flat_grads(loss_ref, params)
    assert abs(res.loss - float(loss_ref)) <= 1e-12 * abs(float(loss_ref))
    assert rel(g_tree, g_ref) < 1e-10
    mean_H = float(sum(h[1:].sum() for h in H) / sum(len(p) - 1 for p in paths))
    assert abs(res.metrics["entropy"] - mean_H) < 1e-12
    assert res.metrics["partitions"] > (1 if budget else 0)


def test_entropy_bonus_needs_the_entropy(dense):
    from treecompile.runtime.objectives import EntropyBonus
    from treecompile.runtime.train import train_step

    model, _ = dense
    with capture_once(model):
        plain = treecompile.compile(model)
    with pytest.raises(ValueError, match="entropy=True"):
        train_step(plain, Tree.from_paths([[1, 2, 3]]), EntropyBonus(0.1))
    res = train_step(plain, Tree.from_paths([[1, 2, 3]]))
    assert res.metrics["entropy"] is None
    for p in model.parameters():
        p.grad = None
