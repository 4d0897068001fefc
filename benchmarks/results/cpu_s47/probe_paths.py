# Session 47: Tree.from_paths' time for the same paths given as lists, int64 tensors and NumPy int32 arrays
# (4,096 x 2,048 tokens at POR 0.5, and 20,000 paths of 64 tokens), min of 3, one thread.  Run from a checkout's
# root: PYTHONPATH=. python benchmarks/results/cpu_s47/probe_paths.py
import random, time
import numpy as np
import torch
from benchmarks.trees import synthetic_paths
from treecompile import Tree

torch.set_num_threads(1)
rng = random.Random(0)
cases = {"4096 x 2048 POR 0.5": synthetic_paths(4096, 2048, 0.5, seed=0),
         "20000 x 64": [[rng.randrange(50) for _ in range(64)] for _ in range(20000)]}
for name, paths in cases.items():
    kinds = {"lists": [list(map(int, p)) for p in paths],
             "int64 tensors": [torch.tensor(p, dtype=torch.int64) for p in paths],
             "numpy int32": [np.array(p, dtype=np.int32) for p in paths]}
    for kind, ps in kinds.items():
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            Tree.from_paths(ps)
            ts.append(time.perf_counter() - t0)
        print(f"{name:20s} {kind:14s} {min(ts):.3f} s", flush=True)
