"""The recurrence-over-the-tree kernels alone on CUDA against the float64 reference of tests/test_fla_tree_recurrence.py
(random trees of many segments at a model's width: programs wait on flags), and their time against the per-call
launches (session 34)."""
import random
import sys
import time

import torch

from tests.test_fla_tree_recurrence import random_segments, reference
from treecompile.ops.fla_tree_recurrence import tree_bwd_dhu, tree_fwd_h, tree_recurrence

dev = torch.device("cuda")
worst = 0.0
for seed, (S, L, H, HV, K, V) in enumerate([(40, 300, 16, 16, 128, 128), (200, 80, 8, 16, 128, 128),
                                             (7, 700, 2, 4, 256, 64), (120, 64, 16, 32, 128, 128)]):
    rng = random.Random(seed)
    starts, lengths, parents = random_segments(rng, S, L)
    R, BT = sum(lengths), 64
    tr = tree_recurrence(starts, lengths, parents, dev, chunk_size=BT)
    NT = int(tr.chunk_offsets[-1])
    gen = torch.Generator(device=dev).manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, device=dev, dtype=torch.float64) * 0.1
    q, k, w, u, do, dv = mk(1, R, H, K), mk(1, R, H, K), mk(1, R, HV, K), mk(1, R, HV, V), mk(1, R, HV, V), mk(1, R, HV, V)
    g = -torch.rand(1, R, HV, generator=gen, device=dev, dtype=torch.float64) * 0.1
    for s in range(S):
        for c in range(starts[s], starts[s] + lengths[s], BT):
            e = min(c + BT, starts[s] + lengths[s])
            g[:, c:e] = g[:, c:e].cumsum(1)
    h0 = mk(HV, K, V)
    f = lambda x: x.float()
    outs = []
    for rep in range(3):
        h, v_new = tree_fwd_h(f(k), f(w), f(u), f(g), f(h0), tr, NT, BT)
        dh, dh0, dv2 = tree_bwd_dhu(f(q), f(k), f(w), f(do), f(dv), f(g), 0.5, tr, NT, BT)
        outs.append([h, v_new, dh, dh0, dv2])
    same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))
    ref = reference(q, k, w, u, g, h0, do, dv, 0.5, starts, lengths, parents, BT)
    errs = {n: float((a.double() - r).abs().max() / r.abs().max()) for n, a, r in
            zip(["h", "v_new", "dh", "dh0", "dv2"], outs[0], ref)}
    worst = max(worst, *errs.values())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        tree_fwd_h(f(k), f(w), f(u), f(g), f(h0), tr, NT, BT)
    torch.cuda.synchronize()
    print(f"S={S} R={R} H={H} HV={HV} K={K} V={V}: deterministic {same}, rel err vs float64 "
          + " ".join(f"{n} {e:.1e}" for n, e in errs.items())
          + f", fwd {1e3 * (time.perf_counter() - t0) / 10:.2f} ms", flush=True)
print("worst", worst)
sys.exit(0 if worst < 1e-3 else 1)
