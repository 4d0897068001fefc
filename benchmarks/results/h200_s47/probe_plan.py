# Session 47: the varlen segment plan's host time on the GPU's host, for CUDA batches: tree_attention_plan on a
# subtree_end moved with its host values remembered (TreeBatch.to's way: no device read), one intra-op thread (as
# the ops' host plans run), P x 2,048-token paths at POR 0.5 (heavy-first trees), median of 200 builds after 10,
# each on a fresh tensor (no cached walk).  With an argument MODULE, that module's tree_attention_plan too (the code
# before the change, loaded as treecompile.ops.MODULE), alternating: PYTHONPATH=. python probe_plan.py [MODULE]
import importlib, sys, time, torch
from benchmarks.trees import synthetic_paths
from treecompile import Tree
from treecompile.host_values import to_device_with_host
from treecompile.ops import varlen_tree_attention as new

torch.set_num_threads(1)
import os
DEV = os.environ.get("DEV", "cuda")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
mods = [("new", new)] + ([("old", importlib.import_module("treecompile.ops." + sys.argv[1]))] if len(sys.argv) > 1 else [])
for rnd in range(2):
    for P in (16, 32, 64):
        se = Tree.from_paths(synthetic_paths(P, 2048, 0.5, seed=0)).to_batch().subtree_end
        for name, mod in mods[::(1 if rnd == 0 else -1)]:
            ses = [to_device_with_host(se, DEV) for _ in range(210)]
            sync()
            ts = []
            for s in ses:
                t0 = time.perf_counter()
                mod.tree_attention_plan(s, block_sparse=False)
                ts.append(time.perf_counter() - t0)
            sync()
            ts = sorted(ts[10:])
            print(f"round {rnd} {name} T {se.numel():6d}  plan ms median {ts[len(ts) // 2] * 1e3:.3f}  min {ts[0] * 1e3:.3f}",
                  flush=True)
