"""Session 40 probe: where the host's time goes in warm 0.6B tree steps (agentic parallel-tools, and the 16k
synthetic POR 0.5 tree), and what single host pieces cost on the device's host.

1. cProfile of one warm step of each (after 5 timed ones; GPU synchronised around), by own time, with the
   callees of custom ops' ``backend_impl`` (session 39's profile gave it 50 ms of own time in 60 calls).
2. Pieces, each timed alone with the GPU idle and the CPU threads asleep (50 ms sleep before each), median of 9:
   ``model.zero_grad(set_to_none=True)`` after a backward, ``torch.cuda.mem_get_info``, the attention plan on a
   fresh CUDA ``subtree_end`` (with remembered host values, as a moved batch has them)."""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from benchmarks import harness


def med(fn, n=9, sleep=0.05):
    ts = []
    for _ in range(n):
        time.sleep(sleep)
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return f"median {statistics.median(ts):.3f} ms (min {min(ts):.3f}, max {max(ts):.3f})"


def profile(name, steps):
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
    print(f"== {name}: step median {statistics.median(ts) * 1e3:.1f} ms, host {statistics.median(hs) * 1e3:.1f} ms",
          flush=True)
    prof = cProfile.Profile()
    prof.enable()
    step()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("tottime").print_stats(40)
    st.print_callees("backend_impl")
    print(s.getvalue()[-14000:], flush=True)
    return step


which = sys.argv[1:] or ["agentic", "16k"]
for w in which:
    steps = harness.cuda_steps("qwen3-0.6b", agentic="parallel-tools" if w == "agentic" else None, iters=5)
    step = profile(w, steps)
    model = steps.model

    def zero_after_backward():
        step()  # leaves the grads set
        torch.cuda.synchronize()
        time.sleep(0.05)
        t = time.perf_counter()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t) * 1e3
    zs = [zero_after_backward() for _ in range(5)]
    print(f"{w}: zero_grad after a step: median {statistics.median(zs):.3f} ms {[round(z, 3) for z in zs]}")
    print(f"{w}: mem_get_info: {med(lambda: torch.cuda.mem_get_info())}")
    from treecompile.host_values import remember_host
    from treecompile.ops import varlen_tree_attention as V
    batch = steps.tree.to_batch(device="cuda")
    se_host = batch.subtree_end.cpu()

    def plan():
        se = remember_host(se_host.cuda(non_blocking=True), se_host)
        V._plan(se, torch.empty(1, 16, 1, 128, device="cuda", dtype=torch.bfloat16))
    print(f"{w}: attention plan, fresh CUDA subtree_end: {med(plan)}")
    del steps, step, model
    torch.cuda.empty_cache()
