"""The hybrid reference model equals HF Qwen3.5 / Qwen3-Next (same safetensors), round-trips its
checkpoints, and exports with its kernel hooks swapped for the registered tree ops."""

import pytest
import torch

from models import HybridConfig, HybridForCausalLM

transformers = pytest.importorskip("transformers")
F64 = torch.float64

CASES = {
    "qwen3_5_dense": dict(model_type="qwen3_5_text"),
    "qwen3_next_dense": dict(model_type="qwen3_next"),
    "qwen3_next_moe": dict(model_type="qwen3_next", num_experts=4),
}


def hf_model(cfg: HybridConfig):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM
    d = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")}
    if cfg.model_type == "qwen3_next":
        hcfg, cls = Qwen3NextConfig(**d), Qwen3NextForCausalLM
    else:
        hcfg, cls = Qwen3_5TextConfig(**d), Qwen3_5ForCausalLM
    hcfg._experts_implementation = "eager"  # the grouped_mm default refuses float64
    torch.manual_seed(0)
    m = cls(hcfg)
    with torch.no_grad():  # HF initialises norms to identity: perturb them so their math is exercised
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) + 0.5 if "linear_attn.norm" in n else torch.randn_like(p) * 0.3)
    return m


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_hf(case, tmp_path):
    """HF computes RMSNorm, the GDN kernel, the decay g, rotary and the router softmax in float32
    even in a float64 model.  Its float64 run (HF64) thus differs from exact float64 math by float32
    rounding at a subset of the places where its all-float32 run (HF32) rounds; max|HF64 - HF32| is
    the scale of that rounding and bounds |ours - HF64| up to a small factor.  A wrong layout, gate
    or decay is >1e3x above it."""
    cfg = HybridConfig.tiny(**CASES[case])
    hf = hf_model(cfg).to(F64)
    hf.save_pretrained(tmp_path / "hf")
    ours = HybridForCausalLM.from_pretrained(tmp_path / "hf", dtype=F64)
    hf32 = hf_model(cfg)
    hf32.load_state_dict(hf.state_dict())
    hf32 = hf32.float()
    ids = torch.randint(0, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b, c = ours(ids), hf(ids).logits, hf32(ids).logits.to(F64)
    budget = (b - c).abs().max()
    assert 0 < budget < 1e-4
    err = (a - b).abs().max()
    assert err <= 2 * budget, f"{case}: |ours - HF64| = {err:.3e} > 2 * {budget:.3e}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_load_round_trip(case, tmp_path):
    cfg = HybridConfig.tiny(**CASES[case])
    torch.manual_seed(0)
    m = HybridForCausalLM(cfg).to(F64)
    m.save_pretrained(tmp_path)
    m2 = HybridForCausalLM.from_pretrained(tmp_path, dtype=F64)
    assert m2.config == cfg
    assert m.state_dict().keys() == m2.state_dict().keys()
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(m(ids), m2(ids))
    # and HF reads our checkpoint (names and shapes are HF's)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=F64, experts_implementation="eager")
    assert type(hf).__name__ == HybridConfig.to_hf_dict(cfg)["architectures"][0]


def test_hf_param_names_match():
    for case in sorted(CASES):
        cfg = HybridConfig.tiny(**CASES[case])
        ours = {k: tuple(v.shape) for k, v in HybridForCausalLM(cfg).state_dict().items()}
        hf = hf_model(cfg)
        theirs = {}
        for k, v in hf.state_dict().items():
            if k.endswith("experts.gate_up_proj"):  # HF fuses experts in memory, writes them per expert
                E, two_i, _ = v.shape
                for e in range(E):
                    base = k[: -len("gate_up_proj")] + f"{e}."
                    theirs[base + "gate_proj.weight"] = (two_i // 2, v.shape[2])
                    theirs[base + "up_proj.weight"] = (two_i // 2, v.shape[2])
            elif k.endswith("experts.down_proj"):
                for e in range(v.shape[0]):
                    theirs[k[: -len("down_proj")] + f"{e}.down_proj.weight"] = tuple(v.shape[1:])
            else:
                theirs[k] = tuple(v.shape)
        assert ours == theirs, case


def test_real_size_configs_are_hf_defaults():
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig
    for ours, theirs in ((HybridConfig.qwen3_5_9b(), Qwen3_5TextConfig()),
                         (HybridConfig.qwen3_next_80b_a3b(), Qwen3NextConfig())):
        d, h = ours.to_hf_dict(), theirs.to_dict()
        diff = {k: (v, h[k]) for k, v in d.items() if k in h and k != "architectures" and h[k] != v}
        assert not diff, diff


def test_config_errors():
    with pytest.raises(ValueError, match="model_type"):
        HybridConfig.tiny(model_type="llama")
    with pytest.raises(ValueError, match="layer_types"):
        HybridConfig.tiny(layer_types=("linear_attention",))
    with pytest.raises(ValueError, match="dense"):
        HybridConfig.tiny(model_type="qwen3_5_text", num_experts=4)
    with pytest.raises(ValueError, match="rope_type"):
        HybridConfig.from_hf_dict({**HybridConfig.tiny().to_hf_dict(), "rope_parameters": {"rope_type": "yarn"}})


def test_export_with_swapped_hooks_is_one_node_per_gdn_layer():
    """Swapping the two hooks for the registered ops makes each GDN layer export (dynamic length)
    with one tree_gated_delta_rule and one tree_causal_conv1d node, and the model is unchanged after."""
    from treecompile import hf_adapters
    cfg = HybridConfig.tiny()
    torch.manual_seed(0)
    m = HybridForCausalLM(cfg).to(F64)
    gdns = [mod for mod in m.modules() if type(mod).__name__ == "GatedDeltaNet"]
    saved = [(g.chunk_gated_delta_rule, g.causal_conv1d_fn) for g in gdns]
    ids = torch.randint(0, cfg.vocab_size, (1, 11))
    with torch.no_grad():
        want = m(ids)
    try:
        for g in gdns:
            g.chunk_gated_delta_rule = hf_adapters.hf_chunk_gated_delta_rule
            g.causal_conv1d_fn = hf_adapters.hf_causal_conv1d_fn
        ep = torch.export.export(m, (ids,), dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=4096)},),
                                 strict=False)
    finally:
        for g, (a, b) in zip(gdns, saved):
            g.chunk_gated_delta_rule, g.causal_conv1d_fn = a, b
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("treecompile.tree_gated_delta_rule.default") == len(gdns)
    assert targets.count("treecompile.tree_causal_conv1d.default") == len(gdns)
    assert all(g.chunk_gated_delta_rule.__name__ == "torch_chunk_gated_delta_rule" for g in gdns)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(ids), want, rtol=1e-10, atol=1e-12)
        ids2 = torch.randint(0, cfg.vocab_size, (1, 77))
        torch.testing.assert_close(ep.module()(ids2), m(ids2), rtol=1e-10, atol=1e-12)
