"""Where one tree GDN layer's fwd+bwd time goes (issue 17 item 3: the tree layer within 1.2x of one fla call).

    python -m benchmarks.prof_gdn_layer [--case syn|agentic] [--compare FILE]

On :func:`benchmarks.hybrid_bench.layer_inputs` (Qwen3.5 linear-attention heads, bf16 on CUDA) of a bench tree,
each variant (one fla varlen call over the tree's tokens; the tree through ``tree_gated_delta_rule_fla`` with the
default plan (levelled), the same through fla's own functions (``tree_planned_via_fla``:
``fla_gdn_levels.DIRECT`` off), levelled with ``replay_max=0``, and whole fla calls) is timed (median of 5: step
and host-until-return) and profiled once (torch.profiler): on CUDA the kernel count, kernel time and the top
kernels; everywhere the top host ops.  ``--compare FILE``: another ``fla_gdn.py`` (e.g. ``git show
REV:treecompile/ops/fla_gdn.py``) whose ``tree_gated_delta_rule_fla`` runs the same tree variants as
``<name>_compare`` rows, and whose outputs and input gradients are compared with this tree's (max abs diff).  One
JSON row per variant, then its top ops.

``--case group``: a prompt and its sampled completions (a GRPO group, ``trees.group_paths``), padded to ``--pad``
tokens as a length bucket would be: its plan's rows are the tokens in DFS order, so the layer gathers nothing.
``tree_planned_gathered`` (every case): the same layer with the rows gathered into call order whatever the plan
(DFS-order detection, ``fla_gdn.IN_PLACE`` and ``fla_gdn_levels.TREE`` off: what ran before session 33).
``tree_per_call``: the default with ``fla_gdn_levels.TREE`` off (the recurrence one launch per call of the plan
chosen for it: what ran before session 34).  ``--tree-config BV:WARPS:STAGES`` (repeatable) adds a
``tree_bv<BV>_w<WARPS>_s<STAGES>`` variant: the recurrence over the tree at that kernel config.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

if __package__:
    from benchmarks import hybrid_bench as hb
    from benchmarks.trees import group_paths
else:
    import hybrid_bench as hb
    from trees import group_paths

from treecompile import Tree
from treecompile.ops import fla_gdn
from treecompile.ops.last_batch import LastBatch

# the default (levelled: fla's chunk kernels once, the recurrence per call), levelled without replay, whole calls
TREE_VARIANTS = {"tree_planned": {}, "tree_levels_r0": {"replay_max": 0, "levels": True},
                 "tree_calls": {"levels": False}}


def tree_variants() -> dict:
    """:data:`TREE_VARIANTS` that run here (the levelled ones need fla's chunk-level functions)."""
    from treecompile.ops.fla_gdn_levels import levels_unusable_reason

    usable = levels_unusable_reason() is None
    return {k: kw for k, kw in TREE_VARIANTS.items() if usable or not kw.get("levels")}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _load(path: str):
    spec = importlib.util.spec_from_file_location("fla_gdn_compare", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the file executes
    spec.loader.exec_module(mod)
    return mod


_GATHERED_PLANS = LastBatch()  # the gathered variant's plan, made once like the default's


def _gathered(fn):
    """``fn()`` with the plans' DFS-order detection, in-place reads and the recurrence over the tree off: rows
    gathered into call order."""
    from treecompile.ops import fla_gdn_levels

    with mock.patch.object(fla_gdn, "_in_dfs_order", lambda *a: False), mock.patch.object(fla_gdn, "IN_PLACE", False), \
            mock.patch.object(fla_gdn, "_roots_delayed", lambda *a: None), \
            mock.patch.object(fla_gdn, "_PLANS", _GATHERED_PLANS), mock.patch.object(fla_gdn_levels, "TREE", False):
        return fn()


_PER_CALL_PLANS = LastBatch()


def _per_call(fn):
    """``fn()`` with ``fla_gdn_levels.TREE`` off: the recurrence one launch per call of the plan."""
    from treecompile.ops import fla_gdn_levels

    with mock.patch.object(fla_gdn_levels, "TREE", False), mock.patch.object(fla_gdn, "_PLANS", _PER_CALL_PLANS):
        return fn()


def _tree_config(config: str, fn):
    """``fn()`` with the recurrence over the tree at kernel config ``BV:WARPS:STAGES``."""
    from treecompile.ops import fla_tree_recurrence as ftr

    bv, warps, stages = (int(x) for x in config.split(":"))
    with mock.patch.object(ftr, "BV", bv), mock.patch.object(ftr, "NUM_WARPS", warps), \
            mock.patch.object(ftr, "NUM_STAGES", stages):
        return fn()


def variants(paths, device: str, compare=None, pad: int | None = None, tree_configs=()) -> tuple[dict, list, torch.Tensor]:
    """``({name: fn() -> output}, inputs, d_out)`` on the layer inputs of ``paths`` (padded to ``pad``)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    b, xs, do = hb.layer_inputs(paths, device, pad)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    one = torch.tensor([0, b.seq_len], device=device)
    h0 = torch.zeros(1, hb.HV, hb.DK, hb.DV, device=device)
    fns = {"one_fla_call": lambda: chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True,
                                                          cu_seqlens=one, use_qk_l2norm_in_kernel=True)[0]}
    for mod, suffix in ((fla_gdn, ""), (compare, "_compare")):
        if mod is None:
            continue
        for name, kw in tree_variants().items():
            fns[name + suffix] = (lambda f=mod.tree_gated_delta_rule_fla, kw=kw:
                                  f(*xs, *nodes, use_qk_l2norm_in_kernel=True, **kw))
    fns["tree_planned_gathered"] = lambda: _gathered(lambda: fla_gdn.tree_gated_delta_rule_fla(
        *xs, *nodes, use_qk_l2norm_in_kernel=True))
    fns["tree_per_call"] = lambda: _per_call(lambda: fla_gdn.tree_gated_delta_rule_fla(
        *xs, *nodes, use_qk_l2norm_in_kernel=True))
    for c in tree_configs:
        fns["tree_bv{}_w{}_s{}".format(*c.split(":"))] = lambda c=c: _tree_config(c, lambda: (
            fla_gdn.tree_gated_delta_rule_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True)))
    if "tree_levels_r0" in tree_variants():  # levelled, default plan, every kernel through fla's own functions
        fns["tree_planned_via_fla"] = lambda: _via_fla(lambda: fla_gdn.tree_gated_delta_rule_fla(
            *xs, *nodes, use_qk_l2norm_in_kernel=True))
    return fns, xs, do


def _via_fla(fn):
    """``fn()`` with ``fla_gdn_levels.DIRECT`` off: the levelled layer's recurrence through fla's own functions (a
    call each, outputs concatenated) instead of launches into one buffer; its backward uses the same set."""
    from treecompile.ops import fla_gdn_levels

    with mock.patch.object(fla_gdn_levels, "DIRECT", False):
        return fn()


def profile_variant(fn, xs, do, top: int = 8, warmup: int = 3, iters: int = 5) -> dict:
    def step():
        torch.autograd.backward(fn(), do)
        for x in xs:
            x.grad = None

    for _ in range(warmup):
        step()
    _sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        th = time.perf_counter()
        _sync()
        ts.append((time.perf_counter() - t0, th - t0))
    ts.sort()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        _sync()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ka = prof.key_averages()
    med = ts[len(ts) // 2]
    row = {"step_ms": round(med[0] * 1e3, 2), "host_ms": round(med[1] * 1e3, 2), "kernels": len(kernels),
           "kernel_sum_ms": round(sum(e.device_time for e in kernels) / 1e3, 2)}
    row["top_kernels"] = [(round(e.self_device_time_total / 1e3, 2), e.count, e.key[:110]) for e in
                          sorted((e for e in ka if e.self_device_time_total > 0),
                                 key=lambda e: -e.self_device_time_total)[:top]]
    row["top_host"] = [(round(e.self_cpu_time_total / 1e3, 2), e.count, e.key[:110]) for e in
                       sorted(ka, key=lambda e: -e.self_cpu_time_total)[:top]]
    return row


def max_diff(fa, fb, xs, do) -> float:
    """Max abs difference of outputs and input gradients of two variants."""
    def og(f):
        o = f()
        return [o.detach().float()] + [g.float() for g in torch.autograd.grad(o, xs, do)]
    return max(float((a - b).abs().max()) for a, b in zip(og(fa), og(fb)))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("syn", "agentic", "group"), default="syn")
    ap.add_argument("--pad", type=int, default=None, help="pad the tree to a multiple of this many tokens")
    ap.add_argument("--group", type=int, nargs=4, default=(2048, 16, 512, 1536), metavar=("PROMPT", "SAMPLES", "LO", "HI"),
                    help="--case group: prompt tokens, completions, their shortest and longest")
    ap.add_argument("--compare", metavar="FILE", help="another fla_gdn.py to run the same tree variants with")
    ap.add_argument("--tree-config", action="append", default=[], metavar="BV:WARPS:STAGES",
                    help="add a variant: the recurrence over the tree at this kernel config")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--scale", type=float, default=hb.AGENTIC_SCALE, help="agentic tree scale")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    ap.add_argument("--iters", type=int, default=5, help="timed steps per variant (the median is reported)")
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    paths = (group_paths(*a.group, vocab=a.vocab) if a.case == "group"
             else next(iter(hb.bench_trees(a.case, a.vocab, scale=a.scale).values())))
    nodes = Tree.from_paths(paths).to_batch(pad_to_multiple=a.pad)
    nodes = (nodes.node_start, nodes.node_end, nodes.node_parent)
    levels = fla_gdn.default_levels()
    tree = levels and fla_gdn.tree_usable(torch.device(device))
    print(json.dumps({"recurrence": "one launch over the tree" if tree else "per call"}), flush=True)
    for r in (None, 0, 256):  # the plans tree_gated_delta_rule_fla takes at these replay_max (None: its default)
        in_place = levels and (tree or fla_gdn.in_place_usable())
        cost = (fla_gdn.level_cost_rows if levels else fla_gdn.call_cost_rows)(hb.HV, hb.DK, hb.DV)
        p = (fla_gdn.cheapest_plan(*nodes, call_cost_rows=cost, in_place=in_place) if r is None and not tree
             else fla_gdn.plan_calls(*nodes, replay_max=r or 0, max_replay_fraction=fla_gdn.REPLAY_FRACTION))
        print(json.dumps({"plan replay_max": r, "calls": p.calls, "levels": p.levels,
                          "replayed": p.replayed_tokens, "rows": p.rows_read(in_place)}), flush=True)
    fns, xs, do = variants(paths, device, _load(a.compare) if a.compare else None, a.pad, a.tree_config)
    rows = []
    for name, fn in fns.items():
        row = {"variant": name, **profile_variant(fn, xs, do, warmup=a.warmup, iters=a.iters)}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("top_")}), flush=True)
        for key in ("top_kernels", "top_host"):
            for ms, n, op in row[key]:
                print(f"   {key[4:]:8s} {ms:8.2f} ms  n={n:4d}  {op}")
    for other in ("tree_planned_gathered", "tree_per_call"):
        d = max_diff(fns["tree_planned"], fns[other], xs, do)
        rows.append({"variant": f"tree_planned vs {other}", "max_abs_diff": d})
        print(json.dumps(rows[-1]), flush=True)
    for name in tree_variants():
        if name + "_compare" in fns:
            d = max_diff(fns[name], fns[name + "_compare"], xs, do)
            rows.append({"variant": f"{name} vs {name}_compare", "max_abs_diff": d})
            print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
