"""``treecompile::tree_causal_conv1d_fla`` (fla's varlen causal conv over the tree's chains) ==
``treecompile::tree_causal_conv1d``: on CPU with a float64 torch stand-in for fla's two conv functions (the
segments, initial states and their gradients are ours; the kernels are fla's), on CUDA with fla itself."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import ODD_TREES, path_sets
from tests.test_tree_gdn import SHORT_CHAINS
from treecompile.ops import fla_conv, tree_conv
from treecompile.tree import Tree

F64 = torch.float64
TREES = {**ODD_TREES, **SHORT_CHAINS}


def _expected_chunks(cu: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """fla's prepare_chunk_indices: (segment, chunk) for every chunk of every segment."""
    rows = [(s, c) for s, n in enumerate(cu.diff().tolist()) for c in range(-(-n // chunk_size))]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 2)


def _segment_conv(x, weight, bias, initial_state, cu, activation):
    """fla's varlen causal conv semantics in torch: each segment continues its initial state's columns 1..K-1."""
    K = weight.shape[1]
    outs = []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        xs = torch.cat([initial_state[n, :, 1:].T, x[0, s:e]], 0)  # [K-1 + L, C]
        y = sum(weight[:, k] * xs[k:k + e - s] for k in range(K))
        y = y + bias if bias is not None else y
        outs.append(F.silu(y) if activation in ("silu", "swish") else y)
    return torch.cat(outs, 0)[None]


class StandIn:
    """``fla.modules.causal_conv1d``'s ``causal_conv1d_fwd`` / ``causal_conv1d_bwd`` (the arguments the op passes,
    checked as fla would read them), float64-capable."""

    calls = 0

    @classmethod
    def _check(cls, x, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size, initial_state, weight):
        cls.calls += 1
        assert x.dim() == 3 and x.shape[0] == 1 and int(cu_seqlens[-1]) == x.shape[1]
        assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu) and bool((cu_seqlens.diff() > 0).all())
        assert torch.equal(chunk_indices.cpu(), _expected_chunks(cu_seqlens_cpu, chunk_size))
        assert initial_state.shape == (cu_seqlens.numel() - 1, weight.shape[0], weight.shape[1])

    @classmethod
    def causal_conv1d_fwd(cls, x, weight, bias, residual, initial_state=None, output_final_state=False,
                          activation=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64):
        assert residual is None and not output_final_state
        cls._check(x, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size, initial_state, weight)
        return _segment_conv(x, weight, bias, initial_state, cu_seqlens_cpu, activation), None

    @classmethod
    def causal_conv1d_bwd(cls, x, dy, dht, weight=None, bias=None, residual=None, initial_state=None,
                          activation=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_size=64):
        assert dht is None and residual is None
        cls._check(x, cu_seqlens, cu_seqlens_cpu, chunk_indices, chunk_size, initial_state, weight)
        # by hand: the op calls this below autograd (a custom op's implementation), where nothing records a graph
        K = weight.shape[1]
        dx, dw, db = torch.zeros_like(x), torch.zeros_like(weight), torch.zeros_like(weight[:, 0])
        dh0 = torch.zeros_like(initial_state)
        for n, (s, e) in enumerate(zip(cu_seqlens_cpu[:-1].tolist(), cu_seqlens_cpu[1:].tolist())):
            xs = torch.cat([initial_state[n, :, 1:].T, x[0, s:e]], 0)  # [K-1 + L, C]
            pre = sum(weight[:, k] * xs[k:k + e - s] for k in range(K)) + (bias if bias is not None else 0)
            d = dy[0, s:e]
            if activation in ("silu", "swish"):
                sg = torch.sigmoid(pre)
                d = d * sg * (1 + pre * (1 - sg))
            dxs = torch.zeros_like(xs)
            for k in range(K):
                dxs[k:k + e - s] += weight[:, k] * d
                dw[:, k] += (d * xs[k:k + e - s]).sum(0)
            db += d.sum(0)
            dx[0, s:e] = dxs[K - 1:]
            dh0[n, :, 1:] = dxs[:K - 1].T
        return dx, dw, db if bias is not None else None, None, dh0


@pytest.fixture
def stand_in(monkeypatch):
    mod = types.ModuleType("fla.modules.causal_conv1d")
    mod.causal_conv1d_fwd, mod.causal_conv1d_bwd = StandIn.causal_conv1d_fwd, StandIn.causal_conv1d_bwd
    for name in ("fla", "fla.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d", mod)
    fla_conv._SEGMENTS.clear()
    StandIn.calls = 0
    return StandIn


def _inputs(T, C, K, B, seed, dtype=F64, bias=True):
    gen = torch.Generator().manual_seed(seed)
    # x as HF hands it to the op: the transpose of a contiguous [B, T, C]
    x = torch.randn(B, T, C, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    w = torch.randn(C, K, generator=gen, dtype=dtype).requires_grad_()
    bs = torch.randn(C, generator=gen, dtype=dtype).requires_grad_() if bias else None
    dy = torch.randn(B, C, T, generator=gen, dtype=dtype)
    return x, w, bs, dy


def check_equal_to_torch_op(conv_index, *, C=5, K=4, B=1, seed=0, activation="silu", bias=True, fn=None):
    """``fn`` (default: the fla op) == the torch op in float64: output and every gradient to 1e-12."""
    T = conv_index.shape[0]
    x, w, bs, dy = _inputs(T, C, K, B, seed, bias=bias)
    leaves = [t for t in (x, w, bs) if t is not None]
    want = tree_conv.tree_causal_conv1d(x, w, bs, conv_index, activation)
    got = (fn or fla_conv.tree_causal_conv1d_fla)(x, w, bs, conv_index, activation)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_want = torch.autograd.grad(want, leaves, dy)
    g_got = torch.autograd.grad(got, leaves, dy)
    for name, a, b in zip(("x", "weight", "bias"), g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("B,activation,bias", [(1, "silu", True), (2, None, False)])
def test_equals_torch_op_on_odd_trees(stand_in, name, B, activation, bias):
    b = Tree.from_paths(TREES[name]).to_batch(conv_kernel=4, pad_to_multiple=8)  # padding: one-token segments
    check_equal_to_torch_op(b.conv_index, B=B, seed=len(name), activation=activation, bias=bias)
    assert stand_in.calls == 2  # one forward, one backward: the segments were planned once (cached)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(paths=path_sets(max_paths=8, max_len=12, vocab=3), seed=st.integers(0, 100), k=st.sampled_from([2, 3, 4]))
def test_equals_torch_op_hypothesis(stand_in, paths, seed, k):
    fla_conv._SEGMENTS.clear()
    b = Tree.from_paths(paths).to_batch(conv_kernel=k)
    check_equal_to_torch_op(b.conv_index, K=k, seed=seed)


def test_segments_follow_chains_and_any_index_is_exact(stand_in):
    # a 133-token path and a branch after its second token
    paths = [[1, 2, 3] + [4] * 130, [1, 2, 5, 6]]
    b = Tree.from_paths(paths).to_batch(conv_kernel=4)
    seg = fla_conv.conv_segments(b.conv_index, 1)
    # DFS: [1 2] [3 4...4] [5 6]: the first child continues its parent in DFS order (one segment of 133
    # tokens, three fla time tiles); the second starts from tokens 1, 0 (and none)
    assert seg.cu_seqlens_cpu.tolist() == [0, 133, 135]
    assert seg.context.tolist() == [[0, 0, 0], [1, 0, 0]]
    assert seg.valid.tolist() == [[False] * 3, [True, True, False]]
    assert seg.chunk_indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]
    check_equal_to_torch_op(b.conv_index)
    # not a tree's index (rows that do not continue their predecessor): each such token is a segment of its
    # own whose context is all state, so the result is still the torch op's
    gen = torch.Generator().manual_seed(3)
    T = 40
    ci = torch.randint(-1, T, (T, 3), generator=gen)
    ci[5:20] = tree_conv.chain_conv_index(15, 4) + 5
    ci[5:20][ci[5:20] < 5] = -1
    fla_conv._SEGMENTS.clear()
    assert fla_conv.conv_segments(ci, 1).cu_seqlens_cpu.numel() - 1 == T - 14
    check_equal_to_torch_op(ci)


def test_kernel_size_one_is_one_segment(stand_in):
    ci = tree_conv.chain_conv_index(9, 1)  # [9, 0]
    assert fla_conv.conv_segments(ci, 2).cu_seqlens_cpu.tolist() == [0, 9, 18]
    check_equal_to_torch_op(ci, K=1, B=2)


def test_empty_batches(stand_in):
    ci = torch.zeros(0, 3, dtype=torch.long)
    seg = fla_conv.conv_segments(ci, 2)
    assert seg.cu_seqlens_cpu.tolist() == [0] and seg.chunk_indices.shape == (0, 2) and seg.context.shape == (0, 3)
    x = torch.zeros(1, 5, 0, dtype=F64, requires_grad=True)
    w = torch.randn(5, 4, dtype=F64, requires_grad=True)
    y = fla_conv.tree_causal_conv1d_fla(x, w, None, ci, None)
    assert y.shape == (1, 5, 0)
    dx, dw = torch.autograd.grad(y.sum(), (x, w), allow_unused=True, materialize_grads=True)
    assert dx.shape == x.shape and not dw.any() and stand_in.calls == 0


def test_opcheck(stand_in):
    b = Tree.from_paths(TREES["short_node_chain"]).to_batch(conv_kernel=4)
    x, w, bs, _ = _inputs(b.seq_len, 5, 4, 1, 0)
    torch.library.opcheck(fla_conv.tree_causal_conv1d_fla, (x, w, bs, b.conv_index, "silu"))


def test_bad_arguments_raise_like_the_torch_op():
    b = Tree.from_paths([[1, 2, 3]]).to_batch(conv_kernel=4)
    with pytest.raises(ValueError, match="conv_index"):
        fla_conv.tree_causal_conv1d_fla(torch.randn(1, 5, 3), torch.randn(5, 3), None, b.conv_index, None)
    with pytest.raises(ValueError, match="activation"):
        fla_conv.tree_causal_conv1d_fla(torch.randn(1, 5, 3), torch.randn(5, 4), None, b.conv_index, "relu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_equals_torch_op_on_cuda(dtype):
    """fla's kernels vs the torch op on a tree with short and long nodes: float32 to float32 rounding;
    bf16 no further from a float64 oracle than the torch op in bf16 (x 2)."""
    pytest.importorskip("fla.modules.causal_conv1d")
    fla_conv._SEGMENTS.clear()
    check_cuda_error_bound(fla_conv.tree_causal_conv1d_fla, dtype)


def check_cuda_error_bound(fn, dtype):
    """``fn`` vs the torch op on CUDA on a tree with short and long nodes: float32 to float32 rounding; bf16 no further
    from a float64 oracle than the torch op in bf16 (x 2)."""
    # 12 branches of 300-700 tokens under a shared 3-token root, and 1-3-token nodes chained several levels deep
    paths = ([p + [7] * (300 + 37 * i) for i, p in enumerate(ODD_TREES["wide_fanout_64"][:12])]
             + TREES["short_node_chain"])
    b = Tree.from_paths(paths).to_batch(conv_kernel=4, pad_to_multiple=64).to("cuda")
    C, K = 96, 4
    x, w, bs, dy = _inputs(b.seq_len, C, K, 1, 0, dtype=F64)

    def run(fn, dt):
        xs = [t.detach().to("cuda", dt).requires_grad_() for t in (x, w, bs)]
        y = fn(xs[0], xs[1], xs[2], b.conv_index, "silu")
        return [y.double(), *(g.double() for g in torch.autograd.grad(y, xs, dy.to("cuda", dt)))]

    oracle = run(tree_conv.tree_causal_conv1d, F64)
    ref = run(tree_conv.tree_causal_conv1d, dtype)
    got = run(fn, dtype)
    for name, o, r, g in zip(("y", "dx", "dw", "dbias"), oracle, ref, got):
        err_ref = float((r - o).abs().max() / o.abs().max())
        err_got = float((g - o).abs().max() / o.abs().max())
        # bf16: twice the torch op's own bf16 error, that error floored at 1e-3 (a quarter of bf16's unit
        # roundoff 3.9e-3) so that an error the op happens to hit near 0 does not demand fla round better
        bound = 1e-5 if dtype == torch.float32 else 2 * max(err_ref, 1e-3)
        assert err_got <= bound, (name, err_got, err_ref)
