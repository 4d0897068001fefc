"""treecompile.compile on the dense reference model and unmodified HF Llama/Qwen3: tree == per path."""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treecompile
from treecompile import NORMALIZATIONS, Tree, frontend, reference
from treecompile.models import DenseConfig, DenseForCausalLM
from treecompile.frontend import CaptureError
from treecompile.passes import UnsupportedModelError
from helpers import (cached_compile, cached_model, capture_once, deterministic_algorithms, flat_grads,
                     reference_noise, rel, tiny_dense)
from mixer_models import ShiftMaskedPast, ShiftMaskedPastFloat
from strategies import ODD_TREES, weighted_path_sets

aten = torch.ops.aten


@pytest.fixture(scope="module")
def dense():
    model = cached_model("dense-tiny-v11", lambda: tiny_dense(11))  # captured once per process
    return model, cached_compile(model)


def compare(model, tmodel, paths, masks, weights, normalize, *, retain_ref=False):
    """``retain_ref``: keep the reference's graph (``helpers.reference_noise`` reads it)."""
    tree = Tree.from_paths(paths, loss_masks=masks, path_weights=weights)
    batch = tree.to_batch(normalize=normalize)
    params = list(model.parameters())
    out = tmodel(batch)
    ref = reference.run(model, paths, loss_masks=masks, path_weights=weights, normalize=normalize)
    lp_err = max(float((a - r).detach().abs().max()) for a, r in zip(batch.path_logprobs(out.logprobs), ref.logprobs))
    loss_err = abs(float(out.loss - ref.loss)) / max(abs(float(ref.loss)), 1e-300)
    g_tree, g_ref = flat_grads(out.loss, params), flat_grads(ref.loss, params, retain_graph=retain_ref)
    return loss_err, lp_err, g_tree, g_ref, out, ref, batch


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weighted_path_sets(max_paths=8, max_len=10, vocab=11), st.sampled_from(NORMALIZATIONS), st.booleans())
def test_dense_tree_equals_per_path(dense, pmw, normalize, use_masks):
    """Tree == per path, to 1e-9 relative, above the rounding floor of the per-path sum itself.

    Both the reference and the tree add the same per-path terms c_p * s_p (s_p = a path's masked
    loss), grouped differently, so each is exact up to a few eps * sum_p |c_p| |s_p| (loss) and
    sum_p |c_p| |grad s_p| (gradient).  When the terms cancel (duplicate paths weighted w and -w next
    to a path weighted 3e-136), the reference's own result is that rounding (here: loss and gradient
    0, the tree's ~1e-136 being right), so no error relative to it alone is meaningful; 1e-12 of the
    terms' magnitudes (~1e4 eps) is that floor, and 1e-9 relative to the result is kept on top.
    Below the normal range (a path weight of 5e-324) rounding is absolute, not relative: each
    operation may be off by up to the subnormal spacing ``math.ulp(0.0)``, hence ``SUBNORMAL_FLOOR``.
    """
    model, tmodel = dense
    paths, masks, weights = pmw
    masks = masks if use_masks else None
    _, lp_err, g_tree, g_ref, out, ref, batch = compare(model, tmodel, paths, masks, weights, normalize)
    loss_scale, grad_scale = per_path_term_magnitudes(model, paths, masks, batch.tree.path_coefficients(normalize))
    assert lp_err < 1e-12
    assert abs(float(out.loss - ref.loss)) <= 1e-9 * abs(float(ref.loss)) + 1e-12 * loss_scale + SUBNORMAL_FLOOR
    assert safe_norm(g_tree - g_ref) <= (1e-9 * safe_norm(g_ref) + 1e-12 * grad_scale
                                         + SUBNORMAL_FLOOR * math.sqrt(g_ref.numel()))


SUBNORMAL_FLOOR = 1e4 * math.ulp(0.0)  # ~5e-320: 1e4 absolute roundings of a subnormal


def safe_norm(x: torch.Tensor) -> float:
    """2-norm that does not underflow (torch squares the entries: 1e-170 -> norm 0)."""
    m = x.detach().abs().max()
    return float(m * (x.detach() / m).norm()) if float(m) > 0 else 0.0


def per_path_term_magnitudes(model, paths, masks, coef):
    """(sum_p |c_p| |s_p|, sum_p |c_p| |grad s_p|): the scale of the rounding of sum_p c_p s_p."""
    params = list(model.parameters())
    loss_scale = grad_scale = 0.0
    for p, path in enumerate(paths):
        one = reference.run(model, [path], loss_masks=None if masks is None else [masks[p]])
        if one.loss.requires_grad and float(coef[p]) != 0:
            loss_scale += abs(float(coef[p])) * abs(float(one.loss))
            grad_scale += abs(float(coef[p])) * safe_norm(flat_grads(one.loss, params))
    return loss_scale, grad_scale


def test_reference_cancellation_is_within_the_derived_floor(dense):
    """The inputs that made test_dense_tree_equals_per_path's old relative measure ill-posed: the
    reference loses the 3e-136 path ((s + 3e-136 s') - s == 0), the tree keeps it; the floor admits
    the reference's error (test_dense_tiny_path_weight_next_to_an_untrained_path shows that it does
    not admit a tree that loses a path which the reference keeps)."""
    model, tmodel = dense
    paths, weights = [[1, 2, 3], [1, 2, 4], [1, 2, 3]], [1.0, 3e-136, -1.0]
    _, _, g_tree, g_ref, out, ref, batch = compare(model, tmodel, paths, None, weights, "sum")
    assert float(ref.loss) == 0 and float(g_ref.norm()) == 0 and float(out.loss) != 0  # the reference rounds
    loss_scale, grad_scale = per_path_term_magnitudes(model, paths, None, batch.tree.path_coefficients("sum"))
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * loss_scale
    assert safe_norm(g_tree - g_ref) <= 1e-12 * grad_scale


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_dense_tiny_path_weight_next_to_an_untrained_path(dense, normalize):
    """Regression (found by test_dense_tree_equals_per_path): path [1] trains nothing but its weight
    1.5 entered a prefix sum of path weights that absorbed the 3e-136 of path [1, 2, 3], so the tree's
    loss and gradient were exactly 0 (relative error 1.0)."""
    model, tmodel = dense
    paths = [[1], [1, 2, 3]]
    loss_err, lp_err, g_tree, g_ref, out, ref, batch = compare(model, tmodel, paths, None, [1.5, 3e-136], normalize)
    assert float(ref.loss) != 0 and float(g_ref.norm()) > 0
    assert lp_err < 1e-12 and loss_err < 1e-9
    assert rel(g_tree, g_ref) < 1e-9
    # the rounding floor of test_dense_tree_equals_per_path does not hide the bug: the old 0 fails it
    loss_scale, grad_scale = per_path_term_magnitudes(model, paths, None, batch.tree.path_coefficients(normalize))
    assert not abs(float(ref.loss)) <= 1e-9 * abs(float(ref.loss)) + 1e-12 * loss_scale
    assert not safe_norm(g_ref) <= 1e-9 * safe_norm(g_ref) + 1e-12 * grad_scale


@pytest.mark.parametrize("name", sorted(ODD_TREES))
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_dense_odd_trees(dense, name, normalize):
    model, tmodel = dense
    paths = [[t % 11 for t in p] for p in ODD_TREES[name]]
    loss_err, lp_err, g_tree, g_ref, *_ = compare(model, tmodel, paths, None, None, normalize)
    assert lp_err < 1e-12 and loss_err < 1e-9
    if float(g_ref.norm()) > 0:
        assert rel(g_tree, g_ref) < 1e-9


def test_parameters_are_shared_and_state_dict_unchanged(dense):
    model, tmodel = dense
    assert [id(p) for p in tmodel.parameters()] == [id(p) for p in model.parameters()]
    assert list(tmodel.state_dict().keys()) == list(model.state_dict().keys())
    # an optimizer on model.parameters() trains the tree model
    tree = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5]])
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    b = tree.to_batch()
    before = float(tmodel(b).loss)
    for _ in range(3):
        opt.zero_grad()
        tmodel(b).loss.backward()
        opt.step()
    assert float(tmodel(b).loss) < before
    model.load_state_dict(saved)  # the fixture is shared by the other tests of this module
    model.zero_grad(set_to_none=True)


def test_padding_does_not_change_results(dense):
    model, tmodel = dense
    tree = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5], [6]])
    a = tmodel(tree.to_batch())
    b = tmodel(tree.to_batch(pad_to_multiple=16))
    assert b.logprobs.numel() == 16
    torch.testing.assert_close(a.logprobs, b.logprobs[:a.logprobs.numel()], rtol=0, atol=1e-13)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-13, atol=0)


def test_graph_after_rewrite(dense):
    _, tmodel = dense
    g = tmodel.graph_module.graph
    targets = [n.target for n in g.nodes if n.op == "call_function"]
    assert aten.scaled_dot_product_attention.default not in targets
    assert targets.count(torch.ops.treecompile.tree_attention.default) == 2  # one per layer
    assert not any(t in (aten.arange.default, aten.arange.start) for t in targets)
    assert {k: v.count for k, v in tmodel.pass_results.items()} == {
        "check_dropout": 0, "rewrite_attention": 2, "route_gdn_states": 0, "rewrite_positions": 1,
        "rewrite_scans": 0, "rewrite_causal_convs": 0, "rewrite_token_shifts": 0, "rewrite_causal_attention": 0,
        "rewrite_router_loss": 0, "rewrite_loss": 1, "verify_token_locality": 0}
    for n in g.nodes:  # every node carries meta["val"]
        if n.op in ("call_function", "placeholder"):
            assert "val" in n.meta, n.name


def test_model_unchanged_by_compile():
    torch.manual_seed(1)
    model = DenseForCausalLM(DenseConfig.tiny()).double().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.tensor([[1, 2, 3]])
    out_before = model(ids)
    treecompile.compile(model)
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(model(ids), out_before, rtol=0, atol=0)


def test_decorator_forms():
    @treecompile.compile
    class Tiny(DenseForCausalLM):
        pass

    tm = Tiny(DenseConfig.tiny())
    assert isinstance(tm, treecompile.TreeModel)

    @treecompile.compile(debug=False)
    def build():
        return DenseForCausalLM(DenseConfig.tiny())

    assert isinstance(build(), treecompile.TreeModel)


def test_disable_unknown_pass_is_an_error(monkeypatch):
    import importlib

    def no_capture(*a, **k):
        raise AssertionError("captured the model before refusing the pass name")

    monkeypatch.setattr(importlib.import_module("treecompile.compile"), "capture", no_capture)  # refused up front
    with pytest.raises(ValueError, match="unknown pass"):
        treecompile.compile(DenseForCausalLM(DenseConfig.tiny()), disable=("rewrite_everything",))
    with pytest.raises(ValueError, match=r"unknown pass name\(s\) \['expose_boundary'\]"):  # a partition-graph pass only
        treecompile.compile(DenseForCausalLM(DenseConfig.tiny()), disable=("expose_boundary",))
    with pytest.raises(TypeError, match=r"got the string 'rewrite_positions' \(write disable=\('rewrite_positions',\)\)"):
        treecompile.compile(DenseForCausalLM(DenseConfig.tiny()), disable="rewrite_positions")


def test_names_from_named_parameters_resolve_on_the_tree_model():
    """``tm.get_parameter`` / ``get_buffer`` / ``get_submodule`` take the names ``named_parameters()`` and
    ``state_dict()`` give, also under an adopted child called ``model`` (``tm.model`` is the user's module)."""
    tm = treecompile.compile(DenseForCausalLM(DenseConfig.tiny()))
    assert any(n.startswith("model.layers.") for n, _ in tm.named_parameters())
    for n, p in tm.named_parameters():
        assert tm.get_parameter(n) is p, n
    for n, b in tm.named_buffers():
        assert tm.get_buffer(n) is b, n
    for n, m in tm.named_modules():
        assert tm.get_submodule(n) is m, n
    with pytest.raises(AttributeError):
        tm.get_submodule("model.nope")


class HiddenChildren(torch.nn.Module):
    """A causal LM whose children are called ``model`` and ``program``: names the TreeModel's own attributes hide."""

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Embedding(11, 8)
        self.program = torch.nn.Linear(8, 11)

    def forward(self, ids):
        return self.program(torch.tanh(self.model(ids)))


@pytest.mark.parametrize("make", [lambda: DenseForCausalLM(DenseConfig.tiny()), HiddenChildren],
                         ids=["dense", "hidden_children"])
def test_distributed_checkpoint_state_dict_of_the_tree_model(make):
    """torch.distributed.checkpoint's ``get_model_state_dict`` / ``set_model_state_dict`` walk a key's parts by
    attribute; ``tm.model`` / ``tm.program`` are the TreeModel's own, not the adopted children of those names.  The
    state dict is the model's, and one set through DCP is what the model then holds (tests/test_distributed.py: the
    same under DDP and FSDP2)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = make()
    tm = treecompile.compile(model)
    sd = get_model_state_dict(tm)
    ref = {k: v.clone() for k, v in model.state_dict().items()}  # (the state dict's values are the live tensors)
    assert sorted(sd) == sorted(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    set_model_state_dict(tm, {k: v + 1 for k, v in sd.items()})
    assert all(torch.equal(model.state_dict()[k], ref[k] + 1) for k in ref)
    assert tm._fqn_modifiers() == ({"model": "_adopted_children"} if make is not HiddenChildren
                                   else {"model": "_adopted_children", "program": "_adopted_children"})


class RootTensors(torch.nn.Module):
    """A causal LM whose head weight and an output scale live on the root module (not in a child)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Parameter(torch.randn(11, 8) * 0.3)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, ids):
        return torch.nn.functional.linear(torch.tanh(self.emb(ids)), self.head) * self.scale


def test_the_tree_model_follows_the_model_or_refuses():
    """What the user changes after compile: a root parameter or buffer set on the TreeModel (assignment,
    ``load_state_dict(assign=True)``) is the model's too, and the tree loss is the per-path one with it; set on the
    model alone, a module replaced, or the model converted to another dtype, the next call refuses by name (the
    graph would read one tensor while the optimizer trains another, compute the old module, or keep casts traced for
    the old dtype)."""
    paths = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]
    batch = Tree.from_paths(paths).to_batch()

    def exact(tm, model):
        out, ref = tm(batch), reference.run(model, paths)
        assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))
        params = list(tm.parameters())
        assert rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)) <= 1e-12

    torch.manual_seed(0)
    model = RootTensors().double()
    tm = treecompile.compile(model)
    exact(tm, model)
    tm.head = torch.nn.Parameter(torch.randn(11, 8, dtype=torch.float64))  # on the TreeModel: the model's too
    tm.scale = torch.tensor(4.0, dtype=torch.float64)
    assert model.head is tm.head and model.scale is tm.scale
    exact(tm, model)
    other = RootTensors().double()
    tm.load_state_dict(other.state_dict(), assign=True)
    assert model.head is tm.head and torch.equal(model.head, other.head)
    exact(tm, model)
    model.head = torch.nn.Parameter(torch.zeros(11, 8, dtype=torch.float64))  # on the model alone
    with pytest.raises(RuntimeError, match=r"root parameter 'head' was replaced on the model after "
                                           r"treecompile.compile.*assign it on the TreeModel"):
        tm(batch)
    tm.head = model.head
    exact(tm, model)
    model.emb = torch.nn.Embedding(11, 8).double()  # a module: the graph was traced through the old one
    with pytest.raises(RuntimeError, match=r"module 'emb' was replaced after treecompile.compile"):
        tm(batch)
    with pytest.raises(RuntimeError, match=r"module 'emb' was replaced"):
        tm.prepare(batch)
    dense = DenseForCausalLM(DenseConfig.tiny())  # float32
    tdense = treecompile.compile(dense)
    tdense(batch)
    dense.double()
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight is float64 but the model was compiled with it "
                                         r"in float32: convert the model before treecompile.compile"):
        tdense(batch)


def _dense_change(change):
    """A tiny dense model (tied embeddings and head), compiled, then changed by ``change(model)``."""
    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny(tie_word_embeddings=True)).double()
    tm = treecompile.compile(model)
    change(model)
    return model, tm


def _untie(m):
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone() * 0.5)


def _load_untied(m):
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)  # two tensors from a checkpoint for the two tied names


def _swap_mlp_class(m):
    mlp = m.model.layers[0].mlp
    mlp.__class__ = type("Doubled" + type(mlp).__name__, (type(mlp),),
                         {"forward": lambda self, x: 2 * type(mlp).forward(self, x)})


def _replace_config(m):
    import dataclasses

    object.__setattr__(m, "config", dataclasses.replace(m.config, rope_theta=500.0))


def _set_bias(m):
    m.model.layers[0].mlp.down_proj.bias = torch.nn.Parameter(torch.ones(m.config.hidden_size, dtype=torch.float64))


@pytest.mark.parametrize("change, message", [
    (lambda m: setattr(m.model, "norm", torch.nn.LayerNorm(m.config.hidden_size).double()),
     r"module 'model.norm' \(a RMSNorm at compile\) was replaced by a LayerNorm"),
    (lambda m: m.model.layers.append(m.model.layers[0]), r"model.layers holds 3 modules, 2 at compile \(added: '2'\)"),
    (lambda m: delattr(m.model, "norm"), r"module 'model.norm' \(a RMSNorm at compile\) was removed"),
    (_set_bias, r"'model.layers.0.mlp.down_proj.bias' was None at compile and is now a tensor"),
    (lambda m: delattr(m.model.norm, "weight"), r"'model.norm.weight' was deleted or set to None"),
    (_untie, r"'model.embed_tokens.weight' and 'lm_head.weight', one tensor at compile \(tied"),
    (_load_untied, r"'model.embed_tokens.weight' and 'lm_head.weight', one tensor at compile \(tied"),
    (lambda m: setattr(m.model.layers[1].mlp, "forward", lambda x: x), r"the forward of model.layers.1.mlp was replaced"),
    (_swap_mlp_class, r"the class of model.layers.0.mlp was changed from \w+ to Doubled\w+, whose forward is another"),
    (lambda m: setattr(m.model.norm, "eps", 0.5), r"model.norm.eps was 1e-06 at compile and was set to 0.5"),
    (_replace_config, r"config was replaced by a configuration with other values"),
], ids=["nested_module", "layer_appended", "module_removed", "bias_set", "weight_deleted", "untied", "untied_by_load",
        "instance_forward", "class_swapped", "eps_set", "config_replaced"])
def test_changes_below_the_root_that_the_graph_would_not_follow_are_refused(change, message):
    """A nested module replaced, removed or added to a container, a parameter that was None set (or one deleted),
    tied weights made two, a module's forward replaced (on the instance, or by a class swap), a plain value a
    forward reads (``eps``) or the configuration changed: the graph computes the model as traced (each of these ran
    the old computation without a word, 0.02-0.44 relative off in the gradients), so the next call refuses, naming
    the change; ``prepare`` too."""
    _, tm = _dense_change(change)
    batch = Tree.from_paths([[1, 2, 3, 4], [1, 2, 5]]).to_batch()
    with pytest.raises(RuntimeError, match=message + r".* after treecompile.compile: the compiled graph computes the "
                                                      r"model as it was traced; compile the model again"):
        tm(batch)
    with pytest.raises(RuntimeError, match=message):
        tm.prepare(batch)


def test_a_class_forward_patched_after_compile_is_refused(monkeypatch):
    tm = treecompile.compile(WithDropout(0.0).double())
    monkeypatch.setattr(WithDropout, "forward", lambda self, ids: self.head(self.emb(ids)))
    with pytest.raises(RuntimeError, match=r"WithDropout.forward \(the class of the model\) was replaced"):
        tm(Tree.from_paths([[1, 2, 3]]).to_batch())


def test_changes_the_graph_follows_are_not_refused():
    """New values in the same places (a nested parameter replaced, a tied pair re-tied to a new tensor), a new
    attribute on a module that is not a container, and a wrapper class that keeps the forward (as FSDP2's
    ``fully_shard`` swaps classes): the call runs and equals the per-path oracle."""
    paths = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]

    def change(m):
        m.model.norm.weight = torch.nn.Parameter(torch.rand_like(m.model.norm.weight) + 0.5)
        tied = torch.nn.Parameter(m.lm_head.weight.detach() * 0.9)
        m.lm_head.weight = tied
        m.model.embed_tokens.weight = tied
        m.model.probe = torch.nn.Linear(2, 2)
        layer = m.model.layers[0]
        layer.__class__ = type("Wrapped" + type(layer).__name__, (type(layer),), {})

    model, tm = _dense_change(change)
    out, ref = tm(Tree.from_paths(paths).to_batch()), reference.run(model, paths)
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))
    params = [p for n, p in model.named_parameters() if ".probe." not in n]
    assert rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)) <= 1e-12


def test_a_nan_valued_attribute_is_not_a_change():
    """A plain value that is NaN (unequal to itself) is unchanged while it stays NaN, and a change from it is named."""
    model = WithDropout(0.0).double().eval()
    model.head.limit = float("nan")
    tm = treecompile.compile(model)
    batch = Tree.from_paths([[1, 2, 3]]).to_batch()
    tm(batch)
    model.head.limit = 1.0
    with pytest.raises(RuntimeError, match=r"head.limit was nan at compile and was set to 1.0"):
        tm(batch)


def test_common_calls_on_an_hf_model_after_compile_are_not_refused():
    """What users call on an HF model after loading it, which the graph follows or which does not change what it
    computes: activation checkpointing switched on, train mode without dropout, the output flags of its config,
    weights tied again, a state dict loaded in place.  Each runs, and equals the per-path oracle."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).double().eval()
    tm = treecompile.compile(model)
    model.gradient_checkpointing_enable()
    model.train()
    model.config.use_cache = False
    model.config.output_hidden_states = True
    model.tie_weights()
    model.load_state_dict({k: v * 1.01 for k, v in model.state_dict().items()})
    paths = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]
    _, _, g_tree, g_ref, out, ref, batch = compare(model, tm, paths, None, None, "sum", retain_ref=True)
    # HF's float32 RMSNorm / rotary: within 10x the reference's own rounding, as the HF zoo test (an upper bound:
    # ``enough``, so (e) joins where the exact per-path computations all round alike)
    g_err, loss_err = rel(g_tree, g_ref), abs(float(out.loss - ref.loss))

    def within(g_noise, loss_noise):
        return g_err <= 10 * g_noise + 1e-12 and loss_err <= 10 * loss_noise + 1e-12 * abs(float(ref.loss))

    g_noise, loss_noise = reference_noise(model, paths, None, None, batch, ref, list(model.parameters()), g_ref,
                                          enough=within)
    assert within(g_noise, loss_noise), (g_err, loss_err, g_noise, loss_noise)


def test_split_at_refuses_modules_with_hooks_traced_into_the_graph():
    """A forward (pre-)hook registered before compile is in the graph; ``split_at`` runs a split module's part through
    its call, which would run the hook again (a pre-hook doubling its input took the loss from the oracle's 16.638
    to 16.524).  Refused, naming the module; removed, the split runs and equals the whole graph.  Hooks registered
    after compile run once, in the split module's call (FSDP2's)."""
    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny()).double()
    handle = model.model.layers[0].register_forward_pre_hook(lambda mod, args: (args[0] * 2.0,) + tuple(args[1:]))
    tm = treecompile.compile(model)
    paths = [[1, 2, 3, 4], [1, 2, 5]]
    batch = Tree.from_paths(paths).to_batch()
    whole = float(tm(batch).loss)
    assert whole != float(reference.run(DenseForCausalLM(DenseConfig.tiny()).double(), paths).loss)  # the hook acts
    with pytest.raises(ValueError, match=r"split_at: 'model.layers.0' has 1 forward hook\(s\) or pre-hook\(s\) "
                                         r"registered before treecompile.compile"):
        tm.split_at(list(model.model.layers))
    handle.remove()
    tm.split_at(list(model.model.layers))
    assert abs(float(tm(batch).loss) - whole) <= 1e-12 * abs(whole)
    calls = []
    model.model.layers[1].register_forward_pre_hook(lambda mod, args: calls.append(1))
    assert abs(float(tm(batch).loss) - whole) <= 1e-12 * abs(whole) and calls == [1]


# ---------------------------------------------------------------- near misses: refused
class Bidirectional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids):
        x = self.emb(ids)[:, None]  # [1, 1, T, 8]
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x)  # not causal
        return self.head(x[:, 0])


class PaddingMasked(Bidirectional):
    def forward(self, ids):
        x = self.emb(ids)[:, None]
        keep = (ids != 0)[:, None, None, :]  # a mask read from input values
        causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=causal & keep)
        return self.head(x[:, 0])


class SlidingWindow(Bidirectional):
    window = 3

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        i = torch.arange(ids.shape[1])
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < self.window)
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        return self.head(x[:, 0])


class ExplicitCausal(Bidirectional):
    def forward(self, ids):
        x = self.emb(ids)[:, None]
        i = torch.arange(ids.shape[1])
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=i[None, :] <= i[:, None])
        return self.head(x[:, 0])


class HeadsFirstSdpa(Bidirectional):
    """Causal SDPA on a 3-D ``[heads, tokens, head_dim]`` query (the batch dimension dropped)."""

    def forward(self, ids):
        x = self.emb(ids)[0].unflatten(-1, (2, 4)).transpose(0, 1)  # [2, T, 4]
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        return self.head(x.transpose(0, 1).flatten(-2)[None])


def test_sdpa_without_a_batch_dimension_is_refused_by_its_shape():
    """A 3-D query's first dimension is its heads: the refusal names the shape and the layout the rewrite takes,
    not "batch size must be 1"."""
    with pytest.raises(treecompile.passes.PassError, match=r"test_compile.py:\d+ in forward.*attention on a 3-D query "
                                                          r"of shape \(2, s\d+, 4\)"
                                                          r".*\[batch, heads, tokens, head_dim\]"):
        treecompile.compile(HeadsFirstSdpa())


class ChunkedCausal(Bidirectional):
    """Causal within chunks of 4 tokens (Llama 4's chunked layers): neither causal nor a sliding window."""

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        i = torch.arange(ids.shape[1])
        mask = (i[None, :] <= i[:, None]) & (i[:, None] // 4 == i[None, :] // 4)
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        return self.head(x[:, 0])


class HidesTheLastQuery(Bidirectional):
    """Causal except that the last query sees no key: neither causal nor a window (a window read off the last row
    would be 0 tokens)."""

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        i = torch.arange(ids.shape[1])
        mask = (i[None, :] <= i[:, None]) & (i[:, None] < ids.shape[1] - 1)
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        return self.head(x[:, 0])


class WideSlidingWindow(SlidingWindow):
    """A window of 64 tokens: causal at every length up to 64."""

    window = 64


class EagerWideSlidingWindow(Bidirectional):
    """Attention written out (``q @ k^T``, ``masked_fill``, softmax) with a window of 64 tokens: the eager-attention
    pass once probed it at 5 and 11 tokens only, where it is causal, and rewrote it into full tree attention."""

    def forward(self, ids):
        x = self.emb(ids)
        i = torch.arange(ids.shape[1])
        far = (i[:, None] - i[None, :] >= 64) | (i[None, :] > i[:, None])
        scores = (x @ x.transpose(-1, -2) / 8 ** 0.5).masked_fill(far, float("-inf"))
        return self.head(torch.softmax(scores, -1) @ x)


class EagerWindowInABuffer(Bidirectional):
    """Attention written out with a window width held in a buffer: the probe fed buffers random values, read a window
    of 2 tokens off them and rewrote the layer with it (silently wrong: the model's window is 4)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("width", torch.tensor(4))

    def forward(self, ids):
        x = self.emb(ids)
        i = torch.arange(ids.shape[1])
        ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.width)
        scores = (x @ x.transpose(-1, -2) / 8 ** 0.5).masked_fill(~ok, float("-inf"))
        return self.head(torch.softmax(scores, -1) @ x)


class EagerWindowClampedFromABuffer(EagerWindowInABuffer):
    """A window ``width.clamp(min=6)`` with ``width = 8``: both small probe feeds gave 6 (compiled as a window of 6,
    silently wrong); a third probe feeds large values."""

    def __init__(self):
        super().__init__()
        self.width = torch.tensor(8)

    def forward(self, ids):
        x = self.emb(ids)
        i = torch.arange(ids.shape[1])
        ok = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.width.clamp(min=6))
        scores = (x @ x.transpose(-1, -2) / 8 ** 0.5).masked_fill(~ok, float("-inf"))
        return self.head(torch.softmax(scores, -1) @ x)


class SdpaBiasInTheMask(Bidirectional):
    """A float SDPA mask that carries an ALiBi-style bias besides -inf: its non-zero entries were read as masked
    (each token attended to itself alone)."""

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        i = torch.arange(ids.shape[1])
        mask = (0.5 * (i[None, :] - i[:, None])).to(x.dtype).masked_fill(i[None, :] > i[:, None], float("-inf"))
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        return self.head(x[:, 0])


class SdpaSoftMask(Bidirectional):
    """A float causal mask whose masked value is a finite -3 (the future keeps a small weight): it passed as
    causal."""

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        T = ids.shape[1]
        mask = torch.zeros(T, T, dtype=x.dtype).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -3.0)
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        return self.head(x[:, 0])


class SdpaFiniteMaskValue(Bidirectional):
    """A float causal mask of -1e9 (a common written-out mask value): exact, the masked weights are 0."""

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        T = ids.shape[1]
        mask = torch.zeros(T, T, dtype=x.dtype).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -1e9)
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        return self.head(x[:, 0])


class ShiftOffBelowSixTokens(Bidirectional):
    """A previous-token feature switched off for sequences of at most 5 tokens: the probes (13 tokens and more)
    saw a plain shift, and the condition vanished into the tree's shift (loss off by 1.4e-3)."""

    def forward(self, ids):
        x = self.emb(ids)
        long_enough = torch.ones(ids.shape[1], dtype=x.dtype).sum() > 5
        return self.head(x + torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1] * long_enough)


class SdpaBidirectionalBelowFourTokens(Bidirectional):
    """A causal mask made bidirectional for sequences under 4 tokens: checked at 1, 5 and 11 tokens only, where the
    1-token mask is causal too."""

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        T = ids.shape[1]
        mask = torch.ones(T, T, dtype=torch.bool).tril() | (torch.scalar_tensor(T) < 4)
        return self.head(torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)[:, 0])


class ShiftGatedByLength(Bidirectional):
    """The shift of :class:`ShiftOffBelowSixTokens` gated by other spellings of the length: the last position
    (``arange(T).flip(0)[0]``, ``arange(T)[-1]``, ``arange(T).sort(descending=True)``), a normalized entry
    (``softmax(zeros(T))[0]`` is ``1 / T``), a product (``ones(T) @ ones(T)``).  Each read a value of the whole
    sequence that the old check (reductions by name) did not list."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, ids):
        x = self.emb(ids)
        T = ids.shape[1]
        pos = torch.arange(T, dtype=x.dtype)
        gate = {"flip": lambda: pos.flip(0)[0] > 5,
                "last": lambda: pos[-1] > 5,
                "sort": lambda: pos.sort(descending=True).values[0] > 5,
                "softmax": lambda: torch.softmax(torch.zeros(T, dtype=x.dtype), 0)[0] < 0.2,
                "dot": lambda: torch.ones(T, dtype=x.dtype) @ torch.ones(T, dtype=x.dtype) > 5}[self.how]()
        return self.head(x + torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1] * gate)


@pytest.mark.parametrize("cls, message", [
    (ShiftOffBelowSixTokens, r"rewrite_token_shifts would absorb aten.sum, which reads a tensor of the sequence's "
                             r"length and makes a value without a token axis"),
    (SdpaBidirectionalBelowFourTokens, r"rewrite_attention would absorb aten.scalar_tensor, which uses the sequence "
                                       r"length as a value"),
    (functools.partial(ShiftGatedByLength, "flip"), r"would absorb aten.select, which reads entries of a tensor "
                                                    r"reordered along the sequence"),
    (functools.partial(ShiftGatedByLength, "last"), r"would absorb aten.select, which reads tokens counted from the "
                                                    r"end"),
    (functools.partial(ShiftGatedByLength, "sort"), r"would absorb aten.select, which reads entries of a tensor "
                                                    r"reordered along the sequence"),
    (functools.partial(ShiftGatedByLength, "softmax"), r"would absorb aten.select, which reads entries of a tensor "
                                                       r"normalized along the sequence"),
    (functools.partial(ShiftGatedByLength, "dot"), r"would absorb aten.(dot|mm|matmul), which reads a tensor of the "
                                                   r"sequence's length and makes a value without a token axis"),
], ids=["sum", "scalar_tensor", "flip", "last", "sort", "softmax", "dot"])
def test_a_condition_on_the_sequence_length_is_refused(cls, message):
    with pytest.raises(treecompile.passes.PassError, match=message) as info:
        treecompile.compile(cls())
    assert isinstance(info.value.__cause__, UnsupportedModelError)
    assert "test_compile.py" in str(info.value)  # the user's source line


class ReorderedAlongFeatures(Bidirectional):
    """Near misses of :class:`ShiftGatedByLength`: ``topk``/``flip`` over the features and ``softmax`` over the
    features of each token, then an entry picked, then a shift (a router's ``topk`` over experts is this).  No
    length in sight: compiled, and exact on a tree."""

    def forward(self, ids):
        x = self.emb(ids)
        top = x.topk(2, dim=-1).values[..., 0:1] + x.flip(-1)[..., :1] + torch.softmax(x, -1)[..., 0:1]
        return self.head(x + torch.nn.functional.pad(x * top, (0, 0, 1, 0))[:, :-1])


def test_reordering_along_features_is_not_a_length_value():
    torch.manual_seed(0)
    model = ReorderedAlongFeatures().double()
    assert treecompile.compile(model).pass_results["rewrite_token_shifts"].count == 1
    _assert_tree_equals_per_path(model, [[1, 2, 3, 4], [1, 2, 5], [1, 6]])


class ScaledWindow(Bidirectional):
    """A window of 90 tokens written through a scale, ``0.01 * (q - k) < 0.9``, in SDPA's mask, in hand-written
    attention and on a shift's multiplier (``0.1 * position < 9``): probed one past the largest number (0.9, 9),
    each passed as plain causal attention or a plain shift.  ``how="sqrt"``: ``sqrt(q - k) < 9.5``, a threshold no
    literal bounds."""

    def __init__(self, how="scale"):
        super().__init__()
        self.how = how

    def forward(self, ids):
        x = self.emb(ids)
        T = ids.shape[1]
        i = torch.arange(T)
        d = (i[:, None] - i[None, :]).to(x.dtype)
        near = (d.clamp(min=0).sqrt() < 9.5) if self.how == "sqrt" else (d * 0.01 < 0.9)
        mask = (i[None, :] <= i[:, None]) & near
        y = torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], attn_mask=mask)[:, 0]
        s = (y @ y.transpose(-1, -2) / 8 ** 0.5).masked_fill(~mask, float("-inf"))
        y = torch.softmax(s, -1) @ y
        pos = torch.arange(T, dtype=x.dtype)
        y = y + torch.where((pos * 0.1 < 9.0)[None, :, None], torch.nn.functional.pad(y, (0, 0, 1, 0))[:, :-1], 0.0)
        return self.head(y)


def test_a_threshold_written_through_a_scale_is_probed_past():
    """Numbers in a mask or multiplier count scaled back through the arithmetic on the positions (``pos * 0.1 < 9``
    is ``pos < 90``): the window and the shift's cut at 90 are found and exact on paths of 120 and 93 tokens (they
    were silently dropped: log-probs off by 0.6); a square root before the comparison bounds nothing: refused."""
    torch.manual_seed(0)
    model = ScaledWindow().double()
    tm = treecompile.compile(model)
    assert tm.pass_results["rewrite_attention"].info["windowed"] == 1
    assert tm.pass_results["rewrite_causal_attention"].info["windowed"] == 1
    paths = [[j % 10 + 1 for j in range(120)], [j % 10 + 1 for j in range(90)] + [5, 6, 7], [1, 2, 3, 9]]
    out, ref = tm(Tree.from_paths(paths).to_batch()), reference.run(model, paths)
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))
    params = list(model.parameters())
    assert rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)) <= 1e-12
    with pytest.raises(treecompile.passes.PassError, match=r"compares positions with 2\.1\d*e\+09 .*square root"):
        treecompile.compile(ScaledWindow("sqrt"))


class ShiftCutAt90(Bidirectional):
    """A shift switched off from position 90 on, its threshold spelled through arithmetic the old scaling did not
    read: a bit shift (``pos >> 3 < 11``), ``lerp``/``addcmul`` weights, a scale held in a tensor
    (``full_like(pos, 0.1)``, ``scalar_tensor(0.1)``, ``torch.tensor(0.1)``), a threshold in a tensor; and maps no
    number bounds (``exp(-pos) > 1e-39``, ``cos(0.0157 * pos) > 0``, ``2 ** pos < 2 ** 90``).  Each was absorbed
    into a plain shift (log-probs off by 0.5 on paths of 120 tokens)."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, ids):
        x = self.emb(ids)
        pos = torch.arange(ids.shape[1], dtype=x.dtype)
        keep = {"rshift": lambda: (pos.long() >> 3) < 11,
                "lerp": lambda: torch.lerp(torch.zeros_like(pos), pos, 0.1) < 9.0,
                "addcmul": lambda: torch.addcmul(torch.zeros_like(pos), pos, torch.ones_like(pos), value=0.1) < 9.0,
                "full_like": lambda: pos * torch.full_like(pos, 0.1) < 9.0,
                "scalar_tensor": lambda: pos * torch.scalar_tensor(0.1, dtype=pos.dtype) < 9.0,
                "constant": lambda: pos * torch.tensor(0.1, dtype=pos.dtype) < 9.0,
                "threshold_tensor": lambda: pos * 0.1 < torch.full_like(pos, 9.0),
                "new_full": lambda: pos * pos.new_full((ids.shape[1],), 0.1) < 9.0,
                "exp": lambda: torch.exp(-pos) > 1e-39,
                "cos": lambda: torch.cos(pos * 0.0157) > 0,
                "pow2": lambda: 2.0 ** pos < 2.0 ** 90}[self.how]()
        return self.head(x + torch.where(keep[None, :, None], torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1], 0.0))


@pytest.mark.parametrize("how", ["rshift", "lerp", "addcmul", "full_like", "scalar_tensor", "constant",
                                 "threshold_tensor", "new_full", "exp", "cos", "pow2"])
def test_a_threshold_through_any_arithmetic_is_probed_past(how):
    """Exact on paths of 120 and 93 tokens: the cut is probed past (scaled back: 88, 90), or where no number bounds
    it the shift's rewrite leaves the condition in the graph, on the tree's positions."""
    torch.manual_seed(0)
    model = ShiftCutAt90(how).double()
    paths = [[j % 10 + 1 for j in range(120)], [j % 10 + 1 for j in range(93)], [1, 2, 3, 9]]
    _assert_tree_equals_per_path(model, paths)


class SoftCappedScoresPlusOne(Bidirectional):
    """Hand-written causal attention with soft-capped scores and a constant bias, ``tanh(s / 30) * 30 + 1.0``: the
    bias's 1.0 after a ``tanh`` read as a threshold no number bounds (refused as a window of 2**31 tokens), then as
    a mask operand (a crash on the number).  Arithmetic on the scores is no position's: exact."""

    def forward(self, ids):
        x = self.emb(ids)
        T = ids.shape[1]
        s = torch.tanh(x @ x.transpose(-1, -2) / 30.0) * 30.0 + 1.0
        i = torch.arange(T)
        s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
        return self.head(torch.softmax(s, -1) @ x)


def test_soft_capped_scores_with_a_constant_bias_are_exact():
    torch.manual_seed(0)
    model = SoftCappedScoresPlusOne().double()
    assert treecompile.compile(model).pass_results["rewrite_causal_attention"].count == 1
    _assert_tree_equals_per_path(model, [[1, 2, 3, 4, 5], [1, 2, 6], [7, 8]])


class SdpaOverTheHeads(Bidirectional):
    """SDPA on ``[1, T, heads, head_dim]`` (no transpose): it attends over the heads of each token alone.  It was
    rewritten as tree attention: a run-time failure, or silently wrong on a tree of exactly ``heads`` tokens."""

    def forward(self, ids):
        T = ids.shape[1]
        x = self.emb(ids).view(1, T, 2, 4)
        return self.head(torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).reshape(1, T, 8))


@pytest.mark.parametrize("cls, message", [
    (SdpaOverTheHeads, r"SDPA's q has shape \[1, s\d+, 2, 4\].*tokens on dim 2 alone"),
    (EagerWindowInABuffer, r"mask moves with the values of the model's tensors .*a window of 2 tokens with one set "
                           r"of values, a window of 4 tokens with another"),
    (EagerWindowClampedFromABuffer, r"mask moves with the values of the model's tensors"),
    (SdpaBiasInTheMask, r"the float attention mask holds -0.5 .*additive bias"),
    (SdpaSoftMask, r"the float attention mask holds -3 .*additive bias"),
    (Bidirectional, r"test_compile.py:\d+ in forward.*not causal"),
    (PaddingMasked, "reads the values of input"),
    (ChunkedCausal, r"neither the causal mask nor a sliding window over it \(checked at length \d+"),
    (HidesTheLastQuery, r"hides every key from the last query"),
])
def test_non_causal_attention_is_refused(cls, message):
    with pytest.raises(treecompile.passes.PassError, match=message) as info:
        treecompile.compile(cls())
    assert isinstance(info.value.__cause__, UnsupportedModelError)
    eager = cls in (EagerWindowInABuffer, EagerWindowClampedFromABuffer)
    assert ("rewrite_causal_attention" if eager else "rewrite_attention") in str(info.value)


@pytest.mark.parametrize("cls", [SlidingWindow, WideSlidingWindow, EagerWideSlidingWindow])
def test_sliding_window_attention_is_exact_on_a_tree(cls):
    """A sliding window of W tokens (W read off the mask, checked past it) becomes ``tree_attention_windowed``:
    each token sees the W - 1 tokens above it on its own path.  Paths of 70-150 tokens, so that the 64-token
    window cuts them, with branches on both sides of it."""
    torch.manual_seed(0)
    model = cls().double()
    tm = treecompile.compile(model)
    windowed = tm.pass_results["rewrite_attention"].info.get("windowed", 0)
    windowed += tm.pass_results["rewrite_causal_attention"].info.get("windowed", 0)
    assert windowed == 1
    trunk = [1 + i % 9 for i in range(70)]
    paths = [trunk + [2, 3] * 40, trunk[:20] + [4] * 60, trunk[:66] + [5, 6, 7], [3, 1, 4]]
    out, ref = tm(Tree.from_paths(paths).to_batch()), reference.run(model, paths)
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))
    params = list(model.parameters())
    assert rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)) <= 1e-12


class LoopOverLength(Bidirectional):  # a recurrent scan written as a Python loop: fixes the length
    def forward(self, ids):
        h = self.emb(ids)
        outs = [h[:, 0]]
        for i in range(1, ids.shape[1]):
            outs.append(outs[-1] * 0.5 + h[:, i])
        return self.head(torch.stack(outs, 1))


class MisconfiguredHead(torch.nn.Module):
    """A model that fails on its own: its head takes 7 features, its embedding gives 8."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(7, 11)

    def forward(self, ids):
        return self.head(self.emb(ids))


def test_a_model_that_fails_on_its_own_is_named_so_not_as_a_capture_refusal():
    """A refused capture of a model that cannot run the example at all (a bad configuration) says so, with the
    model's own error, rather than reading as torch.export's limitation."""
    with pytest.raises(CaptureError, match=r"MisconfiguredHead fails on its own: run eagerly \(no torch.export\) on "
                                           r"a 16-token example, it raises RuntimeError: mat1 and mat2 shapes cannot "
                                           r"be multiplied.*fix the model or its configuration"):
        treecompile.compile(MisconfiguredHead())
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=3)  # 4 query heads over 3 kv heads
    with pytest.raises(CaptureError, match=r"LlamaForCausalLM fails on its own: run eagerly \(no torch.export; "
                                           r"'sdpa' attention, as the capture runs it\) on a 16-token example, it "
                                           r"raises RuntimeError"):
        treecompile.compile(transformers.LlamaForCausalLM(cfg))


class WithDropout(torch.nn.Module):
    def __init__(self, p):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.drop = torch.nn.Dropout(p)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(self.drop(torch.tanh(self.emb(ids))))


def test_a_mode_switch_after_compile_is_refused_where_the_model_has_dropout():
    """Capture traces the train / eval mode's dropout into the graph.  Compiled in eval mode, a model with dropout
    switched to train mode would train without it, the per-path model with it: refused, naming the dropout; back in
    eval mode it runs.  A model without dropout switches freely (``model.train()`` after a compile in eval mode is
    the usual order) and stays exact."""
    paths = [[1, 2, 3, 4], [1, 2, 5]]
    batch = Tree.from_paths(paths).to_batch()
    torch.manual_seed(0)
    model = WithDropout(0.1).double().eval()
    tm = treecompile.compile(model)
    model.train()
    with pytest.raises(RuntimeError, match=r"the model was in eval mode at compile and is now in train mode, and the "
                                           r"model has dropout \(drop p=0.1\): capture traced its dropout off"):
        tm(batch)
    model.eval()
    tm(batch)
    plain = WithDropout(0.0).double().eval()
    tplain = treecompile.compile(plain)
    plain.train()
    out, ref = tplain(batch), reference.run(plain, paths)
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))


def test_capture_refusal_names_the_model_source_line():
    """From Python too (not only ``treecompile rewrite``), a model torch.export cannot capture at every
    length is refused with one line naming the model's own source line; torch's error is the cause."""
    with pytest.raises(CaptureError) as info:
        treecompile.compile(LoopOverLength())
    msg = str(info.value)
    assert len(msg.splitlines()) == 1
    for needle in ("LoopOverLength", "fixes the length to the example's 16 tokens",
                   "test_compile.py:", "in forward", "for i in range(1, ids.shape[1]):"):
        assert needle in msg, (needle, msg)
    assert "Constraints violated" in str(info.value.__cause__)


class LoopOverWidth(Bidirectional):  # the near miss: a Python loop whose count is not the length
    def forward(self, ids):
        h = self.emb(ids)
        for _ in range(3):
            h = torch.tanh(h) * 0.5 + h
        return self.head(h)


def test_loop_not_over_the_length_is_captured():
    torch.manual_seed(0)
    model = LoopOverWidth().double()
    tm = treecompile.compile(model)
    paths = [[1, 2, 3], [1, 2, 4, 5]]
    out, ref = tm(Tree.from_paths(paths).to_batch()), reference.run(model, paths)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=0)


class ProvableLengthBranch(Bidirectional):
    """Causal, with a branch on the length that holds at every length but that torch.export's solver does
    not prove (the shape of the guard SDPA's stride ordering adds for float32 CUDA q/k/v, ``Ne(Min(16*s,
    32*s), 64*s)``): without help, "Constraints violated (seq)"."""

    def forward(self, ids):
        x = self.emb(ids)[:, None]
        n = ids.shape[1]
        if min(16 * n, 3 * n + 4) != 64 * n:  # true for every n >= 1
            x = x * 0.5
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        return self.head(x[:, 0])


class UnprovenLengthBranch(ProvableLengthBranch):  # the near miss: true at every length, not proven
    def forward(self, ids):
        n = ids.shape[1]
        if 128 * ((n + 127) // 128) >= n:
            ids = ids * 1
        return super().forward(ids)


class BoundedLengthBranch(ProvableLengthBranch):  # false beyond 2,048 tokens: must stay refused
    def forward(self, ids):
        if ids.shape[1] <= 2048:
            ids = ids * 1
        return super().forward(ids)


class FixedLengthBranch(ProvableLengthBranch):  # true at the example's 16 tokens only: must stay refused
    def forward(self, ids):
        if ids.shape[1] == 16:
            ids = ids * 1
        return super().forward(ids)


def test_length_guard_proven_for_every_length_is_captured(monkeypatch):
    """A guard export leaves unproven but that holds at every length: captured (export again with the
    guard as a runtime assert, the assert proven and removed), and the tree equals the per-path model."""
    torch.manual_seed(0)
    model = ProvableLengthBranch().double()
    try:  # the premise: torch alone refuses it
        torch.export.export(model, (torch.zeros(1, 16, dtype=torch.long),),
                            dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=1 << 20)},), strict=False)
        pytest.skip("this torch proves the guard itself: the retry is not exercised")
    except Exception as e:
        assert "Constraints violated" in str(e)
    retries = []
    real = frontend._export_with_proven_asserts
    monkeypatch.setattr(frontend, "_export_with_proven_asserts", lambda *a: retries.append(1) or real(*a))
    tm = treecompile.compile(model)
    assert retries == [1]  # it fired
    assert not [n for n in tm.graph_module.graph.nodes if "assert" in str(n.target)]
    paths = [[1, 2, 3], [1, 2, 4, 5], [6]]
    out, ref = tm(Tree.from_paths(paths).to_batch()), reference.run(model, paths)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=0)


@pytest.mark.parametrize("cls, guard", [(UnprovenLengthBranch, "//"), (BoundedLengthBranch, "2048"),
                                        (FixedLengthBranch, "16")])
def test_length_guard_not_proven_stays_refused(cls, guard):
    with pytest.raises(CaptureError) as info:
        treecompile.compile(cls())
    msg = str(info.value)
    assert len(msg.splitlines()) == 1 and cls.__name__ in msg and "Constraints violated" in str(info.value.__cause__)
    assert guard in str(info.value.__cause__)


@pytest.mark.parametrize("expr, lo, holds", [
    ("Ne(Min(16*s, 32*s), 64*s)", 2, True),  # the float32 CUDA SDPA guard (session 7)
    ("Ne(Min(16*s, 3*s + 4), 64*s)", 2, True),
    ("s >= 2", 2, True),
    ("s >= 3", 2, False),
    ("s <= 2048", 2, False),
    ("Ne(s, 5)", 2, False),
    ("Eq(Mod(s, 2), 0)", 2, False),
    ("Ne(s*t, 0)", 2, False),  # two symbols: not taken
])
def test_holds_for_every_length(expr, lo, holds):
    import sympy

    from treecompile.frontend import holds_for_every_length

    s, t = sympy.Symbol("s"), sympy.Symbol("t")  # no assumptions, as the guard may arrive
    from torch.utils._sympy import functions as torch_sympy

    e = sympy.sympify(expr, locals={"s": s, "t": t, "Min": torch_sympy.Min})  # torch's Min, as in its guards
    assert holds_for_every_length(e, lo) is holds


def test_holds_for_every_length_takes_plain_bools():
    from treecompile.frontend import holds_for_every_length

    assert holds_for_every_length(True, 2) and not holds_for_every_length(False, 2)


def test_explicit_causal_mask_is_accepted():
    torch.manual_seed(0)
    model = ExplicitCausal().double()
    tm = treecompile.compile(model)
    assert tm.pass_results["rewrite_attention"].count == 1
    paths = [[1, 2, 3], [1, 2, 4, 5]]
    out = tm(Tree.from_paths(paths).to_batch())
    ref = reference.run(model, paths)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=0)


# ---------------------------------------------------------------- Hugging Face models
def hf_models():
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    return {
        "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
    }


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def hf(request):
    torch.manual_seed(0)
    model = hf_models()[request.param]().double()
    with capture_once(model):  # the near-miss test compiles this model twice more
        return model, treecompile.compile(model)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(weighted_path_sets(max_paths=6, max_len=12, vocab=37))
def test_hf_tree_equals_per_path_within_reference_rounding(hf, pmw):
    model, tmodel = hf
    paths, masks, weights = pmw
    _, _, g_tree, g_ref, out, ref, batch = compare(model, tmodel, paths, masks, weights, "sum", retain_ref=True)
    if float(g_ref.norm()) == 0:
        return
    params = list(model.parameters())
    g_err, loss_err = rel(g_tree, g_ref), abs(float(out.loss - ref.loss))

    def within(g_noise, loss_noise):
        # 10x the disagreement of two exact per-path computations; 1e-12 floor for pure float64 rounding
        return g_err <= 10 * g_noise + 1e-12 and loss_err <= 10 * loss_noise + 1e-12 * abs(float(ref.loss))

    g_noise, loss_noise = reference_noise(model, paths, masks, weights, batch, ref, params, g_ref, enough=within)
    assert g_err <= 10 * g_noise + 1e-12
    assert loss_err <= 10 * loss_noise + 1e-12 * abs(float(ref.loss))


def test_hf_graph_and_wrong_positions_are_far_above_noise(hf):
    model, tmodel = hf
    targets = [n.target for n in tmodel.graph_module.graph.nodes if n.op == "call_function"]
    assert aten.scaled_dot_product_attention.default not in targets
    assert targets.count(torch.ops.treecompile.tree_attention.default) == 2
    # the HF causal-mask subgraph (diff/cumsum/le over cache_position) is gone, as are aranges
    assert not any(t in (aten.arange.default, aten.arange.start, aten.diff.default, aten.cumsum.default)
                   for t in targets)
    assert tmodel.pass_results["rewrite_attention"].info["repeat_kv_folded"] == 2
    paths = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 10], [1, 2, 11, 12, 13, 14, 15]]
    batch = Tree.from_paths(paths).to_batch()
    params = list(model.parameters())
    ref = reference.run(model, paths)
    g_ref = flat_grads(ref.loss, params, retain_graph=True)  # reference_noise reads ref's graph
    noise, _ = reference_noise(model, paths, None, None, batch, ref, params, g_ref)
    with capture_once(model):  # the fixture's capture of this model, deep-copied: same graph, same passes
        with pytest.raises(treecompile.passes.PassError, match=r"(?s)verify_token_locality.*aten\.arange"):
            treecompile.compile(model, disable=("rewrite_positions",))  # the verifier catches the DFS positions
        with pytest.warns(treecompile.passes.UnverifiedGraphWarning):
            broken = treecompile.compile(model, disable=("rewrite_positions", "verify_token_locality"))
    g_broken = flat_grads(broken(batch).loss, params)
    assert rel(g_broken, g_ref) > 1e3 * max(noise, 1e-12)


def test_tree_output_is_a_pytree_node():
    """Wrappers find the output tensors through pytree (FSDP2 in torch 2.11 hooks its pre-backward,
    and so the root's gradient reduce-scatter, on the tensors ``tree_flatten`` returns)."""
    import torch.utils._pytree as pytree
    from treecompile.compile import TreeOutput

    out = TreeOutput(loss=torch.tensor(1.0), logprobs=torch.zeros(3))
    leaves, spec = pytree.tree_flatten(out)
    assert len(leaves) == 2 and leaves[0] is out.loss and leaves[1] is out.logprobs
    back = pytree.tree_unflatten(leaves, spec)
    assert isinstance(back, TreeOutput) and back.loss is out.loss and back.entropy is None
    out = TreeOutput(loss=torch.tensor(1.0), logprobs=torch.zeros(3), entropy=torch.ones(3))
    leaves, spec = pytree.tree_flatten(out)
    assert len(leaves) == 3 and leaves[2] is out.entropy
    assert pytree.tree_unflatten(leaves, spec).entropy is out.entropy


class ConstantArangeOfExampleLength(torch.nn.Module):
    """An ``arange(16)`` that is no position: 16 is the capture's example length, so a comparison with the
    symbolic length that read the example's hint took it for one (refused by the verifier, or rewritten)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.table = torch.nn.Parameter(torch.randn(40, 16))
        self.head = torch.nn.Linear(16, 50)

    def forward(self, ids):
        return self.head(self.emb(ids) + self.table[torch.arange(16)].sum(0))


def _assert_tree_equals_per_path(model, paths):
    """Loss to 1e-12 and every parameter gradient to 1e-9 (relative) of the per-path run, float64."""
    out = treecompile.compile(model)(Tree.from_paths(paths).to_batch())
    ref = reference.run(model, paths)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=0)
    g = torch.autograd.grad(out.loss, list(model.parameters()))
    g_ref = torch.autograd.grad(ref.loss, list(model.parameters()))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


class _TwoHeads(torch.nn.Module):
    """Embedding, a q/k/v projection to 2 heads of 4 and the LM head: the parts of the hand-written attention models
    below (:meth:`heads` splits the projection into ``[1, 2, T, 4]`` q, k, v; :meth:`logits` merges the heads)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.qkv = torch.nn.Linear(8, 24)
        self.head = torch.nn.Linear(8, 11)

    def heads(self, x):
        T = x.shape[1]
        return tuple(t.view(1, T, 2, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))

    def logits(self, o):
        return self.head(o.transpose(1, 2).reshape(1, o.shape[2], 8))


BRANCHY = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 8, 9], [1, 2, 10], [9, 4]]  # shared prefixes, a second root


class EagerLseSinks(_TwoHeads):
    """Causal attention with sinks in GraniteSWA's form: ``softmax(s) @ v`` scaled by ``sigmoid(logsumexp(s) - sink)``
    per row (one learned logit per head).  ``shift``: the softmax reads ``s - rowmax(s)`` (the same probabilities);
    ``lse_of_shifted``: the logsumexp reads that shifted tensor too (a different function: the sink moves by the
    row max); ``per_token``: the sink is computed from each token's embedding (not a constant per row)."""

    def __init__(self, shift=False, lse_of_shifted=False, per_token=False):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(2))
        self.shift, self.lse_of_shifted, self.per_token = shift, lse_of_shifted, per_token

    def forward(self, ids):
        x = self.emb(ids)
        T = ids.shape[1]
        q, k, v = self.heads(x)
        s = (q @ k.transpose(-1, -2)) * 0.5
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        shifted = s - s.amax(-1, keepdim=True) if (self.shift or self.lse_of_shifted) else s
        lse = torch.logsumexp(shifted if self.lse_of_shifted else s, dim=-1)
        sink = x[..., :2].transpose(1, 2) if self.per_token else self.sinks.view(1, -1, 1)
        scale = torch.sigmoid(lse - sink)
        return self.logits((torch.softmax(shifted, -1) @ v) * scale.unsqueeze(-1))


@pytest.mark.parametrize("shift", [False, True])
def test_sinks_as_a_post_softmax_scale_equal_per_path(shift):
    """GraniteSWA's sinks written out: rewritten into tree attention with a sink column, exact in float64 (the
    sinks' gradient included), with or without the softmax's row-max shift."""
    torch.manual_seed(0)
    model = EagerLseSinks(shift=shift).double()
    info = treecompile.compile(model).pass_results["rewrite_causal_attention"]
    assert info.count == 1 and info.info["with_sinks"] == 1
    _assert_tree_equals_per_path(model, BRANCHY)


@pytest.mark.parametrize("kw", [dict(lse_of_shifted=True), dict(per_token=True)])
def test_sinks_scale_that_is_not_a_sink_softmax_is_refused(kw):
    """A scale whose logsumexp reads the shifted scores, or whose sink is a per-token value, is not one more logit
    per row: the attention is left as written, and the verifier refuses its score product by the model's line."""
    with pytest.raises(treecompile.passes.PassError, match=r"test_compile.py:\d+ in forward: s = \(q @ k"):
        treecompile.compile(EagerLseSinks(**kw).double())


class EagerFlatHeads(_TwoHeads):
    """Causal attention whose scores are made as ``[heads, T, T]`` (``bmm`` over batch x heads) and viewed to
    ``[1, heads, T, T]`` before the mask and softmax, ``@ v`` in ``[1, heads, T, d]`` (GPT-NeoX Japanese).  ``bias``:
    an ALiBi-like distance bias added in the ``[1, heads]`` layout."""

    def __init__(self, bias=False):
        super().__init__()
        self.bias = bias

    def forward(self, ids):
        T = ids.shape[1]
        q, k, v = self.heads(self.emb(ids))
        s = torch.bmm(q.reshape(2, T, 4), k.reshape(2, T, 4).transpose(1, 2)).view(1, 2, T, T) * 0.5
        if self.bias:
            i = torch.arange(T)
            s = s - 0.25 * (i[:, None] - i[None, :]).abs().to(s.dtype)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        return self.logits(torch.softmax(s, -1) @ v)


def test_scores_made_over_flattened_heads_equal_per_path():
    torch.manual_seed(0)
    model = EagerFlatHeads().double()
    assert treecompile.compile(model).pass_results["rewrite_causal_attention"].count == 1
    _assert_tree_equals_per_path(model, BRANCHY)


def test_scores_over_flattened_heads_with_a_bias_are_refused():
    """With a position bias the rewrite does not build that bias for the flattened layout: it leaves the attention,
    and the verifier refuses it by the model's line (never a tree attention without the bias)."""
    with pytest.raises(treecompile.passes.PassError, match=r"test_compile.py:\d+ in forward: s = torch.bmm"):
        treecompile.compile(EagerFlatHeads(bias=True).double())


class NoGradCycle(_TwoHeads):
    """A causal SDPA layer run once under ``torch.no_grad()`` and again with gradients, on the first run's output
    (HRM's inner cycles, truncated backprop through a recurrence).  ``nested``: inside the no-grad region, a second
    region turns gradients back on."""

    def __init__(self, nested=False):
        super().__init__()
        self.nested = nested

    def att(self, x):
        o = torch.nn.functional.scaled_dot_product_attention(*self.heads(x), is_causal=True)
        return o.transpose(1, 2).reshape(1, x.shape[1], 8)

    def forward(self, ids):
        x = self.emb(ids)
        with torch.no_grad():
            y = self.att(x)
            if self.nested:
                with torch.enable_grad():
                    y = y + self.att(y)
        return self.head(x + self.att(x + y))


@pytest.mark.parametrize("nested", [False, True])
def test_a_no_grad_region_is_inlined_on_detached_inputs(nested):
    """The no-grad region's attention is rewritten like any other and the tree equals per-path in float64: its
    values feed the loss, its gradients do not (the shared projection's gradient would differ if they did).  With
    gradients turned back on inside it, that part trains (torch.export closes the region around it)."""
    torch.manual_seed(0)
    model = NoGradCycle(nested=nested).double()
    assert treecompile.compile(model).pass_results["rewrite_attention"].count == 2 + nested
    _assert_tree_equals_per_path(model, BRANCHY)


def test_an_arange_as_long_as_the_example_is_not_taken_for_positions():
    torch.manual_seed(0)
    paths = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 8], [9]]
    for model in (ConstantArangeOfExampleLength().double(),
                  # rotary frequencies arange(0, 32, 2): 16 entries
                  DenseForCausalLM(DenseConfig.tiny(head_dim=32, num_hidden_layers=1)).double()):
        _assert_tree_equals_per_path(model, paths)


class EagerTrilBias(Bidirectional):
    """Causal attention written out with a bias of -0.5 from a distance of 41 on, built from ``tril`` of a ``[T, T]``
    tensor: the DFS distance, not the path distance.  On the 16-token probe tree every pair is closer than 41, so
    the tree check found the bias exact and the tree trained with the DFS distance (1.6e-4 off per-path)."""

    def forward(self, ids):
        x = self.emb(ids)
        T = ids.shape[1]
        far = torch.ones(T, T, dtype=x.dtype).tril(-41)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        s = (x @ x.transpose(-1, -2) - 0.5 * far).masked_fill(~causal, float("-inf"))
        return self.head(torch.softmax(s, -1) @ x)


def test_a_bias_of_dfs_distance_past_the_probe_tree_is_refused():
    """The bias check's tree now holds pairs that lie further apart in DFS order than every number the bias holds
    while close on their path: a bias made from DFS indices is refused by name instead of trained wrong."""
    with pytest.raises(treecompile.passes.PassError, match=r"test_compile.py:\d+ in forward.*tril") as info:
        treecompile.compile(EagerTrilBias().double())
    assert isinstance(info.value.__cause__, UnsupportedModelError)


class EagerBiasPastADistance(torch.nn.Module):
    """Causal attention written out whose additive operand is 0 up to a distance of 40 and a bias past it: at the
    probe lengths (5, 11) the operand holds only zeros, so the pass took it for a mask and dropped it."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids):
        x = self.emb(ids)
        i = torch.arange(ids.shape[1])
        d = i[:, None] - i[None, :]
        side = torch.where(d > 40, -0.5, 0.0).to(x.dtype) + torch.where(d < 0, float("-inf"), 0.0).to(x.dtype)
        return self.head(torch.softmax(x @ x.transpose(-1, -2) + side, -1) @ x)


@pytest.mark.parametrize("cls", [EagerBiasPastADistance, ConstantArangeOfExampleLength])
def test_long_paths_equal_per_path_past_every_number_in_the_model(cls):
    """Paths longer than the numbers the model holds (a bias from distance 40; a table of 16 rows): the tree equals
    per-path in float64 (the checks that sample short lengths saw neither)."""
    torch.manual_seed(0)
    _assert_tree_equals_per_path(cls().double(), [[t % 11 for t in range(60)], [t % 11 for t in range(45)] + [3, 4],
                                                  [5, 6]])


@pytest.mark.parametrize("cls, n", [(ShiftMaskedPast, 100), (ShiftMaskedPastFloat, 9100)])
def test_a_token_shift_masked_past_the_probe_lengths_keeps_its_mask(cls, n):
    """A token shift zeroed from position 80 (past every length the shift rewrite sampled), or from position 9000
    given as a float: paths longer than that equal per-path in float64."""
    torch.manual_seed(0)
    _assert_tree_equals_per_path(cls().double(), [[t % 11 for t in range(n)],
                                                  [t % 11 for t in range(n - 10)] + [3, 4], [5, 6]])


def test_largest_index_literal_counts_thresholds_not_fill_values():
    """Integers below 2**31; floats below FLOAT_LITERAL_LIMIT anywhere, and past it only as a threshold or offset
    (a comparison, clamp, add/sub, remainder) -- a fill value or scale such as -1e4 is not a pattern's offset."""
    from torch import fx

    from treecompile.passes.base import FLOAT_LITERAL_LIMIT, largest_index_literal

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    fill = g.call_function(aten.masked_fill.Scalar, (x, x, -1e4))
    scale = g.call_function(aten.mul.Tensor, (fill, -1e9))
    assert largest_index_literal([fill, scale]) == 0.0
    assert largest_index_literal([g.call_function(aten.lt.Scalar, (x, 9000.0))]) == 9000.0
    assert largest_index_literal([g.call_function(aten.sub.Tensor, (x, 2e4))]) == 2e4
    assert largest_index_literal([g.call_function(aten.slice.Tensor, (x, 1, 0, 2 ** 63 - 1))]) == 1  # the dim only
    assert largest_index_literal([g.call_function(aten.slice.Tensor, (x, 1, 0, 300))]) == 300
    assert largest_index_literal([g.call_function(aten.lt.Scalar, (x, float("inf")))]) == 0.0
    assert largest_index_literal([g.call_function(aten.mul.Tensor, (x, FLOAT_LITERAL_LIMIT / 2))]) == FLOAT_LITERAL_LIMIT / 2


class LogitsAndAuxLoss(Bidirectional):
    """Returns its logits and a loss term of its own (a stand-in for an MTP head or a regularizer)."""

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h), (h ** 2).mean()


def test_outputs_other_than_the_logits_are_named_when_dropped():
    """treecompile trains the tree loss of the logits; any other output the model computes is not computed and not
    trained, and compile says so naming it (silently dropping a loss term would train something else)."""
    with pytest.warns(UserWarning, match=r"other outputs 'output 1' are not computed"):
        tm = treecompile.compile(LogitsAndAuxLoss().double())
    assert tm.pass_results["rewrite_loss"].info["dropped"] == ["'output 1'"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert treecompile.compile(ConstantArangeOfExampleLength().double()).pass_results["rewrite_loss"].info["dropped"] == []


def _assert_exact_on_a_small_tree(model, tm):
    """Loss and every gradient of ``tm`` (compiled from ``model``, float64) equal the per-path run to 1e-12."""
    paths = [[1, 2, 3, 4, 5], [1, 2, 6], [1, 7, 8, 9], [3, 3]]
    out, ref = tm(Tree.from_paths(paths).to_batch()), reference.run(model, paths)
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))
    params = list(model.parameters())
    assert rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)) <= 1e-12


class OffsetPositions(torch.nn.Module):
    """Positions from ``arange(2, T + 2)`` and ``arange(0, 2 * T, 2)`` (OPT-style offsets, a stride): refused before
    ("does not count from 0 by 1"); they are the depths times the step plus the start, in the arange's own dtype
    (float64 and int32 ones too)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.pos = torch.nn.Embedding(200, 8)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids):
        T = ids.shape[1]
        x = self.emb(ids) + self.pos(torch.arange(2, T + 2))[None]
        freq = torch.arange(0, 2 * T, 2).to(x.dtype)[None, :, None] * torch.linspace(0.01, 0.5, 8, dtype=x.dtype)
        x = x + torch.sin(freq)
        # not int64: the start and step were dropped by the cast (session 31: loss off by 1e-3, NaN gradients)
        x = x / torch.arange(1, T + 1, dtype=x.dtype)[None, :, None]
        x = x + torch.arange(5, 3 * T + 5, 3, dtype=torch.int32)[None, :, None] * 0.01
        i = torch.arange(T)
        x = torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], is_causal=True)[:, 0]
        return self.head(x + (i[:, None] >= 0))


def _pooled(h):
    return h.mean(1, keepdim=True)  # HELPER-LINE: mixes every token of the sequence


class MixesInAHelper(Bidirectional):
    """The refused op sits in a module-level helper called from a method: torch.export keeps only ``forward``
    frames, so the refusal named the ``forward`` line that called the method."""

    def mix(self, x):
        return _pooled(x) * 2

    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x + self.mix(x))


@pytest.mark.skipif(not hasattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS"),
                    reason="this torch has no stack-trace anchors (torch.fx.proxy._STACK_TRACE_ANCHORS)")
def test_a_refusal_names_the_line_inside_the_model_helpers():
    import inspect

    line = next(i for i, text in enumerate(inspect.getsource(inspect.getmodule(_pooled)).splitlines(), 1)
                if "HELPER-LINE" in text and "return" in text)
    with pytest.raises(treecompile.passes.PassError, match=rf"test_compile.py:{line} in _pooled: return h.mean"):
        treecompile.compile(MixesInAHelper())


def _shim(fn):
    """A decorator whose one wrapper code serves every function it wraps (as transformers' ``deprecate_kwarg``)."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return fn(*args, **kwargs)  # SHIM-LINE
    return wrapped


def _helper_elsewhere():
    """``_shim``-decorated ``pooled(h)`` (mixes tokens) from a module that holds none of the model's classes (as
    HF's ``masking_utils`` mask builders)."""
    import types

    mod = types.ModuleType("treecompile_test_elsewhere")
    exec("def pooled(h):\n    return h.mean(dim=1, keepdim=True)\n", mod.__dict__)
    return _shim(mod.pooled)


_pooled_elsewhere = _helper_elsewhere()


class DecoratedForwardCallsADecoratedHelper(Bidirectional):
    @_shim
    def forward(self, ids):
        x = self.emb(ids)
        return self.head(x + _pooled_elsewhere(x))  # CALL-LINE


@pytest.mark.skipif(not hasattr(torch.fx.proxy, "_STACK_TRACE_ANCHORS"),
                    reason="this torch has no stack-trace anchors (torch.fx.proxy._STACK_TRACE_ANCHORS)")
def test_a_refusal_under_a_shared_decorator_names_the_models_line():
    """The model's decorated ``forward`` is anchored by the function it wraps, not by the decorator's wrapper: that
    wrapper's code is shared with the helper it also decorates, whose frame then stood for the op, and the refusal
    named the decorator's ``return fn(*args, **kwargs)`` (HF GraniteSWA: transformers' ``deprecation.py``)."""
    import inspect

    source = inspect.getsource(inspect.getmodule(_shim)).splitlines()
    call = next(i for i, text in enumerate(source, 1) if "CALL-LINE" in text and "return" in text)
    with pytest.raises(treecompile.passes.PassError) as info:
        treecompile.compile(DecoratedForwardCallsADecoratedHelper())
    first = next(ln for ln in str(info.value).splitlines() if ln.startswith("  - "))
    assert f"test_compile.py:{call} in forward" in first and "SHIM-LINE" not in first, first


class EagerWrittenOutMaskValue(Bidirectional):
    """Attention written out with the classic finite mask values: ``masked_fill(future, -1e9)`` and an additive
    ``-1e4 * (1 - tril)`` (refused before: only -inf and a dtype's min counted as masked)."""

    def forward(self, ids):
        x = self.emb(ids)
        T = ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        s = (x @ x.transpose(-1, -2) / 8 ** 0.5).masked_fill(~causal, -1e9)
        y = torch.softmax(s, -1) @ x
        s2 = y @ y.transpose(-1, -2) / 8 ** 0.5 - 1e4 * (1 - causal.to(x.dtype))
        return self.head(torch.softmax(s2, -1) @ y)


class LogitsAndHidden(Bidirectional):
    """``return logits, hidden``: two [1, T, *] outputs; the logits are the one as wide as the embedding's rows."""

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h), h


class TwoLogits(Bidirectional):
    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h), self.head(h * 2)


class _FirstOutput(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids)[0]


def test_the_logits_among_several_outputs():
    torch.manual_seed(0)
    model = LogitsAndHidden().double()
    with pytest.warns(UserWarning, match="other outputs .* are not computed"):
        tm = treecompile.compile(model)
    paths = [[1, 2, 3], [1, 4]]
    out = tm(Tree.from_paths(paths).to_batch())
    ref = reference.run(_FirstOutput(model), paths)  # the per-path oracle reads the logits output
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))
    with pytest.raises(treecompile.passes.PassError, match=r"expected exactly one \[1, T, V\] logits output, found 2 "
                                                          r".*the embedding has 11 rows.*return the logits alone"):
        treecompile.compile(TwoLogits())


class HiddenAndLogits(Bidirectional):
    def forward(self, ids):
        h = self.emb(ids)
        return h, self.head(h)


class LogitsInADict(Bidirectional):
    def __init__(self, key: str):
        super().__init__()
        self.key = key

    def forward(self, ids):
        h = self.emb(ids)
        return {"hidden": h, self.key: self.head(h)}


@pytest.mark.parametrize("model_cls,pick", [
    (LogitsAndHidden, lambda out: out[0]), (HiddenAndLogits, lambda out: out[1]),
    (lambda: LogitsInADict("logits"), lambda out: out["logits"]),
    (lambda: LogitsInADict("out"), lambda out: out["out"])],
    ids=["logits_hidden", "hidden_logits", "dict_logits", "dict_other_name"])
def test_the_oracle_reads_the_logits_the_compiler_trains(model_cls, pick):
    """``reference.run`` on a model that returns a tuple or a mapping takes the logits the compiler takes (HF's
    ``.logits`` or a ``"logits"`` key, else the one ``[1, T, V]`` tensor as wide as the input embedding), so that the
    model's own outputs can be checked per path, with no wrapper: the same loss, log-probs and gradients as the
    wrapped model's, and the tree's."""
    torch.manual_seed(0)
    model = model_cls().double()
    paths = [[1, 2, 3], [1, 4], [5]]
    ref = reference.run(model, paths)
    want = reference.run(_Picked(model, pick), paths)
    assert float(ref.loss) == float(want.loss)
    assert all(torch.equal(a, b) for a, b in zip(ref.logprobs, want.logprobs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dropped outputs' warning (test_outputs_other_than_the_logits_...)
        tm = treecompile.compile(model)
    out = tm(Tree.from_paths(paths).to_batch())
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))
    params = list(model.parameters())
    assert rel(flat_grads(out.loss, params), flat_grads(ref.loss, params)) <= 1e-12
    with pytest.raises(ValueError, match=r"expected exactly one \[1, T, V\] logits output, found 2 among the model's "
                                         r"outputs \(tuple: \[\(1, 3, 11\), \(1, 3, 11\)\]; "
                                         r"the input embedding has 11 rows"):
        reference.run(TwoLogits().double(), paths)


class _Picked(torch.nn.Module):
    def __init__(self, model, pick):
        super().__init__()
        self.model, self.pick = model, pick

    def forward(self, ids):
        return self.pick(self.model(ids))


class MultiheadAttentionBoolMask(torch.nn.Module):
    """``nn.MultiheadAttention`` with the usual bool causal mask: it turns the mask into a float one with
    ``zeros_like(mask).masked_fill_(mask, -inf)``, and that dead in-place write kept the ``[T, T]`` mask alive after
    the rewrite (refused as "aten.ones pairs every token")."""

    def __init__(self, need_weights: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = torch.nn.Linear(8, 11)
        self.need_weights = need_weights

    def forward(self, ids):
        h = self.emb(ids)
        T = ids.shape[1]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        return self.head(h + self.mha(h, h, h, attn_mask=mask, need_weights=self.need_weights)[0])


@pytest.mark.parametrize("make, rewrites", [
    (SdpaFiniteMaskValue, {"rewrite_attention": 1}),
    (OffsetPositions, {"rewrite_positions": 5}),
    (EagerWrittenOutMaskValue, {"rewrite_causal_attention": 2}),
    (lambda: MultiheadAttentionBoolMask(need_weights=False), {"rewrite_attention": 1}),
    (lambda: MultiheadAttentionBoolMask(need_weights=True), {"rewrite_causal_attention": 1}),
], ids=["sdpa-mask-1e9", "offset-positions", "written-out-mask-values", "mha-bool-mask", "mha-bool-mask-weights"])
def test_models_once_refused_are_exact(make, rewrites):
    """Models that used to be refused and are now rewritten: each rewrite fires, and loss and every gradient equal
    the per-path run (1e-12)."""
    torch.manual_seed(0)
    model = make().double()
    tm = treecompile.compile(model)
    assert {k: tm.pass_results[k].count for k in rewrites} == rewrites
    _assert_exact_on_a_small_tree(model, tm)


class LogitsRoundedToBf16(Bidirectional):
    """Logits rounded through bfloat16 and back: the fused head computed them in float64 and skipped the rounding
    (log-probs off by 1e-3); the loss now reads the logits as cast."""

    def forward(self, ids):
        x = self.emb(ids)
        x = torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None], is_causal=True)[:, 0]
        return self.head(x).bfloat16().double()


def test_a_rounding_cast_of_the_logits_is_kept():
    """Forward log-probs and loss equal the per-path run's (the gradient through a bfloat16 cast is rounded there
    per path and here once per tree token, so it is compared to bfloat16's precision only)."""
    torch.manual_seed(0)
    model = LogitsRoundedToBf16().double()
    tm = treecompile.compile(model)
    paths = [[1, 2, 3, 4, 5], [1, 2, 6], [1, 7, 8, 9], [3, 3]]
    batch = Tree.from_paths(paths).to_batch()
    out, ref = tm(batch), reference.run(model, paths)
    for a, r in zip(batch.path_logprobs(out.logprobs), ref.logprobs):
        assert float((a - r).abs().max()) <= 1e-12
    assert abs(float(out.loss - ref.loss)) <= 1e-12 * abs(float(ref.loss))


@pytest.mark.parametrize("kind", ["dense", "hybrid", "moe"])
def test_steps_run_under_deterministic_algorithms(kind):
    """Under ``torch.use_deterministic_algorithms(True)`` (no ``warn_only``) a compiled step runs: no op of the
    lowered graph, ours or torch's, raises the not-deterministic error on this device (CPU; the CUDA ops are the
    GPU keeping test's), and two steps give the same loss and gradients bit for bit."""
    from treecompile.models import HybridConfig, HybridForCausalLM

    torch.manual_seed(0)
    model = (tiny_dense() if kind == "dense" else
             HybridForCausalLM(HybridConfig.tiny(**({"num_experts": 4} if kind == "moe" else {}))).double())
    vocab = model.config.vocab_size
    batch = Tree.from_paths([[t % vocab for t in p] for p in ([1, 2, 3, 4, 5], [1, 2, 3, 6, 7, 8], [9, 10, 11])]
                            ).to_batch()
    tm = treecompile.compile(model)
    steps = []
    with deterministic_algorithms(True):
        for _ in range(2):
            model.zero_grad()
            out = tm(batch)
            out.loss.backward()
            steps.append([out.loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(steps[0]) > 1 and all(torch.equal(x, y) for x, y in zip(*steps))
