"""HF transformers models in the benchmark harness (kind "hf") and the FLOP model's routed experts."""

import csv
import statistics

import pytest
import torch

from benchmarks.flops import FlopModel

transformers = pytest.importorskip("transformers")


def tiny_hf_moe(**over):
    cfg = dict(vocab_size=31, hidden_size=16, intermediate_size=24, moe_intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
               tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**cfg, **over}))


def test_flops_count_the_routed_experts_only():
    """HF Qwen3-MoE (fused 3-D experts): per token and layer q/k/v/o, the router, and top-2 of 4 experts'
    gate/up/down; plus the head.  By hand: attention 16*16 + 2*(16*8) + 16*16 = 768, router 4*16 = 64,
    experts 2 * (2*16*16 + 16*16) = 1536; 2 layers; head 16*31 = 496 -> 5232 multiply-adds."""
    fm = FlopModel.of(tiny_hf_moe())
    assert fm.linear_per_token == 2.0 * (2 * (768 + 64 + 1536) + 496)
    assert fm.attention_per_entry == 4.0 * 2 * 8 * 2 and fm.recurrent_per_token == 0.0
    # top-1: half the expert work; a dense MLP layer (mlp_only_layers) costs its 3 * 16 * 24
    assert FlopModel.of(tiny_hf_moe(num_experts_per_tok=1)).linear_per_token == 2.0 * (2 * (768 + 64 + 768) + 496)
    mixed = FlopModel.of(tiny_hf_moe(mlp_only_layers=[0]))
    assert mixed.linear_per_token == 2.0 * ((768 + 3 * 16 * 24) + (768 + 64 + 1536) + 496)


def test_flops_of_our_models():
    """Dense: unchanged (every nn.Linear; by hand for DenseConfig.tiny: per layer q 32*32, k and v 32*16,
    o 32*32, MLP 3*32*48; head 32*97).  Our MoE (a ModuleList of expert MLPs, computed densely): top-k of
    E experts counted, router and shared expert in full."""
    from torch import nn

    from treecompile.models import DenseConfig, DenseForCausalLM, HybridConfig, HybridForCausalLM

    dense = DenseForCausalLM(DenseConfig.tiny())
    assert FlopModel.of(dense).linear_per_token == 2.0 * (2 * (1024 + 2 * 512 + 1024 + 3 * 32 * 48) + 32 * 97)
    cfg = HybridConfig.tiny(num_experts=4)
    moe = HybridForCausalLM(cfg)
    every = sum(m.in_features * m.out_features for m in moe.modules() if isinstance(m, nn.Linear))
    experts = [m.mlp.experts for m in moe.model.layers if hasattr(m.mlp, "experts")]
    assert experts
    in_experts = sum(e.in_features * e.out_features for ex in experts for e in ex.modules() if isinstance(e, nn.Linear))
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    assert k < E and FlopModel.of(moe).linear_per_token == 2.0 * (every - in_experts + in_experts * k // E)


def test_harness_hf_moe_tree_equals_per_path(tmp_path):
    """A tiny HF Qwen3-MoE through the harness in one process (CPU, float64): the per-path baselines,
    packed_flex (document mask over one pack; HF runs its SDPA call without a mask there) and the tree are
    rows "ok", equal in loss and gradient; FA4 contenders are skipped rows with their reason; the tree's
    bound is the FLOP model's (routed experts counted top-k)."""
    from benchmarks import harness

    rc = harness.main(["--device", "cpu", "--tiny", "--model", "hf-qwen3-moe-tiny", "--dtype", "float64",
                       "--suite", "sweep", "--por", "0.7", "--paths", "4", "--path-len", "24", "--contenders",
                       "eager_per_path", "compiled_per_path", "packed_flex", "tree", "compiled_per_path_fa4",
                       "packed_fa4_varlen", "compiled_per_path_fla", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["contender"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    for name in ("eager_per_path", "compiled_per_path(eager: CPU)", "packed_flex", "tree"):
        assert rows[name]["status"] == "ok", rows[name]
    assert float(rows["compiled_per_path(eager: CPU)"]["loss_rel_dev"]) == 0  # the same per-path step, uncompiled
    for name in ("compiled_per_path_fa4", "packed_fa4_varlen"):
        assert rows[name]["status"] == "skipped: FA4 runs on CUDA only"
    assert rows["compiled_per_path_fla"]["status"].startswith("skipped: hybrid models only")
    # packed_flex equal to per path shows its document mask was applied (HF's own causal mask over the
    # pack would let paths see each other); exact up to float64 rounding (HF's float64 model computes its norms in float32; the tree reproduces
    # them op for op: measured 2e-16 for the tree, 2e-11 for the pack, whose attention shapes differ)
    for name in ("packed_flex", "tree"):
        assert float(rows[name]["loss_rel_dev"]) < 1e-9 and float(rows[name]["grad_cos"]) > 1 - 1e-9, rows[name]
    tree = rows["tree"]
    assert int(tree["computed_tokens"]) == int(tree["tree_tokens"]) < int(tree["path_tokens"])
    # every timed step is in the row (the jsonl keeps them as a list; --tiny times one); step_s is their median
    times = {r["contender"]: r for r in harness._read_jsonl(str(tmp_path / "results.jsonl"))}["tree"]["step_times_s"]
    assert len(times) == 1 and float(tree["step_s"]) == pytest.approx(statistics.median(times), rel=1e-3, abs=1e-5)
    assert float(tree["bound"]) > 1.5 and float(rows["packed_flex"]["bound"]) == 1.0


def test_hf_causal_attention_passes_no_mask_and_refuses_more():
    """Under ``causal_attention`` an HF model calls SDPA with no mask, ``is_causal=True`` and GQA through
    ``enable_gqa`` even where stock HF builds an explicit bool mask and repeats K/V (as it does under
    ``torch.compile`` with torch < 2.14: its mask-skip check returns False while tracing; patched to here),
    with the stock model's logits; the attention implementation is restored after; a sliding-window layer
    is refused; the packed baselines' SDPA replacement refuses a mask it would otherwise ignore."""
    from unittest import mock

    from benchmarks import harness
    from benchmarks.hf_models import causal_attention

    torch.manual_seed(0)
    model = tiny_hf_moe().double()
    model.set_experts_implementation("eager")
    ids = torch.arange(1, 9)[None]
    seen, orig = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        seen.append((attn_mask is None, is_causal, enable_gqa, k.shape[1]))
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    with torch.no_grad(), mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", spy):
        ref = model(ids, use_cache=False).logits
        assert seen[-1] == (True, True, True, 1)  # stock HF, eager: no mask
        with mock.patch("transformers.masking_utils._ignore_causal_mask_sdpa", lambda *a, **k: False):
            stock = model(ids, use_cache=False).logits
            assert seen[-1] == (False, False, False, 2)  # explicit mask, K/V repeated
            seen.clear()
            with causal_attention(model):
                got = model(ids, use_cache=False).logits
    assert seen and all(s == (True, True, True, 1) for s in seen), seen
    assert torch.equal(got, ref) and torch.allclose(stock, ref, rtol=0, atol=1e-12)
    assert model.config._attn_implementation == "sdpa"
    sliding = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=0))
    with pytest.raises(NotImplementedError, match="sliding_window=4"), causal_attention(sliding):
        sliding(ids, use_cache=False)
    assert sliding.config._attn_implementation == "sdpa"
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="causal SDPA without mask"):
        harness.document_sdpa(harness._Packed)(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))


def test_hf_dense_spec_has_our_qwen3_shape():
    """``hf-qwen3-0.6b`` is HF's Qwen3 at ``qwen3-0.6b``'s shape: the same parameter names and shapes (tied
    head), the same FLOP model (built on the meta device: no memory, no init)."""
    from benchmarks import harness

    specs = harness.model_specs()
    hf, ours = specs["hf-qwen3-0.6b"], specs["qwen3-0.6b"]
    assert hf.kind == "hf" and hf.config.vocab_size == ours.config.vocab_size
    from treecompile.models import DenseForCausalLM

    with torch.device("meta"):
        a = transformers.AutoModelForCausalLM.from_config(hf.config.build())
        b = DenseForCausalLM(ours.config)
    assert {k: v.shape for k, v in a.named_parameters()} == {k: v.shape for k, v in b.named_parameters()}
    assert FlopModel.of(a) == FlopModel.of(b)
    moe = specs["qwen3-30b-a3b-4l"].config.build()
    assert (moe.num_hidden_layers, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size,
            moe.hidden_size, moe.num_attention_heads, moe.num_key_value_heads, moe.head_dim) == (4, 128, 8, 768, 2048,
                                                                                                   32, 4, 128)


def test_hf_moe_hybrid_spec_has_the_qwen3_5_35b_a3b_layer_shape():
    """``qwen3.5-35b-a3b-8l``: HF Qwen3.5-MoE with the 35B-A3B text layers (the config class's defaults, as
    they stand in this transformers), 8 layers of 3 GDN : 1 attention; its GDN layers are found by the
    baselines' hook discovery (the capture's), and the FLOP model counts 8 routed experts + the shared one."""
    from benchmarks import harness
    from treecompile.frontend import gdn_hook_owners

    cfg = harness.model_specs()["qwen3.5-35b-a3b-8l"].config.build()
    default = transformers.Qwen3_5MoeTextConfig()
    for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "tie_word_embeddings", "rope_parameters"):
        assert getattr(cfg, k) == getattr(default, k), k
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert gdn_hook_owners(model)
    fm = FlopModel.of(model)
    D, I, E, k = 2048, 512, 256, 8
    experts = 8 * (k * 3 * D * I + 3 * D * I + D * E + D)  # routed top-8, shared expert, router, shared gate
    assert fm.linear_per_token - 2 * experts == 2 * sum(
        m.in_features * m.out_features for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".mlp." not in n)
