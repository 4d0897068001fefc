"""Session 38: which aten op of the kept head's backward allocates past ``head_backward_bytes``.

Runs ``treecompile::linear_logprobs_kept`` (keep="fit", 40 % of the rows kept, as
tests/test_logprobs_kept.py::test_fit_keeps_what_the_headroom_holds_on_cuda) under a dispatch mode that
records, per aten op, the bytes allocated before it, its transient peak above that and what it leaves
allocated. Prints the ops whose transient peak exceeds what they leave (temporaries) and the overall peak."""
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from treecompile.ops import logprobs_kept
from treecompile.ops.logprobs_kept import linear_logprobs_kept

MiB = 2 ** 20


class Probe(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        left = torch.cuda.memory_allocated() - before
        self.rows.append(dict(op=str(func), before=before / MiB, peak=peak / MiB, left=left / MiB,
                              shapes=[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return out


def main(N=4096, D=256, V=151936, bias=True):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(N, D, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_()
    W = (torch.randn(V, D, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_()
    b = (torch.randn(V, generator=g, device="cuda") * 0.5).bfloat16().requires_grad_() if bias else None
    t = torch.randint(0, V, (N,), generator=g, device="cuda")
    chunk = min(N, logprobs_kept._chunk(h, V))
    need = logprobs_kept.head_backward_bytes(N, V, D, torch.bfloat16, chunk_rows=chunk, bias=bias, triton=True,
                                             entropy=True)
    want = int(0.4 * N)
    headroom = need + want * V * 2
    logprobs_kept.headroom_bytes = lambda device: headroom
    logprobs_kept.FIT_MARGIN_FRACTION = 1 << 40
    fwd = logprobs_kept.linear_logprobs_kept._init_fn  # the Python bodies: the mode sees their aten ops
    bwd = logprobs_kept.linear_logprobs_kept_backward._init_fn
    Wd, bd = W.detach(), None if b is None else b.detach()
    for warm in (True, False):
        hh = h[:8].detach() if warm else h.detach()
        tt = t[:hh.shape[0]]
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        pf, pb = Probe(), Probe()
        with pf:
            lp, lse, ent, logits = fwd(hh, Wd, bd, tt, True, "all" if warm else "fit")
        ones = torch.ones_like(lp)
        with pb:
            grads = bwd(hh, Wd, bd, tt, lse, ent, logits, ones, ones, ones)
        del grads, logits, lp, lse, ent, ones
    print(json.dumps(dict(N=N, D=D, V=V, chunk=chunk, kept=logprobs_kept.last_fit, need_MiB=need / MiB,
                          headroom_MiB=headroom / MiB, kept_logits_MiB=want * V * 2 / MiB)))
    for name, probe in (("forward", pf), ("backward", pb)):
        print(f"--- {name} (MiB above the allocation before the forward)")
        for r in probe.rows:
            r["before"] -= base / MiB
            mark = " <-- temporary" if r["peak"] - max(r["left"], 0) > 1 else ""
            print(f"{r['op']:45s} before {r['before']:9.1f}  peak +{r['peak']:8.1f}  left +{r['left']:8.1f}  "
                  f"{r['shapes']}{mark}")
        print(f"{name}: max before+peak {max(r['before'] + r['peak'] for r in probe.rows):.1f} MiB "
              f"(headroom {headroom / MiB:.1f})")
    # the two GEMMs with a float32 result from bf16 operands, alone
    M = 1024
    dl = torch.randn(M, V, device="cuda").bfloat16()
    hc = torch.randn(M, D, device="cuda").bfloat16()
    gW = torch.zeros(V, D, device="cuda")
    for name, fn in (("mm(dl.t(), h, out_dtype=f32)", lambda: torch.mm(dl.t(), hc, out_dtype=torch.float32)),
                     ("addmm(gW, dl.t(), h, out_dtype=f32, out=gW)",
                      lambda: torch.addmm(gW, dl.t(), hc, out_dtype=torch.float32, out=gW)),
                     ("gW.addmm_(dl.t().float(), h.float())", None)):
        if fn is None:
            continue
        fn()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        r = fn()
        torch.cuda.synchronize()
        print(f"{name}: transient peak +{(torch.cuda.max_memory_allocated() - before) / MiB:.1f} MiB, "
              f"[V, D] float32 is {V * D * 4 / MiB:.1f} MiB")
        del r

if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
