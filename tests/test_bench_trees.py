"""The benchmark tree generators: requested POR reached, paths valid, agentic suite spans the range."""

import pytest
import torch

from benchmarks.flops import tree_attention_entries, path_attention_entries
from benchmarks.trees import AgenticSpec, agentic_paths, agentic_specs, max_por, synthetic_paths
from treecompile import Tree


def valid(paths, vocab):
    assert paths and all(len(p) >= 1 for p in paths)
    assert all(isinstance(t, int) and 0 <= t < vocab for p in paths for t in p)


@pytest.mark.parametrize("por", [0.0, 0.2, 0.5, 0.7, 0.92])
def test_synthetic_hits_por_at_fixed_path_tokens(por):
    N, L, V = 16, 300, 1000
    paths = synthetic_paths(N, L, por, vocab=V, seed=3)
    valid(paths, V)
    assert len(paths) == N and all(len(p) == L for p in paths)
    tree = Tree.from_paths(paths)
    assert tree.num_path_tokens == N * L
    # exact by construction: sum of shares = round(por * N * L), and every branch diverges at once
    assert tree.num_tokens == N * L - round(por * N * L)
    assert tree.num_paths == N and [tree.path(i) for i in range(N)] == paths


def test_synthetic_refuses_unreachable_por():
    assert max_por(8, 100) < 0.92
    with pytest.raises(ValueError, match="outside"):
        synthetic_paths(8, 100, 0.92)


def test_agentic_suite_spans_the_paper_range():
    pors = []
    for spec in agentic_specs(0.25):
        paths = agentic_paths(spec)
        valid(paths, spec.vocab)
        tree = Tree.from_paths(paths)
        assert [tree.path(i) for i in range(len(paths))] == paths
        pors.append(tree.por)
    assert 0.2 <= min(pors) <= 0.35 and 0.85 <= max(pors) <= 0.92, pors
    assert pors == sorted(pors)


def test_agentic_trees_by_name_in_suite_order_and_unknown_names_refused():
    """Named agentic trees come in the suite's order; a name the suite lacks is refused, naming it (the harness
    and prof_step took a misspelt name as "no tree" or failed on an empty list)."""
    from benchmarks import harness

    assert [s.name for s in agentic_specs(names=["deep-agent", "short-chat"])] == ["short-chat", "deep-agent"]
    assert agentic_specs(0.5, names=["tool-loop"]) == [s for s in agentic_specs(0.5) if s.name == "tool-loop"]
    with pytest.raises(ValueError, match="'deep_agent'.*deep-agent"):
        agentic_specs(names=["deep-agent", "deep_agent"])
    with pytest.raises(ValueError, match="'nope'"):
        harness.agentic_cases(1.0, 1000, ["nope"])
    with pytest.raises(SystemExit, match="--agentic: .*'parallel_tools'"):
        harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--suite", "agentic",
                      "--agentic", "parallel_tools"])


def test_driver_reads_contender_reads_every_time_only_while_its_step_runs():
    """``tree_driver_reads``'s step runs with ``DRIVER_READ_S = 0`` and leaves the setting as it found it, also when
    the step raises."""
    from benchmarks import harness
    from treecompile.ops import logprobs_kept

    seen = []
    step = harness._with_driver_reads(lambda: seen.append(logprobs_kept.DRIVER_READ_S) or 7)
    was = logprobs_kept.DRIVER_READ_S
    assert step() == 7 and seen == [0.0] and logprobs_kept.DRIVER_READ_S == was

    def boom():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        harness._with_driver_reads(boom)()
    assert logprobs_kept.DRIVER_READ_S == was
    # it and the C++ wrapper (minutes of compile) run when named, not in a default harness run
    default = harness.build_parser().parse_args([]).contenders
    assert "tree" in default and not set(harness.ON_REQUEST) & set(default)
    assert harness.build_parser().parse_args(["--contenders", "tree_driver_reads"]).contenders == ["tree_driver_reads"]


def test_block_sparse_heavy_first_contender_sets_the_order_only_while_its_step_runs():
    """``tree_block_sparse_heavy_first``'s step runs with the block-sparse plan in the heaviest-child-first order and
    puts the default order back after, also when the step raises; it runs when named only."""
    from benchmarks import harness
    from treecompile.ops import varlen_tree_attention as vta

    step = harness._with_block_sparse_layout(lambda: vta.BLOCK_SPARSE_LAYOUT, "heavy_first")
    assert step() == "heavy_first" and vta.BLOCK_SPARSE_LAYOUT == "dfs"

    def boom():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        harness._with_block_sparse_layout(boom, "heavy_first")()
    assert vta.BLOCK_SPARSE_LAYOUT == "dfs" and "tree_block_sparse_heavy_first" in harness.ON_REQUEST


@pytest.mark.parametrize("kv_heads", ["grouped", "expanded"])
def test_index_add_sums_take_the_ops_call(kv_heads, monkeypatch):
    """``bench_fa4_attention.index_add_sums`` (the ``fa4_varlen_index_add`` row) stands in for ``sum_copies`` as the
    op calls it (``zero_tail=``, ``rep=``: its lambda of four arguments failed on every call from session 51 to 52,
    unseen off the GPU), and the op's gradients stay the dense mask's (CPU, float64)."""
    import inspect

    from benchmarks import bench_fa4_attention as bench
    from tests.test_fa4_tree_attention import forest_paths
    from treecompile import Tree
    from treecompile.ops import key_copies
    from treecompile.ops import varlen_tree_attention as vta
    from treecompile.ops.tree_attention import tree_attention_reference

    monkeypatch.setattr(vta, "KV_HEADS", kv_heads)
    b = Tree.from_paths(forest_paths(60, 2, seed=1)).to_batch(pad_to_multiple=16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, b.seq_len, h, 8, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
               for h in (4, 2, 2))
    do = torch.randn(1, 4, b.seq_len, 8, generator=g, dtype=torch.float64)
    seen = []

    def grads():
        seen.append(vta.sum_copies)
        out = vta.tree_attention_varlen(q, k, v, b.subtree_end, 0.3)
        return torch.autograd.grad(out, (q, k, v), do)

    got = bench.index_add_sums(grads)
    assert seen[0] is not key_copies.sum_copies and vta.sum_copies is key_copies.sum_copies
    assert list(inspect.signature(seen[0]).parameters) == list(inspect.signature(key_copies.sum_copies).parameters)
    want = torch.autograd.grad(tree_attention_reference(q, k, v, b.subtree_end, scale=0.3), (q, k, v), do)
    for x, r in zip(got, want):
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12)


def test_kv_expanded_contender_sets_the_kv_heads_only_while_its_step_runs():
    """``tree_kv_expanded``'s step runs the varlen op with K/V expanded to the query heads, and the default comes
    back after, also when the step raises; an unknown setting is refused before any step; on request only."""
    from benchmarks import harness
    from treecompile.ops import varlen_tree_attention as vta

    assert harness._with_kv_heads(lambda: vta.KV_HEADS, "expanded")() == "expanded" and vta.KV_HEADS == "auto"
    assert harness._with_kv_heads(lambda: vta.KV_HEADS, "grouped")() == "grouped" and vta.KV_HEADS == "auto"

    def boom():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        harness._with_kv_heads(boom, "expanded")()
    assert vta.KV_HEADS == "auto" and {"tree_kv_expanded", "tree_kv_grouped"} <= set(harness.ON_REQUEST)
    with pytest.raises(ValueError, match="kv_heads: expected one of"):
        harness._with_kv_heads(boom, "repeated")
    # the attention benchmark's row of the same setting
    from benchmarks import bench_fa4_attention as bench

    assert bench.kv_expanded(lambda: vta.KV_HEADS) == "expanded" and vta.KV_HEADS == "auto"
    assert bench.kv_grouped(lambda: vta.KV_HEADS) == "grouped" and vta.KV_HEADS == "auto"
    assert bench.contender_names("fa4_varlen,fa4_varlen_kv_expanded,fa4_varlen_kv_grouped") == [
        "fa4_varlen", "fa4_varlen_kv_expanded", "fa4_varlen_kv_grouped"]


def test_unkept_forward_contenders_set_the_forward_only_while_their_step_runs():
    """``tree_unkept_segments``' step (and the attention bench's row of the same setting) runs the varlen op's
    forwards that keep no rows on the segments, ``tree_unkept_block_sparse``'s on the block-sparse plan (the default),
    and the default comes back after, also when the step raises; an unknown setting is refused before any step; on
    request only.  ``fa4_segments`` holds the op's forward to the segments too, ``fa4_block_sparse`` the op to its
    block-sparse plan, while their call runs."""
    from benchmarks import bench_fa4_attention as bench
    from benchmarks import harness
    from treecompile.ops import varlen_tree_attention as vta

    assert vta.UNKEPT_FORWARD == "block_sparse"
    got = harness._with_unkept_forward(lambda: vta.UNKEPT_FORWARD, "segments")()
    assert got == "segments" and vta.UNKEPT_FORWARD == "block_sparse"

    def boom():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        harness._with_unkept_forward(boom, "segments")()
    assert vta.UNKEPT_FORWARD == "block_sparse"
    assert {"tree_unkept_block_sparse", "tree_unkept_segments", "tree_keys_gathered_block_sparse_forward",
            "tree_keys_gathered_segments_forward"} <= set(harness.ON_REQUEST)
    with pytest.raises(ValueError, match="unkept_forward: expected one of"):
        harness._with_unkept_forward(boom, "gathered")
    assert bench.unkept_segments(lambda: vta.UNKEPT_FORWARD) == "segments"
    assert bench.unkept_block_sparse(lambda: vta.UNKEPT_FORWARD) == "block_sparse"
    assert bench.segments_only(lambda: (vta.UNKEPT_FORWARD, vta.VARLEN_GATHER_LIMIT)) == ("segments", float("inf"))
    assert bench.block_sparse_only(lambda: vta.VARLEN_GATHER_LIMIT) == 0.0 and vta.VARLEN_GATHER_LIMIT == 6.0
    assert vta.UNKEPT_FORWARD == "block_sparse"
    assert bench.contender_names("fa4_block_sparse,fa4_varlen_unkept_block_sparse,fa4_varlen_unkept_segments") == [
        "fa4_block_sparse", "fa4_varlen_unkept_block_sparse", "fa4_varlen_unkept_segments"]


def test_attention_bench_refuses_unknown_contenders(monkeypatch):
    """``bench_fa4_attention --contenders`` names each contender it runs: a misspelt one is refused by name (it
    used to be dropped without a word), every documented one is accepted, and each has its row in ``tree_fns``."""
    import inspect
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_fa4_attention as bench

    assert bench.contender_names("fa4_varlen,fa4_varlen_heavy_first") == ["fa4_varlen", "fa4_varlen_heavy_first"]
    with pytest.raises(SystemExit, match=r"unknown \['fa4_varlen_heavy'\]"):
        bench.contender_names("fa4_varlen,fa4_varlen_heavy")
    with pytest.raises(SystemExit, match="none given"):
        bench.contender_names("")
    source = inspect.getsource(bench)
    assert all(f'"{name}" in which' in source for name in bench.CONTENDERS)
    assert all(f"``{name}``" in bench.__doc__ for name in bench.CONTENDERS)


def test_deterministic_contender_sets_the_mode_only_while_its_step_runs(monkeypatch):
    """``tree_deterministic``'s step runs under ``torch.use_deterministic_algorithms(True)`` with cuBLAS's workspace
    setting, and leaves both as it found them, also when the step raises; it runs when named only."""
    import os

    from benchmarks import harness

    seen = []
    was_env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    step = harness._with_deterministic(
        lambda: seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        or 5)
    assert not torch.are_deterministic_algorithms_enabled()
    assert step() == 5 and seen == [(True, ":4096:8")]
    assert not torch.are_deterministic_algorithms_enabled() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") == was_env

    def boom():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        harness._with_deterministic(boom)()
    assert not torch.are_deterministic_algorithms_enabled() and os.environ.get("CUBLAS_WORKSPACE_CONFIG") == was_env
    assert "tree_deterministic" in harness.ON_REQUEST and "tree_deterministic" in harness.CONTENDERS
    fills = []
    monkeypatch.setenv("TREE_DETERMINISTIC_FILL", "0")
    harness._with_deterministic(lambda: fills.append(torch.utils.deterministic.fill_uninitialized_memory))()
    assert fills == [False] and torch.utils.deterministic.fill_uninitialized_memory


def test_cudagraphs_contender_partitions_at_every_treecompile_op_only_while_its_step_runs():
    """``tree_cudagraphs``'s step compiles under inductor's CUDA graphs with the graphs partitioned at every
    registered ``treecompile::`` op (their host work must run each call, never replayed from a capture), and leaves
    inductor's settings as it found them, also when the step raises; it runs when named only."""
    import torch._inductor.config as inductor_config

    from benchmarks import harness

    ops = harness.treecompile_ops()
    assert {"treecompile::tree_attention_varlen_fwd", "treecompile::tree_attention_varlen_bwd",
            "treecompile::linear_logprobs_kept", "treecompile::materialize"} <= set(ops)
    assert all(n.startswith("treecompile::") for n in ops)
    before = (inductor_config.triton.cudagraphs, inductor_config.graph_partition,
              list(inductor_config.custom_should_partition_ops))
    seen = []
    step = harness._with_cudagraphs(lambda: seen.append(
        (inductor_config.triton.cudagraphs, inductor_config.graph_partition,
         list(inductor_config.custom_should_partition_ops))) or 3)
    assert step() == 3 and seen == [(True, True, ops)]
    assert (inductor_config.triton.cudagraphs, inductor_config.graph_partition,
            list(inductor_config.custom_should_partition_ops)) == before

    def boom():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        harness._with_cudagraphs(boom)()
    assert inductor_config.triton.cudagraphs == before[0] and "tree_cudagraphs" in harness.ON_REQUEST


def test_agentic_think_dropping_and_fanout_make_the_expected_tree():
    spec = AgenticSpec("t", prompt=20, turns=3, think=10, action=4, observation=6, fanout=2, fanout_turns=(0,),
                       drift_prob=0.0, vocab=500, seed=0)
    paths = agentic_paths(spec)
    # turn 0, then 2 branches each with turns 1 and 2: 1 + 2 * 2 samples
    assert len(paths) == 5
    lcp = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # noqa
    p0, a1, a2, b1, b2 = paths  # DFS: turn 0, branch A (turns 1, 2), branch B (turns 1, 2)
    shared = lcp(p0, a1)  # the prompt: turn 0's reasoning is where they part
    rest = p0[shared:]  # think_0 + action_0; the history of turn 1 holds action_0 only
    k = next(k for k in range(1, len(rest)) if a1[shared:shared + len(rest) - k] == rest[k:])
    assert 5 <= k <= 15  # the dropped reasoning: think=10 drawn in [5, 15]
    assert b1[shared:shared + len(rest) - k] == rest[k:]
    # parallel tool calls: the branches share prompt + action_0 and part at their observations
    assert lcp(a1, b1) == shared + len(rest) - k
    assert lcp(a1, a2) > lcp(a1, b1) and lcp(b1, b2) > lcp(a1, b1)

def test_attention_entries_match_a_dense_count():
    paths = synthetic_paths(5, 40, 0.5, vocab=100, seed=1)
    tree = Tree.from_paths(paths)
    b = tree.to_batch()
    T = tree.num_tokens
    se = b.subtree_end[:T].tolist()
    dense = sum(1 for k in range(T) for q in range(T) if k <= q < se[k])
    assert tree_attention_entries(b.position_ids[:T]) == dense
    assert path_attention_entries([len(p) for p in paths]) == sum(L * (L + 1) // 2 for L in map(len, paths))


def test_harness_cpu_smoke(tmp_path):
    """The harness end to end on CPU (float64, tiny dense model): rows written, tree == per-path."""
    import csv

    from benchmarks import harness

    rc = harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--dtype", "float64", "--suite", "sweep",
                       "--por", "0.7", "--contenders", "eager_per_path", "tree", "tree_lex", "tree_packed", "--out",
                       str(tmp_path)])
    assert rc == 0
    rows = {r["contender"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert set(rows) == {"eager_per_path", "tree", "tree_lex", "tree_packed"}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    tree = rows["tree"]
    assert float(tree["loss_rel_dev"]) < 1e-9 and float(tree["grad_cos"]) > 1 - 1e-9
    assert float(rows["tree_packed"]["loss_rel_dev"]) < 1e-9
    # the lexicographic serialisation: the same tokens, equal to per-path too
    assert float(rows["tree_lex"]["loss_rel_dev"]) < 1e-9 and float(rows["tree_lex"]["grad_cos"]) > 1 - 1e-9
    assert rows["tree_lex"]["tree_tokens"] == tree["tree_tokens"]
    # bound = per-path FLOPs / tree FLOPs > 1 at POR 0.7; and computed tokens == unique tokens
    assert int(tree["computed_tokens"]) == int(tree["tree_tokens"]) and float(tree["bound"]) > 2
    assert (tmp_path / "tables.md").read_text().count("| dense-tiny") == 4


def test_harness_packed_flex_in_several_packs_matches_per_path(tmp_path):
    """packed_flex with a capacity below the path tokens: several padded packs, gradients accumulated;
    loss and gradients equal the per-path baseline (CPU float64, dense document mask)."""
    import csv

    from benchmarks import harness

    rc = harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--dtype", "float64", "--suite", "sweep",
                       "--por", "0.5", "--capacity", "100", "--contenders", "eager_per_path", "packed_flex",
                       "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["contender"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert rows["packed_flex"]["status"] == "ok", rows
    assert float(rows["packed_flex"]["loss_rel_dev"]) < 1e-9
    assert float(rows["packed_flex"]["grad_cos"]) > 1 - 1e-9


def _jsonl(path):
    import json

    return [json.loads(line) for line in open(path)]


def test_harness_isolate_times_each_contender_in_its_own_process(tmp_path, monkeypatch):
    """--isolate on CPU (float64, tiny dense model): one child per contender, eager_per_path first whatever
    the order asked; the packed baseline's loss and gradient compared across processes with the eager child's
    saved reference (exact); speedups set by the parent; the parent's temporary folder removed.  packed_flex,
    not the tree: on CPU it runs uncompiled, so the children cost their imports only (a tree child captures
    and compiles, ~6 s more; the tree's own exactness is test_harness_cpu_smoke's)."""
    import os
    import tempfile

    from benchmarks import harness

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "out"
    rc = harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--dtype", "float64", "--suite", "sweep",
                       "--por", "0.5", "--paths", "4", "--path-len", "32", "--contenders", "packed_flex",
                       "eager_per_path", "--isolate", "--out", str(out)])
    assert rc == 0
    rows = _jsonl(out / "results.jsonl")
    assert [r["contender"] for r in rows] == ["eager_per_path", "packed_flex"]
    eager, packed = rows
    assert all(r["status"] == "ok" for r in rows), rows
    pids = {r["pid"] for r in rows}
    assert len(pids) == 2 and os.getpid() not in pids and None not in pids
    assert packed["loss_rel_dev"] < 1e-9 and abs(packed["grad_cos"] - 1) < 1e-9
    assert eager["loss_rel_dev"] == 0 and abs(eager["grad_cos"] - 1) < 1e-12
    best = min(rows, key=lambda r: r["step_s"])  # both are baselines: the faster one is the reference
    assert packed["best_baseline"] == eager["best_baseline"] == best["contender"]
    assert abs(packed["x_best"] - best["step_s"] / packed["step_s"]) < 1e-12
    assert abs(packed["x_eager"] - eager["step_s"] / packed["step_s"]) < 1e-12 and eager["x_eager"] == 1.0
    assert abs(packed["frac_bound"] - packed["x_best"] / packed["bound"]) < 1e-12 and packed["bound"] == 1.0
    assert len(open(out / "results.csv").readlines()) == 1 + 2
    assert "each contender in its own process" in (out / "tables.md").read_text()
    assert list(scratch.iterdir()) == []  # the reference and the children's folders are gone


def test_harness_isolate_failed_child_is_an_error_row(tmp_path, monkeypatch, capsys):
    """A child that exits non-zero is an error row naming its exit code and last stderr line, its output
    forwarded to the parent's stderr; the parent returns 0 and the other rows are whole.  The tree's child
    was handed the eager child's reference."""
    import sys

    from benchmarks import harness

    real, seen = harness.child_command, {}

    def child_command(args, *, contender, **kw):
        cmd = real(args, contender=contender, **kw)
        seen[contender] = cmd
        if contender != "tree":
            return cmd
        seen["ref"] = harness.load_ref(cmd[cmd.index("--ref-load") + 1])
        return [sys.executable, "-c", "import sys; print('compiling'); "
                "sys.stderr.write('Traceback (most recent call last):\\nRuntimeError: boom\\n\\n'); sys.exit(3)"]

    monkeypatch.setattr(harness, "child_command", child_command)
    out = tmp_path / "out"
    rc = harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--dtype", "float64", "--suite", "sweep",
                       "--por", "0.5", "--paths", "4", "--path-len", "32", "--contenders", "eager_per_path", "tree",
                       "--isolate", "--out", str(out)])
    assert rc == 0
    eager, tree = _jsonl(out / "results.jsonl")
    assert "--ref-save" in seen["eager_per_path"]
    assert eager["status"] == "ok" and eager["x_best"] == 1.0 and seen["ref"]["loss"] == eager["loss"]
    assert tree["status"] == "error: child exited 3: RuntimeError: boom", tree
    assert tree["pid"] not in (None, eager["pid"]) and tree["step_s"] is None and tree["x_best"] is None
    err = capsys.readouterr().err
    assert "[dense-tiny | syn POR=0.50 | tree] RuntimeError: boom" in err
    assert "[dense-tiny | syn POR=0.50 | tree] compiling" in err


def test_harness_isolate_budget_starts_no_child(tmp_path, monkeypatch):
    """--budget-s is the parent's: past it, contenders are skipped rows and no child starts."""
    from benchmarks import harness

    def no_child(*a, **k):
        raise AssertionError("a child started past the budget")

    monkeypatch.setattr(harness, "run_child", no_child)
    rc = harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--suite", "sweep", "--por", "0.5", "0.7",
                       "--contenders", "eager_per_path", "tree", "--isolate", "--budget-s", "0",
                       "--out", str(tmp_path)])
    assert rc == 0
    rows = _jsonl(tmp_path / "results.jsonl")
    assert len(rows) == 4 and all(r["status"] == "skipped: time budget" and r["pid"] is None for r in rows)


def test_child_process_names_timeouts_and_signals():
    """run_child: a timeout kills the child's whole process group (a grandchild holding the pipes does
    not hang the parent); a signal is named; the last non-empty stderr line is kept."""
    import sys
    import time

    from benchmarks.child_process import run_child

    grandchild = ("import subprocess, sys, time; "
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    t0 = time.perf_counter()
    how = run_child([sys.executable, "-c", grandchild], timeout_s=1.0)
    assert time.perf_counter() - t0 < 8
    assert how.returncode is None and how.describe() == "child timed out after 1 s"
    how = run_child([sys.executable, "-c", "import os, signal, sys; print('last words', file=sys.stderr, flush=True); "
                     "os.kill(os.getpid(), signal.SIGKILL)"], timeout_s=30)
    assert how.describe() == "child exited -9 (SIGKILL): last words"
    assert run_child([sys.executable, "-c", "pass"], timeout_s=30).ok


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_baselines_materialize_rope_tables_without_changing_them(kind):
    """The harness's baselines of our models read RoPE's tables through treecompile::materialize
    (computed once per step under inductor): bitwise the same logits and gradients, one wrapper per
    model across steps (a compiled baseline would otherwise recompile), the model as it was after."""
    import torch

    from benchmarks.harness import materialized_rope
    from treecompile.models import DenseConfig, DenseForCausalLM, HybridConfig, HybridForCausalLM

    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny()) if kind == "dense" else HybridForCausalLM(HybridConfig.tiny())
    model = model.double()
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    runs, wrappers = [], []
    for ctx in (None, materialized_rope, materialized_rope):
        model.zero_grad(set_to_none=True)
        if ctx is None:
            out = model(ids)
        else:
            with ctx(model):
                wrappers.append(model.rope)
                assert "rope" in vars(model)
                out = model(ids)
            assert "rope" not in vars(model)
        out.square().sum().backward()
        runs.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    assert wrappers[0] is wrappers[1]
    for out, grads in runs[1:]:
        assert torch.equal(out, runs[0][0]) and all(torch.equal(a, b) for a, b in zip(grads, runs[0][1]))


def test_harness_tree_paths_names_the_bad_item():
    from benchmarks.trees import harness_tree_paths

    paths = harness_tree_paths("4x64@0.5")
    assert paths == synthetic_paths(4, 64, 0.5)
    for bad in ("4x64", "4-64@0.5", "0x64@0.5"):
        with pytest.raises(ValueError, match=f"'{bad}': expected PATHSxLEN@POR"):
            harness_tree_paths(bad)


def test_prof_step_busy_time_and_kinds():
    """benchmarks.prof_step: the GPU's busy time is the union of kernel intervals; the hybrids' kernels get their kinds."""
    from benchmarks.prof_step import busy_ms, kind_of

    assert busy_ms([(30, 40), (0, 10), (5, 20), (12, 14)]) == 0.03 and busy_ms([]) == 0.0
    assert [kind_of(n) for n in ("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", "kernel_kernel",
                                 "causal_conv1d_bwd_kernel", "triton_poi_fused_mul_silu_2", "nvjet_sm90_tst_256x128",
                                 "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90")] == \
        ["gdn", "gdn", "conv", "triton", "gemm", "attention"]


def test_prof_step_idle_gaps_are_named_by_the_host_events_under_them():
    from benchmarks.prof_step import idle_gaps

    kernels = [(0, 100), (50, 300), (800, 900), (950, 1000), (1600, 1700)]  # gaps 300-800, 900-950, 1000-1600
    host = [("step", 0, 2000), ("GDN backward", 250, 1100), ("cudaStreamSynchronize", 400, 700),
            ("aten::mm", 1200, 1500)]
    assert idle_gaps(kernels, host) == [("step > aten::mm", 0.6, 1),
                                        ("step > GDN backward > cudaStreamSynchronize", 0.5, 1)]
    assert idle_gaps(kernels, host, min_us=10, depth=1) == [("aten::mm", 0.6, 1), ("cudaStreamSynchronize", 0.5, 1),
                                                            ("GDN backward", 0.05, 1)]
    assert idle_gaps([(0, 1)], host) == [] and idle_gaps(kernels, [])[0] == ("(no host event)", 1.1, 2)


def test_prof_step_counts_kernels_not_the_gpu_side_of_record_function_ranges():
    """A ``record_function`` range shows up on the GPU too, spanning its kernels and the gaps between them (the
    harness's and treecompile's named ranges: session 38's first profile with them read 152 ms busy of a 140 ms
    step); only the kernels count, CPU events never do."""
    from types import SimpleNamespace

    import torch

    from benchmarks.prof_step import is_kernel

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    assert is_kernel(SimpleNamespace(device_type=cuda, is_user_annotation=False))
    assert is_kernel(SimpleNamespace(device_type=cuda))  # a torch whose events lack the field
    assert not is_kernel(SimpleNamespace(device_type=cuda, is_user_annotation=True))
    assert not is_kernel(SimpleNamespace(device_type=cpu, is_user_annotation=False))
    # the GPU side of a real range, where a CUDA profiler can record one
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        x = torch.ones(1 << 20, device="cuda")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function("harness::forward"):
                (x * 2).sum()
            torch.cuda.synchronize()
        gpu = [e for e in prof.events() if e.device_type == cuda]
        assert gpu and not any(is_kernel(e) for e in gpu if e.name == "harness::forward")


def test_prof_step_phases_are_host_and_gpu_ms_of_the_harness_ranges():
    """Each ``harness::`` range's host duration and its GPU side's span, summed per phase; other events ignored."""
    from types import SimpleNamespace as E

    import torch

    from benchmarks.prof_step import phases_ms

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    span = lambda a, b: E(start=a, end=b)
    events = [E(name="harness::forward", device_type=cpu, time_range=span(0, 48_800)),
              E(name="harness::forward", device_type=cuda, time_range=span(300, 50_800)),
              E(name="harness::backward", device_type=cpu, time_range=span(48_800, 100_000)),
              E(name="harness::prepare", device_type=cpu, time_range=span(100_000, 100_500)),
              E(name="harness::prepare", device_type=cpu, time_range=span(200_000, 200_250)),
              E(name="aten::mm", device_type=cpu, time_range=span(10, 20))]
    assert phases_ms(events) == {"forward": [48.8, 50.5], "backward": [51.2, 0.0], "prepare": [0.75, 0.0]}


def test_prof_step_host_top_ranks_host_ops_by_self_time():
    """``host_self_ms``: the host ops of a real profile, most self time first, with their call counts; none asked,
    none given.  A parent's self time excludes its children's (a range around 20 matmuls ranks below them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.prof_step import host_self_ms

    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("outer"):
            for _ in range(20):
                a @ a
    top = host_self_ms(prof, 50)
    names = [name for name, _, _ in top]
    assert [ms for _, ms, _ in top] == sorted((ms for _, ms, _ in top), reverse=True)
    mm = next(row for row in top if row[0] in ("aten::mm", "aten::matmul") and row[2] == 20)
    assert names.index("outer") > names.index(mm[0]) and host_self_ms(prof, 0) == []


def test_row_notes_count_fa4_calls_since_the_last_row(monkeypatch):
    """A row's note says how its FA4 calls went per kind (``ops.fa4_replay.counts``, then zeroed for the next row);
    a kind without calls says nothing, a row without any nothing at all."""
    from benchmarks.harness import _with_fa4_replay
    from treecompile.ops import fa4_replay

    monkeypatch.setattr(fa4_replay, "counts", {"forward": {"recorded": 12, "replayed": 324, "refused": 0},
                                               "backward": {"recorded": 11, "replayed": 297, "refused": 1}})
    assert _with_fa4_replay("head kept") == ("head kept; FA4 forward: 324 calls replayed, 12 recorded, 0 through "
                                             "the interface; FA4 backward: 297 calls replayed, 11 recorded, 1 through "
                                             "the interface")
    zero = {"recorded": 0, "replayed": 0, "refused": 0}
    assert fa4_replay.counts == {"forward": zero, "backward": zero} and _with_fa4_replay(None) is None
    fa4_replay.counts["backward"]["replayed"] = 3
    assert _with_fa4_replay(None) == "FA4 backward: 3 calls replayed, 0 recorded, 0 through the interface"


def test_prof_step_lead_in_starts_at_the_harness_step():
    from benchmarks.prof_step import step_start

    host = [("cudaGetDeviceCount", 0, 5), ("harness::zero_grad", 40, 41), ("harness::forward", 41, 90)]
    assert step_start(host) == 40 and step_start(host[:1]) == 0


def test_prof_step_lead_in_is_named_by_the_host_events_then():
    """The lead-in (step start to first kernel) split by what the host ran, innermost ``depth`` events named."""
    from benchmarks.prof_step import lead_in_parts

    host = [("harness::zero_grad", 0, 100), ("harness::forward", 100, 1000), ("treecompile::pad_batch", 120, 160),
            ("treecompile::graph", 200, 1000), ("TorchDynamo Cache Lookup", 200, 500)]
    assert lead_in_parts(host, 0, 600) == [("harness::forward > treecompile::graph > TorchDynamo Cache Lookup", 0.3),
                                           ("harness::zero_grad", 0.1), ("harness::forward > treecompile::graph", 0.1),
                                           ("harness::forward", 0.06), ("harness::forward > treecompile::pad_batch",
                                                                        0.04)]
    assert lead_in_parts(host, 0, 600, depth=1)[0] == ("TorchDynamo Cache Lookup", 0.3)
    assert lead_in_parts(host, 1000, 1030) == [("(no host event)", 0.03)] and lead_in_parts(host, 5, 5) == []


def test_harness_flat_grads_and_oom_note():
    """The reference gradient is one float32 host vector built a parameter at a time (zeros where none); an OOM
    row says where it happened and what the allocator asked for."""
    import torch

    from benchmarks.harness import flat_grads, oom_note

    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)).to(torch.bfloat16)
    m(torch.ones(4, 3, dtype=torch.bfloat16))[:, 0].sum().backward()
    m[1].bias.grad = None
    g = flat_grads(m)
    want = torch.cat([p.grad.float().flatten() if p.grad is not None else torch.zeros(p.numel())
                      for p in m.parameters()])
    assert g.dtype == torch.float32 and g.device.type == "cpu" and torch.equal(g, want) and g[-2:].eq(0).all()
    e = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                               "79.19 GiB of which 1.02 GiB is free. Of the allocated memory 70 GiB is allocated")
    assert oom_note("gradient copy", e, "attention: FA4 varlen") == (
        "attention: FA4 varlen; OOM in gradient copy: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 1.02 GiB is free")


def test_group_paths_are_a_prompt_and_its_samples():
    from benchmarks.trees import group_paths

    paths = group_paths(20, 5, 3, 9, vocab=50, seed=1)
    tree = Tree.from_paths(paths)
    assert tree.num_nodes == 6 and all(p[:20] == paths[0][:20] for p in paths)
    assert sorted(p[20] for p in paths) == list(range(5)) and all(23 <= len(p) <= 29 for p in paths)
    assert tree.num_tokens == 20 + sum(len(p) - 20 for p in paths)
    assert group_paths(20, 5, 3, 9, vocab=50, seed=1) == paths  # seeded
    for bad in ((-1, 2, 1, 2), (4, 0, 1, 2), (4, 2, 0, 2), (4, 2, 3, 2)):
        with pytest.raises(ValueError, match="group"):
            group_paths(*bad)


def test_harness_group_suite_on_cpu(tmp_path):
    """``--suite group``: one GRPO group, the tree exact against the per-path reference."""
    import csv

    from benchmarks import harness

    rc = harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--dtype", "float64", "--suite", "group",
                       "--group", "12", "3", "4", "8", "--contenders", "eager_per_path", "tree", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["contender"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert set(rows) == {"eager_per_path", "tree"} and rows["tree"]["tree"] == "group 12 + 3 x 4-8"
    assert rows["tree"]["status"] == "ok" and float(rows["tree"]["loss_rel_dev"]) < 1e-9
    assert int(rows["tree"]["paths"]) == 3 and float(rows["tree"]["bound"]) > 1


def test_harness_notes_what_a_tree_row_ran_with(monkeypatch):
    """A row's note says how many head rows kept their logits under "fit" (then forgets it for the next contender),
    and, on CUDA where FA4 cannot run, that the attention ran without it; nothing on CPU."""
    import torch

    from benchmarks import harness
    from treecompile.ops import fa4_tree_attention, logprobs_kept

    logprobs_kept.pop_last_fit()
    assert harness._with_head_fit("x") == "x"
    logprobs_kept._record(rows=65536, kept=8204, headroom=1)
    assert harness._with_head_fit(None) == "last head call kept 8,204/65,536 rows" and not logprobs_kept.last_fit
    logprobs_kept._record(rows=3, kept=3, headroom=1)
    assert harness._with_head_fit("a") == "a; last head call kept 3/3 rows"
    from treecompile.ops import varlen_tree_attention as vta

    vta.pop_last_keys_fit()
    assert harness._with_keys_fit("a") == "a"
    vta.last_keys_fit = vta.KeysFit(layers=29, per_layer=1, keys=3 << 27, reserve=0, margin=0, headroom=100 << 30,
                                    keep=True)
    assert harness._with_keys_fit(None) == "attention K/V kept (10.5 GiB over 28 layers; headroom 100.0 GiB)"
    assert vta.last_keys_fit is None
    assert harness._with_attention_setup("a", torch.device("cpu")) == "a"
    monkeypatch.setattr(fa4_tree_attention, "fa4_unusable_reason", lambda: "flash-attn-4 is not installed")
    assert harness._with_attention_setup(None, torch.device("cuda")) == \
        "attention without FA4 (flash-attn-4 is not installed)"
    monkeypatch.setattr(fa4_tree_attention, "fa4_unusable_reason", lambda: None)
    assert harness._with_attention_setup("a", torch.device("cuda")) == "a"


def test_harness_steps_alternate_between_two_sets_of_batch_tensors():
    """A timed tree step must do the per-batch host work as a step on a new batch does: the model keeps it per
    tensor object (``LastBatch``), and a whole-bucket tree is not even padded, so feeding one batch again would
    time cached plans.  ``batches_step(..., make)`` alternates between two sets of distinct tensors, and prepares
    each batch after the backward of the one before it (``TreeModel.prepare``), never before that backward."""
    import torch

    from benchmarks.harness import batches_step, distinct_batches
    from treecompile import Tree
    from treecompile.tree import _TENSOR_FIELDS

    tree = Tree.from_paths([[1, 2, 3], [1, 2, 4]])

    def make(n=1):  # n batches of distinct tensors (CPU batches may share the tree's own)
        return [distinct_batches(lambda: [tree.to_batch()])[0] for _ in range(n)]

    a, b = make()[0], distinct_batches(make)[0]
    for f in _TENSOR_FIELDS:
        assert getattr(a, f) is not getattr(b, f) and torch.equal(getattr(a, f), getattr(b, f)), f

    class Model:  # records what the step does to which batch (by its subtree_end tensor)
        def __init__(self):
            self.events = []

        def __call__(self, batch):
            self.events.append(("fwd", id(batch.subtree_end)))
            loss = self

            class Loss:
                def backward(self):
                    loss.events.append(("bwd", id(batch.subtree_end)))

                def detach(self):
                    return 1.0
            return type("Out", (), {"loss": Loss()})()

        def prepare(self, batch):
            self.events.append(("prep", id(batch.subtree_end)))
            return batch

    tm = Model()
    step = batches_step(tm, make(), lambda: None, make)
    for _ in range(4):
        assert step() == 1.0
    fwd = [i for e, i in tm.events if e == "fwd"]
    assert fwd[0] == fwd[2] != fwd[1] == fwd[3]
    # each forward's batch was prepared right after the backward before it (the first one: not by the step)
    assert tm.events[2::3] == [("prep", i) for i in fwd[1:] + [fwd[0]]]
    assert [e for e, _ in tm.events] == ["fwd", "bwd", "prep"] * 4
    # packed partitions: two batches a step, each prepared after the backward of the one before
    tm = Model()
    step = batches_step(tm, make(2), lambda: None, lambda: make(2))
    step(), step()
    fwd = [i for e, i in tm.events if e == "fwd"]
    assert len(set(fwd)) == 4 and [i for e, i in tm.events if e == "prep"] == fwd[1:] + [fwd[0]]
    tm = Model()
    plain = batches_step(tm, make(), lambda: None)
    plain(), plain()
    fwd = [i for e, i in tm.events if e == "fwd"]
    assert fwd[0] == fwd[1]  # without make: the same tensors every step


def test_cuda_tree_contenders_pass_options_that_tree_step_takes(monkeypatch):
    """Each CUDA-only tree contender's options are ones ``Steps.tree_step`` takes (a CPU run skips them, so a
    misspelt option would only show on the GPU: session 41's first ``tree_keys_gathered`` did)."""
    import inspect

    from benchmarks import harness

    seen = []

    def cuda_tree_step(self, option, **kw):
        inspect.signature(harness.Steps.tree_step).bind(self, **kw)
        seen.append(kw)

    monkeypatch.setattr(harness.Steps, "_cuda_tree_step", cuda_tree_step)
    names = [n for n in harness.TREE_CONTENDERS
             if hasattr(harness.Steps, n) and "_cuda_tree_step" in inspect.getsource(getattr(harness.Steps, n))]
    assert "tree_keys_gathered" in names and len(names) >= 8
    steps = harness.Steps.__new__(harness.Steps)  # nothing built: the contenders only pass their options on
    for name in names:
        getattr(steps, name)()
    assert {"keys": "gathered"} in seen and {"replay": False} in seen and {"cpp_wrapper": True} in seen
    assert {"driver_reads": True} in seen and {"cudagraphs": True} in seen and {"deterministic": True} in seen
    assert {"block_sparse_layout": "heavy_first"} in seen and {"kv_heads": "expanded"} in seen
    assert len(seen) == len(names)


def test_prof_step_loop_runs_the_steps_back_to_back_between_two_synchronizes(monkeypatch):
    """``--loop`` (``prof_step``'s and the harness's: ``harness.steps_seconds``): N steps with one synchronize before
    and one after, none between (the steps overlap on the GPU as in a training loop that does not wait each step); a
    synchronized step waits before and after."""
    from benchmarks import harness

    calls = []
    monkeypatch.setattr(harness, "_sync", lambda dev: calls.append("sync"))
    assert harness.steps_seconds(lambda: calls.append("step"), torch.device("cuda"), 4) >= 0
    assert calls == ["sync"] + ["step"] * 4 + ["sync"]
    calls.clear()
    harness.steps_seconds(lambda: calls.append("step"), torch.device("cuda"))
    assert calls == ["sync", "step", "sync"]


def test_prof_step_gaps_by_length_bins_the_idle_between_merged_kernels():
    """The loop profile's idle time: gaps between kernels (one inside another or touching it leaves none), binned by
    length per step, the longest named by the kernels on both sides."""
    from benchmarks.prof_step import gaps_by_length

    kernels = [("e", 500, 600), ("a", 0, 10), ("b", 15, 30), ("c", 20, 25), ("d", 100, 110), ("f", 600, 700),
               ("g", 1000, 1010)]  # gaps: a-b 5 us, b-d 70 (c inside b), d-e 390, f-g 300; e-f touch
    got = gaps_by_length(kernels, 2, top=2)
    assert got["gaps"] == {"<10us": [0.5, 0.003], "10-50us": [0.0, 0.0], "50-200us": [0.5, 0.035],
                           ">=200us": [1.0, 0.345]}
    assert got["idle_ms"] == pytest.approx(0.3825, abs=1e-3) and got["largest"] == [(0.39, "d", "e"), (0.3, "f", "g")]
    assert gaps_by_length([], 1) == {"idle_ms": 0.0, "gaps": {k: [0.0, 0.0] for k in got["gaps"]}, "largest": []}


def test_harness_loop_times_rounds_of_back_to_back_steps(tmp_path):
    """``--loop N``: after the first step, 3 rounds of N steps each timed as one (per step), no synchronize between
    the steps of a round; the setting reaches the isolated children and env.json says how steps were timed."""
    import argparse
    import json

    from benchmarks import harness

    calls, cpu = [], torch.device("cpu")
    first, ts, peak, loss = harness.time_steps(lambda: calls.append(1) or torch.tensor(2.0), cpu, iters=5, loop=4)
    assert len(calls) == 1 + harness.LOOP_ROUNDS * 4 and len(ts) == harness.LOOP_ROUNDS and loss == 2.0
    calls.clear()
    assert len(harness.time_steps(lambda: calls.append(1) or torch.tensor(0.0), cpu, iters=5)[1]) == 5
    assert len(calls) == 6
    args = argparse.Namespace(device="cuda", dtype="bfloat16", iters=3, loop=7, capacity=64, paths=2, path_len=8,
                              agentic_scale=1.0, por=[0.5], group=[], suite=["sweep"], agentic=None, rf_on_cuda=False)
    cmd = harness.child_command(args, model="dense-tiny", case_index=0, contender="tree", out=str(tmp_path))
    assert cmd[cmd.index("--loop") + 1] == "7"
    with pytest.raises(SystemExit, match="--loop"):
        harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--loop", "-1"])
    rc = harness.main(["--device", "cpu", "--tiny", "--model", "dense-tiny", "--dtype", "float64", "--suite", "sweep",
                       "--por", "0.5", "--paths", "4", "--path-len", "32", "--contenders", "packed_flex", "--loop", "2",
                       "--out", str(tmp_path)])
    assert rc == 0 and json.load(open(tmp_path / "env.json"))["timing"] == "loop 2"
    (row,) = _jsonl(tmp_path / "results.jsonl")
    assert row["status"] == "ok" and len(row["step_times_s"]) == harness.LOOP_ROUNDS
    assert row["clocks"] is None  # sampled on CUDA only


def test_harness_samples_the_clocks_over_the_timed_steps_only():
    """``time_steps(clocks=...)``: the sampler runs around the timed steps, not the first (compiling) one."""
    import contextlib

    from benchmarks import harness

    calls = []

    @contextlib.contextmanager
    def clocks():
        calls.append("clocks on")
        yield
        calls.append("clocks off")

    harness.time_steps(lambda: calls.append("step") or torch.tensor(1.0), torch.device("cpu"), iters=2,
                       clocks=clocks())
    assert calls == ["step", "clocks on", "step", "step", "clocks off"]


def test_packed_fa4_varlen_cudagraphs_compiles_the_packed_step_for_cuda_graphs(monkeypatch):
    """The packed baseline's CUDA-graph form (on request): the same packs, compiled with inductor's
    ``mode="reduce-overhead"`` (the plain one with the default mode)."""
    from types import SimpleNamespace

    from benchmarks import fa4_baselines, harness

    assert "packed_fa4_varlen_cudagraphs" in harness.BASELINES and "packed_fa4_varlen_cudagraphs" in harness.ON_REQUEST
    modes = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: modes.append(kw.get("mode")) or fn)
    pack = SimpleNamespace(ids=torch.zeros(4, dtype=torch.long), targets=torch.zeros(4, dtype=torch.long),
                           same=torch.zeros(4), cu=torch.tensor([0, 4]))
    steps = SimpleNamespace(spec=SimpleNamespace(packing_refusal=lambda model, windows: None),
                            dev=torch.device("cuda"), case=SimpleNamespace(paths=[[1, 2], [3, 4]]),
                            pack_tensors=lambda members, n, wdtype: pack, model=torch.nn.Linear(2, 2))
    for cudagraphs in (False, True):
        assert callable(fa4_baselines.packed_fa4_varlen(steps, 16, cudagraphs=cudagraphs))
    assert modes == [None, "reduce-overhead"]
    # its gradients: zeroed views of one buffer per dtype, which a backward adds into in place (a graph's own
    # gradient outputs are overwritten by the next pack's replay)
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2).double()
    params = [*first.parameters(), *second.parameters()]
    fa4_baselines.zeroed_grads(params)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) and p.grad.shape == p.shape for p in params)
    assert len({p.grad.untyped_storage().data_ptr() for p in params}) == 2  # one buffer per dtype
    grads = [p.grad for p in params]
    for _ in range(2):
        second(first(torch.ones(1, 3)).double()).sum().backward()
    assert all(p.grad is g for p, g in zip(params, grads)) and all(p.grad.abs().sum() > 0 for p in params)


def test_redundancy_free_bench_cpu_rows_and_modes(tmp_path):
    """``benchmarks.redundancy_free_cuda`` on the CPU (float64, graphs run eagerly: the plumbing): ``--modes rf`` runs
    the whole tree and the RF rows only, each equal to the whole tree; an unknown mode is refused by name."""
    import json

    from benchmarks import redundancy_free_cuda as bench

    out = tmp_path / "rf"
    args = ["--device", "cpu", "--model", "dense-tiny", "--paths", "4", "--path-len", "48", "--graphs", "eager",
            "--bounds", "chain", "--out", str(out)]
    assert bench.main(args + ["--modes", "rf"]) == 0
    rows = [json.loads(line) for line in (out / "rf_cuda.jsonl").read_text().splitlines()]
    assert [r["mode"] for r in rows][0] == "whole" and {r["mode"] for r in rows[1:]} == {"rf"}
    ran = [r for r in rows[1:] if "error" not in r]
    assert ran and all(r["loss_rel_diff"] < 1e-12 and r["grad_cos"] > 1 - 1e-12 for r in ran), rows
    with pytest.raises(SystemExit):
        bench.main(args + ["--modes", "rf,whole"])
