"""Session 39 probe: where the host's time goes in one 0.6B tree step on the agentic parallel-tools tree
(cProfile of the step, after warm-up; the GPU is synchronised before and after).  Prints the functions by own
time and by cumulative time."""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from benchmarks import harness

agentic = sys.argv[1] if len(sys.argv) > 1 else "parallel-tools"
steps = harness.cuda_steps("qwen3-0.6b", agentic=agentic, iters=5)
step = steps.tree_step()[0]
for _ in range(3):
    step()
torch.cuda.synchronize()
hs, ts = [], []
for _ in range(5):
    t = time.perf_counter()
    step()
    hs.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    ts.append(time.perf_counter() - t)
print(f"step median {statistics.median(ts) * 1e3:.1f} ms, host {statistics.median(hs) * 1e3:.1f} ms", flush=True)
prof = cProfile.Profile()
prof.enable()
step()
torch.cuda.synchronize()
prof.disable()
for key in ("tottime", "cumulative"):
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
    print(s.getvalue()[-9000:])
