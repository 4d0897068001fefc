"""Where one harness contender's step goes on CUDA (issue 16 item 4: profile what remains).

    python -m benchmarks.prof_step --model qwen3-30b-a3b-4l --contenders tree packed_fa4_varlen [--por 0.5]
                                   [--paths 16] [--path-len 2048] [--agentic NAME [--agentic-scale S]]
                                   [--iters 3] [--top 20] [--loop N]

The model, tree and step closures are the harness's own (:class:`benchmarks.harness.Steps`, one synthetic
tree of ``--paths`` x ``--path-len`` tokens at ``--por``, or the agentic tree ``--agentic``).  Per contender: the
first step (compile included), the median of ``--iters`` steps, the host time until the step returns (before the
final synchronize), then one profiled step (torch.profiler, CPU + CUDA): kernel count, summed kernel time, its
share of the step, the time the GPU was busy (union of the kernels' intervals), and kernel time by kind
(attention, Triton fusions, grouped/MoE GEMMs, GDN and short-conv kernels of hybrids, dense GEMMs,
copies/memsets, other) with the top kernels, the host's lead-in before the first kernel and the GPU's idle gaps,
both named by the host events under them.  ``--loop N``: also N steps back to back with one synchronize (what a
training loop that does not wait for the GPU each step gets: the host's lead-in and host-bound stretches overlap
the GPU's work of the step before), alternating with N synchronized steps, 3 rounds, and 3 such steps profiled for
the GPU's idle time between kernels; the SM clock, power and clock caps of each kind of round are sampled
(:mod:`benchmarks.gpu_clocks`).
One JSON line per contender, then a readable summary.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness
from benchmarks.gpu_clocks import GpuClocks, describe, device_id

# kernel name -> kind; the first pattern that matches wins (names of cuDNN/FA4/flex/cuBLAS/CUTLASS/Triton)
KINDS = [
    ("attention", re.compile(r"flash|fmha|attn|attention|flex|sdpa|cudnn", re.I)),
    ("triton", re.compile(r"^triton_", re.I)),  # inductor's fusions (their names list the ops: _to_copy, cat, ...)
    ("grouped_gemm", re.compile(r"grouped|group_gemm|moe|ragged", re.I)),
    # fla's GDN kernels (Triton; tilelang's are named "kernel_kernel") and the short conv's
    ("gdn", re.compile(r"chunk_|gated_delta|delta_rule|wy_repr|recompute_w_u|l2norm|solve_tril|kkt|^kernel_kernel$")),
    ("conv", re.compile(r"conv1d", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|sm90_xmma|cutlass|cublas|matmul|wgmma", re.I)),
    ("copy/memset", re.compile(r"memcpy|memset|copy|cat_|fill", re.I)),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if pat.search(name):
            return kind
    return "other"


def _merged(intervals) -> list[list[float]]:
    """The union of ``(start, end)`` intervals as disjoint ``[start, end]`` runs, in order."""
    runs: list[list[float]] = []
    for a, b in sorted(intervals):
        if runs and a <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], b)
        else:
            runs.append([a, b])
    return runs


def busy_ms(intervals) -> float:
    """Milliseconds covered by the union of ``(start, end)`` intervals in microseconds (the time the GPU was busy)."""
    return sum(b - a for a, b in _merged(intervals)) / 1e3


def _sync():
    torch.cuda.synchronize()


def _where(stack) -> str:
    """The innermost frame of a profiler event's Python stack in our code or transformers' ("file:line")."""
    for frame in stack or ():
        if any(k in frame for k in ("treecompile/", "benchmarks/", "transformers/")):
            path, _, rest = frame.partition("(")
            return f"{'/'.join(path.split('/')[-2:])}:{rest.split(')')[0]}"
    return ""


def running_at(host_events, t: float, depth: int) -> str:
    """The host events (``(name, start, end)`` us) running at ``t``, outermost to innermost, the last ``depth`` of
    them joined by " > " ("(no host event)" when none)."""
    stack = sorted((ev for ev in host_events if ev[1] <= t <= ev[2]), key=lambda ev: (ev[1], -ev[2]))
    return " > ".join(ev[0][:100] for ev in stack[-depth:]) or "(no host event)"


def idle_gaps(intervals, host_events, *, min_us: float = 200.0, depth: int = 3) -> list[tuple[str, float, int]]:
    """Where the GPU waited on the host: the gaps of at least ``min_us`` between the union of kernel
    ``intervals`` (``(start, end)`` us), each named by the host events (``(name, start, end)`` us) running at
    its midpoint, outermost to innermost, the last ``depth`` of them joined by " > ". Returns ``(name,
    idle ms, gaps)`` per name, most idle first. A gap under a synchronize or a copy to the host is the host
    waiting; under Python-level ops it is host work the GPU ran out of."""
    merged = _merged(intervals)
    by: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for (_, e0), (s1, _) in zip(merged, merged[1:]):
        if s1 - e0 < min_us:
            continue
        name = running_at(host_events, (e0 + s1) / 2, depth)
        by[name][0] += (s1 - e0) / 1e3
        by[name][1] += 1
    return sorted(((n, round(ms, 3), k) for n, (ms, k) in by.items()), key=lambda x: -x[1])


def lead_in_parts(host_events, start: float, end: float, *, slice_us: float = 10.0,
                  depth: int = 3) -> list[tuple[str, float]]:
    """What the host did from the step's ``start`` to the first device event at ``end`` (us), while the GPU had
    nothing: the interval cut in ``slice_us`` slices, each named by :func:`running_at` its middle, as
    :func:`idle_gaps` names a gap. Returns ``(name, ms)``, most first."""
    by: dict[str, float] = defaultdict(float)
    n = max(0, int((end - start) // slice_us))
    during = [ev for ev in host_events if ev[1] <= end and ev[2] >= start]  # a step has ~10^4 host events
    for i in range(n):
        by[running_at(during, start + (i + 0.5) * slice_us, depth)] += slice_us / 1e3
    return sorted(((name, round(ms, 3)) for name, ms in by.items()), key=lambda x: -x[1])


def is_kernel(e) -> bool:
    """Whether profiler event ``e`` is work on the GPU.  A ``record_function`` range (ours: ``harness::*``,
    ``treecompile::*``) also appears there, spanning its kernels and the gaps between them: counted as a kernel it
    would add to the busy time and hide the gaps."""
    return e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)


def profile_step(step, *, stacks: bool = False, host_top: int = 0) -> dict:
    """One profiled step: kernel totals (ms) by kind and the top kernels by time.  ``stacks``: record Python
    stacks, and name each idle gap's host events by their innermost source line in our code (slower host).
    ``host_top``: also the ``host_top`` host ops of most self time (torch's ``key_averages``, ms and calls)."""
    _sync()
    # the Python stacks reach prof.events() only with the verbose experimental config (torch 2.11-2.13)
    extra = {"with_stack": True, "experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)} \
        if stacks else {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], **extra) as prof:
        step()
        _sync()
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    intervals, host = [], []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU:
            where = _where(e.stack) if stacks else ""
            host.append((f"{e.name} @{where}" if where else e.name, e.time_range.start, e.time_range.end))
        if is_kernel(e):
            rec = by_name[e.name]
            rec[0] += e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
            rec[1] += 1
            intervals.append((e.time_range.start, e.time_range.end))
    first = min(a for a, _ in intervals) if intervals else None
    start = step_start(host) if host else None
    kinds: dict[str, float] = defaultdict(float)
    for name, (ms, _) in by_name.items():
        kinds[kind_of(name)] += ms
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"kernels": sum(n for _, n in by_name.values()), "kernel_ms": sum(ms for ms, _ in by_name.values()),
            "gpu_busy_ms": busy_ms(intervals), "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [(name[:110], round(ms, 3), n) for name, (ms, n) in top], "idle": idle_gaps(intervals, host),
            # per harness phase (forward, backward, ...): ms on the host, ms its kernels spanned on the GPU.  A phase
            # whose host ms reach its GPU ms is host-bound (the GPU idles wherever the host falls behind)
            "phases_ms": phases_ms(prof.events()),
            # the host's work from the step's start to its first device event (a kernel or a copy): the GPU idles
            # all of it.  The start: the harness's first named range (the profiler's own start-up events come
            # before it), else the first host event
            "lead_in_ms": round((first - start) / 1e3, 3) if intervals and host else None,
            "lead_in": lead_in_parts(host, start, first) if intervals and host else [],
            "host_top": host_self_ms(prof, host_top)}


def profile_loop(step, n: int) -> dict:
    """``n`` steps back to back under a CUDA-only profiler (no host op events: the host runs nearly as fast as
    unprofiled, where a CPU profile of the same loop made it host-bound), per step: the wall time, the kernel time,
    the time the GPU was busy, and its idle time (after the first kernel) by gap length (:func:`gaps_by_length`), with
    the kernels on both sides of the largest gaps."""
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        _sync()
        wall = time.perf_counter() - t0
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if is_kernel(e)]
    kernel_us = sum(e - s for _, s, e in kernels)
    return {"wall_ms": round(wall * 1e3 / n, 2), "kernel_ms": round(kernel_us / 1e3 / n, 2),
            "gpu_busy_ms": round(busy_ms([(s, e) for _, s, e in kernels]) / n, 2), **gaps_by_length(kernels, n)}


GAP_BINS_US = (10.0, 50.0, 200.0)  # the bins' upper ends; a last bin holds the rest


def gaps_by_length(kernels, steps: int = 1, *, top: int = 10) -> dict:
    """The GPU's idle time between kernels (``(name, start, end)`` us; overlapping kernels merged), per step of
    ``steps``: ``idle_ms`` in all, ``gaps`` per length bin (``"<10us"``, ``"10-50us"``, ``"50-200us"``,
    ``">=200us"``: ``[gaps, ms]``; the short ones are the GPU's own bubbles between kernels fed from a full launch
    queue, the long ones a wait for the host or for another stream), and the ``top`` longest gaps in all as
    ``(ms, kernel before, kernel after)``."""
    order = sorted(kernels, key=lambda k: (k[1], k[2]))
    labels = [f"<{GAP_BINS_US[0]:g}us"] + [f"{a:g}-{b:g}us" for a, b in zip(GAP_BINS_US, GAP_BINS_US[1:])] \
        + [f">={GAP_BINS_US[-1]:g}us"]
    bins = {label: [0, 0.0] for label in labels}
    longest = []
    end, before = None, None
    for name, s, e in order:
        if end is not None and s > end:
            gap = s - end
            label = labels[sum(gap >= b for b in GAP_BINS_US)]
            bins[label][0] += 1
            bins[label][1] += gap / 1e3
            longest.append((round(gap / 1e3, 3), before[:80], name[:80]))
        if end is None or e >= end:
            end, before = e, name
    longest.sort(key=lambda g: -g[0])
    return {"idle_ms": round(sum(ms for _, ms in bins.values()) / steps, 3),
            "gaps": {label: [round(k / steps, 1), round(ms / steps, 3)] for label, (k, ms) in bins.items()},
            "largest": longest[:top]}


def host_self_ms(prof, n: int) -> list[tuple[str, float, int]]:
    """The ``n`` host ops of ``prof`` with the most self time (time in the op less its children's): ``(name, ms,
    calls)``.  Where a phase is host-bound, this says what the host spends it on."""
    if n <= 0:
        return []
    avgs = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
    return [(a.key[:110], round(a.self_cpu_time_total / 1e3, 3), a.count) for a in avgs[:n]]


def phases_ms(events) -> dict[str, list[float]]:
    """Per harness phase (the ``harness::`` ranges: ``zero_grad``, ``forward``, ``backward``, ``prepare``), summed
    over its occurrences: ``[host ms, GPU ms]``, the range on the host and the span its kernels took on the GPU
    (the range's GPU side; 0.0 where the profile has none).  A phase whose host ms reach its GPU ms is host-bound:
    the GPU idles wherever the host falls behind (session 42: the 0.6B agentic forward, 48.8 against 50.5 ms)."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e.name.startswith("harness::"):
            ms = out.setdefault(e.name[len("harness::"):], [0.0, 0.0])
            ms[0 if e.device_type == torch.autograd.DeviceType.CPU else 1] += \
                round((e.time_range.end - e.time_range.start) / 1e3, 3)
    return out


def step_start(host_events) -> float:
    """When the profiled step began (us): the first ``harness::`` range's start, else the first host event's."""
    named = [start for name, start, _ in host_events if name.startswith("harness::")]
    return min(named) if named else min(start for _, start, _ in host_events)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--contenders", nargs="+", default=["tree"], choices=harness.CONTENDERS)
    ap.add_argument("--por", type=float, default=0.5)
    ap.add_argument("--paths", type=int, default=16)
    ap.add_argument("--path-len", type=int, default=2048)
    ap.add_argument("--agentic", default=None, metavar="NAME", help="an agentic tree (benchmarks/trees.py) instead")
    ap.add_argument("--agentic-scale", type=float, default=1.0)
    ap.add_argument("--capacity", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--stacks", action="store_true", help="name the idle gaps by source line (Python stacks "
                    "recorded: the profiled step's host runs slower)")
    ap.add_argument("--host-top", type=int, default=0, metavar="N",
                    help="also print the N host ops of most self time in the profiled step")
    ap.add_argument("--loop", type=int, default=0, metavar="N",
                    help="also time N steps back to back, one synchronize before and after (a training loop that "
                    "does not wait for the GPU each step), in rounds alternating with the synchronized steps; and "
                    "profile 3 steps back to back")
    args = ap.parse_args(argv)
    if args.loop < 0:
        raise SystemExit(f"prof_step: --loop expects a number of steps >= 0, got {args.loop}")
    if not torch.cuda.is_available():
        raise SystemExit("prof_step: needs a CUDA device")
    steps = harness.cuda_steps(args.model, agentic=args.agentic, agentic_scale=args.agentic_scale, por=args.por,
                               paths=args.paths, path_len=args.path_len, capacity=args.capacity, iters=args.iters)
    case = steps.case
    for name in args.contenders:
        harness._with_run_notes(None)  # the row's note says this contender's decisions and counts only
        made = steps.tree_step() if name == "tree" else getattr(steps, name)()
        step = made[0] if isinstance(made, tuple) else made
        t0 = time.perf_counter()
        step()
        _sync()
        first = time.perf_counter() - t0
        times, hosts = [], []
        for _ in range(args.iters):
            _sync()
            t0 = time.perf_counter()
            step()
            hosts.append(time.perf_counter() - t0)
            _sync()
            times.append(time.perf_counter() - t0)
        loops, synced = [], []
        cuda = torch.device("cuda")
        # the SM clock and power each kind of round ran at (a GPU with fewer idle gaps may hold a lower clock)
        clocks = {kind: GpuClocks(device_id()) for kind in ("loop", "synced")} if args.loop else {}
        for _ in range(3 if args.loop else 0):  # rounds: N steps back to back, then N synchronized ones (median)
            with clocks["loop"]:
                loops.append(harness.steps_seconds(step, cuda, args.loop))
            with clocks["synced"]:
                synced.append(statistics.median(harness.steps_seconds(step, cuda) for _ in range(args.loop)))
        row = {"contender": name, "model": args.model, "tree": case.name, "tree_tokens": steps.tree.num_tokens,
               "path_tokens": steps.tree.num_path_tokens, "first_s": round(first, 3),
               "step_s": round(statistics.median(times), 4), "host_s": round(statistics.median(hosts), 4),
               **({"loop_step_s": [round(x, 4) for x in loops], "synced_step_s": [round(x, 4) for x in synced],
                   "clocks": {kind: c.summary() for kind, c in clocks.items()}} if loops else {}),
               **profile_step(step, stacks=args.stacks, host_top=args.host_top)}
        if args.loop:
            row["loop_profile"] = profile_loop(step, 3)
        row["kernel_share"] = round(row["kernel_ms"] / 1e3 / row["step_s"], 3)
        row["note"] = harness._with_run_notes(None)
        top, idle, lead_in, host_top = row.pop("top"), row.pop("idle"), row.pop("lead_in"), row.pop("host_top")
        print(json.dumps(row))
        print(f"# {name}: step {row['step_s'] * 1e3:.1f} ms, host {row['host_s'] * 1e3:.1f} ms, "
              f"{row['kernels']} kernels {row['kernel_ms']:.1f} ms ({row['kernel_share']:.0%} of the step), "
              f"GPU busy {row['gpu_busy_ms']:.1f} ms")
        if loops:
            lp = row["loop_profile"]
            print(f"#   back to back ({args.loop} steps, one synchronize; 3 rounds): "
                  + ", ".join(f"{x * 1e3:.1f}" for x in loops) + " ms a step (synchronized, each round's median: "
                  + ", ".join(f"{x * 1e3:.1f}" for x in synced) + "); 3 steps under a CUDA-only profiler: "
                  f"{lp['wall_ms']:.1f} ms a step, kernels {lp['kernel_ms']:.1f} ms, "
                  f"GPU busy {lp['gpu_busy_ms']:.1f} ms,"
                  f" idle {lp['idle_ms']:.1f} ms: " + ", ".join(f"{label} {k:g} gaps {ms:.2f} ms"
                                                           for label, (k, ms) in lp["gaps"].items()))
            for kind, c in row["clocks"].items():
                print(f"#   {kind} rounds: {describe(c)}")
            for ms, before, after in lp["largest"][:8]:
                print(f"#     {ms:8.3f} ms  after {before}  before {after}")
        for kind, ms in row["by_kind_ms"].items():
            print(f"#   {kind:13s} {ms:8.2f} ms")
        for kname, ms, n in top[:args.top]:
            print(f"#     {ms:8.2f} ms  x{n:<5d} {kname}")
        print("#   phases (host ms / GPU ms): " + ", ".join(f"{name} {h:.1f} / {g:.1f}"
                                                        for name, (h, g) in row["phases_ms"].items()))
        print(f"#   GPU idle before the first kernel (host lead-in): {row['lead_in_ms']} ms, by the host events then:")
        for hname, ms in lead_in[:args.top]:
            print(f"#     {ms:8.2f} ms         {hname}")
        print(f"#   GPU idle in gaps >= 0.2 ms after it: "
              f"{sum(ms for _, ms, _ in idle):.1f} ms, by the host events at their middle:")
        for hname, ms, n in idle[:args.top]:
            print(f"#     {ms:8.2f} ms  x{n:<5d} {hname}")
        if host_top:
            print("#   host ops by self time (ms, calls):")
        for hname, ms, n in host_top:
            print(f"#     {ms:8.2f} ms  x{n:<5d} {hname}")
        steps.zero()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
