# Session 42 (issue 16): where the host time of the compiled Qwen3-0.6B tree step's forward goes on the H200's host
# (agentic parallel-tools tree, FA4's forward replayed): cProfile of 5 forwards with the GPU held busy by a sleep
# kernel (so no call waits for the device), top functions by own time and by cumulative time.
# Run on the device from the repository root: python benchmarks/results/h200_s42/probe_host.py
import cProfile
import io
import pstats
import time

import torch

from benchmarks import harness

steps = harness.cuda_steps("qwen3-0.6b", agentic="parallel-tools", iters=3)
step, _, _ = steps.tree_step()
tm = steps._tree_model()
step(), step()
batch = steps.tree.to_batch(normalize=steps.cfg.normalize, device="cuda")
tm.prepare(batch)
for _ in range(2):
    steps.zero()
    tm(batch).loss.backward()
torch.cuda.synchronize()
pr = cProfile.Profile()
outs = []
torch.cuda._sleep(int(6e9))
t0 = time.perf_counter()
pr.enable()
for _ in range(5):
    outs.append(tm(batch))
pr.disable()
print(f"5 forwards under cProfile: {(time.perf_counter() - t0) * 1e3:.1f} ms host")
torch.cuda.synchronize()
del outs
for key in ("tottime", "cumulative"):
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
    print(s.getvalue())
