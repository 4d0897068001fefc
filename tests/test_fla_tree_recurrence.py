"""The tree GDN recurrence in one launch (ops/fla_tree_recurrence.py): its schedule on the host, and its two Triton
kernels under Triton's CPU interpreter against a float64 recurrence written here from the kernels' math (skipped
where triton does not import; ``benchmarks/fla_interpret_check.py`` checks the whole layer against fla's calls)."""

import random

import pytest
import torch

from tests.helpers import run_interpreted
from treecompile.ops.fla_tree_recurrence import tree_recurrence


def random_segments(rng: random.Random, n: int, max_len: int = 40):
    lengths = [rng.randint(1, max_len) for _ in range(n)]
    parents = [-1] + [rng.choice([-1, *range(s)]) if rng.random() < 0.15 else rng.randrange(s) for s in range(1, n)]
    starts = [sum(lengths[:s]) for s in range(n)]
    return starts, lengths, parents


@pytest.mark.parametrize("seed", range(20))
def test_schedule_orders_every_wait_after_what_it_waits_for(seed):
    rng = random.Random(seed)
    starts, lengths, parents = random_segments(rng, rng.randint(1, 30))
    tr = tree_recurrence(starts, lengths, parents, torch.device("cpu"), chunk_size=16)
    S = len(starts)
    fwd, bwd = tr.fwd_order.tolist(), tr.bwd_order.tolist()
    assert sorted(fwd) == sorted(bwd) == list(range(S))
    pos_f, pos_b = {s: i for i, s in enumerate(fwd)}, {s: i for i, s in enumerate(bwd)}
    children = [[c for c in range(S) if parents[c] == s] for s in range(S)]
    slot, parent_slot = tr.state_slot.tolist(), tr.parent_slot.tolist()
    ptr, idx = tr.child_ptr.tolist(), tr.child_idx.tolist()
    for s in range(S):
        if parents[s] >= 0:
            assert pos_f[parents[s]] < pos_f[s] and pos_b[s] < pos_b[parents[s]]
            assert parent_slot[s] == slot[parents[s]] >= 0
        else:
            assert parent_slot[s] == -1
        assert (slot[s] >= 0) == bool(children[s])
        assert idx[ptr[s]:ptr[s + 1]] == children[s]
    assert sorted(x for x in slot if x >= 0) == list(range(tr.states))
    assert tr.chunk_offsets.tolist() == [sum(-(-n // 16) for n in lengths[:s]) for s in range(S + 1)]
    assert [r for g in tr.root_groups for r in g.tolist()] == [s for s in range(S) if parents[s] < 0]


def test_schedule_refuses_what_it_cannot_run():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="end to end"):
        tree_recurrence([0, 5], [4, 3], [-1, 0], cpu, chunk_size=16)
    with pytest.raises(ValueError, match="segment 1: parent 1"):
        tree_recurrence([0, 4], [4, 3], [-1, 1], cpu, chunk_size=16)
    with pytest.raises(ValueError, match="segment 0: parent -1 .* length 0"):
        tree_recurrence([0, 0], [0, 3], [-1, 0], cpu, chunk_size=16)


_KERNELS_VS_FLOAT64 = r"""
import random, torch
from tests.helpers import count_launches
from tests.test_fla_tree_recurrence import random_segments, reference
from treecompile.ops import fla_tree_recurrence_triton as kernels
from treecompile.ops.fla_tree_recurrence import tree_bwd_dhu, tree_fwd_h, tree_recurrence

launched = [count_launches(kernels, "tree_fwd_h_kernel"), count_launches(kernels, "tree_bwd_dhu_kernel")]
errs = {}
for seed, (H, HV, K, V) in enumerate([(1, 2, 64, 32), (2, 2, 128, 64), (1, 1, 16, 16)]):
    rng = random.Random(seed)
    starts, lengths, parents = random_segments(rng, 9)
    R, BT = sum(lengths), 16
    tr = tree_recurrence(starts, lengths, parents, torch.device("cpu"), chunk_size=BT)
    NT = int(tr.chunk_offsets[-1])
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64) * 0.3
    q, k, w, u, do, dv = mk(1, R, H, K), mk(1, R, H, K), mk(1, R, HV, K), mk(1, R, HV, V), mk(1, R, HV, V), mk(1, R, HV, V)
    g = -torch.rand(1, R, HV, generator=gen, dtype=torch.float64)
    for s in range(len(lengths)):  # the chunk-local cumulative log2 decay, as the kernels read it
        for c in range(starts[s], starts[s] + lengths[s], BT):
            e = min(c + BT, starts[s] + lengths[s])
            g[:, c:e] = g[:, c:e].cumsum(1)
    h0 = mk(HV, K, V)
    f32 = lambda x: x.float()
    h, v_new = tree_fwd_h(f32(k), f32(w), f32(u), f32(g), f32(h0), tr, NT, BT)
    dh, dh0, dv2 = tree_bwd_dhu(f32(q), f32(k), f32(w), f32(do), f32(dv), f32(g), 0.7, tr, NT, BT)
    ref = reference(q, k, w, u, g, h0, do, dv, 0.7, starts, lengths, parents, BT)
    for name, got, want in zip(["h", "v_new", "dh", "dh0", "dv2"], [h, v_new, dh, dh0, dv2], ref):
        errs[f"{seed}:{name}"] = float((got.double() - want).abs().max() / want.abs().max())
errs["launches"] = float(len(launched[0]) + 10 * len(launched[1]))
print(errs)
"""


def reference(q, k, w, u, g, h0, do, dv, scale, starts, lengths, parents, BT):
    """fla's chunk recurrence (``chunk_gated_delta_rule_fwd_h`` / ``_bwd_dhu``) per segment, each segment starting
    from its parent's final state (roots: ``h0``) and its final state's gradient the sum of its children's
    initial-state gradients; in the inputs' dtype.  Returns ``(h, v_new, dh, dh0, dv2)``."""
    H, HV = k.shape[2], u.shape[2]
    S = len(lengths)
    chunks = [range(a, a + n, BT) for a, n in zip(starts, lengths)]
    first = [sum(len(c) for c in chunks[:s]) for s in range(S)]
    h = u.new_zeros(1, first[-1] + len(chunks[-1]), HV, k.shape[3], u.shape[3])
    dh, v_new, dv2 = torch.zeros_like(h), torch.zeros_like(u), torch.zeros_like(dv)
    final, dh0 = [None] * S, u.new_zeros(S, HV, k.shape[3], u.shape[3])
    kv = lambda x, t: x[0, t][:, torch.arange(HV) // (HV // H)]  # noqa: E731  (q/k heads of each v head)
    for s in range(S):
        state = h0.clone() if parents[s] < 0 else final[parents[s]].clone()
        end = starts[s] + lengths[s]
        for i, c in enumerate(chunks[s]):
            t = slice(c, min(c + BT, end))
            h[0, first[s] + i] = state
            vn = u[0, t] - torch.einsum("thk,hkv->thv", w[0, t], state)
            v_new[0, t] = vn
            gl = g[0, t][-1]
            vn = vn * torch.exp2(gl - g[0, t])[..., None]
            state = state * torch.exp2(gl)[:, None, None] + torch.einsum("thk,thv->hkv", kv(k, t), vn)
        final[s] = state
    for s in range(S - 1, -1, -1):
        d = u.new_zeros(HV, k.shape[3], u.shape[3])
        for c in range(S):
            if parents[c] == s:
                d = d + dh0[c]
        end = starts[s] + lengths[s]
        for i in range(len(chunks[s]) - 1, -1, -1):
            c = chunks[s][i]
            t = slice(c, min(c + BT, end))
            dh[0, first[s] + i] = d
            gl = g[0, t][-1]
            dvt = torch.einsum("thk,hkv->thv", kv(k, t), d) * torch.exp2(gl - g[0, t])[..., None] + dv[0, t]
            dv2[0, t] = dvt
            qg = kv(q, t) * torch.exp2(g[0, t])[..., None]
            d = (d * torch.exp2(gl)[:, None, None] + torch.einsum("thk,thv->hkv", qg, do[0, t]) * scale
                 - torch.einsum("thk,thv->hkv", w[0, t], dvt))
        dh0[s] = d
    return h, v_new, dh, dh0, dv2


def test_kernels_in_interpreter_equal_the_float64_recurrence():
    pytest.importorskip("triton")
    errs = run_interpreted(_KERNELS_VS_FLOAT64)
    assert errs.pop("launches") == 33  # both kernels ran, three trees each
    # float32 kernels (fp32 dots in the interpreter) against float64 over <= 9 chained segments of <= 40 rows
    assert max(errs.values()) < 1e-5, errs
