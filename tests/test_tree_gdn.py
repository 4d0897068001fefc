"""Tree GDN and tree causal conv on a DFS batch == each path run alone (forward and gradients)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treecompile import hf_adapters
from treecompile.ops import gdn, tree_conv, tree_gdn
from treecompile.tree import Tree
from tests.strategies import ODD_TREES, path_sets

F64 = torch.float64
Hk, Hv, Dk, Dv, C, K = 1, 2, 4, 3, 5, 4

# nodes of 1-3 tokens chained several levels deep: conv context crosses several ancestors
SHORT_CHAINS = {
    "short_node_chain": [[1, 2], [1, 3, 4], [1, 3, 5, 6], [1, 3, 5, 7, 8, 9], [1, 3, 5, 7, 2, 2, 2]],
    "branch_every_token": [[1] * d + [2] for d in range(8)],
}
TREES = {**ODD_TREES, **SHORT_CHAINS}


def path_indices(tree):
    return [tree.path_index[tree.path_offsets[p]:tree.path_offsets[p + 1]] for p in range(tree.num_paths)]


def unique_weights(tree, T):
    """1 / (number of paths through each token): summing a per-path loss with these weights counts
    every unique token once, so the per-path loss equals the tree loss exactly."""
    cnt = torch.zeros(T, dtype=F64).index_add_(0, tree.path_index, torch.ones(tree.num_path_tokens, dtype=F64))
    return 1.0 / cnt


def gdn_inputs(T, seed, *, with_init):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, T, Hk, Dk, generator=gen), torch.randn(1, T, Hk, Dk, generator=gen),
          torch.randn(1, T, Hv, Dv, generator=gen), -torch.rand(1, T, Hv, generator=gen),
          torch.rand(1, T, Hv, generator=gen)]
    xs.append(torch.randn(Hv, Dk, Dv, generator=gen) if with_init else None)
    return [x.to(F64).requires_grad_() if x is not None else None for x in xs]


def check_tree_gdn(paths, seed=0, *, with_init=True, chunk_size=4):
    tree = Tree.from_paths(paths)
    b = tree.to_batch(pad_to_multiple=8)  # padding tokens are extra one-token roots
    T = b.seq_len
    q, k, v, g, beta, h0 = gdn_inputs(T, seed, with_init=with_init)
    leaves = [x for x in (q, k, v, g, beta, h0) if x is not None]
    W = torch.randn(1, T, Hv, Dv, dtype=F64, generator=torch.Generator().manual_seed(seed + 1))
    o = tree_gdn.tree_gated_delta_rule(q, k, v, g, beta, b.node_start, b.node_end, b.node_parent, b.node_level,
                                       h0, use_qk_l2norm_in_kernel=True, chunk_size=chunk_size)
    n = tree.num_tokens
    got = torch.autograd.grad((o[:, :n] * W[:, :n]).sum(), leaves)
    per_tok = unique_weights(tree, n)
    ref_loss = 0
    for idx in path_indices(tree):
        op, _ = gdn.recurrent_gated_delta_rule(q[:, idx], k[:, idx], v[:, idx], g[:, idx], beta[:, idx],
                                               initial_state=None if h0 is None else h0[None],
                                               use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, idx], op, rtol=1e-10, atol=1e-12)
        ref_loss = ref_loss + (op * W[:, idx] * per_tok[idx][None, :, None, None]).sum()
    want = torch.autograd.grad(ref_loss, leaves, allow_unused=True)
    for name, a, w in zip("q k v g beta h0".split(), got, want):
        if w is None:  # a leaf no path reads (padding): the tree may give it zeros, never anything else
            w = torch.zeros_like(a)
        a, w = a[:, :n] if a.dim() > 3 else a, w[:, :n] if w.dim() > 3 else w
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"d{name}: {m}")


def check_tree_conv(paths, seed=0, activation="silu"):
    tree = Tree.from_paths(paths)
    b = tree.to_batch(conv_kernel=K)
    T = b.seq_len
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, C, T, generator=gen, dtype=F64).requires_grad_()
    w = torch.randn(C, K, generator=gen, dtype=F64).requires_grad_()
    bias = torch.randn(C, generator=gen, dtype=F64).requires_grad_()
    W = torch.randn(1, C, T, generator=gen, dtype=F64)
    y = tree_conv.tree_causal_conv1d(x, w, bias, b.conv_index, activation)
    got = torch.autograd.grad((y * W).sum(), (x, w, bias))
    per_tok = unique_weights(tree, T)
    ref_loss = 0
    for idx in path_indices(tree):
        yp = F.conv1d(x[:, :, idx], w[:, None], bias, padding=K - 1, groups=C)[..., :len(idx)]
        yp = F.silu(yp) if activation else yp
        torch.testing.assert_close(y[:, :, idx], yp, rtol=1e-10, atol=1e-12)
        ref_loss = ref_loss + (yp * W[:, :, idx] * per_tok[idx]).sum()
    want = torch.autograd.grad(ref_loss, (x, w, bias))
    for name, a, c in zip(("x", "weight", "bias"), got, want):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("name", sorted(TREES))
def test_tree_gdn_odd_trees(name):
    check_tree_gdn(TREES[name], seed=len(name))


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_tree_gdn_chunk_sizes_no_initial_state(chunk_size):
    check_tree_gdn(TREES["short_node_chain"], with_init=False, chunk_size=chunk_size)


def test_tree_gdn_deep_long_tree():
    # 12 levels, nodes of 1-6 tokens, under a long shared root (spans several chunks)
    gen = torch.Generator().manual_seed(7)
    root = torch.randint(0, 5, (40,), generator=gen).tolist()
    paths, cur = [], list(root)
    for d in range(12):
        cur = cur + [5 + d] + torch.randint(0, 5, (d % 6,), generator=gen).tolist()
        paths.append(list(cur))
        paths.append(cur[:-1] + [99])
    check_tree_gdn(paths, chunk_size=16)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paths=path_sets(max_paths=8, max_len=10, vocab=3), seed=st.integers(0, 100))
def test_tree_gdn_hypothesis(paths, seed):
    check_tree_gdn(paths, seed=seed, chunk_size=3)


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("activation", [None, "silu"])
def test_tree_conv_odd_trees(name, activation):
    check_tree_conv(TREES[name], seed=len(name), activation=activation)


@settings(max_examples=25, deadline=None)
@given(paths=path_sets(max_paths=8, max_len=10, vocab=3), seed=st.integers(0, 100))
def test_tree_conv_hypothesis(paths, seed):
    check_tree_conv(paths, seed=seed)


def test_hf_shims_equal_plain_kernels():
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 9, Hk, Dk, generator=gen, dtype=F64), torch.randn(2, 9, Hk, Dk, generator=gen, dtype=F64)
    v = torch.randn(2, 9, Hv, Dv, generator=gen, dtype=F64)
    g, beta = -torch.rand(2, 9, Hv, generator=gen, dtype=F64), torch.rand(2, 9, Hv, generator=gen, dtype=F64)
    o, state = hf_adapters.hf_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    want, _ = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert state is None
    torch.testing.assert_close(o, want, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="output_final_state"):
        hf_adapters.hf_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    x, w = torch.randn(2, C, 9, dtype=F64), torch.randn(C, K, dtype=F64)
    torch.testing.assert_close(hf_adapters.hf_causal_conv1d_fn(x, w, None, activation="silu"),
                               F.silu(F.conv1d(x, w[:, None], None, padding=K - 1, groups=C)[..., :9]))


def test_opcheck():
    b = Tree.from_paths([[1, 2], [1, 3, 4], [1, 3, 5]]).to_batch(conv_kernel=K)
    T = b.seq_len
    q, k, v, g, beta, h0 = [x.detach() for x in gdn_inputs(T, 0, with_init=True)]
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    for init in (h0, None):
        args = [x.clone().requires_grad_() for x in (q, k, v, g, beta)] + list(nodes) + \
            [init.clone().requires_grad_() if init is not None else None]
        torch.library.opcheck(tree_gdn.tree_gated_delta_rule, tuple(args),
                              dict(use_qk_l2norm_in_kernel=True, chunk_size=2))
    torch.library.opcheck(tree_gdn.tree_gated_delta_rule_backward,
                          (torch.randn_like(v), q, k, v, g, beta, *nodes, h0), dict(chunk_size=2))
    x = torch.randn(1, C, T, dtype=F64, requires_grad=True)
    w = torch.randn(C, K, dtype=F64, requires_grad=True)
    for bias in (torch.randn(C, dtype=F64, requires_grad=True), None):
        torch.library.opcheck(tree_conv.tree_causal_conv1d, (x, w, bias, b.conv_index, "silu"))


def test_malformed_nodes_raise():
    b = Tree.from_paths(TREES["short_node_chain"]).to_batch()
    T = b.seq_len
    q, k, v, g, beta, _ = [x.detach() if x is not None else None for x in gdn_inputs(T, 0, with_init=False)]
    parent = b.node_parent.clone()
    parent[2] = 5
    with pytest.raises(ValueError, match="node 2: parent"):
        tree_gdn.tree_gated_delta_rule(q, k, v, g, beta, b.node_start, b.node_end, parent, b.node_level)
    end = b.node_end.clone()
    end[1] -= 1
    with pytest.raises(ValueError, match="node 1: nodes must tile"):
        tree_gdn.tree_gated_delta_rule(q, k, v, g, beta, b.node_start, end, b.node_parent, b.node_level)
    with pytest.raises(ValueError, match="conv_index"):
        tree_conv.tree_causal_conv1d(torch.randn(1, C, T), torch.randn(C, 3), None, b.conv_index, None)
    with pytest.raises(ValueError, match="activation"):
        tree_conv.tree_causal_conv1d(torch.randn(1, C, T), torch.randn(C, K), None, b.conv_index, "relu")
