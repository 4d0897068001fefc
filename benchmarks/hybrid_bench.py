"""Hybrid (GDN + attention) benchmark on one GPU (issue 17 items 2-3): one command, one output folder.

    python -m benchmarks.hybrid_bench --out DIR [--case syn|agentic|both] [--budget-s 360]

1. fla call counts per GDN layer (host-side plans, no GPU needed): the per-level schedule (one call per
   tree level) vs :func:`treecompile.ops.fla_gdn.plan_calls` (chains merged, short parents replayed, ready
   sets) at several ``replay_max``, on the bench trees and every agentic spec.
2. One GDN layer's fwd+bwd (bf16, Qwen3.5 linear-attention heads: 16 q/k and 16 v heads of 128) on each
   bench tree: the tree through fla levelled (the default: fla's chunk kernels once, the state recurrence per
   call, ``ops/fla_gdn_levels.py``), through whole fla calls (``tree_calls*``, the default before session 17),
   with the per-level schedule (``per_level_fla`` below, kept here for the comparison), and ONE fla varlen
   call over the same number of tokens (one sequence): the cost of the tree structure itself (target <= 1.2x).
3. The harness (:mod:`benchmarks.harness`) on a Qwen3.5-shaped hybrid (``--model``, default
   ``qwen3.5-hybrid-0.8b``: 24 layers, 18 GDN + 6 attention) for ``tree`` vs ``compiled_per_path_fla``
   vs ``packed_fla_varlen`` (and ``eager_per_path``, the gradient reference), on a synthetic POR 0.5 tree
   (16 paths x 2048, 16,384 tree tokens) and/or the agentic ``parallel-tools`` tree at scale 1.5
   (16,416 tree tokens, POR 0.66); the harness names the fastest baseline and the speedup over it.

Writes ``DIR/hybrid_bench.md`` (tables with conditions), ``DIR/hybrid_bench.json``, ``DIR/fla_calls.csv``,
``DIR/gdn_layer.csv``, ``DIR/harness/`` (the
harness's results.csv / tables.md / results.jsonl, rows written as they finish).  The first fla call
compiles tilelang kernels on Hopper (minutes on a cold machine): it is timed and reported separately
(``fla_first_call_s``).  On a cold machine with a per-command limit, split it (caches stay on the machine):

    python -m benchmarks.hybrid_bench --out $OUT/layer --skip-harness             # counts + GDN layer (+ tilelang)
    python -m benchmarks.hybrid_bench --out $OUT/syn --case syn --skip-layer
    python -m benchmarks.hybrid_bench --out $OUT/agentic --case agentic --skip-layer

``--model qwen3-next-moe-small`` runs the MoE-hybrid shape (its MoE is the dense reference: checks, not speed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

if __package__:
    from benchmarks import harness
    from benchmarks.trees import agentic_paths, agentic_specs, synthetic_paths
else:
    import harness
    from trees import agentic_paths, agentic_specs, synthetic_paths

from treecompile import Tree
from treecompile.ops.fla_gdn import REPLAY_FRACTION, call_cost_rows, cheapest_plan, level_cost_rows, plan_calls

H, HV, DK, DV = 16, 16, 128, 128  # Qwen3.5 linear attention (16 key / 16 value heads of 128)
AGENTIC, AGENTIC_SCALE = "parallel-tools", 1.5
SYN_PATHS, SYN_LEN, SYN_POR = 16, 2048, 0.5


def bench_trees(case: str, vocab: int, *, path_len: int = SYN_LEN, scale: float = AGENTIC_SCALE):
    """The harness's cases (same generators and seeds): {name: paths}."""
    out = {}
    if case in ("syn", "both"):
        out[f"syn POR={SYN_POR:.2f}"] = synthetic_paths(SYN_PATHS, path_len, SYN_POR, vocab=vocab, seed=int(SYN_POR * 1000))
    if case in ("agentic", "both"):
        spec = next(s for s in agentic_specs(scale) if s.name == AGENTIC)
        out[f"agentic {AGENTIC}@{scale}"] = agentic_paths(dataclasses.replace(spec, vocab=vocab))
    return out


def call_counts(trees: dict[str, list[list[int]]], replays=(0, 64, 256, 1024)) -> list[dict]:
    """fla calls per GDN layer (forward; the backward makes as many) per tree and ``replay_max`` (with the
    layer's cap on replayed rows, ``REPLAY_FRACTION`` of the tokens), and the default plans'
    (:func:`~treecompile.ops.fla_gdn.cheapest_plan` at the levelled path's and at whole calls' price of a call:
    calls and rows fed to fla, vs the per-path rows)."""
    rows = []
    named = dict(trees)
    for s in agentic_specs(1.0):
        named.setdefault(f"agentic {s.name}@1.0", agentic_paths(s))
    for name, paths in named.items():
        t = Tree.from_paths(paths)
        b = t.to_batch()
        row = {"tree": name, "tree_tokens": t.num_tokens, "nodes": t.num_nodes, "por": round(t.por, 3),
               "levels (per-level calls)": int(t.node_level.max()) + 1}
        for r in replays:
            p = plan_calls(b.node_start, b.node_end, b.node_parent, replay_max=r, max_replay_fraction=REPLAY_FRACTION)
            row[f"calls r={r}"] = p.calls
            row[f"replayed r={r}"] = p.replayed_tokens
        p = cheapest_plan(b.node_start, b.node_end, b.node_parent, call_cost_rows=level_cost_rows(HV, DK, DV))
        w = cheapest_plan(b.node_start, b.node_end, b.node_parent, call_cost_rows=call_cost_rows(HV, DK, DV))
        row.update({"calls auto (levelled)": p.calls, "rows auto (levelled)": len(p.index),
                    "calls auto (whole calls)": w.calls, "rows auto (whole calls)": len(w.index),
                    "per-path rows": t.num_path_tokens})
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- GDN layer
def per_level_fla(q, k, v, g, beta, node_start, node_end, node_parent, node_level, *, use_qk_l2norm_in_kernel):
    """The schedule fla_gdn had before plan_calls: one varlen call per tree level, the level's inputs
    gathered and its outputs index_copy'd per level (kept for the before/after timing)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    ns, ne, par, lv = (t.tolist() for t in (node_start, node_end, node_parent, node_level))
    by_level: dict[int, list[int]] = {}
    for n, l in enumerate(lv):
        by_level.setdefault(l, []).append(n)
    row, sched, dev = {}, [], q.device
    for l in range(len(by_level)):
        idx, cu = [], [0]
        for r, n in enumerate(by_level[l]):
            row[n] = r
            idx.extend(range(ns[n], ne[n]))
            cu.append(len(idx))
        prow = None if l == 0 else torch.tensor([row[par[n]] for n in by_level[l]], device=dev)
        sched.append((torch.tensor(idx, device=dev), torch.tensor(cu, device=dev), prow))
    o, states = v.new_zeros(v.shape), None
    for idx, cu, prow in sched:
        n = cu.numel() - 1
        init = q.new_zeros(n, v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32) if prow is None \
            else states.index_select(0, prow)
        oi, states = chunk_gated_delta_rule(
            q.index_select(1, idx), k.index_select(1, idx), v.index_select(1, idx), g.index_select(1, idx),
            beta.index_select(1, idx), initial_state=init, output_final_state=True, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        o = o.index_copy(1, idx, oi.to(o.dtype))
    return o


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, iters=5):
    ts = []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _host_syncs(fn) -> int | None:
    """Host-device synchronisations in one call of ``fn`` (torch's sync debug mode warns on each; None off CUDA)."""
    import warnings

    if not torch.cuda.is_available():
        return None
    _sync()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _out_and_grads(f, xs, do) -> list[torch.Tensor]:
    o = f()
    grads = torch.autograd.grad(o, xs, do)
    return [o.detach().float()] + [g.float() for g in grads]


def gdn_layer_times(trees: dict[str, list[list[int]]], device: str = "cuda") -> list[dict]:
    rows = []
    for name, paths in trees.items():
        rows.append(_layer_row(name, paths, device))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def layer_inputs(paths: list[list[int]], device: str, pad_to_multiple: int | None = None):
    """One GDN layer's inputs on the tree of ``paths`` (seed 0), padded to ``pad_to_multiple`` tokens as a
    length bucket would be: ``(batch, [q, k, v, g, beta] (leaves that require grad), d_out)``; q, k
    ``[1, T, H, DK]``, v ``[1, T, HV, DV]``, g (log decay, float32) and beta ``[1, T, HV]``; bf16 on CUDA, float32
    elsewhere."""
    b = Tree.from_paths(paths).to_batch(device=device, pad_to_multiple=pad_to_multiple)
    T = b.seq_len
    gen = torch.Generator(device=device).manual_seed(0)
    lp = torch.bfloat16 if device == "cuda" else torch.float32

    def mk(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    xs = [mk(1, T, H, DK).to(lp), mk(1, T, H, DK).to(lp), mk(1, T, HV, DV).to(lp),
          torch.nn.functional.logsigmoid(mk(1, T, HV)) * 0.1, torch.rand(1, T, HV, device=device).to(lp)]
    return b, [x.requires_grad_() for x in xs], mk(1, T, HV, DV).to(lp)


def _layer_row(name: str, paths: list[list[int]], device: str) -> dict:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from treecompile.ops.fla_gdn import (REPLAY_FRACTION, cheapest_plan, level_cost_rows, plan_calls,
                                         tree_gated_delta_rule_fla)
    from treecompile.ops.fla_gdn_levels import levels_unusable_reason

    b, xs, do = layer_inputs(paths, device)
    T = b.seq_len
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    one = torch.tensor([0, T], device=device)
    h0 = torch.zeros(1, HV, DK, DV, device=device)

    def run(f):
        def step():
            torch.autograd.backward(f(), do)
            for x in xs:
                x.grad = None
        return step

    def planned(r, levels=None):
        return lambda: tree_gated_delta_rule_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True, replay_max=r,
                                                 levels=levels)

    levelled = levels_unusable_reason() is None  # fla's chunk-level functions import (not with a stand-in fla)
    variants_fn = {
        # the default: fla's chunk kernels once over all rows, the recurrence per call (ops/fla_gdn_levels.py),
        # cheapest_plan at LEVEL_COST_ROWS (whole calls where the chunk-level functions do not import)
        "tree_planned": planned(None),
        **({"tree_levels_r0": planned(0, True),  # ... without replay
            "tree_levels_r64": planned(64, True)} if levelled else {}),
        "tree_calls": planned(None, False),  # whole fla calls (the default before session 17), cheapest_plan
        "tree_calls_r0": planned(0, False),
        "tree_per_level": lambda: per_level_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True),
        "one_fla_call": lambda: chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True,
                                                       cu_seqlens=one, use_qk_l2norm_in_kernel=True)[0],
    }
    variants = {k: run(f) for k, f in variants_fn.items()}
    row = {"tree": name, "tokens": T}
    t0 = time.perf_counter()
    variants["one_fla_call"]()
    _sync()
    row["fla_first_call_s"] = round(time.perf_counter() - t0, 1)  # tilelang / triton compiles (cold machine)
    for k, f in variants.items():
        f()  # warm-up (autotune for the varlen shapes)
        row[f"{k}_ms"] = round(_timed(f) * 1e3, 3)
        row[f"{k}_syncs"] = _host_syncs(f)
    # same function: each planned variant's output and input gradients vs the per-level schedule's (bf16
    # rounding of different chunk alignments only; a schedule bug shows as an O(1) difference)
    ref = _out_and_grads(variants_fn["tree_per_level"], xs, do)
    for k in ("tree_planned", "tree_levels_r0", "tree_levels_r64", "tree_calls", "tree_calls_r0"):
        if k not in variants_fn:
            continue
        got = _out_and_grads(variants_fn[k], xs, do)
        row[f"{k}_vs_per_level"] = max(float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))
                                       for a, r in zip(got, ref))
    for r in (0, 64):  # the plans tree_gated_delta_rule_fla takes at these replay_max, and at None
        row[f"calls_r{r}"] = plan_calls(*nodes[:3], replay_max=r, max_replay_fraction=REPLAY_FRACTION).calls
    plan = cheapest_plan(*nodes[:3], call_cost_rows=(level_cost_rows if levelled else call_cost_rows)(HV, DK, DV))
    whole = cheapest_plan(*nodes[:3], call_cost_rows=call_cost_rows(HV, DK, DV))
    row.update({"levels": plan.levels, "calls": plan.calls, "replayed_tokens": plan.replayed_tokens,
                "calls_whole": whole.calls, "replayed_tokens_whole": whole.replayed_tokens,
                "calls/one_call": round(row["tree_calls_ms"] / row["one_fla_call_ms"], 3),
                "tree/one_call": round(row["tree_planned_ms"] / row["one_fla_call_ms"], 3),
                "per_level/one_call": round(row["tree_per_level_ms"] / row["one_fla_call_ms"], 3)})
    return row


def _write_csv(rows: list[dict], path: str) -> None:
    import csv

    if not rows:
        return
    names = list(dict.fromkeys(k for r in rows for k in r))
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def environment() -> dict:
    env = harness.environment("cuda" if torch.cuda.is_available() else "cpu")
    for mod in ("fla", "tilelang", "flash_attn", "transformers"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001 (a missing extra is a fact to report)
            env[mod] = f"missing ({type(e).__name__})"
    return env


def _table(rows: list[dict]) -> str:
    from tabulate import tabulate

    return tabulate([list(r.values()) for r in rows], headers=list(rows[0]), tablefmt="github") if rows else "(none)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hybrid_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--case", choices=["syn", "agentic", "both"], default="both")
    ap.add_argument("--model", default="qwen3.5-hybrid-0.8b")
    ap.add_argument("--contenders", nargs="+", default=["eager_per_path", "tree", "packed_fla_varlen",
                                                        "compiled_per_path_fla"])
    ap.add_argument("--capacity", type=int, default=8192, help="tokens per pack of packed_fla_varlen")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=360.0, help="the harness starts no contender after this")
    ap.add_argument("--skip-layer", action="store_true", help="skip the GDN layer timing")
    ap.add_argument("--skip-harness", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="short trees (a CPU smoke run; pair with --model hybrid-tiny)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.perf_counter()
    env = environment()
    print(json.dumps(env), flush=True)
    vocab = harness.model_specs()[args.model].config.vocab_size
    path_len, scale = (48, 0.03) if args.tiny else (SYN_LEN, AGENTIC_SCALE)
    trees = bench_trees(args.case, vocab, path_len=path_len, scale=scale)
    result: dict = {"env": env, "call_counts": call_counts(trees)}
    print(_table(result["call_counts"]), flush=True)
    _write_csv(result["call_counts"], os.path.join(args.out, "fla_calls.csv"))
    if not args.skip_layer and torch.cuda.is_available():
        try:
            result["gdn_layer"] = gdn_layer_times(trees)
            _write_csv(result["gdn_layer"], os.path.join(args.out, "gdn_layer.csv"))
        except Exception as e:  # noqa: BLE001 (a failed section is reported, the rest still runs)
            result["gdn_layer_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            print(result["gdn_layer_error"], file=sys.stderr, flush=True)
    if not args.skip_harness:
        hargs = ["--model", args.model, "--out", os.path.join(args.out, "harness"), "--iters", str(args.iters),
                 "--capacity", str(args.capacity), "--budget-s", str(max(0.0, args.budget_s - (time.perf_counter() - t_start))),
                 "--contenders", *args.contenders]
        if args.case in ("syn", "both"):
            hargs += ["--suite", "sweep", "--por", str(SYN_POR), "--paths", str(SYN_PATHS), "--path-len", str(path_len)]
        if args.case in ("agentic", "both"):
            hargs += ["--suite", "agentic", "--agentic", AGENTIC, "--agentic-scale", str(scale)]
        if not torch.cuda.is_available():
            hargs += ["--device", "cpu"]
        result["harness_args"] = hargs
        harness.main(hargs)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    md = [(f"# Hybrid benchmark\n\nConditions: {json.dumps(env)}; GDN layer timing bf16; GDN heads {H}x{DK} "
           f"(q/k), {HV}x{DV} (v); fla calls per GDN layer forward (backward as many); wall {result['wall_s']} s\n"),
          "## fla calls per GDN layer\n", _table(result["call_counts"]), ""]
    if "gdn_layer" in result:
        md += [("## One GDN layer fwd+bwd (ms, median of 5): tree planned / tree per level / one fla call over "
                "the same tokens\n"), _table(result["gdn_layer"]), ""]
    if "gdn_layer_error" in result:
        md += [f"GDN layer timing failed: {result['gdn_layer_error']}\n"]
    tables = os.path.join(args.out, "harness", "tables.md")
    if os.path.exists(tables):
        with open(tables) as f:
            md += ["## Training step (harness)\n", f.read()]
    tmp = os.path.join(args.out, "hybrid_bench.md.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(md))
    os.replace(tmp, os.path.join(args.out, "hybrid_bench.md"))
    tmp = os.path.join(args.out, "hybrid_bench.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, os.path.join(args.out, "hybrid_bench.json"))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
