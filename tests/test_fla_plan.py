"""The fla tree GDN's call plan (``ops.fla_gdn.plan_calls``) on CPU: fewer varlen calls, same function.

fla itself runs on CUDA only; here ``tree_gated_delta_rule_fla`` runs its whole plan (gathers, calls,
state hand-offs, scatter) with a float64 torch stand-in of fla's varlen ``chunk_gated_delta_rule``,
and must equal the reference tree op (forward and every input gradient) to ~1e-12.
"""

import random

import pytest
import torch

from models.hybrid import torch_chunk_gated_delta_rule
from tests.strategies import ODD_TREES
from tests.test_tree_gdn import Dv, Hv, gdn_inputs  # the same shapes and inputs
from treecompile import Tree
from treecompile.ops import fla_gdn, tree_gdn

F64 = torch.float64


def fla_chunk_indices(cu_seqlens, chunk_size):
    """fla's ``prepare_chunk_indices`` (fla/ops/utils/index.py) written out: one row (segment, chunk of
    that segment) per chunk_size-token chunk of every segment, segments in order."""
    cu = cu_seqlens.tolist()
    return torch.tensor([(s, c) for s in range(len(cu) - 1) for c in range(-(-(cu[s + 1] - cu[s]) // chunk_size))],
                        dtype=torch.long).reshape(-1, 2)


def torch_varlen_gdn(q, k, v, g, beta, *, scale=None, initial_state, output_final_state, cu_seqlens,
                     use_qk_l2norm_in_kernel, chunk_size, cu_seqlens_cpu=None, chunk_indices=None, calls=None):
    """fla's varlen ``chunk_gated_delta_rule`` contract in torch: one sequence per ``cu_seqlens`` segment,
    each from its own ``initial_state`` row; returns (o, final states [k, Hv, Dk, Dv]).  Precomputed
    ``chunk_indices`` / ``cu_seqlens_cpu``, when given, must be what fla would derive from ``cu_seqlens``."""
    assert scale is None and output_final_state and q.shape[0] == 1
    if cu_seqlens_cpu is not None:
        assert torch.equal(cu_seqlens_cpu, cu_seqlens.cpu()) and cu_seqlens_cpu.device.type == "cpu"
    if chunk_indices is not None:
        assert torch.equal(chunk_indices, fla_chunk_indices(cu_seqlens, chunk_size)) and chunk_indices.dtype == torch.long
    if calls is not None:
        calls.append(cu_seqlens.numel() - 1)
    cu = cu_seqlens.tolist()
    outs, finals = [], []
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        o, h = torch_chunk_gated_delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
                                            chunk_size=chunk_size, initial_state=initial_state[i:i + 1].to(q.dtype),
                                            output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(h[0])
    return torch.cat(outs, 1), torch.stack(finals)


def agentic_like_paths(seed):
    """Turns that drop reasoning, 1-3 token re-tokenization drift, a fan-out: long and very short nodes."""
    rnd = random.Random(seed)
    fresh = lambda n: [rnd.randrange(2, 40) for _ in range(n)]
    paths, hist = [], fresh(9)
    for turn in range(5):
        think, act = fresh(rnd.randint(2, 6)), fresh(rnd.randint(1, 4))
        paths.append(hist + think + act)
        for b in range(2 if turn == 2 else 1):
            drift = act[:-1] + [41 + b] if rnd.random() < 0.5 else act
            paths.append(hist + drift + fresh(rnd.randint(1, 3)))
        hist = hist + act + fresh(rnd.randint(1, 5))
    return paths


TREES = {**ODD_TREES, "agentic_like_0": agentic_like_paths(0), "agentic_like_1": agentic_like_paths(1),
         "chains": [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 8], [1, 9]],
         # a prompt and its sampled completions (a GRPO group): with a bucket's padding, still in DFS order
         "prompt_and_samples": [[3, 1, 4, 1, 5, 9, 2] + [10 + i] + list(range(20, 20 + n))
                                for i, n in enumerate((5, 1, 9, 3))]}


@pytest.mark.parametrize("replay_max", [0, 3, 64, None])  # None: cheapest_plan (here: every ancestor replayed)
@pytest.mark.parametrize("name", sorted(TREES))
def test_planned_fla_path_equals_reference_op(name, replay_max):
    b = Tree.from_paths(TREES[name]).to_batch(pad_to_multiple=8)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    xs = gdn_inputs(b.seq_len, 0, with_init=name != "forest")
    leaves = [x for x in xs if x is not None]
    W = torch.randn(1, b.seq_len, Hv, Dv, dtype=F64, generator=torch.Generator().manual_seed(1))
    ref = tree_gdn.tree_gated_delta_rule(*xs[:5], *nodes, xs[5], use_qk_l2norm_in_kernel=True, chunk_size=4)
    calls = []

    def kern(*a, **kw):  # every call gets the plan's chunk indices (fla would sync the host to derive them)
        assert kw["chunk_indices"] is not None and kw["cu_seqlens_cpu"] is not None
        return torch_varlen_gdn(*a, **kw, calls=calls)
    got = fla_gdn.tree_gated_delta_rule_fla(*xs[:5], *nodes, xs[5], use_qk_l2norm_in_kernel=True, chunk_size=4,
                                            replay_max=replay_max, kernel=kern)
    plan = fla_gdn._cached_plan(*nodes[:3], replay_max)
    assert len(calls) == plan.calls <= plan.levels
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(torch.autograd.grad((got * W).sum(), leaves), torch.autograd.grad((ref * W).sum(), leaves)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def level_nodes(b):
    return [torch.nonzero(b.node_level == l).flatten() for l in range(int(b.node_level.max()) + 1)]


def test_plan_without_chains_or_replay_is_the_level_schedule():
    """No single-child node, replay off: one call per level with that level's nodes, parents' rows in the
    previous call (the per-level schedule fla_gdn had before)."""
    b = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5, 9], [1, 2, 5, 6, 7], [1, 2, 5, 6, 8], [9]]).to_batch()
    kids = torch.bincount(b.node_parent[b.node_parent >= 0], minlength=b.num_nodes)
    assert not bool((kids == 1).any())
    plan = fla_gdn.plan_calls(b.node_start, b.node_end, b.node_parent, replay_max=0)
    levels = level_nodes(b)
    assert plan.calls == plan.levels == len(levels) and plan.replayed_tokens == 0
    for l, (w, nodes) in enumerate(zip(plan.waves, levels)):
        sizes = b.node_end[nodes] - b.node_start[nodes]
        assert w.cu_seqlens.tolist() == [0] + sizes.cumsum(0).tolist()
        toks = torch.cat([torch.arange(int(s), int(e)) for s, e in zip(b.node_start[nodes], b.node_end[nodes])])
        assert torch.equal(plan.index[w.lo:w.hi], toks)
        if l:
            assert torch.equal(levels[l - 1][w.source], b.node_parent[nodes])
        else:
            assert w.source is None
    assert torch.equal(plan.index[plan.out_rows], torch.arange(b.seq_len))


def test_chains_merge_and_replay_cut_calls():
    """A path that ends inside another leaves a single-child node: merged (no call of its own).  A short
    parent is replayed: its children start from the grandparent's state, one call earlier."""
    chain = Tree.from_paths(TREES["chains"]).to_batch()
    p0 = fla_gdn.plan_calls(chain.node_start, chain.node_end, chain.node_parent, replay_max=0)
    assert p0.levels == 5 and p0.calls == 2 and p0.replayed_tokens == 0  # root chain, then its two branches
    # 1 -> 5 -> 8 -> {9, 2}, one-token nodes; lexicographic: each level's nodes come after the previous level's
    # (heavy-first visits 8's subtree before 5's other child, so its levels interleave and the rows are gathered)
    deep = Tree.from_paths(ODD_TREES["one_token_nodes"], order="lex").to_batch()
    p0 = fla_gdn.plan_calls(deep.node_start, deep.node_end, deep.node_parent, replay_max=0)
    p1 = fla_gdn.plan_calls(deep.node_start, deep.node_end, deep.node_parent, replay_max=1)
    p3 = fla_gdn.plan_calls(deep.node_start, deep.node_end, deep.node_parent, replay_max=3)
    assert p0.calls == p0.levels == 4
    assert p1.calls == 2 and p1.replayed_tokens > 0  # the one-token parents replayed: 2 calls
    assert p3.calls == 1  # every node replays its whole (short) path: one call
    capped = fla_gdn.plan_calls(deep.node_start, deep.node_end, deep.node_parent, replay_max=3,
                                max_replay_fraction=0.25)  # 12 replayed rows > 0.25 * 10 tokens: halved to 1, then 0
    assert capped.replayed_tokens <= 0.25 * deep.seq_len and capped.calls > 1
    for p in (p0, p1, p3):  # each token's output row is its own token
        assert torch.equal(p.index[p.out_rows], torch.arange(deep.seq_len))
    assert p0.identity  # one node per level, levels in DFS order: the rows need no gather
    assert not p1.identity and not p3.identity  # replayed rows
    hf = Tree.from_paths(ODD_TREES["one_token_nodes"]).to_batch()
    p0 = fla_gdn.plan_calls(hf.node_start, hf.node_end, hf.node_parent, replay_max=0)
    assert p0.calls == p0.levels == 4 and not p0.identity and torch.equal(p0.index[p0.out_rows], torch.arange(10))


def test_full_replay_runs_the_per_path_rows_in_one_call():
    """Every ancestor replayed: one call, and the internal segments do not run (each child replays them; the
    outputs are read from the first child's replayed rows), so the rows are exactly the per-path tokens."""
    paths = [[1, 2, 3, 4], [1, 2, 5, 9], [1, 2, 5, 6, 7], [1, 2, 5, 6, 8], [9, 3], [9, 4, 4]]
    b = Tree.from_paths(paths).to_batch()
    full = fla_gdn.plan_calls(b.node_start, b.node_end, b.node_parent, replay_max=b.seq_len)
    assert full.calls == 1 and len(full.index) == sum(map(len, paths))
    assert torch.equal(full.index[full.out_rows], torch.arange(b.seq_len))
    assert fla_gdn.cheapest_plan(b.node_start, b.node_end, b.node_parent, call_cost_rows=10 ** 6).calls == 1
    # a call that costs nothing: no replay at all (the fewest rows), one call per segment level
    free = fla_gdn.cheapest_plan(b.node_start, b.node_end, b.node_parent, call_cost_rows=0)
    r0 = fla_gdn.plan_calls(b.node_start, b.node_end, b.node_parent, replay_max=0)
    assert free.replayed_tokens == 0 and free.calls == r0.calls == r0.levels > 1


def test_cheapest_plan_weighs_calls_against_rows():
    """A long root and short branches: replaying the 1-token parent pays even at a small call cost; the
    long root is replayed only when a call costs more than its rows."""
    paths = [[1] * 40 + [2, 3, 4], [1] * 40 + [2, 5, 6], [1] * 40 + [7]]
    b = Tree.from_paths(paths).to_batch()
    nodes = (b.node_start, b.node_end, b.node_parent)
    cheap = fla_gdn.cheapest_plan(*nodes, call_cost_rows=8)  # root (40) -> [2] (1) -> {3 4, 5 6}; root -> 7
    assert (cheap.calls, cheap.replayed_tokens) == (2, 1)  # [2] replayed in front of both children, not run
    dear = fla_gdn.cheapest_plan(*nodes, call_cost_rows=1000)
    assert dear.calls == 1 and len(dear.index) == sum(map(len, paths))
    for p in (cheap, dear):
        assert torch.equal(p.index[p.out_rows], torch.arange(b.seq_len))


def test_plan_refuses_bad_nodes_by_name():
    b = Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch()
    with pytest.raises(ValueError, match="node 1"):
        fla_gdn.plan_calls(b.node_start, b.node_end, torch.tensor([-1, 2, 0]))


def test_plan_cached_per_batch():
    b = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5], [1, 2, 5, 6, 7], [8]]).to_batch()
    nodes = (b.node_start, b.node_end, b.node_parent)
    cached = fla_gdn._cached_plan(*nodes, 0)
    assert fla_gdn._cached_plan(*nodes, 0) is cached  # once per batch, not per layer
    assert fla_gdn._cached_plan(*nodes, 5) is not cached
    cached = fla_gdn._cached_plan(*nodes, 0)
    b.node_start.add_(0)  # an in-place write bumps the version: recomputed
    assert fla_gdn._cached_plan(*nodes, 0) is not cached


def test_call_cost_scales_with_the_layer_width():
    """A call's cost in rows: the measured figure at its layer's width, fewer rows for a wider layer."""
    assert fla_gdn.call_cost_rows(16, 128, 128) == fla_gdn.CALL_COST_ROWS
    assert fla_gdn.call_cost_rows(32, 128, 128) == fla_gdn.CALL_COST_ROWS // 2
    assert fla_gdn.call_cost_rows(2, 8, 8) > 1000 * fla_gdn.CALL_COST_ROWS


@pytest.mark.parametrize("seed", range(3))
def test_gather_rows_backward_sums_each_tokens_rows(seed):
    """The input gather's backward (replayed tokens: several rows each) equals index_select's (index_add),
    per occurrence group; tokens no row reads get zero; every row is in exactly one group."""
    g = torch.Generator().manual_seed(seed)
    T = 37
    index = torch.cat([torch.randint(0, T - 5, (60,), generator=g), torch.arange(3, 9).repeat(16)])  # 5 unread
    groups = fla_gdn.occurrence_groups(index, T)
    counts = torch.bincount(index, minlength=T)
    assert [rows.shape[1] for _, rows in groups] == sorted(set(counts.tolist()))
    seen = torch.cat([rows.flatten() for _, rows in groups])
    assert torch.equal(seen.sort().values, torch.arange(len(index)))
    for values, rows in groups:
        assert torch.equal(index[rows], values[:, None].expand_as(rows)) and (counts[values] == rows.shape[1]).all()
    x = torch.randn(2, T, 3, 4, dtype=F64, generator=g, requires_grad=True)
    w = torch.randn(2, len(index), 3, 4, dtype=F64, generator=g)
    got = fla_gdn.gather_rows(x, index, groups)
    assert type(got.grad_fn).__name__ == "_GatherRowsBackward"  # it fired
    ref = x.index_select(1, index)
    assert torch.equal(got, ref)
    (dg,), (dr,) = torch.autograd.grad((got * w).sum(), x), torch.autograd.grad((ref * w).sum(), x)
    torch.testing.assert_close(dg, dr, rtol=1e-14, atol=1e-14)
    assert (dg[:, T - 5:] == 0).all()


def test_identity_plan_has_no_gather():
    b = Tree.from_paths([[1, 2, 3, 4, 5]]).to_batch()
    plan = fla_gdn.plan_calls(b.node_start, b.node_end, b.node_parent)
    assert plan.identity and plan.occurrences == ()


@pytest.mark.parametrize("pad", [None, 8, 32])
def test_identity_means_the_rows_are_the_tokens_in_dfs_order(pad):
    """``identity`` (no gather) exactly where the plan's rows are ``arange(T)``, over every tree and budget."""
    seen = set()
    for name, paths in TREES.items():
        b = Tree.from_paths(paths).to_batch(pad_to_multiple=pad)
        nodes = (b.node_start, b.node_end, b.node_parent)
        for plan in [fla_gdn.plan_calls(*nodes, replay_max=r) for r in (0, 1, 3, 64)] + [fla_gdn.cheapest_plan(*nodes)]:
            arange = torch.arange(b.seq_len)
            in_order = len(plan.index) == b.seq_len and torch.equal(plan.index, arange)
            assert plan.identity == in_order, name
            if plan.identity:
                assert torch.equal(plan.out_rows, arange) and plan.occurrences == ()
            seen.add(plan.identity)
    assert seen == {True, False}


def test_a_padded_group_runs_in_dfs_order():
    """A prompt, its samples and a bucket's padding: the padding is a root, but it feeds nothing, so it runs in
    the samples' call (starting from the root state) and the rows stay in DFS order; the cheapest plan takes
    that over replaying the prompt, which would need the gather."""
    b = Tree.from_paths(TREES["prompt_and_samples"]).to_batch(pad_to_multiple=32)
    plan = fla_gdn.cheapest_plan(b.node_start, b.node_end, b.node_parent, call_cost_rows=8)
    assert plan.identity and plan.calls == 2
    first, last = plan.waves
    assert first.roots is None and last.roots.tolist() == [len(last.lengths) - 1]  # the padding, last in DFS order
    assert last.lengths[-1] == b.seq_len - int(b.node_start[-1])
    unpadded = Tree.from_paths(TREES["prompt_and_samples"]).to_batch()
    assert fla_gdn.plan_calls(unpadded.node_start, unpadded.node_end, unpadded.node_parent).waves[-1].roots is None


def test_gather_cost_tips_the_cheapest_plan_to_dfs_order(monkeypatch):
    """Replaying a 7-token prompt in front of 4 samples saves a call for 21 rows: cheaper at 32 rows per call
    without the gather's price, dearer with it."""
    b = Tree.from_paths(TREES["prompt_and_samples"]).to_batch()
    nodes = (b.node_start, b.node_end, b.node_parent)
    monkeypatch.setattr(fla_gdn, "GATHER_COST_PER_ROW", 0.0)
    assert fla_gdn.cheapest_plan(*nodes, call_cost_rows=32).calls == 1
    monkeypatch.setattr(fla_gdn, "GATHER_COST_PER_ROW", 0.5)
    plan = fla_gdn.cheapest_plan(*nodes, call_cost_rows=32)
    assert plan.calls == 2 and plan.identity and plan.rows_read(False) == "in DFS order"


@pytest.mark.parametrize("chunk_size", [2, 4, 64])
@pytest.mark.parametrize("name", ["agentic_like_0", "chains", "one_token_nodes"])
def test_level_tensors_lay_the_calls_end_to_end(name, chunk_size):
    """The levelled path's host tensors (``fla_gdn_levels.level_tensors``): one cu_seqlens over every call's
    segments, fla's chunk indices over all of them, and per call the slice of rows and of chunks that call's
    own (relative) cu_seqlens / chunk indices / chunk offsets describe, the chunks in the same order."""
    from treecompile.ops.fla_gdn_levels import level_tensors

    b = Tree.from_paths(TREES[name]).to_batch()
    plan = fla_gdn.plan_calls(b.node_start, b.node_end, b.node_parent, replay_max=1)
    L = level_tensors(plan, chunk_size)
    assert level_tensors(plan, chunk_size) is L  # cached on the plan
    assert L.cu_seqlens[-1] == len(plan.index) and torch.equal(L.chunk_indices, fla_chunk_indices(L.cu_seqlens, chunk_size))
    seg, chunk = 0, 0
    for c, w in zip(L.calls, plan.waves):
        assert (c.lo, c.hi, c.segments) == (w.lo, w.hi, len(w.lengths)) and c.source is w.source
        assert torch.equal(L.cu_seqlens[seg:seg + c.segments + 1] - c.lo, c.cu_seqlens)
        assert c.c_lo == chunk and torch.equal(c.chunk_indices, fla_chunk_indices(c.cu_seqlens, chunk_size))
        ci = L.chunk_indices[c.c_lo:c.c_hi]
        assert torch.equal(ci[:, 0] - seg, c.chunk_indices[:, 0]) and torch.equal(ci[:, 1], c.chunk_indices[:, 1])
        lens = c.cu_seqlens.diff()  # fla's prepare_chunk_offsets: first chunk of each segment
        assert c.chunk_offsets.tolist() == [0] + ((lens + chunk_size - 1) // chunk_size).cumsum(0).tolist()
        seg, chunk = seg + c.segments, c.c_hi
    assert chunk == len(L.chunk_indices) and seg == len(L.cu_seqlens) - 1


def test_levels_option_refuses_what_it_cannot_run():
    b = Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch()
    xs = gdn_inputs(b.seq_len, 0, with_init=False)[:5]
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    with pytest.raises(ValueError, match="takes no `kernel`"):
        fla_gdn.tree_gated_delta_rule_fla(*xs, *nodes, kernel=torch_varlen_gdn, levels=True)
    from treecompile.ops.fla_gdn_levels import levels_unusable_reason

    if levels_unusable_reason() is not None:  # no fla here: the explicit option says why
        with pytest.raises(RuntimeError, match="not importable"):
            fla_gdn.tree_gated_delta_rule_fla(*xs, *nodes, levels=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_padding_and_host_plans_do_not_wait_for_the_gpu():
    """Padding a CUDA batch and copying the host-made plans (the GDN call plan, the attention's copy runs) to the
    GPU issue no blocking copy: one would wait for everything queued on the GPU, mid-step.  CUDA's sync debug
    mode raises on any synchronising call."""
    from treecompile.ops.key_copies import copy_runs

    rng = random.Random(3)
    paths = [[rng.randrange(9) for _ in range(rng.randint(20, 90))] for _ in range(4)]
    paths += [p[:rng.randint(1, len(p))] + [rng.randrange(9) for _ in range(30)] for p in paths]
    host = Tree.from_paths(paths).to_batch()
    batch = host.to("cuda")
    torch.cuda.synchronize()
    segs = fla_gdn._segments(host.node_start, host.node_end, host.node_parent)
    lo, hi = torch.tensor([0, 5, 40]), torch.tensor([5, 9, 60])
    torch.cuda.set_sync_debug_mode("error")
    try:
        padded = batch.padded(batch.seq_len + 7)
        plan = fla_gdn._materialize(segs, fla_gdn._schedule(segs, 8), torch.device("cuda"))
        runs = copy_runs(lo, hi, torch.cumsum(hi - lo, 0) - (hi - lo), torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert padded.node_start.device.type == "cuda" and padded.seq_len == batch.seq_len + 7
    assert torch.equal(padded.to("cpu").node_end, host.padded(host.seq_len + 7).node_end)
    ref = fla_gdn._materialize(segs, fla_gdn._schedule(segs, 8), torch.device("cpu"))
    assert torch.equal(plan.index.cpu(), ref.index) and torch.equal(plan.out_rows.cpu(), ref.out_rows)
    assert runs.runs.device.type == "cuda" and runs.offsets.device.type == "cuda"


def run_slots_in_torch(xs, h0, L):
    """The levelled path's recurrence as its kernels read :class:`LevelTensors` (one program per slot: rows
    ``[cu[j], cu[j + 1])``, none where that pair goes backwards, the final state then being the initial one), each
    slot's segment through the float64 torch GDN from ``start_states``: the rows' layout, the slots' sources and
    roots, checked without fla."""
    from treecompile.ops.fla_gdn import start_states

    q, k, v, g, beta = xs
    Hv_, Dk, Dv_ = v.shape[2], k.shape[3], v.shape[3]
    out, prev = torch.zeros_like(v), None
    for c in L.calls:
        init = start_states(c.source, c.roots, prev, h0, c.segments, (Hv_, Dk, Dv_), F64, q.device)
        cu, finals = c.cu_seqlens.tolist(), []
        for j in range(c.segments):
            a, e = c.lo + cu[j], c.lo + cu[j + 1]
            if e <= a:
                finals.append(init[j])
                continue
            o, h = torch_chunk_gated_delta_rule(q[:, a:e], k[:, a:e], v[:, a:e], g[:, a:e], beta[:, a:e], chunk_size=4,
                                                initial_state=init[j:j + 1], output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
            out = out.index_copy(1, torch.arange(a, e), o)
            finals.append(h[0])
        prev = torch.stack(finals)
    return out


@pytest.mark.parametrize("name", sorted(TREES))
def test_in_place_slots_read_each_segment_where_it_lies(name):
    """``level_tensors(..., in_place=True)`` of a plan without replay: every segment's rows are its own DFS range
    (no gather), gaps between slots go backwards, and run as the kernels read them (emulated in float64 torch) the
    tree equals the reference op, forward and gradients, from a root initial state, padding included."""
    from treecompile.ops.fla_gdn_levels import _in_place_tensors, level_tensors

    b = Tree.from_paths(TREES[name]).to_batch(pad_to_multiple=8)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    plan = fla_gdn.plan_calls(*nodes[:3], replay_max=0)
    L = level_tensors(plan, 4, in_place=True)
    assert L.in_place != plan.identity and level_tensors(plan, 4, in_place=True) is L
    if plan.identity:  # the op runs these rows as they are; the slots must hold for them too (the padding's roots)
        L = _in_place_tensors(plan, 4)
    assert torch.equal(L.cu_seqlens, torch.tensor([0, *sorted(int(e) for w in plan.waves for e in
                                                              torch.tensor(w.starts) + torch.tensor(w.lengths))]))
    covered = []
    for c in L.calls:
        cu = c.cu_seqlens.tolist()
        assert all(cu[j + 1] < cu[j + 2] for j in range(1, c.segments, 2))  # the gaps go backwards
        covered += [t for j in range(0, c.segments, 2) for t in range(cu[j], cu[j + 1])]
    assert sorted(covered) == list(range(b.seq_len))  # each token read once, by its own segment's slot
    xs = gdn_inputs(b.seq_len, 0, with_init=True)
    leaves = [x for x in xs if x is not None]
    W = torch.randn(1, b.seq_len, Hv, Dv, dtype=F64, generator=torch.Generator().manual_seed(1))
    ref = tree_gdn.tree_gated_delta_rule(*xs[:5], *nodes, xs[5], use_qk_l2norm_in_kernel=True, chunk_size=4)
    got = run_slots_in_torch(xs[:5], xs[5], L)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for a, r in zip(torch.autograd.grad((got * W).sum(), leaves), torch.autograd.grad((ref * W).sum(), leaves)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_in_place_refuses_replayed_rows():
    from treecompile.ops.fla_gdn_levels import level_tensors

    b = Tree.from_paths(ODD_TREES["one_token_nodes"]).to_batch()
    plan = fla_gdn.plan_calls(b.node_start, b.node_end, b.node_parent, replay_max=3)
    with pytest.raises(ValueError, match="without replayed rows"):
        level_tensors(plan, 4, in_place=True)


@pytest.mark.parametrize("seed", range(6))
def test_occurrence_groups_equal_a_stable_sort_of_every_row(seed):
    """The groups (values read once found by a scatter, only the replayed values' rows sorted) equal the groups
    of one stable sort of every row: same counts, values and rows, in the same order."""
    g = torch.Generator().manual_seed(seed)
    T = [1, 5, 40, 300, 1000, 64][seed]
    n = [1, 0, 100, 299, 5000, 64][seed]
    index = torch.randint(0, T, (n,), generator=g) if seed != 5 else torch.randperm(T, generator=g)
    counts = torch.bincount(index, minlength=T)
    order = torch.argsort(index, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    want = []
    for c in torch.unique(counts).tolist():
        values = torch.nonzero(counts == c).flatten()
        want.append((values, order[starts[values, None] + torch.arange(c)] if c else values.new_empty(len(values), 0)))
    got = fla_gdn.occurrence_groups(index, T)
    assert len(got) == len(want)
    for (gv, gr), (wv, wr) in zip(got, want):
        assert torch.equal(gv, wv) and gr.shape == wr.shape and torch.equal(gr, wr)


@pytest.mark.parametrize("replay_max", [0, None])
def test_prepared_plan_is_the_one_the_call_runs(replay_max, monkeypatch):
    """``fla_gdn.prepare`` (what ``TreeModel.prepare`` calls for a lowered fla GDN layer) builds the plan a call of
    these dims will run (whole calls, the path a torch kernel takes here): the call then builds none, and its output
    is the unprepared call's.  A layer of other dims keys its own plan (the cost per call depends on them)."""
    b = Tree.from_paths(TREES["agentic_like_0"]).to_batch(pad_to_multiple=8)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    xs = gdn_inputs(b.seq_len, 0, with_init=True)
    Dk = xs[0].shape[3]
    built = []
    for name in ("cheapest_plan", "plan_calls"):
        fn = getattr(fla_gdn, name)
        monkeypatch.setattr(fla_gdn, name, lambda *a, _fn=fn, **kw: built.append(1) or _fn(*a, **kw))

    def run():
        return fla_gdn.tree_gated_delta_rule_fla(*xs[:5], *nodes, xs[5], use_qk_l2norm_in_kernel=True, chunk_size=4,
                                                 replay_max=replay_max, kernel=torch_varlen_gdn, levels=False)
    fla_gdn._PLANS.clear()
    want = run()
    assert len(built) == 1
    fla_gdn._PLANS.clear()
    fla_gdn.prepare(*nodes[:3], value_heads=Hv, key_dim=Dk, value_dim=Dv, replay_max=replay_max, levels=False,
                    chunk_size=4)
    assert len(built) == 2
    torch.testing.assert_close(run(), want, rtol=0, atol=0)
    assert len(built) == 2  # the call found the prepared plan
    if replay_max is None:  # cheapest_plan weighs calls by the layer's dims: another layer plans again
        fla_gdn.prepare(*nodes[:3], value_heads=2 * Hv, key_dim=Dk, value_dim=Dv, levels=False, chunk_size=4)
        assert len(built) == 3


def test_prepared_conv_segments_are_the_ones_the_call_reads(monkeypatch):
    """``fla_conv.prepare``: the segments of a batch's ``conv_index`` for ``batch`` rows, kept for the op's call."""
    from treecompile.ops import fla_conv

    b = Tree.from_paths(TREES["agentic_like_1"]).to_batch(conv_kernel=4)
    built = []
    fn = fla_conv.conv_segments
    monkeypatch.setattr(fla_conv, "conv_segments", lambda *a: built.append(1) or fn(*a))
    fla_conv._SEGMENTS.clear()
    fla_conv.prepare(b.conv_index, 2)
    seg = fla_conv._cached_segments(b.conv_index, 2)
    assert len(built) == 1 and seg is fla_conv._SEGMENTS._entry[3]
    fla_conv._cached_segments(b.conv_index, 1)  # other rows: other segments
    assert len(built) == 2
