"""Tree GDN through flash-linear-attention (CUDA only): equal to the per-path oracle within fla's rounding."""

from __future__ import annotations

import functools

import pytest
import torch

from benchmarks.trees import group_paths, short_node_paths
from treecompile import Tree
from treecompile.ops.fla_gdn import fla_available, fla_unusable_reason, tree_gated_delta_rule_fla
from treecompile.ops.tree_gdn import sequence_nodes, tree_gated_delta_rule

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not fla_available(), reason=str(fla_unusable_reason()))]


def inputs(T, H, Hv, Dk, Dv, dtype, gen):
    mk = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float64)  # noqa: E731
    q, k, v = mk(1, T, H, Dk), mk(1, T, H, Dk), mk(1, T, Hv, Dv)
    g = -torch.rand(1, T, Hv, generator=gen, device="cuda", dtype=torch.float64) * 0.3
    beta = torch.rand(1, T, Hv, generator=gen, device="cuda", dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]


def run(fn, xs, nodes, grad_o):
    o = fn(*xs, *nodes, None, use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad(o, xs, grad_o.to(o.dtype))
    return [o.detach().double()] + [g.double() for g in grads]


@pytest.mark.parametrize("levels", [True, False], ids=["levels", "calls"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fla_tree_equals_per_path_oracle(dtype, seed, levels):
    paths = short_node_paths(seed)
    b = Tree.from_paths(paths).to_batch(pad_to_multiple=64, device="cuda")
    T, H, Hv, Dk, Dv = b.seq_len, 2, 4, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(seed)
    xs = inputs(T, H, Hv, Dk, Dv, dtype, gen)
    grad_o = torch.randn(1, T, Hv, Dv, generator=gen, device="cuda", dtype=torch.float64)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    oracle = run(tree_gated_delta_rule, [x.detach().double().requires_grad_() for x in xs], nodes, grad_o)
    tree = run(functools.partial(tree_gated_delta_rule_fla, levels=levels), xs, nodes, grad_o)
    # fla's own rounding: each path alone through fla vs the float64 oracle of that path
    noise = [0.0] * 6
    for p in range(len(paths)):
        s, e = int(b.tree.path_offsets[p]), int(b.tree.path_offsets[p + 1])
        idx = b.tree.path_index[s:e].cuda()
        px = [x.detach()[:, idx].clone().requires_grad_() for x in xs]
        pn = sequence_nodes(1, idx.numel(), device="cuda")
        f = run(tree_gated_delta_rule_fla, px, pn, grad_o[:, idx])
        r = run(tree_gated_delta_rule, [x.detach().double().requires_grad_() for x in px], pn, grad_o[:, idx])
        noise = [max(n, float((a - c).abs().max() / c.abs().max())) for n, a, c in zip(noise, f, r)]
    real = torch.arange(b.num_tokens, device="cuda")
    for name, t, o, n in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], tree, oracle, noise):
        err = float((t[:, real] - o[:, real]).abs().max() / o[:, real].abs().max())
        assert err <= 4 * n + 1e-6, f"{name}: tree error {err:.2e} vs fla's own per-path error {n:.2e}"


@pytest.mark.parametrize("tree", ["deep", "padded_group"])
@pytest.mark.parametrize("mode", ["over_tree", "direct", "dispatched"])
@pytest.mark.parametrize("replay_max", [0, 8])
def test_levels_equal_whole_calls_with_initial_state(replay_max, mode, tree, monkeypatch):
    """The levelled path (fla's chunk kernels once; the recurrence one launch over the tree, or per call with its
    kernels launched into one buffer or called through fla's functions) against whole fla calls on the same plan,
    with a root initial state and its gradient, and both against the float64 oracle.  ``padded_group``: a prompt,
    its samples and a bucket's padding, planned in DFS order (no gather; the padding's root in the samples' call)."""
    from treecompile.ops import fla_gdn_levels
    from treecompile.ops.fla_gdn import plan_calls

    if mode == "over_tree" and replay_max:
        pytest.skip("the recurrence over the tree runs plans without replayed rows")
    monkeypatch.setattr(fla_gdn_levels, "TREE", mode == "over_tree")
    monkeypatch.setattr(fla_gdn_levels, "DIRECT", mode != "dispatched")
    assert (fla_gdn_levels._fla()["direct"] is not None) == (mode != "dispatched")  # no fla backend claims them
    launches, fwd_h = [], fla_gdn_levels.tree_fwd_h
    monkeypatch.setattr(fla_gdn_levels, "tree_fwd_h", lambda *a: launches.append(1) or fwd_h(*a))
    if tree == "deep":
        b = Tree.from_paths(short_node_paths(2)).to_batch(device="cuda")
    else:
        b = Tree.from_paths(group_paths(150, 5, 20, 90, vocab=500)).to_batch(pad_to_multiple=256, device="cuda")
        plan = plan_calls(b.node_start, b.node_end, b.node_parent, replay_max=replay_max)
        assert plan.identity and plan.waves[-1].roots is not None
    T, H, Hv, Dk, Dv = b.seq_len, 2, 4, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(3)
    xs = inputs(T, H, Hv, Dk, Dv, torch.float32, gen)
    h0 = (0.1 * torch.randn(Hv, Dk, Dv, generator=gen, device="cuda", dtype=torch.float64))
    grad_o = torch.randn(1, T, Hv, Dv, generator=gen, device="cuda", dtype=torch.float64)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)

    def grads(fn, dtype, **kw):
        x = [t.detach().to(dtype).requires_grad_() for t in xs]
        i0 = h0.to(dtype).requires_grad_()
        o = fn(*x, *nodes, i0, use_qk_l2norm_in_kernel=True, **kw)
        return [o.detach().double()] + [g.double() for g in torch.autograd.grad(o, x + [i0], grad_o.to(o.dtype))]

    oracle = grads(tree_gated_delta_rule, torch.float64)
    whole = grads(tree_gated_delta_rule_fla, torch.float32, levels=False, replay_max=replay_max)
    levels = grads(tree_gated_delta_rule_fla, torch.float32, levels=True, replay_max=replay_max)
    assert len(launches) == (2 if mode == "over_tree" else 0)  # forward, and again in the backward
    for name, a, w, o in zip(["o", "dq", "dk", "dv", "dg", "dbeta", "dh0"], levels, whole, oracle):
        err_levels = float((a - o).abs().max() / o.abs().max())
        err_whole = float((w - o).abs().max() / o.abs().max())
        assert err_levels <= 2 * err_whole + 1e-6, f"{name}: levels {err_levels:.2e} vs whole calls {err_whole:.2e}"


@pytest.mark.parametrize("paths", ["agentic", "synthetic"])
def test_recurrence_over_tree_at_model_width_is_deterministic(paths, monkeypatch):
    """The recurrence over the tree at a model's width (16 v heads of 128: hundreds of programs waiting on their
    parents' flags): the same bits on every run (a missed wait would read a state half written), within the
    per-call path's error against the float64 oracle."""
    from benchmarks.trees import synthetic_paths
    from treecompile.ops import fla_gdn_levels

    p = short_node_paths(5, root_len=300, branches=12) if paths == "agentic" else synthetic_paths(8, 512, 0.5, seed=1)
    b = Tree.from_paths(p).to_batch(device="cuda")
    T, H, Hv, Dk, Dv = b.seq_len, 16, 16, 128, 128
    gen = torch.Generator(device="cuda").manual_seed(4)
    xs = inputs(T, H, Hv, Dk, Dv, torch.float32, gen)
    grad_o = torch.randn(1, T, Hv, Dv, generator=gen, device="cuda", dtype=torch.float64)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)

    def grads(fn, dtype, **kw):
        x = [t.detach().to(dtype).requires_grad_() for t in xs]
        o = fn(*x, *nodes, use_qk_l2norm_in_kernel=True, **kw)
        return [o.detach().double()] + [g.double() for g in torch.autograd.grad(o, x, grad_o.to(o.dtype))]

    runs = [grads(tree_gated_delta_rule_fla, torch.bfloat16, levels=True) for _ in range(3)]
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again))
    oracle = grads(tree_gated_delta_rule, torch.float64)
    over_tree = grads(tree_gated_delta_rule_fla, torch.float32, levels=True)
    monkeypatch.setattr(fla_gdn_levels, "TREE", False)
    per_call = grads(tree_gated_delta_rule_fla, torch.float32, levels=True, replay_max=0)
    for name, a, c, o in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], over_tree, per_call, oracle):
        err, err_calls = (float((x - o).abs().max() / o.abs().max()) for x in (a, c))
        assert err <= 2 * err_calls + 1e-6, f"{name}: over the tree {err:.2e} vs per call {err_calls:.2e}"
