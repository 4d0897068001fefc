"""treecompile.host_values: a batch's tree tensors keep their host values when moved, so the CUDA ops'
plans read no device tensor back (a blocking copy mid-step).  On the CPU the "device" is ``meta``: a meta
tensor has no values, so a plan built from a meta batch proves it read none from the device."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from treecompile import Tree
from treecompile.host_values import (_HOST, SINGLE_THREAD_ROWS, host_copy, remember_host, remembered_host, repeat_counts,
                                     single_threaded, single_threaded_for, to_device_with_host)
from treecompile.tree import _TENSOR_FIELDS


def _paths(seed=0, n=6):
    rng = random.Random(seed)
    paths = [[rng.randrange(50) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    return paths + [p[:rng.randint(1, len(p))] + [rng.randrange(50) for _ in range(rng.randint(1, 9))] for p in paths]


def test_host_values_follow_the_same_unchanged_tensor_only():
    t = torch.arange(7)
    d = to_device_with_host(t, "meta")
    assert d.device.type == "meta" and torch.equal(host_copy(d), t)
    t.add_(100)  # the remembered values are a private copy
    assert torch.equal(remembered_host(d), torch.arange(7))
    assert remembered_host(d.clone()) is None and remembered_host(d.view(7)) is None  # another tensor object
    d.add_(1)  # an in-place write bumps the version counter: the record no longer applies
    assert remembered_host(d) is None
    c = torch.arange(3)
    assert to_device_with_host(c, "cpu") is c and host_copy(c) is c  # no copies on the host
    with pytest.raises(ValueError, match=r"shape \(7,\) and dtype torch.int64"):
        remember_host(d, torch.zeros(6, dtype=torch.long))


def test_record_goes_with_its_tensor():
    d = to_device_with_host(torch.arange(5), "meta")
    key = id(d)
    assert _HOST[key][0]() is d
    del d
    gc.collect()
    assert key not in _HOST


@pytest.mark.parametrize("extra", [0, 1, 37])
def test_moved_and_padded_batch_keeps_host_values(extra):
    host = Tree.from_paths(_paths(1)).to_batch()
    moved = host.to("meta")
    padded = moved.padded(moved.seq_len + extra)
    want = host.padded(host.seq_len + extra)
    for f in _TENSOR_FIELDS:
        got = getattr(padded, f)
        assert got.device.type == "meta" and torch.equal(remembered_host(got), getattr(want, f)), f
    assert padded.num_tokens == host.num_tokens and padded.tree is host.tree


def test_plans_of_a_moved_batch_read_nothing_from_the_device():
    """The varlen attention's plans, the fla GDN call plan and the conv tables, built from a meta batch, equal
    the same plans built from the host batch (a device read would raise: meta tensors hold no values)."""
    from treecompile.ops import fla_conv, fla_gdn, tree_conv_shifts, tree_layout
    from treecompile.ops import varlen_tree_attention as vta

    host = Tree.from_paths(_paths(2)).to_batch(pad_to_multiple=64)
    dev = host.to("meta").padded(host.seq_len + 64)
    host = host.padded(host.seq_len + 64)
    for block_sparse in (False, True):
        a = vta.tree_attention_plan(dev.subtree_end, block_sparse=block_sparse)
        b = vta.tree_attention_plan(host.subtree_end, block_sparse=block_sparse)
        assert type(a) is type(b) and a.gathered == b.gathered
    assert vta.segments_fit(dev.subtree_end) == vta.segments_fit(host.subtree_end)
    nodes = (dev.node_start, dev.node_end, dev.node_parent)
    assert fla_gdn._segments(*nodes) == fla_gdn._segments(host.node_start, host.node_end, host.node_parent)
    assert fla_gdn.plan_calls(*nodes).index.device.type == "meta"
    from treecompile.ops.fla_gdn_levels import level_tensors

    in_place = level_tensors(fla_gdn.plan_calls(*nodes, replay_max=0), 64, in_place=True)  # reads the sources
    host_plan = fla_gdn.plan_calls(host.node_start, host.node_end, host.node_parent, replay_max=0)
    assert in_place.in_place and len(in_place.calls) == host_plan.calls > 1
    assert tree_conv_shifts.context_exceptions(dev.conv_index).token.device.type == "meta"
    assert torch.equal(fla_conv.conv_segments(dev.conv_index, 2).cu_seqlens_cpu,
                       fla_conv.conv_segments(host.conv_index, 2).cu_seqlens_cpu)
    assert tree_layout.heavy_first_order(dev.subtree_end).device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [False, True])
def test_cuda_copy_remembers_a_private_host_copy(pinned):
    """Through pinned staging (a pinned source, as a DataLoader's pin_memory gives, is copied, not reused)."""
    t = torch.arange(9).pin_memory() if pinned else torch.arange(9)
    d = to_device_with_host(t, "cuda")
    t.add_(100)
    assert torch.equal(remembered_host(d), torch.arange(9)) and torch.equal(d.cpu(), torch.arange(9))


def _same_bucket_trees(vocab: int):
    """Two different trees in one length bucket (one compiled graph for both)."""
    from treecompile.program import bucket_length

    trees = []
    for seed, tail in ((0, 40), (1, 50)):  # 320 + 6 x 40 = 560 and 320 + 6 x 50 = 620 tokens, bucket 768
        rng = random.Random(seed)
        trunk = [rng.randrange(vocab) for _ in range(320)]
        paths = [trunk]
        for cut in (30, 80, 130, 180, 230, 280):  # each branch leaves the trunk at its own token
            paths.append(trunk[:cut] + [(trunk[cut] + 1) % vocab] + [rng.randrange(vocab) for _ in range(tail - 1)])
        trees.append(Tree.from_paths(paths))
    assert [t.num_tokens for t in trees] == [560, 620]
    assert bucket_length(560) == bucket_length(620)
    return trees


def _gpu_model_reason(kind: str) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from treecompile.ops.fa4_tree_attention import fa4_unusable_reason

    if kind == "hybrid":
        from treecompile.ops.fla_gdn_levels import levels_unusable_reason

        return fa4_unusable_reason() or levels_unusable_reason()
    return fa4_unusable_reason()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_compiled_step_on_a_moved_batch_does_not_wait_for_the_gpu(kind):
    """Forward and backward of a compiled tree step (FA4 varlen attention; for the hybrid, the levelled fla GDN
    and the conv tables) on a batch moved by ``TreeBatch.to``: no call waits for the GPU (CUDA's sync debug mode
    raises on any), once the length bucket's graph is compiled."""
    reason = _gpu_model_reason(kind)
    if reason:
        pytest.skip(reason)
    import treecompile
    from treecompile.models import DenseConfig, DenseForCausalLM, HybridConfig, HybridForCausalLM

    torch.manual_seed(0)
    if kind == "dense":
        model = DenseForCausalLM(DenseConfig.tiny(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                                  num_key_value_heads=2, head_dim=128))
    else:
        # the GDN layer shape of Qwen3.5-35B-A3B (16 key / 32 value heads of 128): tilelang kernels already built
        model = HybridForCausalLM(HybridConfig.tiny(hidden_size=256, intermediate_size=512, head_dim=256,
                                                    num_attention_heads=4, num_key_value_heads=2,
                                                    linear_key_head_dim=128, linear_value_head_dim=128,
                                                    linear_num_key_heads=16, linear_num_value_heads=32))
    model = model.cuda().to(torch.bfloat16)
    tm = treecompile.compile(model)
    first, second = _same_bucket_trees(model.config.vocab_size)
    threads = torch.get_num_threads()
    tm(first.to_batch().to("cuda")).loss.backward()  # compiles the bucket's graph
    torch.cuda.synchronize()
    batch = second.to_batch().to("cuda")
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = tm(batch)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(out.loss.detach()).item()
    # the host plans ran on one intra-op thread (host_values.single_threaded) and gave the count back before the
    # graph's entry, whose guards hold it: no recompile, the caller's count after the step
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles
    assert torch.get_num_threads() == threads


def _tables():
    """Tables of every kind a plan sends: lists of int64 and int32 values of odd lengths (extremes included), empty
    lists, a 2-D int64 tensor over the staging alignment, an empty [0, 4] tensor, a non-contiguous view."""
    return [[5, -(2 ** 63), 2 ** 63 - 1], [7, -2, 3, 2 ** 31 - 1, -(2 ** 31)], [], torch.arange(300).view(75, 4), [],
            torch.zeros(0, 4, dtype=torch.int64), list(range(70)), torch.arange(12).view(3, 4).T, [1]]


INT32 = (1, 4, 8)  # the tables of _tables() sent as int32


def _check_tables(tables, out, device):
    """Each table came back equal, on ``device``, with its dtype (int32 where asked) and shape, contiguous, as a view
    of one buffer at an aligned offset; no two share a byte."""
    from treecompile import host_values

    assert len(out) == len(tables)
    spans = []
    for i, (t, o) in enumerate(zip(tables, out)):
        want = t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=torch.int32 if i in INT32 else torch.int64)
        assert o.device.type == device and o.dtype == want.dtype and o.shape == want.shape and o.is_contiguous()
        assert torch.equal(o.cpu(), want)
        assert o.untyped_storage().data_ptr() == out[0].untyped_storage().data_ptr()  # one buffer
        start = o.storage_offset() * o.element_size()
        assert start % host_values.STAGING_ALIGN == 0
        assert device != "cuda" or o.data_ptr() % host_values.STAGING_ALIGN == 0  # (the CUDA allocator aligns blocks)
        spans.append((start, start + o.numel() * o.element_size()))
    spans = sorted(s for s in spans if s[1] > s[0])
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two tables share a byte


def test_tables_sent_together_keep_dtype_shape_values_and_alignment():
    """``to_device_tables`` on the CPU: each list comes back as int64 (int32 where asked) and each tensor with its
    shape, equal, as views of one buffer at offsets aligned to ``STAGING_ALIGN`` bytes, not overlapping; the tables
    are copies (the caller's tensors may change after).  Values out of a table's dtype, anything but an int64 host
    tensor, and non-integers are refused naming the table."""
    from treecompile import host_values

    tables = _tables()
    out = host_values.to_device_tables(tables, "cpu", int32=INT32)
    _check_tables(tables, out, "cpu")
    tables[3].add_(100)  # the sent copy is the device's own, not the caller's table
    assert torch.equal(out[3], torch.arange(300).view(75, 4))
    assert host_values.to_device_tables([], "cpu") == ()
    assert [t.tolist() for t in host_values.to_device_tables([[], []], "cpu")] == [[], []]
    for bad, match in (([[1], [2 ** 31]], "table 1 is not a list of torch.int32"),
                       ([[2 ** 63]], "table 0 is not a list"), ([[1.5]], "table 0 is not a list"),
                       ([[1], torch.arange(3, dtype=torch.int32)],
                        "table 1: expected an int64 host tensor, got torch.int32"),
                       ([torch.arange(3, device="meta")], "table 0: expected an int64 host tensor")):
        with pytest.raises(ValueError, match=match):
            host_values.to_device_tables(bad, "cpu", int32=(1,) if len(bad) > 1 and isinstance(bad[1], list) else ())
    for int32 in ((1,), (2,), (-1,)):  # a tensor table, or none at all
        with pytest.raises(ValueError, match=r"int32 names tables \["):
            host_values.to_device_tables([[1], torch.arange(2)], "cpu", int32=int32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tables_sent_together_reach_cuda_in_one_copy_without_waiting():
    """On CUDA: the tables arrive equal, in one device buffer, each at an aligned address, and the copy does not
    wait for the GPU's queue (CUDA's sync debug mode raises on a blocking copy)."""
    from treecompile import host_values

    tables = _tables()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = host_values.to_device_tables(tables, "cuda", int32=INT32)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    _check_tables(tables, out, "cuda")


def test_to_device_sends_host_tables_without_a_blocking_copy(monkeypatch):
    """``to_device``: a host tensor goes to another device through ``to_device_async`` (pinned, non-blocking: a
    pageable ``.to`` would wait for the GPU's queue), cast first where a dtype is given; a tensor already there is
    itself; the values are the same (the router losses' and the objectives' host tables go this way)."""
    from treecompile import host_values

    moved = []
    monkeypatch.setattr(host_values, "to_device_async", lambda x, device: moved.append((x, device)) or x)
    x = torch.arange(4)
    assert host_values.to_device(x, torch.device("cpu")) is x and not moved  # same device: nothing moved
    out = host_values.to_device(x, torch.device("meta"), torch.float64)  # host -> another device: async
    assert len(moved) == 1 and moved[0][1] == torch.device("meta") and out.dtype == torch.float64
    assert torch.equal(out, x.double())


@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.sampled_from([torch.int64, torch.float64]),
       st.integers(1, 3))
def test_repeat_counts_equals_repeat_interleave(counts, dtype, width):
    """``repeat_counts`` == ``torch.repeat_interleave(values, counts, dim=0)``: zero counts anywhere (first, last,
    runs of them), 1-D and 2-D values, integer and float values (gathered, so floats are exact)."""
    c = torch.tensor(counts)
    values = torch.randn(len(counts), width, dtype=torch.float64).to(dtype)
    for v in (values[:, 0], values):
        want = torch.repeat_interleave(v, c, dim=0)
        assert torch.equal(repeat_counts(v, c), want)
        assert torch.equal(repeat_counts(v, c.to(torch.int32), int(c.sum())), want)


def test_repeat_counts_refuses_what_repeat_interleave_refuses():
    v = torch.arange(3)
    with pytest.raises(ValueError, match="negative count -1 at 1"):
        repeat_counts(v, torch.tensor([1, -1, 2]))
    with pytest.raises(ValueError, match="total 5 but the counts sum to 4"):
        repeat_counts(v, torch.tensor([1, 1, 2]), 5)
    with pytest.raises(ValueError, match=r"values \[n, \.\.\.\] and counts \[n\]"):
        repeat_counts(v, torch.tensor([1, 1]))
    assert repeat_counts(torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)).shape == (0, 2)


def test_host_plans_never_call_repeat_interleave(monkeypatch):
    """The plans built inside a step (the tree batch, the varlen attention's segments and their copy runs, the
    heavy-first layout, the conv segments, path-level objectives' tables) do not call ``torch.repeat_interleave``,
    whose CPU kernel wakes every intra-op thread per call (``repeat_counts``)."""
    from treecompile.ops import varlen_tree_attention as V
    from treecompile.ops.tree_layout import heavy_first_order

    rng = random.Random(5)
    paths = [[1, 2, 3, 4]]
    for _ in range(40):  # a deep tree of short branches (several segments, nested)
        base = rng.choice(paths)
        paths.append(base[:rng.randint(1, len(base))] + [rng.randint(1, 50) for _ in range(rng.randint(1, 6))])

    def refuse(*a, **k):
        raise AssertionError("torch.repeat_interleave called in a host plan")

    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    tree = Tree.from_paths(paths)
    batch = tree.to_batch(normalize="token_mean")
    tree.token_weights("token_mean")
    tree.trained_counts()
    plan = V.tree_attention_plan(batch.subtree_end, block_sparse=False)
    assert isinstance(plan, V.SegmentPlan) and len(plan.cu_seqlens_q_host) > 3
    heavy_first_order(batch.subtree_end)


@pytest.fixture
def two_threads():
    """torch at two intra-op threads for the test (restored: dynamo guards the count); OpenMP builds only (torch's
    native pool cannot resize, and single_threaded leaves it alone)."""
    import treecompile.host_values as hv

    if not hv._openmp():
        pytest.skip("torch's intra-op threads are not OpenMP's here")
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


def test_single_threaded_runs_one_thread_and_restores_the_count(two_threads):
    with single_threaded():
        assert torch.get_num_threads() == 1
        with single_threaded():  # nested: still one, and the outer count comes back at the outer exit only
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(KeyError):
        with single_threaded():
            raise KeyError("x")
    assert torch.get_num_threads() == 2

    @single_threaded()
    def inside():
        return torch.get_num_threads()

    assert inside() == 1 and inside() == 1 and torch.get_num_threads() == 2
    # above the size bound the kernels are long enough for the threads: the count stays
    with single_threaded(SINGLE_THREAD_ROWS):
        assert torch.get_num_threads() == 1
    with single_threaded(SINGLE_THREAD_ROWS + 1):
        assert torch.get_num_threads() == 2

    @single_threaded_for(lambda rows, **_: rows)
    def sized(rows, *, tag=None):
        return torch.get_num_threads(), tag

    assert sized(10, tag="a") == (1, "a") and sized(SINGLE_THREAD_ROWS + 1) == (2, None)
    assert sized.__name__ == "sized" and torch.get_num_threads() == 2


def test_single_threaded_leaves_a_native_thread_pool_alone(two_threads, monkeypatch):
    """torch's native pool (no OpenMP) cannot resize once used and warns: no change there."""
    import treecompile.host_values as hv

    monkeypatch.setattr(hv, "_openmp", lambda: False)
    with single_threaded():
        assert torch.get_num_threads() == 2


def test_per_step_host_work_runs_single_threaded(two_threads):
    """Every torch op of the tree batch, its padding, its id check and the ops' plans (``LastBatch``) runs on one
    intra-op thread; the count is back after each."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from treecompile.ops import varlen_tree_attention as V
    from treecompile.ops.last_batch import LastBatch

    class Threads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(torch.get_num_threads())
            return func(*args, **(kwargs or {}))

    tree = Tree.from_paths([[1, 2, 3], [1, 2, 4, 5], [1, 6]], loss_masks=[[0, 1, 1], [0, 0, 1, 1], [0, 1]])
    calls = {"to_batch": lambda: tree.to_batch(normalize="token_mean")}
    batch = calls["to_batch"]()
    se = batch.subtree_end.clone()
    calls.update(padded=lambda: batch.padded(16), check_ids=lambda: batch.check_ids(10),
                 plan=lambda: V._PLANS.get((se,), False, lambda: V._build_plan(se, False)),
                 cache=lambda: LastBatch().get((se,), None, lambda: se + 1))
    for name, call in calls.items():
        with Threads() as mode:
            call()
        assert mode.seen and set(mode.seen) == {1}, (name, mode.seen)
        assert torch.get_num_threads() == 2, name


def test_plans_inside_a_compiled_region_cause_no_recompile(two_threads):
    """dynamo guards the intra-op thread count (a call made with another count compiles again: checked here, so
    that the premise stays true on a new torch); a plan built on one thread inside the compiled region's op gives
    the count back before the region returns, so the next call reuses the graph."""
    from treecompile.ops.last_batch import LastBatch

    plans = LastBatch()

    @torch.library.custom_op("treecompile_test::planned_double", mutates_args=())
    def planned_double(x: torch.Tensor) -> torch.Tensor:
        plan = plans.get((x,), None, lambda: torch.get_num_threads())
        assert plan == 1
        return x * 2

    @planned_double.register_fake
    def _(x):
        return torch.empty_like(x)

    f = torch.compile(lambda x: planned_double(x) + 1, backend="eager", dynamic=False)
    counts = torch._dynamo.utils.counters["stats"]
    f(torch.ones(4))
    first = counts["unique_graphs"]
    for _ in range(3):
        assert torch.equal(f(torch.ones(4)), torch.full((4,), 3.0)) and torch.get_num_threads() == 2
    assert counts["unique_graphs"] == first
    torch.set_num_threads(1)  # the premise: another count at the entry compiles again
    f(torch.ones(4))
    assert counts["unique_graphs"] == first + 1
