"""dW = dL.T @ h for the kept head (dL [N, V] bf16 row-major, h [N, D] bf16): time, peak memory over the inputs and
error against float64, for the ways to get a float32-accumulated dW rounded once to bf16."""
import json
import os
import time

import torch

res = []
for V, D, N in ((248320, 2048, 15360), (151936, 1024, 10240)):
    g = torch.Generator(device="cuda").manual_seed(0)
    dl = (torch.randn(N, V, device="cuda", generator=g) * 1e-3).bfloat16()
    h = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    want = None
    ways = {
        "mm_out_dtype(dl.t, h)": lambda: torch.mm(dl.t(), h, out_dtype=torch.float32).to(torch.bfloat16),
        "mm_out_dtype(h.t, dl).t": lambda: torch.mm(h.t(), dl, out_dtype=torch.float32).to(torch.bfloat16).t().contiguous(),
        "addmm_out_dtype(z, dl.t, h)": lambda: torch.addmm(torch.zeros(V, D, device="cuda"), dl.t(), h,
                                                         out_dtype=torch.float32).to(torch.bfloat16),
        "bf16 mm(dl.t, h)": lambda: dl.t() @ h,
        "bf16 mm(h.t, dl).t": lambda: (h.t() @ dl).t().contiguous(),
    }
    rows = torch.arange(0, V, 97, device="cuda")
    ref = (dl[:, rows].double().t() @ h.double())  # sampled rows of the float64 dW
    for name, fn in ways.items():
        fn(); torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ts = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter(); out = fn(); torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0); del out
        out = fn()
        err = float((out[rows].double() - ref).norm() / ref.norm())
        r = dict(V=V, D=D, N=N, way=name, ms=round(sorted(ts)[2] * 1e3, 2),
                 peak_over_inputs_gib=round((torch.cuda.max_memory_allocated() - base) / 2**30, 2), rel_err_vs_fp64=err,
                 strides=list(out.stride()))
        del out
        res.append(r); print(json.dumps(r), flush=True)
    del dl, h; torch.cuda.empty_cache()
print("allow_bf16_reduced_precision_reduction", torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
open(os.path.join(os.environ.get("OUT", "."), "dw.jsonl"), "w").write("\n".join(json.dumps(r) for r in res) + "\n")
