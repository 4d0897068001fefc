"""Command line: ``treecompile {demo, rewrite, inspect, stats}``.

Conventions: ``--help`` on every command (it imports no torch: heavy imports happen inside the
commands); exit status 0 (done), 1 (a problem with the user's input or environment: one line on
stderr naming the file, ``file:line``, argument or model construct, no traceback), 2 (usage, from
argparse); outputs are written to a temporary name and renamed, so a failure leaves nothing behind.
``bench`` is not here: the harness runs from a source checkout as ``python -m benchmarks.harness``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input: reported in one line on stderr, exit status 1."""


# ---------------------------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    if args.steps < 0:
        raise UserError(f"--steps {args.steps}: must be 0 or more training steps")
    from treecompile.demo import run_demo

    run_demo(steps=args.steps)
    return 0


# ---------------------------------------------------------------------------------------------- rewrite
DTYPES = {"float32": "float32", "fp32": "float32", "float64": "float64", "fp64": "float64",
          "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def _reference_models() -> dict:
    """Reference model name -> (family, config factory)."""
    from treecompile.models import DenseConfig, HybridConfig

    return {
        "dense-tiny": ("dense", DenseConfig.tiny),
        "dense-qwen3-0.6b": ("dense", DenseConfig.qwen3_0_6b),
        "dense-qwen3-1.7b": ("dense", DenseConfig.qwen3_1_7b),
        "dense-qwen3-8b": ("dense", DenseConfig.qwen3_8b),
        "hybrid-tiny": ("hybrid", HybridConfig.tiny),
        "hybrid-tiny-moe": ("hybrid", lambda: HybridConfig.tiny(num_experts=4)),
        "hybrid-qwen3.5-9b": ("hybrid", HybridConfig.qwen3_5_9b),
    }


REFERENCE_NAMES = ("dense-tiny", "dense-qwen3-0.6b", "dense-qwen3-1.7b", "dense-qwen3-8b", "hybrid-tiny",
                   "hybrid-tiny-moe", "hybrid-qwen3.5-9b")


def _check_hf_dir(d: Path) -> None:
    """config.json present and valid, at least one readable *.safetensors file (header checked)."""
    from safetensors import safe_open

    cfg = d / "config.json"
    if not cfg.is_file():
        raise UserError(f"{d}: no config.json (expected a Hugging Face-format model directory)")
    try:
        config = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(f"{cfg}: invalid JSON ({type(e).__name__}: {e})") from None
    if isinstance(config, dict) and config.get("auto_map"):
        # transformers would ask on a terminal whether to run the directory's own Python: never
        raise UserError(f"{cfg}: auto_map names custom code ({', '.join(sorted(map(str, config['auto_map'])))}) "
                        "that would run from the model directory; treecompile loads only the model classes "
                        "transformers ships (remove auto_map if the architecture is one of them)")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise UserError(f"{d}: config.json but no *.safetensors weights")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    sf.get_slice(k)
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise UserError(f"{f}: cannot read safetensors ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                            ) from None


def load_model(spec: str, *, dtype: str = "float32", seed: int = 0):
    """MODEL argument -> (nn.Module, description). Reference names get a seeded random init."""
    import torch

    torch_dtype = getattr(torch, DTYPES[dtype])
    refs = _reference_models()
    if spec in refs:
        from treecompile.models import DenseForCausalLM, HybridForCausalLM

        family, cfg = refs[spec]
        if not 0 <= seed < 2 ** 63:
            raise UserError(f"--seed {seed}: expected an integer in [0, 2**63)")
        torch.manual_seed(seed)
        cls = DenseForCausalLM if family == "dense" else HybridForCausalLM
        return cls(cfg()).to(torch_dtype), {"source": spec, "seed": seed, "dtype": DTYPES[dtype]}
    d = Path(spec)
    if not d.exists():
        raise UserError(f"MODEL {spec!r}: no such directory, and not a reference model name "
                        f"({', '.join(REFERENCE_NAMES)})")
    if not d.is_dir():
        raise UserError(f"MODEL {spec}: not a directory (expected config.json + *.safetensors)")
    _check_hf_dir(d)
    try:
        import transformers
    except ImportError:
        raise UserError(f"MODEL {spec}: loading a Hugging Face directory needs transformers "
                        f"(pip install 'treecompile[hf]')") from None
    tf_log = transformers.utils.logging
    verbosity, bars = tf_log.get_verbosity(), tf_log.is_progress_bar_enabled()
    tf_log.set_verbosity_error()  # missing weights are reported below, in one line
    tf_log.disable_progress_bar()
    try:
        # mismatched shapes are refused below with their names and shapes (transformers' own refusal
        # points at a report that the silenced logger never printed)
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(d), dtype=torch_dtype, output_loading_info=True, ignore_mismatched_sizes=True,
            use_safetensors=True,  # never a pickled pytorch_model.bin lying beside them
            trust_remote_code=False)  # nor Python from the directory (transformers would ask on a terminal)
    except Exception as e:
        raise UserError(f"{d}: transformers could not load the model ({type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    finally:
        tf_log.set_verbosity(verbosity)
        if bars:
            tf_log.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    bad = sorted(info.get("mismatched_keys") or [], key=str)
    if bad:  # transformers would initialise these at random: refuse
        shown = "; ".join(f"{k[0]}: file {list(k[1])}, config {list(k[2])}" if isinstance(k, tuple) and len(k) == 3
                          else str(k) for k in bad[:4])
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise UserError(f"{d}: {len(bad)} weight(s) in the safetensors do not have the shape config.json "
                        f"gives: {shown}{more}")
    if missing:
        raise UserError(f"{d}: the safetensors lack weights the model needs: {', '.join(missing[:4])}"
                        + (f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""))
    return model, {"source": str(d.resolve()), "dtype": DTYPES[dtype],
                   "architecture": type(model).__name__}


def _check_out(out: Path, overwrite: bool) -> None:
    """Refuse an --out that could not be written, or whose replacement would lose the user's data.

    ``--out`` is a new directory, an empty one, or (with ``--overwrite``) a previous saved program;
    never a file, never the current directory or one that contains it (it cannot be renamed away).
    """
    try:
        str(out).encode("utf-8")
    except UnicodeEncodeError:  # torch's archive writer takes UTF-8 paths only (it aborts the process on others)
        shown = str(out).encode("utf-8", "backslashreplace").decode()  # printable wherever stderr goes
        raise UserError(f"--out {shown}: the path is not valid UTF-8; choose another name") from None
    parent = out.parent if str(out.parent) else Path(".")
    up = parent
    while not up.exists() and up != up.parent:
        up = up.parent
    if up.exists() and not up.is_dir():
        raise UserError(f"--out {out}: {up} is a file, not a directory")
    if not parent.is_dir():
        raise UserError(f"--out {out}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: parent directory {parent} is not writable")
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink():
        raise UserError(f"--out {out}: is a symbolic link; --out must be a new or empty directory")
    if not out.is_dir():
        raise UserError(f"--out {out}: is an existing file; --out must be a new or empty directory"
                        + (" (--overwrite replaces only a saved program directory)" if overwrite else ""))
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise UserError(f"--out {out}: is the current directory or contains it; choose a new directory")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(f"--out {out}: directory exists and is not empty (use --overwrite to replace a "
                        f"saved program)")
    from treecompile import saved

    why = saved.not_replaceable(out)
    if why:
        raise UserError(f"--out {out}: --overwrite replaces only a directory written by `treecompile rewrite`, and "
                        f"{why}; left as it is")


def _check_space(out: Path, model) -> None:
    """Refuse before writing when the weights alone do not fit (torch's archive writer aborts the
    process on a full disk instead of raising): before the capture, which ``saved.save``'s own check follows."""
    import shutil

    from treecompile import saved

    seen, need = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            need += t.numel() * t.element_size()
    need += saved.SAVE_SLACK_BYTES  # program.pt2, manifest and file-system slack
    parent = out.parent if str(out.parent) else Path(".")
    free = shutil.disk_usage(parent).free
    if free < need:
        raise UserError(f"--out {out}: not enough space ({free / 2**20:.0f} MiB free on {parent}, about "
                        f"{need / 2**20:.0f} MiB needed)")


def _write_error(e: Exception) -> str:
    """The OS reason inside a write failure (safetensors wraps it as ``IoError(Os { ... message: "..." })``)."""
    import re

    if isinstance(e, OSError):
        return e.strerror or str(e)
    m = re.search(r'message: "([^"]*)"', str(e))
    return m.group(1) if m else (str(e).strip().splitlines() or [type(e).__name__])[0]


def cmd_rewrite(args) -> int:
    from safetensors import SafetensorError

    import treecompile
    from treecompile import saved

    out = Path(args.out)
    _check_out(out, args.overwrite)
    model, info = load_model(args.model, dtype=args.dtype, seed=args.seed)
    _check_space(out, model)  # the weights' size is known before the capture: refuse before spending it
    tmodel = treecompile.compile(model)  # a CaptureError names the model's source line (one line, below)
    try:  # saved.save writes a temporary sibling and renames it: a failed write leaves nothing
        saved.save(tmodel, out, manifest_extra=info, overwrite=args.overwrite)
    except (OSError, SafetensorError) as e:
        raise UserError(f"--out {out}: cannot write ({_write_error(e)})") from None
    except RuntimeError as e:  # torch's zip writer: "PytorchStreamWriter failed writing file ..."
        if "PytorchStreamWriter" not in str(e) and "file write failed" not in str(e):
            raise
        raise UserError(f"--out {out}: cannot write {saved.PROGRAM} ({_write_error(e)})") from None
    passes = ", ".join(f"{k}={v.count}" for k, v in tmodel.pass_results.items())
    print(f"rewrote {info['source']} ({type(model).__name__}, {info['dtype']}): {passes}")
    print(f"saved to {out}/ ({saved.PROGRAM}, {saved.WEIGHTS}, {saved.MANIFEST}); "
          f"load with treecompile.saved.load({str(out)!r})")
    return 0


# ---------------------------------------------------------------------------------------------- inspect
def cmd_inspect(args) -> int:
    from tabulate import tabulate

    from treecompile import saved

    d = Path(args.dir)
    if d.exists() and not d.is_dir():
        raise UserError(f"{d}: is a file, not a saved-program directory (DIR is what `treecompile rewrite "
                        f"--out DIR` wrote)")
    m = saved.verify(d)  # files present, SHA-256 as recorded, the program archive holds data only
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    text = io.StringIO()  # the whole report first: a malformed field stops it before anything is printed
    try:
        with contextlib.redirect_stdout(text):
            _print_manifest(d, m)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{d / saved.MANIFEST}: a field inspect shows is malformed ({type(e).__name__}: {e}); "
                        f"`treecompile inspect --json` prints the manifest as it is") from None
    # the manifest's strings as text, not as terminal commands (escape sequences, carriage returns)
    print(re.sub(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", lambda c: f"\\x{ord(c.group()):02x}", text.getvalue()), end="")
    return 0


def _print_manifest(d: Path, m: dict) -> None:
    from tabulate import tabulate
    extra = m.get("extra", {})
    print(f"{d}: {m['format']}")
    print(f"  model      {m.get('model_class')}  ({extra.get('source', '?')})")
    print(f"  dtype      {m.get('dtype')}   parameters {m.get('num_parameters', 0):,}   tensors "
          f"{len(m.get('tensors', {}))}" + (f"   tied {m['tied']}" if m.get("tied") else ""))
    print(f"  versions   treecompile {m.get('treecompile_version')}, torch {m.get('torch_version')}")
    print("\npasses")
    rows = [[k, v["count"], ", ".join(f"{a}={b}" for a, b in v.get("info", {}).items() if a != "sites")]
            for k, v in m.get("passes", {}).items()]
    print(tabulate(rows, headers=["pass", "changed", "info"], tablefmt="github"))
    verified = m.get("passes", {}).get("verify_token_locality")
    print("\ntoken-mixing sites (ops that touch the sequence axis, and what became of them)" if verified else
          "\ntoken locality NOT verified (verify_token_locality was disabled)")
    rows = [[s["action"], s["op"], s["node"], s["source"], s["detail"]] for s in (verified or {}).get("info", {}).get("sites", [])]
    if rows:
        print(tabulate(rows, headers=["action", "op", "node", "where", "detail"], tablefmt="github"))
    print("\nreplaced ops per layer type")
    rows = [[r["layer_type"], r["replaces"], r["op"], r["pass"], r["count"], _modules(r["modules"])]
            for r in m.get("replaced_ops", [])]
    print(tabulate(rows, headers=["layer type", "replaced", "by", "pass", "sites", "modules"], tablefmt="github"))
    print("\nprogram inputs (T = tokens, N = radix nodes)")
    rows = [[r["name"], r["dtype"], "[" + ", ".join(str(s) for s in r["shape"]) + "]", r["batch_field"]]
            for r in m.get("inputs", [])]
    print(tabulate(rows, headers=["input", "dtype", "shape", "TreeBatch field"], tablefmt="github"))
    print("outputs: " + ", ".join(f"{o['name']} [{', '.join(o['shape'])}]" for o in m.get("outputs", [])))


def _modules(paths: list[str], show: int = 2) -> str:
    if not paths:
        return ""
    more = f", ... ({len(paths)} modules)" if len(paths) > show else ""
    return ", ".join(p or "<root>" for p in paths[:show]) + more


# ---------------------------------------------------------------------------------------------- stats
def cmd_stats(args) -> int:
    from treecompile.runtime.data import read_trajectories
    from treecompile.runtime.stats import stats_table, total_stats, tree_stats

    if args.budget < 1:
        raise UserError(f"--budget {args.budget}: must be a positive number of tokens")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise UserError(f"--vocab-size {args.vocab_size}: must be a positive number of token ids")
    path = Path(args.data)
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path}: not a file")
    rows = []
    try:  # the reader training uses: what stats accepts, training accepts
        for t in read_trajectories(path, vocab_size=args.vocab_size, progress=True):
            for key in ("old_logprobs", "ref_logprobs"):  # shared tokens agree across paths, as training checks
                if getattr(t, key) is not None:
                    t.dfs(key)
            rows.append({"tree_id": t.tree_id, **tree_stats(t.tree, args.budget)})
    except ValueError as e:
        raise UserError(str(e)) from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e})") from None
    total = total_stats(rows)
    if args.json:
        print(json.dumps({"file": str(path), "budget": args.budget, "vocab_size": args.vocab_size,
                          "trees": rows, "total": total}, indent=1))
        return 0

    print(f"{path}: {len(rows)} trees, budget C={args.budget} tokens "
          f"(ERR = 1 - computed/path tokens; totals are token-summed)")
    print(stats_table(rows, total))
    why = total["modes"]["packed"].get("why")
    if why:
        print(f"packed: {why} (packed partitioning needs every path whole in one partition)")
    return 0


# ---------------------------------------------------------------------------------------------- bench
# The benchmark harness is not part of the installed package: it lives in a source checkout
# (benchmarks/harness.py with its baselines, tree generators and FLOP model) and runs as
# ``python -m benchmarks.harness``.  The CLI used to find it by putting the checkout on sys.path;
# it now says where it is instead.
BENCH_MOVED = ("the benchmark harness is not part of the installed command: from a source checkout of "
               "treecompile run `python -m benchmarks.harness ARGS` (pip install -e '.[bench]' adds "
               "matplotlib for its plot)")


def cmd_bench(args) -> int:
    if any(a in ("-h", "--help") for a in args.args):
        print(f"usage: treecompile bench\n\n{BENCH_MOVED[0].upper()}{BENCH_MOVED[1:]}.")
        return 0
    raise UserError(BENCH_MOVED)


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="treecompile", description="Train LLMs on trajectory trees.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run the main job on a small embedded example and print what it did")
    p.add_argument("--steps", type=int, default=3, help="training steps to run (default 3)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("rewrite", help="capture and rewrite a model, save the program + weights + manifest",
                       description="Capture MODEL, rewrite it for trees, and save it to --out: program.pt2 "
                                   "(torch.export), model.safetensors, manifest.json. Load it with "
                                   "treecompile.saved.load(DIR).")
    p.add_argument("model", metavar="MODEL",
                   help=f"a reference model name ({', '.join(REFERENCE_NAMES)}; random init from --seed) "
                        f"or a Hugging Face-format directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype (default float32)")
    p.add_argument("--seed", type=int, default=0, help="random init seed for reference models (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.set_defaults(func=cmd_rewrite)

    p = sub.add_parser("inspect", help="show a saved program's manifest and the ops replaced per layer type")
    p.add_argument("dir", metavar="DIR", help="a directory written by `treecompile rewrite`")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("stats", help="per-tree and total paths, tokens, POR and ERR per partitioning mode",
                       description="Read trajectories with the reader training uses (JSONL, one path per "
                                   "line: {\"tree_id\": ..., \"input_ids\": [...], ...}; the format is in "
                                   "treecompile/runtime/data.py) and report, per tree and in total, paths, path "
                                   "tokens, unique tokens, POR, and ERR for each partitioning mode at budget C: "
                                   "whole (one batch), packed (Tree Packing), redundancy_free.  A line that "
                                   "training would refuse is an error naming FILE:LINE.")
    p.add_argument("data", metavar="DATA.jsonl", help="trajectories, one path per line")
    p.add_argument("--budget", type=int, default=8192, metavar="C", help="partition budget in tokens (default 8192)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="V",
                   help="refuse token ids >= V (the model's vocabulary size)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("bench", help="moved: run `python -m benchmarks.harness` from a source checkout",
                       add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="ignored")
    p.set_defaults(func=cmd_bench)
    return ap


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: raised in the main thread, so that what is being written is removed on the way
    out (``saved.save`` removes its temporary directory on any exception), as on Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _terminate_as_exception():
    """While a command runs: SIGTERM and SIGHUP raise :class:`Terminated` (their default kills the process with
    a temporary directory left beside ``--out``); the previous handlers after.  The main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    old = {s: signal.signal(s, raise_terminated) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def user_error_message(e: BaseException) -> str | None:
    """One line for an error that is the user's input or environment; None for a bug (traceback)."""
    if isinstance(e, UserError):
        return " ".join(str(e).split())
    if isinstance(e, OSError) and e.errno is not None and e.strerror:  # the environment: a name, a disk, a mode
        import errno

        where = f"{e.filename}: " if e.filename is not None else ""
        return f"{where}{e.strerror} ({errno.errorcode.get(e.errno, e.errno)})"
    if "torch" not in sys.modules:  # nothing below can have been raised
        return None
    from treecompile.frontend import CaptureError  # already one line: frontend.capture explained it
    from treecompile.passes.base import UnsupportedModelError
    from treecompile.saved import SavedProgramError

    if isinstance(e, (CaptureError, UnsupportedModelError, SavedProgramError)):
        return " ".join(str(e).split())
    return None


def main(argv=None) -> int:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # whatever follows `bench` (its old options included) gets the same answer
        args = argparse.Namespace(command="bench", args=argv[1:], func=cmd_bench)
    else:
        args = ap.parse_args(argv)  # usage errors: argparse prints them and exits with 2
    try:
        with _terminate_as_exception():
            rc = args.func(args)
            sys.stdout.flush()  # a closed pipe (`| head`) shows here, inside the handler below
        return rc
    except Terminated as e:  # SIGTERM / SIGHUP: the writers' cleanup ran on the way out, as on Ctrl-C
        print(f"treecompile {args.command}: terminated ({signal.Signals(e.signum).name})", file=sys.stderr)
        return 128 + e.signum
    except BrokenPipeError:
        # the reader went away (`treecompile stats --json | head`): stop quietly, as cat does; stdout
        # points at devnull so that the interpreter's own flush at exit finds nothing to complain about
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"treecompile {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        msg = user_error_message(e)
        if msg is None:
            raise
        print(f"treecompile {args.command}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
