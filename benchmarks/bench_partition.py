"""Partition planning: speed on a ~1M-token tree, and the packed heuristic's cost against exact DP.

1. Planning time (CPU) of ``pack`` (Tree Packing heuristic) and ``partition_redundancy_free`` on a
   synthetic tree of ~1M unique tokens (10k paths of 1000 tokens, POR ~0.9; the tree is built once,
   outside the timing), with tokens computed, ERR vs POR, and the activations one chain holds.
2. Heuristic vs exact DP on random small trees: cost gap = heuristic / optimum - 1, mean and worst,
   against the multi-path optimum (any grouping of leaves) and the single-path one (contiguous runs
   of the heuristic's leaf order).

Run: python benchmarks/bench_partition.py [--small-trees 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import torch
from tabulate import tabulate

from bench_tree import make_paths  # the same synthetic ~1M-token tree
from treecompile import Tree
from treecompile.runtime.optimal_partition import dp_multi_path, dp_single_path
from treecompile.runtime.metrics import dataset_reuse
from treecompile.runtime.partition import pack, partition_redundancy_free


@dataclass(frozen=True)
class BigConfig:
    num_paths: int = 10_000
    path_len: int = 1000
    new_per_path: int = 100
    budgets: tuple[int, ...] = (2048, 8192, 32768)
    repeats: int = 3


def best_time(fn, repeats: int):
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def bench_big(cfg: BigConfig) -> None:
    tree = Tree.from_paths(make_paths(cfg.num_paths, cfg.path_len, cfg.new_per_path))
    print(f"{tree!r}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    rows = []
    for C in cfg.budgets:
        t, plan = best_time(lambda: pack(tree, C), cfg.repeats)
        r = plan.reuse()
        rows.append(["packed", C, f"{t * 1e3:.0f}", len(plan), plan.cost, f"{r.por:.4f}", f"{r.err:.4f}",
                     max(p.num_tokens for p in plan.partitions)])
        t, rf = best_time(lambda: partition_redundancy_free(tree, C), cfg.repeats)
        r = rf.reuse()
        rows.append(["redundancy-free", C, f"{t * 1e3:.0f}", len(rf), rf.cost, f"{r.por:.4f}", f"{r.err:.4f}",
                     rf.peak_chain_tokens()])
    print(tabulate(rows, headers=["planner", "C", "plan ms (best of %d)" % cfg.repeats, "partitions",
                                  "tokens computed", "POR", "ERR", "peak alive tokens"], tablefmt="github"))
    print("peak alive tokens: packed = largest partition; redundancy-free = largest chain of partitions "
          f"(whole tree = {tree.num_tokens}, longest path = {int(tree.path_lengths.max())})")
    # batch building is separate from planning; time one partition's batch for reference
    C = cfg.budgets[0]
    plan, rf = pack(tree, C), partition_redundancy_free(tree, C)
    t1, _ = best_time(lambda: plan.batch(0), 1)
    t2, _ = best_time(lambda: rf.batch(len(rf) - 1), 1)
    print(f"one batch at C={C}: packed {t1 * 1e3:.0f} ms, redundancy-free {t2 * 1e3:.0f} ms")


def random_small_tree(rng: random.Random, max_paths: int = 8, max_len: int = 10, vocab: int = 3):
    paths: list[list[int]] = []
    for _ in range(rng.randint(2, max_paths)):
        if paths and rng.random() < 0.8:
            base = rng.choice(paths)
            keep = rng.randint(0, len(base))
            p = base[:keep] + [rng.randrange(vocab) for _ in range(rng.randint(1 if keep == 0 else 0, max_len))]
        else:
            p = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
        paths.append(p or [0])
    return paths


def bench_dp(n_trees: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    gaps_multi, gaps_single, rel = [], [], []
    worst = None
    n = 0
    t0 = time.perf_counter()
    while n < n_trees:
        tree = Tree.from_paths(random_small_tree(rng))
        longest = int(tree.path_lengths.max())
        C = rng.randint(longest, max(longest, tree.num_tokens))
        try:
            opt = dp_multi_path(tree, C, max_leaves=9)
        except ValueError:
            continue  # too many leaves for the exact DP
        single = dp_single_path(tree, C)
        plan = pack(tree, C)
        heur = plan.cost
        assert opt <= single <= heur
        g = heur / opt - 1
        gaps_multi.append(g)
        gaps_single.append(heur / single - 1)
        rel.append((plan.reuse(), tree))
        if worst is None or g > worst[0]:
            worst = (g, tree, C, heur, opt)
        n += 1
    elapsed = time.perf_counter() - t0
    rows = [["multi-path optimum", f"{100 * statistics.mean(gaps_multi):.2f}%", f"{100 * max(gaps_multi):.1f}%",
             f"{100 * sum(g == 0 for g in gaps_multi) / n:.0f}%"],
            ["single-path optimum (same leaf order)", f"{100 * statistics.mean(gaps_single):.2f}%",
             f"{100 * max(gaps_single):.1f}%", f"{100 * sum(g == 0 for g in gaps_single) / n:.0f}%"]]
    print(f"\n{n} random trees (2-8 paths, <= 10 tokens each, <= 9 leaves), C uniform in "
          f"[longest path, tree tokens]; {elapsed:.1f} s")
    print(tabulate(rows, headers=["heuristic cost vs", "mean gap", "worst gap", "optimal in"], tablefmt="github"))
    d = dataset_reuse(r for r, _ in rel)
    print(f"dataset: POR {d.por:.4f}, packed-heuristic ERR {d.err:.4f}")
    g, tree, C, heur, opt = worst
    print(f"worst case: {tree!r} C={C}: heuristic {heur} vs optimum {opt}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small-trees", type=int, default=300)
    ap.add_argument("--skip-big", action="store_true")
    args = ap.parse_args()
    if not args.skip_big:
        bench_big(BigConfig())
    bench_dp(args.small_trees)


if __name__ == "__main__":
    main()
