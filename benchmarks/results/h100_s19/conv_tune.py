"""Session 19: the Triton conv backward alone (treecompile::tree_conv_shifts_backward), CUDA bf16, C = 6,144, K = 4,
over block configurations (module constants BLOCK_T / BLOCK_C / CHUNK_T), synthetic 16 x 2,048 POR 0.5 and the agentic
parallel-tools @1.5 tree; kernel time from CUDA events, median of 20."""
import itertools
import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from trees import agentic_paths, agentic_specs, synthetic_paths  # noqa: E402

from treecompile import Tree  # noqa: E402
from treecompile.ops import tree_conv_triton as TT  # noqa: E402

trees = {"syn16k": synthetic_paths(16, 2048, 0.5),
         "agentic": agentic_paths({s.name: s for s in agentic_specs(1.5)}["parallel-tools"]),
         "syn32k": synthetic_paths(32, 2048, 0.5)}
C, K = 6144, 4
rows = []
for name, paths in trees.items():
    ci = Tree.from_paths(paths).to_batch(conv_kernel=K).conv_index.cuda()
    T = ci.shape[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, T, C, device="cuda", generator=g).bfloat16()
    dy = torch.randn(1, T, C, device="cuda", generator=g).bfloat16()
    w = torch.randn(C, K, device="cuda", generator=g).bfloat16()
    b = torch.randn(C, device="cuda", generator=g).bfloat16()
    ref = None
    for bt, bc, ch in itertools.product((16, 32, 64), (64, 128, 256), (128, 256, 512)):
        if bt > ch:
            continue
        TT.BLOCK_T, TT.BLOCK_C, TT.CHUNK_T = bt, bc, ch
        out = TT.tree_conv_shifts_backward(dy, x, w, b, ci, True)
        if ref is None:
            ref = out
        diff = max(float((o.float() - r.float()).abs().max()) for o, r in zip(out, ref))
        ts = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            TT.tree_conv_shifts_backward(dy, x, w, b, ci, True)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1))
        rows.append({"tree": name, "T": T, "BLOCK_T": bt, "BLOCK_C": bc, "CHUNK_T": ch,
                     "ms": round(sorted(ts)[10], 4), "max_diff_vs_first": diff})
        print(json.dumps(rows[-1]), flush=True)
for name in trees:
    best = min((r for r in rows if r["tree"] == name), key=lambda r: r["ms"])
    print("best", json.dumps(best))
