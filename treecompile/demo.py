"""The embedded example behind ``treecompile demo``: a small branching rollout, trained on as a tree."""

from __future__ import annotations

import torch
from tabulate import tabulate

from treecompile.tree import Tree

# Token ids of a toy agentic rollout: a prompt, a think turn, then three branches (two parallel tool
# calls, one of which retries; and a final answer that dropped the earlier reasoning).
EXAMPLE_PATHS = [
    [1, 11, 12, 13, 21, 22, 31, 32, 33],
    [1, 11, 12, 13, 21, 22, 41, 42],
    [1, 11, 12, 13, 21, 22, 41, 43, 44],
    [1, 11, 12, 13, 51, 52, 53],
]


def describe(tree: Tree) -> str:
    b = tree.to_batch()
    rows = [[t, int(b.input_ids[t]), int(b.position_ids[t]), int(b.pred_index[t]), int(b.subtree_end[t]),
             int(b.node_id[t]), f"{float(b.loss_weight[t]):.3f}"] for t in range(b.seq_len)]
    return tabulate(rows, headers=["dfs", "token", "position", "pred", "subtree_end", "node", "weight"],
                    tablefmt="github")


def run_demo(steps: int = 3) -> None:
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile import reference

    tree = Tree.from_paths(EXAMPLE_PATHS)
    print(f"{tree!r}\n")
    print(describe(tree), "\n")
    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny()).double()
    ref = reference.run(model, EXAMPLE_PATHS, normalize="sum")
    print(f"per-path reference loss: {ref.loss.item():.6f}")
