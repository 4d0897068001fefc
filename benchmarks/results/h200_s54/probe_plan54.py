# Session 54: the varlen segment plan's host time for a batch on DEV (cuda by default; its subtree_end moved with
# its host values remembered, TreeBatch.to's way: no device read), one intra-op thread, median and min of 200 builds
# after 10, each on a fresh tensor (no cached walk): this checkout's module against MODULE's (the code before the
# change, loaded as treecompile.ops.MODULE), alternating, in two rounds; then this checkout's plan at 64k split into
# its stages, and the tensor ops of one build of each (torch.profiler, CPU activity).  (Its timing loop, a copy of
# ../h200_s50/probe_agentic.py's, was folded into an import of it after the runs.)
#   PYTHONPATH=. python probe_plan54.py MODULE
import importlib, os, statistics, sys, time

import torch

from benchmarks.trees import agentic_paths, agentic_specs, synthetic_paths
from treecompile import Tree
from treecompile.host_values import to_device_with_host
from treecompile.ops import key_copies as kc
from treecompile.ops import varlen_tree_attention as new

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "h200_s50"))
from probe_agentic import plan_ms  # noqa: E402  (200 builds after 10 on fresh moved copies: median, min ms)

torch.set_num_threads(1)
DEV = os.environ.get("DEV", "cuda")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
old = importlib.import_module("treecompile.ops." + sys.argv[1])
for m in (new, old):
    m.VERIFY_PLANS = False  # the run-time default
trees = [(f"{P} x 2048 POR 0.5", Tree.from_paths(synthetic_paths(P, 2048, 0.5, seed=0)).to_batch().subtree_end)
         for P in (16, 32, 64)]
trees += [(s.name, Tree.from_paths(agentic_paths(s)).to_batch().subtree_end)
          for s in agentic_specs(1.0, ["parallel-tools", "deep-agent"])]
se56 = Tree.from_paths(synthetic_paths(56, 2048, 0.5, seed=0)).to_batch().subtree_end
trees += [("56 x 2048 + 8k pad", torch.cat([se56, torch.arange(se56.numel() + 1, 65537)]))]

print(f"device {DEV}; old = {sys.argv[1]}")
for rnd in range(2):
    for name, se in trees:
        row = f"round {rnd}  {name:20s} T {se.numel():6d}"
        for tag, mod in (("new", new), ("old", old))[::1 if rnd == 0 else -1]:
            med, mn = plan_ms(mod, se, DEV)
            row += f"  {tag} median {med:.3f} min {mn:.3f} ms"
        print(row, flush=True)

# the stages of this checkout's plan at 64k (each timed alone, median of 200)
se = trees[2][1]


def stage_us(f, n=210):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[10:]) * 1e6


w = new._walk(se)
intervals = []
for j in range(w.n_main):
    run, i = [w.ends[j], w.starts[j]], j
    while w.parents[i] is not None:
        i, p = w.parents[i]
        run += (p, w.starts[i])
    intervals += run[::-1]
lo, hi, first = new._rows(intervals, w.gathered)
cu_q = [0, *w.ends]
cu_k = [0]
for j in range(w.n_main):
    cu_k.append(cu_k[-1] + w.prefix_len[j] + w.ends[j] - w.starts[j])
at, by = new._key_index_changes(lo, first)
runs, offsets, _, _, n_tiles = kc.copy_run_lists(lo, hi, first)
tables = (at, by, cu_q, cu_k, runs, offsets)
moved = new.to_device_tables(tables, DEV, int32=(2, 3))
print(f"stages at 64k ({w.run_se.numel()} runs, {w.n_main} segments, {len(lo)} intervals, {n_tiles} tiles, "
      f"{len(offsets)} offsets), us:")
print(f"  runs {stage_us(lambda: new._runs(se)):.1f}  walk (runs included) {stage_us(lambda: new._walk(se)):.1f}  "
      f"rows {stage_us(lambda: new._rows(intervals, w.gathered)):.1f}  "
      f"copy runs {stage_us(lambda: kc.copy_run_lists(lo, hi, first)):.1f}  "
      f"tables to {DEV} {stage_us(lambda: new.to_device_tables(tables, DEV, (2, 3))):.1f}  "
      f"key index {stage_us(lambda: new._key_index_from(moved[0], moved[1], w.gathered)):.1f}")
sync()

from torch.profiler import ProfilerActivity, profile

for tag, mod in (("new", new), ("old", old)):
    s = to_device_with_host(se, DEV)
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        mod.tree_attention_plan(s, block_sparse=False)
    sync()
    ev = prof.key_averages()
    calls = sum(e.count for e in ev if e.key.startswith("aten::"))
    print(f"{tag}: {calls} aten calls in one 64k build; the most frequent:")
    for e in sorted(ev, key=lambda e: -e.count)[:8]:
        print(f"    {e.key:32s} x{e.count}")

# the walk alone (runs, bounds, segments, cuts) on trees of very short nodes, where it has the most runs: DFS
# trees of random 1-L-token nodes (whose segments would gather hundreds of times T: the block-sparse plan's trees)
import random


def short_node_tree(T, max_len, branch_p, seed):
    rng = random.Random(seed)
    se, t, stack = [0] * T, 0, []
    while t < T:
        n = min(rng.randint(1, max_len), T - t)
        stack += range(t, t + n)  # a node's tokens: each one's subtree open
        t += n
        if rng.random() > branch_p:  # close some of the open tokens' subtrees here
            while stack and rng.random() < 0.7:
                se[stack.pop()] = t
    for s in stack:
        se[s] = T
    return torch.tensor(se)


for T, L, p in ((65536, 4, 0.5), (65536, 32, 0.6), (16384, 2, 0.5)):
    se = short_node_tree(T, L, p, 0)
    w = new._walk(se)
    row = f"walk, {T} tokens of 1-{L}-token nodes ({w.run_se.numel()} runs, {w.n_main} segments):"
    for tag, mod in (("new", new), ("old", old), ("new", new), ("old", old)):
        ses = [to_device_with_host(se, DEV) for _ in range(30)]
        sync()
        ts = []
        for s in ses:
            t0 = time.perf_counter()
            mod._walk(s)
            ts.append(time.perf_counter() - t0)
        row += f"  {tag} {statistics.median(ts[5:]) * 1e3:.2f} ms"
    print(row, flush=True)
