"""Redundancy-free partitions executed with boundary tensors == the whole tree (float64, CPU).

The ops (attention over [boundary ; local] keys, GDN with exported states, conv with boundary
context) against the whole-tree ops; the expose_boundary pass (fires, refuses a near miss); the
executor: summed loss, log-probs and every parameter gradient equal the whole-tree TreeModel's
(1e-9 relative) for random trees and budgets (C = 1 .. more than the tree), dense and hybrid models,
with every unique token computed exactly once (ERR == POR).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treecompile
from treecompile import NORMALIZATIONS, Tree
from treecompile.models import HybridConfig, HybridForCausalLM
from treecompile.ops import gdn
from treecompile.ops.tree_attention import tree_attention_reference
from treecompile.passes import PassError
from treecompile.runtime.partition import partition_redundancy_free
from treecompile.runtime.redundancy_free import run_redundancy_free
from helpers import cached_compile, cached_model, tiny_dense
from strategies import ODD_TREES, weighted_path_sets

import treecompile.ops.tree_attention_boundary  # noqa: F401  (registers the ops)
import treecompile.ops.tree_conv_boundary  # noqa: F401
import treecompile.ops.tree_gdn_boundary  # noqa: F401

ops = torch.ops.treecompile
f64 = torch.float64
VOCAB = 11


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def _tree_and_plan(C=2):
    tree = Tree.from_paths([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 2, 3, 4], [3, 4], [3, 5, 6]])
    return tree, partition_redundancy_free(tree, C)


# ------------------------------------------------------------------------------------------ ops
def test_attention_boundary_equals_whole_tree_attention():
    """Each partition's queries over [its boundary's K/V ; its own] == the whole tree's attention."""
    torch.manual_seed(0)
    tree, plan = _tree_and_plan(C=3)
    T = tree.num_tokens
    q, k, v = torch.randn(1, 4, T, 8, dtype=f64), torch.randn(1, 2, T, 8, dtype=f64), torch.randn(1, 2, T, 6, dtype=f64)
    whole = tree_attention_reference(q, k, v, tree.subtree_end)
    assert len(plan) > 3
    for i in range(len(plan)):
        b = plan.batch(i)
        tok, bnd = b.extras["tokens"], b.extras["boundary_index"]
        out = ops.tree_attention_boundary(q[:, :, tok], k[:, :, tok], v[:, :, tok], b.subtree_end, k[:, :, bnd],
                                          v[:, :, bnd], b.extras["boundary_visible"])
        assert torch.allclose(out, whole[:, :, tok], rtol=0, atol=1e-14)


def test_attention_boundary_gradients_and_opcheck():
    torch.manual_seed(1)
    T, B = 5, 3
    args = [torch.randn(1, 4, T, 8, dtype=f64), torch.randn(1, 2, T, 8, dtype=f64), torch.randn(1, 2, T, 6, dtype=f64),
            torch.randn(1, 2, B, 8, dtype=f64), torch.randn(1, 2, B, 6, dtype=f64)]
    args = [a.requires_grad_() for a in args]
    se, vis = torch.tensor([5, 3, 3, 5, 5]), torch.tensor([3, 3, 2, 3, 1])
    assert torch.autograd.gradcheck(lambda q, k, v, pk, pv: ops.tree_attention_boundary(q, k, v, se, pk, pv, vis), args,
                                      fast_mode=True)
    torch.library.opcheck(ops.tree_attention_boundary.default, (*args[:3], se, *args[3:], vis))
    # an empty boundary is the plain tree attention
    out = ops.tree_attention_boundary(*args[:3], se, args[3][:, :, :0], args[4][:, :, :0],
                                      torch.zeros(T, dtype=torch.long))
    assert torch.equal(out, tree_attention_reference(*args[:3], se))


def _gdn_inputs(T, seed=2):
    torch.manual_seed(seed)
    q, k = torch.randn(1, T, 2, 4, dtype=f64), torch.randn(1, T, 2, 4, dtype=f64)
    v = torch.randn(1, T, 4, 3, dtype=f64)
    g, beta = -torch.rand(1, T, 4, dtype=f64), torch.rand(1, T, 4, dtype=f64)
    return [q, k, v, g, beta]


def test_gdn_boundary_states_are_each_nodes_final_state():
    """final[state_nodes] == the recurrence run along the node's root path from initial_state."""
    tree, _ = _tree_and_plan()
    b = tree.to_batch()
    q, k, v, g, beta = _gdn_inputs(tree.num_tokens)
    h0 = torch.randn(4, 4, 3, dtype=f64)
    nodes = torch.arange(tree.num_nodes)
    o, states = ops.tree_gated_delta_rule_boundary(q, k, v, g, beta, b.node_start, b.node_end, b.node_parent,
                                                 b.node_level, h0, nodes, use_qk_l2norm_in_kernel=True, chunk_size=2)
    o_ref = ops.tree_gated_delta_rule(q, k, v, g, beta, b.node_start, b.node_end, b.node_parent, b.node_level, h0,
                                      use_qk_l2norm_in_kernel=True, chunk_size=2)
    assert torch.allclose(o, o_ref, rtol=0, atol=1e-13)
    for n in range(tree.num_nodes):
        chain, a = [], n
        while a >= 0:
            chain.append(a)
            a = int(tree.node_parent[a])
        idx = torch.cat([torch.arange(int(tree.node_start[a]), int(tree.node_end[a])) for a in reversed(chain)])
        _, hT = gdn.recurrent_gated_delta_rule(q[:, idx], k[:, idx], v[:, idx], g[:, idx], beta[:, idx],
                                               initial_state=h0[None], output_final_state=True,
                                               use_qk_l2norm_in_kernel=True)
        assert torch.allclose(states[n], hT[0], rtol=0, atol=1e-12), n


def test_gdn_boundary_gradients_and_opcheck():
    tree = Tree.from_paths([[1, 2, 3], [1, 4, 5], [1, 4, 6]])
    b = tree.to_batch()
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    xs = _gdn_inputs(tree.num_tokens, seed=3) + [torch.randn(4, 4, 3, dtype=f64)]
    xs = [x.requires_grad_() for x in xs]
    sn = torch.tensor([0, 2, 2, 3])  # a repeated node: its gradients add

    def f(q, k, v, g, beta, h0):
        return ops.tree_gated_delta_rule_boundary(q, k, v, g, beta, *nodes, h0, sn, use_qk_l2norm_in_kernel=True,
                                                chunk_size=2)

    assert torch.autograd.gradcheck(f, xs, fast_mode=True)
    torch.library.opcheck(ops.tree_gated_delta_rule_boundary.default, (*xs[:5], *nodes, xs[5], sn),
                          {"use_qk_l2norm_in_kernel": True, "chunk_size": 2})


def test_conv_boundary_equals_whole_tree_conv():
    torch.manual_seed(4)
    tree, plan = _tree_and_plan(C=1)
    K = 4
    whole_b = tree.to_batch(conv_kernel=K)
    x, w, bias = torch.randn(1, 5, tree.num_tokens, dtype=f64), torch.randn(5, K, dtype=f64), torch.randn(5, dtype=f64)
    whole = ops.tree_causal_conv1d(x, w, bias, whole_b.conv_index, "silu")
    for i in range(len(plan)):
        b = plan.batch(i, conv_kernel=K)
        tok, bnd, cbi = b.extras["tokens"], b.extras["boundary_index"], b.extras["conv_boundary_index"]
        n = tok.numel()
        idx = torch.where(cbi >= 0, n + cbi, b.conv_index)  # boundary_x = all boundary columns
        out = ops.tree_causal_conv1d_boundary(x[:, :, tok], w, bias, idx, x[:, :, bnd], "silu")
        assert torch.allclose(out, whole[:, :, tok], rtol=0, atol=1e-14)


def test_conv_boundary_gradients_and_opcheck():
    torch.manual_seed(5)
    xs = [torch.randn(1, 5, 5, dtype=f64), torch.randn(5, 4, dtype=f64), torch.randn(5, dtype=f64),
          torch.randn(1, 5, 2, dtype=f64)]
    xs = [x.requires_grad_() for x in xs]
    ci = torch.tensor([[6, 5, -1], [0, 6, 5], [1, 0, 6], [5, -1, -1], [3, 5, -1]])
    assert torch.autograd.gradcheck(lambda x, w, b, p: ops.tree_causal_conv1d_boundary(x, w, b, ci, p, "silu"), xs,
                                      fast_mode=True)
    torch.library.opcheck(ops.tree_causal_conv1d_boundary.default, (xs[0], xs[1], xs[2], ci, xs[3], "silu"))
    with pytest.raises(ValueError, match="conv_index: entry 7"):
        ops.tree_causal_conv1d_boundary(xs[0], xs[1], xs[2], ci.clamp(max=7) + (ci == 6), xs[3], "silu")


# ------------------------------------------------------------------------------------------ models
def _hybrid():
    torch.manual_seed(0)
    # tiny's 4 layers (3 GDN + 1 attention) less one GDN layer: capture and every run cost 3/4; two GDN
    # layers still carry their own recurrent and conv states across each partition boundary
    return HybridForCausalLM(HybridConfig.tiny(vocab_size=VOCAB, num_hidden_layers=3,
                                               layer_types=("linear_attention", "linear_attention",
                                                            "full_attention"))).double()


@pytest.fixture(scope="module")
def dense():
    model = cached_model(f"dense-tiny-v{VOCAB}", lambda: tiny_dense(VOCAB))
    return model, cached_compile(model), cached_compile(model, boundary=True)


@pytest.fixture(scope="module")
def hybrid():
    model = cached_model(f"hybrid-tiny-v{VOCAB}", _hybrid)
    return model, cached_compile(model), cached_compile(model, boundary=True)


def test_pass_fires_and_default_pipeline_unchanged(dense, hybrid):
    for (model, tmodel, bmodel), want in ((dense, dict(attention=2, gdn=0, conv=0)),
                                          (hybrid, dict(attention=1, gdn=2, conv=2))):
        assert "expose_boundary" not in tmodel.pass_results and tmodel.program.boundary is None
        assert not any(n.name.startswith("boundary_") for n in tmodel.graph_module.graph.nodes)
        res = bmodel.pass_results["expose_boundary"]
        assert res.count == sum(want.values()) + 1
        assert {k: res.info[k] for k in want} == want
        spec = bmodel.program.boundary
        assert spec is res.spec and {k: getattr(spec, k) for k in want} == want
        assert len(spec.input_shapes) == len(spec.inputs)
        targets = {n.target for n in bmodel.graph_module.graph.nodes}
        assert ops.tree_attention.default not in targets and ops.tree_gated_delta_rule.default not in targets
        assert ops.tree_causal_conv1d.default not in targets and ops.tree_attention_boundary.default in targets
        with pytest.raises(TypeError, match="boundary=True"):
            bmodel(Tree.from_paths([[1, 2, 3]]).to_batch())
        with pytest.raises(ValueError, match="boundary=True"):
            run_redundancy_free(tmodel, partition_redundancy_free(Tree.from_paths([[1, 2, 3]]), 2))


def test_pass_refuses_graph_without_the_loss_rewrite(dense):
    model = dense[0]
    with pytest.raises(PassError, match="expose_boundary.*row gather"):  # the fixture's capture, passes run anew
        cached_compile(model, boundary=True, disable=("rewrite_loss",))


def _whole(model, tmodel, tree, normalize):
    params = list(model.parameters())
    out = tmodel(tree.to_batch(normalize=normalize))
    grads = torch.autograd.grad(out.loss, params, allow_unused=True)
    return out.loss.detach(), out.logprobs.detach(), torch.cat([
        (g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def check_partitioned(model, tmodel, bmodel, tree, C, normalize, whole=None, bound="auto"):
    """``whole``: ``_whole(model, tmodel, tree, normalize)`` when the caller checks several budgets of one
    tree (the whole-tree run does not depend on C: computed once, not once per budget)."""
    loss, lp, g_ref = _whole(model, tmodel, tree, normalize) if whole is None else whole
    plan = partition_redundancy_free(tree, C, bound=bound)
    params = list(model.parameters())
    for p in params:
        p.grad = None
    res = run_redundancy_free(bmodel, plan, normalize=normalize)
    g = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
    for p in params:
        p.grad = None
    # each unique token computed exactly once; ERR == POR; activations alive = one chain
    toks = torch.cat([p.tokens for p in plan.partitions])
    assert torch.equal(toks.sort().values, torch.arange(tree.num_tokens))
    assert res.tokens_computed == tree.num_tokens and res.num_partitions == len(plan)
    assert res.reuse.err == pytest.approx(tree.por, abs=1e-15)
    assert res.peak_alive_tokens == plan.peak_chain_tokens() <= max(tree.path_lengths.tolist()) + C
    assert plan.bound == "partition" or res.peak_alive_tokens <= C
    # exact: loss, log-probs, every parameter gradient
    assert abs(float(res.loss - loss)) <= 1e-9 * max(abs(float(loss)), 1e-300)
    assert float((res.logprobs - lp).abs().max()) < 1e-12
    if float(g_ref.norm()) == 0:
        assert float(g.norm()) == 0
    else:
        assert rel(g, g_ref) < 1e-9
    return plan


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weighted_path_sets(max_paths=6, max_len=8, vocab=VOCAB), st.integers(1, 12), st.sampled_from(NORMALIZATIONS),
       st.booleans())
def test_dense_partitioned_equals_whole_tree(dense, pmw, C, normalize, use_masks):
    paths, masks, weights = pmw
    tree = Tree.from_paths(paths, loss_masks=masks if use_masks else None, path_weights=weights)
    check_partitioned(*dense, tree, C, normalize)


@pytest.mark.parametrize("name", sorted(ODD_TREES))
def test_dense_odd_trees(dense, name):
    tree = Tree.from_paths([[t % VOCAB for t in p] for p in ODD_TREES[name]])
    longest = max(tree.path_lengths.tolist())
    whole = _whole(dense[0], dense[1], tree, "path_mean")
    for C in sorted({1, 2, max(longest - 1, 1), tree.num_tokens}):
        if name == "wide_fanout_64" and C < 3:
            continue  # 131 one-token partitions: slow, and C = longest - 1 already splits every path
        check_partitioned(*dense, tree, C, "path_mean", whole=whole)


def test_dense_path_longer_than_budget_spans_partitions(dense):
    tree = Tree.from_paths([list(range(1, 11)), list(range(1, 6)) + [7, 8, 9, 1, 2, 3]])
    plan = check_partitioned(*dense, tree, 3, "sum")
    assert max(len(p.ancestors) for p in plan.partitions) >= 3  # a chain of several partitions


@pytest.mark.parametrize("bound", ["chain", "partition"])
def test_chunk_with_a_subtree_taken_whole(dense, hybrid, bound):
    """The chain bound's first partition holds the chunk (tokens 0, 1) and the leaf below the root (token 7),
    with partitions hanging below token 1: K/V, GDN states and conv inputs exported from a partition that is
    not one path; the partition bound's plan of the same tree next to it."""
    tree = Tree.from_paths([[3, 2, 2, 1], [1, 2, 3, 3, 3], [1, 3], [1, 2, 1, 3]])
    for model in (dense, hybrid):
        plan = check_partitioned(*model, tree, 6, "token_mean", bound=bound)
        assert (plan.partitions[0].tokens.tolist() == [0, 1, 7]) == (bound == "chain")


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weighted_path_sets(max_paths=5, max_len=8, vocab=VOCAB), st.integers(1, 10), st.sampled_from(NORMALIZATIONS))
def test_hybrid_partitioned_equals_whole_tree(hybrid, pmw, C, normalize):
    paths, masks, weights = pmw
    tree = Tree.from_paths(paths, loss_masks=masks, path_weights=weights)
    check_partitioned(*hybrid, tree, C, normalize)


@pytest.mark.parametrize("name", ["one_token_nodes", "prefix_of_other", "deep_chain", "forest"])
def test_hybrid_odd_trees(hybrid, name):
    """Conv context spanning several partitions (C = 1, 2 < K - 1), a root partition, deep chains."""
    tree = Tree.from_paths([[t % VOCAB for t in p] for p in ODD_TREES[name]])
    whole = _whole(hybrid[0], hybrid[1], tree, "token_mean")
    for C in (1, 2, 4):
        check_partitioned(*hybrid, tree, C, "token_mean", whole=whole)


def test_partitions_run_through_the_programs_one_runner(dense, monkeypatch):
    """Every partition goes through ``program.run`` with its boundary inputs (the runner that also
    picks the CUDA lowering); a default program refuses boundary inputs by name."""
    model, tmodel, bmodel = dense
    tree = Tree.from_paths([[1, 2, 3, 4, 5], [1, 2, 3, 6], [1, 7, 8, 9]])
    plan = partition_redundancy_free(tree, 3)
    calls = []
    run = bmodel.program.run

    def counting(batch, boundary_inputs=(), **kw):
        calls.append(len(boundary_inputs))
        return run(batch, boundary_inputs, **kw)

    monkeypatch.setattr(bmodel.program, "run", counting)
    run_redundancy_free(bmodel, plan)
    model.zero_grad()
    assert len(plan) > 1 and calls == [len(bmodel.program.boundary.inputs)] * len(plan)
    with pytest.raises(TypeError, match="takes 0 boundary inputs, got 1.*boundary=True"):
        tmodel.program.run(tree.to_batch(), [torch.zeros(1)])


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_padded_partitions_equal_whole_tree(which, dense, hybrid, monkeypatch):
    """Partitions padded as the CUDA buckets pad them (``TreeProgram.padded_call``: padding tokens, fed-row
    indices moved past them, ``boundary_visible`` and zero K/V rows padded) still give the whole tree's
    loss, log-probs and gradients; the padding moved indices and K/V rows (it fired)."""
    model, tmodel, bmodel = dense if which == "dense" else hybrid
    program = bmodel.program
    run = program.run
    moved = []

    def padded(batch, boundary_inputs=(), **kw):
        T = batch.seq_len
        b, ins = program.padded_call(batch, boundary_inputs, T + 7)
        moved.append(int((b.pred_index >= T + 7).sum()) + int((b.conv_index >= T + 7).sum()))
        kv = [x for (kind, _), x in zip(program.boundary.inputs, ins) if kind == "boundary_k"]
        assert all(x.shape[2] in (0, 256) for x in kv)  # bucket_length of B <= 256
        return program.unpadded_outputs(run(b, ins, lower=False), T)

    monkeypatch.setattr(program, "run", padded)
    tree = Tree.from_paths([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 2, 3, 4], [3, 4], [3, 5, 6]])
    whole = _whole(model, tmodel, tree, "token_mean")
    for C in (1, 3):
        check_partitioned(model, tmodel, bmodel, tree, C, "token_mean", whole=whole)
    assert sum(moved) > 0


@pytest.mark.parametrize("which", ["dense", "hybrid"])
@pytest.mark.parametrize("pad", [0, 7])
def test_partitions_through_the_varlen_boundary_lowering_equal_whole_tree(pad, which, dense, hybrid, monkeypatch):
    """The lowering's varlen boundary attention (``attention_kernel="fa4_varlen"``, what "auto" takes on Hopper:
    ``ops.varlen_boundary_attention``, its reference kernel on the CPU) run for every partition, padded as the CUDA
    buckets pad them or not: the whole tree's loss, log-probs and every gradient (float64).  A partition whose
    segments would gather too much runs the flex lowering: the check the runner makes is the op's own bound."""
    from treecompile.passes import lower_cuda as lc

    model, tmodel, bmodel = dense if which == "dense" else hybrid
    program = bmodel.program
    monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q=None: None)
    monkeypatch.setattr(lc, "varlen_input_reason", lambda q: None)
    low = lc.lower_cuda(program.graph_module, lc.CudaOptions(compile_cuda=False, gdn_kernel="reference",
                                                             conv_kernel="reference", attention_kernel="fa4_varlen"),
                        boundary=True)
    layers = sum(kind == "boundary_k" for kind, _ in program.boundary.inputs)
    assert (low.boundary_varlen, low.attention) == (layers, 0) and layers > 0
    calls = []

    def run(batch, boundary_inputs=(), **kw):
        T = batch.seq_len
        b, ins = program.padded_call(batch, boundary_inputs, T + pad) if pad else (batch, list(boundary_inputs))
        mask = program._boundary_mask_args(ins)
        calls.append(mask["num_boundary"])
        args = program.batch_args(b) + ins + lc.attention_inputs(b.subtree_end, low, **mask)
        assert args[-1] is None  # no block mask
        out = tuple(low.graph_module(*program.lifted_values(), *args))
        return program.unpadded_outputs(out, T) if pad else out

    monkeypatch.setattr(program, "run", run)
    tree = Tree.from_paths([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 2, 3, 4], [3, 4], [3, 5, 6],
                            [1, 2, 3, 4, 9, 9, 9, 1]])
    whole = _whole(model, tmodel, tree, "token_mean")
    for C in (1, 3, 5):
        check_partitioned(model, tmodel, bmodel, tree, C, "token_mean", whole=whole)
    assert max(calls) > 0  # partitions read boundary rows


def test_padded_partition_on_a_device_keeps_host_values(hybrid, monkeypatch):
    """A partition moved to a device (``meta`` here: no values) and padded by ``padded_call`` keeps the host
    values of its tree tensors, the fed-row shift of ``pred_index``/``conv_index`` included, and of its
    ``boundary_visible`` (moved as the executor moves it): the CUDA plans read them instead of the device
    (``treecompile.host_values``; the varlen boundary attention plans from ``boundary_visible``)."""
    from treecompile.host_values import remembered_host, to_device_with_host
    from treecompile.tree import _TENSOR_FIELDS

    model, tmodel, bmodel = hybrid
    program = bmodel.program
    run, seen = program.run, []

    def record(batch, boundary_inputs=(), **kw):
        seen.append((batch, list(boundary_inputs)))
        return run(batch, boundary_inputs, **kw)

    monkeypatch.setattr(program, "run", record)
    tree = Tree.from_paths([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2, 9, 10, 2, 3, 4], [3, 4], [3, 5, 6]])
    run_redundancy_free(bmodel, partition_redundancy_free(tree, 3))
    model.zero_grad()
    shifted = 0
    for batch, ins in seen:
        L = batch.seq_len + 7
        want, _ = program.padded_call(batch, ins, L)
        kinds = [kind for kind, _ in program.boundary.inputs]
        moved = [to_device_with_host(x, "meta") if kind == "boundary_visible" else x.detach().to("meta")
                 for kind, x in zip(kinds, ins)]
        got, got_ins = program.padded_call(batch.to("meta"), moved, L)
        for f in _TENSOR_FIELDS:
            assert torch.equal(remembered_host(getattr(got, f)), getattr(want, f)), f
        visible = kinds.index("boundary_visible")
        assert torch.equal(remembered_host(got_ins[visible]), program.padded_call(batch, ins, L)[1][visible])
        shifted += int((want.conv_index >= L).sum())
    assert len(seen) > 1 and shifted > 0  # the partitions read fed rows: the shift moved indices


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compile_cuda", [False, True], ids=["eager_graph", "compiled_graph"])
def test_cuda_partitions_equal_whole_tree(compile_cuda):
    """On CUDA (float32): partitions through the flex boundary kernel, padded to buckets, == the whole tree."""
    from treecompile.models import DenseConfig, DenseForCausalLM

    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny(vocab_size=97, hidden_size=64, head_dim=16)).cuda()
    opts = dict(compile_cuda=compile_cuda, attention_kernel="flex")
    tmodel, bmodel = treecompile.compile(model, **opts), treecompile.compile(model, boundary=True, **opts)
    g = torch.Generator().manual_seed(1)
    paths = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (300, 250, 40)]
    paths[1][:120] = paths[0][:120]
    paths[2][:30] = paths[0][:30]
    tree = Tree.from_paths(paths)
    params = list(model.parameters())
    out = tmodel(tree.to_batch(normalize="token_mean"))
    g_ref = torch.cat([x.flatten() for x in torch.autograd.grad(out.loss, params)])
    plan = partition_redundancy_free(tree, 100)
    assert len(plan) > 3 and max(p.parent for p in plan.partitions) >= 0
    res = run_redundancy_free(bmodel, plan, normalize="token_mean")
    g = torch.cat([p.grad.flatten() for p in params])
    low = bmodel.program._cuda.lowering  # the lowering that ran: flex boundary attention, bucketed
    assert (low.attention, low.boundary, low.bucket, low.compiled) == (2, True, True, compile_cuda)
    assert abs(float(res.loss) - float(out.loss)) <= 1e-5 * abs(float(out.loss))
    assert float((res.logprobs - out.logprobs.double().cpu()).abs().max()) < 1e-4
    assert rel(g.double(), g_ref.double()) < 1e-4


@pytest.mark.parametrize("frozen", ["all_but_head", "embedding_and_first_layer", "embedding"])
@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_partitioned_with_frozen_parameters_equals_whole_tree(dense, hybrid, which, frozen):
    """Parameters frozen below the head (head-only training, a frozen embedding and first layer): boundary exports
    that nothing trainable produced carry no gradient, and the partitions' loss and every trainable gradient equal
    the whole tree's (the exports used to reach ``torch.autograd.backward`` without requiring grad: a crash)."""
    model, tmodel, bmodel = dense if which == "dense" else hybrid

    def is_frozen(name):
        if frozen == "all_but_head":
            return not name.startswith("lm_head")
        return "embed_tokens" in name or (frozen == "embedding_and_first_layer" and name.startswith("model.layers.0."))

    saved = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(not is_frozen(n))
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert trainable and len(trainable) < len(list(model.parameters()))
        tree = Tree.from_paths([[1, 3, 4, 5, 9, 5], [1, 3, 4, 6], [1, 3, 7, 8, 10], [1, 2]])
        out = tmodel(tree.to_batch(normalize="path_mean"))
        g_ref = torch.autograd.grad(out.loss, trainable)
        for C in (2, 3):
            for p in model.parameters():
                p.grad = None
            res = run_redundancy_free(bmodel, partition_redundancy_free(tree, C), normalize="path_mean")
            assert abs(float(res.loss - out.loss)) <= 1e-12 * abs(float(out.loss))
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
            got = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in trainable])
            assert rel(got, torch.cat([g.flatten() for g in g_ref])) < 1e-12
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(saved[n])
            p.grad = None


def test_partitions_refuse_a_model_changed_after_compile():
    """The partitions run the program directly, not through the TreeModel's call: the same refusal of a change the
    graph would not follow (here a nested module replaced) holds for them (they ran the traced model silently)."""
    torch.manual_seed(0)
    model = tiny_dense(VOCAB)
    bmodel = treecompile.compile(model, boundary=True)
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size).double()
    with pytest.raises(RuntimeError, match=r"module 'model.norm' \(a RMSNorm at compile\) was replaced by a LayerNorm"):
        run_redundancy_free(bmodel, partition_redundancy_free(Tree.from_paths([[1, 2, 3], [1, 2, 4]]), 2))


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_compiled_varlen_boundary_program_compiles_with_dynamic_shapes(which, dense, hybrid, monkeypatch):
    """A compiled boundary program with no block mask (the varlen boundary lowering) runs under dynamo's automatic
    dynamic shapes (``CudaLowering.dynamic``).  Partitions below a long chain, padded to buckets as the CUDA run pads
    them, fall in four boundary-length buckets.  Static shapes compile each bucket (the dense model: 4 graphs);
    dynamic ones compile the roots' B = 0 and then one graph with the boundary length symbolic (2), and the hybrid
    model twice more: its partitions' counts of boundary states run 0, 1, 2, and dynamo specialises sizes 0 and 1.
    The partitions still give the whole tree's loss, log-probs and every gradient (float64; dynamo's ``aot_eager``
    backend on the CPU, inductor in the CUDA run).  The flex lowering and whole-tree programs keep static shapes."""
    from torch._dynamo.backends.debugging import aot_eager

    from treecompile.passes import lower_cuda as lc
    from treecompile.program import bucket_length, compile_lowered, dynamo_config

    model, tmodel, bmodel = dense if which == "dense" else hybrid
    program = bmodel.program
    monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q=None: None)
    monkeypatch.setattr(lc, "varlen_input_reason", lambda q: None)

    def lower(program, kernel, boundary=True):
        return lc.lower_cuda(program.graph_module, lc.CudaOptions(compile_cuda=True, gdn_kernel="reference",
                                                                  conv_kernel="reference", attention_kernel=kernel),
                             boundary=boundary)

    low = lower(program, "fa4_varlen")
    assert low.dynamic and low.boundary_varlen > 0 and low.attention == 0
    assert not lower(program, "flex").dynamic and not lower(tmodel.program, "fa4_varlen", boundary=False).dynamic
    g = torch.Generator().manual_seed(3)
    chain = torch.randint(1, VOCAB, (700,), generator=g).tolist()
    paths = [chain[:n] + torch.randint(1, VOCAB, (m,), generator=g).tolist()
             for n, m in ((700, 30), (120, 40), (300, 25), (520, 35), (650, 20))]
    tree = Tree.from_paths(paths)
    whole = _whole(model, tmodel, tree, "token_mean")
    results = {}
    for dynamic in (True, False) if which == "dense" else (True,):
        compiles, shapes = [], set()

        def counting(gm, example_inputs):
            compiles.append(len(example_inputs))
            return aot_eager(gm, example_inputs)

        torch._dynamo.reset()
        # the static arm: what compile_lowered runs for a lowering with a block mask (one graph per shape)
        run_graph = (compile_lowered(low, low.graph_module, backend=counting) if dynamic else
                     torch.compile(low.graph_module, dynamic=False, backend=counting))

        def run(batch, boundary_inputs=(), **kw):
            T = batch.seq_len
            b, ins = program.padded_call(batch, boundary_inputs, bucket_length(T))
            mask = program._boundary_mask_args(ins)
            shapes.add((b.seq_len, mask["num_boundary"]))
            args = program.batch_args(b) + ins + lc.attention_inputs(b.subtree_end, low, **mask)
            with torch._dynamo.config.patch(**dynamo_config(program.options)):
                out = tuple(run_graph(*program.lifted_values(), *args))
            return program.unpadded_outputs(out, T)

        monkeypatch.setattr(program, "run", run)
        check_partitioned(model, tmodel, bmodel, tree, 150, "token_mean", whole=whole)
        results[dynamic] = len(compiles), shapes
    torch._dynamo.reset()
    n_dynamic, shapes = results[True]
    assert {B for _, B in shapes} == {0, 256, 512, 768}, shapes  # the chain's partitions: four boundary buckets
    assert n_dynamic == (2 if which == "dense" else 4), results
    if which == "dense":
        assert results[False][0] == len(shapes) == 4, results
