"""Partitioning under a token budget: packed (Tree Packing), redundancy-free, exact DP, metrics."""

from __future__ import annotations

import itertools
import random
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treecompile import NORMALIZATIONS, Tree, reference
from treecompile.runtime.optimal_partition import dp_multi_path, dp_single_path, leaf_groups_cost
from treecompile.runtime.metrics import dataset_reuse, reuse
from treecompile.runtime.partition import TreeShape, pack, partition_redundancy_free
from treecompile.tree import ORDERS
from strategies import ODD_TREES, path_sets, weighted_path_sets


# ------------------------------------------------------------------------------------------ helpers
_ANC: "weakref.WeakKeyDictionary[Tree, list[frozenset]]" = weakref.WeakKeyDictionary()


def ancestors(tree: Tree, t: int) -> frozenset:
    """Strict ancestors of DFS token t, by walking pred (cached per tree)."""
    if tree not in _ANC:
        pred = tree.pred.tolist()
        out: list[frozenset] = []
        for u in range(tree.num_tokens):  # pred[u] < u: its set is already built
            out.append(frozenset() if pred[u] < 0 else out[pred[u]] | {pred[u]})
        _ANC[tree] = out
    return _ANC[tree][t]


def per_path_weights(paths, masks, weights, normalize) -> list[list[float]]:
    """The per-path formulas written out (as reference.run): coefficient * mask, per path token."""
    N = len(paths)
    ms = [[0] + [1] * (len(p) - 1) for p in paths] if masks is None else [list(m) for m in masks]
    cs = [1.0] * N if weights is None else [float(w) for w in weights]
    if normalize == "sum":
        coef = [c / N for c in cs]
    elif normalize == "path_mean":
        coef = [c / (N * sum(m)) if sum(m) else 0.0 for c, m in zip(cs, ms)]
    else:
        tot = sum(sum(m) for m in ms)
        coef = [c / tot if tot else 0.0 for c in cs]
    return [[k * x for x in m] for k, m in zip(coef, ms)]


def whole_loss_per_path(tree, paths, masks, weights, normalize, lp_dfs) -> float:
    """sum_p sum_i w[p,i] * -lp(token), lp read through the path -> DFS map."""
    pw = per_path_weights(paths, masks, weights, normalize)
    total = 0.0
    for i, wp in enumerate(pw):
        s = int(tree.path_offsets[i])
        idx = tree.path_index[s:s + len(wp)]
        total += -(torch.tensor(wp, dtype=torch.float64) * lp_dfs[idx]).sum().item()
    return total


def partition_loss_sum(plan, normalize, lp_dfs) -> float:
    total = 0.0
    for i in range(len(plan)):
        b = plan.batch(i, normalize=normalize)
        tok = b.extras["tokens"]
        total += -(b.loss_weight[:b.num_tokens] * lp_dfs[tok]).sum().item()
    return total


def close(a: float, b: float, rel: float = 1e-12) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def longest(paths) -> int:
    return max(map(len, paths))


# -------------------------------------------------------------------------------------- packed
def prefix_keys(ids: list[int], pred: list[int]) -> list[tuple]:
    """Each token (DFS order, ``pred``: its path predecessor or -1) as the token ids from its root to it: its
    identity in any DFS order of the same tree."""
    keys: list[tuple] = []
    for t in range(len(ids)):  # a predecessor comes before its token in any DFS order
        keys.append((keys[pred[t]] if pred[t] >= 0 else ()) + (ids[t],))
    return keys


def tree_keys(tree: Tree) -> list[tuple]:
    return prefix_keys(tree.input_ids.tolist(), tree.pred.tolist())


def same_tree_up_to_order(a, b) -> bool:
    """Batches ``a`` and ``b`` serialise the same tree (tokens, links, subtrees, conv context, radix nodes and their
    levels and parents) in possibly different DFS orders: every field compared through the tokens' prefixes."""
    out = []
    for x in (a, b):
        n = x.num_tokens
        keys = prefix_keys(x.input_ids[:n].tolist(), x.pred_index[:n].tolist())
        se, conv = x.subtree_end.tolist(), x.conv_index.tolist()
        ns, ne, par, lev = (x.node_start.tolist(), x.node_end.tolist(), x.node_parent.tolist(),
                            x.node_level.tolist())
        node_keys = [frozenset(keys[ns[m]:ne[m]]) for m in range(len(ns)) if ns[m] < n]
        out.append((
            {keys[t]: (frozenset(keys[t:se[t]]),  # the subtree's tokens
                       tuple(keys[c] if c >= 0 else None for c in conv[t])) for t in range(n)},
            {node_keys[m]: (lev[m], node_keys[par[m]] if par[m] >= 0 else None) for m in range(len(node_keys))}))
    return out[0] == out[1]


def check_packed(paths, C, masks=None, weights=None, order="heavy_first"):
    tree = Tree.from_paths(paths, loss_masks=masks, path_weights=weights, order=order)
    plan = pack(tree, C)
    T = tree.num_tokens
    owned_count = torch.zeros(T, dtype=torch.long)
    assigned = torch.zeros(tree.num_paths, dtype=torch.long)
    for part in plan.partitions:
        tok = part.tokens
        assert 0 < tok.numel() <= C
        assert torch.equal(tok, torch.sort(tok).values) and tok.unique().numel() == tok.numel()
        s = set(tok.tolist())
        for t in s:  # prefix-closed: every ancestor is in the partition
            assert ancestors(tree, t) <= s
        owned_count[tok[part.owned]] += 1
        for p in part.paths.tolist():  # an assigned path lies whole in its partition
            a, b = int(tree.path_offsets[p]), int(tree.path_offsets[p + 1])
            assert set(tree.path_index[a:b].tolist()) <= s
            assigned[p] += 1
        # the partition's batch serialises exactly these tokens, in whole-tree DFS order
        bt = plan.batch(part.index)
        assert torch.equal(bt.input_ids[:bt.num_tokens], tree.input_ids[tok])
        assert torch.equal(bt.position_ids[:bt.num_tokens], tree.depth[tok])
        glob_pred = tree.pred[tok]
        loc_pred = bt.pred_index[:bt.num_tokens]
        assert torch.equal(torch.where(loc_pred >= 0, tok[loc_pred.clamp(min=0)], -1), glob_pred)
        # ... with the radix nodes of the tree of its own leaf paths (no extra GDN segments or levels); the whole
        # tree's order restricted to the partition is a DFS order of that tree, not necessarily the one its own
        # Tree.from_paths picks (heaviest child first within the partition), so compared by prefix, not by index
        own = Tree.from_paths(plan.leaf_paths(part.index), order=tree.order).to_batch()
        assert same_tree_up_to_order(bt, own)
        if tree.order == "lex":  # the sorted order restricts to the sorted order: the same indices too
            for f in ("pred_index", "subtree_end", "node_id", "node_start", "node_end", "node_parent", "node_level",
                      "conv_index"):
                assert torch.equal(getattr(bt, f), getattr(own, f)), f
    assert (owned_count == 1).all(), "each token's weight is carried by exactly one partition"
    assert (assigned == 1).all(), "each path is assigned to exactly one partition"
    assert plan.cost == sum(p.num_tokens for p in plan.partitions) >= T
    r = plan.reuse()
    assert r.err <= r.por + 1e-15
    # weights: sum of partition losses == whole-tree loss == per-path formula, random per-token losses
    g = torch.Generator().manual_seed(len(paths) * 7919 + C)
    lp = -torch.rand(T, generator=g, dtype=torch.float64)
    for normalize in NORMALIZATIONS:
        whole = -(tree.to_batch(normalize=normalize).loss_weight * lp).sum().item()
        direct = whole_loss_per_path(tree, paths, masks, weights, normalize, lp)
        split = partition_loss_sum(plan, normalize, lp)
        assert close(whole, direct) and close(split, whole), (normalize, whole, direct, split)
    return tree, plan


@settings(max_examples=60, deadline=None)
@given(weighted_path_sets(max_paths=10, max_len=10), st.integers(0, 12), st.sampled_from(ORDERS))
def test_packed_random(data, extra, order):
    paths, masks, weights = data
    check_packed(paths, longest(paths) + extra, masks, weights, order=order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", sorted(ODD_TREES))
def test_packed_odd_trees(name, order):
    paths = ODD_TREES[name]
    n = longest(paths)
    for C in sorted({n, n + 1, 2 * n, 10 * n, 10_000}):
        check_packed(paths, C, order=order)


def test_packed_weights_per_path_in_partition():
    """Owned tokens carry exactly the per-path formula's weight: sum over paths through them."""
    paths = ODD_TREES["one_token_nodes"] + [[1, 2, 3], [1, 5]]
    masks = [[0] + [(i + j) % 2 for j in range(1, len(p))] for i, p in enumerate(paths)]
    weights = [0.5, -1.0, 2.0, 1.5, 3.0, 0.25]
    tree = Tree.from_paths(paths, loss_masks=masks, path_weights=weights)
    plan = pack(tree, 5)
    assert len(plan) > 1
    for normalize in NORMALIZATIONS:
        pw = per_path_weights(paths, masks, weights, normalize)
        want = torch.zeros(tree.num_tokens, dtype=torch.float64)
        for i, wp in enumerate(pw):
            s = int(tree.path_offsets[i])
            want.index_add_(0, tree.path_index[s:s + len(wp)], torch.tensor(wp, dtype=torch.float64))
        got = torch.zeros(tree.num_tokens, dtype=torch.float64)
        for i, part in enumerate(plan.partitions):
            b = plan.batch(i, normalize=normalize)
            assert (b.loss_weight[~part.owned] == 0).all()
            got.index_add_(0, part.tokens, b.loss_weight)
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


def test_packed_budget_below_longest_path_names_it():
    paths = [[1, 2], [1, 2, 3, 4, 5], [7, 8, 9]]
    with pytest.raises(ValueError, match=r"path 1 has 5 tokens.*C=4"):
        pack(Tree.from_paths(paths), 4)
    pack(Tree.from_paths(paths), 5)  # exactly the longest path fits


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8", None])
def test_capacity_must_be_positive_int(bad):
    tree = Tree.from_paths([[1, 2, 3]])
    with pytest.raises(ValueError, match="capacity"):
        pack(tree, bad)
    with pytest.raises(ValueError, match="capacity"):
        partition_redundancy_free(tree, bad)


def test_errors_normalize_order_metrics():
    tree = Tree.from_paths([[1, 2, 3], [1, 4]])
    with pytest.raises(ValueError, match="normalize"):
        pack(tree, 3).batch(0, normalize="mean")
    with pytest.raises(ValueError, match="normalize"):
        partition_redundancy_free(tree, 3).batch(0, normalize="mean")
    with pytest.raises(ValueError, match="order"):
        pack(tree, 3, order="random")
    with pytest.raises(ValueError, match="below the tree's 4 unique"):
        reuse(tree, 3)
    with pytest.raises(ValueError, match="no trees"):
        dataset_reuse([])


@pytest.mark.parametrize("plan_of", [lambda t: pack(t, 5), lambda t: partition_redundancy_free(t, 4)],
                         ids=["packed", "redundancy_free"])
def test_partition_batch_checks_its_index_and_whole_tree_weights(plan_of):
    """``plan.batch(i, weights=W)``: ``W`` is the whole tree's ``[T]`` (another tree's longer weights were cut to
    the partition's tokens, a shorter one failed inside or was taken as it was), finite floats; ``i`` a partition
    index (``-1`` quietly took the last)."""
    import dataclasses

    tree = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5, 6, 7], [1, 8]])
    plan, T = plan_of(tree), tree.num_tokens
    assert len(plan) > 1
    w = torch.arange(T, dtype=torch.float64)
    b = plan.batch(1, weights=w)
    tokens = b.extras["tokens"][:b.num_tokens]
    owned = b.extras.get("owned", torch.ones(b.num_tokens, dtype=torch.bool))  # packed: prefixes it does not own
    assert torch.equal(b.loss_weight[:b.num_tokens], torch.where(owned, w[tokens], 0.0))
    assert torch.equal(plan.batch(1, weights=w.tolist()).loss_weight, b.loss_weight)  # a list of T numbers too
    for bad, message in ((torch.ones(T + 6), rf"expected the whole tree's weights, shape \[{T}\].*got \({T + 6},\)"),
                         (torch.ones(3), r"got \(3,\)"), (torch.ones(T, 1), rf"got \({T}, 1\)"),
                         (torch.ones(T, dtype=torch.bool), "expected float weights, got dtype torch.bool"),
                         (torch.full((T,), float("nan")), "whole-tree token 0: not finite")):
        with pytest.raises(ValueError, match=message):
            plan.batch(0, weights=bad)
    for i in (-1, len(plan)):
        with pytest.raises(IndexError, match=rf"partition index {i}: this plan has {len(plan)} partitions"):
            plan.batch(i)
    for i in (True, 0.0, torch.tensor([0, 1])):
        with pytest.raises(TypeError, match="partition index: expected an integer"):
            plan.batch(i)
    assert plan.batch(torch.tensor(1)).num_tokens == plan.batch(1).num_tokens
    if hasattr(plan, "token_weights"):  # a plan's own token weights are checked the same way
        with pytest.raises(ValueError, match=r"token_weights: expected the whole tree's weights"):
            dataclasses.replace(plan, token_weights=torch.ones(T + 1)).batch(0)


def test_pack_padding_keeps_weights():
    paths = ODD_TREES["one_token_nodes"]
    tree = Tree.from_paths(paths)
    plan = pack(tree, 4)
    b = plan.batch(1, normalize="token_mean", pad_to_multiple=8)
    assert b.seq_len == 8 and (b.loss_weight[b.num_tokens:] == 0).all()
    rf = partition_redundancy_free(tree, 3)
    b = rf.batch(1, pad_to_multiple=8)
    assert b.seq_len == 8 and (b.loss_weight[b.num_tokens:] == 0).all()
    assert (b.extras["pred_boundary"][b.num_tokens:] == -1).all()
    # one padding rule (TreeBatch.padded): the padding is one extra root node; per-node extras follow
    for b in (plan.batch(1, pad_to_multiple=8), rf.batch(1, pad_to_multiple=8)):
        n = b.num_tokens
        assert b.node_start[-1] == n and b.node_end[-1] == 8 and b.node_parent[-1] == -1
        assert (b.node_id[n:] == b.num_nodes - 1).all() and (b.subtree_end[n:] == torch.arange(n, 8) + 1).all()
    unpadded = rf.batch(1)
    assert b.num_nodes == unpadded.num_nodes + 1
    assert b.extras["node_boundary_parent"].tolist() == unpadded.extras["node_boundary_parent"].tolist() + [-1]
    assert b.extras["conv_boundary_index"].shape == (8, 3) and b.extras["boundary_visible"].shape == (8,)


# ------------------------------------------------------------------------------- redundancy-free
def check_redundancy_free(paths, C, masks=None, weights=None, conv_kernel=4, bound="auto"):
    tree = Tree.from_paths(paths, loss_masks=masks, path_weights=weights)
    plan = partition_redundancy_free(tree, C, bound=bound)
    fits = longest(paths) <= C
    assert plan.bound == ("chain" if bound == "chain" or (bound == "auto" and fits) else "partition")
    T = tree.num_tokens
    pred = tree.pred.tolist()
    whole_w = tree.to_batch().loss_weight
    all_bnd = [set(plan.boundary(i).tolist()) for i in range(len(plan))]
    count = torch.zeros(T, dtype=torch.long)
    for part in plan.partitions:
        tok = part.tokens
        assert 0 < tok.numel() <= C
        assert torch.equal(tok, torch.sort(tok).values)
        count[tok] += 1
        assert (plan.owner[tok] == part.index).all()
        assert sum(e - s for s, e in part.ranges) == tok.numel()
        s = set(tok.tolist())
        # boundary: exactly the ancestors outside the partition, root first, boundary position == depth
        outside = set()
        for t in s:
            outside |= ancestors(tree, t) - s
        bnd = plan.boundary(part.index)
        assert set(bnd.tolist()) == outside and bnd.unique().numel() == bnd.numel()
        assert tree.depth[bnd].tolist() == list(range(bnd.numel()))
        if part.boundary_last >= 0:
            assert int(bnd[-1]) == part.boundary_last and part.parent == int(plan.owner[part.boundary_last])
            assert part.parent < part.index and part.ancestors[-1] == part.parent
            assert set(plan.owner[bnd].tolist()) == set(part.ancestors)
        else:
            assert bnd.numel() == 0 and part.parent == -1 and part.ancestors == ()
        # the batch: local structure + boundary links reproduce the whole tree's view
        b = plan.batch(part.index, conv_kernel=conv_kernel)
        n = b.num_tokens
        x = b.extras
        assert torch.equal(x["tokens"], tok) and torch.equal(x["boundary_index"], bnd)
        assert torch.equal(b.input_ids, tree.input_ids[tok]) and torch.equal(b.position_ids, tree.depth[tok])
        assert torch.equal(b.loss_weight, whole_w[tok])
        tl, bl, se = tok.tolist(), bnd.tolist(), b.subtree_end.tolist()
        pi, pp_, pv = b.pred_index.tolist(), x["pred_boundary"].tolist(), x["boundary_visible"].tolist()
        ci, cpi = b.conv_index.tolist(), x["conv_boundary_index"].tolist()
        for q in range(n):
            tq = tl[q]
            anc = ancestors(tree, tq)
            seen_local = {tl[k] for k in range(q + 1) if q < se[k]}
            assert seen_local == (anc & s) | {tq}
            assert set(bl[:pv[q]]) == anc - s
            gp = pred[tq]
            if gp < 0:
                assert pi[q] == -1 and pp_[q] == -1
            elif gp in s:
                assert tl[pi[q]] == gp and pp_[q] == -1
            else:
                assert pi[q] == -1 and bl[pp_[q]] == gp
            c = gp  # conv context: the j+1-th preceding token along the path, local or boundary
            for j in range(conv_kernel - 1):
                cl, cp = ci[q][j], cpi[q][j]
                if c < 0:
                    assert cl == -1 and cp == -1
                elif c in s:
                    assert tl[cl] == c and cp == -1
                else:
                    assert cl == -1 and bl[cp] == c
                c = pred[c] if c >= 0 else c
        # local radix nodes: chains whose parent's last token precedes the node's first token
        nst, nen, npa, nid = (b.node_start.tolist(), b.node_end.tolist(), b.node_parent.tolist(),
                              b.node_id.tolist())
        nbp = x["node_boundary_parent"].tolist()
        for k in range(b.num_nodes):
            ns, ne, npar = nst[k], nen[k], npa[k]
            assert all(pi[t] == t - 1 for t in range(ns + 1, ne))
            first_pred = pi[ns]
            assert npar == (-1 if first_pred < 0 else nid[first_pred])
            if npar >= 0:
                assert nen[npar] - 1 == first_pred
            assert nbp[k] == pp_[ns]
        # boundary rows: own tokens that some later partition attends to
        later = set()
        for bo in all_bnd:
            later |= bo & s
        assert set(plan.boundary_rows(part.index).tolist()) == later
    assert (count == 1).all(), "every unique token in exactly one partition"
    assert plan.cost == T
    r = plan.reuse()
    assert r.err == r.por and r.redundant_tokens == 0
    # schedule: forwards parents-first, backwards after all descendants, alive set == the chain
    alive: list[int] = []
    fwd, bwd = set(), set()
    for ev, i in plan.schedule():
        part = plan.partitions[i]
        if ev == "forward":
            assert list(part.ancestors) == alive
            alive.append(i)
            fwd.add(i)
        else:
            assert alive[-1] == i and all(c in bwd for c in part.children)
            alive.pop()
            bwd.add(i)
    assert fwd == bwd == set(range(len(plan))) and not alive
    assert plan.peak_chain_tokens() <= min(T, longest(paths) + C)
    if plan.bound == "chain":  # what is alive at once fits C, as a packed partition does
        assert plan.peak_chain_tokens() <= C
    for part in plan.partitions:  # a partition with partitions below it holds one path's tokens (the chain
        if part.children and plan.bound == "partition":  # bound's chunks may also take hanging subtrees whole)
            tl = part.tokens.tolist()
            assert all(pred[u] == v for v, u in zip(tl, tl[1:]))
    # weights: each token once, so the partition losses sum to the whole-tree loss
    g = torch.Generator().manual_seed(len(paths) * 104729 + C)
    lp = -torch.rand(T, generator=g, dtype=torch.float64)
    for normalize in NORMALIZATIONS:
        whole = -(tree.to_batch(normalize=normalize).loss_weight * lp).sum().item()
        direct = whole_loss_per_path(tree, paths, masks, weights, normalize, lp)
        assert close(whole, direct) and close(partition_loss_sum(plan, normalize, lp), whole)
    return tree, plan


@settings(max_examples=50, deadline=None)
@given(weighted_path_sets(max_paths=8, max_len=10), st.integers(1, 14))
def test_redundancy_free_random(data, C):
    paths, masks, weights = data
    check_redundancy_free(paths, C, masks, weights)
    check_redundancy_free(paths, C, masks, weights, bound="partition")


@settings(max_examples=50, deadline=None)
@given(path_sets(max_paths=10, max_len=12), st.integers(0, 12))
def test_redundancy_free_chain_bound_random(paths, extra):
    """Budgets from the longest path up: every chain of partitions within C, each token once."""
    check_redundancy_free(paths, longest(paths) + extra, bound="chain")


def test_redundancy_free_bounds_and_errors():
    wide = [list(range(1, 9)) + [100 + 8 * i + j for j in range(8)] for i in range(16)]  # root node of 8, 16 leaves
    tree = Tree.from_paths(wide)
    chain, part = (partition_redundancy_free(tree, 32, bound=b) for b in ("chain", "partition"))
    # the chain plan keeps the root alone (the wide node's children get the room) and bins 3 leaves per partition
    assert chain.peak_chain_tokens() == 32 and len(chain) == 1 + 6
    assert part.peak_chain_tokens() == 8 + 32 > 32  # each partition <= C, a chain up to longest path + C
    assert partition_redundancy_free(tree, 32).bound == "chain"
    assert partition_redundancy_free(tree, 15).bound == "partition"  # paths of 16 tokens do not fit 15
    with pytest.raises(ValueError, match=r"bound='chain' needs every path to fit.*path 0 has 16 tokens.*C=15"):
        partition_redundancy_free(tree, 15, bound="chain")
    with pytest.raises(ValueError, match="bound must be one of"):
        partition_redundancy_free(tree, 32, bound="paths")
    # a spine of long nodes with a short leaf below each: one chunk down the spine, the leaves below it
    spine, paths = [], []
    for i in range(6):
        spine = spine + [1000 + 10 * i + j for j in range(5)]
        paths.append(spine + [2000 + i])
    plan = partition_redundancy_free(Tree.from_paths(paths), 31, bound="chain")
    assert plan.peak_chain_tokens() <= 31 and plan.partitions[0].num_tokens >= 25
    # a chunk takes a subtree hanging below it whole where that saves a partition: tokens 1, 2 (the chunk) and
    # the leaf 3 below the root (token 7) in one partition, whose children hang below token 1
    paths = [[3, 2, 2, 1], [1, 2, 3, 3, 3], [1, 3], [1, 2, 1, 3]]
    tree, plan = check_redundancy_free(paths, 6, bound="chain")
    first = plan.partitions[0]
    assert first.tokens.tolist() == [0, 1, 7] and len(first.children) == 2 and len(plan) == 4
    assert plan.peak_chain_tokens() == 6 < partition_redundancy_free(tree, 6, bound="partition").peak_chain_tokens()


@pytest.mark.parametrize("name", sorted(ODD_TREES))
def test_redundancy_free_odd_trees(name):
    paths = ODD_TREES[name]
    n = longest(paths)
    T = Tree.from_paths(paths).num_tokens
    for C in sorted({1, 2, 3, max(1, n - 1), n, T, T + 5}):
        check_redundancy_free(paths, C, conv_kernel=3 if C % 2 else 4)


def test_redundancy_free_budget_below_path_splits_it():
    paths = [list(range(1, 21)), list(range(1, 11)) + [50, 51, 52]]
    tree, plan = check_redundancy_free(paths, 4)
    assert tree.path_lengths.max() > 4 and len(plan) >= 6
    # the long path runs through a chain of partitions; its last one sees 16+ boundary tokens
    last = plan.partitions[int(plan.owner[tree.path_end[0]])]
    assert plan.boundary(last.index).numel() >= 16


# --------------------------------------------------------------------------------------------- DP
def brute_force_multi(tree, C) -> int:
    sh = TreeShape(tree)
    leaves = [n for n in range(sh.num_nodes) if sh.is_leaf(n)]

    def set_partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in set_partitions(rest):
            yield [[first]] + part
            for i in range(len(part)):
                yield part[:i] + [[first] + part[i]] + part[i + 1:]

    def union(group):  # tokens, by walking pred (independent of the DP's node bitmasks)
        toks = set()
        for leaf in group:
            t = sh.end[leaf] - 1
            toks |= ancestors(tree, t) | {t}
        return len(toks)

    best = None
    for grouping in set_partitions(leaves):
        sizes = [union(g) for g in grouping]
        if max(sizes) <= C and (best is None or sum(sizes) < best):
            best = sum(sizes)
    return best


def brute_force_single(tree, C, order="deepest") -> int:
    from treecompile.runtime.partition import leaf_order
    leaves, _ = leaf_order(TreeShape(tree), order)
    L = len(leaves)
    best = None
    for cuts in itertools.product([0, 1], repeat=L - 1):
        groups, cur = [], [leaves[0]]
        for leaf, cut in zip(leaves[1:], cuts):
            if cut:
                groups.append(cur)
                cur = []
            cur.append(leaf)
        groups.append(cur)
        sizes = [leaf_groups_cost(tree, [g]) for g in groups]
        if max(sizes) <= C and (best is None or sum(sizes) < best):
            best = sum(sizes)
    return best


@settings(max_examples=40, deadline=None)
@given(path_sets(max_paths=6, max_len=6), st.integers(0, 8))
def test_dp_equals_brute_force(paths, extra):
    tree = Tree.from_paths(paths)
    C = longest(paths) + extra
    multi, single = dp_multi_path(tree, C), dp_single_path(tree, C)
    assert multi == brute_force_multi(tree, C)
    assert single == brute_force_single(tree, C)
    plan = pack(tree, C)
    # the heuristic is one contiguous grouping of the same leaf order: DP <= heuristic
    assert tree.num_tokens <= multi <= single <= plan.cost
    # and the heuristic's cost is the true union cost of its grouping
    sh = TreeShape(tree)
    groups = [[int(tree.node_id[l]) for l in p.leaves.tolist()] for p in plan.partitions]
    assert leaf_groups_cost(tree, groups) == plan.cost
    assert all(sh.is_leaf(n) for g in groups for n in g)


@pytest.mark.parametrize("name", sorted(set(ODD_TREES) - {"wide_fanout_64"}))
def test_dp_odd_trees(name):
    tree = Tree.from_paths(ODD_TREES[name])
    n = longest(ODD_TREES[name])
    for C in (n, n + 2, 3 * n):
        assert tree.num_tokens <= dp_multi_path(tree, C) <= dp_single_path(tree, C) <= pack(tree, C).cost


def test_dp_errors():
    tree = Tree.from_paths(ODD_TREES["wide_fanout_64"])
    with pytest.raises(ValueError, match="64 leaves"):
        dp_multi_path(tree, 10)
    with pytest.raises(ValueError, match="path 0 has 5 tokens"):
        dp_single_path(tree, 4)
    assert dp_single_path(tree, 10_000) == tree.num_tokens


def test_dp_finds_known_optimum():
    """Two deep leaves under one prefix and one shallow elsewhere: the optimum groups the deep ones."""
    paths = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9]]
    tree = Tree.from_paths(paths)
    assert dp_multi_path(tree, 8) == 8 + 2  # {deep, deep} (8 tokens) + {shallow}
    assert dp_multi_path(tree, 7) == 6 + 6 + 2  # no room for both deep leaves together


# ------------------------------------------------------------------------------------------ metrics
def test_metrics_per_tree_and_dataset():
    t1 = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5, 6]])  # 8 path tokens, 6 unique
    t2 = Tree.from_paths([[7, 8], [9]])  # 3 path tokens, 3 unique
    r1 = reuse(t1, 8)
    assert r1.por == pytest.approx(0.25) and r1.err == 0.0 and r1.redundant_tokens == 2
    assert reuse(t1).err == reuse(t1).por
    d = dataset_reuse([r1, reuse(t2)])
    assert d.path_tokens == 11 and d.unique_tokens == 9 and d.computed_tokens == 11
    assert d.por == pytest.approx(2 / 11) and d.err == 0.0
    assert pack(t1, 4).reuse().err == 0.0 and pack(t1, 6).reuse().err == pytest.approx(0.25)
    assert partition_redundancy_free(t1, 2).reuse().err == pytest.approx(0.25)


# ------------------------------------------------------------------------- gradients, dense model
def _model():
    from treecompile.models.dense import DenseConfig, DenseForCausalLM
    torch.manual_seed(0)
    return DenseForCausalLM(DenseConfig.tiny(vocab_size=23)).double()


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _oracle_dfs(model, tree, paths):
    """Per-path reference log-probs scattered into the tree's DFS order (one path per token)."""
    lps = torch.cat([reference.path_logprobs(model, p) for p in paths])
    pick = torch.empty(tree.num_tokens, dtype=torch.long)
    pick[tree.path_index] = torch.arange(tree.num_path_tokens)
    return lps[pick]


GRAD_CASES = {
    "branchy": ([[3, 4, 5, 6, 7, 8], [3, 4, 5, 9, 10], [3, 4, 11, 12, 13, 14, 15], [3, 4, 5, 6],
                 [16, 17, 18], [3, 4, 11, 12, 2, 1]], 7),
    "one_token_nodes": (ODD_TREES["one_token_nodes"], 5),
    "forest": (ODD_TREES["forest"], 2),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_gradients_match_per_path_reference(case, normalize):
    paths, C = GRAD_CASES[case]
    rng = random.Random(hash((case, normalize)) % 1000)
    masks = [[0] + [rng.randint(0, 1) for _ in p[1:]] for p in paths]
    weights = [rng.uniform(-1.5, 2.0) for _ in paths]
    model = _model()
    ref = reference.run(model, paths, loss_masks=masks, path_weights=weights, normalize=normalize)
    g_ref = _grads(model, ref.loss)
    tree = Tree.from_paths(paths, loss_masks=masks, path_weights=weights)

    # packed: each partition runs the oracle on its *own* paths (its tree), scattered into its DFS order
    plan = pack(tree, C)
    assert len(plan) > 1
    loss = 0.0
    for i in range(len(plan)):
        b = plan.batch(i, normalize=normalize)
        sub_paths = plan.leaf_paths(i)
        # the partition as a tree of its own: the same tokens, in the DFS order its own Tree.from_paths picks,
        # which need not be the whole tree's restricted to them (heaviest child first within the partition)
        sub = Tree.from_paths(sub_paths)
        tok = plan.partitions[i].tokens
        where = {k: j for j, k in enumerate(tree_keys(sub))}
        whole = tree_keys(tree)
        at = torch.tensor([where[whole[t]] for t in tok.tolist()])  # the sub-tree's token of each partition token
        assert torch.equal(sub.input_ids[at], tree.input_ids[tok]) and torch.equal(sub.depth[at], tree.depth[tok])
        lp = _oracle_dfs(model, sub, sub_paths)[at]
        loss = loss - (b.loss_weight * lp).sum()
    g = _grads(model, loss)
    assert abs(loss.item() - ref.loss.item()) <= 1e-9 * abs(ref.loss.item()) + 1e-15
    assert _rel(g, g_ref) <= 1e-9

    # redundancy-free with a budget below the longest path: whole-tree oracle read at each partition
    rf = partition_redundancy_free(tree, max(1, C - 3))
    assert rf.partitions and max(p.num_tokens for p in rf.partitions) < longest(paths)
    lp_dfs = _oracle_dfs(model, tree, paths)
    loss = 0.0
    for i in range(len(rf)):
        b = rf.batch(i, normalize=normalize)
        loss = loss - (b.loss_weight * lp_dfs[b.extras["tokens"]]).sum()
    g = _grads(model, loss)
    assert abs(loss.item() - ref.loss.item()) <= 1e-9 * abs(ref.loss.item()) + 1e-15
    assert _rel(g, g_ref) <= 1e-9
