"""Fused head fwd+bwd (treecompile::linear_logprobs_triton) on CUDA bf16 at several rows per chunk: the backward
reads and writes the float32 dW [V, D] once per chunk.  N = 15,360 rows (the agentic tree's bucket)."""
import json
import os
import time

import torch

from treecompile.ops.logprobs_triton import linear_logprobs_triton

N = 15360
res = []
for V, D in ((248320, 2048), (248320, 1024), (151936, 1024)):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(N, D, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    W = (torch.randn(V, D, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    ref = None
    for chunk in (max(1, (1 << 30) // (4 * V)), 2048, 4096, 7680):
        def step():
            lp, lse, ent = linear_logprobs_triton(h, W, None, t, chunk)
            lp.sum().backward()
        step(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ts = []
        for _ in range(5):
            h.grad = W.grad = None
            torch.cuda.synchronize(); t0 = time.perf_counter(); step(); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        gW = W.grad.float()
        ref = gW if ref is None else ref
        r = dict(V=V, D=D, N=N, chunk=chunk, chunks=-(-N // chunk), ms=round(sorted(ts)[2] * 1e3, 2),
                 peak_over_start_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2),
                 dW_rel_vs_first=float((gW - ref).norm() / ref.norm()))
        res.append(r); print(json.dumps(r), flush=True)
        h.grad = W.grad = None
    del h, W, ref; torch.cuda.empty_cache()
open(os.path.join(os.environ.get("OUT", "."), "head_chunk.jsonl"), "w").write("\n".join(json.dumps(r) for r in res) + "\n")
