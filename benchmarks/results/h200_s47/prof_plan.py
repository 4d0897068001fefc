# Session 47: where the varlen segment plan's host time goes for a CUDA batch (as probe_plan.py: 64 x 2,048 POR 0.5,
# one intra-op thread, fresh moved tensors): torch.profiler's CPU ops per build, and the plan's parts timed.
import time, torch
from benchmarks.trees import synthetic_paths
from treecompile import Tree
from treecompile.host_values import to_device_with_host
from treecompile.ops import varlen_tree_attention as vta

torch.set_num_threads(1)
se = Tree.from_paths(synthetic_paths(64, 2048, 0.5, seed=0)).to_batch().subtree_end
N = 50
ses = [to_device_with_host(se, "cuda") for _ in range(N + 10)]
for s in ses[:10]:
    vta.tree_attention_plan(s, block_sparse=False)
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
    for s in ses[10:]:
        vta.tree_attention_plan(s, block_sparse=False)
torch.cuda.synchronize()
rows = sorted(((e.self_cpu_time_total / N, e.count / N, e.key) for e in p.key_averages()), reverse=True)
print("self CPU us per build", round(sum(r[0] for r in rows), 1))
for r in rows[:30]:
    print(f"{r[0]:8.1f} us {r[1]:6.1f}x {r[2]}")
acc = {}
# the plan's parts at session 47 (copy_runs, to_device_async) and from session 48 on (copy_run_tables and
# to_device_together: its six tables in one copy); the parts the module does not have are skipped
for name in ("_walk", "_rows", "_check_plan", "_segment_plan", "copy_runs", "to_device_async", "copy_run_tables",
             "to_device_together"):
    if not hasattr(vta, name):
        continue
    f = getattr(vta, name)
    def wrap(f=f, name=name):
        def g(*a, **k):
            t0 = time.perf_counter(); r = f(*a, **k); acc.setdefault(name, []).append(time.perf_counter() - t0); return r
        return g
    setattr(vta, name, wrap())
ses = [to_device_with_host(se, "cuda") for _ in range(110)]
ts = []
for s in ses:
    t0 = time.perf_counter(); vta.tree_attention_plan(s, block_sparse=False); ts.append(time.perf_counter() - t0)
torch.cuda.synchronize()
med = lambda v: sorted(v[10:])[len(v[10:]) // 2] * 1e3
print("plan ms", round(med(ts), 3), {k: round(med(v), 3) for k, v in acc.items()})
