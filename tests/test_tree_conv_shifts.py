"""``ops.tree_conv_shifts.tree_causal_conv1d_shifts`` (the tree conv as shifted products + the exceptions' index_add)
== ``treecompile::tree_causal_conv1d`` in float64, eager and under torch.compile; on CUDA in bf16 against a
float64 oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import run_interpreted
from tests.strategies import path_sets
from tests.test_fla_conv import TREES, _inputs, check_cuda_error_bound, check_equal_to_torch_op
from treecompile.ops import tree_conv_shifts
from treecompile.tree import Tree

F64 = torch.float64


def check_equal(conv_index, fn=None, **kw):
    check_equal_to_torch_op(conv_index, fn=fn or tree_conv_shifts.tree_causal_conv1d_shifts, **kw)


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("B,activation,bias", [(1, "silu", True), (2, None, False)])
def test_equals_torch_op_on_odd_trees(name, B, activation, bias):
    b = Tree.from_paths(TREES[name]).to_batch(conv_kernel=4, pad_to_multiple=8)
    check_equal(b.conv_index, B=B, seed=len(name), activation=activation, bias=bias)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=path_sets(max_paths=6, max_len=9), K=st.integers(1, 5), pad=st.sampled_from([1, 8]))
def test_equals_torch_op_on_random_trees(paths, K, pad):
    b = Tree.from_paths(paths).to_batch(conv_kernel=K, pad_to_multiple=pad)
    check_equal(b.conv_index, K=K, seed=K)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), T=st.integers(0, 12), K=st.integers(1, 5))
def test_equals_torch_op_on_any_conv_index(data, T, K):
    """Any mix of shifts, other rows and -1 (not only what a tree makes): the split is per entry."""
    entries = data.draw(st.lists(st.lists(st.integers(-1, max(T - 1, -1)), min_size=K - 1, max_size=K - 1),
                                 min_size=T, max_size=T))
    shifts = data.draw(st.lists(st.booleans(), min_size=T * (K - 1), max_size=T * (K - 1)))
    ci = torch.tensor(entries, dtype=torch.long).reshape(T, K - 1)
    for i, s in enumerate(shifts):  # make about half of the entries the plain shift (where it exists)
        t, j = divmod(i, K - 1)
        if s and t - j - 1 >= 0:
            ci[t, j] = t - j - 1
    check_equal(ci, K=K, B=2, seed=T)


def test_exceptions_table():
    b = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5, 6], [1, 7]]).to_batch(conv_kernel=3)
    exc = tree_conv_shifts.context_exceptions(b.conv_index)
    ci = b.conv_index
    got = sorted(zip(exc.token.tolist(), exc.column.tolist(), exc.sources[exc.slot].tolist()))
    want = sorted((t, j, int(ci[t, j])) for t in range(ci.shape[0]) for j in range(ci.shape[1])
                  if ci[t, j] >= 0 and ci[t, j] != t - j - 1)
    assert got == want and len(want) == 4  # the first K-1 tokens of the 2nd and 3rd branch read above their DFS neighbour
    assert exc.sources.tolist() == sorted(set(exc.sources[exc.slot].tolist()))  # distinct, increasing


def test_under_torch_compile():
    """Compiled by inductor (as lower_cuda runs it): same values and gradients, the exceptions op stays opaque."""
    b = Tree.from_paths(TREES["short_node_chain"] + [[9, 9, 9, 9, 9, 9]]).to_batch(conv_kernel=4, pad_to_multiple=8)
    fn = torch.compile(tree_conv_shifts.tree_causal_conv1d_shifts, fullgraph=True, dynamic=False)
    check_equal(b.conv_index, fn=fn)


def test_opcheck_and_bad_arguments():
    b = Tree.from_paths(TREES["short_node_chain"]).to_batch(conv_kernel=4)
    gen = torch.Generator().manual_seed(0)
    dpre = torch.randn(2, b.seq_len, 5, generator=gen, dtype=F64)
    torch.library.opcheck(tree_conv_shifts.tree_conv_context_grad, (dpre, torch.randn(5, 4, dtype=F64), b.conv_index))
    with pytest.raises(ValueError, match="conv_index"):
        tree_conv_shifts.tree_causal_conv1d_shifts(torch.randn(1, 5, b.seq_len), torch.randn(5, 3), None,
                                                   b.conv_index, None)
    with pytest.raises(ValueError, match="activation"):
        tree_conv_shifts.tree_causal_conv1d_shifts(torch.randn(1, 5, b.seq_len), torch.randn(5, 4), None,
                                                   b.conv_index, "relu")
    bad = b.conv_index.clone()
    bad[3, 1] = b.seq_len  # a row past the batch: named, never read
    with pytest.raises(ValueError, match=rf"conv_index\[3, 1\] = {b.seq_len} is past the last row {b.seq_len - 1}"):
        tree_conv_shifts.tree_conv_context_grad(dpre, torch.randn(5, 4, dtype=F64), bad)


def test_triton_backward_refuses_what_it_cannot_run():
    """The Triton backward op on CPU without the interpreter names why (tree_causal_conv1d_shifts then keeps the
    traced backward), and it checks its arguments like the registered op."""
    from treecompile.ops import tree_conv_triton

    b = Tree.from_paths(TREES["short_node_chain"]).to_batch(conv_kernel=4)
    x = torch.randn(1, b.seq_len, 5, dtype=F64)
    if not tree_conv_triton.usable(x):
        with pytest.raises(ValueError, match="Triton kernels, CUDA tensors only"):
            tree_conv_triton.tree_conv_shifts_backward(x, x, torch.randn(5, 4, dtype=F64), None, b.conv_index, True)
    else:  # TRITON_INTERPRET=1
        with pytest.raises(ValueError, match="conv_index"):
            tree_conv_triton.tree_conv_shifts_backward(x, x, torch.randn(5, 3, dtype=F64), None, b.conv_index, True)


def test_empty():
    ci = torch.zeros(0, 3, dtype=torch.long)
    x = torch.zeros(1, 5, 0, dtype=F64, requires_grad=True)
    w = torch.randn(5, 4, dtype=F64, requires_grad=True)
    y = tree_conv_shifts.tree_causal_conv1d_shifts(x, w, None, ci, "silu")
    assert y.shape == (1, 5, 0)
    dx, dw = torch.autograd.grad(y.sum(), (x, w), allow_unused=True, materialize_grads=True)
    assert dx.shape == x.shape and not dw.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [tree_conv_shifts.tree_causal_conv1d_shifts,
                                tree_conv_shifts.tree_causal_conv1d_shifts_inductor], ids=["triton", "inductor"])
def test_equals_torch_op_on_cuda(dtype, fn):
    """Compiled on CUDA vs the torch op (backward through the Triton kernels, and traced): float32 to float32
    rounding; bf16 no further from a float64 oracle than the torch op in bf16 (x 2, that error floored at 1e-3 as in
    test_fla_conv)."""
    check_cuda_error_bound(torch.compile(fn, fullgraph=True, dynamic=False), dtype)


_INTERPRETED = r"""
import random, torch
from treecompile.ops import tree_conv_shifts, tree_conv_triton
from treecompile.ops.tree_conv import tree_causal_conv1d
from treecompile.tree import Tree

from tests.helpers import branching_paths, count_launches

launched = count_launches(tree_conv_triton, "_dx_kernel")

rng = random.Random(0)
def paths():
    return branching_paths(rng, 5, 12, 10, 7)

worst = {"tree": 0.0, "any": 0.0, "bf16_dx": 0.0}
for it in range(36):
    K, B, C = rng.randint(1, 5), rng.randint(1, 2), rng.choice([3, 64, 130, 200])
    if it % 3 == 2:  # any conv_index: a mix of shifts, other rows and -1
        T = rng.randint(0, 40)
        ci = torch.tensor([[t - j - 1 if rng.random() < 0.5 else rng.randint(-1, T - 1) for j in range(K - 1)]
                           for t in range(T)], dtype=torch.long).reshape(T, K - 1)
    else:
        ci = Tree.from_paths(paths()).to_batch(conv_kernel=K, pad_to_multiple=rng.choice([1, 8])).conv_index
    T = ci.shape[0]
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, K, dtype=torch.float64, requires_grad=True)
    b = torch.randn(C, dtype=torch.float64, requires_grad=True) if rng.random() < 0.5 else None
    act = rng.choice(["silu", None])
    g = torch.randn(B, C, T, dtype=torch.float64)
    params = [p for p in (x, w, b) if p is not None]
    want = torch.autograd.grad(tree_causal_conv1d(x.transpose(1, 2), w, b, ci, act), params, g)
    got = torch.autograd.grad(tree_conv_shifts.tree_causal_conv1d_shifts(x.transpose(1, 2), w, b, ci, act), params, g)
    for q, r in zip(got, want):
        worst["any" if it % 3 == 2 else "tree"] = max(worst["any" if it % 3 == 2 else "tree"],
                                                    float((q - r).norm() / max(float(r.norm()), 1e-300)))
assert launched, "the Triton backward did not run"

# bf16: 64 children read the same parent rows; each source's sum is float32 and rounded once with the rest of dx
ci = Tree.from_paths([[1, 2, 3, 4] + [10 + i, 99] for i in range(64)]).to_batch(conv_kernel=4).conv_index
x, g = torch.randn(1, ci.shape[0], 8), torch.randn(1, ci.shape[0], 8)
w, b = torch.randn(8, 4), torch.randn(8)
bf = [t.to(torch.bfloat16) for t in (g, x, w, b)]
dx = tree_conv_triton.tree_conv_shifts_backward(*bf, ci, True)[0]
dx64 = tree_conv_triton.tree_conv_shifts_backward(*(t.double() for t in bf), ci, True)[0]
ulp = torch.exp2(torch.floor(torch.log2(dx64.abs().clamp(min=1e-30))) - 7)  # bf16's spacing at dx64
worst["bf16_dx"] = float(((dx.double() - dx64).abs() / (ulp + 1e-5 * dx64.abs().max())).max())
torch.library.opcheck(tree_conv_triton.tree_conv_shifts_backward, (g.double(), x.double(), w.double(), None, ci, True))
print(repr(worst))
"""


@pytest.mark.skipif(not tree_conv_shifts.tree_conv_triton.available(), reason="triton is not importable")
def test_triton_backward_in_interpreter_equals_torch_op():
    """The Triton backward (kernels run by Triton's CPU interpreter) through the autograd of
    ``tree_causal_conv1d_shifts``, float64, against the torch op: random trees (K 1-5, padding, batch rows,
    channels not a multiple of the block) and any conv_index, to float64 rounding; in bf16 each dx element is
    rounded once: within one bf16 ulp of the float64 result from the same bf16 inputs (the interpreter truncates
    where the GPU rounds to nearest; rounding the sources' sums first would add another ulp)."""
    worst = run_interpreted(_INTERPRETED)
    assert worst["tree"] < 1e-12 and worst["any"] < 1e-12, worst
    assert worst["bf16_dx"] <= 1, worst


def test_exceptions_made_once_per_batch_under_torch_compile(monkeypatch):
    """Two convs of one compiled graph that share conv_index, forward and backward: one host table (the compiled
    graph hands the ops the caller's tensor), and none made again once prepare() has made it."""
    made = []
    real = tree_conv_shifts.context_exceptions
    monkeypatch.setattr(tree_conv_shifts, "context_exceptions", lambda ci: made.append(1) or real(ci))
    tree_conv_shifts._EXCEPTIONS.clear()
    b = Tree.from_paths(TREES["short_node_chain"] + [[9, 9, 9, 9]]).to_batch(conv_kernel=4)
    x, w, bs, dy = _inputs(b.seq_len, 5, 4, 1, 0)

    def two(x, w, bs, ci):
        h = tree_conv_shifts.tree_causal_conv1d_shifts(x, w, bs, ci, "silu")
        return tree_conv_shifts.tree_causal_conv1d_shifts(h, w, bs, ci, "silu")

    fn = torch.compile(two, fullgraph=True, dynamic=False)
    ci = b.conv_index.clone()
    torch.autograd.grad(fn(x, w, bs, ci), (x, w), dy)
    assert len(made) == 1
    ci2 = b.conv_index.clone()  # the next batch: prepare() makes its table before the graph runs
    tree_conv_shifts.prepare(ci2)
    torch.autograd.grad(fn(x, w, bs, ci2), (x, w), dy)
    assert len(made) == 2


def test_context_grad_rounds_each_source_once_in_bf16():
    """64 children read the same parent rows: their bf16 gradients are summed in float32 and rounded once (within
    one bf16 rounding of the float64 sum of the same bf16 inputs)."""
    b = Tree.from_paths([[1, 2, 3, 4] + [10 + i, 99] for i in range(64)]).to_batch(conv_kernel=4)
    gen = torch.Generator().manual_seed(0)
    dpre = torch.randn(1, b.seq_len, 8, generator=gen).to(torch.bfloat16)
    w = torch.randn(8, 4, generator=gen).to(torch.bfloat16)
    got = tree_conv_shifts.tree_conv_context_grad(dpre, w, b.conv_index)
    want = tree_conv_shifts.tree_conv_context_grad(dpre.double(), w.double(), b.conv_index)
    assert want.abs().amax() > 0
    torch.testing.assert_close(got.double(), want.to(torch.bfloat16).double(), rtol=2 ** -8, atol=0)


def test_conv_kernel_is_a_run_option_of_compile_and_load(tmp_path):
    """``conv_kernel`` reaches the program's CudaOptions through compile() and load() (chosen at load, never saved);
    a name outside CONV_KERNELS raises (CudaOptions, before any capture or load)."""
    from helpers import cached_compile, cached_model
    from treecompile import saved
    from treecompile.models import HybridConfig, HybridForCausalLM

    def make():
        torch.manual_seed(0)
        return HybridForCausalLM(HybridConfig.tiny())

    tm = cached_compile(cached_model("hybrid-tiny-float32", make), conv_kernel="fla")
    assert tm.program.options.conv_kernel == "fla"
    saved.save(tm, tmp_path / "p")
    for kernel in ("shifts", "shifts_inductor", "reference"):
        assert saved.load(tmp_path / "p", conv_kernel=kernel).program.options.conv_kernel == kernel
    with pytest.raises(ValueError, match="conv_kernel: expected one of"):
        saved.load(tmp_path / "p", conv_kernel="triton")
