"""Tree / TreeBatch: structure, paths read back exactly, weights equal the per-path formulas."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treecompile import NORMALIZATIONS, Tree, TreeBatch
from treecompile.ops.tree_layout import heavy_first_order
from treecompile.tree import ORDERS, _range_sums, ancestor_index
from strategies import ODD_TREES, path_sets, weighted_path_sets


def prefix_key(tree: Tree, t: int) -> tuple:
    """The token sequence from the root to DFS token t, following pred."""
    out = []
    while t >= 0:
        out.append(int(tree.input_ids[t]))
        t = int(tree.pred[t])
    return tuple(reversed(out))


def check_structure(paths, order="heavy_first"):
    tree = Tree.from_paths(paths, order=order)
    assert tree.order == order
    T = tree.num_tokens
    prefixes = {tuple(p[: i + 1]) for p in paths for i in range(len(p))}
    # each unique token (= unique prefix) appears exactly once
    keys = [prefix_key(tree, t) for t in range(T)]
    assert len(keys) == T == len(set(keys)) == len(prefixes) and set(keys) == prefixes
    assert tree.num_path_tokens == sum(map(len, paths))
    assert math.isclose(tree.por, 1 - T / tree.num_path_tokens)
    # each path read back along the batch
    batch = tree.to_batch()
    for p, path in enumerate(paths):
        s, e = int(tree.path_offsets[p]), int(tree.path_offsets[p + 1])
        idx = tree.path_index[s:e]
        assert batch.input_ids[idx].tolist() == list(path)
        assert batch.position_ids[idx].tolist() == list(range(len(path)))
        assert batch.pred_index[idx].tolist() == [-1] + idx[:-1].tolist()
        for j in range(3):  # conv context: the j+1-th previous token along the path
            want = [int(idx[i - j - 1]) if i - j - 1 >= 0 else -1 for i in range(len(path))]
            assert batch.conv_index[idx, j].tolist() == want
    # path counts: tokens counted once per path through them
    counts = tree.aggregate(torch.ones(len(paths)), torch.ones(tree.num_path_tokens))
    assert int(counts.sum()) == tree.num_path_tokens
    for t in range(T):
        assert int(counts[t]) == sum(1 for p in paths if tuple(p[: len(keys[t])]) == keys[t])
    # subtree interval: exactly the tokens whose prefix extends t's
    for t in range(T):
        inside = {u for u in range(T) if keys[u][: len(keys[t])] == keys[t]}
        assert inside == set(range(t, int(tree.subtree_end[t])))
    # radix nodes: maximal chains; parents; levels
    children = [0] * T
    for t in range(T):
        if int(tree.pred[t]) >= 0:
            children[int(tree.pred[t])] += 1
    ends = {int(tree.path_index[int(tree.path_offsets[p + 1]) - 1]) for p in range(len(paths))}
    for n in range(tree.num_nodes):
        s, e = int(tree.node_start[n]), int(tree.node_end[n])
        assert (tree.node_id[s:e] == n).all()
        for t in range(s + 1, e):
            assert int(tree.pred[t]) == t - 1 and children[t - 1] == 1 and (t - 1) not in ends
        last = e - 1
        assert children[last] != 1 or last in ends  # compressed: a node ends at a branch or a path end
        par = int(tree.node_parent[n])
        assert par == (-1 if int(tree.pred[s]) < 0 else int(tree.node_id[int(tree.pred[s])]))
        assert int(tree.node_level[n]) == (0 if par < 0 else int(tree.node_level[par]) + 1)
    return tree


@settings(max_examples=150, deadline=None)
@given(path_sets(), st.sampled_from(ORDERS))
def test_structure_random(paths, order):
    check_structure(paths, order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", sorted(ODD_TREES))
def test_structure_odd(name, order):
    check_structure(ODD_TREES[name], order)


def check_heavy_first(paths):
    """``order="heavy_first"``: every node's children (and the roots) start in order of non-increasing subtree
    size, ties in the lexicographic tree's order (checked here directly); the tokens are the lexicographic tree's in
    ``tree_layout.heavy_first_order`` (which shares the node rule ``tree.heavy_first_starts`` but reads its nodes
    and parents off ``subtree_end`` alone, not off the walk, and moves tokens, not paths), with the same paths,
    depths, links and weights."""
    lex, hf = Tree.from_paths(paths, order="lex"), Tree.from_paths(paths, order="heavy_first")
    size = (hf.node_subtree_end - hf.node_start).tolist()
    kids: dict[int, list[int]] = {}
    for n, p in enumerate(hf.node_parent.tolist()):
        kids.setdefault(p, []).append(n)  # nodes are numbered in DFS order: siblings in visiting order
    for group in kids.values():
        sizes = [size[n] for n in group]
        assert sizes == sorted(sizes, reverse=True)
    perm, pos = heavy_first_order(lex.subtree_end)
    assert torch.equal(hf.input_ids, lex.input_ids[perm]) and torch.equal(hf.depth, lex.depth[perm])
    assert torch.equal(hf.subtree_end, pos[perm] + (lex.subtree_end - torch.arange(lex.num_tokens))[perm])
    assert torch.equal(hf.pred, torch.where(lex.pred >= 0, pos[lex.pred.clamp(min=0)], -1)[perm])
    assert torch.equal(hf.path_index, pos[lex.path_index]) and torch.equal(hf.path_end, pos[lex.path_end])
    for normalize in NORMALIZATIONS:
        torch.testing.assert_close(hf.token_weights(normalize), lex.token_weights(normalize)[perm],
                                   rtol=1e-15, atol=0)


@settings(max_examples=150, deadline=None)
@given(path_sets())
def test_heavy_first_order_random(paths):
    check_heavy_first(paths)


@pytest.mark.parametrize("name", sorted(ODD_TREES))
def test_heavy_first_order_odd(name):
    check_heavy_first(ODD_TREES[name])


def test_heavy_first_visits_the_light_branch_last():
    """A spine with a one-token leaf off every node: lexicographically the leaf (a smaller id) comes first, so
    every later spine node starts a new tile-straddling branch; heavy-first puts each leaf after the spine."""
    paths = [[1, 50, 51, 52, 53], [1, 2], [1, 50, 3], [1, 50, 51, 4]]
    assert Tree.from_paths(paths, order="lex").input_ids.tolist() == [1, 2, 50, 3, 51, 4, 52, 53]
    assert Tree.from_paths(paths).input_ids.tolist() == [1, 50, 51, 52, 53, 4, 3, 2]


def test_order_is_checked_and_kept_by_merge():
    with pytest.raises(ValueError, match="order: expected one of"):
        Tree.from_paths([[1, 2]], order="bfs")
    a, b = Tree.from_paths([[1, 2], [1, 3, 4]], order="lex"), Tree.from_paths([[5, 6]], order="lex")
    assert Tree.merge([a, b]).order == "lex"
    assert Tree.merge([a, Tree.from_paths([[5, 6]])]).order == "heavy_first"  # mixed: the default


def per_path_loss(paths, masks, weights, losses, normalize):
    """The per-path formulas of each normalization, written out directly."""
    N = len(paths)
    sums = [sum(m * losses[tuple(p[: i + 1])] for i, m in enumerate(mk)) for p, mk in zip(paths, masks)]
    if normalize == "sum":
        return sum(c * s for c, s in zip(weights, sums)) / N
    if normalize == "path_mean":
        return sum(c * s / sum(mk) for c, s, mk in zip(weights, sums, masks) if sum(mk) > 0) / N
    total = sum(sum(mk) for mk in masks)
    return sum(c * s for c, s in zip(weights, sums)) / total if total else 0.0


@settings(max_examples=150, deadline=None)
@given(weighted_path_sets(), st.sampled_from(NORMALIZATIONS), st.booleans(), st.randoms())
def test_weights_equal_per_path_formulas(pmw, normalize, default_masks, rnd):
    paths, masks, weights = pmw
    if default_masks:
        masks = [[0] + [1] * (len(p) - 1) for p in paths]
    tree = Tree.from_paths(paths, loss_masks=None if default_masks else masks, path_weights=weights)
    keys = [prefix_key(tree, t) for t in range(tree.num_tokens)]
    losses = {k: rnd.uniform(0.1, 5.0) for k in keys}  # a token's loss depends only on its prefix
    batch = tree.to_batch(normalize=normalize)
    got = float(sum(batch.loss_weight[t] * losses[keys[t]] for t in range(tree.num_tokens)))
    want = per_path_loss(paths, masks, weights, losses, normalize)
    assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12)


@settings(max_examples=80, deadline=None)
@given(weighted_path_sets(), st.sampled_from(NORMALIZATIONS))
def test_default_mask_fast_path_matches_general(pmw, normalize):
    paths, _, weights = pmw
    tree = Tree.from_paths(paths, path_weights=weights)
    coef = tree.path_coefficients(normalize)
    fast = tree.aggregate(coef)
    general = tree.aggregate(coef, tree.loss_mask)
    torch.testing.assert_close(fast, general, rtol=1e-12, atol=1e-12)


def exact_token_weights(tree, coef):
    """w(t) = sum over paths p through t of coef[p] (default masks), each sum exact (math.fsum),
    and the scale of its rounding: sum of |coef[p]| over the same paths."""
    terms = [[] for _ in range(tree.num_tokens)]
    for p in range(tree.num_paths):
        s, e = int(tree.path_offsets[p]), int(tree.path_offsets[p + 1])
        for t in tree.path_index[s + 1:e].tolist():  # token 0 of a path is untrained
            terms[t].append(float(coef[p]))
    return ([math.fsum(x) for x in terms], [math.fsum(abs(v) for v in x) for x in terms])


@settings(max_examples=80, deadline=None)
@given(weighted_path_sets(), st.sampled_from(NORMALIZATIONS))
def test_default_mask_token_weights_have_relative_accuracy(pmw, normalize):
    """Each token's weight is accurate relative to its own paths' weights (no absolute tolerance):
    rounding may not borrow magnitude from paths that do not pass through the token."""
    paths, _, weights = pmw
    tree = Tree.from_paths(paths, path_weights=weights)
    coef = tree.path_coefficients(normalize)
    exact, scale = exact_token_weights(tree, coef)
    for got, want, sc in zip(tree.aggregate(coef).tolist(), exact, scale):
        assert abs(got - want) <= 1e-14 * sc, (got, want, sc)


def test_tiny_path_weight_is_not_absorbed_by_other_paths():
    """Regression: w(t) was a difference of prefix sums over DFS path ends, so the tiny weight of
    path [1, 2, 3] vanished in (0.75 + 1.5e-136) - 0.75 (path [1] ends before it, and trains
    nothing): every token weight, the loss and the gradient were 0 instead of ~1e-136."""
    tree = Tree.from_paths([[1], [1, 2, 3]], path_weights=[1.5, 3e-136])
    for normalize in NORMALIZATIONS:
        coef = tree.path_coefficients(normalize)
        exact, _ = exact_token_weights(tree, coef)
        assert tree.aggregate(coef).tolist() == exact
        assert exact[1] == exact[2] == float(coef[1]) > 0
    tree = Tree.from_paths([[4, 5], [4, 5, 6], [4, 7], [4, 5, 6], [4, 7, 8]],
                           path_weights=[2.0, 1e-200, -2.0, 5e-324, 1.0])
    coef = tree.path_coefficients("sum")
    exact, scale = exact_token_weights(tree, coef)
    assert tree.aggregate(coef).tolist() == exact


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 100])
def test_range_sums_add_only_their_own_range(n):
    rng = random.Random(n)
    vals = [rng.choice([1.5, -1.5, 3e-136, 1e-300, 0.0, rng.uniform(-2, 2)]) for _ in range(n)]
    pairs = [(a, b) for a in range(n + 1) for b in range(a, n + 1)]
    got = _range_sums(torch.tensor(vals, dtype=torch.float64), torch.tensor([a for a, _ in pairs]),
                      torch.tensor([b for _, b in pairs])).tolist()
    for (a, b), g in zip(pairs, got):
        assert abs(g - math.fsum(vals[a:b])) <= 1e-14 * math.fsum(abs(v) for v in vals[a:b]), (a, b)


def test_padding_sees_only_itself():
    tree = Tree.from_paths([[1, 2, 3], [1, 4]])
    b = tree.to_batch(pad_to_multiple=8)
    assert b.seq_len == 8 and b.num_tokens == 4
    pad = torch.arange(4, 8)
    assert (b.loss_weight[pad] == 0).all() and (b.position_ids[pad] == 0).all()
    assert (b.pred_index[pad] == -1).all() and (b.conv_index[pad] == -1).all()
    assert b.subtree_end[pad].tolist() == (pad + 1).tolist()
    assert (b.subtree_end[:4] <= 4).all()  # no real token's interval reaches the padding
    # the padding is one extra root node
    assert b.node_start[-1] == 4 and b.node_end[-1] == 8 and b.node_parent[-1] == -1 and b.node_level[-1] == 0
    assert (b.node_id[pad] == b.num_nodes - 1).all()


@settings(max_examples=60, deadline=None)
@given(weighted_path_sets(), st.integers(0, 10_000), st.sampled_from([1, 2, 4]))
def test_from_tokens_restricts_the_tree(pmw, seed, K):
    """A token subset: ids/depths/weights are the tree's, local links exist exactly where the path
    predecessor / conv context is in the subset, a node never spans a gap or a whole-tree node start."""
    paths, masks, weights = pmw
    tree = Tree.from_paths(paths, loss_masks=masks, path_weights=weights)
    whole = TreeBatch.from_tokens(tree, None, normalize="path_mean", conv_kernel=K)
    ref = tree.to_batch(normalize="path_mean", conv_kernel=K)
    for f in ("input_ids", "position_ids", "pred_index", "loss_weight", "subtree_end", "node_id", "conv_index"):
        assert torch.equal(getattr(whole, f), getattr(ref, f)), f
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(tree.num_tokens, generator=g) < 0.6
    keep[int(torch.randint(tree.num_tokens, (1,), generator=g))] = True
    tok = torch.nonzero(keep).flatten()
    w = torch.rand(tok.numel(), generator=g, dtype=torch.float64)
    b = TreeBatch.from_tokens(tree, tok, weights=w, normalize="sum", conv_kernel=K, pad_to_multiple=8)
    n = tok.numel()
    assert b.tree is None and torch.equal(b.extras["tokens"], tok) and b.seq_len % 8 == 0
    assert torch.equal(b.input_ids[:n], tree.input_ids[tok]) and torch.equal(b.position_ids[:n], tree.depth[tok])
    assert torch.equal(b.loss_weight[:n], w) and (b.loss_weight[n:] == 0).all()
    ctx = ancestor_index(tree.pred, K, rows=tok)  # column 0: the predecessor, then the conv context
    for loc, glob in ((b.pred_index[:n, None], ctx[:, :1]), (b.conv_index[:n], ctx[:, :K - 1])):
        inside = (glob >= 0) & keep[glob.clamp(min=0)]
        assert torch.equal(loc >= 0, inside)
        assert torch.equal(tok[loc.clamp(min=0)][loc >= 0], glob[loc >= 0])
    # attention: local k is seen by local q iff the whole tree's k sees q
    se = tree.subtree_end[tok]
    sees = (tok[None, :] <= tok[:, None]) & (tok[:, None] < se[None, :])
    ar = torch.arange(n)
    assert torch.equal((ar[None, :] <= ar[:, None]) & (ar[:, None] < b.subtree_end[:n][None, :]), sees)
    # radix nodes of the subset: j ends its node iff it has != 1 child in the subset, its child is not
    # j+1, or it is one of node_ends; a node's parent holds its first token's predecessor
    ends = tok[torch.rand(n, generator=g) < 0.2]
    b = TreeBatch.from_tokens(tree, tok, weights=w, conv_kernel=K, pad_to_multiple=8, node_ends=ends)
    pred = b.pred_index[:n].tolist()
    for j in range(n):
        kids = [q for q in range(n) if pred[q] == j]
        want_end = len(kids) != 1 or kids[0] != j + 1 or int(tok[j]) in set(ends.tolist())
        assert (int(b.node_end[int(b.node_id[j])]) == j + 1) == want_end, j
        if j > 0 and int(b.node_start[int(b.node_id[j])]) < j:
            assert pred[j] == j - 1
    for k in range(b.num_nodes - (b.seq_len > n)):
        s_ = int(b.node_start[k])
        par = int(b.node_parent[k])
        assert par == (int(b.node_id[pred[s_]]) if pred[s_] >= 0 else -1)
        assert int(b.node_level[k]) == (0 if par < 0 else int(b.node_level[par]) + 1)
    if b.seq_len > n:
        assert b.node_start[-1] == n and b.node_end[-1] == b.seq_len and b.node_parent[-1] == -1


def test_from_tokens_refuses_bad_input():
    tree = Tree.from_paths([[1, 2, 3], [1, 4]])
    with pytest.raises(ValueError, match="tokens: expected ascending"):
        TreeBatch.from_tokens(tree, torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="tokens: expected ascending"):
        TreeBatch.from_tokens(tree, torch.tensor([0, 9]))
    with pytest.raises(ValueError, match=r"weights: expected shape \[2\]"):
        TreeBatch.from_tokens(tree, torch.tensor([0, 1]), weights=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"weights: expected shape \[4\]"):
        tree.to_batch(weights=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="partition"):
        TreeBatch.from_tokens(tree, torch.tensor([0, 1])).path_logprobs(torch.zeros(2))


def test_to_batch_weights_are_used_as_given():
    tree = Tree.from_paths([[1, 2, 3], [1, 4]])
    w = torch.tensor([0.0, 0.5, -2.0, 3.0], dtype=torch.float64)
    b = tree.to_batch(normalize="token_mean", weights=w, pad_to_multiple=8)
    assert b.normalize == "token_mean" and torch.equal(b.loss_weight, torch.cat([w, torch.zeros(4, dtype=torch.float64)]))


def test_path_logprobs_roundtrip():
    paths = ODD_TREES["one_token_nodes"] + [[1, 2]]
    tree = Tree.from_paths(paths)
    b = tree.to_batch(pad_to_multiple=16)
    lp = torch.randn(b.seq_len, requires_grad=True)
    per = b.path_logprobs(lp)
    assert len(per) == len(paths)
    for p, (path, t) in enumerate(zip(paths, per)):
        s = int(tree.path_offsets[p])
        assert torch.equal(t, lp.detach()[tree.path_index[s:s + len(path)]])
    sum(t.sum() for t in per).backward()  # shared tokens collect one gradient per path
    counts = tree.aggregate(torch.ones(len(paths)), torch.ones(tree.num_path_tokens))
    torch.testing.assert_close(lp.grad[: tree.num_tokens], counts.float())


def test_ancestor_index_matches_repeated_pred():
    pred = torch.tensor([-1, 0, 1, 1, -1, 4])
    assert ancestor_index(pred, 2).tolist() == [[-1, -1], [0, -1], [1, 0], [1, 0], [-1, -1], [4, -1]]


def test_large_random_tree_matches_bruteforce_counts():
    rnd = random.Random(1)
    paths = [[rnd.randrange(3) for _ in range(rnd.randrange(1, 30))] for _ in range(200)]
    tree = Tree.from_paths(paths)
    assert tree.num_tokens == len({tuple(p[: i + 1]) for p in paths for i in range(len(p))})


_TENSOR_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
                   torch.uint64]


@pytest.mark.parametrize("order", ORDERS)
def test_tensor_and_numpy_paths_build_the_list_tree(order):
    """Paths given as tensors (every integer dtype, strided, mixed with lists) or NumPy arrays build the tree of the
    same paths given as lists: the block copy of a whole path reads every id in place."""
    rnd = random.Random(3)
    paths = [[rnd.randrange(1, 120) for _ in range(rnd.randrange(1, 40))] for _ in range(30)]
    paths += [paths[0][:5] + [7, 8], list(paths[1]), [100]]
    want = Tree.from_paths(paths, order=order)

    def same(tree):
        for f in ("input_ids", "depth", "pred", "subtree_end", "path_index", "path_end"):
            assert torch.equal(getattr(tree, f), getattr(want, f)), f

    for dt in _TENSOR_DTYPES:
        same(Tree.from_paths([torch.tensor(p, dtype=dt) for p in paths], order=order))
    wide = [torch.tensor([[x, -1] for x in p])[:, 0] for p in paths]  # strided views
    assert not wide[0].is_contiguous()
    same(Tree.from_paths([w if i % 2 else paths[i] for i, w in enumerate(wide)], order=order))
    np = pytest.importorskip("numpy")
    for dt in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        same(Tree.from_paths([np.array(p, dtype=dt) for p in paths], order=order))
    same(Tree.from_paths([np.array([[x, -1] for x in p])[:, 0] for p in paths], order=order))


def test_bad_tensor_and_numpy_paths_are_named():
    for bad, message in [
        ([[1], torch.tensor([[1, 2]])], r"path 1: expected a 1-D sequence of token ids, got shape \(1, 2\)"),
        ([[1], torch.tensor([True])], "path 1: token ids must be integers, got dtype torch.bool"),
        ([torch.tensor([], dtype=torch.int32)], "path 0: empty path"),
        ([[1, 2], torch.tensor([3, -4], dtype=torch.int16)], "path 1: token ids must be non-negative"),
        ([torch.tensor([2 ** 63 + 5], dtype=torch.uint64)], "path 0: token ids must be non-negative"),
    ]:
        with pytest.raises(ValueError, match=message):
            Tree.from_paths(bad)
    np = pytest.importorskip("numpy")
    for bad, message in [
        ([[1], np.array([1.0, 2.0])], r"path 1: token ids must be integers, got .*1\.0.* \(float64\) at position 0"),
        ([np.array([True, False])], r"path 0: token ids must be integers, got .*True.* at position 0"),
        ([np.zeros((2, 2), dtype=np.int64)], r"path 0: expected a 1-D sequence of token ids, got shape \(2, 2\)"),
        ([np.array([], dtype=np.int32)], "path 0: empty path"),
        ([[1], np.array([1, -2], dtype=np.int8)], "path 1: token ids must be non-negative"),
        ([np.array([2 ** 63 + 5], dtype=np.uint64)], "path 0: token ids must be non-negative"),
    ]:
        with pytest.raises(ValueError, match=message):
            Tree.from_paths(bad)


@pytest.mark.parametrize("bad, message", [
    ([], "no paths"),
    ([[1, 2], []], "path 1: empty path"),
    ([[1, 2], [1, 2.5]], "path 1: token ids must be"),
    ([[1, 2], [3, -4]], "path 1: token ids must be non-negative"),
    ([[1], torch.tensor([1.0, 2.0])], "path 1: token ids must be integers"),
    ([[1], "abc"], "path 1: expected a sequence"),
    ([[1], {1: 2, 3: 4}], "path 1: expected a sequence of token ids, got dict"),  # its values were dropped
    ([{5, 1, 3}], "path 0: expected a sequence of token ids, got set"),  # in its hash's order
])
def test_bad_paths(bad, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_paths(bad)


@pytest.mark.parametrize("kw, message", [
    (dict(loss_masks=[[0, 1]]), "expected 2 masks"),
    (dict(loss_masks=[[0, 1], [0, 1]]), "path 1: loss mask has 2 entries, the path has 3"),
    (dict(loss_masks=[[0, 1], [0, 2, 1]]), "path 1: loss mask must hold only 0 and 1"),
    (dict(loss_masks=[[1, 1], [0, 1, 1]]), "path 0: loss mask trains token 0"),
    (dict(path_weights=[1.0]), "expected 2 weights"),
    (dict(path_weights=[1.0, float("nan")]), "path 1: path weight is not finite"),
    (dict(path_weights=[float("inf"), 1.0]), "path 0: path weight is not finite"),
])
def test_bad_masks_and_weights(kw, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_paths([[1, 2], [1, 3, 4]], **kw)


def test_bad_normalize_and_pad():
    tree = Tree.from_paths([[1, 2]])
    with pytest.raises(ValueError, match="normalize"):
        tree.to_batch(normalize="mean")
    with pytest.raises(ValueError, match="pad_to_multiple"):
        tree.to_batch(pad_to_multiple=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_masks=[None, [0, 1]]), r"path 0: loss mask must be a sequence of 0/1 or bools, got NoneType"),
    (dict(loss_masks=["011", [0, 1]]), r"path 0: loss mask must be a sequence of 0/1 or bools, got str"),
    (dict(loss_masks=[[[0, 1, 1]], [0, 1]]), r"path 0: loss mask must be one flat sequence, got shape \(1, 3\)"),
    (dict(path_weights=[10 ** 400, 1]), r"path_weights: expected finite numbers.*OverflowError"),
    (dict(path_weights=[True, False]), r"path 0: path weight True is a bool"),
])
def test_bad_masks_and_weights_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_paths([[1, 2, 3], [1, 4]], **kwargs)


def test_a_numpy_bool_path_weight_is_refused():
    np = pytest.importorskip("numpy")
    with pytest.raises(ValueError, match=r"path 1: path weight .*False_? is a bool"):
        Tree.from_paths([[1, 2, 3], [1, 4]], path_weights=[1.0, np.bool_(False)])


@pytest.mark.parametrize("kwargs, message", [
    (dict(pad_to_multiple=2.5), r"pad_to_multiple: expected a positive integer, got 2.5"),
    (dict(conv_kernel=-3), r"conv_kernel: expected a positive integer"),
    (dict(weights=torch.tensor([0.5, float("nan"), 0.5, 0.5])), r"weights: batch token 1: not finite \(nan\)"),
])
def test_bad_batch_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch(**kwargs)
