"""The hybrid baselines of the benchmark harness on CPU: packed == per path (loss and every gradient)."""

import copy
import itertools

import pytest
import torch

from benchmarks import harness
from benchmarks.hybrid_baselines import Pack, hook_values, reset_conv1d
from benchmarks.trees import synthetic_paths


def run(spec_name, contender, paths, capacity, model=None):
    """``contender``'s step on a fresh ``spec_name`` model (float64, seed 0), or on ``model``."""
    spec = harness.model_specs()[spec_name]
    if model is None:
        torch.manual_seed(0)
        model = spec.build(torch.device("cpu"), torch.float64)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    case = harness.TreeCase("t", "synthetic", None, tuple(map(tuple, paths)))
    cfg = harness.BenchConfig(device="cpu", dtype=dtype, iters=1, capacity=capacity, compile_baselines=False)
    steps = harness.Steps(model, spec, case, cfg, {})
    before = hook_values(model)
    assert before  # every spec here is a hybrid
    loss = float(getattr(steps, contender)()())
    # the hooks are restored after the step: the model stays unmodified for the tree contender
    assert before == hook_values(model)
    assert torch.nn.functional.scaled_dot_product_attention is harness._ORIG_SDPA
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads, model, steps


F32_TINY = torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("spec_name", ["hybrid-tiny", "hybrid-moe-tiny", "hf-qwen3.5-moe-tiny"])
@pytest.mark.parametrize("capacity", [40, 10_000], ids=["several_packs", "one_pack"])
def test_packed_hybrid_equals_per_path(spec_name, capacity):
    """The packed step (the reference GDN once per sequence, a dense document mask) equals each path run alone:
    ours to 1e-9; HF's Qwen3.5-MoE (whose GDN layers call their modeling module's globals, not instance
    attributes) within the per-path run's own rounding: HF computes its GDN, RMSNorm and router in float32
    inside the float64 model, so the bound is 2x the per-path run's distance to the same model run all in
    float32 (which rounds wherever HF64 rounds; as ``test_compile_hybrid``'s HF checks)."""
    if spec_name.startswith("hf-"):
        pytest.importorskip("transformers")
    paths = synthetic_paths(6, 23, 0.5, vocab=512, seed=3) + [[5, 6, 7]]  # odd lengths, a 3-token path
    ref_loss, ref_grads, model, _ = run(spec_name, "eager_per_path", paths, capacity)
    loss, grads, _, steps = run(spec_name, "packed_fla_varlen", paths, capacity)
    assert "attention" in steps.note
    assert grads.keys() == ref_grads.keys()
    if not spec_name.startswith("hf-"):
        assert abs(loss - ref_loss) <= 1e-9 * abs(ref_loss)
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-9, atol=1e-12, msg=n)
        return
    model.zero_grad(set_to_none=True)
    loss32, grads32, *_ = run(spec_name, "eager_per_path", paths, capacity, model=copy.deepcopy(model).float())
    assert abs(loss - ref_loss) <= 2 * abs(loss32 - ref_loss) + 1e-12 * abs(ref_loss)
    for n, g in ref_grads.items():
        err, noise = float((grads[n] - g).norm()), float((grads32[n].double() - g).norm())
        assert err <= 2 * noise + 1e-12 * float(g.norm()) + F32_TINY, (n, err, noise)


def test_packed_with_a_varlen_conv_equals_per_path():
    """``conv="fla"`` (``packed_fla_varlen_conv`` on CUDA): the conv hook hands fla's varlen ``causal_conv1d``
    the pack's sequence bounds; with a float64 torch stand-in for that function the step is per-path exact."""
    import torch.nn.functional as F

    from benchmarks import hybrid_baselines as hb

    calls = []

    def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, cu_seqlens_cpu=None):
        assert x.shape[0] == 1 and torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
        assert int(cu_seqlens_cpu[-1]) == x.shape[1]
        calls.append(len(cu_seqlens_cpu) - 1)
        K = weight.shape[1]
        outs = [F.conv1d(x[:, s:e].transpose(1, 2), weight[:, None], bias, padding=K - 1, groups=weight.shape[0])
                [..., :e - s].transpose(1, 2) for s, e in itertools.pairwise(cu_seqlens_cpu.tolist())]
        y = torch.cat(outs, 1)
        return (F.silu(y) if activation in ("silu", "swish") else y), None

    paths = synthetic_paths(6, 23, 0.5, vocab=512, seed=3) + [[5, 6, 7]]
    ref_loss, ref_grads, _, _ = run("hybrid-tiny", "eager_per_path", paths, 40)
    spec = harness.model_specs()["hybrid-tiny"]
    torch.manual_seed(0)
    model = spec.build(torch.device("cpu"), torch.float64)
    case = harness.TreeCase("t", "synthetic", None, tuple(map(tuple, paths)))
    cfg = harness.BenchConfig(device="cpu", dtype="float64", iters=1, capacity=40, compile_baselines=False)
    steps = harness.Steps(model, spec, case, cfg, {})
    loss = float(hb.packed_fla_varlen(steps, 40, conv="fla", causal_conv1d=causal_conv1d)())
    # 6 packs of <= 40 tokens (each 23-token path alone, the 3-token path with one of them), each padded to one
    # length: 2-3 sequences per call, one call per GDN layer and pack
    n_gdn = sum(type(m).__name__ == "GatedDeltaNet" for m in model.modules())
    assert "conv: fla varlen" in steps.note and len(calls) == n_gdn * 6
    assert set(calls) == {2, 3}
    assert abs(loss - ref_loss) <= 1e-9 * abs(ref_loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-9, atol=1e-12, msg=n)
    with pytest.raises(ValueError, match="conv"):
        hb.packed_fla_varlen(steps, 40, conv="shifted")


def test_packing_without_resets_is_not_per_path():
    """Near miss: the same packs with the conv and GDN state carried across sequences differ."""
    from benchmarks import hybrid_baselines as hb
    from models.hybrid import causal_conv1d_fn

    paths = synthetic_paths(4, 17, 0.3, vocab=512, seed=1)
    ref_loss, *_ = run("hybrid-tiny", "eager_per_path", paths, 10_000)
    saved = hb._varlen_gdn_reference, hb.reset_conv1d
    try:
        hb._varlen_gdn_reference = lambda orig: orig  # one sequence for the whole pack
        hb.reset_conv1d = causal_conv1d_fn
        loss, *_ = run("hybrid-tiny", "packed_fla_varlen", paths, 10_000)
    finally:
        hb._varlen_gdn_reference, hb.reset_conv1d = saved
    assert abs(loss - ref_loss) > 1e-6 * abs(ref_loss)


def test_reset_conv_equals_conv_per_sequence():
    from models.hybrid import causal_conv1d_fn

    gen = torch.Generator().manual_seed(0)
    seqs = [5, 1, 9, 2]
    x = torch.randn(1, 6, sum(seqs), generator=gen, dtype=torch.float64)
    w = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0] + seqs).cumsum(0)
    doc = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(seqs))
    Pack.pos_in_seq = torch.arange(sum(seqs)) - cu[doc]
    got = reset_conv1d(x, w, b, activation="silu")
    bounds = itertools.pairwise(cu.tolist())
    ref = torch.cat([causal_conv1d_fn(x[..., s:e], w, b, activation="silu") for s, e in bounds], -1)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_hybrid_baselines_skip_dense_and_fla_rows_on_cpu():
    paths = [[1, 2, 3], [1, 2, 4]]
    spec = harness.model_specs()["dense-tiny"]
    model = spec.build(torch.device("cpu"), torch.float64)
    case = harness.TreeCase("t", "synthetic", None, tuple(map(tuple, paths)))
    cfg = harness.BenchConfig(device="cpu", dtype="float64", iters=1, capacity=64, compile_baselines=False)
    with pytest.raises(harness._Skip, match="hybrid models only"):
        harness.Steps(model, spec, case, cfg, {}).packed_fla_varlen()
    hspec = harness.model_specs()["hybrid-tiny"]
    with pytest.raises(harness._Skip, match="CUDA"):
        harness.Steps(hspec.build(torch.device("cpu"), torch.float64), hspec, case, cfg, {}).compiled_per_path_fla()


@pytest.fixture
def stand_in_fla(monkeypatch):
    """fla replaced by the float64-capable torch stand-in, and hybrid_bench's layer shapes made tiny."""
    import sys
    import types

    from benchmarks import hybrid_bench as hb
    from tests.test_fla_plan import torch_varlen_gdn

    def chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state=False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False, chunk_size=64, scale=None, cu_seqlens_cpu=None,
                               chunk_indices=None):
        return torch_varlen_gdn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                                cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                chunk_size=chunk_size, cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices)

    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = chunk_gated_delta_rule
    for name in [m for m in sys.modules if m.startswith("fla.")]:  # a real fla imported earlier stays out of reach
        monkeypatch.delitem(sys.modules, name)
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake)
    for name, value in (("H", 1), ("HV", 2), ("DK", 8), ("DV", 8)):
        monkeypatch.setattr(hb, name, value)
    return hb


def test_hybrid_bench_layer_timing_runs_with_a_stand_in_fla(stand_in_fla):
    """The GPU bench's GDN layer section on CPU, fla replaced by the float64-capable torch stand-in: it
    runs every variant and reports the plan's calls (the GPU run only swaps the kernel)."""
    hb = stand_in_fla
    trees = hb.bench_trees("agentic", 512, scale=0.02)
    (row,) = hb.gdn_layer_times(trees, device="cpu")
    assert row["calls"] <= row["calls_r0"] == row["levels"]
    assert all(row[f"{k}_ms"] > 0 for k in ("tree_planned", "tree_calls", "tree_calls_r0", "tree_per_level", "one_fla_call"))
    assert all(row[f"{k}_vs_per_level"] < 1e-4 for k in ("tree_planned", "tree_calls", "tree_calls_r0"))
    assert "tree_levels_r0_ms" not in row  # the levelled variants need fla's own chunk functions
    counts = hb.call_counts(trees)
    assert {r["tree"] for r in counts} >= set(trees)


def test_packed_hooks_are_the_same_objects_every_step(monkeypatch):
    """dynamo guards on the hook functions: a baseline must install the same objects at every step."""
    from benchmarks import hybrid_baselines as hb

    seen = []
    real = hb.hooks

    def spy(model, **kw):
        seen.append((tuple(kw["gdn"].values()), kw["conv"], kw["sdpa"]))
        return real(model, **kw)

    monkeypatch.setattr(hb, "hooks", spy)
    spec = harness.model_specs()["hybrid-tiny"]
    model = spec.build(torch.device("cpu"), torch.float64)
    case = harness.TreeCase("t", "synthetic", None, ((1, 2, 3, 4), (1, 2, 5)))
    cfg = harness.BenchConfig(device="cpu", dtype="float64", iters=1, capacity=64, compile_baselines=False)
    step = harness.Steps(model, spec, case, cfg, {}).packed_fla_varlen()
    step()
    step()
    assert len(seen) == 2 and seen[0] == seen[1]


def test_prof_gdn_layer_runs_and_compares_with_a_stand_in_fla(stand_in_fla, tmp_path):
    """benchmarks/prof_gdn_layer.py on CPU: every variant timed and profiled; ``--compare`` with a copy of
    this fla_gdn.py runs the tree variants again and finds them bitwise equal (same code, CPU)."""
    import shutil

    from benchmarks import prof_gdn_layer
    from treecompile.ops import fla_gdn

    copy = shutil.copy(fla_gdn.__file__, tmp_path / "fla_gdn_copy.py")
    rows = prof_gdn_layer.main(["--case", "agentic", "--scale", "0.01", "--vocab", "512", "--compare", str(copy),
                                "--warmup", "0", "--iters", "1"])
    timed = {r["variant"]: r for r in rows if "step_ms" in r}
    variants = prof_gdn_layer.tree_variants()
    assert set(variants) == {"tree_planned", "tree_calls"}  # the levelled ones need fla's own chunk functions
    assert set(timed) == {"one_fla_call", "tree_planned_gathered", "tree_per_call", *variants,
                          *(n + "_compare" for n in variants)}
    assert all(r["step_ms"] > 0 and r["top_host"] for r in timed.values())
    diffs = {r["variant"]: r["max_abs_diff"] for r in rows if "max_abs_diff" in r}
    # on CPU (whole calls, nothing read in place) this tree's plans are gathered either way: the same plan, bit for bit
    assert diffs.pop("tree_planned vs tree_planned_gathered") == 0.0
    assert diffs.pop("tree_planned vs tree_per_call") == 0.0  # no recurrence over the tree without Triton
    assert list(diffs.values()) == [0.0] * len(variants)


def test_prof_gdn_layer_group_case_is_in_dfs_order(stand_in_fla, capsys):
    """``--case group`` (a prompt and its samples, padded): without replay the plan needs no gather (with
    whole calls, the CPU stand-in's, the default replays the short prompt); the gathered variant runs that plan too."""
    from benchmarks import prof_gdn_layer

    rows = prof_gdn_layer.main(["--case", "group", "--group", "20", "3", "5", "12", "--pad", "16", "--warmup", "0",
                                "--iters", "1"])
    assert '{"plan replay_max": 0, "calls": 2, "levels": 2, "replayed": 0, "rows": "in DFS order"' in capsys.readouterr().out
    diffs = {r["variant"]: r["max_abs_diff"] for r in rows if "max_abs_diff" in r}
    assert diffs["tree_planned vs tree_planned_gathered"] == 0.0  # the same plan (the prompt replayed), gathered


@pytest.mark.parametrize("capacity", [1, 100, 8192, 16384, 10**6])
@pytest.mark.parametrize("seed", range(4))
def test_pack_plan_covers_every_path_in_few_shapes(capacity, seed):
    """Every path in exactly one pack, packs under max(capacity, longest path), padded to multiples of 128,
    at most PACK_SHAPES lengths; where the packs round to at most that many lengths each is padded by < 128
    tokens (the agentic parallel-tools tree at 16,384: packs of 13,378 / 12,748 / 16,041 path tokens, no longer
    all padded to 16,128)."""
    import random

    rnd = random.Random(seed)
    lens = [rnd.randint(1, 7000) for _ in range(rnd.randint(1, 30))]
    plan = harness.pack_plan(lens, capacity)
    members = sorted(i for g, _ in plan for i in g)
    assert members == list(range(len(lens)))
    sizes = [sum(lens[i] for i in g) for g, _ in plan]
    assert all(s <= max(capacity, max(lens)) for s in sizes)
    assert len({n for _, n in plan}) <= harness.PACK_SHAPES
    assert all(n >= s and n % 128 == 0 for s, (_, n) in zip(sizes, plan))
    if len({-(-s // 128) for s in sizes}) <= harness.PACK_SHAPES:
        assert all(n - s < 128 for s, (_, n) in zip(sizes, plan))
    with pytest.raises(ValueError, match="non-empty"):
        harness.pack_plan([3, 0], capacity)


@pytest.mark.parametrize("seed", range(6))
def test_pack_plan_pads_least_under_its_shape_limit(seed):
    """The padded lengths waste the fewest tokens of any choice of <= PACK_SHAPES lengths (brute force over
    the packs' rounded sizes: a pack goes to the smallest chosen length that holds it; the largest is always
    chosen), for the same packs."""
    import random

    rnd = random.Random(seed)
    lens = [rnd.randint(1, 3000) for _ in range(rnd.randint(5, 40))]
    plan = harness.pack_plan(lens, 4096)
    rounded = [-(-sum(lens[i] for i in g) // 128) * 128 for g, _ in plan]
    cands = sorted(set(rounded))
    best = min(sum(min(c for c in chosen + (cands[-1],) if c >= x) - x for x in rounded)
               for k in range(harness.PACK_SHAPES) for chosen in itertools.combinations(cands[:-1], k))
    assert sum(n for _, n in plan) - sum(rounded) == best
    assert all(n >= x for (_, n), x in zip(plan, rounded))
