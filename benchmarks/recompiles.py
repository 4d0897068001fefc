"""Recompiles over a stream of differently sized trees with length buckets (dynamo, CPU).

TreeModel on CUDA compiles its rewritten graph with static shapes and pads every batch to a length
bucket (``program.bucket_length``), so a stream of tree sizes should compile at most once per bucket.
This measures that mechanism where it lives, in dynamo: the same rewritten graph (CPU attention op
instead of flex) under ``torch.compile(dynamic=False, backend="eager")``, 200 random trees, counting
frame compiles against the number of distinct buckets.  Usage: python benchmarks/recompiles.py
"""

from __future__ import annotations

import random

import torch
import torch._dynamo

import treecompile
from treecompile import Tree
from treecompile.program import bucket_length
from treecompile.models import DenseConfig, DenseForCausalLM


def main(num_trees: int = 200, seed: int = 0, *, tmodel=None) -> dict:
    """``tmodel``: a ``treecompile.compile`` of the tiny float32 dense model to use (default: compile one)."""
    rnd = random.Random(seed)
    tm = treecompile.compile(DenseForCausalLM(DenseConfig.tiny())) if tmodel is None else tmodel
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = 256
    compiles = 0

    def counting_backend(gm, example_inputs):
        nonlocal compiles
        compiles += 1
        return gm.forward

    fn = torch.compile(tm.graph_module, dynamic=False, backend=counting_backend)
    buckets, sizes = set(), []
    for _ in range(num_trees):
        n_paths = rnd.randrange(2, 9)
        paths = [[rnd.randrange(97) for _ in range(rnd.randrange(50, 400))]]
        for _ in range(n_paths - 1):
            base = paths[rnd.randrange(len(paths))]
            paths.append(base[:rnd.randrange(1, len(base))] + [rnd.randrange(97) for _ in range(rnd.randrange(1, 500))])
        batch = Tree.from_paths(paths).to_batch()
        sizes.append(batch.seq_len)
        L = bucket_length(batch.seq_len)
        buckets.add(L)
        with torch.no_grad():
            fn(*tm.program.inputs(batch.padded(L)))
    res = {"trees": num_trees, "sizes": (min(sizes), max(sizes)), "distinct_sizes": len(set(sizes)),
           "buckets": len(buckets), "compiles": compiles}
    print(res)
    return res


if __name__ == "__main__":
    main()
