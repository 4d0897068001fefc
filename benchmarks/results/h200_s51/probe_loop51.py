# Session 51: why 10 Qwen3-0.6B parallel-tools tree steps run back to back (one synchronize) take 127-131 ms a step
# when their kernels take 118 ms and their host 92-108 ms.
# 1. the loop's step time, and each step's host time (to its return), 3 rounds of 10;
# 2. 6 steps back to back under a CUDA-only profiler (no host op events, so the host runs nearly as fast): kernel
#    time, GPU busy, idle gaps >= 0.2 ms, and the CUDA runtime calls that took >= 0.3 ms (a blocking call: a
#    synchronize, a pinned allocation, a full launch queue);
# 3. two steps under torch.cuda.set_sync_debug_mode("warn"): every synchronizing torch call, with where it came from.
#   PYTHONPATH=. python probe_loop51.py
import os
import statistics
import time
import traceback
import warnings
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness
from benchmarks.prof_step import busy_ms, is_kernel, _merged

steps = harness.cuda_steps("qwen3-0.6b", agentic="parallel-tools", iters=5)
step = steps.tree_step()[0]
for _ in range(3):
    step()
torch.cuda.synchronize()

for rnd in range(3):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    hosts = []
    for _ in range(10):
        h = time.perf_counter()
        step()
        hosts.append((time.perf_counter() - h) * 1e3)
    torch.cuda.synchronize()
    print(f"round {rnd}: {(time.perf_counter() - t0) * 100:.1f} ms a step back to back; host per step "
          + " ".join(f"{x:.0f}" for x in hosts), flush=True)

if os.environ.get("LOOP_ONLY"):
    raise SystemExit(0)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter()
    for _ in range(6):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / 6
kern, calls = [], defaultdict(lambda: [0.0, 0])
for e in prof.events():
    if is_kernel(e):
        kern.append((e.time_range.start, e.time_range.end))
    else:
        d = (e.time_range.end - e.time_range.start) / 1e3
        if d >= 0.3:
            calls[e.name][0] += d
            calls[e.name][1] += 1
ms = sum(b - a for a, b in kern) / 1e3 / 6
merged = _merged(kern)
gaps = sorted(((s1 - e0) / 1e3 for (_, e0), (s1, _) in zip(merged, merged[1:]) if s1 - e0 >= 200), reverse=True)
print(f"CUDA-only profile, 6 steps back to back: {wall:.1f} ms a step, kernels {ms:.1f} ms, busy {busy_ms(kern) / 6:.1f}"
      f" ms a step; idle in {len(gaps)} gaps >= 0.2 ms: {sum(gaps) / 6:.1f} ms a step; largest "
      + " ".join(f"{g:.2f}" for g in gaps[:15]), flush=True)
for name, (d, n) in sorted(calls.items(), key=lambda kv: -kv[1][0])[:15]:
    print(f"  host call >= 0.3 ms: {d:8.2f} ms x{n:<4d} {name[:100]}", flush=True)

seen = defaultdict(int)


def show(message, category, filename, lineno, file=None, line=None):
    where = [f"{f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
             for f in traceback.extract_stack() if "treecompile/" in f.filename or "benchmarks/" in f.filename]
    seen[(str(message)[:80], " < ".join(where[::-1][:4]))] += 1


warnings.showwarning = show
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
step()
step()
torch.cuda.set_sync_debug_mode(0)
torch.cuda.synchronize()
print(f"synchronizing torch calls in 2 steps: {sum(seen.values())}", flush=True)
for (msg, where), n in seen.items():
    print(f"  x{n} {msg} @ {where}", flush=True)
