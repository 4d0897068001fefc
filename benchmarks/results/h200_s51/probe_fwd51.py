# Session 51: where the host's time goes in the forward and backward of a warm Qwen3-0.6B tree step (agentic
# parallel-tools), phase by phase, against the GPU's time for the same phase; then cProfile of one forward and one
# backward (own time, and the callees of the varlen ops' Python).
#   PYTHONPATH=. python probe_fwd51.py
import cProfile
import io
import pstats
import statistics
import time

import torch

from benchmarks import harness

steps = harness.cuda_steps("qwen3-0.6b", agentic="parallel-tools", iters=5)
tm = steps._tree_model()
batches = [steps.tree.to_batch(normalize=steps.cfg.normalize, device=steps.dev) for _ in range(2)]


def one(i, prof=None, what=None):
    """One step on batches[i % 2], each phase between synchronizes: (host ms, total ms) of the forward and backward."""
    b = batches[i % 2]
    steps.zero()
    torch.cuda.synchronize()
    if prof is not None and what == "forward":
        prof.enable()
    t0 = time.perf_counter()
    out = tm(b)
    h_f = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_f = time.perf_counter() - t0
    if prof is not None and what == "forward":
        prof.disable()
    if prof is not None and what == "backward":
        prof.enable()
    t0 = time.perf_counter()
    out.loss.backward()
    h_b = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_b = time.perf_counter() - t0
    if prof is not None and what == "backward":
        prof.disable()
    tm.prepare(batches[(i + 1) % 2])
    torch.cuda.synchronize()
    return h_f * 1e3, t_f * 1e3, h_b * 1e3, t_b * 1e3


for i in range(4):
    one(i)
rows = [one(i) for i in range(12)]
med = [statistics.median(r[j] for r in rows) for j in range(4)]
print(f"forward: host {med[0]:.1f} ms, with its GPU work {med[1]:.1f} ms; backward: host {med[2]:.1f} ms, "
      f"with its GPU work {med[3]:.1f} ms (medians of 12, each phase between synchronizes)", flush=True)

for what in ("forward", "backward"):
    prof = cProfile.Profile()
    one(12, prof, what)
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats("varlen_tree_attention|fa4_replay|key_copies|_ops|custom_ops|library", 40)
    print(f"===== cProfile, {what}", flush=True)
    print(s.getvalue()[-16000:], flush=True)
