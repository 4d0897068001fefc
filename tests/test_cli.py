"""The command line: stats == POR/ERR computed independently; bad inputs exit 1 in one line, leaving nothing.

Most commands run in-process through ``cli.main`` (fast); a few run as ``python -m treecompile`` to
check exit codes and that no traceback reaches the user.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from treecompile import cli
from treecompile.runtime.partition import pack
from treecompile.tree import Tree

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["demo", "rewrite", "inspect", "stats", "bench"]


def run_cli(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def shared():
    """The rewrite tests build the same reference model many times: one torch.export per process and
    architecture (``helpers.shared_capture``); load, passes, checks and writes run as usual."""
    from helpers import shared_capture

    with shared_capture():
        yield


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# ---------------------------------------------------------------------------------------------- stats
def random_trees(seed: int, n_trees: int):
    rng = random.Random(seed)
    trees = {}
    for t in range(n_trees):
        base = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
        paths = []
        for _ in range(rng.randrange(1, 8)):
            cut = rng.randrange(0, len(base) + 1)
            paths.append(base[:cut] + [rng.randrange(1, 50) for _ in range(rng.randrange(0 if cut else 1, 25))])
        if rng.random() < 0.3:
            paths.append(list(paths[0]))  # a duplicate
        trees[f"t{t}" if t % 2 else t] = paths  # string and integer ids
    return trees


def write_jsonl(path: Path, trees: dict, seed: int = 0) -> None:
    rng = random.Random(seed)
    order = list(trees)
    rng.shuffle(order)  # trees in any order; the lines of one tree are contiguous (the data contract)
    with open(path, "w") as f:
        for i, tid in enumerate(order):
            for p in trees[tid]:
                f.write(json.dumps({"tree_id": tid, "input_ids": p, "reward": 1.0}) + "\n")
            if i % 5 == 0:
                f.write("\n")  # blank lines are skipped


def independent(paths: list[list[int]], C: int) -> dict:
    """POR/ERR from prefix sets, not from Tree: unique tokens = distinct non-empty prefixes."""
    path_tokens = sum(len(p) for p in paths)
    unique = len({tuple(p[:i + 1]) for p in paths for i in range(len(p))})
    out = {"path_tokens": path_tokens, "unique_tokens": unique, "por": 1 - unique / path_tokens,
           "err_whole": 1 - unique / path_tokens, "err_rf": 1 - unique / path_tokens}
    if max(len(p) for p in paths) <= C:
        plan = pack(Tree.from_paths(paths), C)
        computed = 0
        for i in range(len(plan)):  # a partition computes the union of its leaves' prefixes
            part = plan.leaf_paths(i)
            union = {tuple(p[:j + 1]) for p in part for j in range(len(p))}
            assert len(union) <= C
            computed += len(union)
        out["err_packed"], out["packed_parts"] = 1 - computed / path_tokens, len(plan)
        out["packed_computed"] = computed
    else:
        out["err_packed"] = None
    return out


@pytest.mark.parametrize("C", [24, 40])
def test_stats_matches_independent_por_err(tmp_path, capsys, C):
    trees = random_trees(seed=C, n_trees=12)
    data = tmp_path / "data.jsonl"
    write_jsonl(data, trees, seed=C)
    rc, out, err = run_cli(["stats", str(data), "--budget", str(C), "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert [r["tree_id"] for r in rep["trees"]] == [k for k in _first_order(data)]
    tot_pt = tot_ut = tot_packed = 0
    packed_ok = True
    for r in rep["trees"]:
        paths = trees[r["tree_id"]]
        want = independent(paths, C)
        assert r["paths"] == len(paths)
        assert r["path_tokens"] == want["path_tokens"] and r["unique_tokens"] == want["unique_tokens"]
        assert r["por"] == pytest.approx(want["por"], abs=1e-15)
        assert r["modes"]["whole"]["err"] == pytest.approx(want["err_whole"], abs=1e-15)
        assert r["modes"]["redundancy_free"]["err"] == pytest.approx(want["err_rf"], abs=1e-15)
        if want["err_packed"] is None:
            assert r["modes"]["packed"]["err"] is None and "exceeds the budget" in r["modes"]["packed"]["why"]
            packed_ok = False
        else:
            assert r["modes"]["packed"]["err"] == pytest.approx(want["err_packed"], abs=1e-15)
            assert r["modes"]["packed"]["partitions"] == want["packed_parts"]
            tot_packed += want["packed_computed"]
        tot_pt += want["path_tokens"]
        tot_ut += want["unique_tokens"]
    t = rep["total"]
    assert t["path_tokens"] == tot_pt and t["unique_tokens"] == tot_ut
    assert t["por"] == pytest.approx(1 - tot_ut / tot_pt, abs=1e-15)  # token-summed, not a mean of ratios
    assert t["modes"]["redundancy_free"]["err"] == pytest.approx(1 - tot_ut / tot_pt, abs=1e-15)
    if packed_ok:
        assert t["modes"]["packed"]["err"] == pytest.approx(1 - tot_packed / tot_pt, abs=1e-15)
    else:
        assert t["modes"]["packed"]["err"] is None
    assert C != 24 or not packed_ok  # the small budget does exercise the "path too long" row

    rc, out, err = run_cli(["stats", str(data), "--budget", str(C)], capsys)
    assert rc == 0 and err == ""
    assert "| TOTAL" in out and "ERR packed" in out and "ERR redundancy_free" in out
    assert f"{1 - tot_ut / tot_pt:.4f}" in out


def _first_order(path: Path) -> list:
    seen = []
    for line in path.read_text().splitlines():
        if line.strip():
            tid = json.loads(line)["tree_id"]
            if tid not in seen:
                seen.append(tid)
    return seen


# stats reads with the training reader (runtime/data.py): whatever training refuses, stats refuses,
# naming file:line, in one line, exit 1
BAD_LINES = [
    ('{"tree_id": 1, "input_ids": [1, 2', "bad JSON"),
    ('{"tree_id": 1}', "missing 'input_ids'"),
    ('{"tree_id": 1, "input_ids": [1, -2]}', "-2"),
    ('{"tree_id": 1, "input_ids": [1, 2.5]}', "2.5"),
    ('{"tree_id": 1, "input_ids": [1, 2.0]}', "input_ids[1] = 2.0"),
    ('{"tree_id": 1, "input_ids": [1, true]}', "input_ids[1] = true"),
    ('{"tree_id": 1, "input_ids": [1, %d]}' % 2**70, "out of range"),
    ('{"input_ids": [1, 2]}', "tree_id"),
    ('[1, 2, 3]', "JSON object"),
    ('{"tree_id": 1, "input_ids": [1, 2], "advantage": NaN}', "NaN"),
    ('{"tree_id": 1, "input_ids": [1, 2], "weight": Infinity}', "Infinity"),
    ('{"tree_id": 1, "input_ids": [1, 2], "weight": 1e999}', "'weight' is not finite"),
    ('{"tree_id": 1, "input_ids": [1, 2], "loss_masks": [0, 1]}', "loss_masks"),
    ('{"tree_id": 1, "input_ids": [1, 2], "loss_mask": [0, 1, 1]}', "'loss_mask' has 3 entries"),
    ('{"tree_id": true, "input_ids": [1, 2]}', "'tree_id' must be"),
    ('{"tree_id": 1.5, "input_ids": [1, 2]}', "'tree_id' must be"),
    ('{"group_id": 1, "input_ids": [1, 2]}', "rename it to 'tree_id'"),
    ('{"tree_id": 0, "input_ids": [1, 2]}', "tree_id 0 reappears"),  # line 1 is tree 0, line 2 tree 7
]


@pytest.mark.parametrize("line, needle", BAD_LINES, ids=[n for _, n in BAD_LINES])
def test_stats_refuses_what_training_refuses(tmp_path, capsys, line, needle):
    from treecompile.runtime.data import read_trajectories

    data = tmp_path / "bad.jsonl"
    data.write_text('{"tree_id": 0, "input_ids": [1, 2, 3]}\n{"tree_id": 7, "input_ids": [4, 5]}\n\n' + line + "\n")
    before = listing(tmp_path)
    rc, out, err = run_cli(["stats", str(data)], capsys)
    assert rc == 1 and out == ""
    one_line_error(err, f"{data}:4", needle)
    assert listing(tmp_path) == before
    with pytest.raises(ValueError) as e:  # the same refusal, word for word, from the training reader
        list(read_trajectories(data))
    assert err.strip() == f"treecompile stats: error: {' '.join(str(e.value).split())}"


def test_stats_vocab_size(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"tree_id": 1, "input_ids": [1, 2, 3]}\n{"tree_id": 1, "input_ids": [1, 2, 9]}\n')
    rc, out, err = run_cli(["stats", str(data), "--vocab-size", "10", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["vocab_size"] == 10 and json.loads(out)["total"]["unique_tokens"] == 4
    rc, out, err = run_cli(["stats", str(data), "--vocab-size", "9"], capsys)
    assert rc == 1 and out == ""
    one_line_error(err, f"{data}:2", "input_ids[2] = 9", "vocab_size 9")
    rc, _, err = run_cli(["stats", str(data), "--vocab-size", "0"], capsys)
    assert rc == 1
    one_line_error(err, "--vocab-size 0")


def test_stats_missing_file_and_bad_budget(tmp_path, capsys):
    rc, _, err = run_cli(["stats", str(tmp_path / "none.jsonl")], capsys)
    assert rc == 1
    one_line_error(err, "none.jsonl", "no such file")
    data = tmp_path / "d.jsonl"
    data.write_text('{"tree_id": 1, "input_ids": [1, 2, 3]}\n')
    rc, _, err = run_cli(["stats", str(data), "--budget", "0"], capsys)
    assert rc == 1
    one_line_error(err, "--budget")
    rc, _, err = run_cli(["stats", str(data), "--budget", "many"], capsys)
    assert rc == 2 and "--budget" in err


def test_stats_into_a_closed_pipe_exits_quietly(tmp_path):
    """`treecompile stats --json | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    # ~450 bytes of JSON a tree: 400 trees are ~180 KB, nearly 3x a 64 KiB pipe buffer
    trees = {t: [[1, 2, 3 + t % 40], [1, 2, 50 + t % 40, 7]] for t in range(400)}
    data = tmp_path / "many.jsonl"
    write_jsonl(data, trees)
    p = subprocess.Popen([sys.executable, "-m", "treecompile", "stats", str(data), "--json"], cwd=ROOT,
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"{"
    p.stdout.close()  # like `head -1`: the output (> a pipe buffer) is still being written
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert p.returncode == 1 and err == "", err


# ---------------------------------------------------------------------------------------------- progress
def test_one_progress_bar_for_stats_and_training(capsys):
    from treecompile.runtime import data, progress, train

    assert data.Progress is progress.Progress and train.Progress is progress.Progress
    bar = progress.Progress(100, "x", enabled=False)
    bar.update(advance=50)
    bar.close()
    assert capsys.readouterr().err == "" and bar.done == 50
    bar = progress.Progress(10, "train_step", enabled=True, unit="batches")
    for _ in range(10):
        bar.update(7)
    text = capsys.readouterr().err
    assert "100% 10/10 batches, 70 tokens" in text and text.startswith("\r")
    bar.close()
    assert capsys.readouterr().err.strip() == ""  # the line is cleared


def test_one_list_of_modes():
    from treecompile.runtime import partition, stats, train

    assert stats.stats_modes() == ("whole", *train.MODES)
    assert "MODES" not in vars(cli) and stats.MODES is train.MODES  # imported, not a second list
    # defined beside the partitioners: `treecompile stats` lists the modes without importing the training
    # step and the compiler passes behind it (~1 s of CPU a run)
    assert stats.MODES is partition.MODES


# ---------------------------------------------------------------------------------------------- rewrite
@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    d = tmp_path_factory.mktemp("hf") / "qwen3"
    cfg = transformers.Qwen3Config(vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(d)
    return d


def test_rewrite_and_inspect_reference_model(tmp_path, capsys, shared):
    out_dir = tmp_path / "out"
    rc, out, err = run_cli(["rewrite", "dense-tiny", "--out", str(out_dir), "--seed", "3"], capsys)
    assert rc == 0, err
    assert "rewrite_attention=2" in out
    assert listing(tmp_path) == ["out", "out/manifest.json", "out/model.safetensors", "out/program.pt2"]
    rc, out, err = run_cli(["inspect", str(out_dir)], capsys)
    assert rc == 0, err
    assert "treecompile::tree_attention" in out and "Attention" in out and "dense-tiny" in out
    assert "tree_subtree_end" in out and "float32" in out
    rc, out, _ = run_cli(["inspect", str(out_dir), "--json"], capsys)
    assert rc == 0 and json.loads(out)["extra"] == {"source": "dense-tiny", "seed": 3, "dtype": "float32"}
    # an existing non-empty --out is refused before any work, and left as it was
    rc, _, err = run_cli(["rewrite", "dense-tiny", "--out", str(out_dir)], capsys)
    assert rc == 1
    one_line_error(err, f"--out {out_dir}", "--overwrite")
    assert listing(tmp_path) == ["out", "out/manifest.json", "out/model.safetensors", "out/program.pt2"]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_rewrite_stopped_by_a_signal_leaves_nothing(tmp_path, capsys, monkeypatch, sig):
    """A signal that arrives while the program is being written (the archive written, the weights next): the
    temporary directory beside ``--out`` is removed and the exit code says which signal (128 + its number), as
    for Ctrl-C (SIGINT: 130); the handlers the process had before are back afterwards."""
    import signal

    import safetensors.torch

    signum = getattr(signal, sig)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    real = safetensors.torch.save_file
    sent = []

    def save_file(*a, **k):  # the archive is on disk in the temporary directory now
        assert [p.name for p in tmp_path.iterdir()] and not (tmp_path / "out").exists()
        sent.append(sig)
        os.kill(os.getpid(), signum)
        return real(*a, **k)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    rc, _, err = run_cli(["rewrite", "dense-tiny", "--out", str(tmp_path / "out")], capsys)
    assert sent == [sig] and rc == 128 + signum
    assert err.strip().splitlines()[-1] == ("treecompile rewrite: interrupted" if sig == "SIGINT" else
                                            f"treecompile rewrite: terminated ({sig})")
    assert listing(tmp_path) == []
    assert {s: signal.getsignal(s) for s in before} == before


def test_rewrite_bad_inputs_exit_1_and_leave_nothing(tmp_path, capsys, hf_dir):
    import torch
    from safetensors.torch import load_file, save_file

    cases = []
    cases.append((["rewrite", str(tmp_path / "missing")], ["missing", "no such directory"]))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((hf_dir / "config.json").read_text())
    cases.append((["rewrite", str(no_weights)], ["no_weights", "no *.safetensors"]))
    corrupt = shutil.copytree(hf_dir, tmp_path / "corrupt")
    w = corrupt / "model.safetensors"
    w.write_bytes(w.read_bytes()[:200])
    cases.append((["rewrite", str(corrupt)], ["model.safetensors", "cannot read safetensors"]))
    garbage = shutil.copytree(hf_dir, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x00" * 64)
    cases.append((["rewrite", str(garbage)], ["model.safetensors", "cannot read safetensors"]))
    badjson = shutil.copytree(hf_dir, tmp_path / "badjson")
    (badjson / "config.json").write_text("{not json")
    cases.append((["rewrite", str(badjson)], ["config.json", "invalid JSON"]))
    nested = shutil.copytree(hf_dir, tmp_path / "nested")
    (nested / "config.json").write_text("[" * 100_000 + "]" * 100_000)  # past json's recursion limit
    cases.append((["rewrite", str(nested)], ["config.json", "invalid JSON", "RecursionError"]))
    # custom code named by auto_map (transformers would ask on a terminal whether to run it): refused before
    # transformers reads the directory, and the module never runs
    remote = shutil.copytree(hf_dir, tmp_path / "remote")
    cfg = json.loads((remote / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    (remote / "config.json").write_text(json.dumps(cfg))
    ran = tmp_path / "ran"
    for mod in ("configuration_evil", "modeling_evil"):
        (remote / f"{mod}.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    cases.append((["rewrite", str(remote)], ["config.json", "auto_map names custom code (AutoConfig, "
                                                           "AutoModelForCausalLM)"]))
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases.append((["rewrite", "dense-tiny", "--out", str(a_file / "out")], ["--out", f"{a_file} is a file"]))
    cases.append((["rewrite", "dense-tiny", "--out", str(a_file / "sub" / "out")], [f"{a_file} is a file"]))
    cases.append((["rewrite", "dense-tiny", "--out", str(tmp_path / "none" / "out")], ["does not exist"]))
    cases.append((["rewrite", "dense-tiny", "--out", str(tmp_path / os.fsdecode(b"nu\xff"))], ["not valid UTF-8"]))
    empty_file = tmp_path / "empty_file"
    empty_file.write_text("")
    cases.append((["rewrite", "dense-tiny", "--out", str(empty_file)], ["empty_file", "is an existing file"]))
    cases.append((["rewrite", "dense-tiny", "--out", str(a_file), "--overwrite"],
                  ["a_file", "is an existing file", "replaces only a saved program"]))
    user_dir = tmp_path / "user_dir"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("mine")
    cases.append((["rewrite", "dense-tiny", "--out", str(user_dir)], ["user_dir", "not empty", "--overwrite"]))
    cases.append((["rewrite", "dense-tiny", "--out", str(user_dir), "--overwrite"],
                  ["user_dir", "no treecompile manifest.json", "left as it is"]))
    shapes = shutil.copytree(hf_dir, tmp_path / "shapes")
    state = load_file(str(shapes / "model.safetensors"))
    state["model.norm.weight"] = torch.ones(17)
    save_file(state, str(shapes / "model.safetensors"), metadata={"format": "pt"})
    cases.append((["rewrite", str(shapes)], ["shapes", "model.norm.weight: file [17], config [16]"]))
    cases.append((["rewrite", "nonsense-model"], ["nonsense-model", "dense-tiny"]))
    for argv, needles in cases:
        if "--out" not in argv:
            argv = argv + ["--out", str(tmp_path / "out")]
        before = listing(tmp_path)
        rc, out, err = run_cli(argv, capsys)
        assert rc == 1, (argv, err)
        one_line_error(err, *needles)
        assert listing(tmp_path) == before, argv
    assert not ran.exists()


def test_rewrite_weights_missing_a_tensor_is_refused(tmp_path, capsys, hf_dir):
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(hf_dir, tmp_path / "partial")
    state = load_file(str(d / "model.safetensors"))
    state.pop("model.norm.weight")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = run_cli(["rewrite", str(d), "--out", str(tmp_path / "out")], capsys)
    assert rc == 1
    one_line_error(err, "model.norm.weight")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("error", ["oserror", "safetensors"])
def test_rewrite_unwritable_out_fails_late_and_leaves_nothing(tmp_path, capsys, monkeypatch, error, shared):
    """The write itself fails (disk full): one line, exit 1, no temp directory left."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*a, **k):
        if error == "oserror":
            raise OSError(28, "No space left on device")
        # what safetensors raises on a full disk
        raise SafetensorError('Error while serializing: I/O error: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    rc, _, err = run_cli(["rewrite", "dense-tiny", "--out", str(tmp_path / "out")], capsys)
    assert rc == 1
    one_line_error(err, "--out", "cannot write (No space left on device)")
    assert listing(tmp_path) == []


def test_rewrite_refuses_when_the_weights_cannot_fit(tmp_path, capsys, monkeypatch):
    import collections
    import shutil as shutil_mod

    usage = collections.namedtuple("usage", "total used free")
    import treecompile

    def no_capture(*a, **k):
        raise AssertionError("the space check comes after the capture")

    monkeypatch.setattr(shutil_mod, "disk_usage", lambda p: usage(1 << 30, (1 << 30) - (1 << 20), 1 << 20))
    monkeypatch.setattr(treecompile, "compile", no_capture)  # refused before spending the capture
    rc, _, err = run_cli(["rewrite", "dense-tiny", "--out", str(tmp_path / "out")], capsys)
    assert rc == 1
    one_line_error(err, "--out", "not enough space (1 MiB free")
    assert listing(tmp_path) == []


def test_rewrite_overwrite_only_replaces_a_saved_program(tmp_path, capsys, monkeypatch, shared):
    out_dir = tmp_path / "out"
    assert run_cli(["rewrite", "dense-tiny", "--out", str(out_dir), "--seed", "1"], capsys)[0] == 0
    rc, _, err = run_cli(["rewrite", "dense-tiny", "--out", str(out_dir), "--seed", "2", "--overwrite"], capsys)
    assert rc == 0, err
    assert json.loads((out_dir / "manifest.json").read_text())["extra"]["seed"] == 2
    assert listing(tmp_path) == ["out", "out/manifest.json", "out/model.safetensors", "out/program.pt2"]
    # a saved program with the user's own file next to it: refused naming the file, everything kept
    (out_dir / "notes.txt").write_text("keep me")
    rc, _, err = run_cli(["rewrite", "dense-tiny", "--out", str(out_dir), "--seed", "3", "--overwrite"], capsys)
    assert rc == 1
    one_line_error(err, f"--out {out_dir}", "also holds notes.txt, which save did not write")
    assert json.loads((out_dir / "manifest.json").read_text())["extra"]["seed"] == 2
    (out_dir / "notes.txt").unlink()
    # the current directory (or one holding it) cannot be renamed away: refused up front, nothing left
    monkeypatch.chdir(out_dir)
    for target in (".", str(out_dir), str(tmp_path)):
        rc, _, err = run_cli(["rewrite", "dense-tiny", "--out", target, "--overwrite"], capsys)
        assert rc == 1
        one_line_error(err, f"--out {target}", "current directory")
    assert listing(tmp_path) == ["out", "out/manifest.json", "out/model.safetensors", "out/program.pt2"]


def test_capture_refusal_names_the_model_line(tmp_path, capsys, monkeypatch):
    """torch.export's "Constraints violated (seq)" becomes one line naming the model's own source line."""
    import torch
    from torch import nn

    class LoopOverLength(nn.Module):  # a recurrent scan written as a Python loop: specialises the length
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)

        def forward(self, ids):
            h = self.emb(ids)
            outs = [h[:, 0]]
            for i in range(1, ids.shape[1]):  # LOOP-LINE
                outs.append(outs[-1] * 0.5 + h[:, i])
            return self.head(torch.stack(outs, 1))

    class BoundedTable(nn.Module):  # a fixed-size position table: bounds the length
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)
            self.register_buffer("table", torch.randn(64, 4))

        def forward(self, ids):
            return self.head(self.emb(ids) + self.table[: ids.shape[1]])

    class Unfolds(BoundedTable):  # needs at least 3 tokens: a lower bound (it was called "bounds the length")
        def forward(self, ids):
            h = self.emb(ids)
            return self.head((h.unfold(1, 3, 1) * torch.tensor([0.2, 0.3, 0.5])).sum(-1))

    class CatShift(BoundedTable):  # a shift by concatenation: torch guards the length against 2
        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h + torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1))

    class BranchOnLength(BoundedTable):  # a Python branch on the length: torch writes the guard `s0 > 8`
        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h * 2 if ids.shape[1] > 8 else h)

    class IntOfABuffer(BoundedTable):  # int(tensor): a data-dependent guard (the message named no line)
        def forward(self, ids):
            h = self.emb(ids)
            return self.head(h + torch.roll(h, int(self.table.shape[0] * 0 + self.table[0, 0] > 9), 1))

    for model, needles in ((IntOfABuffer(), ["turns a tensor's value into a Python number", "test_cli.py",
                                             "torch.roll(h, int("]),
                           (LoopOverLength(), ["fixes the length to the example's 16 tokens",
                                               "test_cli.py", "for i in range(1, ids.shape[1]):"]),
                           (BoundedTable(), ["bounds the length", "test_cli.py", "self.table"]),
                           (Unfolds(), ["needs at least 5 tokens", "test_cli.py"]),
                           (BranchOnLength(), ["needs at least 9 tokens", "a branch on the length", "test_cli.py",
                                               "h * 2 if ids.shape[1] > 8 else h"]),
                           (CatShift(), ["behaves differently at some particular length", "test_cli.py",
                                         "torch.cat([torch.zeros_like"])):
        monkeypatch.setattr(cli, "load_model", lambda *a, m=model, **k: (m, {"source": "x", "dtype": "float32"}))
        rc, _, err = run_cli(["rewrite", "whatever", "--out", str(tmp_path / "out")], capsys)
        assert rc == 1
        one_line_error(err, type(model).__name__, *needles)
        assert listing(tmp_path) == []


def test_inspect_errors(tmp_path, capsys):
    rc, _, err = run_cli(["inspect", str(tmp_path / "nope")], capsys)
    assert rc == 1
    one_line_error(err, "nope", "no such directory")
    (tmp_path / "program.pt2").write_bytes(b"PK")
    rc, _, err = run_cli(["inspect", str(tmp_path / "program.pt2")], capsys)
    assert rc == 1
    one_line_error(err, "program.pt2", "is a file, not a saved-program directory")
    rc, _, err = run_cli(["inspect", str(tmp_path)], capsys)
    assert rc == 1
    one_line_error(err, "manifest.json", "missing")


def test_environment_errors_are_one_line(tmp_path, capsys):
    """An OSError from the file system (a path component past the name limit) is one line naming the path and the
    error, exit 1, for each command that takes a path."""
    long = str(tmp_path / ("x" * 300))
    for argv in (["inspect", long], ["stats", long], ["rewrite", "dense-tiny", "--out", long],
                 ["rewrite", long, "--out", str(tmp_path / "out")]):
        rc, _, err = run_cli(argv, capsys)
        assert rc == 1, argv
        one_line_error(err, "x" * 300, "(ENAMETOOLONG)")


def test_inspect_prints_manifest_strings_as_text_and_all_or_nothing(tmp_path, capsys):
    """A manifest edited (and its digest recorded again) to hold terminal escape codes: ``inspect`` prints them
    escaped; one with a malformed field prints nothing but the one-line error."""
    from treecompile import saved

    d = tmp_path / "p"
    assert run_cli(["rewrite", "dense-tiny", "--out", str(d)], capsys)[0] == 0

    def edit(change):
        m = json.loads((d / saved.MANIFEST).read_text())
        change(m)
        m["sha256"][saved.MANIFEST] = saved.manifest_digest(m)
        (d / saved.MANIFEST).write_text(json.dumps(m))

    edit(lambda m: m.__setitem__("model_class", "evil\x1b[2J\rclass\x9b"))
    rc, out, err = run_cli(["inspect", str(d)], capsys)
    assert rc == 0 and err == ""
    assert "evil\\x1b[2J\\x0dclass\\x9b" in out and not any(c in out for c in "\x1b\r\x9b")
    edit(lambda m: m["replaced_ops"].append({"layer_type": "x"}))  # no "replaces" key
    rc, out, err = run_cli(["inspect", str(d)], capsys)
    assert rc == 1 and out == ""
    one_line_error(err, "manifest.json: a field inspect shows is malformed (KeyError")


def test_inspect_checks_the_weights_against_the_manifest(tmp_path, capsys):
    """``inspect`` reads ``model.safetensors``' header: another model's weights, or an empty file, with the hashes
    recorded again (as whoever edits the directory can), are refused as ``load`` refuses them, naming the tensor."""
    import hashlib

    from treecompile import saved

    for name, dtype in (("a", "float32"), ("b", "float64")):
        assert run_cli(["rewrite", "dense-tiny", "--out", str(tmp_path / name), "--dtype", dtype], capsys)[0] == 0

    def resign(d):
        m = json.loads((d / saved.MANIFEST).read_text())
        m["sha256"][saved.WEIGHTS] = hashlib.sha256((d / saved.WEIGHTS).read_bytes()).hexdigest()
        m["sha256"][saved.MANIFEST] = saved.manifest_digest(m)
        (d / saved.MANIFEST).write_text(json.dumps(m))

    other = shutil.copytree(tmp_path / "a", tmp_path / "other")
    shutil.copy(tmp_path / "b" / saved.WEIGHTS, other / saved.WEIGHTS)
    resign(other)
    rc, _, err = run_cli(["inspect", str(other)], capsys)
    assert rc == 1
    one_line_error(err, "model.safetensors", "is float64[", "manifest.json says float32[")
    empty = shutil.copytree(tmp_path / "a", tmp_path / "empty")
    (empty / saved.WEIGHTS).write_bytes(b"")
    resign(empty)
    rc, _, err = run_cli(["inspect", str(empty)], capsys)
    assert rc == 1
    one_line_error(err, "model.safetensors", "cannot read safetensors")
    assert run_cli(["inspect", str(tmp_path / "a")], capsys)[0] == 0


# ---------------------------------------------------------------------------------------------- bench, help
def test_bench_says_where_the_harness_is(capsys):
    """The harness is a checkout script, not part of the installed command: `bench` says how to run it."""
    rc, out, err = run_cli(["bench", "--quick"], capsys)
    assert rc == 1 and out == ""
    one_line_error(err, "python -m benchmarks.harness", ".[bench]")
    rc, out, err = run_cli(["bench", "--help"], capsys)
    assert rc == 0 and "python -m benchmarks.harness" in out and err == ""


def test_bench_extra_installs_matplotlib():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("matplotlib") for r in extras["bench"])


def test_help_does_not_import_torch():
    """`treecompile --help` (and every command's --help) runs without importing torch (fast start)."""
    code = ("import sys\nfrom treecompile import cli\n"
            "for argv in (['--help'], ['stats', '--help'], ['rewrite', '--help'], ['demo', '--help']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit as e:\n        assert e.code == 0\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr


def test_lazy_package_names():
    import treecompile
    import treecompile.compile  # noqa: F401  (binding the submodule must not shadow the function)

    assert callable(treecompile.compile) and not isinstance(treecompile.compile, types.ModuleType)
    assert treecompile.Tree.__name__ == "Tree" and treecompile.reference.run
    assert set(treecompile.__all__) <= set(dir(treecompile))
    with pytest.raises(AttributeError):
        treecompile.nothing_here


def test_demo_refuses_negative_steps(capsys):
    rc, out, err = run_cli(["demo", "--steps", "-1"], capsys)
    assert rc == 1 and out == ""
    one_line_error(err, "--steps -1")


@pytest.mark.parametrize("cmd", COMMANDS[:-1])
def test_help_everywhere(capsys, cmd):
    rc, out, _ = run_cli([cmd, "--help"], capsys)
    assert rc == 0 and f"treecompile {cmd}" in out


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["rewrite", "dense-tiny"], ["nope"], ["stats"], ["rewrite", "dense-tiny", "--out", "x",
                                                                      "--dtype", "int3"]):
        rc, _, err = run_cli(argv, capsys)
        assert rc == 2, argv
        assert "usage:" in err


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_entry_point_exit_codes_without_traceback(tmp_path, capsys):
    """Through ``python -m treecompile``: exit 1 with one line (a data error), exit 2 (usage)."""
    env = _env()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tree_id": 1, "input_ids": [1, 2]}\n{oops\n')
    p = subprocess.run([sys.executable, "-m", "treecompile", "stats", str(bad)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout == ""
    one_line_error(p.stderr, f"{bad}:2", "bad JSON")
    rc, _, err = run_cli(["stats", str(bad).replace("bad", "big")], capsys)  # the same exit path, in-process
    assert rc == 1
    one_line_error(err, "big.jsonl", "no such file")
    p = subprocess.run([sys.executable, "-m", "treecompile", "inspect"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_demo_runs_and_matches_the_per_path_reference(capsys, shared):
    from treecompile.cli import main

    assert main(["demo", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "Tree(num_paths=4" in out and "rewrite_attention: 2" in out
    grad_diff = float(out.split("gradient rel. diff ")[1].split()[0])
    assert grad_diff < 1e-9
    losses = [float(line.split("loss ")[1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_stats_refuses_shared_tokens_whose_logprobs_disagree(tmp_path, capsys):
    """Two paths give one shared trained token different old log-probs: training refuses that tree, so stats does
    too (it accepted the file)."""
    data = tmp_path / "old.jsonl"
    data.write_text('{"tree_id": 0, "input_ids": [1, 2, 3], "old_logprobs": [0, -1.0, -2.0]}\n'
                    '{"tree_id": 0, "input_ids": [1, 2, 4], "old_logprobs": [0, -1.5, -2.0]}\n')
    rc, out, err = run_cli(["stats", str(data)], capsys)
    assert rc == 1 and out == ""
    one_line_error(err, "old_logprobs: the token at depth 1 (id 2) is shared by", f"{data}:2")
