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
    """Compile the tiny dense reference model, train on the example tree, check against the paths."""
    import treecompile
    from treecompile import reference
    from treecompile.models import DenseConfig, DenseForCausalLM

    tree = Tree.from_paths(EXAMPLE_PATHS)
    print(f"{tree!r}  (1/(1-POR) = {1 / (1 - tree.por):.2f}x fewer tokens than running each path)\n")
    print(describe(tree), "\n")
    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny()).double()
    tmodel = treecompile.compile(model)
    done = ", ".join(f"{name}: {r.count}" for name, r in tmodel.pass_results.items())
    print(f"compiled {type(model).__name__} (float64): passes {done}")
    batch = tree.to_batch(normalize="path_mean")
    params = list(model.parameters())
    out = tmodel(batch)
    ref = reference.run(model, EXAMPLE_PATHS, normalize="path_mean")
    g_tree = torch.cat([g.flatten() for g in torch.autograd.grad(out.loss, params)])
    g_ref = torch.cat([g.flatten() for g in torch.autograd.grad(ref.loss, params)])
    lp_err = max(float((a - b).abs().max()) for a, b in zip(batch.path_logprobs(out.logprobs.detach()),
                                                            [r.detach() for r in ref.logprobs]))
    print(f"tree loss {out.loss.item():.12f}  per-path loss {ref.loss.item():.12f}")
    print(f"max |logprob diff| {lp_err:.1e}   gradient rel. diff {float((g_tree - g_ref).norm() / g_ref.norm()):.1e}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        out = tmodel(batch)
        out.loss.backward()
        opt.step()
        print(f"step {step}: loss {out.loss.item():.6f}")
