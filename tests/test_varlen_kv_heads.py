"""The varlen tree attention with grouped-query K/V expanded to the query heads (``varlen_tree_attention.KV_HEADS =
"expanded"``): the gather that repeats each kv head (``key_copies.gather_keys``), the copy sums that add the
heads of a group back (``sum_copies(rep=)``), and the op on both settings, exact in float64 against the dense
tree mask (issue 16: FA4's GQA backward accumulates dK/dV in float32 buffers over the gathered rows; expanded,
it writes them per head)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_interpreted
from tests.test_fa4_tree_attention import forest_paths
from tests.test_flex_tree_attention import out_and_grads
from tests.test_varlen_tree_attention import _gpu_reason, _qkv
from treecompile import Tree
from treecompile.ops import key_copies
from treecompile.ops import varlen_tree_attention as vta
from treecompile.ops.tree_attention import tree_attention_reference


def _count_gathers(monkeypatch) -> list:
    """The ``rep`` of every gather of a segment plan's rows while the test runs."""
    calls, keys = [], vta.SegmentPlan.keys

    def counted(self, k_t, v_t, rep=1, front=None):
        calls.append(rep)
        return keys(self, k_t, v_t, rep, front)

    monkeypatch.setattr(vta.SegmentPlan, "keys", counted)
    return calls


def _tokens_major(T, Hkv, D, seed, dtype=torch.float64):
    """``[T, Hkv, D]`` rows laid out as the op sees them: a view of the model's ``[1, T, Hkv, D]`` storage."""
    return torch.randn(1, T, Hkv, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)[0]


def _expected_gather(src, index, rep):
    return torch.stack([src[index, h // rep] for h in range(src.shape[1] * rep)], 1)


@pytest.mark.parametrize("rep", [1, 2, 3, 4])
@pytest.mark.parametrize("D", [5, 16, 40])
def test_gather_keys_repeats_each_kv_head_for_its_query_heads(rep, D):
    src = _tokens_major(23, 3, D, seed=rep)
    index = torch.randint(0, 23, (57,), generator=torch.Generator().manual_seed(D))
    got = key_copies.gather_keys(src, index, rep)
    assert got.shape == (57, 3 * rep, D) and got.is_contiguous()
    assert torch.equal(got, _expected_gather(src, index, rep))
    assert key_copies.gather_keys(src, index[:0], rep).shape == (0, 3 * rep, D)


def test_gather_keys_takes_any_1d_index():
    """A strided or int32 index gathers the same rows (the kernel reads a dense int64 copy); a 2-D one is refused."""
    src = _tokens_major(30, 2, 8, seed=0)
    index = torch.randint(0, 30, (40,), generator=torch.Generator().manual_seed(1))
    for idx in (index[::2], index[::2].to(torch.int32)):
        assert torch.equal(key_copies.gather_keys(src, idx, 2), _expected_gather(src, idx.long(), 2))
    with pytest.raises(ValueError, match="index must be 1-D"):
        key_copies.gather_keys(src, index.view(4, 10), 2)


@pytest.mark.parametrize("rep", [1, 2, 3])
def test_gather_keys_reads_front_rows_then_the_source(rep):
    """``front``: the index reads ``[front ; src]`` (a partition's boundary rows, then its own), each row where it
    lies; an empty front is none; a front that does not continue the source is refused."""
    src, front = _tokens_major(23, 3, 8, seed=rep), _tokens_major(9, 3, 8, seed=rep + 10)
    index = torch.randint(0, 32, (57,), generator=torch.Generator().manual_seed(rep))
    got = key_copies.gather_keys(src, index, rep, front)
    assert got.shape == (57, 3 * rep, 8) and torch.equal(got, _expected_gather(torch.cat([front, src]), index, rep))
    assert torch.equal(key_copies.gather_keys(src, index % 23, rep, front[:0]), _expected_gather(src, index % 23, rep))
    for bad in (front[:, :2], front.float(), front[None]):
        with pytest.raises(ValueError, match="do not continue src"):
            key_copies.gather_keys(src, index, rep, bad)


def test_gather_keys_refuses_what_it_cannot_expand():
    with pytest.raises(ValueError, match="rep 2 needs src"):
        key_copies.gather_keys(torch.zeros(4, 8), torch.zeros(2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="rep 0"):
        key_copies.gather_keys(torch.zeros(4, 2, 8), torch.zeros(2, dtype=torch.int64), 0)


def _plan(paths, pad_to=None):
    return vta.segment_plan(Tree.from_paths(paths).to_batch(pad_to_multiple=pad_to).subtree_end)


@pytest.mark.parametrize("rep", [1, 2, 4])
def test_sum_copies_adds_the_heads_of_a_group_with_the_copies(rep):
    """``rep`` > 1: out[t, h] = the sum over t's gathered copies and the ``rep`` heads of group h, accumulated in
    float32 and rounded once (float64 here: exact to rounding); rows past the runs zero."""
    plan = _plan(forest_paths(80, 3, seed=2), pad_to=16)
    T, G = plan.tail + 5, plan.gathered
    src = torch.randn(G, 2 * rep, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(rep))
    got = key_copies.sum_copies(src, plan.copies, plan.key_index, T, rep=rep)
    want = torch.zeros(T, 2 * rep, 6, dtype=torch.float64).index_add_(0, plan.key_index, src)
    want = want.unflatten(1, (2, rep)).sum(2)
    assert got.shape == (T, 2, 6)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)
    assert not got[plan.tail:].any()
    for bad in (0, 5):  # 2, 4 or 8 heads: not groups of 5
        with pytest.raises(ValueError, match="heads a multiple"):
            key_copies.sum_copies(src, plan.copies, plan.key_index, T, rep=bad)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (8, 2), (6, 2)])
@pytest.mark.parametrize("pad_to", [None, 16])
@pytest.mark.parametrize("keep,unkept", [("none", "segments"), ("none", "block_sparse"), ("all", "block_sparse")])
def test_expanded_kv_heads_equal_the_tree_mask(H, Hkv, pad_to, keep, unkept, monkeypatch):
    """Under ``KV_HEADS = "expanded"`` the op's out and q/k/v gradients equal the dense tree mask's in float64
    (GQA 1-4, a padding tail, rows kept or gathered again, a forward that keeps none on the segments or on the
    block-sparse plan), the kept rows are the expanded gather (``[G * rep, Hkv, D]`` views of ``[G, H, D]``), and
    the backward reads them without gathering again; a forward that keeps none gathers only on the segments."""
    monkeypatch.setattr(vta, "KV_HEADS", "expanded")
    monkeypatch.setattr(vta, "UNKEPT_FORWARD", unkept)
    b = Tree.from_paths(forest_paths(90, 3, seed=H + Hkv)).to_batch(pad_to_multiple=pad_to)
    se, T = b.subtree_end, b.seq_len
    q, k, v = _qkv(T, H, Hkv, 8, seed=pad_to or 1)
    do = torch.randn(1, H, T, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def op(q, k, v):
        return torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, se, 0.3, keep)[0]

    got = out_and_grads(op, q, k, v, do, torch.float64)
    ref = out_and_grads(lambda q, k, v: tree_attention_reference(q, k, v, se, scale=0.3), q, k, v, do, torch.float64)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=name)
    plan, rep = vta._plan(se, q), H // Hkv
    calls = _count_gathers(monkeypatch)
    qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
    res = torch.ops.treecompile.tree_attention_varlen_fwd(qq, kk, vv, se, 0.3, keep)
    res[0].backward(do)
    # kept rows: the backward does not gather again; none kept: the backward gathers, the forward on the segments too
    assert calls == [rep] * (1 if keep == "all" or unkept == "block_sparse" else 2)
    kept_k, kept_v = res[2:]
    if keep == "all":
        assert kept_k.shape == (plan.gathered * rep, Hkv, 8) == kept_v.shape
        kt = k.detach()[0].transpose(0, 1)
        assert torch.equal(kept_k.view(plan.gathered, H, 8), _expected_gather(kt, plan.key_index, rep))
    else:
        assert kept_k.shape == (0, Hkv, 8)


@pytest.mark.parametrize("pad_to", [None, 16, 512])
def test_expanded_op_writes_every_row_it_returns(pad_to, monkeypatch):
    """Under ``torch.use_deterministic_algorithms(True)`` every ``empty`` tensor starts as NaN: the expanded op's
    out and gradients are finite and the dense mask's on padded, unpadded and mostly-padding batches (a row nobody
    writes would stay NaN)."""
    from tests.helpers import deterministic_algorithms

    monkeypatch.setattr(vta, "KV_HEADS", "expanded")
    b = Tree.from_paths(forest_paths(100, 3, seed=9)).to_batch(pad_to_multiple=pad_to)
    q, k, v = _qkv(b.seq_len, 6, 2, 8, seed=9)
    do = torch.randn(1, 6, b.seq_len, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with deterministic_algorithms():
        got = out_and_grads(lambda q, k, v: torch.ops.treecompile.tree_attention_varlen_fwd(
            q, k, v, b.subtree_end, 0.3, "all")[0], q, k, v, do, torch.float64)
    ref = out_and_grads(lambda q, k, v: tree_attention_reference(q, k, v, b.subtree_end, scale=0.3), q, k, v, do,
                        torch.float64)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(x).all(), name
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("forward,backward", [("expanded", "grouped"), ("grouped", "expanded")])
def test_kept_rows_of_either_setting_serve_a_backward_under_the_other(forward, backward, monkeypatch):
    """The backward tells the kept rows' form by their count, so a setting changed between a forward and its
    backward still gives the same gradients (the setting changes how the kernel reads K/V, not the result)."""
    b = Tree.from_paths(forest_paths(70, 2, seed=4)).to_batch(pad_to_multiple=16)
    se = b.subtree_end
    q, k, v = _qkv(b.seq_len, 4, 2, 8, seed=2)
    do = torch.randn(1, 4, b.seq_len, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref = torch.autograd.grad(tree_attention_reference(q, k, v, se, scale=0.3), (q, k, v), do)
    monkeypatch.setattr(vta, "KV_HEADS", forward)
    out = torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, se, 0.3, "all")[0]
    monkeypatch.setattr(vta, "KV_HEADS", backward)
    for x, r in zip(torch.autograd.grad(out, (q, k, v), do), ref):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12)


def test_expanded_windowed_op_equals_the_gathered_one(monkeypatch):
    """The sliding-window op shares the forward and backward: expanded K/V give its gradients too."""
    b = Tree.from_paths(forest_paths(90, 3, seed=6)).to_batch(pad_to_multiple=16)
    se, pos = b.subtree_end, b.position_ids
    q, k, v = _qkv(b.seq_len, 4, 2, 8, seed=5)
    do = torch.randn(1, 4, b.seq_len, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def run():
        out = torch.ops.treecompile.tree_attention_varlen_windowed_fwd(q, k, v, se, pos, 7, 0.3, "all")[0]
        return (out, *torch.autograd.grad(out, (q, k, v), do))

    want = run()
    monkeypatch.setattr(vta, "KV_HEADS", "expanded")
    for x, r in zip(run(), want):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12)


def test_kept_rows_of_another_count_are_an_internal_error():
    plan = _plan(forest_paths(40, 2, seed=1))
    rows = torch.zeros(plan.gathered * 3, 2, 8)
    with pytest.raises(AssertionError, match="the forward kept"):
        vta._kept_keys(rows, rows, plan, 4)  # 3 copies of each row, for a group of 2
    keys, rep = vta._kept_keys(rows[:plan.gathered * 2], rows[:plan.gathered * 2], plan, 4)
    assert rep == 2 and keys[0].shape == (plan.gathered, 4, 8)


def test_an_unknown_setting_is_refused(monkeypatch):
    monkeypatch.setattr(vta, "KV_HEADS", "repeated")
    b = Tree.from_paths(forest_paths(30, 2, seed=1)).to_batch()
    q, k, v = _qkv(b.seq_len, 4, 2, 8, seed=1)
    with pytest.raises(ValueError, match="KV_HEADS: expected one of"):
        torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, b.subtree_end, 0.3, "none")


@pytest.mark.parametrize("H,Hkv,want", [(4, 4, 1), (4, 2, 2), (6, 2, 1), (8, 2, 1), (32, 8, 1), (16, 8, 2)])
def test_auto_expands_groups_of_at_most_two(H, Hkv, want):
    """The default ``"auto"`` expands a group of two query heads (measured faster in a step) and keeps larger
    groups (a group of four measured no faster); ``"expanded"`` / ``"grouped"`` force either form."""
    assert vta.KV_HEADS == "auto" and vta.EXPAND_MAX_GROUP == 2
    assert vta._kv_rep(H, Hkv) == want


@pytest.mark.parametrize("setting", ["expanded", "grouped"])
def test_forced_settings_ignore_the_group_size(setting, monkeypatch):
    monkeypatch.setattr(vta, "KV_HEADS", setting)
    assert [vta._kv_rep(H, Hkv) for H, Hkv in ((4, 2), (8, 2), (32, 8))] == (
        [2, 4, 4] if setting == "expanded" else [1, 1, 1])


@pytest.mark.parametrize("H,Hkv", [(4, 2), (8, 2)])
def test_the_default_op_expands_a_group_of_two_only(H, Hkv, monkeypatch):
    """Under the default setting the op gathers a group of two expanded and a group of four as it is, and both
    equal the dense tree mask in float64."""
    b = Tree.from_paths(forest_paths(60, 3, seed=H)).to_batch(pad_to_multiple=16)
    se = b.subtree_end
    q, k, v = _qkv(b.seq_len, H, Hkv, 8, seed=3)
    do = torch.randn(1, H, b.seq_len, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    calls = _count_gathers(monkeypatch)
    got = out_and_grads(lambda q, k, v: torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, se, 0.3, "all")[0],
                        q, k, v, do, torch.float64)
    assert calls == [2 if H // Hkv == 2 else 1]
    ref = out_and_grads(lambda q, k, v: tree_attention_reference(q, k, v, se, scale=0.3), q, k, v, do, torch.float64)
    for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("setting,rep", [("grouped", 1), ("expanded", 2), ("auto", 2)])
def test_fit_counts_the_expanded_rows(setting, rep, monkeypatch):
    """``keep="fit"`` weighs the rows it would keep: expanded, ``rep`` times the grouped bytes (the decision's
    recorded ``keys``, memory queries stubbed as in the varlen file's fit test)."""
    plan = _plan(forest_paths(40, 2, seed=1))
    k = v = torch.zeros(1, 2, 10, 8)
    assert vta.gathered_bytes(plan, k, v, 4) == 4 * vta.gathered_bytes(plan, k, v) == 4 * plan.gathered * 2 * 2 * 8 * 4
    monkeypatch.setattr(vta, "KV_HEADS", setting)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {
        "allocated_bytes": {"all": {"current": 0}}, "reserved_bytes": {"all": {"current": 0}}})
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: type("P", (), {"total_memory": 1 << 30})())
    monkeypatch.setattr(vta, "headroom_bytes", lambda device, allocator=None: 1 << 30)
    q = torch.zeros(1, 4, 10, 8)  # 4 query heads on 2 kv heads: a group of two
    vta._fit(plan, q, k, v, 0, 3, 0)
    vta._fit(plan, q, k, v, 1, 3, 0)
    assert vta.last_keys_fit.keys == rep * vta.gathered_bytes(plan, k, v)


_INTERPRETED = r"""
import torch
from treecompile import Tree
from treecompile.ops import key_copies
from treecompile.ops import varlen_tree_attention as vta
from treecompile.ops.tree_attention import tree_attention_reference
from tests.test_fa4_tree_attention import forest_paths
from tests.helpers import count_launches

gathers = count_launches(key_copies, "_gather_keys_kernel")
pairs = count_launches(key_copies, "_gather_key_values_kernel")
sums = count_launches(key_copies, "_sum_copies_kernel")
worst = {"gather": 0, "f64": 0.0, "bf16_ulps": 0.0, "configs": 0, "op": 0.0}
g = torch.Generator().manual_seed(0)
# the gather: a copy, bitwise, for groups of 2-4, head dims not a power of two, strided rows, more rows than a block
for rep, D, Hkv in [(2, 5, 3), (3, 40, 2), (4, 128, 1), (2, 33, 8)]:
    src = torch.randn(1, 50, Hkv, D, generator=g).to(torch.bfloat16)[0]
    index = torch.randint(0, 50, (77,), generator=g)
    got = key_copies.gather_keys(src, index, rep)
    want = src.index_select(0, index)[:, :, None].expand(77, Hkv, rep, D).reshape(77, Hkv * rep, D)
    worst["gather"] += not torch.equal(got, want)
    # a strided int32 index, a head slice of the rows (row and head strides of their own)
    sub = torch.randn(50, 2 * Hkv, D + 3, generator=g)[:, ::2, :D]
    worst["gather"] += not torch.equal(key_copies.gather_keys(sub, index[::2].int(), rep),
                                       sub.index_select(0, index[::2])[:, :, None].expand(-1, -1, rep, -1)
                                       .reshape(-1, Hkv * rep, D))
# the gather with front rows (a partition's boundary, ops/varlen_boundary_attention.py): each row read where it lies,
# rep 1 (a kernel launch too) to 4, an empty index, the front strided
for rep, D, Hkv, F in [(1, 16, 2, 9), (2, 5, 3, 40), (4, 33, 1, 1)]:
    src = torch.randn(1, 30, Hkv, D, generator=g).to(torch.bfloat16)[0]
    front = torch.randn(F, 2 * Hkv, D, generator=g).to(torch.bfloat16)[:, ::2]
    for index in (torch.randint(0, F + 30, (77,), generator=g), torch.zeros(0, dtype=torch.int64)):
        got = key_copies.gather_keys(src, index, rep, front)
        both = torch.cat([front, src]).index_select(0, index)
        worst["gather"] += not torch.equal(got, both[:, :, None].expand(-1, Hkv, rep, D).reshape(-1, Hkv * rep, D))
worst["gather"] += len(gathers) != 4 * 2 + 3  # every gather above ran the kernel (none for an empty index)
# keys and values in one launch: each the single gather's rows, head dims of their own, fronts strided or none
for rep, Dk, Dv, Hkv, F in [(1, 16, 8, 2, 9), (2, 5, 40, 3, 0), (4, 33, 33, 1, 1), (3, 128, 64, 2, 40)]:
    k = torch.randn(1, 30, Hkv, Dk, generator=g).to(torch.bfloat16)[0]
    v = torch.randn(30, 2 * Hkv, Dv, generator=g).to(torch.bfloat16)[:, ::2]  # a head stride of its own
    front = None
    if F:
        front = (torch.randn(F, 2 * Hkv, Dk, generator=g).to(torch.bfloat16)[:, ::2],
                 torch.randn(F, Hkv, Dv, generator=g).to(torch.bfloat16))
    index = torch.randint(0, F + 30, (77,), generator=g)
    got = key_copies.gather_key_values(k, v, index, rep, front)
    want = [key_copies.gather_keys(x, index, rep, None if front is None else front[i]) for i, x in enumerate((k, v))]
    worst["gather"] += sum(not torch.equal(a, b) for a, b in zip(got, want))
worst["gather"] += len(pairs) != 4  # one launch each
# the sums with the heads of a group: float64 to rounding, bf16 within one unit of the exact sum, every config the same
plan = vta.segment_plan(Tree.from_paths([[1] * 70 + [2 + i] * 5 for i in range(48)]).to_batch(
    pad_to_multiple=16).subtree_end)
for rep, D in [(2, 24), (4, 40), (3, 16)]:
    for dtype in (torch.float64, torch.bfloat16):
        src = torch.randn(plan.gathered, 2 * rep, D, generator=g).to(dtype)
        outs = [key_copies.sum_copies(src, plan.copies, plan.key_index, plan.tail + 7, config=c, rep=rep)
                for c in key_copies.CONFIGS]
        worst["configs"] += sum(not torch.equal(o, outs[0]) for o in outs)
        want = torch.zeros(plan.tail + 7, 2 * rep, D, dtype=torch.float64).index_add_(0, plan.key_index, src.double())
        want = want.unflatten(1, (2, rep)).sum(2)
        if dtype == torch.float64:
            worst["f64"] = max(worst["f64"], float((outs[0] - want).abs().max() / want.abs().max()))
        else:
            ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=1e-30))) - 7)
            worst["bf16_ulps"] = max(worst["bf16_ulps"],
                                     float(((outs[0].double() - want).abs() / (ulp + 1e-6 * want.abs().max())).max()))
# the op, expanded, in float64 with both kernels: the dense tree mask's gradients, every new tensor NaN-filled
# (deterministic mode) so that a row no kernel writes would show
vta.KV_HEADS = "expanded"
paired = len(pairs)
torch.use_deterministic_algorithms(True)
for it in range(4):
    b = Tree.from_paths(forest_paths(120, 3, seed=it)).to_batch(pad_to_multiple=[None, 16][it % 2])
    T, H, Hkv = b.seq_len, [4, 6][it % 2], 2
    q, k, v = (torch.randn(1, T, h, 8, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
               for h in (H, Hkv, Hkv))
    do = torch.randn(1, H, T, 8, generator=g, dtype=torch.float64)
    out = torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, b.subtree_end, 0.3, ["none", "all"][it // 2])[0]
    got = torch.autograd.grad(out, (q, k, v), do)
    ref = torch.autograd.grad(tree_attention_reference(q, k, v, b.subtree_end, scale=0.3), (q, k, v), do)
    for x, r in zip(got, ref):
        worst["op"] = max(worst["op"], float((x - r).abs().max() / r.abs().max()))  # NaN fails the comparison
        worst["op"] = worst["op"] if bool(torch.isfinite(x).all()) else float("inf")
# the op's keys and values: one launch per forward, and per backward that did not keep them
assert len(pairs) - paired >= 4 + 2 and len(sums) >= 3 * 2 * len(key_copies.CONFIGS), (len(pairs), len(sums))
print(repr(worst))
"""


def test_expanded_kernels_in_interpreter():
    """The gather and the grouped copy sums through their Triton kernels (Triton's CPU interpreter): the gather is
    the broadcast rows bit for bit, and keys and values gathered in one launch are each the single gather's rows; the
    sums in float64 within rounding of the exact sum and in bf16 within one bf16 unit (float32 accumulation, rounded
    once; the interpreter truncates), the same bits under every config; the op expanded in float64 with both kernels
    equals the dense tree mask, with every new tensor NaN-filled (deterministic mode).  (Triton 3.6's interpreter
    needs numpy < 2 for the sums' loop over loaded bounds.)"""
    pytest.importorskip("triton")
    worst = run_interpreted(_INTERPRETED)
    assert worst["gather"] == 0 and worst["configs"] == 0, worst
    assert worst["f64"] < 1e-14 and worst["bf16_ulps"] <= 1.0 and worst["op"] < 1e-12, worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rep", [1, 2, 4])
def test_expanded_kernels_on_cuda(rep):
    """The gather bitwise on CUDA (keys and values in one launch too); the grouped sums of bf16 rows within float32
    accumulation's error (a float32 unit of the terms' magnitudes per term) plus half a bf16 unit (the GPU rounds to
    nearest) of the float64 sum.  (rep 1: the plain sums, each tile's run found by the kernel's binary search over the
    forest's runs.)"""
    plan = vta.segment_plan(Tree.from_paths(forest_paths(600, 4, seed=rep)).to_batch(pad_to_multiple=64)
                            .subtree_end.cuda())
    g = torch.Generator(device="cuda").manual_seed(rep)
    src = torch.randn(1, plan.tail + 9, 8 // rep, 128, generator=g, device="cuda").to(torch.bfloat16)[0]
    got = key_copies.gather_keys(src, plan.key_index, rep)
    assert torch.equal(got, src.index_select(0, plan.key_index)[:, :, None].expand(-1, -1, rep, -1).flatten(1, 2))
    front = torch.randn(1, 300, 8 // rep, 128, generator=g, device="cuda").to(torch.bfloat16)[0]  # boundary rows
    index = torch.randint(0, 300 + src.shape[0], (5000,), generator=g, device="cuda")
    got = key_copies.gather_keys(src, index, rep, front)
    both = torch.cat([front, src]).index_select(0, index)
    assert torch.equal(got, both[:, :, None].expand(-1, -1, rep, -1).flatten(1, 2))
    # keys and values in one launch (values of head dim 64 here, strided): each the single gather's rows
    pair = key_copies.gather_key_values(src, src[:, :, :64], index, rep, (front, front[:, :, :64]))
    assert torch.equal(pair[0], got)
    assert torch.equal(pair[1], key_copies.gather_keys(src[:, :, :64], index, rep, front[:, :, :64]))
    rows = torch.randn(plan.gathered, 8, 128, generator=g, device="cuda").to(torch.bfloat16)
    out = key_copies.sum_copies(rows, plan.copies, plan.key_index, plan.tail + 9, rep=rep)
    want = torch.zeros(plan.tail + 9, 8, 128, dtype=torch.float64, device="cuda").index_add_(
        0, plan.key_index, rows.double()).unflatten(1, (8 // rep, rep)).sum(2)
    mag = torch.zeros(plan.tail + 9, 8, 128, dtype=torch.float64, device="cuda").index_add_(
        0, plan.key_index, rows.double().abs()).unflatten(1, (8 // rep, rep)).sum(2)
    copies = torch.bincount(plan.key_index, minlength=plan.tail + 9)[:, None, None] * rep
    bound = mag * copies * 2.0 ** -24 + want.abs() * 2.0 ** -8  # + half a bf16 unit of the sum (round to nearest)
    assert ((out.double() - want).abs() <= bound + 1e-30).all()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("T,roots,pad_to,H,Hkv,D", [(1000, 3, 1024, 4, 2, 128), (2900, 1, 3072, 16, 8, 128),
                                                   (700, 1, None, 8, 2, 64)])
@pytest.mark.parametrize("keep", ["none", "all"])
def test_fa4_expanded_kv_heads_vs_fp64_oracle(T, roots, pad_to, H, Hkv, D, keep, monkeypatch):
    """FA4 over the segments with K/V expanded to the query heads: bf16 output and q/k/v gradients within 2x the
    bf16 dense kernel's error against the float64 dense-mask oracle (rows kept for the backward or gathered again)."""
    from tests.test_fa4_tree_attention import assert_bf16_tree_kernel_near_oracle

    monkeypatch.setattr(vta, "KV_HEADS", "expanded")
    monkeypatch.setattr(vta, "VARLEN_GATHER_LIMIT", float("inf"))
    kept = []

    def attend(b, scale):
        def fn(q, k, v):
            res = torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, b.subtree_end, scale, keep)
            kept.append((res[2].shape[0], vta._plan(b.subtree_end, q).gathered))
            return res[0]
        return fn

    assert_bf16_tree_kernel_near_oracle(attend, T, roots, pad_to, H, Hkv, D)
    if keep == "all":  # the expanded rows, H // Hkv per gathered row
        assert kept and all(n == G * (H // Hkv) > 0 for n, G in kept), kept


def test_expanded_op_opcheck(monkeypatch):
    monkeypatch.setattr(vta, "KV_HEADS", "expanded")
    b = Tree.from_paths(forest_paths(40, 2, seed=3)).to_batch(pad_to_multiple=8)
    q, k, v = (x.detach().requires_grad_() for x in _qkv(b.seq_len, 4, 2, 8, seed=0))
    torch.library.opcheck(torch.ops.treecompile.tree_attention_varlen_fwd.default,
                          (q, k, v, b.subtree_end, 0.35, "all"))


def test_lowered_model_with_expanded_kv_heads_equals_the_rewritten_graph(monkeypatch):
    """The tiny model lowered to the varlen op, its rows kept, run with K/V expanded: loss, log-probs and every
    gradient as the rewritten graph's (CPU, float64, reference kernels)."""
    from helpers import cached_compile, cached_model, tiny_dense
    from tests.test_varlen_tree_attention import _assert_lowered_equals_rewritten, _lower_fa4_varlen

    model = cached_model("dense-tiny", tiny_dense)
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # GQA: something to expand
    prog = cached_compile(model).program
    low = _lower_fa4_varlen(prog, monkeypatch, attention_keys="kept")
    monkeypatch.setattr(vta, "KV_HEADS", "expanded")
    reps = []
    real = key_copies.gather_key_values
    monkeypatch.setattr(vta, "gather_key_values",
                        lambda k, v, index, rep=1, front=None: reps.append(rep) or real(k, v, index, rep, front))
    _assert_lowered_equals_rewritten(prog, low)
    assert reps and set(reps) == {model.config.num_attention_heads // model.config.num_key_value_heads}


@pytest.mark.parametrize("rep", [1, 2, 3])
@pytest.mark.parametrize("with_front", [False, True])
def test_gather_key_values_equals_a_gather_of_each(rep, with_front):
    """Keys and values under one index (head dims of their own, strided rows, front rows or none) are each
    :func:`gather_keys`' rows; fronts of different lengths, or sources with different kv heads, gather each alone."""
    k, v = _tokens_major(23, 3, 8, seed=rep), torch.randn(23, 6, 6, dtype=torch.float64)[:, ::2]
    fk = fv = None
    if with_front:
        fk, fv = _tokens_major(9, 3, 8, seed=rep + 10), _tokens_major(9, 3, 6, seed=rep + 20)
    index = torch.randint(0, 32 if with_front else 23, (57,), generator=torch.Generator().manual_seed(rep))
    got = key_copies.gather_key_values(k, v, index, rep, (fk, fv) if with_front else None)
    assert torch.equal(got[0], key_copies.gather_keys(k, index, rep, fk))
    assert torch.equal(got[1], key_copies.gather_keys(v, index, rep, fv))
    if with_front:
        got = key_copies.gather_key_values(k, v, index % 28, rep, (fk, fv[:5]))
        assert torch.equal(got[1], key_copies.gather_keys(v, index % 28, rep, fv[:5]))
        with pytest.raises(ValueError, match="do not continue src"):
            key_copies.gather_key_values(k, v, index, rep, (fk, fk))
