"""Saved programs: rewrite once, train many times in other processes.

``save(tmodel, DIR)`` writes three files, into a temporary sibling directory that is renamed into
place only when all of them are written (a failure leaves nothing behind):

- ``program.pt2``: the *rewritten* graph as a ``torch.export`` program.  It is re-exported from a
  small module that holds the model's parameters and buffers under their original names (FQNs) and
  whose forward calls the rewritten lifted graph, with a dynamic sequence length ``T`` and a dynamic
  radix-node count ``N``.  The tree ops are ``torch.library.custom_op`` registrations
  (``treecompile::tree_attention`` ...), which serialise by name; the flex_attention higher-order op
  (the CUDA lowering) is *not* in the saved graph -- it is chosen at run time, as for a freshly
  compiled model -- because ``torch.export.save`` cannot serialise its block-mask arguments.
  The program's own copy of the weights is replaced by zero-stride stand-ins before saving (a few
  bytes each): ``model.safetensors`` is the one copy of the weights.
- ``model.safetensors``: every lifted parameter and buffer under its model name (HF names for HF
  models and for treecompile's reference models); a tied weight is stored once, under the name the
  program uses.
- ``manifest.json``: format version, treecompile/torch versions, the model class, the passes applied
  with what each changed (``verify_token_locality``'s ``info.sites``: the token-mixing sites found),
  the ops that were replaced per layer (module) type, and the inputs the program expects (names,
  dtypes, shapes in ``T``/``N``).

``load(DIR)`` returns a :class:`~treecompile.compile.TreeModel` built from the program
(:meth:`TreeModel.from_program`): same ``forward(batch) -> TreeOutput``, parameters trainable
(``load(DIR).parameters()`` go into an optimizer as usual).  The tree ops must be registered, so
loading imports ``treecompile.ops``.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import io
import json
import os
import re
import shutil
import tempfile
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.export import Dim
from torch.export.graph_signature import InputKind

from treecompile.tracing import export_settings

__all__ = ["save", "load", "verify", "read_manifest", "SavedProgramError", "FORMAT", "PROGRAM", "WEIGHTS", "MANIFEST"]

FORMAT = "treecompile-saved/1"
PROGRAM, WEIGHTS, MANIFEST = "program.pt2", "model.safetensors", "manifest.json"

# which pass (or capture step) puts each tree op into the graph, for the manifest and `inspect`
OP_ORIGIN = {
    "tree_attention": ("rewrite_attention", "causal scaled_dot_product_attention"),
    "tree_attention_windowed": ("rewrite_attention", "sliding-window causal scaled_dot_product_attention"),
    "tree_gated_delta_rule": ("capture swap + route_gdn_states", "chunk_gated_delta_rule"),
    "tree_causal_conv1d": ("capture swap + route_gdn_states", "causal_conv1d"),
    "linear_logprobs": ("rewrite_loss", "lm_head + log_softmax + gather"),
    "gather_logprobs": ("rewrite_loss", "log_softmax + gather"),
}


class SavedProgramError(ValueError):
    """A saved directory is missing, incomplete or corrupt; the message names the file."""


# ---------------------------------------------------------------------------------------------- holder
def _set_tensor(root: nn.Module, fqn: str, value: torch.Tensor, *, kind: str, persistent: bool = True) -> None:
    """Register ``value`` on ``root`` under the dotted name ``fqn``, creating empty submodules."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    if kind == "parameter":
        mod.register_parameter(leaf, value if isinstance(value, nn.Parameter) else nn.Parameter(value))
    else:
        mod.register_buffer(leaf, value, persistent=persistent)


class _Holder(nn.Module):
    """The model's tensors under their FQNs; forward = the rewritten graph (for re-export only)."""

    def __init__(self, tmodel, tensors: dict, kinds: dict, non_persistent: set):
        super().__init__()
        for fqn, t in tensors.items():
            _set_tensor(self, fqn, t, kind=kinds[fqn], persistent=fqn not in non_persistent)
        object.__setattr__(self, "_tm", tmodel)

    def forward(self, input_ids: torch.Tensor, tree: dict) -> tuple[torch.Tensor, torch.Tensor]:
        # the program's one runner, on this module's tensors, never the CUDA lowering
        return self._tm.program.run({"input_ids": input_ids, **tree}, tensors=self, lower=False)


def _example(tm) -> tuple[torch.Tensor, dict, dict]:
    """Example inputs (a small tree: T=10 tokens, N=6 nodes) and their dynamic shapes."""
    from treecompile.tree import Tree

    tree = Tree.from_paths([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 8], [9, 1]])
    b = tree.to_batch()
    dev = tm.device
    prog = tm.program
    T, N = Dim("T", min=2, max=1 << 24), Dim("N", min=2, max=1 << 24)
    # the program's own batch inputs (conv_index at its conv width), after the user inputs
    values = prog.batch_args(b)[len(prog.user_inputs):]
    tree_inputs = {name: v.to(dev) for name, v in zip(prog.tree_inputs, values, strict=True)}
    tree_dyn = {name: {0: N} if name.startswith("node_") else {0: T} for name in prog.tree_inputs}
    assert b.seq_len == 10 and b.num_nodes == 6, "the example must keep T and N apart"
    return b.input_ids[None].to(dev), tree_inputs, {"input_ids": {1: T}, "tree": tree_dyn}


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A zero-stride view of one element with ``t``'s shape/dtype (keeps the .pt2 free of weights)."""
    return t.new_zeros(1).expand(t.shape) if t.dim() else t.new_zeros(())


# ---------------------------------------------------------------------------------------------- manifest
def _ops_by_layer_type(gm) -> list[dict]:
    """Tree ops in the rewritten graph, grouped by the class of the module that calls them."""
    rows: dict[tuple[str, str], dict] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "treecompile":
            op = n.target._opname if hasattr(n.target, "_opname") else str(n.target).split(".")[1]
            stack = list((n.meta.get("nn_module_stack") or {}).values())
            path, cls = stack[-1] if stack else ("", "?")
            cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
            key = (cls.rsplit(".", 1)[-1], op)
            r = rows.setdefault(key, {"layer_type": key[0], "op": f"treecompile::{op}",
                                      "replaces": OP_ORIGIN.get(op, ("?", "?"))[1],
                                      "pass": OP_ORIGIN.get(op, ("?", "?"))[0], "count": 0, "modules": []})
            r["count"] += 1
            if path not in r["modules"]:
                r["modules"].append(path)
    pos = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "tree_position_ids"]
    if pos:
        users = {}
        for u in pos[0].users:
            stack = list((u.meta.get("nn_module_stack") or {}).values())
            cls = stack[-1][1] if stack else "?"
            cls = (cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))).rsplit(".", 1)[-1]
            users[cls] = users.get(cls, 0) + 1
        for cls, c in users.items():
            rows[(cls, "positions")] = {"layer_type": cls, "op": "tree position_ids (depth)",
                                        "replaces": "arange / cache_position", "pass": "rewrite_positions",
                                        "count": c, "modules": []}
    return list(rows.values())


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):  # e.g. the verifier's TokenMixingSite
        return _jsonable(dataclasses.asdict(x))
    return repr(x)


def _input_table(tm) -> list[dict]:
    from treecompile.passes.base import TREE_INPUTS

    rows = [{"name": "input_ids", "dtype": "int64", "shape": ["T"], "batch_field": "input_ids"}]
    for name in tm.program.tree_inputs:
        dtype, shape = TREE_INPUTS[name]
        if shape == "T":
            sh = ["T"]
        elif shape == "N":
            sh = ["N"]
        else:
            sh = ["T", tm.program.conv_width]
        rows.append({"name": f"tree_{name}", "dtype": str(dtype).removeprefix("torch."), "shape": sh,
                     "batch_field": name})
    return rows


# ---------------------------------------------------------------------------------------------- save
# TreeModel -> (key, ExportedProgram).  The re-export depends on the rewritten graph and on the
# tensors' names, kinds, shapes, dtypes and devices, never on their values (the holder exports
# stand-ins), so saving the same TreeModel again (a checkpoint every N steps) reuses it and writes
# only the new weights, instead of tracing the whole graph again (seconds even for a tiny model).
_REEXPORTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _reexport_signature(prog, tensors: dict, kinds: dict, tied: dict, non_persistent: set) -> tuple:
    """What a re-export depends on: the rewritten graph's code and tree inputs, and the tensors' names,
    kinds, shapes, dtypes and devices (never their values)."""
    return (prog.graph_module.code, tuple(prog.tree_inputs), prog.conv_width,
            tuple((k, kinds[k], tuple(v.shape), v.dtype, v.device) for k, v in tensors.items()),
            tuple(sorted(tied.items())), tuple(sorted(non_persistent)))


def _reexport(tmodel, tensors: dict, kinds: dict, tied: dict, non_persistent: set):
    """The rewritten graph exported over stand-ins of ``tensors`` (no second weight copy)."""
    prog = tmodel.program
    key = (id(prog), id(prog.graph_module), *_reexport_signature(prog, tensors, kinds, tied, non_persistent))
    hit = _REEXPORTED.get(tmodel)
    if hit is not None and hit[0] == key:
        return hit[1]
    stand = {k: _stand_in(v.detach()) for k, v in tensors.items() if k not in tied}
    stand = {k: stand[tied.get(k, k)] for k in tensors}  # aliases share their stand-in
    holder = _Holder(tmodel, stand, kinds, non_persistent)
    for p in holder.parameters():
        p.requires_grad_(True)
    ids, tree_inputs, dyn = _example(tmodel)
    try:
        with export_settings():
            ep = torch.export.export(holder, (ids, tree_inputs), dynamic_shapes=dyn, strict=False)
    except Exception as e:
        raise RuntimeError(f"re-exporting the rewritten graph failed: {type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}") from e
    _REEXPORTED[tmodel] = (key, ep)
    return ep


# what a save writes beside the weights (program.pt2, the manifest) and the file system's slack, for its space check
SAVE_SLACK_BYTES = 16 << 20


def save(tmodel, directory: str | os.PathLike, *, manifest_extra: dict | None = None,
         overwrite: bool = False) -> Path:
    """Write ``tmodel`` (a :class:`TreeModel`) to ``directory``: program.pt2, model.safetensors, manifest.json.

    Everything is written to a temporary sibling directory first, then renamed into place.  An
    existing non-empty ``directory`` is an error unless ``overwrite=True``.
    """
    import safetensors.torch

    import treecompile
    from treecompile.compile import TreeModel

    if not isinstance(tmodel, TreeModel):
        raise TypeError(f"save expects a treecompile.TreeModel, got {type(tmodel).__name__}")
    out = Path(directory)
    if out.is_symlink():
        raise FileExistsError(f"{out}: is a symbolic link (saving would replace the link, not fill what it points "
                              f"to); pass the directory itself")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise FileExistsError(f"{out}: exists and is not an empty directory (pass overwrite=True to replace a "
                                  f"saved program)")
        why = not_replaceable(out)
        if why:
            raise FileExistsError(f"{out}: overwrite=True replaces only a directory written by save, and {why}; "
                                  "left as it is")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"{parent}: no such directory")
    try:
        str(out.resolve()).encode("utf-8")
    except UnicodeEncodeError:  # torch's archive writer takes UTF-8 paths only, and aborts the process on others
        raise ValueError(f"{str(out).encode('utf-8', 'backslashreplace').decode()}: the path is not valid UTF-8 "
                         "(torch's program writer needs UTF-8 paths); "
                         "choose another directory name") from None
    if tmodel.program.boundary is not None:
        raise ValueError("save: this is a partition graph (compile(..., boundary=True)), which takes boundary "
                         "tensors from the partitions before it; save the whole-tree program (boundary=False) and "
                         "build partition graphs where they run")
    if getattr(tmodel, "router_aux", None) is not None:
        raise ValueError("save: the program returns router logits for a router auxiliary loss "
                         "(compile(..., router_aux=...)), whose spec a saved program does not hold: a loaded "
                         "program would drop that loss; compile with router_aux=None to save it")

    import treecompile.ops.experts_module  # noqa: F401  (registers the op the check below names)

    held = [n for n in tmodel.exported_program.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.treecompile.experts_module.default]
    if held:
        raise ValueError(f"save: the program calls {len(held)} HF experts module(s) that treecompile has no op for "
                         f"(treecompile::experts_module, e.g. {held[0].args[0]!r}), which run the module's own code "
                         f"in the process that compiled it; such a program cannot be saved")
    sig = tmodel.exported_program.graph_signature
    non_persistent = set(sig.non_persistent_buffers if hasattr(sig, "non_persistent_buffers") else ())
    tensors, kinds = {}, {}
    for x in tmodel.program.lifted:
        if x.kind == InputKind.PARAMETER:
            tensors[x.target], kinds[x.target] = tmodel.model.get_parameter(x.target), "parameter"
        elif x.kind == InputKind.BUFFER:
            tensors[x.target], kinds[x.target] = tmodel.model.get_buffer(x.target), "buffer"
    # tied weights (one tensor under several names, e.g. lm_head.weight = embed_tokens.weight) are
    # stored once, under the first name; the others are recorded as aliases
    first: dict[int, str] = {}
    tied = {}
    for k, v in tensors.items():
        if id(v) in first:
            tied[k] = first[id(v)]
        else:
            first[id(v)] = k
    weights = {k: v.detach().cpu().contiguous() for k, v in tensors.items() if k not in tied}
    # torch's archive writer aborts the whole process on a full disk instead of raising: refuse first
    need = sum(v.numel() * v.element_size() for v in weights.values()) + SAVE_SLACK_BYTES
    free = shutil.disk_usage(parent).free
    if free < need:
        raise OSError(errno.ENOSPC, f"not enough space to save ({free / 2**20:.0f} MiB free, about "
                      f"{need / 2**20:.0f} MiB needed)", str(parent))

    ep = _reexport(tmodel, tensors, kinds, tied, non_persistent)
    phs = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    expected = ["input_ids"] + [f"tree_{n}" for n in tmodel.program.tree_inputs]
    if phs != expected:  # the loader relies on this order
        raise RuntimeError(f"re-exported program inputs {phs} != expected {expected}")

    manifest = {
        "format": FORMAT,
        "treecompile_version": treecompile.__version__,
        "torch_version": torch.__version__,
        "model_class": f"{type(tmodel.model).__module__}.{type(tmodel.model).__qualname__}",
        "dtype": str(next(iter(weights.values())).dtype).removeprefix("torch.") if weights else None,
        "passes": {k: {"count": v.count, "info": _jsonable(v.info)} for k, v in tmodel.pass_results.items()},
        "replaced_ops": _ops_by_layer_type(tmodel.graph_module),
        "inputs": _input_table(tmodel),
        "outputs": [{"name": "loss", "dtype": "float", "shape": []},
                    {"name": "logprobs", "dtype": "float", "shape": ["T"]}],
        "conv_width": tmodel.program.conv_width,
        "tensors": {k: {"kind": kinds[k], "persistent": k not in non_persistent,
                        "dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                    for k, v in weights.items()},
        "tied": tied,
        "num_parameters": sum(v.numel() for k, v in weights.items() if kinds[k] == "parameter"),
        "files": {"program": PROGRAM, "weights": WEIGHTS},
    }
    if manifest_extra:
        manifest["extra"] = _jsonable(manifest_extra)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name[:64]}.", suffix=".tmp", dir=parent))
    try:
        ep.example_inputs = None  # torch would pickle them: a saved program holds data only
        with warnings.catch_warnings():  # the zero-stride stand-ins are "incomplete" by design
            warnings.filterwarnings("ignore", message="No complete tensor found")
            torch.export.save(ep, tmp / PROGRAM)
        safetensors.torch.save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        _check_written(tmp / PROGRAM)  # what load would refuse is not saved
        manifest["sha256"] = {f: _sha256(tmp / f) for f in (PROGRAM, WEIGHTS)}
        manifest["sha256"][MANIFEST] = manifest_digest(manifest)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)  # mkdtemp makes 0700 and some writers 0600: give the usual modes
        os.chmod(tmp, 0o777 & ~umask)
        for f in (PROGRAM, WEIGHTS, MANIFEST):
            os.chmod(tmp / f, 0o666 & ~umask)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name[:64]}.", suffix=".old", dir=parent))
            try:
                os.replace(out, old / "x")
            except BaseException:
                shutil.rmtree(old, ignore_errors=True)  # still empty: nothing was moved
                raise
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old / "x", out)  # put the previous program back (if this fails, it stays in old)
                shutil.rmtree(old, ignore_errors=True)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def not_replaceable(directory: Path) -> str | None:
    """Why replacing ``directory`` (an existing, non-empty directory) could lose data other than a saved program,
    or None: it must hold a treecompile manifest and nothing but the files :func:`save` writes (anything else,
    such as notes or checkpoints put next to them, would go with it)."""
    try:
        read_manifest(directory)
    except SavedProgramError:
        return f"{directory} holds no treecompile {MANIFEST}"
    others = sorted(p.name for p in Path(directory).iterdir() if p.name not in (PROGRAM, WEIGHTS, MANIFEST))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        return f"{directory} also holds {shown}, which save did not write"
    return None


# ---------------------------------------------------------------------------------------------- load
def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a saved directory; SavedProgramError naming the file if missing/invalid."""
    d = Path(directory)
    if not d.is_dir():
        if d.exists():
            raise SavedProgramError(f"{d}: is a file, not a saved-program directory (pass the directory that "
                                    f"holds {PROGRAM}, {WEIGHTS} and {MANIFEST})")
        raise SavedProgramError(f"{d}: no such directory")
    p = d / MANIFEST
    if not p.is_file():
        raise SavedProgramError(f"{p}: missing (not a treecompile saved program)")
    try:
        m = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested past json's limit
        raise SavedProgramError(f"{p}: invalid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise SavedProgramError(f"{p}: format {got!r} is not {FORMAT!r}")
    return m


def _register(module: nn.Module, specs: dict, tied: dict, weights: dict, d: Path, wpath: Path) -> None:
    """The stored tensors, then the tied aliases, on ``module`` under their dotted names."""
    for k, s in specs.items():
        _set_tensor(module, k, weights[k], kind=s["kind"], persistent=s.get("persistent", True))
    for alias, k in tied.items():
        if k not in specs:
            raise SavedProgramError(f"{d / MANIFEST}: tied weight {alias} -> {k}, which {wpath.name} lacks")
        if alias in specs:  # an alias would replace a stored tensor
            raise SavedProgramError(f"{d / MANIFEST}: tied weight {alias} -> {k}, but {alias} is stored in "
                                    f"{wpath.name} itself")
        src = module.get_parameter(k) if specs[k]["kind"] == "parameter" else module.get_buffer(k)
        _set_tensor(module, alias, src, kind=specs[k]["kind"], persistent=specs[k].get("persistent", True))


def _load_device(device) -> torch.device:
    """The device ``load`` puts the weights on (default CPU): ValueError naming ``device`` when it is not one."""
    if device is None:
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"load: device {device!r} is not a device ({e})") from None
    if dev.type == "meta":
        raise ValueError("load: device 'meta' holds no data; load onto 'cpu' or 'cuda'")
    if dev.type == "cuda" and (not torch.cuda.is_available()
                               or (dev.index is not None and dev.index >= torch.cuda.device_count())):
        raise ValueError(f"load: device {device!r} is not available here ({torch.cuda.device_count()} CUDA "
                         f"device(s))")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise ValueError(f"load: device {device!r}: there is one CPU device ('cpu')")
    return dev


_FQN = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
_DTYPES = {"float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"}


def _check_manifest(m: dict, path: Path) -> None:
    """The manifest fields ``load`` reads, typed as ``save`` writes them; SavedProgramError naming the field."""
    def bad(field, why):
        raise SavedProgramError(f"{path}: {field}: {why}")

    tensors = m.get("tensors", {})
    if not isinstance(tensors, dict):
        bad("tensors", f"expected a mapping of tensor names, got {type(tensors).__name__}")
    for k, spec in tensors.items():
        if not _FQN.fullmatch(k):
            bad(f"tensors[{k!r}]", "not a dotted parameter/buffer name")
        if not isinstance(spec, dict):
            bad(f"tensors[{k!r}]", f"expected a mapping, got {type(spec).__name__}")
        if spec.get("kind") not in ("parameter", "buffer"):
            bad(f"tensors[{k!r}].kind", f"expected 'parameter' or 'buffer', got {spec.get('kind')!r}")
        if spec.get("dtype") not in _DTYPES:
            bad(f"tensors[{k!r}].dtype", f"{spec.get('dtype')!r} is not a dtype a saved program holds")
        shape = spec.get("shape")
        if not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
            bad(f"tensors[{k!r}].shape", f"expected a list of sizes, got {shape!r}")
        if type(spec.get("persistent", True)) is not bool:
            bad(f"tensors[{k!r}].persistent", f"expected true or false, got {spec.get('persistent')!r}")
    tied = m.get("tied", {})
    if not isinstance(tied, dict) or not all(isinstance(a, str) and isinstance(b, str) and _FQN.fullmatch(a)
                                             and _FQN.fullmatch(b) for a, b in tied.items()):
        bad("tied", "expected a mapping of dotted tensor names to dotted tensor names")
    passes = m.get("passes", {})
    if not isinstance(passes, dict) or not all(isinstance(v, dict) and type(v.get("count")) is int
                                               and isinstance(v.get("info", {}), dict) for v in passes.values()):
        bad("passes", "expected a mapping of pass names to {count: int, info: {...}}")
    conv = m.get("conv_width")
    if conv is not None and (type(conv) is not int or conv < 1):
        bad("conv_width", f"expected null or a positive int, got {conv!r}")


def manifest_digest(manifest: dict) -> str:
    """SHA-256 of the manifest's fields but its ``sha256`` map (canonical JSON): a tied alias or a tensor's kind edited
    in the manifest alone changes what a loaded program computes, and the manifest holds the files' hashes itself.
    It detects edits, not attackers (who would recompute it, as they would the files')."""
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify(directory: str | os.PathLike) -> dict:
    """The manifest of a saved directory whose files are intact and data only (what ``inspect`` shows).

    Checks: the manifest; ``program.pt2`` and ``model.safetensors`` present with the SHA-256 the manifest
    records; the program archive holds no pickle and no code (:func:`treecompile.program_check.check_program`).
    Raises :class:`SavedProgramError` naming the file (and the archive entry).
    """
    manifest = _verified(Path(directory))[0]
    _check_manifest(manifest, Path(directory) / MANIFEST)
    _check_weights_header(Path(directory) / WEIGHTS, manifest.get("tensors", {}))
    return manifest


# safetensors' dtype names -> torch's (the manifest's)
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _check_weights_header(wpath: Path, specs: dict) -> None:
    """``model.safetensors`` holds exactly the tensors, dtypes and shapes the manifest lists, read from its header
    (no tensor data is read): what :func:`verify` checks without loading, and :func:`load` again on the tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(wpath), framework="pt") as f:
            header = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types on corrupt headers
        raise SavedProgramError(f"{wpath}: cannot read safetensors ({str(e).splitlines()[0] if str(e) else ''})"
                                ) from None
    missing, unexpected = sorted(set(specs) - set(header)), sorted(set(header) - set(specs))
    if missing or unexpected:
        raise SavedProgramError(f"{wpath}: tensors do not match {MANIFEST} (missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]})")
    for k, spec in specs.items():
        dtype, shape = _ST_DTYPES.get(header[k][0], header[k][0]), list(header[k][1])
        if shape != spec.get("shape") or dtype != spec.get("dtype"):
            raise SavedProgramError(f"{wpath}: {k} is {dtype}{shape}, {MANIFEST} says "
                                    f"{spec.get('dtype')}{spec.get('shape')}")


def _check_written(path: Path) -> None:
    from treecompile.program_check import UnsafeProgramError, check_program

    try:
        check_program(path.read_bytes())
    except UnsafeProgramError as e:
        raise SavedProgramError(f"the rewritten program cannot be saved as data only ({e}); "
                                f"treecompile.load would refuse it") from None


def _verified(d: Path) -> tuple[dict, bytes]:
    """(manifest, the program's bytes): hashed and checked once, then handed to torch from memory."""
    from treecompile.program_check import UnsafeProgramError, check_program

    manifest = read_manifest(d)
    sums = manifest.get("sha256")
    for f in (PROGRAM, WEIGHTS):
        if not (d / f).is_file():
            raise SavedProgramError(f"{d / f}: missing")
        if not isinstance(sums, dict) or not isinstance(sums.get(f), str):
            raise SavedProgramError(f"{d / MANIFEST}: no SHA-256 recorded for {f} (written by an older "
                                    f"treecompile: rewrite it)")
    if MANIFEST in sums and manifest_digest(manifest) != sums[MANIFEST]:  # older programs hold no digest
        raise SavedProgramError(f"{d / MANIFEST}: its fields changed after it was saved (their SHA-256 "
                                f"{manifest_digest(manifest)[:16]}... is not the recorded {str(sums[MANIFEST])[:16]}...)")
    program = (d / PROGRAM).read_bytes()
    for f, digest in ((PROGRAM, hashlib.sha256(program).hexdigest()), (WEIGHTS, _sha256(d / WEIGHTS))):
        if digest != sums[f]:
            raise SavedProgramError(f"{d / f}: SHA-256 {digest[:16]}... does not match {MANIFEST} "
                                    f"({sums[f][:16]}...): the file changed after it was saved")
    try:
        check_program(program)
    except UnsafeProgramError as e:
        msg = str(e) if str(e).startswith("cannot load") else f"refused: {e}"
        raise SavedProgramError(f"{d / PROGRAM}: {msg}") from None
    return manifest, program


def load(directory: str | os.PathLike, *, device=None, compile_cuda: bool = True, bucket: bool = True,
         gdn_kernel: str = "auto", attention_kernel: str = "auto", attention_layout: str = "dfs",
         conv_kernel: str = "auto", head_logits: str = "auto", attention_keys: str = "auto"):
    """A :class:`~treecompile.compile.TreeModel` from a directory written by :func:`save`.

    ``device``: where the weights go (default: CPU).  ``compile_cuda``, ``bucket``, ``gdn_kernel``,
    ``attention_kernel``, ``attention_layout``, ``conv_kernel``, ``head_logits``, ``attention_keys``: the run options of
    :func:`treecompile.compile` (chosen at load, never saved).
    """
    import safetensors.torch

    import treecompile.ops  # noqa: F401 - registers the tree ops the program calls by name
    from treecompile.compile import TreeModel
    from treecompile.passes.base import PassResult
    from treecompile.passes.lower_cuda import CudaOptions

    d = Path(directory)
    target = _load_device(device)
    manifest, program = _verified(d)  # hashes match and the archive holds no pickle: torch may read it
    wpath, ppath = d / WEIGHTS, d / PROGRAM
    _check_manifest(manifest, d / MANIFEST)
    try:
        weights = safetensors.torch.load_file(str(wpath), device=str(target))
    except Exception as e:  # safetensors raises its own error types on corrupt headers
        raise SavedProgramError(f"{wpath}: cannot read safetensors ({str(e).splitlines()[0]})") from None
    if target.type == "cpu":
        # own storage from torch's allocator: safetensors >= 0.8 hands out views of the mapped file at 8-byte
        # offsets, on which the CPU matmul kernels round differently (1 ulp) from the compiled original's weights
        weights = {k: w.clone() for k, w in weights.items()}
    specs = manifest.get("tensors", {})
    missing = sorted(set(specs) - set(weights))
    unexpected = sorted(set(weights) - set(specs))
    if missing or unexpected:
        raise SavedProgramError(f"{wpath}: tensors do not match {MANIFEST} (missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]})")
    for k, s in specs.items():
        w = weights[k]
        if list(w.shape) != s["shape"] or str(w.dtype).removeprefix("torch.") != s["dtype"]:
            raise SavedProgramError(f"{wpath}: {k} is {str(w.dtype)}{list(w.shape)}, "
                                    f"{MANIFEST} says {s['dtype']}{s['shape']}")
    try:
        ep = torch.export.load(io.BytesIO(program))  # the bytes that were checked, not the file again
    except Exception as e:
        raise SavedProgramError(f"{ppath}: cannot load the exported program "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None

    module = nn.Module()
    tied = manifest.get("tied", {})
    try:
        _register(module, specs, tied, weights, d, wpath)
    except (KeyError, AttributeError, TypeError) as e:  # a name nn.Module refuses ('__class__', 'a.forward', ...)
        raise SavedProgramError(f"{d / MANIFEST}: cannot register the tensors under their names ({e})") from None
    sig = ep.graph_signature

    lifted = [(s.kind, s.target) for s in sig.input_specs if s.kind != InputKind.USER_INPUT]
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    for spec in sig.input_specs:
        kind, fqn = spec.kind, spec.target
        if kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            continue
        if fqn not in specs and fqn not in tied:
            raise SavedProgramError(f"{ppath}: the program reads {fqn}, which {wpath.name} lacks")
        stored = specs[tied.get(fqn, fqn)]
        want = "parameter" if kind == InputKind.PARAMETER else "buffer"
        if stored["kind"] != want:
            raise SavedProgramError(f"{d / MANIFEST}: {fqn} is a {stored['kind']}, the program reads a {want}")
        val = vals.get(spec.arg.name)
        if isinstance(val, torch.Tensor) and (list(val.shape) != stored["shape"]
                                               or str(val.dtype).removeprefix("torch.") != stored["dtype"]):
            raise SavedProgramError(f"{wpath}: {fqn} is {stored['dtype']}{stored['shape']}, the program reads "
                                    f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}")
    conv = vals.get("tree_conv_index")
    if isinstance(conv, torch.Tensor) and manifest.get("conv_width") != conv.shape[1]:
        raise SavedProgramError(f"{d / MANIFEST}: conv_width {manifest.get('conv_width')!r}, the program's conv "
                                f"context is {conv.shape[1]} tokens wide")
    user = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    if not user or user[0] != "input_ids" or not all(u.startswith("tree_") for u in user[1:]):
        raise SavedProgramError(f"{ppath}: unexpected program inputs {user}")
    if device is not None:
        for k, v in list(ep.constants.items()):
            if isinstance(v, torch.Tensor):
                ep.constants[k] = v.to(device)
    passes = {k: PassResult(v["count"], v.get("info", {})) for k, v in manifest.get("passes", {}).items()}
    options = CudaOptions(compile_cuda=compile_cuda, bucket=bucket, gdn_kernel=gdn_kernel,
                          attention_kernel=attention_kernel, attention_layout=attention_layout,
                          conv_kernel=conv_kernel, head_logits=head_logits, attention_keys=attention_keys)
    tm = TreeModel.from_program(module, ep, input_name="input_ids", user_inputs=["input_ids"],
                                tree_inputs=[u[len("tree_"):] for u in user[1:]],
                                conv_width=manifest.get("conv_width"), pass_results=passes, options=options)
    object.__setattr__(tm, "manifest", manifest)
    return tm
