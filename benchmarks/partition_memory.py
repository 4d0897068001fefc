"""Peak GPU memory of one training step (fwd+bwd): whole tree vs packed vs redundancy-free partitions.

Qwen3-0.6B-shaped random model, bf16, a synthetic branching tree.  All three modes run the rewritten
graph *eagerly* (no inductor), so their peaks compare like with like, all with the separately compiled
FlexAttention kernel (redundancy-free partitions: over [boundary ; local] keys,
ops/flex_tree_attention_boundary.py; before issue 16 they ran the dense-mask reference).
Usage: python benchmarks/partition_memory.py
"""

from __future__ import annotations

import json
import time

import torch

import treecompile
from treecompile import Tree
from treecompile.models import DenseConfig, DenseForCausalLM
from treecompile.runtime.partition import pack, partition_redundancy_free
from treecompile.runtime.redundancy_free import run_redundancy_free

from gpu_checks import branching_paths, init_


def measure(name, fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        extra = fn() or {}
        torch.cuda.synchronize()
        row = {"mode": name, "peak_GiB_above_weights+grads": (torch.cuda.max_memory_allocated() - base) / 2**30,
               "seconds_incl_compile": time.perf_counter() - t0, **extra}
    except torch.OutOfMemoryError as e:
        row = {"mode": name, "error": f"OOM: {str(e).splitlines()[0]}"}
    print(json.dumps(row), flush=True)
    return row


def main():
    torch.manual_seed(0)
    cfg = DenseConfig.qwen3_0_6b()
    paths = branching_paths(8, prompt=3000, seg=1500, vocab=cfg.vocab_size)
    tree = Tree.from_paths(paths)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tree_tokens": tree.num_tokens,
                      "path_tokens": tree.num_path_tokens, "por": tree.por,
                      "longest_path": int(tree.path_lengths.max())}), flush=True)
    model = init_(DenseForCausalLM(cfg)).to("cuda", torch.bfloat16)
    for p in model.parameters():  # gradients allocated up front so that peaks exclude them
        p.grad = torch.zeros_like(p)
    tm = treecompile.compile(model, compile_cuda=False, bucket=False)
    bm = treecompile.compile(model, boundary=True, compile_cuda=False, bucket=False)

    def whole():
        tm(tree.to_batch()).loss.backward()

    def packed(C):
        plan = pack(tree, C)
        for i in range(len(plan)):
            tm(plan.batch(i)).loss.backward()
        return {"partitions": len(plan), "tokens_computed": plan.reuse().computed_tokens}

    def rf(C):
        plan = partition_redundancy_free(tree, C)
        res = run_redundancy_free(bm, plan)
        return {"partitions": res.num_partitions, "tokens_computed": res.tokens_computed,
                "peak_alive_tokens": res.peak_alive_tokens}

    measure("whole tree", whole)
    C = int(tree.path_lengths.max())
    measure(f"packed C={C}", lambda: packed(C))
    for c in (C, 2048):
        measure(f"redundancy-free C={c}", lambda c=c: rf(c))


if __name__ == "__main__":
    main()
