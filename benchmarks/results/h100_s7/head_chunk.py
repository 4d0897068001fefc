# As run on the H100 against commit 7d81cc7 (its vocab_slice was backed out in 5228543; the "rows" mode is the
# backward on main, the budgets are the old and the new CUDA default).
"""Fused head fwd+bwd on CUDA bf16: backward over row chunks (old) vs vocabulary slices (new), at 2 logits budgets."""
import time, torch, json, os
import treecompile.ops.logprobs_triton as LT
from treecompile.ops.logprobs_triton import linear_logprobs_triton
real = LT.vocab_slice
N = 16384
res = []
for V, H in ((248320, 1024), (151936, 2048)):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(N, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    W = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    grads = {}
    for budget in (1 << 28, 1 << 30):
        for mode in ("rows", "vocab"):
            LT.vocab_slice = real if mode == "vocab" else (lambda *a: None)
            chunk = max(1, budget // (4 * V))
            def step(keep=False):
                lp, lse, ent = linear_logprobs_triton(h, W, None, t, chunk)
                lp.sum().backward()
                if keep:
                    grads[(budget, mode)] = (h.grad.float().clone(), W.grad.float().clone())
                h.grad = W.grad = None
            step(True); step(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter(); step(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
            r = dict(V=V, H=H, N=N, budget_mib=budget >> 20, chunk=chunk, mode=mode, ms=round(sorted(ts)[2] * 1e3, 2),
                     peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
            if mode == "vocab":
                a, b = grads[(budget, "rows")], grads[(budget, "vocab")]
                r["dh_rel"] = float((a[0] - b[0]).norm() / a[0].norm()); r["dW_rel"] = float((a[1] - b[1]).norm() / a[1].norm())
            res.append(r); print(json.dumps(r), flush=True)
    del h, W, grads; torch.cuda.empty_cache()
LT.vocab_slice = real
open(os.path.join(os.environ.get("OUT", "."), "head_chunk.jsonl"), "w").write("\n".join(json.dumps(r) for r in res) + "\n")
