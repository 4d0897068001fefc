"""Time Tree.from_paths + to_batch on a large synthetic tree (CPU).

Default: 10k paths of 1000 tokens (10M path tokens) holding ~1M unique tokens (POR ~0.9), given as
Python lists of ints, which is how rollouts usually arrive.  Run: python benchmarks/bench_tree.py
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from treecompile import Tree


def make_paths(num_paths: int, path_len: int, new_per_path: int, vocab: int = 150_000, seed: int = 0):
    """Each path copies a prefix of an earlier path and appends fresh tokens (~new_per_path)."""
    rng = random.Random(seed)
    paths = [[rng.randrange(vocab) for _ in range(path_len)]]
    for _ in range(num_paths - 1):
        base = paths[rng.randrange(len(paths))]
        new = max(1, min(path_len, int(rng.expovariate(1.0 / new_per_path))))
        keep = path_len - new
        paths.append(base[:keep] + [rng.randrange(vocab) for _ in range(new)])
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--paths", type=int, default=10_000)
    ap.add_argument("--path-len", type=int, default=1000)
    ap.add_argument("--new-per-path", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    paths = make_paths(args.paths, args.path_len, args.new_per_path)
    # copy the lists so that no int objects are shared between paths (as after JSON decoding)
    paths = [[int(str(x)) for x in p] for p in paths]
    best = float("inf")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        tree = Tree.from_paths(paths)
        batch = tree.to_batch(normalize="sum")
        best = min(best, time.perf_counter() - t0)
    print(f"{tree!r}\nbatch T={batch.seq_len}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"from_paths + to_batch: best of {args.repeats}: {best * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
