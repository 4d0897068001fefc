# Session 50: where the varlen plan's host time goes for a CUDA batch (h200_s47/probe_plan.py's measurement, 64 x
# 2,048 POR 0.5, one intra-op thread): medians of 200 builds of the whole plan and of each named step, timed by
# wrapping it (a step's time includes the ones it calls); then the same for a CPU batch.  PYTHONPATH=. python ...
import statistics, sys, time
import torch
from benchmarks.trees import synthetic_paths
from treecompile import Tree
from treecompile.host_values import to_device_with_host
from treecompile.ops import varlen_tree_attention as vta

torch.set_num_threads(1)
acc = {}


def wrap(name):
    f = getattr(vta, name)

    def g(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        acc.setdefault(name, []).append(time.perf_counter() - t0)
        return r
    setattr(vta, name, g)


for n in ("_walk", "_runs", "_parent_cuts", "_check_nested", "_rows", "_segment_plan", "_key_index_changes",
          "copy_run_tables", "to_device_together", "_key_index_from"):
    wrap(n)
se = Tree.from_paths(synthetic_paths(int(sys.argv[1]) if len(sys.argv) > 1 else 64, 2048, 0.5, seed=0)).to_batch().subtree_end
for dev in ("cuda", "cpu"):
    ses = [to_device_with_host(se, dev) for _ in range(220)]
    torch.cuda.synchronize()
    ts = []
    for i, s in enumerate(ses):
        if i == 20:
            acc.clear()
        t0 = time.perf_counter()
        vta.tree_attention_plan(s, block_sparse=False)
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"{dev} batch T {se.numel()}: plan median {statistics.median(ts[20:]) * 1e3:.3f} ms")
    for k, v in acc.items():
        print(f"  {k:20s} {statistics.median(v) * 1e6:7.1f} us")
