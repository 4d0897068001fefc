# Session 42 (issue 16): the host against the GPU in the compiled Qwen3-0.6B tree step on the agentic
# parallel-tools tree, the GPU not held (probe_host.py held it with a sleep kernel: past ~1,000 queued launches
# every launch blocked, which hid the host's own time).  Per step (new batch tensors, prepared after the backward,
# as the harness): host ms until the forward, the backward and prepare return, and the GPU's ms for the forward and
# the backward (CUDA events); medians of 10 steps, FA4 replay on and off.  Then cProfile of 5 forwards (normal steps:
# the host is behind the GPU in the forward, so no launch waits), top functions by own and cumulative time.
# Run on the device from the repository root: python benchmarks/results/h200_s42/probe_host2.py
import cProfile
import io
import itertools
import pstats
import statistics
import time

import torch

from benchmarks import harness
from treecompile.ops import fa4_replay

steps = harness.cuda_steps("qwen3-0.6b", agentic="parallel-tools", iters=3)
tm = steps._tree_model()
make = lambda: steps.tree.to_batch(normalize=steps.cfg.normalize, device="cuda")
order = itertools.cycle([make(), make()])
nxt = next(order)
tm.prepare(nxt)
ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]


def one(prof=None):
    global nxt
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps.zero()
    ev[0].record()
    if prof:
        prof.enable()
    out = tm(nxt)
    if prof:
        prof.disable()
    t1 = time.perf_counter()
    ev[1].record()
    out.loss.backward()
    t2 = time.perf_counter()
    ev[2].record()
    nxt = next(order)
    tm.prepare(nxt)
    t3 = time.perf_counter()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    return [(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, (t4 - t0) * 1e3, ev[0].elapsed_time(ev[1]),
            ev[1].elapsed_time(ev[2])]


t0 = time.perf_counter()
one()
print(f"first step {time.perf_counter() - t0:.1f} s")
names = ["host fwd", "host bwd", "host prepare", "step", "GPU fwd", "GPU bwd"]
for rnd in range(2):
    for enabled in (True, False):
        fa4_replay.ENABLED = enabled
        one()
        rows = [one() for _ in range(10)]
        med = [statistics.median(c) for c in zip(*rows)]
        print(f"replay {'on ' if enabled else 'off'}: " + ", ".join(f"{n} {m:.1f}" for n, m in zip(names, med)))
from treecompile.ops import varlen_tree_attention as vta

inner = vta._forward
spent = []


def timed_forward(*a, **kw):
    t = time.perf_counter()
    try:
        return inner(*a, **kw)
    finally:
        spent.append(time.perf_counter() - t)


vta._forward = timed_forward
for enabled in (True, False):
    fa4_replay.ENABLED = enabled
    one()
    spent.clear()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    before = torch.cuda.memory_stats()
    for _ in range(10):
        one()
    after = torch.cuda.memory_stats()
    print(f"replay {'on ' if enabled else 'off'}: the varlen op's _forward {statistics.mean(spent) * 1e6:.0f} us host "
          f"per call ({len(spent)} calls); allocator over 10 steps: "
          + ", ".join(f"{k} +{after.get(k, 0) - before.get(k, 0)}" for k in keys))
vta._forward = inner
fa4_replay.ENABLED = True
pr = cProfile.Profile()
for _ in range(5):
    one(pr)
for key in ("tottime", "cumulative"):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(key).print_stats(40)
    print(s.getvalue())
