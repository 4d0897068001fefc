"""Tree attention as varlen attention over node segments (treecompile/ops/varlen_tree_attention.py).

CPU: the segment plan expands to exactly the dense tree mask (odd trees, forests, padding, hypothesis trees);
the op (plan, key gather, float32 scatter-add of key gradients, autograd) equals the dense-mask reference in
float64 to rounding, opcheck; bad ``subtree_end`` is refused naming the token; the lowering's
``attention_kernel="fa4_varlen"`` option.  GPU (``-m gpu``, flash-attn-4 on sm_90+): FA4's varlen kernel through
the op (both plans: the segments, and FA4's block-sparse kernels the op takes for trees whose segments gather
more than ``VARLEN_GATHER_LIMIT`` x T rows), output and q/k/v gradients within 2x the bf16 dense kernel's error
against a float64 oracle, and a compiled model's step with it against the flex lowering (a deep tree too).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import deterministic_algorithms, run_interpreted
from tests.strategies import ODD_TREES, path_sets
from tests.test_fa4_tree_attention import assert_bf16_tree_kernel_near_oracle, forest_paths
from tests.test_flex_tree_attention import ancestor_mask, out_and_grads
from treecompile import Tree
from treecompile.tree import _TENSOR_FIELDS, DEFAULT_ORDER, ORDERS
from treecompile.ops import key_copies
from treecompile.ops.tree_attention import tree_attention_reference, tree_mask
from treecompile.ops.varlen_tree_attention import segment_plan, tree_attention_varlen


def plan_mask(plan, T: int, front: int = 0) -> torch.Tensor:
    """The [T, front + T] visibility the plan computes over ``front`` rows (a partition's boundary) and the T
    tokens: segment j's query i sees its first prefix + i + 1 keys; the tail's tokens see themselves."""
    m = torch.zeros(T, front + T, dtype=torch.bool)
    m[torch.arange(plan.tail, T), front + torch.arange(plan.tail, T)] = True
    cq, ck = plan.cu_seqlens_q_host, plan.cu_seqlens_k_host
    assert cq[-1] == plan.tail
    idx = plan.key_index.cpu()
    for j in range(plan.segments):
        n, keys = cq[j + 1] - cq[j], idx[ck[j]:ck[j + 1]]
        assert keys.unique().numel() == keys.numel(), "a segment reads a key twice"
        for i in range(n):
            m[cq[j] + i, keys[:keys.numel() - n + i + 1]] = True
    return m


def _batch(paths, pad_to=None, order=DEFAULT_ORDER):
    return Tree.from_paths(paths, order=order).to_batch(pad_to_multiple=pad_to)


@pytest.mark.parametrize("name", sorted(ODD_TREES))
@pytest.mark.parametrize("pad_to", [None, 8, 13])
def test_plan_is_the_tree_mask_on_odd_trees(name, pad_to):
    b = _batch(ODD_TREES[name], pad_to)
    plan = segment_plan(b.subtree_end)
    assert torch.equal(plan_mask(plan, b.seq_len), tree_mask(b.subtree_end))
    assert torch.equal(tree_mask(b.subtree_end), ancestor_mask(b.pred_index))  # the mask is the tree's


@pytest.mark.parametrize("T,roots,pad_to", [(1, 1, None), (64, 1, None), (129, 3, None), (300, 2, 384), (517, 5, 520)])
def test_plan_is_the_tree_mask_on_forests(T, roots, pad_to):
    b = _batch(forest_paths(T, roots, seed=T), pad_to)
    plan = segment_plan(b.subtree_end)
    assert torch.equal(plan_mask(plan, b.seq_len), tree_mask(b.subtree_end))
    # queries are never gathered: the segments tile [0, tail) in order; the padding is the tail
    assert plan.cu_seqlens_q_host[0] == 0 and plan.cu_seqlens_q_host[-1] == plan.tail
    assert plan.tail <= T  # the padding is never handed to the kernel (a 1-token root may end the tree too)


@settings(max_examples=60, deadline=None)
@given(path_sets(max_paths=8, max_len=10))
def test_plan_is_the_tree_mask_hypothesis(paths):
    b = _batch(paths)
    plan = segment_plan(b.subtree_end)
    assert torch.equal(plan_mask(plan, b.seq_len), tree_mask(b.subtree_end))
    # one segment per first-child chain: the gathered keys are the paths of the distinct leaves
    t = Tree.from_paths(paths)
    assert plan.gathered <= t.num_path_tokens


def copies_index(runs, G: int) -> torch.Tensor:
    """The gathered row -> token map the copy runs describe (each run's token t reads rows t + off), -1 where no
    run reads a row."""
    from treecompile.ops.key_copies import BLOCK_T

    idx = torch.full((G,), -1, dtype=torch.int64)
    offsets = runs.offsets.cpu()
    prev = None
    for t0, t1, e0, e1 in runs.tiles().tolist():
        assert 0 < t1 - t0 <= BLOCK_T and e0 <= e1
        assert prev is None or t0 == prev, "tiles do not cover the tokens in order"
        prev = t1
        # a run's copies in interval order (root first: the kernel sums them in this order): rows increasing
        assert offsets[e0:e1].tolist() == sorted(set(offsets[e0:e1].tolist())), "copies out of interval order"
        for off in offsets[e0:e1].tolist():
            rows = torch.arange(t0, t1) + off
            assert bool((idx[rows] == -1).all()), "a gathered row is read twice"
            idx[rows] = torch.arange(t0, t1)
    assert prev in (None, runs.tokens)
    return idx


@settings(max_examples=60, deadline=None)
@given(path_sets(max_paths=8, max_len=10), st.sampled_from([None, 8]))
def test_copy_runs_read_every_gathered_row_once(paths, pad_to):
    """The backward's per-token sums read, through the runs, exactly the gathered rows of each token (every row
    once), whatever the tree: the same sums as the scatter-add over ``key_index``."""
    b = _batch(paths, pad_to)
    plan = segment_plan(b.subtree_end)
    assert plan.copies.rows == plan.gathered and plan.copies.tokens == plan.tail
    assert torch.equal(copies_index(plan.copies, plan.gathered), plan.key_index.cpu())


def test_copy_runs_cut_runs_of_any_length_into_tiles():
    """Runs of 1, BLOCK_T - 1, BLOCK_T, BLOCK_T + 1, 2 BLOCK_T and 2 BLOCK_T + 1 tokens, each read by one or two
    intervals: every tile within one run and at most ``BLOCK_T`` tokens, the tiles covering the tokens in order,
    every gathered row read once, in interval order."""
    from treecompile.ops.key_copies import BLOCK_T, CopyRuns, copy_run_lists

    bounds = [0]
    for n in (1, BLOCK_T - 1, BLOCK_T, BLOCK_T + 1, 2 * BLOCK_T, 2 * BLOCK_T + 1):
        bounds.append(bounds[-1] + n)
    intervals = [(a, b) for a, b in zip(bounds, bounds[1:])] + [(0, bounds[3]), (bounds[4], bounds[6])]
    lo, hi = torch.tensor(intervals).unbind(1)
    first = torch.cumsum(hi - lo, 0) - (hi - lo)
    table, offsets, tokens, rows, n_tiles = copy_run_lists(lo, hi, first)
    assert (tokens, rows) == (bounds[-1], int((hi - lo).sum()))
    runs = CopyRuns(runs=torch.tensor(table).view(-1, 5), offsets=torch.tensor(offsets), tokens=tokens, rows=rows,
                    n_tiles=n_tiles)
    assert copies_index(runs, rows).tolist() == [t for a, b in intervals for t in range(a, b)]
    cuts = {x for iv in intervals for x in iv}  # the runs' bounds: no tile crosses one
    tiles = runs.tiles()
    assert n_tiles == tiles.shape[0] == sum(-(-(b - a) // BLOCK_T) for a, b in zip(bounds, bounds[1:]))
    assert not [(t0, t1) for t0, t1, _, _ in tiles.tolist() if any(t0 < c < t1 for c in cuts)]


def test_copy_runs_on_forests_and_deep_trees():
    for paths in (forest_paths(300, 4, seed=3), [[1] * 3 + [i] * (i + 1) for i in range(2, 40)],
                  [list(range(n)) for n in range(1, 30)]):
        plan = segment_plan(_batch(paths, 16).subtree_end)
        assert torch.equal(copies_index(plan.copies, plan.gathered), plan.key_index.cpu())


@settings(max_examples=30, deadline=None)
@given(path_sets(max_paths=8, max_len=10), st.sampled_from([None, 8]), st.sampled_from([0, 3]))
def test_plan_tables_cross_together_and_are_what_they_stand_for(paths, pad_to, window):
    """A segment plan's six device tables (the key index's changes, both ``cu_seqlens``, the copy runs' tiles and
    offsets) go to the device in one ``to_device_tables`` call (here the CPU: views of its one buffer), and each is
    the table it stands for (windowed plans too)."""
    from treecompile.ops import varlen_tree_attention as vta

    b = _batch(paths, pad_to)
    if window:  # positions are depths: the rows of each path count up by one
        build = lambda: vta.windowed_plan(b.subtree_end, b.position_ids, window)  # noqa: E731
    else:
        build = lambda: vta.tree_attention_plan(b.subtree_end.clone(), block_sparse=False)  # noqa: E731
    calls = []
    real = vta.to_device_tables

    def counted(tables, device, int32=()):
        calls.append((len(tables), tuple(int32)))
        return real(tables, device, int32)

    vta.to_device_tables = counted
    try:
        got = build()
    finally:
        vta.to_device_tables = real
    if got is None:  # a window that would gather too many rows: no plan
        assert not calls
        return
    assert calls == [(6, (2, 3))]
    # each table is the one it stands for: the cu_seqlens their host copies, the copy runs the key index's rows,
    # and (unwindowed) the key index with the cu_seqlens the tree mask, pair by pair
    for dev, host in ((got.cu_seqlens_q, got.cu_seqlens_q_host), (got.cu_seqlens_k, got.cu_seqlens_k_host)):
        assert dev.dtype == torch.int32 and dev.tolist() == list(host)
    assert torch.equal(copies_index(got.copies, got.gathered), got.key_index)
    if not window:
        se, T = b.subtree_end, b.seq_len
        assert _plan_pairs(got.key_index, got.cu_seqlens_q, got.cu_seqlens_k, got.tail, T) == \
            {(q, k): 1 for k in range(T) for q in range(k, int(se[k]))}
    storages = {t.untyped_storage().data_ptr() for t in (got.cu_seqlens_q, got.cu_seqlens_k, got.copies.runs,
                                                         got.copies.offsets)}
    assert len(storages) == 1


_INTERPRETED = r"""
import random, torch
from treecompile import Tree
from treecompile.ops import key_copies
from treecompile.ops.tree_attention import tree_attention_reference
from treecompile.ops.varlen_tree_attention import segment_plan, tree_attention_varlen
from tests.test_fa4_tree_attention import forest_paths

from tests.helpers import branching_paths, count_launches
import triton
import triton.testing

launched = count_launches(key_copies, "_sum_copies_kernel")

rng = random.Random(0)
def paths():
    return branching_paths(rng, 4, 90, 80, 9)

worst = {"op": 0.0, "bf16": 0.0}
for it in range(12):
    ps = forest_paths(150, 3, seed=it) if it % 4 == 3 else paths()
    b = Tree.from_paths(ps).to_batch(pad_to_multiple=rng.choice([None, 16]))
    T, H, Hkv, D = b.seq_len, rng.choice([2, 4]), rng.choice([1, 2]), rng.choice([8, 40])
    g = torch.Generator().manual_seed(it)
    q, k, v = (torch.randn(1, T, h, D, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
               for h in (H, Hkv, Hkv))
    do = torch.randn(1, H, T, D, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(tree_attention_varlen(q, k, v, b.subtree_end, scale=0.3), (q, k, v), do)
    ref = torch.autograd.grad(tree_attention_reference(q, k, v, b.subtree_end, scale=0.3), (q, k, v), do)
    for x, r in zip(got, ref):
        worst["op"] = max(worst["op"], float((x - r).abs().max() / r.abs().max().clamp(min=1e-300)))
assert len(launched) >= 24, "the Triton sums did not run"

# bf16 rows, 48 copies of the root: float32 sums rounded once, as index_add_ into float32 then rounded
plan = segment_plan(Tree.from_paths([[1] * 70 + [2 + i] * 5 for i in range(48)]).to_batch().subtree_end)
src = torch.randn(plan.gathered, 2, 24).to(torch.bfloat16)
got = key_copies.sum_copies(src, plan.copies, plan.key_index, plan.tail)
want = torch.zeros(plan.tail, 2, 24, dtype=torch.float64).index_add_(0, plan.key_index, src.double())
ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=1e-30))) - 7)
worst["bf16"] = float(((got.double() - want).abs() / (ulp + 1e-6 * want.abs().max())).max())

# every kernel config (the autotuner's choices on the GPU) gives the same bits: channels not a multiple of the
# column blocks (48, 300), one and several column blocks, either order of the programs
worst["configs"] = 0
timed = []  # the autotuner's timed launches: every config, once per key
triton.testing.do_bench = lambda fn, warmup, rep, quantiles: (fn(), timed.append(1), [1.0, 1.0, 1.0])[2]
for it, (ps, shape) in enumerate([(paths(), (2, 24)), (forest_paths(120, 3, seed=5), (3, 100)),
                                  ([[1] * 70 + [2 + i] * 5 for i in range(48)], (1, 300))]):
    plan = segment_plan(Tree.from_paths(ps).to_batch(pad_to_multiple=16).subtree_end)
    for dtype in (torch.bfloat16, torch.float64):
        src = torch.randn(plan.gathered, *shape, generator=torch.Generator().manual_seed(it)).to(dtype)
        # 7 rows past the plan's: zero
        outs = [key_copies.sum_copies(src, plan.copies, plan.key_index, plan.tail + 7, config=c)
                for c in key_copies.CONFIGS]
        worst["configs"] += sum(not torch.equal(o, outs[0]) for o in outs)
        # the autotuner's path (its timing faked: the interpreter has no GPU clock), launching every config
        tuned = torch.full_like(outs[0], float("nan"))
        tuned[plan.tail:] = 0
        key_copies._launch_tuned(src.contiguous(), tuned, plan.copies, src[0].numel(),
                                 triton.language.float64 if dtype == torch.float64 else triton.language.float32)
        worst["configs"] += not torch.equal(tuned, outs[0])
        want = torch.zeros(outs[0].shape, dtype=torch.float64).index_add_(0, plan.key_index, src.double())
        if dtype == torch.float64:
            worst["op"] = max(worst["op"], float((outs[0] - want).abs().max() / want.abs().max()))
worst["timed"] = len(timed)
print(repr(worst))
"""


@pytest.mark.skipif(not key_copies.available(), reason="triton is not importable")
def test_triton_copy_sums_in_interpreter():
    """The backward's per-token key/value sums through the Triton kernel (Triton's CPU interpreter): the op's
    float64 gradients equal the dense-mask reference's to rounding on random trees and forests (GQA, padding,
    head dims not a multiple of the block); bf16 sums of 48 copies are within one bf16 ulp of the exact sum
    (accumulated in float32, rounded once; the interpreter truncates where the GPU rounds to nearest); every
    kernel config the GPU's autotuner may pick gives the same bits.  (Triton 3.6's interpreter needs numpy < 2 for
    the kernel's loop over loaded bounds.)"""
    worst = run_interpreted(_INTERPRETED)
    assert worst["op"] < 1e-12, worst
    assert worst["bf16"] <= 1, worst
    assert worst["configs"] == 0, worst
    # every config timed once per key: channel counts 48 and 300 (twice), each in bf16 and float64 (the autotuner
    # keys on the tensors' dtypes too)
    assert worst["timed"] == 4 * len(key_copies.CONFIGS), worst


def _qkv(T, H, Hkv, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    # the model's layout: [1, T, H, D] storage viewed as [1, H, T, D]
    return [torch.randn(1, T, h, D, generator=g, dtype=dtype).transpose(1, 2).requires_grad_() for h in (H, Hkv, Hkv)]


def assert_same_as(fn, ref_fn, q, k, v, do):
    """Out and q/k/v gradients of ``fn(q, k, v)`` equal ``ref_fn``'s in float64 (O(1) values; a 1-token segment's
    dq is 0)."""
    got, ref = (out_and_grads(f, q, k, v, do, torch.float64) for f in (fn, ref_fn))
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=name)


def assert_traced_same_as(fn, ref_fn, q, k, v, *tree):
    """dynamo (fullgraph) and AOT autograd through ``fn(q, k, v, *tree)`` (an op and its backward op, as inductor's
    front end sees them; the tree tensors as graph inputs): q/k/v gradients as ``ref_fn``'s."""
    f = torch.compile(lambda q, k, v, *t: (fn(q, k, v, *t) * 1.5).sum(), backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(f(q, k, v, *tree), (q, k, v))
    ref = torch.autograd.grad((ref_fn(q, k, v, *tree) * 1.5).sum(), (q, k, v))
    for x, r in zip(got, ref):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("paths_name,H,Hkv", [("one_token_nodes", 4, 2), ("prefix_of_other", 2, 2),
                                               ("forest", 6, 2), ("single_token", 2, 1)])
def test_op_equals_the_dense_reference_float64(paths_name, H, Hkv):
    paths = forest_paths(200, 3, seed=1) if paths_name == "forest" else ODD_TREES[paths_name]
    b = _batch(paths, 16)
    D = 8
    q, k, v = _qkv(b.seq_len, H, Hkv, D, seed=H)
    do = torch.randn(1, H, b.seq_len, D, dtype=torch.float64)
    assert_same_as(lambda a, b_, c: tree_attention_varlen(a, b_, c, b.subtree_end, scale=0.3),
                   lambda a, b_, c: tree_attention_reference(a, b_, c, b.subtree_end, scale=0.3), q, k, v, do)


@pytest.mark.parametrize("layout", ["tokens_major", "heads_major", "sliced"])
def test_layout_helpers_equal_their_plain_forms(layout):
    """``_tokens_major`` / ``_heads_major`` take one view where the storage allows (the op's per-layer host time) and
    equal the plain transposes on every layout: a view of the model's ``[1, T, H, D]`` storage, a contiguous
    ``[1, H, T, D]``, a slice of a wider tensor."""
    from treecompile.ops import varlen_tree_attention as vta

    T, H, D = 7, 3, 5
    base = torch.randn(2, T, H, D + 2, dtype=torch.float64)
    x = {"tokens_major": base[1:, :, :, :D].contiguous().transpose(1, 2),
         "heads_major": base[1:, :, :, :D].transpose(1, 2).contiguous(),
         "sliced": base[1:, :, :, 1:D + 1].transpose(1, 2)}[layout]
    t = vta._tokens_major(x)
    assert t.is_contiguous() and torch.equal(t, x[0].transpose(0, 1))
    assert (t.data_ptr() == x.data_ptr()) == (layout == "tokens_major")  # a view only where the storage is token-major
    h = vta._heads_major(t)
    assert h.shape == (1, H, T, D) and torch.equal(h, t.transpose(0, 1).unsqueeze(0)) and h.data_ptr() == t.data_ptr()
    assert torch.equal(vta._heads_major(t[:, 1:]), t[:, 1:].transpose(0, 1).unsqueeze(0))  # not contiguous


@pytest.mark.parametrize("intervals", [[(3, 7), (0, 2), (9, 10)], [(0, 0), (5, 8), (2, 2), (2, 2), (0, 4), (6, 6)],
                                       [(4, 4)], [(0, 0)]], ids=["plain", "empty_intervals", "one_empty", "none"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_key_rows_are_the_intervals_one_after_the_other(intervals, device):
    """``_rows`` and the key index (its changes on the host, built on the tokens' device) is the intervals' tokens laid out in
    order (empty intervals anywhere), ``first`` each interval's first row; a total that is not the plan's is an
    internal error."""
    from treecompile.host_values import to_device_async
    from treecompile.ops import varlen_tree_attention as vta

    G = sum(h - l for l, h in intervals)
    lo, hi, first = vta._rows([x for iv in intervals for x in iv], G)
    at, by = (to_device_async(torch.tensor(x), torch.device(device)) for x in vta._key_index_changes(lo, first))
    key_index = vta._key_index_from(at, by, G)
    assert key_index.device.type == device
    assert key_index.tolist() == [t for l, h in intervals for t in range(l, h)]
    assert first == [sum(h - l for l, h in intervals[:m]) for m in range(len(intervals))]
    assert (lo, hi) == ([l for l, _ in intervals], [h for _, h in intervals])
    with pytest.raises(AssertionError, match="internal error"):
        vta._rows([x for iv in intervals for x in iv], G + 1)


def test_padding_is_the_tail_not_segments():
    b = _batch([[1, 2, 3], [1, 4]], 64)
    plan = segment_plan(b.subtree_end)
    assert plan.tail == 4 and plan.segments == 2 and plan.gathered == 3 + 2  # the two paths' keys
    only_pads = segment_plan(torch.arange(1, 6))  # five tokens that each see only themselves
    assert only_pads.tail == 0 and only_pads.segments == 0 and only_pads.gathered == 0
    q, k, v = _qkv(5, 2, 1, 4, seed=1)
    do = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    se = torch.arange(1, 6)
    assert_same_as(lambda a, b_, c: tree_attention_varlen(a, b_, c, se),
                   lambda a, b_, c: tree_attention_reference(a, b_, c, se), q, k, v, do)


def test_opcheck():
    b = _batch(forest_paths(40, 2, seed=3), 8)
    q, k, v = (x.detach() for x in _qkv(b.seq_len, 4, 2, 8, seed=0))
    torch.library.opcheck(torch.ops.treecompile.tree_attention_varlen_fwd.default,
                          (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), b.subtree_end, 0.35))


def test_traced_fullgraph_under_aot_autograd():
    """dynamo (fullgraph) and AOT autograd through the op and its backward op, as inductor's front end sees them."""
    b = _batch(forest_paths(80, 2, seed=1), 32)
    q, k, v = _qkv(b.seq_len, 4, 2, 16, seed=2)
    assert_traced_same_as(tree_attention_varlen, tree_attention_reference, q, k, v, b.subtree_end)


def test_bad_subtree_end_is_named():
    with pytest.raises(ValueError, match=r"subtree_end\[2\] = 2"):
        segment_plan(torch.tensor([3, 3, 2]))  # token 2 would not see itself
    with pytest.raises(ValueError, match=r"subtree_end\[0\] = 9"):
        segment_plan(torch.tensor([9, 2]))
    with pytest.raises(ValueError, match=r"subtree_end\[2\] = 2"):  # tokens 1 and 2 share it: 2 is the first past it
        segment_plan(torch.tensor([4, 2, 2, 4]))
    with pytest.raises(ValueError, match="not the DFS layout of a forest"):
        segment_plan(torch.tensor([2, 4, 4, 4]))  # token 1's subtree [1, 4) sticks out of token 0's [0, 2)
    with pytest.raises(ValueError, match="integer"):
        segment_plan(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="integer"):
        segment_plan(torch.tensor([1 + 0j]))
    with pytest.raises(ValueError, match=r"subtree_end\[0\] = 9223372036854775813: "):  # not wrapped to int64
        segment_plan(torch.tensor([2 ** 63 + 5, 2], dtype=torch.uint64))
    with pytest.raises(ValueError, match="1-D"):
        segment_plan(torch.tensor([[1]]))


@settings(max_examples=60, deadline=None)
@given(path_sets(max_paths=8, max_len=10), st.sampled_from([None, 8, 13]),
       st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.sampled_from(["self", "before", "past", "neg", "end"])),
                min_size=1, max_size=3), st.booleans())
def test_entries_out_of_bounds_are_refused_naming_the_first(paths, pad_to, changes, tensor_runs):
    """Entries out of bounds anywhere (near the end and in a padded tail too, where the walk looks for the tail
    before it checks the bounds on the runs before it) are refused naming the first token ``t`` without
    ``t < subtree_end[t] <= T``, by the brute force; with the walk's per-run checks in Python and as tensor ops
    (``WALK_TENSOR_RUNS``)."""
    with _walk_runs_as_tensors(tensor_runs):
        _refused_naming_the_first(paths, pad_to, changes)


@contextlib.contextmanager
def _walk_runs_as_tensors(on: bool):
    """The walk's per-run checks and lists as tensor ops for any number of runs (``on``), else in Python for all."""
    from treecompile.ops import varlen_tree_attention as vta

    real = vta.WALK_TENSOR_RUNS
    vta.WALK_TENSOR_RUNS = -1 if on else 1 << 62
    try:
        yield
    finally:
        vta.WALK_TENSOR_RUNS = real


def _refused_naming_the_first(paths, pad_to, changes):
    se = _batch(paths, pad_to).subtree_end.clone()
    T = se.numel()
    for from_end, n, kind in changes:
        t = (T - 1 - n if from_end else n) % T
        se[t] = {"self": t, "before": t // 2, "past": T + 1 + n, "neg": -1 - n, "end": T}[kind]
    L = se.tolist()
    first = next((t for t in range(T) if not t < L[t] <= T), None)
    if first is None:  # every change in bounds: the batch is planned or refused as not nested, not out of bounds
        try:
            segment_plan(se)
        except ValueError as e:
            assert "not the DFS layout of a forest" in str(e)
        return
    with pytest.raises(ValueError, match=rf"subtree_end\[{first}\] = {L[first]}: expected {first} < "):
        segment_plan(se)


def _first_not_nested(se: list) -> int | None:
    """Brute force: the first token ``t`` whose subtree sticks out of an ancestor's (some ``k < t < se[k] < se[t]``)."""
    return min((t for k in range(len(se)) for t in range(k + 1, min(se[k], len(se))) if se[t] > se[k]), default=None)


@settings(max_examples=80, deadline=None)
@given(path_sets(max_paths=10, max_len=12), st.sampled_from([None, 8, 13]), st.integers(0, 2 ** 31 - 1),
       st.integers(1, 3), st.booleans())
def test_walk_is_the_brute_force_one_and_names_the_first_token_not_nested(paths, pad_to, seed, changes, tensor_runs):
    """The walk (per run of equal subtree ends: its bounds, segments, parent cuts and prefix lengths) on any forest,
    padded or not, is the brute force's: each segment's parent is the segment of the last token above its start
    that sees it, cut after that token, and its prefix is every earlier token that sees its start.  With up to
    three entries changed inside the bounds, the plan is refused iff ``subtree_end`` is not nested, naming the first
    token whose subtree sticks out of an ancestor's; else it is the plan of that other forest.  With the walk's
    per-run checks and lists in Python and as tensor ops (``WALK_TENSOR_RUNS``)."""
    with _walk_runs_as_tensors(tensor_runs):
        _walk_is_the_brute_force_one(paths, pad_to, seed, changes)


def _walk_is_the_brute_force_one(paths, pad_to, seed, changes):
    from treecompile.ops import varlen_tree_attention as vta

    se = _batch(paths, pad_to).subtree_end
    T = se.numel()
    w = vta._walk(se)
    L = se.tolist()
    for j, a in enumerate(w.starts):
        above = [k for k in range(a) if L[k] > a]
        assert w.prefix_len[j] == len(above)
        if not above:
            assert w.parents[j] is None
        else:
            assert w.parents[j] == (max(i for i, s in enumerate(w.starts) if s <= above[-1]), above[-1] + 1)
    # the tail: the longest run of last tokens that each see only themselves and that no earlier token reaches past
    tail = T
    while tail and L[tail - 1] == tail and max(L[:tail - 1], default=0) <= tail - 1:
        tail -= 1
    assert w.tail == tail and w.n_main == len(w.starts) == len(w.parents)
    assert w.starts == ([0] if tail else []) + [t + 1 for t in range(tail - 1) if L[t] == t + 1]
    g = torch.Generator().manual_seed(seed)
    bad = se.clone()
    for _ in range(changes):
        t = int(torch.randint(T, (1,), generator=g))
        bad[t] = int(torch.randint(t + 1, T + 1, (1,), generator=g))
    first = _first_not_nested(bad.tolist())
    if first is None:
        assert vta.tree_attention_plan(bad.clone(), block_sparse=False).gathered == vta._walk(bad).gathered
    else:
        with pytest.raises(ValueError, match=rf"not the DFS layout of a forest at token {first} "):
            vta.tree_attention_plan(bad.clone(), block_sparse=False)


def test_a_comb_is_refused_with_its_gather_size(monkeypatch):
    from treecompile.ops import varlen_tree_attention as vta

    spine = list(range(100, 140))
    comb = [spine[:i] + [1000 + i] for i in range(1, 41)] + [spine]  # a leaf off every spine token
    se = _batch(comb).subtree_end
    monkeypatch.setattr(vta, "MAX_GATHER_ROWS", 0)
    monkeypatch.setattr(vta, "MAX_GATHER_FACTOR", 4)
    with pytest.raises(ValueError, match=r"40 segments would gather .* rows for 80 tokens .*attention_kernel='flex'"):
        segment_plan(se)
    monkeypatch.setattr(vta, "MAX_GATHER_FACTOR", 64)
    assert segment_plan(se).gathered == sum(i + 1 for i in range(1, 41))  # each leaf reads its whole path


def test_plan_is_kept_per_batch():
    from treecompile.ops import varlen_tree_attention as vta

    se = _batch([[1, 2, 3], [1, 4]]).subtree_end
    q = torch.empty(1, 2, se.numel(), 8, dtype=torch.float64)
    p1 = vta._plan(se, q)
    assert vta._plan(se, q) is p1
    se2 = se.clone()
    assert vta._plan(se2, q) is not p1 and vta._plan(se2, q).cu_seqlens_q_host == p1.cu_seqlens_q_host


def _deep_paths(levels: int = 12, leaves_per_level: int = 2) -> list[list[int]]:
    """A spine of 3-token nodes with short leaves off every level: each leaf re-reads the spine (G >> T)."""
    spine, paths, nxt = [], [], iter(range(10**6))
    for _ in range(levels):
        spine = spine + [next(nxt) for _ in range(3)]
        paths += [spine + [next(nxt) for _ in range(2)] for _ in range(leaves_per_level)]
    return paths + [spine]


def test_deep_trees_take_the_block_sparse_plan():
    """Above VARLEN_GATHER_LIMIT x T gathered rows the op runs the whole sequence under the tree mask (FA4's
    block-sparse kernels on CUDA); below, the segments.  Where the block-sparse tiles cannot run (``block_sparse=
    False``: a head dim FA4's sparse tiles do not take) the segments stay, up to the refusal."""
    from treecompile.ops import varlen_tree_attention as vta

    deep = _batch(_deep_paths(levels=24), 16).subtree_end
    assert segment_plan(deep).gathered > vta.VARLEN_GATHER_LIMIT * deep.numel()
    assert isinstance(vta.tree_attention_plan(deep, block_sparse=True), vta.BlockSparsePlan)
    assert isinstance(vta.tree_attention_plan(deep, block_sparse=False), vta.SegmentPlan)
    wide = _batch([[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]]).subtree_end  # G = 4 + 4 + 2 = 1.25x T
    assert isinstance(vta.tree_attention_plan(wide, block_sparse=True), vta.SegmentPlan)
    p = vta.tree_attention_plan(deep, block_sparse=True)
    assert p.gathered == segment_plan(deep).gathered and p.tail == deep.numel() and p.mask_end is None  # CPU


def test_deterministic_mode_keeps_fa4_off_its_block_sparse_backward(monkeypatch):
    """Under ``torch.use_deterministic_algorithms(True)`` a batch the FA4 kernels would run block-sparse runs its
    segments where they fit (FA4's deterministic block-sparse backward needs write orders the op does not build);
    past their bound a RuntimeError is raised, as torch's non-deterministic ops raise theirs (a warning and the
    block-sparse plan under ``warn_only``).  The FA4 kernels are stood in for (CPU): only the choice is checked
    here; the GPU test of the kept K/V checks the deterministic backward bit for bit."""
    from treecompile.ops import fa4_tree_attention
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "_fa4", lambda q: True)
    monkeypatch.setattr(fa4_tree_attention, "fa4_input_reason", lambda q: None)
    q = torch.empty(1, 4, 1, 8)
    deep = _batch(_deep_paths(levels=24), 16).subtree_end
    assert segment_plan(deep).gathered > vta.VARLEN_GATHER_LIMIT * deep.numel()
    with deterministic_algorithms(True):
        assert isinstance(vta._plan(deep, q), vta.SegmentPlan)
    with deterministic_algorithms(False):
        assert isinstance(vta._plan(deep, q), vta.BlockSparsePlan)  # the same tensor: the plan follows the mode
    monkeypatch.setattr(vta, "MAX_GATHER_FACTOR", 2)  # the deep tree's segments past their bound
    monkeypatch.setattr(vta, "MAX_GATHER_ROWS", 0)
    with deterministic_algorithms(True), \
            pytest.raises(RuntimeError, match="segments_fit.*not deterministic.*attention_kernel='flex'"):
        vta._plan(deep.clone(), q)
    with deterministic_algorithms(True, warn_only=True), \
            pytest.warns(UserWarning, match="warn_only=True: running the non-deterministic backward"):
        assert isinstance(vta._plan(deep.clone(), q), vta.BlockSparsePlan)


@settings(max_examples=40, deadline=None)
@given(path_sets(max_paths=8, max_len=10), st.sampled_from([0.0, 3.0, float("inf")]), st.sampled_from([None, 8, 13]),
       st.sampled_from(["dfs", "heavy_first"]), st.sampled_from(ORDERS))
def test_op_equals_the_dense_reference_hypothesis(paths, limit, pad_to, layout, order):
    """Any tree in either serialisation, either plan (the limit forced low, as shipped, or high), the block-sparse
    plan in either order, padded or not: out and q/k/v gradients of the op equal the dense-mask reference in
    float64."""
    from treecompile.ops import varlen_tree_attention as vta

    old, vta.VARLEN_GATHER_LIMIT = vta.VARLEN_GATHER_LIMIT, limit
    old_layout, vta.BLOCK_SPARSE_LAYOUT = vta.BLOCK_SPARSE_LAYOUT, layout
    try:
        se = _batch(paths, pad_to, order).subtree_end.clone()  # a tensor of its own per example: one plan each
        q, k, v = _qkv(se.numel(), 4, 2, 4, seed=se.numel())
        do = torch.randn(1, 4, se.numel(), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        assert_same_as(lambda a, b_, c: tree_attention_varlen(a, b_, c, se, scale=0.5),
                       lambda a, b_, c: tree_attention_reference(a, b_, c, se, scale=0.5), q, k, v, do)
    finally:
        vta.VARLEN_GATHER_LIMIT, vta.BLOCK_SPARSE_LAYOUT = old, old_layout


@pytest.mark.parametrize("limit", [0.0, float("inf")], ids=["block_sparse", "segments"])
@pytest.mark.parametrize("H,Hkv", [(4, 2), (3, 3)])
def test_op_on_a_deep_tree_equals_the_dense_reference_both_plans(limit, H, Hkv, monkeypatch):
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", limit)
    b = _batch(_deep_paths(9, 3), 32)  # padded: the block-sparse plan's padding sees itself through the mask
    q, k, v = _qkv(b.seq_len, H, Hkv, 8, seed=H)
    se = b.subtree_end.clone()  # a tensor of its own: the per-batch plan is not the other parametrization's
    assert isinstance(vta._plan(se, q), vta.BlockSparsePlan if limit == 0 else vta.SegmentPlan)
    do = torch.randn(1, H, b.seq_len, 8, dtype=torch.float64)
    assert_same_as(lambda a, b_, c: tree_attention_varlen(a, b_, c, se, scale=0.4),
                   lambda a, b_, c: tree_attention_reference(a, b_, c, se, scale=0.4), q, k, v, do)
    torch.library.opcheck(torch.ops.treecompile.tree_attention_varlen_fwd.default,
                          (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(),
                           se, 0.4))


@pytest.mark.parametrize("H,Hkv,pad_to", [(4, 2, 48), (3, 3, None)])
def test_block_sparse_plan_in_heavy_first_order_equals_the_batch_order_and_the_reference(H, Hkv, pad_to,
                                                                                        monkeypatch):
    """Under BLOCK_SPARSE_LAYOUT = "heavy_first" the block-sparse plan runs a nested tree in its heaviest-child-first
    order: q, k, v permuted in, out, log-sum-exp and the gradients permuted back.  On a deep tree whose DFS order
    visits the light leaves first (a real permutation), the op's out, lse and q/k/v gradients equal those of the
    batch's order and the dense reference in float64; the plan's mask is the tree's in the new order, with fewer
    partial 16 x 16 tiles.  The plan follows the setting per batch tensor, and an unknown setting is refused."""
    from treecompile.ops import varlen_tree_attention as vta
    from treecompile.ops.flex_tree_attention import tree_block_mask
    from treecompile.ops.tree_layout import permuted_subtree_end

    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", 0.0)
    b = _batch(_deep_paths(10, 2), pad_to, order="lex")  # its DFS order visits the light leaves first
    T = b.seq_len
    q, k, v = _qkv(T, H, Hkv, 8, seed=H + T)
    do = torch.randn(1, H, T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    results, plans = {}, {}
    for layout in ("heavy_first", "dfs"):
        monkeypatch.setattr(vta, "BLOCK_SPARSE_LAYOUT", layout)
        se = b.subtree_end.clone()  # a tensor of its own: a plan per layout
        plans[layout] = plan = vta._plan(se, q)
        assert isinstance(plan, vta.BlockSparsePlan) and vta._plan(se, q) is plan
        out, lse, *_ = torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, se, 0.4)
        results[layout] = (out, lse)
        assert_same_as(lambda a, b_, c: tree_attention_varlen(a, b_, c, se, scale=0.4),
                       lambda a, b_, c: tree_attention_reference(a, b_, c, se, scale=0.4), q, k, v, do)
    heavy, dfs = plans["heavy_first"], plans["dfs"]
    assert dfs.order is None and heavy.order is not None
    perm = heavy.order[0]
    assert not torch.equal(perm, torch.arange(T)) and torch.equal(perm[heavy.order[1]], torch.arange(T))
    assert torch.equal(heavy.subtree_end, permuted_subtree_end(b.subtree_end, heavy.order))
    assert torch.equal(tree_mask(heavy.subtree_end), tree_mask(b.subtree_end)[perm][:, perm])
    for x, y in zip(results["heavy_first"], results["dfs"]):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    partial = {n: int(tree_block_mask(p.subtree_end, block_size=16).kv_num_blocks.sum()) for n, p in plans.items()}
    assert partial["heavy_first"] < partial["dfs"], partial
    monkeypatch.setattr(vta, "BLOCK_SPARSE_LAYOUT", "bfs")
    with pytest.raises(ValueError, match="BLOCK_SPARSE_LAYOUT: expected one of"):
        vta._plan(b.subtree_end.clone(), q)


def test_block_sparse_plan_keeps_the_batch_order_where_subtree_end_is_not_nested(monkeypatch):
    """A ``subtree_end`` within bounds but not nested (no tree to reorder) runs the block-sparse plan in the batch's
    order, under the mask ``k <= q < subtree_end[k]`` as the dense reference reads it."""
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", 0.0)
    monkeypatch.setattr(vta, "BLOCK_SPARSE_LAYOUT", "heavy_first")
    se = torch.tensor([3, 4, 4, 5, 6, 6])  # token 1's subtree [1, 4) leaves token 0's [0, 3)
    q, k, v = _qkv(6, 2, 1, 4, seed=7)
    plan = vta._plan(se, q)
    assert isinstance(plan, vta.BlockSparsePlan) and plan.order is None
    do = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    assert_same_as(lambda a, b_, c: tree_attention_varlen(a, b_, c, se, scale=0.5),
                   lambda a, b_, c: tree_attention_reference(a, b_, c, se, scale=0.5), q, k, v, do)


# ---------------------------------------------------------------------------- the lowering's option (CPU)
def test_lowering_fa4_varlen():
    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile.passes import lower_cuda as lc

    with pytest.raises(ValueError, match="attention_layout='heavy_first' with attention_kernel='fa4_varlen'"):
        lc.CudaOptions(attention_kernel="fa4_varlen", attention_layout="heavy_first")
    tm = cached_compile(cached_model("dense-tiny", tiny_dense))
    low = lc.lower_cuda(tm.graph_module, lc.CudaOptions(gdn_kernel="reference", attention_kernel="fa4_varlen"))
    calls = [n for n in low.graph_module.graph.nodes if n.target is lc._varlen]
    assert low.attention_varlen == len(calls) == 2 and low.attention == 0  # no block mask fed
    assert not any(n.target is lc._flex for n in low.graph_module.graph.nodes)
    # on CPU float64 inputs the kernel cannot run: refused at trace time, naming the reason
    q = torch.empty(1, 2, 8, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="attention_kernel='fa4_varlen': "):
        lc._varlen(q, q, q, torch.arange(1, 9), None, None)
    with pytest.raises(RuntimeError, match="attention_kernel='fa4_varlen': no GPU"):
        lc._varlen(q, q, q, torch.arange(1, 9), None, "no GPU")
    # boundary programs (redundancy-free partitions) attend through flex's Triton kernel
    assert lc._boundary_kernel("fa4_varlen") == "flex"
    with pytest.raises(ValueError, match="not a FlexAttention kernel"):
        lc.resolve_attention_kernel("fa4_varlen", q)


def test_auto_lowers_to_varlen_only_where_fa4_runs_both_plans(monkeypatch):
    """``attention_kernel="auto"``: the varlen op for a bf16 model of head dim 64 where FA4 runs and the layout is
    DFS; flex for every other case (no FA4, float64, heavy_first layout, head dim 256: no block-sparse tiles)."""
    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.passes import lower_cuda as lc

    programs = {}

    def lowered(head_dim, dtype, reason=None, layout="dfs", kernel="auto"):
        if (head_dim, dtype) not in programs:
            torch.manual_seed(0)
            cfg = DenseConfig.tiny(head_dim=head_dim, num_hidden_layers=1)
            programs[head_dim, dtype] = treecompile.compile(DenseForCausalLM(cfg).to(dtype))
        tm = programs[head_dim, dtype]
        monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q=None: reason)
        low = lc.lower_cuda(tm.graph_module, lc.CudaOptions(gdn_kernel="reference", attention_kernel=kernel,
                                                           attention_layout=layout), varlen=varlen)
        return low.attention_varlen, low.attention, low.attention_segments_only

    varlen = True
    assert lowered(64, torch.bfloat16) == (1, 0, 0)
    assert lowered(128, torch.float16) == (1, 0, 0)
    assert lowered(256, torch.bfloat16) == (1, 0, 1)  # the segments alone: a per-batch flex fallback
    assert lowered(64, torch.bfloat16, reason="no GPU") == (0, 1, 0)
    assert lowered(64, torch.float64) == (0, 1, 0)
    assert lowered(64, torch.bfloat16, layout="heavy_first") == (0, 1, 0)
    assert lowered(32, torch.bfloat16) == (0, 1, 0)  # a head dim neither measured nor block-sparse
    assert lowered(256, torch.bfloat16, kernel="fa4_varlen") == (1, 0, 0)  # explicit: no fallback, refusals name it
    assert lowered(64, torch.bfloat16, kernel="fa4") == (0, 1, 0)
    varlen = False  # the fallback lowering: flex everywhere under "auto"
    assert lowered(256, torch.bfloat16) == lowered(64, torch.bfloat16) == (0, 1, 0)
    # the traced call names the option asked for when the real inputs cannot run
    q = torch.empty(1, 2, 8, 64, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="attention_kernel='auto': FA4's varlen kernel takes"):
        lc._varlen(q, q, q, torch.arange(1, 9), None, None, "auto")


def test_auto_runs_batches_the_segments_cannot_take_through_the_flex_lowering(monkeypatch):
    """The per-batch choice of ``TreeProgram._run_cuda`` when "auto" put a head dim on the segments alone: a wide
    forest runs the varlen lowering, a comb (a leaf off every spine token: the segments gather ~T^2/2 key rows)
    the flex lowering, with one warning.  The two lowerings are real (CPU, reference kernels); their runners
    report which one ran."""
    import dataclasses
    import warnings

    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile.ops import varlen_tree_attention as vta
    from treecompile.passes import lower_cuda as lc
    from treecompile.program import _CudaState

    prog = cached_compile(cached_model("dense-tiny", tiny_dense)).program
    monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q=None: None)
    monkeypatch.setattr(lc, "HALF", lc.HALF + (torch.float64,))  # the tiny float64 model as a half one
    monkeypatch.setattr(lc, "AUTO_SEGMENTS_HEAD_DIMS", (8,))  # its head dim as one with the segments alone
    options = lc.CudaOptions(compile_cuda=False, bucket=False, gdn_kernel="reference")
    entries = []  # the intra-op threads at each graph entry: the caller's, not the host work's one (dynamo guards it)
    for varlen, name in ((True, "varlen"), (False, "flex")):
        low = lc.lower_cuda(prog.graph_module, options, varlen=varlen)
        assert (low.attention_segments_only > 0) == varlen and (low.attention > 0) != varlen
        state = _CudaState(low, lambda *args, name=name: (entries.append(torch.get_num_threads()) or name,))
        monkeypatch.setattr(prog, "_cuda" if varlen else "_cuda_flex", state)
    forest = Tree.from_paths([[t % 97 for t in p] for p in forest_paths(60, 2, seed=4)]).to_batch()
    spine = list(range(1, 41))
    comb = Tree.from_paths([spine[:i] + [50 + i] for i in range(1, 41)]).to_batch()  # 40 segments, G ~ 900 rows
    monkeypatch.setattr(vta, "MAX_GATHER_ROWS", 0)
    monkeypatch.setattr(vta, "MAX_GATHER_FACTOR", 4)
    assert vta.segments_fit(forest.subtree_end) and not vta.segments_fit(comb.subtree_end)
    monkeypatch.setattr(lc, "_WARNED", set())
    from treecompile.host_values import _openmp

    threads = torch.get_num_threads()
    if _openmp():  # the host work before the graph runs on one thread: the graph entry must see the caller's two
        torch.set_num_threads(2)
    caller = torch.get_num_threads()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert prog._run_cuda(forest, []) == ("varlen",)
            assert prog._run_cuda(comb, []) == ("flex",)
            assert prog._run_cuda(comb, []) == ("flex",)
            assert prog._run_cuda(forest, []) == ("varlen",)
    finally:
        torch.set_num_threads(threads)
    assert entries == [caller] * 4
    assert len([w for w in caught if "runs tree attention through flex" in str(w.message)]) == 1  # once


def _lower_fa4_varlen(prog, monkeypatch, **options):
    """``prog``'s graph lowered under ``attention_kernel="fa4_varlen"`` (and ``options``) as where FA4 runs, for the
    CPU (eager, the ops' reference kernels)."""
    from treecompile.passes import lower_cuda as lc

    monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q=None: None)  # the setup probe: as where FA4 runs
    monkeypatch.setattr(lc, "varlen_input_reason", lambda q: None)
    low = lc.lower_cuda(prog.graph_module, lc.CudaOptions(compile_cuda=False, gdn_kernel="reference",
                                                          attention_kernel="fa4_varlen", **options))
    return low


def _lowered_test_batch():
    """A padded forest of two paths of up to 60 tokens (cut by any window under that)."""
    return Tree.from_paths([[t % 97 for t in p] for p in forest_paths(60, 2, seed=4)]).to_batch(pad_to_multiple=16)


def _assert_lowered_equals_rewritten(prog, low, graph=None):
    """Loss, log-probs and every gradient of the lowered graph (``graph``: the lowering's module compiled, say) as the
    rewritten graph's, float64, on :func:`_lowered_test_batch`."""
    from helpers import run_program_graph

    batch = _lowered_test_batch()
    l1, lp1, g1 = run_program_graph(prog, low.graph_module if graph is None else graph, batch, None)  # no block mask
    l0, lp0, g0 = run_program_graph(prog, prog.graph_module, batch)
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=0)
    torch.testing.assert_close(lp1, lp0, rtol=1e-12, atol=1e-12)
    assert len(g0) == len(g1) > 0
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_lowered_model_with_varlen_attention_equals_the_rewritten_graph(monkeypatch):
    """The lowering's wiring (arguments, scale, the unused block-mask input) on CPU in float64: the input check
    let through, the op runs its reference kernel; loss, log-probs and every gradient as the rewritten graph's."""
    from helpers import cached_compile, cached_model, tiny_dense

    prog = cached_compile(cached_model("dense-tiny", tiny_dense)).program
    low = _lower_fa4_varlen(prog, monkeypatch)
    assert low.attention_varlen == 2
    _assert_lowered_equals_rewritten(prog, low)


def test_split_program_with_varlen_attention_equals_the_rewritten_graph(monkeypatch):
    """``split_at`` (each layer through its module's ``__call__``: FSDP2, activation checkpointing) over the varlen
    lowering, the default on Hopper: the block-mask input unused, each layer's op reads ``subtree_end``; CPU,
    float64, reference kernels; loss, log-probs and every gradient as the rewritten graph's."""
    from helpers import cached_compile, cached_model, run_program_graph, tiny_dense
    from treecompile.passes import lower_cuda as lc

    model = cached_model("dense-tiny", tiny_dense)
    prog = cached_compile(model).split_at(model.model.layers).program
    monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q=None: None)
    monkeypatch.setattr(lc, "varlen_input_reason", lambda q: None)
    low = lc.lower_cuda(prog.graph_module, lc.CudaOptions(compile_cuda=False, gdn_kernel="reference",
                                                          attention_kernel="fa4_varlen"))
    split = prog.split_graph(low.graph_module)
    assert [s.owner for s, _ in split.segments] == [None, "model.layers.0", "model.layers.1", None]
    batch = _lowered_test_batch()
    values = [prog.lifted_value(x) for x in prog.lifted]
    out = prog._run_segments(split, prog.batch_args(batch) + lc.attention_inputs(batch.subtree_end, low))
    g1 = torch.autograd.grad(out[0], [v for v in values if v.requires_grad])
    l0, lp0, g0 = run_program_graph(prog, prog.graph_module, batch)
    torch.testing.assert_close(out[0].detach(), l0, rtol=1e-12, atol=0)
    torch.testing.assert_close(out[1].detach(), lp0, rtol=1e-12, atol=1e-12)
    assert len(g0) == len(g1) > 0
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- GPU
def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from treecompile.ops import fa4_tree_attention as fa4

    return fa4.fa4_unusable_reason()


CASES = [(63, 1, 128, 4, 2, 128), (1000, 3, 1024, 4, 2, 128), (2900, 1, 3072, 16, 8, 128), (1500, 2, 1536, 4, 4, 64),
         (700, 1, None, 4, 2, 128), (900, 2, None, 8, 2, 256)]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("T,roots,pad_to,H,Hkv,D", CASES,
                         ids=[f"T{c[0]}_r{c[1]}_pad{c[2]}_H{c[3]}kv{c[4]}_D{c[5]}" for c in CASES])
@pytest.mark.parametrize("limit,layout", [(float("inf"), "dfs"), (0.0, "dfs"), (0.0, "heavy_first")],
                         ids=["segments", "block_sparse", "block_sparse_heavy_first"])
def test_fa4_varlen_vs_fp64_oracle(T, roots, pad_to, H, Hkv, D, limit, layout, monkeypatch):
    """Both plans of the op on the same trees (the gather limit forced each way), the block-sparse one in either
    order (BLOCK_SPARSE_LAYOUT: FA4's kernels on permuted q/k/v); head dim 256 has no block-sparse tiles and keeps
    the segments."""
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", limit)
    monkeypatch.setattr(vta, "BLOCK_SPARSE_LAYOUT", layout)
    kinds = []

    def attend(b, scale):
        plan = vta._plan(b.subtree_end, torch.empty(1, H, 1, D, device="cuda", dtype=torch.bfloat16))
        kinds.append((type(plan), getattr(plan, "order", None) is not None))
        return lambda q, k, v: tree_attention_varlen(q, k, v, b.subtree_end, scale=scale)

    assert_bf16_tree_kernel_near_oracle(attend, T, roots, pad_to, H, Hkv, D)
    sparse = limit == 0 and D != 256
    assert kinds == [(vta.BlockSparsePlan, layout == "heavy_first") if sparse else (vta.SegmentPlan, False)]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_compiled_model_with_fa4_varlen_matches_flex():
    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM

    torch.manual_seed(0)
    cfg = DenseConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    from treecompile.ops import varlen_tree_attention as vta

    model = DenseForCausalLM(cfg).cuda().to(torch.bfloat16)
    tms = {kernel: treecompile.compile(model, attention_kernel=kernel) for kernel in ("flex", "fa4_varlen", "auto")}
    # a wide forest (the segments) and a deep tree of short nodes (the block-sparse plan), one compiled program
    for paths, kind in ((forest_paths(900, 2, seed=5), vta.SegmentPlan), (_deep_paths(60, 3), vta.BlockSparsePlan)):
        b = Tree.from_paths([[t % cfg.vocab_size for t in p] for p in paths]).to_batch(device="cuda")
        assert isinstance(vta.tree_attention_plan(b.subtree_end, block_sparse=True), kind)
        runs = {}
        for kernel, tm in tms.items():
            model.zero_grad()
            out = tm(b)
            out.loss.backward()
            runs[kernel] = (out.loss.detach().float(),
                            torch.cat([p.grad.flatten().float() for p in model.parameters()]))
        (l1, g1) = runs["flex"]
        for kernel in ("fa4_varlen", "auto"):
            l2, g2 = runs[kernel]
            assert abs(float(l1 - l2)) <= 1e-2 * abs(float(l1)), (kind, kernel)
            assert float(torch.nn.functional.cosine_similarity(g1, g2, 0)) > 0.999, (kind, kernel)
    # "auto" took the varlen op here (bf16, head dim 128, FA4 on sm_90+), "flex" did not
    assert tms["auto"].program._cuda.lowering.attention_varlen == cfg.num_hidden_layers
    assert tms["flex"].program._cuda.lowering.attention_varlen == 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_deterministic_mode_runs_a_deep_tree_on_its_segments_bit_for_bit(monkeypatch):
    """A deep tree the op runs block-sparse (FA4's atomic backward) runs its segments under
    ``torch.use_deterministic_algorithms(True)``: two compiled steps give the same loss and gradients bit for bit,
    and their gradients match the default mode's block-sparse run to the bar of the flex comparison above.
    (Passed on an H200 in session 45, ``benchmarks/results/h200_s45/cg45_test_first.txt``.)"""
    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(0)
    cfg = DenseConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = DenseForCausalLM(cfg).cuda().to(torch.bfloat16)
    batch = Tree.from_paths([[t % cfg.vocab_size for t in p] for p in _deep_paths(60, 3)]).to_batch(device="cuda")
    assert isinstance(vta.tree_attention_plan(batch.subtree_end, block_sparse=True), vta.BlockSparsePlan)
    tm = treecompile.compile(model)

    def step():
        model.zero_grad()
        out = tm(batch)
        out.loss.backward()
        return [out.loss.detach().float()] + [p.grad.flatten().float() for p in model.parameters()]

    default = step()
    with deterministic_algorithms(True):
        runs = [step(), step()]
        q = torch.empty(1, cfg.num_attention_heads, 1, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        assert isinstance(vta._plan(batch.subtree_end, q), vta.SegmentPlan)
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    assert abs(float(runs[0][0] - default[0])) <= 1e-2 * abs(float(default[0]))
    g, g0 = torch.cat(runs[0][1:]), torch.cat(default[1:])
    assert float(torch.nn.functional.cosine_similarity(g, g0, 0)) > 0.999


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_cudagraphs_contender_replays_without_stale_host_work():
    """The harness's ``tree_cudagraphs`` setting (inductor's CUDA graphs, partitioned at every treecompile op): two
    trees of the same length and different shapes, alternated over three steps each, give what the plain compiled
    model gives (loss to 1e-2, log-probs and gradients to cosine 0.999, the bar of the flex comparison above; a
    replay with the other tree's plans would miss it), so do steps that accumulate both trees' gradients, and
    inductor skipped no graph and captured some.  (Session 45's first run found torch 2.11's inductor handing a
    partition an op's whole output tuple: ``harness._partition_outputs_with_their_op``.)"""
    import treecompile
    from benchmarks import harness
    from torch._dynamo.utils import counters
    from treecompile.models import DenseConfig, DenseForCausalLM

    torch.manual_seed(0)
    cfg = DenseConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = DenseForCausalLM(cfg).cuda().to(torch.bfloat16)
    r = lambda a, b: list(range(a, b))  # noqa: E731
    trees = [Tree.from_paths([r(0, 100), r(0, 50) + r(100, 150)]),  # 150 tokens each, different branch points
             Tree.from_paths([r(0, 60), r(0, 20) + r(60, 100), r(0, 10) + r(100, 150)])]
    batches = [t.to_batch(device="cuda") for t in trees]
    assert batches[0].seq_len == batches[1].seq_len

    def run(tm, batch):
        model.zero_grad()
        out = tm(batch)
        out.loss.backward()
        return (out.loss.detach().float().clone(), out.logprobs.detach().float().clone(),
                torch.cat([p.grad.flatten().float() for p in model.parameters()]))

    def accumulate(tm):  # one step of two micro-batches: the second backward adds into the first's .grad
        model.zero_grad()
        for b in batches:
            tm(b).loss.backward()
        return torch.cat([p.grad.flatten().float() for p in model.parameters()])

    def close(got, want, step):
        assert abs(float(got[0] - want[0])) <= 1e-2 * abs(float(want[0])), step
        for x, y in zip(got[1:], want[1:]):
            assert float(torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), 0)) > 0.999, step

    plain, graphed = treecompile.compile(model), treecompile.compile(model)
    counters["inductor"].clear()
    for step in range(6):
        b = batches[step % 2]
        close(harness._with_cudagraphs(lambda: run(graphed, b))(), run(plain, b), step)
    # gradient accumulation: a replay's gradient outputs become .grad, which the next micro-batch adds into
    for step in range(2):
        want = accumulate(plain)
        got = harness._with_cudagraphs(lambda: accumulate(graphed))()
        assert float(torch.nn.functional.cosine_similarity(got, want, 0)) > 0.999, f"accumulated, step {step}"
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    # and graphs were captured: a run that partitioned everything out would pass the checks above vacuously
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
    assert manager is not None and manager.new_graph_id().id > 0


# ---------------------------------------------------------------------------- the tile cost model's varlen rows
@pytest.mark.parametrize("name", ["forest", "one_token_nodes", "prefix_of_other", "single_path"])
def test_varlen_tile_counts_equal_brute_force(name, monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # its own imports
    from benchmarks.tile_cost_model import varlen_tiles

    paths = forest_paths(90, 3, seed=2) if name == "forest" else ODD_TREES[name]
    plan = segment_plan(_batch(paths).subtree_end)
    blk = 4
    computed = partial = 0
    cq, ck = plan.cu_seqlens_q_host, plan.cu_seqlens_k_host
    for j in range(plan.segments):
        n, m = cq[j + 1] - cq[j], ck[j + 1] - ck[j]
        nq, nk = -(-n // blk), -(-m // blk)
        vis = torch.zeros(nq * blk, nk * blk, dtype=torch.bool)  # padded to whole tiles: padding never visible
        vis[:n, :m] = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
        tiles = vis.view(nq, blk, nk, blk)
        any_, all_ = tiles.any(3).any(1), tiles.all(3).all(1)
        computed += int(any_.sum())
        partial += int((any_ & ~all_).sum())
    assert varlen_tiles(plan, block=blk) == (computed, partial)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_auto_at_head_dim_256_runs_segments_and_falls_back_per_batch(monkeypatch):
    """Head dim 256 (the Qwen3.5 hybrids' attention) under "auto": the varlen op's segments; a batch whose segments
    would gather past the bound (forced here by a bound of 0) runs the flex lowering, compiled beside it.  Both
    against flex alone: loss within 1 % and gradient cosine > 0.999 (the bf16 kernels' difference)."""
    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.ops import varlen_tree_attention as vta

    torch.manual_seed(0)
    cfg = DenseConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=256)
    model = DenseForCausalLM(cfg).cuda().to(torch.bfloat16)
    tms = {kernel: treecompile.compile(model, attention_kernel=kernel) for kernel in ("flex", "auto")}
    tree = Tree.from_paths([[t % cfg.vocab_size for t in p] for p in forest_paths(900, 2, seed=5)])

    def run(tm):
        # a new batch each run: a program keeps a batch's inputs, its lowering's choice among them, per batch
        # tensors, so the bound forced below would not reach a batch it has run (session 45's GPU run, which
        # reused one batch, found the flex lowering never made)
        model.zero_grad()
        out = tm(tree.to_batch(device="cuda"))
        out.loss.backward()
        return out.loss.detach().float(), torch.cat([p.grad.flatten().float() for p in model.parameters()])

    l1, g1 = run(tms["flex"])
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(vta, "MAX_GATHER_FACTOR", 0)
            monkeypatch.setattr(vta, "MAX_GATHER_ROWS", 0)
        l2, g2 = run(tms["auto"])
        assert abs(float(l1 - l2)) <= 1e-2 * abs(float(l1)), forced
        assert float(torch.nn.functional.cosine_similarity(g1, g2, 0)) > 0.999, forced
        prog = tms["auto"].program
        assert prog._cuda.lowering.attention_segments_only == cfg.num_hidden_layers
        assert (prog._cuda_flex is not None) == forced  # the flex lowering made only when a batch needed it


@pytest.mark.parametrize("pad_to,H,Hkv", [(None, 4, 2), (16, 4, 2), (16, 6, 3), (64, 2, 1)])
def test_op_lse_is_every_querys_log_sum_exp(pad_to, H, Hkv):
    """The forward's second result (what the backward reads): each query's log-sum-exp over the keys it sees,
    the tail's (tokens that see only themselves: their one score) included, written in place around the kernel's
    rows."""
    b = _batch(ODD_TREES["one_token_nodes"], pad_to)
    T, D = b.seq_len, 8
    q, k, v = (x.detach() for x in _qkv(T, H, Hkv, D, seed=T + H))
    out, lse, *_ = torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, b.subtree_end, 0.3)
    kk = k.repeat_interleave(H // Hkv, 1)
    s = (q @ kk.transpose(-1, -2))[0] * 0.3  # [H, T, T]
    want = torch.logsumexp(s.masked_fill(~tree_mask(b.subtree_end), float("-inf")), -1)
    assert lse.shape == (H, T) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, want.float(), rtol=1e-6, atol=1e-6)
    ref = tree_attention_reference(q, k, v, b.subtree_end, scale=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- a sliding window along each path
def window_plan_mask(plan, T: int) -> torch.Tensor:
    """:func:`plan_mask` under the plan's window: segment j's query i sees its keys ``(prefix + i - W, prefix + i]``."""
    m = plan_mask(plan, T)
    cq, ck = plan.cu_seqlens_q_host, plan.cu_seqlens_k_host
    idx = plan.key_index.cpu()
    for j in range(plan.segments):
        n, keys = cq[j + 1] - cq[j], idx[ck[j]:ck[j + 1]]
        for i in range(n):
            m[cq[j] + i, keys[:max(keys.numel() - n + i + 1 - plan.window, 0)]] = False
    return m


@settings(max_examples=60, deadline=None)
@given(path_sets(max_paths=8, max_len=12), st.integers(1, 14), st.sampled_from([None, 8, 13]))
def test_windowed_plan_is_the_window_mask_hypothesis(paths, window, pad_to):
    """The windowed segments (each prefix cut to its last ``window - 1`` rows, the kernel's own window over the
    rest) expand to exactly the dense ``tree_window_mask``; the gather is at most ``T + segments * (W - 1)``."""
    from treecompile.ops.tree_attention import tree_window_mask
    from treecompile.ops.varlen_tree_attention import windowed_plan

    b = _batch(paths, pad_to)
    se = b.subtree_end.clone()
    plan = windowed_plan(se, b.position_ids, window)
    assert torch.equal(window_plan_mask(plan, b.seq_len), tree_window_mask(se, b.position_ids, window))
    assert plan.gathered <= plan.tail + plan.segments * (window - 1)
    assert plan.gathered <= segment_plan(se).gathered


@pytest.mark.parametrize("paths_name,window,limit", [("one_token_nodes", 2, float("inf")),
                                                     ("deep", 5, float("inf")), ("deep", 40, float("inf")),
                                                     ("deep", 5, 0.0), ("forest", 7, float("inf"))],
                         ids=["short", "deep_w5", "deep_w40", "deep_w5_block_mask", "forest"])
@pytest.mark.parametrize("H,Hkv", [(4, 2), (3, 3)])
def test_windowed_op_equals_the_dense_reference_float64(paths_name, window, limit, H, Hkv, monkeypatch):
    """Out and q/k/v gradients of the windowed op against the dense window mask, float64; ``limit`` 0: every batch
    runs the window block mask inside the op (the dense reference off CUDA), forward and recomputed backward."""
    from treecompile.ops import varlen_tree_attention as vta
    from treecompile.ops.tree_attention import tree_attention_windowed_reference

    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", limit)
    paths = {"deep": _deep_paths(levels=12), "forest": forest_paths(200, 3, seed=1)}.get(paths_name)
    b = _batch(paths or ODD_TREES[paths_name], 16)
    se, pos = b.subtree_end.clone(), b.position_ids
    assert (vta.windowed_plan(se, pos, window) is None) == (limit == 0.0)
    q, k, v = _qkv(b.seq_len, H, Hkv, 8, seed=H)
    do = torch.randn(1, H, b.seq_len, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert_same_as(lambda a, b_, c: vta.tree_attention_varlen_windowed(a, b_, c, se, pos, window, 0.3),
                   lambda a, b_, c: tree_attention_windowed_reference(a, b_, c, se, pos, window, 0.3), q, k, v, do)


def test_windowed_op_opcheck_and_aot_autograd():
    from treecompile.ops.tree_attention import tree_attention_windowed_reference
    from treecompile.ops.varlen_tree_attention import tree_attention_varlen_windowed

    b = _batch(forest_paths(60, 2, seed=3), 8)
    q, k, v = (x.detach() for x in _qkv(b.seq_len, 4, 2, 8, seed=0))
    torch.library.opcheck(torch.ops.treecompile.tree_attention_varlen_windowed_fwd.default,
                          (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), b.subtree_end,
                           b.position_ids, 6, 0.35))
    assert_traced_same_as(lambda *a: tree_attention_varlen_windowed(*a, 6),
                          lambda *a: tree_attention_windowed_reference(*a, 6), q, k, v, b.subtree_end, b.position_ids)


def test_windowed_plan_refuses_what_its_rows_cannot_count():
    """Positions that are not the depths (the window counts positions, the segments rows), a non-nested
    ``subtree_end``, a bad window: each refused naming the token or the value; a plan per window is kept."""
    from treecompile.ops import varlen_tree_attention as vta

    b = _batch([[1, 2, 3, 4], [1, 2, 5]])
    se, pos = b.subtree_end, b.position_ids
    gapped = pos.clone()
    gapped[..., 2:] += 3  # token 2 jumps from position 1 to 5
    with pytest.raises(ValueError, match=r"not the depths .* token 2 \(position 5\) follows token 1 \(position 1\)"):
        vta.windowed_plan(se, gapped, 8)
    # a branch whose first token repeats its parent's position: under a window of 1 the segment keeps no row above
    # itself, yet the dense mask lets it see its parent (distance 0)
    fork = _batch([list(range(1, 13)), list(range(1, 11)) + [50, 51]])  # the branch starts at token 12, depth 10
    se_fork, pos_fork = fork.subtree_end, fork.position_ids.clone()
    pos_fork[..., 12:] -= 1
    with pytest.raises(ValueError, match=r"token 12 \(position 9\) follows token 9 \(position 9\)"):
        vta.windowed_plan(se_fork, pos_fork, 1)
    with pytest.raises(ValueError, match=r"not the DFS layout of a forest at token 1"):
        vta.windowed_plan(torch.tensor([2, 4, 4, 4]), torch.arange(4), 3)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window: expected a positive number of tokens"):
            vta.windowed_plan(se, pos, bad)
    with pytest.raises(ValueError, match="position_ids: expected 5 entries"):
        vta.windowed_plan(se, pos[..., :3], 4)
    p4 = vta._window_plan(se, pos, 4)
    p2 = vta._window_plan(se, pos, 2)
    assert vta._window_plan(se, pos, 4) is p4 and vta._window_plan(se, pos, 2) is p2 and p2.window == 2


WINDOW_CASES = [(2900, 1, 3072, 16, 8, 128, 512), (1000, 3, 1024, 4, 2, 128, 64), (1500, 2, None, 4, 4, 64, 100),
                (900, 2, None, 8, 2, 256, 300)]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("T,roots,pad_to,H,Hkv,D,W", WINDOW_CASES,
                         ids=[f"T{c[0]}_r{c[1]}_pad{c[2]}_H{c[3]}kv{c[4]}_D{c[5]}_W{c[6]}" for c in WINDOW_CASES])
@pytest.mark.parametrize("limit", [float("inf"), 0.0], ids=["segments", "block_mask"])
def test_fa4_varlen_windowed_vs_fp64_oracle(T, roots, pad_to, H, Hkv, D, W, limit, monkeypatch):
    """FA4's varlen kernel with its own window over the windowed segments (and, limit 0, the window block mask
    the op falls back to): bf16 output and q/k/v gradients within 2x the bf16 dense kernel's error against a
    float64 oracle under the dense window mask."""
    from tests.test_flex_tree_attention import dense_sdpa, rel_err
    from treecompile.ops import varlen_tree_attention as vta
    from treecompile.ops.tree_attention import tree_window_mask

    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", limit)
    b = Tree.from_paths(forest_paths(T, roots, seed=T + D)).to_batch(pad_to_multiple=pad_to, device="cuda")
    L, scale = b.seq_len, D ** -0.5
    dense = tree_window_mask(b.subtree_end, b.position_ids, W)
    assert (vta._window_plan(b.subtree_end, b.position_ids, W) is None) == (limit == 0.0)
    g = torch.Generator(device="cuda").manual_seed(T)
    q, k, v = (torch.randn(1, L, h, D, device="cuda", generator=g).transpose(1, 2) for h in (H, Hkv, Hkv))
    do = torch.randn(1, H, L, D, device="cuda", generator=g)
    oracle = out_and_grads(lambda a, b_, c: dense_sdpa(a, b_, c, dense, scale), q, k, v, do, torch.float64)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = out_and_grads(lambda a, b_, c: dense_sdpa(a, b_, c, dense, scale), q, k, v, do, torch.bfloat16)
    got = out_and_grads(lambda a, b_, c: vta.tree_attention_varlen_windowed(a, b_, c, b.subtree_end, b.position_ids,
                                                                            W, scale), q, k, v, do, torch.bfloat16)
    u = torch.finfo(torch.bfloat16).eps / 2
    for name, f, r, o in zip(("out", "dq", "dk", "dv"), got, ref, oracle):
        assert torch.isfinite(f).all(), name
        ef, er = rel_err(f, o), rel_err(r, o)
        assert ef <= 2 * er + u, f"{name}: windowed kernel error {ef:.3g} > 2 * dense bf16 error {er:.3g} + {u:.1g}"


def test_lowered_sliding_model_with_windowed_varlen_equals_the_rewritten_graph(monkeypatch):
    """Gemma 3's sliding layers (W = 5) and its causal ones under ``attention_kernel="fa4_varlen"``: the windowed
    varlen op's wiring (q, k, v, the batch's subtree_end and depths, the window, the scale) on CPU in float64,
    the ops' reference kernels; loss, log-probs and every gradient as the rewritten graph's on a tree whose paths
    the window cuts."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma3ForCausalLM"):
        pytest.skip("transformers has no Gemma3ForCausalLM")
    import treecompile

    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5,
                                        layer_types=["sliding_attention", "full_attention"],
                                        max_position_embeddings=256)
    prog = treecompile.compile(transformers.Gemma3ForCausalLM(cfg).double()).program
    low = _lower_fa4_varlen(prog, monkeypatch)
    assert (low.attention_varlen, low.windowed_varlen, low.windows) == (1, 1, ())
    _assert_lowered_equals_rewritten(prog, low)


def test_copy_sums_fall_back_to_the_first_config_when_autotuning_fails(monkeypatch):
    """Where the autotuner cannot run (its timing buffers on a full device, a config that cannot launch) the sums
    warn once and run :data:`key_copies.CONFIGS`'s first config from then on; other errors are not swallowed."""
    failed = []
    monkeypatch.setattr(key_copies, "_TUNING_FAILED", failed)

    def oom(*args):
        raise torch.OutOfMemoryError("CUDA out of memory (the timing's cache buffer)")

    monkeypatch.setattr(key_copies, "_launch_tuned", oom)
    with pytest.warns(UserWarning, match=r"could not be autotuned .*first config \(128, False, 4\)"):
        assert key_copies._tuned(None, None, None, 0, None) is False
    assert len(failed) == 1 and "out of memory" in failed[0]

    def bug(*args):
        raise TypeError("a bug")

    monkeypatch.setattr(key_copies, "_launch_tuned", bug)
    with pytest.raises(TypeError, match="a bug"):
        key_copies._tuned(None, None, None, 0, None)


def _plan_pairs(key_index, cu_q, cu_k, tail, T):
    """The (query, key) pairs a segment plan attends, with their multiplicity (FA4's causal mask aligned
    bottom-right within each segment; the tail's tokens see themselves)."""
    from collections import Counter

    pairs = Counter()
    for s in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[s], cu_q[s + 1], cu_k[s], cu_k[s + 1]))
        nq, nk = q1 - q0, k1 - k0
        for i in range(nq):
            for r in range(nk - nq + i + 1):
                pairs[(q0 + i, int(key_index[k0 + r]))] += 1
    for t in range(tail, T):
        pairs[(t, t)] += 1
    return pairs


def _random_plan_check_args(seed: int, branches: int, new_tokens: int):
    """(a seeded ``random.Random``, the arguments ``_check_plan`` gets for the segment plan of a random tree of up
    to ``branches`` branches, each adding up to ``new_tokens`` tokens)."""
    import random

    from treecompile.ops import varlen_tree_attention as V

    rng = random.Random(seed)
    paths = [[1, 2, 3]]
    for _ in range(rng.randint(2, branches)):
        base = rng.choice(paths)
        paths.append(base[:rng.randint(1, len(base))] + [rng.randint(1, 30) for _ in range(rng.randint(1, new_tokens))])
    se = Tree.from_paths(paths).to_batch().subtree_end
    seen, real = [], V._check_plan
    V._check_plan = lambda *a: (seen.append(a), real(*a))
    try:
        V.tree_attention_plan(se.clone(), block_sparse=False)
    finally:
        V._check_plan = real
    return rng, seen[-1]


@pytest.mark.parametrize("seed", range(12))
def test_plan_check_refuses_exactly_the_plans_that_are_not_the_mask(seed):
    """``_check_plan`` (per interval, O(T + intervals)) passes a plan iff it attends each pair of the tree mask once
    and nothing else: checked against the plan's pairs counted one by one, on real plans of random trees and on
    corrupted ones (an interval moved by a token, two swapped, a repeated key, another tree's subtree ends)."""
    from treecompile.ops import varlen_tree_attention as V

    rng, (se0, lo, hi, first, G, cu_q, cu_k, tail, _) = _random_plan_check_args(seed, 9, 5)
    real = V._check_plan
    T = se0.numel()

    def verdict(se_, lo_, hi_):
        n = hi_ - lo_
        ki = torch.cat([torch.arange(int(a), int(b)) for a, b in zip(lo_, hi_)]) if n.numel() else lo_[:0]
        want = {(q, k): 1 for k in range(T) for q in range(k, int(se_[k]))}
        ok = _plan_pairs(ki, cu_q, cu_k, tail, T) == want
        try:
            real(se_, lo_, hi_, torch.cumsum(n, 0) - n, ki.numel(), cu_q, cu_k, tail)
            return ok, True
        except ValueError:
            return ok, False

    assert verdict(se0, lo, hi) == (True, True)
    m = len(lo)
    refused = 0
    for trial in range(30):
        lo_, hi_, se_ = lo.clone(), hi.clone(), se0.clone()
        kind = trial % 4
        j = rng.randrange(m)
        if kind == 0 and hi_[j] > lo_[j]:  # moved by one token (in range)
            d = rng.choice([-1, 1])
            if 0 <= lo_[j] + d and hi_[j] + d <= T:
                lo_[j] += d
                hi_[j] += d
        elif kind == 1 and m > 1:  # two intervals of one length swapped in place
            k = rng.randrange(m)
            if hi_[j] - lo_[j] == hi_[k] - lo_[k]:
                lo_[j], lo_[k], hi_[j], hi_[k] = lo_[k].clone(), lo_[j].clone(), hi_[k].clone(), hi_[j].clone()
        elif kind == 2 and hi_[j] - lo_[j] >= 2:  # a key repeated: the interval's last row reads its first again
            k = rng.randrange(m)
            lo_[k], hi_[k] = lo_[j].clone(), lo_[j] + (hi_[k] - lo_[k])
            if hi_[k] > T:
                continue
        else:  # the plan of this tree checked against other subtree ends
            t = rng.randrange(T)
            se_[t] = rng.randint(t + 1, T)
        ok, passed = verdict(se_, lo_, hi_)
        assert passed == ok, (seed, trial, kind)
        refused += not passed
    assert refused  # the corruptions reached the check


@pytest.mark.parametrize("seed", range(8))
def test_counts_plus_key_are_the_brute_force_ones(seed):
    """``_count_plus_key`` (the plan check's count of queries per key, read off running sums of the ranges'
    changes) equals the sum over the intervals written out key by key: random prefix and own ranges (empty ones,
    ranges ending at the last token, one token), any tail; ``_first_count_off`` (the counts compared at the ends of
    the pieces where both sides are lines) names exactly the one key changed in the subtree ends, or none."""
    import random

    from treecompile.ops import varlen_tree_attention as V

    rng = random.Random(seed)
    for _ in range(20):
        T = rng.randint(1, 40)
        m = rng.randint(0, 8)
        lo, ko, hi, nq, c = [], [], [], [], []
        for _ in range(m):
            a = rng.randint(0, T)
            b = rng.randint(a, T)
            e = rng.randint(b, T)
            lo.append(a), ko.append(b), hi.append(e), nq.append(rng.randint(0, 9)), c.append(rng.randint(-5, 60))
        tail = rng.randint(0, T)
        want = list(range(T))
        for a, b, e, q, cc in zip(lo, ko, hi, nq, c):
            for k in range(a, b):
                want[k] += q
            for k in range(b, e):
                want[k] += cc - k
        for k in range(tail, T):
            want[k] += 1
        L = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        got = V._count_plus_key(torch.arange(T), L(lo), L(ko), L(hi), L(nq), L(c), tail)
        assert got.tolist() == want, (T, lo, ko, hi, nq, c, tail)
        # against subtree ends that agree with the counts but at one key (or at none): that key is the first off
        for k in [None] + [rng.randrange(T) for _ in range(3)]:
            se = list(want)
            if k is not None:
                se[k] += rng.choice([-1, 1, 7])
            run_se, run_end, _ = V._runs(L(se))
            assert V._first_count_off(T, L(lo), L(ko), L(hi), L(nq), L(c), tail, run_se, run_end) == k


@pytest.mark.parametrize("seed", range(6))
def test_interval_minimum_is_the_brute_force_one(seed):
    """``_interval_min`` (the plan check's smallest subtree end per key interval, a range minimum over the runs of
    equal subtree ends) equals ``min(se[lo:hi])``: on a real plan's intervals, and on random values (any order,
    long and one-token runs, 1-70 runs) with random intervals (one key, whole sequence, inside one run, across
    runs)."""
    import random

    from treecompile.ops import varlen_tree_attention as V

    _, (se0, lo, hi, *_rest) = _random_plan_check_args(seed, 12, 6)

    def check(se_, lo_, hi_):
        run_se, run_end, _ = V._runs(se_)
        want = [int(se_[a:b].min()) for a, b in zip(lo_.tolist(), hi_.tolist())]
        assert V._interval_min(run_se, run_end, lo_, hi_).tolist() == want, (se_.tolist(), lo_, hi_)

    keep = hi > lo
    check(se0, lo[keep], hi[keep])
    rng = random.Random(seed)
    for _ in range(40):
        runs = rng.randint(1, 70)
        se_ = torch.tensor([v for _ in range(runs) for v in [rng.randint(0, 50)] * rng.choice([1, 1, 2, 5, 17])])
        T = se_.numel()
        pairs = [(0, T), (T - 1, T)] + [sorted(rng.sample(range(T + 1), 2)) for _ in range(25) if T > 1]
        lo_, hi_ = torch.tensor(pairs, dtype=torch.int64).unbind(1)
        check(se_, lo_, hi_)


def test_prepare_does_the_step_host_work_once_and_the_step_finds_it(monkeypatch):
    """``TreeProgram.prepare``: the padding, masks and the varlen op's plan of a batch, built ahead of its run, are
    what the run then uses (the graph inputs are built once, the plan once, forward and backward), with the same
    loss and gradients as a run of a fresh copy of the batch, which builds its own.  A batch changed in place after
    it was prepared is prepared again by its run (its new loss weights count); a prepared batch that is not the
    next one run costs a rebuild, never a wrong input.  A real varlen lowering on the CPU (float64 as a half
    dtype, the op's reference kernel), as the test above."""
    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile.ops import varlen_tree_attention as vta
    from treecompile.passes import lower_cuda as lc
    from treecompile.program import _CudaState

    tm = cached_compile(cached_model("dense-tiny", tiny_dense))
    prog = tm.program
    monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q=None: None)
    monkeypatch.setattr(lc, "HALF", lc.HALF + (torch.float64,))
    monkeypatch.setattr(lc, "AUTO_SEGMENTS_HEAD_DIMS", (8,))
    monkeypatch.setattr(lc, "varlen_input_reason", lambda q: None)  # the traced check: CUDA half inputs
    options = lc.CudaOptions(compile_cuda=False, bucket=True, gdn_kernel="reference")
    low = lc.lower_cuda(prog.graph_module, options)
    assert low.attention_varlen and low.plans == (lc.VarlenPlanInput("tree_subtree_end", None, None, torch.float64, 8),)
    monkeypatch.setattr(prog, "_cuda", _CudaState(low, low.graph_module))
    monkeypatch.setattr(prog, "_inputs", type(prog._inputs)())
    built = {"inputs": 0, "plans": 0}
    cuda_inputs, build_plan = prog._cuda_inputs, vta._build_plan

    def counted(name, fn):
        def run(*args, **kwargs):
            built[name] += 1
            return fn(*args, **kwargs)
        return run
    monkeypatch.setattr(prog, "_cuda_inputs", counted("inputs", cuda_inputs))
    monkeypatch.setattr(vta, "_build_plan", counted("plans", build_plan))
    vta._PLANS.clear()

    tree = Tree.from_paths([[t % 97 for t in p] for p in forest_paths(60, 2, seed=4)])

    def fresh():  # distinct tensors (a CPU batch may share the tree's own)
        b = tree.to_batch()
        return dataclasses.replace(b, **{f: getattr(b, f).clone() for f in _TENSOR_FIELDS})

    def step(batch):
        tm.zero_grad(set_to_none=True)
        loss = prog._run_cuda(batch, [])[0]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in tm.parameters()]

    batch = fresh()
    assert batch.seq_len < prog_bucket(batch.seq_len)  # padded: the kept inputs hold the padded batch
    prog._prepare_cuda(batch)
    assert built == {"inputs": 1, "plans": 1}
    loss, grads = step(batch)
    assert built == {"inputs": 1, "plans": 1}  # the run found both, its backward too
    loss2, grads2 = step(fresh())
    assert built == {"inputs": 2, "plans": 2}
    assert torch.equal(loss, loss2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    reference = tm(tree.to_batch()).loss  # the CPU program (no lowering)
    torch.testing.assert_close(loss, reference.detach(), rtol=1e-12, atol=0)
    # changed in place after its preparation: the run builds the inputs again and reads the new weights
    batch = fresh()
    prog._prepare_cuda(batch)
    batch.loss_weight.mul_(2)
    loss3, _ = step(batch)
    assert built["inputs"] == 4
    torch.testing.assert_close(loss3, 2 * loss, rtol=1e-12, atol=0)
    # prepared, but another batch ran first: each run builds what it needs
    a, b = fresh(), fresh()
    prog._prepare_cuda(a)
    n = built["inputs"]
    loss_b, _ = step(b)
    loss_a, _ = step(a)
    assert built["inputs"] == n + 2 and torch.equal(loss_a, loss) and torch.equal(loss_b, loss)


def prog_bucket(T: int) -> int:
    from treecompile.program import bucket_length

    return bucket_length(T)


def test_prepare_refuses_what_it_cannot_keep_and_does_nothing_off_cuda():
    """``TreeModel.prepare`` on the CPU: the batch back as it is (after the same checks as a call), the program
    untouched; a batch of another type, or for a boundary program, is refused as a call refuses it."""
    from helpers import cached_compile, cached_model, tiny_dense

    tm = cached_compile(cached_model("dense-tiny", tiny_dense))
    batch = Tree.from_paths([[1, 2, 3], [1, 2, 4]]).to_batch()
    assert tm.prepare(batch) is batch and tm.program._inputs._entry == ()
    with pytest.raises(TypeError, match="expects a treecompile.TreeBatch"):
        tm.prepare({"input_ids": batch.input_ids})
    with pytest.raises(ValueError, match=r"path 1, position 2: token id 1000 is outside"):
        tm.prepare(Tree.from_paths([[1, 2, 3], [1, 2, 1000]]).to_batch())


def test_a_batch_moved_once_is_not_moved_again_while_its_tensors_are_unchanged(monkeypatch):
    """``TreeProgram._moved_batch`` (what ``run`` and ``prepare`` move a batch with): the same batch, or another
    TreeBatch holding the same tensors, gets the copy made before; one changed in place, one whose copy was changed
    in place, or another batch, a new copy.  (A "meta" device stands in for CUDA: values are not compared.)"""
    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile.program import TreeProgram

    prog = cached_compile(cached_model("dense-tiny", tiny_dense)).program
    monkeypatch.setattr(TreeProgram, "device", property(lambda self: torch.device("meta")))
    monkeypatch.setattr(prog, "_moved", type(prog._moved)())
    tree = Tree.from_paths([[1, 2, 3], [1, 2, 4]])
    b = tree.to_batch()
    moved = prog._moved_batch(b)
    assert moved.input_ids.device.type == "meta" and moved.seq_len == b.seq_len
    assert prog._moved_batch(b) is moved
    assert prog._moved_batch(dataclasses.replace(b, extras={"x": 1})) is moved  # same tensors
    b.loss_weight.mul_(2)
    again = prog._moved_batch(b)
    assert again is not moved and prog._moved_batch(b) is again
    again.input_ids.add_(1)  # the copy changed in place: moved again, from the batch's own values
    third = prog._moved_batch(b)
    assert third is not again and prog._moved_batch(b) is third
    other = Tree.from_paths([[1, 2, 3], [1, 2, 4]]).to_batch()
    assert prog._moved_batch(other) is not again


def test_prepare_plans_builds_each_listed_plan_once_and_skips_inputs_it_is_not_given(monkeypatch):
    """``lower_cuda.prepare_plans``: the unwindowed and windowed plans a lowering lists are built from the batch's
    tensors, and the ops' calls then find them (no second build); an entry whose placeholders are not among the
    batch inputs given is left to the op."""
    from types import SimpleNamespace

    from treecompile.ops import varlen_tree_attention as vta
    from treecompile.passes import lower_cuda as lc

    b = _batch(ODD_TREES["one_token_nodes"], None)
    built = []
    for name in ("_build_plan", "windowed_plan"):
        fn = getattr(vta, name)
        monkeypatch.setattr(vta, name, lambda *a, _fn=fn, _name=name: built.append(_name) or _fn(*a))
    monkeypatch.setattr(vta, "_WINDOW_PLANS", {})
    vta._PLANS.clear()
    low = SimpleNamespace(plans=(lc.VarlenPlanInput("tree_subtree_end", None, None, torch.float64, 8),
                                 lc.VarlenPlanInput("tree_subtree_end", "tree_position_ids", 3, torch.float64, 8),
                                 lc.VarlenPlanInput("elsewhere", None, None, torch.float64, 8)))
    lc.prepare_plans(low, {"tree_subtree_end": b.subtree_end, "tree_position_ids": b.position_ids})
    assert built == ["_build_plan", "windowed_plan"]
    q = torch.empty(1, 2, b.seq_len, 8, dtype=torch.float64)
    assert vta._plan(b.subtree_end, q) is vta._PLANS._entry[3]
    vta._window_plan(b.subtree_end, b.position_ids, 3)
    assert built == ["_build_plan", "windowed_plan"]  # both found


def test_prepare_refuses_a_boundary_program(monkeypatch):
    from helpers import cached_compile, cached_model, tiny_dense

    tm = cached_compile(cached_model("dense-tiny", tiny_dense))
    monkeypatch.setattr(tm.program, "boundary", object())
    batch = Tree.from_paths([[1, 2, 3]]).to_batch()
    with pytest.raises(TypeError, match="boundary=True"):
        tm.prepare(batch)
    with pytest.raises(TypeError, match="boundary program"):
        tm.program.prepare(batch)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("kernel", ["auto", "fa4_varlen"])
def test_prepared_cuda_batch_runs_its_prepared_plan_with_the_same_results(monkeypatch, kernel):
    """On CUDA (compiled graph, FA4's varlen kernel): a batch prepared ahead (``TreeModel.prepare`` of a CPU batch:
    moved, padded, its plan built) runs without building its graph inputs or its plan again, forward or backward,
    with the loss and log-probs of the same step on a fresh copy of the batch bitwise (the same kernels on the same
    inputs) and its gradients to bf16 rounding (the backward's atomic sums, FA4's dQ and the key copies', add in a
    different order each run).  Another batch prepared between a batch's forward and backward costs a rebuild."""
    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.ops import varlen_tree_attention as vta

    torch.manual_seed(0)
    cfg = DenseConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = DenseForCausalLM(cfg).cuda().to(torch.bfloat16)
    tm = treecompile.compile(model, attention_kernel=kernel)
    tree = Tree.from_paths([[t % cfg.vocab_size for t in p] for p in forest_paths(900, 2, seed=5)])
    built = []
    build = vta._build_plan
    monkeypatch.setattr(vta, "_build_plan", lambda *a: built.append(1) or build(*a))

    def step(batch, between=None):
        model.zero_grad()
        out = tm(batch)
        if between is not None:
            tm.prepare(between)
        out.loss.backward()
        return (out.loss.detach(), out.logprobs.detach()), [p.grad.clone() for p in model.parameters()]

    def same(a, b):  # bitwise forward, gradients to bf16 rounding (one bf16 ulp of each tensor's largest entry)
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0]))
        for x, y in zip(a[1], b[1]):
            torch.testing.assert_close(x, y, rtol=2 ** -7, atol=2 ** -7 * float(y.abs().max()))

    step(tree.to_batch(device="cuda"))  # compiles
    assert tm.program._cuda.lowering.plans, "the lowering found no plan to prepare"
    built.clear()
    batch = tm.prepare(tree.to_batch())
    assert batch.input_ids.is_cuda and len(built) == 1
    prepared = step(batch)
    assert len(built) == 1  # forward and backward found the prepared plan
    same(prepared, step(tree.to_batch(device="cuda")))
    assert len(built) == 2
    other = tm.prepare(tree.to_batch())
    same(prepared, step(tree.to_batch(device="cuda"), between=other))  # the backward's plan rebuilt, not wrong
    cpu = tree.to_batch()  # prepared, then run as the CPU batch it was: the run finds the moved, planned copy
    tm.prepare(cpu)
    n = len(built)
    same(prepared, step(cpu))
    assert len(built) == n
    side = torch.cuda.Stream()  # prepared on a side stream, run on the default one: nothing read across streams
    cpu = tree.to_batch()
    with torch.cuda.stream(side):
        tm.prepare(cpu)
    n = len(built)
    same(prepared, step(cpu))
    assert len(built) == n + 1


# --------------------------------------------------------------------------- the gathered rows kept for the backward
def _count_gathers(monkeypatch) -> list:
    from treecompile.ops import varlen_tree_attention as vta

    calls = []
    keys = vta.SegmentPlan.keys

    def counted(self, k_t, v_t, rep=1, front=None):
        calls.append(self.gathered)
        return keys(self, k_t, v_t, rep, front)

    monkeypatch.setattr(vta.SegmentPlan, "keys", counted)
    return calls


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("pad_to", [None, 16])
@pytest.mark.parametrize("kv_heads", ["grouped", "expanded"])
def test_kept_rows_are_the_gathered_rows_and_the_backward_does_not_gather_again(windowed, pad_to, kv_heads,
                                                                                monkeypatch):
    """``keep="all"``: the forward returns the plan's gathered K/V rows, the backward reads them instead of gathering
    again (one gather per forward + backward instead of two), and out and every gradient are bitwise those of
    ``keep="none"`` (the same rows, the same kernels); a tail of padding tokens and the windowed op alike.  K/V
    expanded to the query heads are kept as ``[G * 2, Hkv, D]`` views of the ``[G, Hkv * 2, D]`` rows."""
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "KV_HEADS", kv_heads)
    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "segments")  # keep="none"'s forward gathers as keep="all"'s
    rep = 2 if kv_heads == "expanded" else 1  # 4 query heads on 2 kv heads

    b = _batch(forest_paths(90, 3, seed=5), pad_to)
    se, pos = b.subtree_end, b.position_ids
    q, k, v = _qkv(b.seq_len, 4, 2, 8, seed=3)
    do = torch.randn(1, 4, b.seq_len, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    calls = _count_gathers(monkeypatch)

    def run(keep):
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        if windowed:
            res = torch.ops.treecompile.tree_attention_varlen_windowed_fwd(qq, kk, vv, se, pos, 7, 0.3, keep)
        else:
            res = torch.ops.treecompile.tree_attention_varlen_fwd(qq, kk, vv, se, 0.3, keep)
        (res[0] * do).sum().backward()
        return res, (qq.grad, kk.grad, vv.grad)

    (out0, _, k0, v0), grads0 = run("none")  # on the segments both ways: the same kernels as keep="all"'s
    assert len(calls) == 2 and k0.shape == (0, 2, 8) == v0.shape
    plan = vta._window_plan(se, pos, 7) if windowed else vta._plan(se, q)
    calls.clear()
    (out1, _, k1, v1), grads1 = run("all")
    assert calls == [plan.gathered] and 0 < plan.gathered
    kt, vt = (x[0].transpose(0, 1) for x in (k, v))
    for kept, x in ((k1, kt), (v1, vt)):  # each kv head repeated rep times in place, as [G * rep, 2, 8]
        assert torch.equal(kept, x[plan.key_index].repeat_interleave(rep, dim=1).view(-1, 2, 8))
    assert not k1.requires_grad and torch.equal(out1, out0)
    assert all(torch.equal(a, b_) for a, b_ in zip(grads1, grads0))


def test_keeps_keys_keeps_only_gathered_segment_rows(monkeypatch):
    """Only a segment plan with queries for the kernel keeps rows: not a block-sparse plan, not a batch of padding
    alone, not the windowed op's block-mask fallback (no plan); "fit" off CUDA keeps (memory is not tracked); an
    unknown ``keep`` is refused by name."""
    from treecompile.ops import varlen_tree_attention as vta

    b = _batch(forest_paths(40, 2, seed=1))
    q, k, v = _qkv(b.seq_len, 2, 1, 8, seed=0)
    seg = vta.tree_attention_plan(b.subtree_end, block_sparse=False)
    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", 0.0)  # any gather is too large: the block-sparse plan
    sparse = vta.tree_attention_plan(b.subtree_end, block_sparse=True)
    pads = vta.segment_plan(torch.arange(1, 6))
    assert isinstance(sparse, vta.BlockSparsePlan) and pads.tail == 0
    assert vta.keeps_keys("all", seg, q, k, v) and vta.keeps_keys("fit", seg, q, k, v)
    assert not vta.keeps_keys("none", seg, q, k, v)
    assert not any(vta.keeps_keys("all", p, q, k, v) for p in (sparse, pads, None))
    assert vta.gathered_bytes(seg, k, v) == seg.gathered * 1 * 8 * 8 * 2 and vta.gathered_bytes(sparse, k, v) == 0
    with pytest.raises(ValueError, match="keep must be one of"):
        torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, b.subtree_end, 0.3, "some")


def test_fit_decides_once_per_forward_from_the_memory_one_layer_took(monkeypatch):
    """``keep="fit"`` on CUDA (memory queries stubbed): call 0 notes the memory and keeps nothing; call 1 keeps,
    for itself and the later calls, exactly when ``(layers - 1) x (per_layer + rows) + reserve x T + margin`` is
    within the headroom (both sides of the bound); a call 1 with no call 0 since the last decision (activation
    checkpointing's recompute) reuses it; the decision is recorded; first two calls on two devices keep nothing."""
    from treecompile.ops import logprobs_kept
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "KV_HEADS", "grouped")  # the kv heads as they are (test_varlen_kv_heads: expanded)
    b = _batch(forest_paths(40, 2, seed=1))
    T = b.seq_len
    q, k, v = _qkv(T, 2, 1, 8, seed=0)
    plan = vta.tree_attention_plan(b.subtree_end, block_sparse=False)
    rows = vta.gathered_bytes(plan, k, v)
    total, per_layer, reserve, layers = 1 << 30, 5000, 3, 6
    margin = total // logprobs_kept.FIT_MARGIN_FRACTION
    allocated = [100]
    headroom = [0]
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {
        "allocated_bytes": {"all": {"current": allocated[0]}}, "reserved_bytes": {"all": {"current": 0}}})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("P", (), {"total_memory": total})())
    monkeypatch.setattr(vta, "headroom_bytes", lambda device, allocator=None: headroom[0])
    need = (layers - 1) * (per_layer + rows) + reserve * T + margin

    def forward(room):
        allocated[0] = 100
        got = [vta._fit(plan, q, k, v, 0, layers, reserve)]
        allocated[0] += per_layer
        headroom[0] = room
        return got + [vta._fit(plan, q, k, v, i, layers, reserve) for i in range(1, layers)]

    assert forward(need) == [False] + [True] * (layers - 1)
    assert vta.last_keys_fit == vta.KeysFit(layers=layers, per_layer=per_layer, keys=rows, reserve=reserve * T,
                                            margin=margin, headroom=need, keep=True)
    headroom[0] = 0
    assert [vta._fit(plan, q, k, v, i, layers, reserve) for i in (3, 2, 1)] == [True] * 3  # a recompute: reused
    assert forward(need - 1) == [False] * layers
    assert vta.last_keys_fit.keep is False
    forward(need)
    vta._fit(plan, q, k, v, 0, layers, reserve)  # the next forward's first call on another device than its second
    assert not vta._fit(plan, q.to("meta"), k, v, 1, layers, reserve)


def test_lowering_numbers_the_calls_and_leaves_room_for_the_head(monkeypatch):
    """``attention_keys``: "auto" lowers every varlen call with ``keep="fit"``, numbered 0..L-1 of L, and the head's
    kept logits per token (vocabulary x element size) as the reserve; "kept" / "gathered" pass "all" / "none";
    a graph whose head keeps no logits reserves nothing; a bad value is refused."""
    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile.passes import lower_cuda as lc

    prog = cached_compile(cached_model("dense-tiny", tiny_dense)).program

    def varlen_calls(low):
        return [n.kwargs for n in low.graph_module.graph.nodes if n.target is lc._varlen]

    low = _lower_fa4_varlen(prog, monkeypatch)
    V = [p for n, p in prog.model.named_parameters() if n.endswith("lm_head.weight")][0].shape[0]
    calls = varlen_calls(low)
    assert [c["layer"] for c in calls] == [0, 1] and {c["layers"] for c in calls} == {2}
    assert {c["keep"] for c in calls} == {"fit"} and low.attention_keep == "fit"
    assert {c["reserve_per_token"] for c in calls} == {V * 8} == {low.keys_reserve_per_token}
    for keys, keep in (("kept", "all"), ("gathered", "none")):
        low = _lower_fa4_varlen(prog, monkeypatch, attention_keys=keys)
        assert {c["keep"] for c in varlen_calls(low)} == {keep} == {low.attention_keep}
    low = _lower_fa4_varlen(prog, monkeypatch, head_logits="chunked")
    assert {c["reserve_per_token"] for c in varlen_calls(low)} == {0}
    with pytest.raises(ValueError, match="attention_keys: expected one of"):
        lc.CudaOptions(attention_keys="all")


def test_calls_without_gradients_keep_nothing(monkeypatch):
    """The lowering's wrapper passes ``keep`` only to calls that differentiate the attention."""
    from treecompile.passes import lower_cuda as lc

    seen = []
    monkeypatch.setattr(lc, "tree_attention_varlen", lambda *a, keep, **kw: seen.append(keep))
    monkeypatch.setattr(lc, "varlen_input_reason", lambda q: None)
    b = _batch(forest_paths(20, 2, seed=1))
    q, k, v = _qkv(b.seq_len, 2, 1, 8, seed=0)
    lc._varlen(q, k, v, b.subtree_end, 0.3, None, "fa4_varlen", keep="all")
    with torch.no_grad():
        lc._varlen(q, k, v, b.subtree_end, 0.3, None, "fa4_varlen", keep="all")
    lc._varlen(*(x.detach() for x in (q, k, v)), b.subtree_end, 0.3, None, "fa4_varlen", keep="all")
    assert seen == ["all", "none", "none"]


@pytest.mark.parametrize("keys", ["kept", "auto"])
def test_lowered_model_keeping_rows_equals_the_rewritten_graph(keys, monkeypatch):
    """The tiny model lowered with its gathered rows kept ("kept"; "auto", which keeps off CUDA): loss, log-probs
    and every gradient as the rewritten graph's (CPU, float64, reference kernels), one gather per layer."""
    from helpers import cached_compile, cached_model, tiny_dense

    prog = cached_compile(cached_model("dense-tiny", tiny_dense)).program
    low = _lower_fa4_varlen(prog, monkeypatch, attention_keys=keys)
    calls = _count_gathers(monkeypatch)
    _assert_lowered_equals_rewritten(prog, low)
    assert len(calls) == low.attention_varlen == 2


def test_one_compiled_graph_serves_kept_and_gathered_calls(monkeypatch):
    """Under ``torch.compile`` (inductor, CPU, the settings a lowered graph runs with: ``program.dynamo_config``; not
    ``fullgraph``, which captures such ops by itself) the kept rows' count is an unbacked size: a call that keeps and
    one that does not (the "fit" decision changing between steps), with K/V grouped or expanded to the query heads
    (``KV_HEADS``: G or G * rep kept rows), run the same one graph, with the reference's gradients."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from treecompile.ops import varlen_tree_attention as vta
    from treecompile.passes.lower_cuda import CudaOptions
    from treecompile.program import dynamo_config

    b = _batch(forest_paths(60, 2, seed=2), 16)
    q, k, v = _qkv(b.seq_len, 4, 2, 8, seed=1)
    counter = CompileCounterWithBackend("inductor")
    fn = torch.compile(lambda q, k, v, se: (tree_attention_varlen(q * 1, k, v, se, 0.3, keep="fit") * 1.5).sum(),
                       backend=counter, dynamic=False)
    want = torch.autograd.grad((tree_attention_reference(q, k, v, b.subtree_end, 0.3) * 1.5).sum(), (q, k, v))
    keeps = vta.keeps_keys
    for heads, keep in (("grouped", True), ("grouped", False), ("expanded", True), ("expanded", False),
                        ("grouped", True)):
        monkeypatch.setattr(vta, "KV_HEADS", heads)
        monkeypatch.setattr(vta, "keeps_keys", lambda *a, keep=keep: keep and keeps(*a))
        with torch._dynamo.config.patch(**dynamo_config(CudaOptions())):
            got = torch.autograd.grad(fn(q, k, v, b.subtree_end), (q, k, v))
        for x, r in zip(got, want):
            torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 1


def test_kept_op_opcheck():
    b = _batch(forest_paths(40, 2, seed=3), 8)
    q, k, v = (x.detach() for x in _qkv(b.seq_len, 4, 2, 8, seed=0))
    torch.library.opcheck(torch.ops.treecompile.tree_attention_varlen_fwd.default,
                          (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), b.subtree_end, 0.35, "all"))


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_compiled_steps_keeping_the_gathered_rows_equal_gathering_them_again(monkeypatch):
    """On CUDA (compiled graph, FA4's varlen kernel, 4 layers), under ``torch.use_deterministic_algorithms(True)``:
    ``attention_keys`` "kept", "auto" (which keeps on this small model: the decision is recorded) and "gathered"
    give the same loss, log-probs and parameter gradients bit for bit, and each mode's two steps repeat bit for bit;
    "kept" gathers half as often.  (Without deterministic mode the forwards are bitwise equal too, 0.0 apart in
    session 41, but FA4's dQ and GQA dK/dV accumulate by atomics in a different order each run: session 44 saw one
    gradient entry of 131,072 differ by 2 bf16 ulps of its tensor's largest, past a one-ulp tolerance.  Before
    dynamo kept these graphs whole the forwards rounded differently: ``h200_s41/gputests_first.txt``.)  Forwards that
    keep no rows run the segments here (``UNKEPT_FORWARD = "segments"``), the kernel of those that keep them: by
    default they run FA4's block-sparse kernels, the same attention rounded otherwise (session 58's first run of this
    test under that default: "gathered" gathered once a layer, in its backward)."""
    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "segments")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for deterministic mode
    torch.manual_seed(0)
    cfg = DenseConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    model = DenseForCausalLM(cfg).cuda().to(torch.bfloat16)
    batch = Tree.from_paths([[t % cfg.vocab_size for t in p] for p in forest_paths(900, 2, seed=5)]
                            ).to_batch(device="cuda")
    gathers = _count_gathers(monkeypatch)
    runs = {}
    with deterministic_algorithms(True):
        for mode in ("gathered", "kept", "auto"):
            tm = treecompile.compile(model, attention_keys=mode)
            steps = []
            for _ in range(2):  # the first step compiles
                model.zero_grad()
                vta.pop_last_keys_fit()
                gathers.clear()
                out = tm(batch)
                out.loss.backward()
                steps.append([out.loss.detach(), out.logprobs.detach()] + [p.grad.clone() for p in model.parameters()])
            same = [torch.equal(x, y) for x, y in zip(*steps)]
            assert all(same), (mode, "steps differ", [i for i, ok in enumerate(same) if not ok])
            runs[mode] = (steps[1], len(gathers), vta.pop_last_keys_fit())
    assert runs["gathered"][1] == 2 * cfg.num_hidden_layers and runs["kept"][1] == cfg.num_hidden_layers
    fit = runs["auto"][2]
    assert fit is not None and fit.keep and fit.layers == cfg.num_hidden_layers and fit.per_layer > 0, fit
    assert runs["auto"][1] == cfg.num_hidden_layers + 1  # layer 0 only notes the memory: it gathers again
    for mode in ("kept", "auto"):
        same = [torch.equal(x, y) for x, y in zip(runs[mode][0], runs["gathered"][0])]
        assert all(same), (mode, [i for i, ok in enumerate(same) if not ok])


def _replay_layers(monkeypatch, pad_to):
    """The replay GPU tests' setting: ``fa4_replay`` with no records and zero counts, a CUDA forest batch (a padding
    tail under ``pad_to``), three layers' bf16 q, k, v (16 query heads over 8 kv heads of 128) in the model's
    ``[1, H, T, D]`` views of ``[1, T, H, D]`` storage, and the generator for more."""
    from treecompile.ops import fa4_replay

    monkeypatch.setattr(fa4_replay, "_records", {})
    monkeypatch.setattr(fa4_replay, "counts", {kind: {"recorded": 0, "replayed": 0, "refused": 0}
                                               for kind in fa4_replay.KINDS})
    b = _batch(forest_paths(900, 2, seed=3), pad_to).to("cuda")
    T, H, Hkv, D = b.seq_len, 16, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [[torch.randn(1, T, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
               for h in (H, Hkv, Hkv)] for _ in range(3)]
    return fa4_replay, b, layers, g


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("pad_to", [None, 1024], ids=["no_tail", "tail"])
@pytest.mark.parametrize("window", [None, 64])
def test_fa4_forward_replay_is_bitwise_the_interface(pad_to, window, monkeypatch):
    """Three layers' forward calls under one plan (FA4's varlen kernel, bf16): with ``fa4_replay`` the first is
    recorded and the two after it replay its launch; out and lse are bitwise the interface's on every layer, with and
    without a padding tail, windowed or not (ops/fa4_replay.py).  The forward that keeps no rows runs the segments
    here (``UNKEPT_FORWARD = "segments"``; by default it runs FA4's block-sparse kernels through their interface)."""
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "segments")
    fa4_replay, b, layers, _ = _replay_layers(monkeypatch, pad_to)

    def run(enabled):
        monkeypatch.setattr(fa4_replay, "ENABLED", enabled)
        ops = torch.ops.treecompile
        if window is None:
            return [ops.tree_attention_varlen_fwd(q, k, v, b.subtree_end, 0.1)[:2] for q, k, v in layers]
        return [ops.tree_attention_varlen_windowed_fwd(q, k, v, b.subtree_end, b.position_ids, window, 0.1)[:2]
                for q, k, v in layers]

    ref = run(False)
    got = run(True)
    assert fa4_replay.counts["forward"] == {"recorded": 1, "replayed": 2, "refused": 0}
    for (o, l_), (o_ref, l_ref) in zip(got, ref):
        assert torch.equal(o, o_ref) and torch.equal(l_, l_ref)


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("pad_to", [None, 1024], ids=["no_tail", "tail"])
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomics"])
def test_fa4_backward_replay_is_bitwise_the_interface(pad_to, window, deterministic, monkeypatch):
    """Three layers' forward and backward under one plan (FA4's varlen kernels, bf16, GQA): with ``fa4_replay`` the
    first backward call is recorded (its scratch buffers and five launches) and the two after it replay; dq, dk, dv
    are bitwise the interface's on every layer in deterministic mode, with and without a padding tail (the given dq
    and the allocated one), windowed or not.  With atomics (FA4's default backward) the sums' order varies between
    runs of the interface itself, so there the replays are counted and checked against the interface's to bf16
    rounding."""
    from treecompile.ops.varlen_tree_attention import tree_attention_varlen, tree_attention_varlen_windowed

    fa4_replay, b, layers, g = _replay_layers(monkeypatch, pad_to)
    douts = [torch.randn(1, b.seq_len, 16, 128, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
             for _ in range(3)]

    def run(enabled):
        monkeypatch.setattr(fa4_replay, "ENABLED", enabled)
        grads = []
        for (q, k, v), dout in zip(layers, douts):
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            if window is None:
                out = tree_attention_varlen(q, k, v, b.subtree_end, 0.1)
            else:
                out = tree_attention_varlen_windowed(q, k, v, b.subtree_end, b.position_ids, window, 0.1)
            out.backward(dout)
            grads.append((q.grad, k.grad, v.grad))
        return grads

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        ref = run(False)
        got = run(True)
    finally:
        torch.use_deterministic_algorithms(before)
    assert fa4_replay.counts["backward"] == {"recorded": 1, "replayed": 2, "refused": 0}
    for layer, (grads, grads_ref) in enumerate(zip(got, ref)):
        for name, x, x_ref in zip("qkv", grads, grads_ref):
            if deterministic:
                assert torch.equal(x, x_ref), (layer, name)
            else:
                err = (x.float() - x_ref.float()).norm() / x_ref.float().norm()
                assert err < 2 ** -8, (layer, name, float(err))


@pytest.mark.slow
def test_lowered_graph_compiles_with_inductors_cpp_wrapper(monkeypatch):
    """The lowering runs under inductor's C++ wrapper (``cpp_wrapper=True``: the harness's ``tree_cpp_wrapper``
    times it on CUDA): the varlen attention keeping its rows and the head's "fit", whose row counts are unbacked
    sizes, are called from the C++ wrapper through the dispatcher.  The tiny model's lowering, compiled on the CPU:
    loss, log-probs and every gradient as the rewritten graph's (float64)."""
    import torch._inductor.config as inductor_config
    from helpers import cached_compile, cached_model, tiny_dense
    from torch._inductor.utils import run_and_get_code
    from treecompile.program import dynamo_config

    prog = cached_compile(cached_model("dense-tiny", tiny_dense)).program
    low = _lower_fa4_varlen(prog, monkeypatch, attention_keys="kept")
    torch._dynamo.reset()
    compiled = torch.compile(low.graph_module, dynamic=False)
    with torch._dynamo.config.patch(**dynamo_config(prog.options)), inductor_config.patch(cpp_wrapper=True):
        _, codes = run_and_get_code(_assert_lowered_equals_rewritten, prog, low, compiled)
    assert len(codes) == 2 and all("inductor_entry_impl" in c for c in codes)  # forward and backward: C++ wrappers


@pytest.mark.parametrize("keys", ["kept", "gathered"])
def test_lowered_graph_with_run_time_row_counts_is_one_compiled_graph(keys, monkeypatch):
    """Under the settings a lowered graph runs with (``program.dynamo_config``) the ops whose row counts are decided
    at run time (the varlen attention's kept K/V, the head's kept logits under "fit") stay in one dynamo graph:
    without ``capture_dynamic_output_shape_ops`` each of them cut the graph (session 41 measured 30 graphs on
    Qwen3-0.6B).  The tiny model's lowering compiled by inductor on the CPU: loss, log-probs and every gradient as
    the rewritten graph's (float64)."""
    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile.program import dynamo_config

    prog = cached_compile(cached_model("dense-tiny", tiny_dense)).program
    low = _lower_fa4_varlen(prog, monkeypatch, attention_keys=keys)
    assert low.head_keep == "fit" and low.attention_keep == ("all" if keys == "kept" else "none")
    args = [*(prog.lifted_value(x) for x in prog.lifted), *prog.batch_args(_lowered_test_batch()), None]
    torch._dynamo.reset()
    with torch._dynamo.config.patch(**dynamo_config(prog.options)):
        explained = torch._dynamo.explain(low.graph_module)(*args)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        _assert_lowered_equals_rewritten(prog, low, torch.compile(low.graph_module, dynamic=False))


def test_plans_are_checked_by_nesting_and_proven_only_when_asked(monkeypatch):
    """At run time (``VERIFY_PLANS`` off, the default) a segment plan is not proven by ``_check_plan``: the walk's
    nesting check refuses a non-nested ``subtree_end`` naming its first token that sticks out, and a nested one
    gets the tree mask.  With ``VERIFY_PLANS`` on (this suite's setting, tests/conftest.py) every plan is proven."""
    from treecompile.ops import varlen_tree_attention as vta

    calls = []
    real = vta._check_plan
    monkeypatch.setattr(vta, "_check_plan", lambda *a: (calls.append(1), real(*a))[1])
    b = _batch(forest_paths(300, 3, seed=5), 320)
    for verify in (False, True):
        monkeypatch.setattr(vta, "VERIFY_PLANS", verify)
        calls.clear()
        plan = vta.tree_attention_plan(b.subtree_end.clone(), block_sparse=False)
        assert torch.equal(plan_mask(plan, b.seq_len), tree_mask(b.subtree_end)) and len(calls) == verify
        bad = torch.tensor([4, 2, 5, 4, 6, 6])  # token 2's subtree [2, 5) sticks out of token 0's [0, 4)
        with pytest.raises(ValueError, match=r"not the DFS layout of a forest at token 2 "):
            vta.tree_attention_plan(bad, block_sparse=False)


# ------------------------------------------------- the forward without kept rows on the block-sparse plan (CPU, GPU)
def _record_plans(monkeypatch) -> dict:
    """The plan kind of every forward and backward of the op while the test runs."""
    from treecompile.ops import varlen_tree_attention as vta

    seen = {"forward": [], "backward": []}
    fwd, bwd = vta._forward, vta._backward_grads

    def forward(q, k, v, plan, *a, **kw):
        seen["forward"].append(type(plan).__name__)
        return fwd(q, k, v, plan, *a, **kw)

    def backward(q, k, v, out, lse, dout, plan, *a, **kw):
        seen["backward"].append(type(plan).__name__)
        return bwd(q, k, v, out, lse, dout, plan, *a, **kw)

    monkeypatch.setattr(vta, "_forward", forward)
    monkeypatch.setattr(vta, "_backward_grads", backward)
    return seen


@pytest.mark.parametrize("H,Hkv,pad_to,layout", [(4, 2, 16, "dfs"), (3, 3, None, "dfs"), (4, 2, 48, "heavy_first")])
@pytest.mark.parametrize("keep", ["none", "all"])
def test_unkept_forward_on_the_block_sparse_plan_equals_the_tree_mask(H, Hkv, pad_to, layout, keep, monkeypatch):
    """Under ``UNKEPT_FORWARD = "block_sparse"`` a batch that takes the segments runs a forward that keeps no rows on
    the block-sparse plan (no gather) and its backward on the segments (gathering the rows): out, log-sum-exp and the
    q/k/v gradients equal the dense tree mask's and the segment forward's in float64 (padded or not, GQA, the
    block-sparse plan in either order; a lexicographic forest, so heavy-first reorders).  A forward that keeps its
    rows gathers them for the segments as before, and the backward reads them."""
    from treecompile.ops import varlen_tree_attention as vta

    b = _batch(forest_paths(90, 3, seed=H + Hkv), pad_to, order="lex")
    T = b.seq_len
    q, k, v = _qkv(T, H, Hkv, 8, seed=H * 7 + (pad_to or 0))
    do = torch.randn(1, H, T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(H))
    se = b.subtree_end.clone()
    assert isinstance(vta._plan(se, q), vta.SegmentPlan)  # a wide forest: the segments' batch
    want_out, want_lse, *_ = torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, se, 0.3, keep)
    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "block_sparse")
    monkeypatch.setattr(vta, "BLOCK_SPARSE_LAYOUT", layout)
    seen = _record_plans(monkeypatch)

    def op(q, k, v):
        return torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, se, 0.3, keep)[0]

    got = out_and_grads(op, q, k, v, do, torch.float64)
    fwd = "SegmentPlan" if keep == "all" else "BlockSparsePlan"
    assert seen == {"forward": [fwd], "backward": ["SegmentPlan"]}, seen
    if keep == "none" and layout == "heavy_first":
        assert vta._FORWARD_PLANS.get((se,), layout, None).order is not None  # a real permutation ran
    ref = out_and_grads(lambda q, k, v: tree_attention_reference(q, k, v, se, scale=0.3), q, k, v, do, torch.float64)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=name)
    out, lse, kept_k, _ = torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, se, 0.3, keep)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert (kept_k.shape[0] > 0) == (keep == "all")


def test_unkept_forward_keeps_the_segments_where_it_cannot_run_block_sparse(monkeypatch):
    """The setting changes only what it can: a deep batch already runs block-sparse both ways; the windowed op keeps
    its segments (its own plan); under the default "segments" the forward gathers.  An unknown setting is refused
    naming it."""
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "block_sparse")
    seen = _record_plans(monkeypatch)
    deep = _batch(_deep_paths(9, 3), 32)
    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", 0.0)
    q, k, v = _qkv(deep.seq_len, 4, 2, 8, seed=1)
    se = deep.subtree_end.clone()
    torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, se, 0.3)[0].sum().backward()
    assert seen == {"forward": ["BlockSparsePlan"], "backward": ["BlockSparsePlan"]}
    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", 6.0)
    b = _batch(forest_paths(60, 2, seed=2), 16)
    q, k, v = _qkv(b.seq_len, 4, 2, 8, seed=2)
    seen["forward"].clear(), seen["backward"].clear()
    out = torch.ops.treecompile.tree_attention_varlen_windowed_fwd(q, k, v, b.subtree_end, b.position_ids, 9, 0.3)[0]
    out.sum().backward()
    assert seen == {"forward": ["SegmentPlan"], "backward": ["SegmentPlan"]}
    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "gathered")
    for keep in ("none", "all"):  # refused whether or not the call keeps its rows
        with pytest.raises(ValueError, match="UNKEPT_FORWARD: expected one of"):
            torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, b.subtree_end.clone(), 0.3, keep)
    with pytest.raises(ValueError, match="UNKEPT_FORWARD: expected one of"):
        vta.prepare(b.subtree_end.clone(), q)


def test_prepare_builds_the_unkept_forward_plan_too(monkeypatch):
    """``prepare`` (a batch's host work while the GPU runs the step before) builds the forward's block-sparse plan
    under the setting (the default), so the op's forward finds it; under "segments" it builds none."""
    from treecompile.ops import varlen_tree_attention as vta

    b = _batch(forest_paths(70, 3, seed=5), 16)
    q = torch.zeros(1, 4, 1, 8, dtype=torch.float64)
    se = b.subtree_end.clone()
    vta._FORWARD_PLANS.clear()
    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "segments")
    vta.prepare(se, q)
    assert vta._FORWARD_PLANS._entry == ()
    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "block_sparse")
    vta.prepare(se, q)
    plan = vta._FORWARD_PLANS._entry[3]
    assert isinstance(plan, vta.BlockSparsePlan)

    def no_second_build(_):
        raise AssertionError("the forward built its plan again")

    build = vta._build_forward_plan
    monkeypatch.setattr(vta, "_build_forward_plan", no_second_build)
    qq, k, v = _qkv(b.seq_len, 4, 2, 8, seed=5)
    torch.ops.treecompile.tree_attention_varlen_fwd(qq, k, v, se, 0.3)
    monkeypatch.setattr(vta, "_build_forward_plan", build)  # opcheck's calls may build their own
    torch.library.opcheck(torch.ops.treecompile.tree_attention_varlen_fwd.default,
                          (qq.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_(),
                           se, 0.3))


def test_lowered_model_with_block_sparse_unkept_forwards_equals_the_rewritten_graph(monkeypatch):
    """The tiny model lowered to the varlen op with no rows kept (``attention_keys="gathered"``) and every forward on
    the block-sparse plan: loss, log-probs and every gradient as the rewritten graph's (CPU, float64)."""
    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile.ops import varlen_tree_attention as vta

    prog = cached_compile(cached_model("dense-tiny", tiny_dense)).program
    low = _lower_fa4_varlen(prog, monkeypatch, attention_keys="gathered")
    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "block_sparse")
    seen = _record_plans(monkeypatch)
    _assert_lowered_equals_rewritten(prog, low)
    assert set(seen["forward"]) == {"BlockSparsePlan"} and set(seen["backward"]) == {"SegmentPlan"}


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("T,roots,pad_to,H,Hkv,D", [(1000, 3, 1024, 4, 2, 128), (2900, 1, 3072, 16, 8, 128),
                                                   (1500, 2, None, 4, 4, 64), (900, 2, None, 8, 2, 256)])
def test_fa4_unkept_forward_on_the_block_sparse_plan_vs_fp64_oracle(T, roots, pad_to, H, Hkv, D, monkeypatch):
    """FA4's block-sparse forward with the segments' backward (``UNKEPT_FORWARD = "block_sparse"``, no rows kept):
    bf16 output and q/k/v gradients within 2x the bf16 dense kernel's error against the float64 dense-mask oracle;
    head dim 256 (no block-sparse tiles) keeps the segments' forward."""
    from treecompile.ops import varlen_tree_attention as vta

    monkeypatch.setattr(vta, "UNKEPT_FORWARD", "block_sparse")
    seen = _record_plans(monkeypatch)

    def attend(b, scale):
        return lambda q, k, v: tree_attention_varlen(q, k, v, b.subtree_end, scale=scale)

    assert_bf16_tree_kernel_near_oracle(attend, T, roots, pad_to, H, Hkv, D)
    want = "SegmentPlan" if D == 256 else "BlockSparsePlan"
    assert seen["forward"] and set(seen["forward"]) == {want} and set(seen["backward"]) == {"SegmentPlan"}, seen
