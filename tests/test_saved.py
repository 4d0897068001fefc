"""Saved programs: ``treecompile.saved.load(DIR)`` in a fresh process == ``treecompile.compile(model)``, exactly.

Dense and hybrid reference models (saved through the API) and an HF Qwen3 directory written with
``save_pretrained`` (rewritten through ``treecompile rewrite``): loss, per-token log-probs, every
gradient, and the parameters after one SGD step are compared with ``torch.equal`` (bitwise).
"""

from __future__ import annotations

import copy
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import treecompile
from treecompile import Tree, cli, saved
from helpers import cached_compile, cached_model, shared_capture, tiny_dense
from treecompile.models import HybridConfig, HybridForCausalLM

ROOT = Path(__file__).resolve().parents[1]
# odd shapes on purpose: duplicates, a path that is a prefix of another, one-token nodes, a forest
PATHS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [1, 2], [1, 2, 7, 8, 9, 3, 3, 3, 3], [1, 2, 7, 5],
         [4, 5, 6], [4, 10, 1, 2, 3, 4, 5, 6, 7, 8]]
MASKS = [[0] + [1] * (len(p) - 1) for p in PATHS]
MASKS[3][:4] = [0, 0, 0, 0]
WEIGHTS = [1.0, 0.5, 2.0, 1.0, -1.0, 1.0, 0.25]
LR = 0.1


def make_batch():
    return Tree.from_paths(PATHS, loss_masks=MASKS, path_weights=WEIGHTS).to_batch(normalize="path_mean")


def run_and_step(tmodel) -> dict:
    """Loss, logprobs, named grads, and the parameters after one SGD step (and the loss after it)."""
    batch = make_batch()
    out = tmodel(batch)
    named = [(n, p) for n, p in tmodel.named_parameters()]
    grads = torch.autograd.grad(out.loss, [p for _, p in named])
    res = {"loss": out.loss.detach(), "logprobs": out.logprobs.detach(),
           "grads": {n: g for (n, _), g in zip(named, grads)}}
    opt = torch.optim.SGD([p for _, p in named], lr=LR)
    for (_, p), g in zip(named, grads):
        p.grad = g
    opt.step()
    opt.zero_grad()
    res["loss_after"] = tmodel(batch).loss.detach()
    res["params_after"] = {n: p.detach().clone() for n, p in named}
    return res


CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    import treecompile
    from treecompile import saved
    from test_saved import run_and_step
    results = {}
    for name, d in zip(sys.argv[3::2], sys.argv[4::2]):
        tm = saved.load(d)
        results[name] = run_and_step(tm)
        results[name]["state_keys"] = sorted(tm.state_dict())
        shared = {}  # id -> the names of one parameter object
        for n, p in tm.model.named_parameters(remove_duplicate=False):
            shared.setdefault(id(p), []).append(n)
        results[name]["shared_params"] = sorted(sorted(v) for v in shared.values() if len(v) > 1)
        results[name]["treecompile_file"] = treecompile.__file__
    torch.save(results, sys.argv[2])
""")


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """name -> (saved dir, results of the freshly compiled model); the dirs are written once."""
    tmp = tmp_path_factory.mktemp("saved")
    out = {}
    dense = cached_model("dense-tiny-v11", lambda: tiny_dense(11))  # test_compile's: captured once per process
    torch.manual_seed(1)
    # 2 layers (tiny's 4 halved: capture, save, load and runs cost half), still one GDN and one
    # attention layer: every op and state kind a saved hybrid program holds
    hybrid = HybridForCausalLM(HybridConfig.tiny(vocab_size=11, num_hidden_layers=2,
                                                 layer_types=("linear_attention", "full_attention"))).double()
    for name, model in (("dense", dense), ("hybrid", hybrid)):
        tm = cached_compile(model)  # compiles any model not from cached_model
        saved.save(tm, tmp / name)
        out[name] = (tmp / name, run_and_step(tm), tm)

    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   tie_word_embeddings=True)
    torch.manual_seed(2)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp / "hf_qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf_qwen3", dtype=torch.float64)
    with shared_capture():  # the CLI loads the same architecture again: one torch.export, passes run twice
        tm = treecompile.compile(model)
        assert cli.main(["rewrite", str(tmp / "hf_qwen3"), "--out", str(tmp / "hf"), "--dtype", "float64"]) == 0
    out["hf_qwen3"] = (tmp / "hf", run_and_step(tm), tm)
    return out


@pytest.fixture(scope="module")
def loaded_in_fresh_process(saved_models, tmp_path_factory):
    res = tmp_path_factory.mktemp("child") / "results.pt"
    args = [str(ROOT / "tests"), str(res)]
    for name, (d, _, _) in saved_models.items():
        args += [name, str(d)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return torch.load(res, weights_only=False)


@pytest.mark.parametrize("name", ["dense", "hybrid", "hf_qwen3"])
def test_load_in_fresh_process_equals_compile_exactly(saved_models, loaded_in_fresh_process, name):
    _, want, tm = saved_models[name]
    got = loaded_in_fresh_process[name]
    assert Path(got["treecompile_file"]).resolve().is_relative_to(ROOT)  # this checkout, not another install
    assert torch.equal(got["loss"], want["loss"])
    assert torch.equal(got["logprobs"], want["logprobs"])
    assert got["grads"].keys() == want["grads"].keys()
    for k in want["grads"]:
        assert torch.equal(got["grads"][k], want["grads"][k]), k
    assert any(float(g.abs().max()) > 0 for g in want["grads"].values())
    # an optimizer on the loaded parameters trains them exactly as it trains the original's
    assert torch.equal(got["loss_after"], want["loss_after"])
    assert not torch.equal(want["loss_after"], want["loss"])
    for k in want["params_after"]:
        assert torch.equal(got["params_after"][k], want["params_after"][k]), k
    # parameter and buffer names are the model's own (HF names), tied weights included
    assert set(got["state_keys"]) == set(tm.model.state_dict())


def test_manifest_records_passes_inputs_and_weights(saved_models):
    d, _, tm = saved_models["hybrid"]
    m = saved.read_manifest(d)
    assert m["format"] == saved.FORMAT and m["torch_version"] == torch.__version__
    assert {k: v["count"] for k, v in m["passes"].items()} == {k: v.count for k, v in tm.pass_results.items()}
    assert [r["name"] for r in m["inputs"]] == ["input_ids"] + [f"tree_{n}" for n in tm.program.tree_inputs]
    conv = next(r for r in m["inputs"] if r["name"] == "tree_conv_index")
    assert conv["shape"] == ["T", tm.program.conv_width]
    ops = {(r["layer_type"], r["op"]): r["count"] for r in m["replaced_ops"]}
    n_gdn = sum(t == "linear_attention" for t in tm.model.config.layer_types)
    assert ops[("GatedDeltaNet", "treecompile::tree_gated_delta_rule")] == n_gdn
    assert ops[("Attention", "treecompile::tree_attention")] == len(tm.model.config.layer_types) - n_gdn
    assert m["num_parameters"] == sum(p.numel() for p in tm.parameters())
    # the program does not carry a second copy of the weights
    assert (d / saved.PROGRAM).stat().st_size < 2 * (d / saved.WEIGHTS).stat().st_size + 600_000


def test_run_options_are_chosen_at_load(saved_models):
    """The CUDA run options are not saved: ``load`` takes them (here ``head_logits``) and checks them."""
    d, _, _ = saved_models["hybrid"]
    assert saved.load(d, head_logits="kept", conv_kernel="fla").program.options.head_logits == "kept"
    assert saved.load(d).program.options.head_logits == "auto"
    with pytest.raises(ValueError, match="head_logits: expected one of"):
        saved.load(d, head_logits="always")


def test_tied_weights_stored_once_and_shared_after_load(saved_models, loaded_in_fresh_process):
    d, _, _ = saved_models["hf_qwen3"]
    m = saved.read_manifest(d)
    assert m["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    # after saved.load in the fresh process (CHILD): lm_head.weight is model.embed_tokens.weight, one object
    assert ["lm_head.weight", "model.embed_tokens.weight"] in loaded_in_fresh_process["hf_qwen3"]["shared_params"]


def test_save_refuses_non_empty_dir_and_failure_leaves_nothing(saved_models, tmp_path, monkeypatch):
    _, _, tm = saved_models["dense"]
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="busy"):
        saved.save(tm, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"]

    import safetensors.torch

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    with pytest.raises(OSError):
        saved.save(tm, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


def test_overwrite_replaces_atomically(saved_models, tmp_path):
    src, _, tm = saved_models["dense"]
    target = tmp_path / "out"
    shutil.copytree(src, target)  # a previous saved program (written by save in the fixture)
    saved.save(tm, target, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == sorted([saved.PROGRAM, saved.WEIGHTS, saved.MANIFEST])
    # really replaced: tm has taken an SGD step since the fixture saved it
    assert (target / saved.WEIGHTS).read_bytes() != (src / saved.WEIGHTS).read_bytes()


def test_saving_again_reuses_the_export_and_writes_the_new_weights(saved_models, tmp_path, monkeypatch):
    """A second save of the same TreeModel (a checkpoint every N steps) does not trace the graph again:
    the program is byte-identical, the weights are the current ones (tm has taken an SGD step)."""
    import gc
    import weakref

    from safetensors.torch import load_file

    src, _, tm = saved_models["dense"]

    def no_export(*a, **k):
        raise AssertionError("re-exported a graph that was already exported")

    monkeypatch.setattr(torch.export, "export", no_export)
    saved.save(tm, tmp_path / "again")
    monkeypatch.undo()
    assert (tmp_path / "again" / saved.PROGRAM).read_bytes() == (src / saved.PROGRAM).read_bytes()
    got = load_file(str(tmp_path / "again" / saved.WEIGHTS))
    assert got.keys() == load_file(str(src / saved.WEIGHTS)).keys()
    for k, v in got.items():
        assert torch.equal(v, tm.model.get_parameter(k) if k in dict(tm.model.named_parameters())
                           else tm.model.get_buffer(k)), k
    assert not torch.equal(got["model.norm.weight"], load_file(str(src / saved.WEIGHTS))["model.norm.weight"])
    # the remembered export does not keep its TreeModel alive
    with warnings.catch_warnings():  # torch's own pytree deprecation, raised while copying the graph's specs
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        copy_tm = copy.deepcopy(tm)
    saved.save(copy_tm, tmp_path / "copy")  # another object: exported anew
    ref = weakref.ref(copy_tm)
    del copy_tm
    gc.collect()
    assert ref() is None


def test_overwrite_failure_keeps_the_old_program_and_leaves_no_temporaries(saved_models, tmp_path, monkeypatch):
    """A failed rename while overwriting (moving the old program aside, or the new one into place)
    re-raises, leaves the previous program as it was, and no hidden ``.out.*.old``/``.tmp`` directory."""
    src, _, tm = saved_models["dense"]
    target = tmp_path / "out"
    shutil.copytree(src, target)  # a previous saved program (written by save in the fixture)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    real = os.replace
    for failing in ("old aside", "new in"):
        def flaky(src, dst, failing=failing):
            if (failing == "old aside" and Path(src) == target) or \
                    (failing == "new in" and Path(dst) == target and Path(src).name.endswith(".tmp")):
                raise OSError(13, "Permission denied")
            return real(src, dst)

        monkeypatch.setattr(os, "replace", flaky)
        with pytest.raises(OSError, match="Permission denied"):
            saved.save(tm, target, overwrite=True)
        monkeypatch.setattr(os, "replace", real)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], failing
        assert {p.name: p.read_bytes() for p in target.iterdir()} == before, failing


def _rehash(d: Path, name: str) -> None:
    """Record ``d/name``'s current SHA-256 in the manifest (as an attacker or a careless edit would)."""
    import hashlib

    m = json.loads((d / saved.MANIFEST).read_text())
    m["sha256"][name] = hashlib.sha256((d / name).read_bytes()).hexdigest()
    (d / saved.MANIFEST).write_text(json.dumps(m))


def test_load_errors_name_the_file(saved_models, tmp_path):
    src, _, _ = saved_models["dense"]
    with pytest.raises(saved.SavedProgramError, match="no such directory"):
        saved.load(tmp_path / "nope")
    with pytest.raises(saved.SavedProgramError, match=r"program\.pt2: is a file, not a saved-program directory"):
        saved.load(src / saved.PROGRAM)
    d = shutil.copytree(src, tmp_path / "a")
    w = d / saved.WEIGHTS
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])  # truncated
    _rehash(d, saved.WEIGHTS)  # the manifest agrees: the corrupt file itself is named
    with pytest.raises(saved.SavedProgramError, match=r"model\.safetensors: cannot read"):
        saved.load(d)
    d = shutil.copytree(src, tmp_path / "b")
    (d / saved.MANIFEST).unlink()
    with pytest.raises(saved.SavedProgramError, match=r"manifest\.json: missing"):
        saved.load(d)
    (d / saved.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)  # nested past json's recursion limit
    with pytest.raises(saved.SavedProgramError, match=r"manifest\.json: invalid JSON \(RecursionError"):
        saved.load(d)
    d = shutil.copytree(src, tmp_path / "c")
    _manifest_edit(d, lambda m: m["tensors"]["model.norm.weight"].__setitem__("shape", [3]))
    with pytest.raises(saved.SavedProgramError, match=r"model\.norm\.weight"):
        saved.load(d)
    d = shutil.copytree(src, tmp_path / "d")
    (d / saved.PROGRAM).write_bytes(b"not a zip")
    _rehash(d, saved.PROGRAM)
    with pytest.raises(saved.SavedProgramError, match=r"program\.pt2: cannot load"):
        saved.load(d)


# ---------------------------------------------------------------------------------------------- loading runs no code
class _Payload:
    """Unpickling this creates the directory ``path`` (stands for any code an attacker would run)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _tamper(src: Path, dst: Path, edit) -> Path:
    """A copy of the saved directory ``src`` whose program.pt2 entries went through ``edit(entries)``.

    The manifest's SHA-256 is updated as an attacker would, so only the archive check stands in the way.
    """
    import zipfile

    d = shutil.copytree(src, dst)
    p = d / saved.PROGRAM
    with zipfile.ZipFile(p) as z:
        root = z.namelist()[0].split("/", 1)[0]
        entries = {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}
    edit(entries)
    with zipfile.ZipFile(p, "w") as z:
        for n, b in entries.items():
            z.writestr(f"{root}/{n}", b)
    _rehash(d, saved.PROGRAM)
    return d


def _pickled_weight(marker):
    def edit(entries):
        cfg = json.loads(entries["data/weights/model_weights_config.json"])
        meta = cfg["config"]["model.embed_tokens.weight"]
        meta["use_pickle"] = True
        entries["data/weights/" + meta["path_name"]] = __import__("pickle").dumps(_Payload(marker), protocol=2)
        entries["data/weights/model_weights_config.json"] = json.dumps(cfg).encode()
    return edit, r"entry 'data/weights/weight_\d+' \(model\.embed_tokens\.weight\) is marked use_pickle"


def _pickled_sample_inputs(marker):
    def edit(entries):
        entries["data/sample_inputs/model.pt"] = __import__("pickle").dumps(_Payload(marker), protocol=2)
    return edit, r"entry 'data/sample_inputs/model\.pt' holds a pickle"


def _pickled_constant(marker):
    def edit(entries):
        entries["data/constants/opaque_obj_0"] = __import__("pickle").dumps(_Payload(marker), protocol=2)
        entries["data/constants/model_constants_config.json"] = json.dumps(
            {"config": {"c": {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True,
                              "tensor_meta": None}}}).encode()
    return edit, r"entry 'data/constants/opaque_obj_0' is not one a treecompile program holds"


@pytest.mark.parametrize("attack", [_pickled_weight, _pickled_sample_inputs, _pickled_constant])
def test_load_and_inspect_refuse_pickled_payloads_before_torch_runs_them(saved_models, tmp_path, capsys, attack):
    src, _, _ = saved_models["dense"]
    marker = tmp_path / "payload_ran"
    edit, entry = attack(marker)
    d = _tamper(src, tmp_path / "evil", edit)
    # control: torch.export.load itself runs the payload (so this archive is a live attack)
    try:
        torch.export.load(d / saved.PROGRAM)
    except Exception:
        pass
    assert marker.is_dir(), "the crafted payload did not run under torch.export.load: the test proves nothing"
    marker.rmdir()

    with pytest.raises(saved.SavedProgramError, match=r"program\.pt2: refused: " + entry):
        saved.load(d)
    assert not marker.exists()
    assert cli.main(["inspect", str(d)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "program.pt2: refused: entry 'data/" in err, err
    assert not marker.exists()


def test_load_and_inspect_refuse_a_compressed_entry(saved_models, tmp_path, capsys):
    """An archive entry stored compressed (torch writes none: a 1 MB archive could inflate to a 1 GiB graph when
    read) is refused before any entry is read, naming it and both sizes."""
    import zipfile

    src, _, _ = saved_models["dense"]
    d = _tamper(src, tmp_path / "packed", lambda entries: None)
    p = d / saved.PROGRAM
    with zipfile.ZipFile(p) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(p, "w") as z:
        for n, b in entries:
            packed = n.endswith("models/model.json")
            z.writestr(n, b + (b" " * 100_000 if packed else b""),
                       compress_type=zipfile.ZIP_DEFLATED if packed else zipfile.ZIP_STORED)
    _rehash(d, saved.PROGRAM)
    with pytest.raises(saved.SavedProgramError, match=r"program\.pt2: refused: entry 'models/model\.json' is "
                                                      r"compressed \([\d,]+ bytes from [\d,]+\)"):
        saved.load(d)
    assert cli.main(["inspect", str(d)]) == 1
    assert "is compressed" in capsys.readouterr().err


def _graph_edit(change):
    def edit(entries):
        g = json.loads(entries["models/model.json"])
        change(g)
        entries["models/model.json"] = json.dumps(g).encode()
    return edit


def _set_target(target):
    def change(g):
        g["graph_module"]["graph"]["nodes"][3]["target"] = target
    return change


_INJECTED = "__import__('os').makedirs('{marker}', exist_ok=True)"


def _rename_last_input(marker):
    """The last graph input renamed to ``tree_loss_weight=<code>``, everywhere its name appears: FX wrote the name
    into the ``def forward(...)`` it execs, so the code ran as a default argument inside ``torch.export.load``."""
    def change(g):
        text = json.dumps(g)
        new = "tree_loss_weight=" + _INJECTED.format(marker=marker)
        g.clear()
        g.update(json.loads(text.replace('"tree_loss_weight"', json.dumps(new))))
    return change


def _set_expr_to(g, template):
    """The first symbolic size's expression ``e`` replaced by ``template.format(e)``."""
    for v in g["graph_module"]["graph"]["sym_int_values"].values():
        if v.get("as_expr"):
            v["as_expr"]["expr_str"] = template.format(v["as_expr"]["expr_str"])
            return
    raise AssertionError("no symbolic size in the program")


@pytest.mark.parametrize("change, message", [
    (_set_target("torch.os.system"), r"calls 'torch\.os\.system': only torch\.ops\.aten"),
    (_set_target("torch.ops.aten.save.default"), r"calls 'torch\.ops\.aten\.save\.default'"),
    (lambda g: _set_expr_to(g, "Integer(1).__class__"), r"symbolic expression 'Integer\(1\)\.__class__'"),
    # 9**9**9: sympy evaluated it for minutes
    (lambda g: _set_expr_to(g, "Add({}, Integer(9)**Integer(9)**Integer(9))"),
     r"symbolic expression .* has '\*\*Integer\(9\)"),
    (lambda g: _set_expr_to(g, "Mul(Float(Integer(8), Integer(100000000)), {})"), r"a Float with a precision"),
    (lambda g: g.__setitem__("guards_code", ["__import__('os').mkdir('x')"]), r"guard"),
], ids=["python-function", "file-writing-op", "sympify-eval", "power-tower", "float-precision", "guard-code"])
def test_load_refuses_code_in_the_graph(saved_models, tmp_path, change, message):
    src, _, _ = saved_models["dense"]
    d = _tamper(src, tmp_path / "evil", _graph_edit(change))
    with pytest.raises(saved.SavedProgramError, match=r"program\.pt2: refused: entry 'models/model\.json': .*" + message):
        saved.load(d)


def test_load_refuses_code_in_a_graph_name(saved_models, tmp_path):
    src, _, _ = saved_models["dense"]
    marker = tmp_path / "payload_ran"
    d = _tamper(src, tmp_path / "evil", _graph_edit(_rename_last_input(marker)))
    # control: torch.export.load itself runs the name as code (so this archive is a live attack)
    try:
        torch.export.load(d / saved.PROGRAM)
    except Exception:
        pass
    assert marker.is_dir(), "the crafted name did not run under torch.export.load: the test proves nothing"
    marker.rmdir()
    with pytest.raises(saved.SavedProgramError, match=r"program\.pt2: refused: entry 'models/model\.json': name "
                                                      r"\"tree_loss_weight=__import__.* is not a name treecompile"):
        saved.load(d)
    assert not marker.exists()


def test_verify_and_inspect_need_no_import_of_the_ops(saved_models):
    """``treecompile inspect`` in a fresh process checks a valid program (the archive check looked the tree ops up
    before anything had registered them, and refused every program)."""
    import subprocess
    import sys

    d = saved_models["dense"][0]
    code = f"from treecompile import saved; print(sorted(saved.verify({str(d)!r})))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_saved_program_is_data_only_and_hashes_are_checked(saved_models, tmp_path, capsys):
    import zipfile

    for name in saved_models:  # what save writes passes the check: no pickle at all
        d = saved_models[name][0]
        with zipfile.ZipFile(d / saved.PROGRAM) as z:
            assert [i.file_size for i in z.infolist() if i.filename.endswith("sample_inputs/model.pt")] == [0]
        assert saved.verify(d)["format"] == saved.FORMAT
    src, _, _ = saved_models["dense"]
    for f in (saved.WEIGHTS, saved.PROGRAM):
        d = shutil.copytree(src, tmp_path / f)
        data = bytearray((d / f).read_bytes())
        data[-100] ^= 1
        (d / f).write_bytes(bytes(data))
        with pytest.raises(saved.SavedProgramError, match=rf"{f}: SHA-256 [0-9a-f]+\.\.\. does not match manifest\.json"):
            saved.load(d)
        assert cli.main(["inspect", str(d)]) == 1
        assert f"{f}: SHA-256" in capsys.readouterr().err
    d = shutil.copytree(src, tmp_path / "nohash")
    m = json.loads((d / saved.MANIFEST).read_text())
    del m["sha256"]
    (d / saved.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(saved.SavedProgramError, match=r"manifest\.json: no SHA-256 recorded for program\.pt2"):
        saved.load(d)


def test_save_refuses_what_load_would_refuse_and_leaves_nothing(saved_models, tmp_path, monkeypatch):
    from treecompile import program_check

    _, _, tm = saved_models["dense"]
    monkeypatch.setattr(program_check, "OP_NAMESPACES", ("torch.ops.treecompile.",))  # as if aten were not data
    with pytest.raises(saved.SavedProgramError, match=r"cannot be saved as data only .*calls 'torch\.ops\.aten\."):
        saved.save(tm, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_sliding_window_program_saves_and_loads(tmp_path):
    """A program holding ``treecompile::tree_attention_windowed`` (HF Mistral with a 3-token window) loads and
    computes what the compiled model computes, bit for bit."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=4, sliding_window=3)).double()
    tm = treecompile.compile(model)
    assert tm.pass_results["rewrite_attention"].info["windowed"] == 2
    saved.save(tm, tmp_path / "mistral")
    manifest = saved.read_manifest(tmp_path / "mistral")
    assert "tree_attention_windowed" in json.dumps(manifest)
    loaded = saved.load(tmp_path / "mistral")
    batch = make_batch()
    want, got = tm(batch), loaded(batch)
    assert torch.equal(want.loss.detach(), got.loss.detach())
    assert torch.equal(want.logprobs.detach(), got.logprobs.detach())


# ---------------------------------------------------------------------------------------------- manifest and weights
def _manifest_edit(d: Path, change) -> None:
    """``change`` the manifest's fields and record their digest again (as an attacker would)."""
    m = json.loads((d / saved.MANIFEST).read_text())
    change(m)
    m["sha256"][saved.MANIFEST] = saved.manifest_digest(m)
    (d / saved.MANIFEST).write_text(json.dumps(m))


def test_a_manifest_edited_alone_is_refused(saved_models, tmp_path):
    """A tied alias re-pointed at another parameter of the same shape and kind loaded and computed something else
    (no hashed file changed): the manifest's fields carry a digest."""
    src, _, _ = saved_models["dense"]
    d = shutil.copytree(src, tmp_path / "edited")
    m = json.loads((d / saved.MANIFEST).read_text())
    m["model_class"] = "SomethingElse"
    (d / saved.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(saved.SavedProgramError, match=r"manifest\.json: its fields changed after it was saved"):
        saved.load(d)


def _first_two(m, kind="parameter"):
    names = [k for k, s in m["tensors"].items() if s["kind"] == kind and len(s["shape"]) == 2]
    return names[0], names[1]


@pytest.mark.parametrize("change, message", [
    # an alias that names a stored tensor re-pointed it at another weight: the program computed something else
    (lambda m: m.__setitem__("tied", {_first_two(m)[1]: _first_two(m)[0]}), r"but \S+ is stored in model"),
    (lambda m: m["tensors"][_first_two(m)[0]].__setitem__("kind", "buffer"), r"is a buffer, the program reads a "
                                                                             r"parameter"),
    (lambda m: m["tensors"][_first_two(m)[0]].pop("shape"), r"\.shape: expected a list of sizes, got None"),
    (lambda m: m.__setitem__("tied", ["x"]), r"tied: expected a mapping"),
    (lambda m: m.__setitem__("tied", {"__class__": _first_two(m)[0]}), r"cannot register the tensors"),
    (lambda m: m.__setitem__("passes", []), r"passes: expected a mapping"),
    (lambda m: m.__setitem__("conv_width", "3"), r"conv_width: expected null or a positive int"),
], ids=["alias-of-a-stored-weight", "kind", "shape-missing", "tied-list", "alias-name", "passes-list", "conv-width"])
def test_load_refuses_a_manifest_that_disagrees_with_the_program(saved_models, tmp_path, change, message):
    """The manifest is not hashed (it holds the hashes): every field ``load`` reads is checked, against the program
    where the program says the same thing, and refused naming the manifest; nothing loads half-checked."""
    src, _, _ = saved_models["dense"]
    d = shutil.copytree(src, tmp_path / "edited")
    _manifest_edit(d, change)
    with pytest.raises(saved.SavedProgramError, match=message):
        saved.load(d)


def test_load_refuses_weights_the_program_does_not_read(saved_models, tmp_path):
    """Weights of another dtype or shape than the program's parameters (all re-hashed, manifest updated to match
    them) are refused at load, naming the tensor, not at the first forward inside an op."""
    import safetensors.torch

    src, _, _ = saved_models["dense"]
    d = shutil.copytree(src, tmp_path / "f32")
    w = safetensors.torch.load_file(str(d / saved.WEIGHTS))
    w = {k: v.float() for k, v in w.items()}
    safetensors.torch.save_file(w, str(d / saved.WEIGHTS), metadata={"format": "pt"})
    _manifest_edit(d, lambda m: [s.__setitem__("dtype", "float32") for s in m["tensors"].values()])
    _rehash(d, saved.WEIGHTS)
    with pytest.raises(saved.SavedProgramError, match=r"model\.safetensors: \S+ is float32\[.*the program reads "
                                                      r"float64"):
        saved.load(d)


@pytest.mark.parametrize("device, message", [("bogus", "is not a device"), ("meta", "holds no data"),
                                             ("cpu:3", "one CPU device")])
def test_load_refuses_a_device_it_cannot_use(saved_models, device, message):
    with pytest.raises(ValueError, match=rf"load: device '{device}'.*{message}"):
        saved.load(saved_models["dense"][0], device=device)


def test_damaged_zip_headers_are_named(saved_models, tmp_path):
    """A damaged central directory (a file name byte, the version field) is "cannot load the archive", naming the
    file, not zipfile's own exception."""
    src, _, _ = saved_models["dense"]
    d = shutil.copytree(src, tmp_path / "damaged")
    data = bytearray((d / saved.PROGRAM).read_bytes())
    cd = data.rfind(b"PK\x01\x02")  # the last central directory record
    data[cd + 46] = 0xFF  # the first byte of its file name: not UTF-8
    data[cd + 9] |= 0x08  # and the UTF-8 flag set
    (d / saved.PROGRAM).write_bytes(bytes(data))
    _rehash(d, saved.PROGRAM)
    with pytest.raises(saved.SavedProgramError, match=r"program\.pt2: (cannot load the archive|refused)"):
        saved.load(d)


def test_save_refuses_what_it_cannot_keep(saved_models, tmp_path):
    """A partition graph, a directory of someone else's files under ``overwrite=True``, a symbolic link: refused by
    name, nothing written or removed."""
    src, _, tm = saved_models["dense"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="replaces only a directory written by save"):
        saved.save(tm, mine, overwrite=True)
    assert (mine / "notes.txt").read_text() == "keep me"
    link = tmp_path / "link"
    link.symlink_to(mine)
    with pytest.raises(FileExistsError, match="is a symbolic link"):
        saved.save(tm, link, overwrite=True)
    boundary = cached_compile(cached_model("dense-tiny-v11", lambda: tiny_dense(11)), boundary=True)
    with pytest.raises(ValueError, match=r"save: this is a partition graph"):
        saved.save(boundary, tmp_path / "rf")
    assert not (tmp_path / "rf").exists()
    saved.save(tm, tmp_path / "again")  # a saved program may be replaced
    saved.save(tm, tmp_path / "again", overwrite=True)
    # ... but not with what the user put next to its files, nor a lone manifest beside other files: refused naming
    # them, all of it kept
    (tmp_path / "again" / "notes.txt").write_text("keep me")
    (tmp_path / "again" / "checkpoints").mkdir()
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "again").iterdir()}
    with pytest.raises(FileExistsError, match=r"also holds checkpoints, notes\.txt, which save did not write"):
        saved.save(tm, tmp_path / "again", overwrite=True)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "again").iterdir()} == before
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "manifest.json").write_text(json.dumps({"format": saved.FORMAT}))
    (lone / "thesis.tex").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"also holds thesis\.tex"):
        saved.save(tm, lone, overwrite=True)
    assert (lone / "thesis.tex").read_text() == "keep me"


def test_save_checks_space_and_path_before_writing(saved_models, tmp_path, monkeypatch):
    """torch's archive writer aborts the process on a full disk or a path that is not UTF-8 (a training loop that
    checkpoints would die): ``save`` refuses both before writing, naming the directory, and leaves nothing."""
    src, _, tm = saved_models["dense"]
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(OSError, match=r"not enough space to save \(1 MiB free, about \d+ MiB needed\)") as info:
        saved.save(tm, tmp_path / "full")
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", real)
    with pytest.raises(ValueError, match="the path is not valid UTF-8"):
        saved.save(tm, tmp_path / os.fsdecode(b"nu\xff"))
    assert list(tmp_path.iterdir()) == []
    long = tmp_path / ("n" * 250)  # a legal name, whose ".<name>.XXXX.tmp" sibling would not be
    saved.save(tm, long)
    assert sorted(p.name for p in tmp_path.iterdir()) == [long.name]


def test_save_refuses_a_program_with_a_router_loss(tmp_path):
    """``router_aux=`` adds the router loss from the graph's router logits through a spec the saved program does
    not hold: save refuses (a loaded program refused every forward instead)."""
    torch.manual_seed(0)
    model = HybridForCausalLM(HybridConfig.tiny(vocab_size=11, num_hidden_layers=2, num_experts=4,
                                                output_router_logits=True,
                                                layer_types=("linear_attention", "full_attention"))).double()
    tm = treecompile.compile(model, router_aux="batch")
    with pytest.raises(ValueError, match=r"save: the program returns router logits"):
        saved.save(tm, tmp_path / "moe")
    assert not (tmp_path / "moe").exists()
