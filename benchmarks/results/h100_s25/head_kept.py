"""The fused head's fwd+bwd on CUDA bf16: chunked (treecompile::linear_logprobs_triton at its default chunk and at
larger ones: the backward recomputes each chunk's logits and reads/writes the float32 dW once per chunk) against
kept (treecompile::linear_logprobs_kept: one logits GEMM, the backward's dh and dW GEMMs over all rows).
Shapes: the MoE agentic bucket (V 248,320 x D 2,048, 15,360 rows), Qwen3-0.6B's head on the parallel-tools
bucket and at 16k, Qwen3-4B's at 16k.  Also the GEMM-only floor (3 bf16 GEMMs of the same shapes)."""
import json
import os
import time

import torch

from treecompile.ops.logprobs_kept import linear_logprobs_kept
from treecompile.ops.logprobs_triton import linear_logprobs_triton

res = []


def timed(step, n=5):
    step(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ts = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); step(); torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3, (torch.cuda.max_memory_allocated() - base) / 2**30


for V, D, N in ((248320, 2048, 15360), (151936, 1024, 10240), (151936, 1024, 16384), (151936, 2560, 16384)):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(N, D, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    W = (torch.randn(V, D, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    ref = None
    for name, chunk in (("chunked", 0), ("chunked", 4096), ("kept", None), ("gemms", None)):
        def step():
            h.grad = W.grad = None
            if name == "gemms":
                with torch.no_grad():
                    x = h @ W.t()
                    h.grad = x @ W
                    W.grad = x.t() @ h
                return
            lp = (linear_logprobs_triton(h, W, None, t, chunk) if name == "chunked"
                  else linear_logprobs_kept(h, W, None, t))[0]
            lp.sum().backward()
        ms, peak = timed(step)
        r = dict(V=V, D=D, N=N, head=name, chunk=chunk, ms=round(ms, 2), peak_over_start_gib=round(peak, 2))
        if name != "gemms":
            gW, gh = W.grad.float(), h.grad.float()
            if ref is None:
                ref = (gW, gh)
            else:
                r["dW_rel_vs_default_chunked"] = float((gW - ref[0]).norm() / ref[0].norm())
                r["dh_rel_vs_default_chunked"] = float((gh - ref[1]).norm() / ref[1].norm())
        res.append(r); print(json.dumps(r), flush=True)
    del h, W, ref; h = W = None; torch.cuda.empty_cache()
open(os.path.join(os.environ.get("OUT", "."), "head_kept.jsonl"), "w").write("\n".join(json.dumps(r) for r in res) + "\n")
