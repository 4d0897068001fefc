"""Train the tiny dense reference model on trajectory trees from a JSONL file (CPU, SFT).

    python examples/train_sft.py --data /tmp/trees.jsonl --make-data      # write synthetic data, train
    python examples/train_sft.py --data rollouts.jsonl --steps 20 --budget 256 --normalize token_mean

The file has one trajectory per line (schema: ``treecompile.runtime.data``): ``{"tree_id": ...,
"input_ids": [...], "loss_mask": [...]}``; lines with the same ``tree_id`` form one tree.
``--make-data`` writes a synthetic file first: each tree is a random prompt (untrained) with
several branches that continue it by a fixed rule the model can learn (``next = 3 * prev + 1 mod
vocab``), branching at random depths.  Every step trains on ``--trees-per-step`` trees
(``treecompile.runtime.train.train_step``: one loss over all their paths, packed partitions of
``--budget`` tokens when given) and prints the loss; it goes down.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

import treecompile
from treecompile.models import DenseConfig, DenseForCausalLM
from treecompile.runtime.data import read_trajectories
from treecompile.runtime.train import train_step


def make_data(path: str, *, num_trees: int, vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for t in range(num_trees):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(4, 10))]
            trunk = [(3 * prompt[-1] + 1) % vocab]
            for _ in range(rng.randint(2, 8)):
                trunk.append((3 * trunk[-1] + 1) % vocab)
            for b in range(rng.randint(2, 5)):
                cut = rng.randint(1, len(trunk))  # branch after a shared part of the response
                resp = trunk[:cut] + [rng.randrange(1, vocab)]  # a sampled token, then the rule again
                for _ in range(rng.randint(2, 8)):
                    resp.append((3 * resp[-1] + 1) % vocab)
                ids = prompt + resp
                mask = [0] * len(prompt) + [1] * len(resp)
                f.write(json.dumps({"tree_id": t, "input_ids": ids, "loss_mask": mask}) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="trajectory JSONL file")
    ap.add_argument("--make-data", action="store_true", help="write a synthetic file to --data first")
    ap.add_argument("--num-trees", type=int, default=16, help="trees written by --make-data")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--trees-per-step", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--budget", type=int, default=None, help="tokens per packed partition (default: whole trees)")
    ap.add_argument("--normalize", default="token_mean", choices=treecompile.NORMALIZATIONS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--progress", action="store_true", help="progress bar on stderr")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    config = DenseConfig.tiny()
    if args.make_data:
        make_data(args.data, num_trees=args.num_trees, vocab=config.vocab_size, seed=args.seed)
    trees = list(read_trajectories(args.data, vocab_size=config.vocab_size))
    model = DenseForCausalLM(config)
    tmodel = treecompile.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(f"{len(trees)} trees, {sum(t.tree.num_paths for t in trees)} paths, "
          f"{sum(t.tree.num_tokens for t in trees)} unique / {sum(t.tree.num_path_tokens for t in trees)} path tokens")
    k = args.trees_per_step
    losses = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = [trees[(step * k + j) % len(trees)] for j in range(min(k, len(trees)))]
        res = train_step(tmodel, batch, None, opt, budget=args.budget, normalize=args.normalize,
                         progress=args.progress)
        m = res.metrics
        losses.append(res.loss)
        print(f"step {step} loss {res.loss:.4f} partitions {m['partitions']} tokens {m['tokens_computed']} "
              f"ERR {m['err']:.3f} POR {m['por']:.3f} {1000 * m['seconds']:.0f} ms")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps, {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
