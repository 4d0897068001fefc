"""treecompile.tracing.export_settings: capture and re-export trace without FakeTensor's dispatch cache,
and the graph (and what it computes) is the one the cache gives."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo.config
from torch._guards import detect_fake_mode

import treecompile
from treecompile import Tree, frontend, saved
from treecompile.models import DenseConfig, DenseForCausalLM

PATHS = [[1, 2, 3, 4], [1, 2, 5], [6, 7]]


def fake_mode(gm):
    return detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder" and "val" in n.meta])


def run(tm):
    out = tm(Tree.from_paths(PATHS).to_batch())
    return [out.loss.detach(), out.logprobs.detach(), *torch.autograd.grad(out.loss, list(tm.parameters()))]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def compiled():
    """(compiled as treecompile does, compiled with torch's default fake cache) of a one-layer float64 model."""
    torch.manual_seed(0)
    model = DenseForCausalLM(DenseConfig.tiny(num_hidden_layers=1, vocab_size=11)).double()
    assert torch._dynamo.config.fake_tensor_cache_enabled  # torch's default, which the settings change
    tm = treecompile.compile(model)
    assert torch._dynamo.config.fake_tensor_cache_enabled  # restored afterwards
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(frontend, "export_settings", contextlib.nullcontext)  # near miss: torch's default
        cached = treecompile.compile(model)
    return tm, cached


def test_compile_traces_without_the_fake_cache_and_gets_the_same_graph(compiled):
    tm, cached = compiled
    assert fake_mode(tm.graph_module).cache_enabled is False  # it fired: the capture's FakeTensorMode
    assert fake_mode(cached.graph_module).cache_enabled is True
    assert tm.graph_module.code == cached.graph_module.code
    assert same(run(tm), run(cached))


def test_reexport_traces_without_the_fake_cache(compiled, tmp_path, monkeypatch):
    tm, cached = compiled
    saved.save(tm, tmp_path / "a")
    ep = saved._REEXPORTED[tm][1]  # the program save re-exported (memoised per TreeModel)
    assert fake_mode(ep.graph_module).cache_enabled is False
    monkeypatch.setattr(saved, "export_settings", contextlib.nullcontext)  # near miss: torch's default
    saved.save(cached, tmp_path / "b")
    ep_cached = saved._REEXPORTED[cached][1]
    assert fake_mode(ep_cached.graph_module).cache_enabled is True
    assert ep.graph_module.code == ep_cached.graph_module.code
    assert same(run(saved.load(tmp_path / "a")), run(saved.load(tmp_path / "b")))  # and computes the same
