# Session 53: the host cost of the expanded K/V gather.  This session's first loop (loop53_pt.txt) had
# tree_kv_expanded's kernels 5.5 ms under the grouped tree's but its profiled forward's host time 16 ms over it
# (tree_attention_varlen_fwd's self time 0.38 -> 0.65 ms a call) and the GPU idle 8 ms in its forward.  Here, per
# call: host microseconds (200 calls enqueued, no synchronize) and GPU ms (CUDA events) of each way to gather K/V
# [G, 16, D] from [T, 8, D]:
#   triton:   key_copies.gather_keys (the Triton kernel, launched through triton's JIT)
#   flat64 / flat32: one index_select of the [T * 8, D] rows by a precomputed [G * 16] index (int64 / int32)
#   grouped:  index_select [G, 8, D] (the grouped form's gather, for scale)
# and of sum_copies (rep 1 and 2), then a cProfile of the Triton launches.  Pure torch + triton (no FA4).  GPU ms:
# probe_gqa52.py's timing (its copy here was folded into an import after the run).
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "h200_s52"))
from probe_gqa52 import timed as gpu_ms  # noqa: E402  (events around each call, the host held back; medians of 15)
from benchmarks.trees import agentic_paths, agentic_specs  # noqa: E402
from treecompile import Tree  # noqa: E402
from treecompile.host_values import to_device_with_host  # noqa: E402
from treecompile.ops import varlen_tree_attention as vta  # noqa: E402
from treecompile.ops.key_copies import gather_keys, sum_copies  # noqa: E402

dev = torch.device("cuda")
H, HKV, D = 16, 8, 128
N = 200


def host_us(fn):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(3):
        torch.cuda._sleep(50_000_000)  # the GPU busy: launches only enqueue
        t0 = time.perf_counter()
        for _ in range(N):
            fn()
        out.append((time.perf_counter() - t0) / N * 1e6)
        torch.cuda.synchronize()
    return min(out)


def main():
    print(torch.__version__, torch.cuda.get_device_name())
    spec = list(agentic_specs(1.0, ["parallel-tools"]))[0]
    se = Tree.from_paths(agentic_paths(spec)).to_batch().subtree_end
    T = se.numel()
    plan = vta.tree_attention_plan(to_device_with_host(se, dev), block_sparse=False)
    G, idx, rep = plan.gathered, plan.key_index, H // HKV
    k = torch.randn(T, HKV, D, device=dev, dtype=torch.bfloat16)
    flat64 = (idx[:, None] * HKV + torch.arange(HKV, device=dev).repeat_interleave(rep)[None]).reshape(-1)
    flat32 = flat64.to(torch.int32)
    ref = gather_keys(k, idx, rep)
    for name, fn in [("triton", lambda: gather_keys(k, idx, rep)),
                     ("flat64", lambda: k.view(T * HKV, D).index_select(0, flat64).view(G, H, D)),
                     ("flat32", lambda: k.view(T * HKV, D).index_select(0, flat32).view(G, H, D)),
                     ("grouped", lambda: k.index_select(0, idx))]:
        same = name == "grouped" or torch.equal(fn(), ref)
        print(f"gather {name:8s} T {T} G {G}: host {host_us(fn):6.1f} us  GPU {gpu_ms(fn):.4f} ms  equal {same}")
    dk1 = torch.randn(G, HKV, D, device=dev, dtype=torch.bfloat16)
    dk2 = torch.randn(G, H, D, device=dev, dtype=torch.bfloat16)
    for name, fn in [("rep1", lambda: sum_copies(dk1, plan.copies, idx, T)),
                     ("rep2", lambda: sum_copies(dk2, plan.copies, idx, T, rep=rep))]:
        print(f"sum_copies {name}: host {host_us(fn):6.1f} us  GPU {gpu_ms(fn):.4f} ms")
    torch.cuda._sleep(200_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(N):
        gather_keys(k, idx, rep)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
