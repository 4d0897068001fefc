"""Command line: ``treecompile {demo, rewrite, inspect, stats, bench}``.

Conventions: ``--help`` on every command; exit status 0 (done), 1 (a problem with the user's input or
environment: one line on stderr naming the file or argument, no traceback), 2 (usage, from argparse);
outputs are written to a temporary name and renamed, so a failure leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class UserError(Exception):
    """A problem with the user's input: reported in one line on stderr, exit status 1."""


# ---------------------------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
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
        json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{cfg}: invalid JSON ({e})") from None
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
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(d), dtype=torch_dtype, output_loading_info=True)
    except Exception as e:
        raise UserError(f"{d}: transformers could not load the model ({type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    finally:
        tf_log.set_verbosity(verbosity)
        if bars:
            tf_log.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    bad = sorted(info.get("mismatched_keys") or [])
    if missing or bad:  # transformers would initialise these at random: refuse
        raise UserError(f"{d}: the safetensors lack weights the model needs (missing {missing[:3]}, "
                        f"mismatched {[k[0] if isinstance(k, tuple) else k for k in bad][:3]})")
    return model, {"source": str(d.resolve()), "dtype": DTYPES[dtype],
                   "architecture": type(model).__name__}


def _check_out(out: Path, overwrite: bool) -> None:
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"--out {out}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {out}: parent directory {parent} is not writable")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserError(f"--out {out}: exists and is not empty (use --overwrite to replace it)")


def cmd_rewrite(args) -> int:
    import treecompile
    from treecompile import saved

    out = Path(args.out)
    _check_out(out, args.overwrite)
    model, info = load_model(args.model, dtype=args.dtype, seed=args.seed)
    tmodel = treecompile.compile(model)
    try:
        saved.save(tmodel, out, manifest_extra=info, overwrite=args.overwrite)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write ({e.strerror or e})") from None
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
    m = saved.verify(d)  # files present, SHA-256 as recorded, the program archive holds data only
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    extra = m.get("extra", {})
    print(f"{d}: {m['format']}")
    print(f"  model      {m.get('model_class')}  ({extra.get('source', '?')})")
    print(f"  dtype      {m.get('dtype')}   parameters {m.get('num_parameters', 0):,}   tensors "
          f"{len(m.get('tensors', {}))}" + (f"   tied {m['tied']}" if m.get("tied") else ""))
    print(f"  versions   treecompile {m.get('treecompile_version')}, torch {m.get('torch_version')}")
    print("\npasses")
    rows = [[k, v["count"], ", ".join(f"{a}={b}" for a, b in v.get("info", {}).items())]
            for k, v in m.get("passes", {}).items()]
    print(tabulate(rows, headers=["pass", "changed", "info"], tablefmt="github"))
    print("\nreplaced ops per layer type")
    rows = [[r["layer_type"], r["replaces"], r["op"], r["pass"], r["count"], _modules(r["modules"])]
            for r in m.get("replaced_ops", [])]
    print(tabulate(rows, headers=["layer type", "replaced", "by", "pass", "sites", "modules"], tablefmt="github"))
    print("\nprogram inputs (T = tokens, N = radix nodes)")
    rows = [[r["name"], r["dtype"], "[" + ", ".join(str(s) for s in r["shape"]) + "]", r["batch_field"]]
            for r in m.get("inputs", [])]
    print(tabulate(rows, headers=["input", "dtype", "shape", "TreeBatch field"], tablefmt="github"))
    print("outputs: " + ", ".join(f"{o['name']} [{', '.join(o['shape'])}]" for o in m.get("outputs", [])))
    return 0


def _modules(paths: list[str], show: int = 2) -> str:
    if not paths:
        return ""
    more = f", ... ({len(paths)} modules)" if len(paths) > show else ""
    return ", ".join(p or "<root>" for p in paths[:show]) + more


# ---------------------------------------------------------------------------------------------- stats
class Progress:
    """A tiny stderr progress bar, drawn only when stderr is a terminal and the work is large."""

    def __init__(self, total: int, label: str, *, enabled: bool):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.last = -1

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        pct = min(100, done * 100 // self.total)
        if pct != self.last:
            self.last = pct
            n = pct * 30 // 100
            sys.stderr.write(f"\r{self.label} [{'#' * n}{'.' * (30 - n)}] {pct:3d}%")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.last >= 0:
            sys.stderr.write("\r" + " " * (len(self.label) + 40) + "\r")
            sys.stderr.flush()


def read_trees(path: Path, *, progress: bool = False) -> dict:
    """JSONL lines ``{"tree_id" | "group_id": ..., "input_ids": [int, ...]}`` -> {tree id: [paths]}.

    Trees keep the order of their first line; errors name ``file:line``.  (A small reader of its
    own: the runtime's JSONL loader lives in ``treecompile/runtime/data.py`` once merged.)
    """
    if not path.exists():
        raise UserError(f"{path}: no such file")
    if not path.is_file():
        raise UserError(f"{path}: not a file")
    size = path.stat().st_size
    bar = Progress(size, f"reading {path.name}", enabled=progress and size > (8 << 20))
    trees: dict = {}
    done = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            done += len(raw)
            if lineno % 4096 == 0:
                bar.update(done)
            line = raw.strip()
            if not line:
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise UserError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise UserError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            key = "tree_id" if "tree_id" in rec else "group_id" if "group_id" in rec else None
            if key is None:
                raise UserError(f"{where}: no \"tree_id\" or \"group_id\"")
            tid = rec[key]
            if not isinstance(tid, (str, int)) or isinstance(tid, bool):
                raise UserError(f"{where}: {key} must be a string or an integer, got {json.dumps(tid)}")
            ids = rec.get("input_ids")
            if not isinstance(ids, list) or not ids:
                raise UserError(f"{where}: \"input_ids\" must be a non-empty list of token ids")
            if not all(type(t) is int and t >= 0 for t in ids):
                bad = next(t for t in ids if not (type(t) is int and t >= 0))
                raise UserError(f"{where}: \"input_ids\" holds {json.dumps(bad)}, not a non-negative integer")
            trees.setdefault(tid, []).append(ids)
    bar.close()
    if not trees:
        raise UserError(f"{path}: no trajectories")
    return trees


MODES = ("whole", "packed", "redundancy_free")


def tree_stats(paths: list[list[int]], budget: int) -> dict:
    """Paths, path tokens, unique tokens, POR and ERR/partitions per partitioning mode at ``budget``."""
    from treecompile.runtime.metrics import reuse
    from treecompile.runtime.partition import pack, partition_redundancy_free
    from treecompile.tree import Tree

    tree = Tree.from_paths(paths)
    row = {"paths": tree.num_paths, "path_tokens": tree.num_path_tokens, "unique_tokens": tree.num_tokens,
           "por": tree.por, "modes": {}}
    row["modes"]["whole"] = {"computed_tokens": tree.num_tokens, "err": reuse(tree).err, "partitions": 1}
    longest = int(tree.path_lengths.max())
    if longest <= budget:
        plan = pack(tree, budget)
        r = plan.reuse()
        row["modes"]["packed"] = {"computed_tokens": r.computed_tokens, "err": r.err, "partitions": len(plan)}
    else:
        row["modes"]["packed"] = {"computed_tokens": None, "err": None, "partitions": None,
                                  "why": f"a path of {longest} tokens exceeds the budget {budget}"}
    rf = partition_redundancy_free(tree, budget)
    r = rf.reuse()
    row["modes"]["redundancy_free"] = {"computed_tokens": r.computed_tokens, "err": r.err, "partitions": len(rf)}
    return row


def total_stats(rows: list[dict]) -> dict:
    """Token-summed totals (POR/ERR over summed tokens); a mode that some tree cannot run is None."""
    pt = sum(r["path_tokens"] for r in rows)
    ut = sum(r["unique_tokens"] for r in rows)
    tot = {"trees": len(rows), "paths": sum(r["paths"] for r in rows), "path_tokens": pt, "unique_tokens": ut,
           "por": 1 - ut / pt, "modes": {}}
    for mode in MODES:
        ms = [r["modes"][mode] for r in rows]
        if any(m["computed_tokens"] is None for m in ms):
            n = sum(m["computed_tokens"] is None for m in ms)
            tot["modes"][mode] = {"computed_tokens": None, "err": None, "partitions": None,
                                  "why": f"{n} tree(s) have a path longer than the budget"}
        else:
            c = sum(m["computed_tokens"] for m in ms)
            tot["modes"][mode] = {"computed_tokens": c, "err": 1 - c / pt, "partitions": sum(m["partitions"] for m in ms)}
    return tot


def cmd_stats(args) -> int:
    from tabulate import tabulate

    if args.budget is not None and args.budget < 1:
        raise UserError(f"--budget {args.budget}: must be a positive number of tokens")
    path = Path(args.data)
    tty = sys.stderr.isatty()
    trees = read_trees(path, progress=tty)
    bar = Progress(len(trees), "partitioning", enabled=tty and len(trees) >= 200)
    rows = []
    for i, (tid, paths) in enumerate(trees.items()):
        rows.append({"tree_id": tid, **tree_stats(paths, args.budget)})
        bar.update(i + 1)
    bar.close()
    total = total_stats(rows)
    if args.json:
        print(json.dumps({"file": str(path), "budget": args.budget, "trees": rows, "total": total}, indent=1))
        return 0

    def fmt(m, key):
        v = m[key]
        return "-" if v is None else f"{v:.4f}" if key == "err" else v

    headers = ["tree", "paths", "path tok", "unique tok", "POR", "bound 1/(1-POR)"]
    for mode in MODES:
        headers += [f"ERR {mode}", f"parts {mode}"]
    table = []
    for r in rows + [{"tree_id": "TOTAL", **total}]:
        line = [r["tree_id"], r["paths"], r["path_tokens"], r["unique_tokens"], f"{r['por']:.4f}",
                f"{1 / (1 - r['por']):.2f}x" if r["por"] < 1 else "inf"]
        for mode in MODES:
            line += [fmt(r["modes"][mode], "err"), fmt(r["modes"][mode], "partitions")]
        table.append(line)
    print(f"{path}: {len(rows)} trees, budget C={args.budget} tokens "
          f"(ERR = 1 - computed/path tokens; totals are token-summed)")
    print(tabulate(table, headers=headers, tablefmt="github"))
    why = total["modes"]["packed"].get("why")
    if why:
        print(f"packed: {why} (packed partitioning needs every path whole in one partition)")
    return 0


# ---------------------------------------------------------------------------------------------- bench
BENCH_HELP = ("usage: treecompile bench [ARGS ...]\n\nRun the benchmark harness (benchmarks/harness.py, "
              "from a source checkout): every argument is passed to benchmarks.harness.main(argv).\n")


def _import_harness():
    try:
        from benchmarks import harness
        return harness
    except ImportError:
        pass
    root = Path(__file__).resolve().parents[1]  # a source checkout: <root>/benchmarks/harness.py
    if (root / "benchmarks" / "harness.py").is_file():
        sys.path.insert(0, str(root))
        try:
            from benchmarks import harness
            return harness
        finally:
            sys.path.remove(str(root))
    return None


def cmd_bench(args) -> int:
    harness = _import_harness()
    argv = list(args.args)
    if harness is None or not hasattr(harness, "main"):
        if any(a in ("-h", "--help") for a in argv):
            print(BENCH_HELP + "\nThe harness is not installed here.")
            return 0
        raise UserError("bench: the benchmark harness (benchmarks/harness.py with main(argv)) was not found; "
                        "run from a source checkout of treecompile")
    rc = harness.main(argv)
    return int(rc or 0)


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
                       description="Read trajectories (JSONL: one path per line, {\"tree_id\" or \"group_id\", "
                                   "\"input_ids\": [...]}) and report, per tree and in total, paths, path "
                                   "tokens, unique tokens, POR, and ERR for each partitioning mode at budget C: "
                                   "whole (one batch), packed (Tree Packing), redundancy_free.")
    p.add_argument("data", metavar="DATA.jsonl", help="trajectories, one path per line")
    p.add_argument("--budget", type=int, default=8192, metavar="C", help="partition budget in tokens (default 8192)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("bench", help="run the benchmark harness (arguments are passed through)", add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for benchmarks.harness")
    p.set_defaults(func=cmd_bench)
    return ap


def _user_error_types() -> tuple:
    from treecompile.frontend import CaptureError
    from treecompile.passes.base import UnsupportedModelError
    from treecompile.saved import SavedProgramError

    return (UserError, CaptureError, UnsupportedModelError, SavedProgramError)


def main(argv=None) -> int:
    ap = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to the harness, options included
        args = argparse.Namespace(command="bench", args=argv[1:], func=cmd_bench)
    else:
        args = ap.parse_args(argv)  # usage errors: argparse prints them and exits with 2
    try:
        return args.func(args)
    except _user_error_types() as e:
        msg = " ".join(str(e).split())  # one line
        print(f"treecompile {args.command}: error: {msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"treecompile {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
