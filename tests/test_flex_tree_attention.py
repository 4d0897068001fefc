"""The tree BlockMask and compiled FlexAttention tree attention (treecompile/ops/flex_tree_attention.py).

Block-mask structure runs on CPU: its element-wise expansion must equal a dense tree mask built
independently (from the path predecessors, not from subtree_end), and its tile classes must be exact.
The kernel tests need CUDA (FlexAttention has no CPU backward): outputs and q/k/v grads in bf16 and
fp32 against an fp64 dense-mask SDPA oracle, with an error budget set by the same-dtype dense SDPA's
own error against that oracle.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import CUDA, DEVICES
from tests.strategies import ODD_TREES, path_sets
from treecompile import Tree
from treecompile.ops.flex_tree_attention import (
    tree_attention_flex,
    tree_block_classes,
    tree_block_mask,
    tree_mask_mod,
    tree_window_block_mask,
)
from treecompile.ops.tree_attention import tree_attention_windowed, tree_window_mask


# ---------------------------------------------------------------------------- helpers
def ancestor_mask(pred: torch.Tensor) -> torch.Tensor:
    """[T, T] bool: q sees k iff k is q or a path ancestor of q (walks pred; ignores subtree_end)."""
    T = pred.numel()
    m = torch.eye(T, dtype=torch.bool)
    rows = torch.arange(T)
    cur = pred.clone()
    while bool((cur >= 0).any()):
        ok = cur >= 0
        m[rows[ok], cur[ok]] = True
        cur = torch.where(ok, pred[cur.clamp(min=0)], cur)
    return m


def expand(block_mask, T: int, kv_len: int | None = None) -> torch.Tensor:
    """Element-wise [T, kv_len] mask a kernel computes (kv_len default T): full tiles all True, partial
    tiles the mask_mod."""
    qb, kb = block_mask.BLOCK_SIZE
    nq = block_mask.kv_num_blocks.shape[-1]
    out = torch.zeros(nq * qb, block_mask.kv_indices.shape[-1] * kb, dtype=torch.bool)
    dev = block_mask.kv_indices.device
    qi = torch.arange(out.shape[0], device=dev)[:, None]
    ki = torch.arange(out.shape[1], device=dev)[None, :]
    zero = torch.tensor(0, device=dev)
    mm = block_mask.mask_mod(zero, zero, qi, ki).cpu()
    for num, idx, is_full in ((block_mask.kv_num_blocks, block_mask.kv_indices, False),
                              (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True)):
        num, idx = num[0, 0].cpu(), idx[0, 0].cpu()
        for i in range(nq):
            for j in idx[i, : int(num[i])].tolist():
                qs, ks = slice(i * qb, (i + 1) * qb), slice(j * kb, (j + 1) * kb)
                if out[qs, ks].any():
                    raise AssertionError(f"tile ({i}, {j}) listed twice")
                out[qs, ks] = True if is_full else mm[qs, ks]
    return out[:T, :T if kv_len is None else kv_len]


def tree_batch(paths, pad_to_multiple=None):
    return Tree.from_paths(paths).to_batch(pad_to_multiple=pad_to_multiple)


def random_paths(num_tokens: int, seed: int) -> list[list[int]]:
    """A random branching tree with exactly ``num_tokens`` unique tokens (fresh ids, no accidental merges)."""
    rng = random.Random(seed)
    nxt = iter(range(10**9))
    paths = [[next(nxt) for _ in range(rng.randint(1, max(1, num_tokens // 4)))]]
    total = len(paths[0])
    while total < num_tokens:
        base = rng.choice(paths)
        keep = rng.randint(0, len(base))
        new = min(num_tokens - total, rng.randint(1, max(1, num_tokens // 8)))
        paths.append(base[:keep] + [next(nxt) for _ in range(new)])
        total += new
    return paths


def check_block_mask(subtree_end, pred, block_size, device="cpu"):
    T = subtree_end.numel()
    bm = tree_block_mask(subtree_end.to(device), block_size=block_size)
    dense = ancestor_mask(pred)
    got = expand(bm, T)
    assert torch.equal(got, dense), f"block mask differs from the tree mask at {torch.nonzero(got != dense)[:5].tolist()}"
    # tile classes are exact: full tiles fully visible, partial tiles mixed, the rest empty
    qb, kb = bm.BLOCK_SIZE
    partial, full = (c.cpu() for c in tree_block_classes(subtree_end.to(device), block_size=block_size))
    nq, nk = partial.shape
    pad = torch.zeros(nq * qb, nk * kb, dtype=torch.bool)
    pad[:T, :T] = dense
    valid = torch.zeros_like(pad)
    valid[:T, :T] = True
    tiles = pad.view(nq, qb, nk, kb).permute(0, 2, 1, 3).reshape(nq, nk, -1)
    vtiles = valid.view(nq, qb, nk, kb).permute(0, 2, 1, 3).reshape(nq, nk, -1)
    any_vis = tiles.any(-1)
    all_vis = (tiles | ~vtiles).all(-1)
    kv_ragged = torch.zeros(nk, dtype=torch.bool)
    kv_ragged[-1] = T % kb != 0
    assert torch.equal(full, any_vis & all_vis & ~kv_ragged[None, :])
    assert torch.equal(partial | full, any_vis)
    # the kernels read the index tensors as row-major: each must be contiguous and own its storage
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):
        t = getattr(bm, name)
        assert t.is_contiguous() and t.storage_offset() == 0 and t.dtype == torch.int32, name
    # the q-side lists are the transpose of the kv-side lists (the backward walks them)
    for kv_num, kv_idx, q_num, q_idx in ((bm.kv_num_blocks, bm.kv_indices, bm.q_num_blocks, bm.q_indices),
                                         (bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_q_num_blocks,
                                          bm.full_q_indices)):
        a = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            a[i, kv_idx[0, 0, i, : int(kv_num[0, 0, i])].long().cpu()] = True
        b = torch.zeros(nq, nk, dtype=torch.bool)
        for j in range(nk):
            b[q_idx[0, 0, j, : int(q_num[0, 0, j])].long().cpu(), j] = True
        assert torch.equal(a, b)
    return bm


BLOCKS = [(16, 16), (16, 32), (32, 16), (64, 64)]


@st.composite
def long_node_trees(draw, max_nodes: int = 12, max_len: int = 70):
    """Radix trees with nodes of 1..max_len tokens (longer than a block), as root-to-leaf paths."""
    n = draw(st.integers(1, max_nodes))
    parent, length = [], []
    for i in range(n):
        parent.append(draw(st.integers(-1, i - 1)))
        length.append(draw(st.integers(1, max_len)))
    start = [sum(length[:i]) for i in range(n)]  # fresh token ids per node
    node_tokens = [list(range(start[i], start[i] + length[i])) for i in range(n)]
    children = {p for p in parent}
    paths = []
    for leaf in (i for i in range(n) if i not in children):
        chain, c = [], leaf
        while c >= 0:
            chain.append(c)
            c = parent[c]
        paths.append([t for c in reversed(chain) for t in node_tokens[c]])
    return paths


# ---------------------------------------------------------------------------- block mask (CPU)
@settings(max_examples=40, deadline=None)
@given(paths=path_sets(max_paths=10, max_len=30), block=st.sampled_from(BLOCKS), pad=st.sampled_from([None, 7, 16]))
def test_block_mask_matches_tree_mask_hypothesis(paths, block, pad):
    b = tree_batch(paths, pad)
    check_block_mask(b.subtree_end, b.pred_index, block)


@settings(max_examples=60, deadline=None)
@given(paths=long_node_trees(), block=st.sampled_from(BLOCKS), pad=st.sampled_from([None, 16, 50]))
def test_block_mask_long_nodes_hypothesis(paths, block, pad):
    b = tree_batch(paths, pad)
    check_block_mask(b.subtree_end, b.pred_index, block)


@pytest.mark.parametrize("name", sorted(ODD_TREES))
def test_block_mask_odd_trees(name):
    b = tree_batch(ODD_TREES[name], 16)
    check_block_mask(b.subtree_end, b.pred_index, (16, 16))


@pytest.mark.parametrize("T,pad_to", [(63, None), (129, None), (50, 63), (100, 129), (200, 256)],
                         ids=["T63", "T129", "T50_pad63", "T100_pad129", "T200_pad256"])
@pytest.mark.parametrize("block", [(32, 32), (64, 32), (128, 128)], ids=lambda b: f"blk{b[0]}x{b[1]}")
def test_block_mask_odd_sizes(T, pad_to, block):
    b = tree_batch(random_paths(T, seed=T), pad_to)
    assert b.seq_len == (pad_to or T)
    check_block_mask(b.subtree_end, b.pred_index, block)


@pytest.mark.parametrize("device", DEVICES)
def test_block_mask_device(device):
    b = tree_batch(random_paths(700, seed=3), 768)
    bm = check_block_mask(b.subtree_end, b.pred_index, (128, 128), device)
    assert bm.kv_indices.device.type == device and bm.kv_indices.dtype == torch.int32


def test_block_mask_single_token_and_full_chain():
    check_block_mask(torch.tensor([1]), torch.tensor([-1]), (16, 16))
    T = 96  # one path: the causal mask, every tile at or below the diagonal of 32-blocks is full
    b = tree_batch([list(range(T))])
    partial, full = tree_block_classes(b.subtree_end, block_size=(32, 32))
    assert torch.equal(full, torch.ones(3, 3, dtype=torch.bool).tril(-1))
    assert torch.equal(partial, torch.eye(3, dtype=torch.bool))


def test_block_mask_rejects_bad_input():
    with pytest.raises(ValueError, match="token 2 has subtree_end 2"):
        tree_block_mask(torch.tensor([4, 2, 2, 4]))
    with pytest.raises(ValueError, match="token 0 has subtree_end 5"):
        tree_block_mask(torch.tensor([5, 2, 3, 4]))
    with pytest.raises(ValueError, match="integer tensor"):
        tree_block_mask(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="power of two"):
        tree_block_mask(torch.tensor([1]), block_size=(48, 64))


@settings(max_examples=40, deadline=None)
@given(paths=long_node_trees(max_len=40), block=st.sampled_from(BLOCKS), pad=st.sampled_from([None, 16]),
       window=st.integers(1, 90))
def test_window_block_mask_is_the_windowed_tree_mask(paths, block, pad, window):
    """Sliding windows along each path: the tiles it lists, with its mask_mod, are exactly the windowed tree
    mask (a key's depth within ``window - 1`` of the query's, on the query's path), and the tiles it prunes hold
    no visible entry."""
    b = tree_batch(paths, pad)
    T = b.seq_len
    bm = tree_window_block_mask(b.subtree_end, b.position_ids, window, block_size=block)
    dense = ancestor_mask(b.pred_index) & (b.position_ids[:, None] - b.position_ids[None, :] < window)
    assert torch.equal(tree_window_mask(b.subtree_end, b.position_ids, window), dense)
    assert torch.equal(expand(bm, T), dense)


def _listed(num, idx, i):
    return sorted(idx[0, 0, i, : int(num[0, 0, i])].tolist())


def test_window_block_mask_prunes_tiles_past_the_window():
    """One path of 200 tokens, 16-token tiles.  A window of 16: query tile i lists key tiles i - 1 and i only, both
    partial.  A window of 64: tiles i - 3 .. i - 1 are full (the window cuts none of their pairs), i - 4 and i
    partial, the rest pruned (the last, ragged query tile: all partial)."""
    b = tree_batch([list(range(200))])
    bm = tree_window_block_mask(b.subtree_end, b.position_ids, 16, block_size=(16, 16))
    for i in range(bm.kv_num_blocks.shape[-1]):
        assert _listed(bm.kv_num_blocks, bm.kv_indices, i) == list(range(max(i - 1, 0), i + 1))
        assert _listed(bm.full_kv_num_blocks, bm.full_kv_indices, i) == []
    bm = tree_window_block_mask(b.subtree_end, b.position_ids, 64, block_size=(16, 16))
    for i in range(12):  # the 13th query tile holds padding: its tiles stay partial
        assert _listed(bm.full_kv_num_blocks, bm.full_kv_indices, i) == list(range(max(i - 3, 0), i))
        assert _listed(bm.kv_num_blocks, bm.kv_indices, i) == ([i - 4] if i >= 4 else []) + [i]
    assert _listed(bm.full_kv_num_blocks, bm.full_kv_indices, 12) == []
    assert _listed(bm.kv_num_blocks, bm.kv_indices, 12) == [8, 9, 10, 11, 12]


def test_windowed_ops_pass_opcheck():
    """The windowed op and its backward op: fakes that match the real results' shapes and strides (q/k/v arrive
    as transposed views of [B, T, H, D]), registered autograd, and the dense reference's gradients."""
    from treecompile.ops.tree_attention import tree_attention_windowed_backward, tree_attention_windowed_reference
    b = tree_batch([[1, 2, 3, 4, 5, 6], [1, 2, 7], [8]])
    T = b.seq_len
    q, k, v = (torch.randn(1, T, h, 8, dtype=torch.float64).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
    args = (q, k, v, b.subtree_end, b.position_ids, 2, None)
    torch.library.opcheck(tree_attention_windowed, args)
    g = torch.randn(1, 4, T, 8, dtype=torch.float64)
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)  # no double backward
    torch.library.opcheck(tree_attention_windowed_backward, (g, *plain))
    got = torch.autograd.grad(tree_attention_windowed(*args), (q, k, v), g)
    want = torch.autograd.grad(tree_attention_windowed_reference(*args), (q, k, v), g)
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-12, atol=1e-12)


def test_window_block_mask_rejects_bad_input():
    b = tree_batch([[1, 2, 3]])
    with pytest.raises(ValueError, match="window"):
        tree_window_block_mask(b.subtree_end, b.position_ids, 0)
    with pytest.raises(ValueError, match="position_ids"):
        tree_window_block_mask(b.subtree_end, b.position_ids[:2], 2)


def test_mask_mod_is_the_tree_rule():
    se = torch.tensor([3, 2, 3, 4])
    mm = tree_mask_mod(se)
    q = torch.arange(4)[:, None]
    k = torch.arange(4)[None, :]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mm(0, 0, q, k), expected)


# ---------------------------------------------------------------------------- kernel (CUDA)
def dense_sdpa(q, k, v, mask, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def rel_err(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


CASES = [  # (tree tokens, padded length, dtype, heads, kv heads, head dim)
    (63, None, torch.bfloat16, 4, 2, 128),
    (100, 129, torch.float32, 4, 4, 64),
    (129, None, torch.float32, 2, 1, 128),
    (1000, 1024, torch.bfloat16, 4, 2, 128),
    (3000, None, torch.bfloat16, 4, 2, 64),
]


def out_and_grads(fn, q, k, v, do, dt):
    """``[out, dq, dk, dv]`` of ``fn(q, k, v)`` run in dtype ``dt``, back-propagating ``do``."""
    qq, kk, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
    o = fn(qq, kk, vv)
    o.backward(do.to(dt))
    return [o.detach(), qq.grad, kk.grad, vv.grad]


@pytest.mark.skipif(not CUDA, reason="FlexAttention backward needs a CUDA device")
@pytest.mark.parametrize("T,pad_to,dtype,H,Hkv,D", CASES,
                         ids=[f"T{c[0]}{'_pad' + str(c[1]) if c[1] else ''}_{str(c[2])[6:]}_H{c[3]}kv{c[4]}_D{c[5]}"
                              for c in CASES])
def test_tree_attention_flex_vs_fp64_oracle(T, pad_to, dtype, H, Hkv, D):
    b = tree_batch(random_paths(T, seed=T + D), pad_to).to("cuda")
    L = b.seq_len
    dense = ancestor_mask(b.pred_index.cpu()).cuda()
    bm = tree_block_mask(b.subtree_end)
    scale = D ** -0.5
    g = torch.Generator(device="cuda").manual_seed(T)
    q, k, v = (torch.randn(1, h, L, D, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv))
    do = torch.randn(1, H, L, D, device="cuda", generator=g).to(dtype)

    def run(fn, dt):
        return out_and_grads(fn, q, k, v, do, dt)

    oracle = run(lambda a, b_, c: dense_sdpa(a, b_, c, dense, scale), torch.float64)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = run(lambda a, b_, c: dense_sdpa(a, b_, c, dense, scale), dtype)
    flex = run(lambda a, b_, c: tree_attention_flex(a, b_, c, bm, scale=scale, enable_gqa=H != Hkv), dtype)
    u = torch.finfo(dtype).eps / 2
    for name, f, r, o in zip(("out", "dq", "dk", "dv"), flex, ref, oracle):
        assert torch.isfinite(f).all(), name
        ef, er = rel_err(f, o), rel_err(r, o)
        # budget: twice the same-dtype dense SDPA's own error, plus one rounding of the result
        assert ef <= 2 * er + u, f"{name}: flex error {ef:.3g} > 2 * dense {dtype} error {er:.3g} + {u:.1g}"


@pytest.mark.skipif(not CUDA, reason="FlexAttention backward needs a CUDA device")
@pytest.mark.parametrize("how", ["op", "flex", "fa4"])
@pytest.mark.parametrize("T,window,dtype", [(1000, 64, torch.bfloat16), (3000, 300, torch.bfloat16),
                                            (500, 7, torch.float32)])
def test_tree_attention_windowed_flex_vs_fp64_oracle(T, window, dtype, how):
    """Sliding-window tree attention on CUDA against the dense windowed mask in float64: within twice the
    same-dtype dense SDPA's error.  ``op``: ``treecompile::tree_attention_windowed`` called as it is (FlexAttention
    inside, its backward recomputes the forward); ``flex`` and ``fa4``: what the CUDA lowering runs (compiled
    FlexAttention under the window block mask with flex's own backward; the Triton kernel with
    ``window_kernel_options_for``, or FA4 through the FLASH backend where it runs)."""
    from treecompile.ops.fa4_tree_attention import fa4_unusable_reason, tree_attention_fa4
    from treecompile.ops.flex_tree_attention import tree_window_block_mask, window_kernel_options_for
    if how == "fa4" and (dtype != torch.bfloat16 or fa4_unusable_reason() is not None):
        pytest.skip(f"FA4: {fa4_unusable_reason() or 'bfloat16 inputs only here'}")
    b = tree_batch(random_paths(T, seed=T + window)).to("cuda")
    L, H, Hkv, D = b.seq_len, 4, 2, 128
    dense = tree_window_mask(b.subtree_end, b.position_ids, window)
    g = torch.Generator(device="cuda").manual_seed(T)
    q, k, v = (torch.randn(1, h, L, D, device="cuda", generator=g).to(dtype) for h in (H, Hkv, Hkv))
    do = torch.randn(1, H, L, D, device="cuda", generator=g).to(dtype)
    scale = D ** -0.5
    oracle = out_and_grads(lambda a, b_, c: dense_sdpa(a, b_, c, dense, scale), q, k, v, do, torch.float64)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = out_and_grads(lambda a, b_, c: dense_sdpa(a, b_, c, dense, scale), q, k, v, do, dtype)
    if how == "op":
        fn = lambda a, b_, c: tree_attention_windowed(a, b_, c, b.subtree_end, b.position_ids, window,  # noqa: E731
                                                      scale)
    else:
        bm = tree_window_block_mask(b.subtree_end, b.position_ids, window)
        fn = (lambda a, b_, c: tree_attention_fa4(a, b_, c, bm, scale=scale, enable_gqa=True)) if how == "fa4" \
            else (lambda a, b_, c: tree_attention_flex(a, b_, c, bm, scale=scale, enable_gqa=True,
                                                       kernel_options=window_kernel_options_for(a)))
    got = out_and_grads(fn, q, k, v, do, dtype)
    u = torch.finfo(dtype).eps / 2
    for name, f, r, o in zip(("out", "dq", "dk", "dv"), got, ref, oracle):
        assert torch.isfinite(f).all(), name
        ef, er = rel_err(f, o), rel_err(r, o)
        assert ef <= 2 * er + u, f"{name}: windowed error {ef:.3g} > 2 * dense {dtype} error {er:.3g} + {u:.1g}"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_tree_attention_flex_rejects_mismatch():
    b = tree_batch(random_paths(64, seed=1)).to("cuda")
    bm = tree_block_mask(b.subtree_end)
    q = torch.randn(1, 2, 65, 64, device="cuda")
    with pytest.raises(ValueError, match="seq_lengths"):
        tree_attention_flex(q, q, q, bm)
    q = torch.randn(1, 2, 64, 64, device="cuda")
    with pytest.raises(ValueError, match="enable_gqa"):
        tree_attention_flex(q, q[:, :1], q[:, :1], bm)
