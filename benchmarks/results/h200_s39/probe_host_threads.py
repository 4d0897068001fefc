"""Session 39 probe: is the agentic step's host plan slow on the device machine because of CPU threads?

Prints the cgroup CPU quota, the CPU count and torch's intra-op threads; times the attention plan of the agentic
parallel-tools tree (CUDA subtree_end, fresh tensor each time as in a step) and the 0.6B tree step, with torch's
default threads and with 1 thread."""
import os
import statistics
import sys
import time

import torch

from benchmarks import harness
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as V


def show(cmd):
    try:
        print(cmd, "->", open(cmd).read().strip())
    except OSError as e:
        print(cmd, "->", e)


show("/sys/fs/cgroup/cpu.max")
print("os.cpu_count", os.cpu_count(), "sched_getaffinity", len(os.sched_getaffinity(0)),
      "torch threads", torch.get_num_threads(), "OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS"))
print(torch.__config__.parallel_info())
case = harness.agentic_cases(1.0, 151936, ["parallel-tools"])[0]
tree = Tree.from_paths([list(p) for p in case.paths])
se = tree.to_batch(device="cuda").subtree_end


def time_plan(n=20):
    ts = []
    for _ in range(n):
        s = se.clone()
        torch.cuda.synchronize()
        t = time.perf_counter()
        V.tree_attention_plan(s, block_sparse=True)
        ts.append((time.perf_counter() - t) * 1e3)
    return f"median {statistics.median(ts):.2f} ms, max {max(ts):.2f} ms"


default = torch.get_num_threads()
for th in (default, 1, 4, default):
    torch.set_num_threads(th)
    print(f"plan, {th} threads: {time_plan()}", flush=True)

steps = harness.cuda_steps("qwen3-0.6b", agentic="parallel-tools", iters=10)
step = steps.tree_step()[0]
step()
torch.cuda.synchronize()
for th in (default, 1, 4, default, 1):
    torch.set_num_threads(th)
    ts, hs = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        hs.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    print(f"step, {th} threads: median {statistics.median(ts) * 1e3:.1f} ms (min {min(ts) * 1e3:.1f}, max "
          f"{max(ts) * 1e3:.1f}), host {statistics.median(hs) * 1e3:.1f} ms", flush=True)
sys.exit(0)
