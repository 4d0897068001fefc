"""Session 40 probe: why the varlen attention plan of a fresh CUDA ``subtree_end`` takes 4.5-5 ms on the H200
host (probe_host.txt) when the same plan of a CPU tensor takes 1.1 ms on the repository's 2-core CPU.

Each line: a median of 9, the GPU idle, a 50 ms sleep before each call (the CPU threads asleep, as between
steps).  The trees: the agentic parallel-tools tree and the 16k synthetic POR 0.5 tree."""
import contextlib
import statistics
import time

import torch

from benchmarks import harness
from treecompile import Tree
from treecompile import host_values
from treecompile.host_values import remember_host
from treecompile.ops import last_batch
from treecompile.ops import varlen_tree_attention as V


def med(fn, n=9, sleep=0.05):
    ts = []
    for _ in range(n):
        time.sleep(sleep)
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return f"median {statistics.median(ts):.3f} ms (min {min(ts):.3f}, max {max(ts):.3f})"


print("threads", torch.get_num_threads(), torch.__config__.parallel_info().splitlines()[1:6])
print("set_num_threads 1 and back:", med(lambda: (torch.set_num_threads(1), torch.set_num_threads(16))))
small = torch.arange(4096)
print("pin_memory + H2D (4096 int64):", med(lambda: small.pin_memory().to("cuda", non_blocking=True)))
print("pin_memory only (4096 int64):", med(lambda: small.pin_memory()))
q = torch.empty(1, 16, 1, 128, device="cuda", dtype=torch.bfloat16)
for name, case in [("agentic", harness.agentic_cases(1.0, 151936, ["parallel-tools"])[0]),
                   ("16k", harness.synthetic_cases([0.5], 16, 2048, 151936)[0])]:
    tree = Tree.from_paths([list(p) for p in case.paths])
    se_host = tree.to_batch().subtree_end

    def cuda_plan():
        V._plan(remember_host(se_host.cuda(non_blocking=True), se_host), q)

    def cpu_plan():
        V._plan(se_host.clone(), q.cpu())
    print(f"{name}: plan, fresh CUDA subtree_end: {med(cuda_plan)}")
    print(f"{name}: plan, fresh CPU subtree_end (CPU tables): {med(cpu_plan)}")
    print(f"{name}: walk only, fresh CPU subtree_end: {med(lambda: V._walk(se_host.clone()))}")
    real = host_values.single_threaded
    last_batch.single_threaded = lambda rows=None: contextlib.nullcontext()
    print(f"{name}: plan, fresh CUDA subtree_end, no single_threaded: {med(cuda_plan)}")
    print(f"{name}: plan, fresh CPU subtree_end, no single_threaded: {med(cpu_plan)}")
    last_batch.single_threaded = real
    for _ in range(3):
        cuda_plan()
    time.sleep(0.05)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        cuda_plan()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
