"""Session 56, from ../h200_s55/probe_rf55.py: where a redundancy-free step's time goes, eager or compiled graphs
(argv 3), boundary attention through FA4's varlen op ("auto") or flex's Triton kernel ("flex"), Qwen3-0.6B shape,
16 x 2,048 POR 0.5, C = 4,096 (11 partitions, chain bound), bf16, one H200: the first step timed, one more, the
median of 3 steps, then one profiled step (kernels by CUDA time, host ops by self CPU time) and, with
``--cprofile``, one step under cProfile.
Usage: python benchmarks/results/h200_s56/probe_rf56.py [auto,flex] [C] [compiled|eager] [--cprofile]"""

import statistics
import sys
import time

import torch

import treecompile
from benchmarks.harness import model_specs
from benchmarks.trees import synthetic_paths
from treecompile import Tree
from treecompile.runtime.partition import partition_redundancy_free
from treecompile.runtime.redundancy_free import run_redundancy_free

sys.argv, cprof = [a for a in sys.argv if a != "--cprofile"], "--cprofile" in sys.argv
kernels = (sys.argv[1] if len(sys.argv) > 1 else "auto,flex").split(",")
dev = torch.device("cuda")
spec = model_specs()["qwen3-0.6b"]
model = spec.build(dev, torch.bfloat16)
tree = Tree.from_paths(synthetic_paths(16, 2048, 0.5, vocab=spec.config.vocab_size))
C = int(sys.argv[2]) if len(sys.argv) > 2 else tree.num_tokens // 4
plan = partition_redundancy_free(tree, C)
for kernel in kernels:
    compiled = len(sys.argv) > 3 and sys.argv[3] == "compiled"
    bm = treecompile.compile(model, boundary=True, compile_cuda=compiled, attention_kernel=kernel)

    def step():
        model.zero_grad(set_to_none=True)
        run_redundancy_free(bm, plan)
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    step()
    print(f"first step {time.perf_counter() - t0:.1f} s", flush=True)
    step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
    ka = prof.key_averages()
    cuda_total = sum(e.self_device_time_total for e in ka) / 1e3
    print(f"== {kernel}: C {C}, {len(plan)} partitions, step median {statistics.median(times):.4f} s "
          f"({', '.join(f'{t:.4f}' for t in times)}), kernels {cuda_total:.1f} ms", flush=True)
    print(ka.table(sort_by="self_device_time_total", row_limit=14, max_name_column_width=60), flush=True)
    print(ka.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60), flush=True)
    if cprof:  # one more step under cProfile: the host's Python functions
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        step()
        pr.disable()
        st = pstats.Stats(pr)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumtime").print_stats(60)
