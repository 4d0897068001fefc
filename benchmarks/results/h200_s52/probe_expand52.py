# Session 52: the gathers and copy sums that K/V expanded to the query heads would need, with existing kernels
# (no FA4), on parallel-tools' segments plan; GPU ms per layer (both K and V), medians of 15 (probe_gqa52.py's timing;
# its copy of `timed` was folded into an import after the run)
import os
import sys

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_gqa52 import timed  # noqa: E402  (the same timing: events around each call, the host held back)
from benchmarks.trees import agentic_paths, agentic_specs  # noqa: E402
from treecompile import Tree  # noqa: E402
from treecompile.host_values import to_device_with_host  # noqa: E402
from treecompile.ops import varlen_tree_attention as vta  # noqa: E402
from treecompile.ops.key_copies import sum_copies  # noqa: E402

dev = torch.device("cuda")


se = Tree.from_paths(agentic_paths(list(agentic_specs(1.0, ["parallel-tools"]))[0])).to_batch().subtree_end
plan = vta.tree_attention_plan(to_device_with_host(se, dev), block_sparse=False)
T, G, HKV, H, D = se.numel(), plan.gathered, 8, 16, 128
idx = plan.key_index
k = torch.randn(T, HKV, D, device=dev, dtype=torch.bfloat16)
v = torch.randn_like(k)
k16, v16 = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
dk8, dv8 = torch.randn(G, HKV, D, device=dev, dtype=torch.bfloat16), torch.randn(G, HKV, D, device=dev,
                                                                                   dtype=torch.bfloat16)
dk16, dv16 = torch.randn(G, H, D, device=dev, dtype=torch.bfloat16), torch.randn(G, H, D, device=dev,
                                                                                   dtype=torch.bfloat16)
cases = {
    "gather [G,8,D] (today)": lambda: (k.index_select(0, idx), v.index_select(0, idx)),
    "gather [G,8,D], then expand-copy to [G,16,D]": lambda: tuple(
        x.index_select(0, idx)[:, :, None].expand(G, HKV, 2, D).reshape(G, H, D) for x in (k, v)),
    "gather [G,16,D] from contiguous [T,16,D] (a fused gather's bytes)": lambda: (k16.index_select(0, idx),
                                                                                  v16.index_select(0, idx)),
    "expand [T,8,D] -> [T,16,D] copy": lambda: tuple(x[:, :, None].expand(T, HKV, 2, D).reshape(T, H, D)
                                                     for x in (k, v)),
    "sum_copies [G,8,D] (today)": lambda: (sum_copies(dk8, plan.copies, idx, T), sum_copies(dv8, plan.copies, idx, T)),
    "sum_copies [G,16,D] + head-pair sum": lambda: tuple(
        sum_copies(x, plan.copies, idx, T).view(T, HKV, 2, D).sum(2) for x in (dk16, dv16)),
    "sum_copies [G,16,D] alone (a fused pair sum's bytes)": lambda: (sum_copies(dk16, plan.copies, idx, T),
                                                                     sum_copies(dv16, plan.copies, idx, T)),
}
print(torch.__version__, torch.cuda.get_device_name(), f"T {T} G {G}")
for name, fn in cases.items():
    fn()
    torch.cuda.synchronize()
    print(f"{name:70s} {timed(fn):.3f} ms", flush=True)
