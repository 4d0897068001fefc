"""``TreeModel.split_at``: the graph cut per module, each module's part run through its ``__call__``.

Split and unsplit runs compute the same values with the same ops in the same order, so loss,
log-probs and gradients are compared for equality (float64).  Hooks registered on the modules fire
once per step, in layer order, and see the parameters the segment reads.
"""

from __future__ import annotations

import copy

import pytest
import torch

import treecompile
from treecompile import Tree
from treecompile.models import DenseConfig, DenseForCausalLM, HybridConfig, HybridForCausalLM
from treecompile.passes.split_modules import SplitError
from helpers import cached_compile, cached_model, tiny_dense


def _dense3():
    torch.manual_seed(0)
    return DenseForCausalLM(DenseConfig.tiny(num_hidden_layers=3)).double()


PATHS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 10], [1, 2, 11, 12, 13, 14, 15], [1, 7]]


def _run(tmodel, batch):
    out = tmodel(batch)
    params = [p for p in tmodel.parameters()]
    grads = torch.autograd.grad(out.loss, params)
    return out.loss.detach(), out.logprobs.detach(), grads


def _check_equal(tmodel, layers):
    batch = Tree.from_paths(PATHS).to_batch(normalize="path_mean")
    loss0, lp0, g0 = _run(tmodel, batch)
    seen = []
    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: seen.append(i)) for i, m in enumerate(layers)]
    try:
        tmodel.split_at(layers)
        loss1, lp1, g1 = _run(tmodel, batch)
    finally:
        for h in handles:
            h.remove()
    assert seen == list(range(len(layers)))
    assert torch.equal(loss0, loss1) and torch.equal(lp0, lp1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)
    assert all("forward" not in m.__dict__ for m in layers)  # the class forward is back
    tmodel.split_at(())
    loss2, _, _ = _run(tmodel, batch)
    assert torch.equal(loss0, loss2)


def test_dense_split_per_layer_equals_whole_graph():
    model = cached_model("dense-tiny-3-layers", _dense3)
    _check_equal(cached_compile(model), list(model.model.layers))


def test_hybrid_split_per_layer_equals_whole_graph():
    torch.manual_seed(0)
    # 2 layers (tiny's 4 halved: the capture costs half), one of each kind: a GDN layer's segment
    # (its conv and recurrent state inside the module) and an attention layer's
    model = HybridForCausalLM(HybridConfig.tiny(num_hidden_layers=2,
                                                layer_types=("linear_attention", "full_attention"))).double()
    _check_equal(treecompile.compile(model), list(model.model.layers))


def test_hf_qwen3_split_per_layer_equals_whole_graph():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).double().eval()
    _check_equal(treecompile.compile(model), list(model.model.layers))


def test_module_hooks_see_the_segment_parameters_and_backward_hooks_fire():
    model = cached_model("dense-tiny", tiny_dense)
    tmodel = cached_compile(model).split_at(model.model.layers)
    layer = model.model.layers[1]
    orig = layer.mlp.down_proj.weight
    swapped = orig.detach().clone().requires_grad_(True)
    fired = []

    def swap_in(mod, args):  # what FSDP2's pre-forward does: new tensors for the layer's parameters
        del mod.mlp.down_proj.weight
        mod.mlp.down_proj.weight = torch.nn.Parameter(swapped)

    layer.register_forward_pre_hook(swap_in)
    layer.register_full_backward_hook(lambda mod, gin, gout: fired.append(len(gout)))
    out = tmodel(Tree.from_paths(PATHS).to_batch())
    out.loss.backward()
    assert fired == [1]  # the layer's hidden-state output
    assert orig.grad is None and layer.mlp.down_proj.weight.grad is not None  # read inside the call


def test_split_errors_name_the_module():
    model = cached_model("dense-tiny", tiny_dense)
    tmodel = cached_compile(model)
    with pytest.raises(ValueError, match="not a submodule"):
        tmodel.split_at([torch.nn.Linear(2, 2)])
    with pytest.raises(SplitError, match="lies inside"):
        tmodel.split_at([model.model.layers[0], model.model.layers[0].mlp])
    unused = DenseForCausalLM(DenseConfig.tiny())
    model.extra = unused.model.norm  # registered but never called by forward
    with pytest.raises(SplitError, match="no graph node belongs to module"):
        tmodel.split_at([model.extra])
    with pytest.raises(SplitError, match="reads '(lm_head|model.embed_tokens).weight', which belongs to module "
                                         "'model.embed_tokens' \\(tied"):
        tied = DenseForCausalLM(DenseConfig.tiny(tie_word_embeddings=True)).double()
        treecompile.compile(tied).split_at([tied.model.embed_tokens])


def test_cuda_lowered_graph_splits_per_layer_with_the_block_mask_as_input():
    """The graph run on CUDA (flex lowering, one BlockMask placeholder) splits the same way; each
    layer segment takes the mask and holds its own attention call (CPU: structure only)."""
    from treecompile.passes.lower_cuda import CudaOptions, lower_cuda

    model = cached_model("dense-tiny-3-layers", _dense3)
    tmodel = cached_compile(model).split_at(model.model.layers)
    low = lower_cuda(tmodel.graph_module, CudaOptions(gdn_kernel="reference"))
    lowered, count = low.graph_module, low.attention
    owners = [f"model.layers.{i}" for i in range(3)]
    split = tmodel.program.split_graph(lowered)
    segs = [s for s, _ in split.segments]
    assert [s.owner for s in segs] == [None] + owners + [None] and count == 3
    assert split.batch_names[-1] == "tree_block_mask" and len(split.result) == 2
    fqn = {x.name: x.target for x in tmodel.program.lifted}
    for s in segs[1:-1]:
        assert "tree_block_mask" in s.inputs and len(s.outputs) == 1
        assert all(fqn[n].startswith(s.owner + ".") for n in s.lifted)
        assert sum(n.op == "call_function" and "flex" in n.name for n in s.graph_module.graph.nodes) == 1


class _SharedScaleModel(torch.nn.Module):
    """Each layer reads a parameter held by the root (as models with a shared table do)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(17, 8)
        self.scale = torch.nn.Parameter(torch.rand(8) + 0.5)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        for layer in self.layers:
            object.__setattr__(layer, "root", self)  # not registered: the parameter stays the root's
        self.head = torch.nn.Linear(8, 17)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x) * layer.root.scale)
        return self.head(x)


def test_layers_may_read_the_roots_parameters():
    torch.manual_seed(0)
    model = _SharedScaleModel().double()
    _check_equal(treecompile.compile(model), list(model.layers))


def test_module_tensor_reads_what_get_parameter_reads():
    """The program's lookup of its lifted tensors (``program.module_tensor``, through the modules' dicts) gives the
    tensor ``get_parameter`` / ``get_buffer`` gives, for every name, after a parameter is swapped (what FSDP2 does
    around a forward), and a missing name raises ``nn.Module``'s own error."""
    from treecompile.program import module_tensor

    model = _dense3()
    model.register_buffer("scale", torch.ones(3))
    model.model.layers[1].register_buffer("step", torch.zeros(()))
    for name, _ in model.named_parameters(remove_duplicate=False):
        assert module_tensor(model, name, parameter=True) is model.get_parameter(name), name
    for name, _ in model.named_buffers():
        assert module_tensor(model, name, parameter=False) is model.get_buffer(name), name
    name = "model.layers.2.mlp.down_proj.weight"
    fresh = torch.nn.Parameter(model.get_parameter(name).detach().clone())
    model.model.layers[2].mlp.down_proj.weight = fresh
    assert module_tensor(model, name, parameter=True) is fresh
    with pytest.raises(AttributeError, match="no attribute `nope`|has no attribute"):
        module_tensor(model, "model.nope.weight", parameter=True)
    with pytest.raises(AttributeError):
        module_tensor(model, "model.layers.0.mlp.down_proj.missing", parameter=True)


def test_lifted_values_are_the_lifted_tensors_looked_up_now():
    """``TreeProgram.lifted_values`` (every step's lookup, one walk of the module dicts) gives, tensor for tensor,
    what ``lifted_value`` gives one by one: after a parameter is swapped, after a whole submodule is replaced (the walk
    keeps names, not modules), and a submodule set to None falls back to the one-by-one lookup and its error."""
    from helpers import cached_compile, cached_model, tiny_dense

    model = cached_model("dense-tiny", tiny_dense)
    prog = cached_compile(model).program

    def same():
        got = prog.lifted_values()
        assert len(got) == len(prog.lifted) and all(a is prog.lifted_value(x) for a, x in zip(got, prog.lifted))
        return got

    before = same()
    mlp = model.model.layers[1].mlp
    fresh = torch.nn.Parameter(mlp.down_proj.weight.detach().clone())
    old_param, old_mlp = mlp.down_proj.weight, mlp
    try:
        mlp.down_proj.weight = fresh
        assert any(t is fresh for t in same())
        model.model.layers[1].mlp = copy.deepcopy(old_mlp)
        after = same()
        assert not any(t is fresh for t in after) and len(after) == len(before)
        model.model.layers[1].mlp = None
        with pytest.raises(AttributeError):
            prog.lifted_values()
    finally:
        model.model.layers[1].mlp = old_mlp
        old_mlp.down_proj.weight = old_param
    assert all(a is b for a, b in zip(same(), before))
