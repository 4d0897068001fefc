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
    with the stock model's logits; the attention implementation is restored after; the packed baselines' SDPA
    replacement refuses a mask it would otherwise ignore."""
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


def tiny_sliding(family: str, window: int = 4):
    """A tiny float64 HF model with sliding-window layers: Mistral (every layer), Qwen3 (layer types mixed)."""
    common = dict(vocab_size=31, hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=8, sliding_window=window, attention_dropout=0.0)
    torch.manual_seed(0)
    if family == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(num_hidden_layers=2, **common)).double()
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_sliding_window=True, **common)).double()


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_hf_causal_attention_applies_each_layers_window(family):
    """Under ``causal_attention`` a sliding layer gets no mask from HF (a custom attention function has no mask
    function) and applies its own window: the stock model's logits (HF's sliding mask) on 12 tokens with a window
    of 4, through plain SDPA under a window mask and through an SDPA replacement that ``takes_window``; the
    windows the FLOP model and the packing refusal read are the ones applied."""
    from benchmarks import hf_models
    from benchmarks.hf_models import causal_attention, model_windows, window_mask

    model = tiny_sliding(family)
    ids = torch.arange(1, 13)[None]
    with torch.no_grad():
        ref = model(ids, use_cache=False).logits
        with causal_attention(model):
            got = model(ids, use_cache=False).logits
        orig, windows = torch.nn.functional.scaled_dot_product_attention, []

        def takes(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  window=None):
            assert attn_mask is None and is_causal
            windows.append(window)
            mask = None if window is None else window_mask(q.shape[2], window, q.device)
            return orig(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=enable_gqa)

        def ignores(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                    window=None):  # the control: a replacement that dropped the window
            return orig(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)

        takes.takes_window = ignores.takes_window = True
        outs = []
        for fn in (takes, ignores):
            torch.nn.functional.scaled_dot_product_attention = fn
            try:
                with causal_attention(model):
                    outs.append(model(ids, use_cache=False).logits)
            finally:
                torch.nn.functional.scaled_dot_product_attention = orig
    assert torch.allclose(got, ref, rtol=0, atol=1e-12) and torch.allclose(outs[0], ref, rtol=0, atol=1e-12)
    assert (outs[1] - ref).abs().max() > 1e-3  # the window matters on these 12 tokens
    expected = [4, 4] if family == "mistral" else [4, None, 4]
    assert [w for w in windows if w is not None] == [w for w in expected if w is not None]
    assert model_windows(model) == expected
    from benchmarks.harness import ModelSpec  # the packing refusal: windows only where the baseline applies them

    s = ModelSpec("t", "hf", hf_models.HFConfig.of("MistralConfig"))
    assert "no window" in s.packing_refusal(model)
    assert s.packing_refusal(model, windows=True) is None


def test_hf_causal_attention_refuses_what_it_would_drop():
    """Softcapping, sinks and position biases reach the attention function as keyword arguments that HF's SDPA
    path ignores: refused by name; a non-positive window is refused."""
    from benchmarks.hf_models import _causal_sdpa, attention_window

    q = torch.zeros(1, 2, 4, 8)
    mod = torch.nn.Module()
    for kw in (dict(softcap=50.0), dict(s_aux=torch.zeros(2)), dict(position_bias=torch.zeros(1, 2, 4, 4))):
        with pytest.raises(NotImplementedError, match=next(iter(kw))):
            _causal_sdpa(mod, q, q, q, None, **kw)
    with pytest.raises(NotImplementedError, match="dropout"):
        _causal_sdpa(mod, q, q, q, None, dropout=0.1, sliding_window=2)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window must be a positive int"):
            attention_window(mod, bad)


def test_flops_count_each_windows_entries():
    """Entries within a sliding window: a path of L tokens and a tree counted against a dense window mask; the FLOP
    model charges each layer its own window's entries and refuses a bare count for a model with windows."""
    from benchmarks.flops import path_attention_entries, tree_attention_entries
    from benchmarks.hf_models import window_mask
    from treecompile import Tree

    for L in (1, 3, 4, 5, 11):
        for w in (1, 2, 4, 7):
            assert path_attention_entries([L], w) == int(window_mask(L, w, "cpu").sum())
    paths = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 7], [1, 8, 9, 10, 11, 12, 13], [14]]
    tree = Tree.from_paths(paths)
    depth = tree.to_batch().position_ids[:tree.num_tokens]
    for w in (None, 1, 2, 3, 5):
        by_token = {}
        for p in paths:  # each tree token (its prefix) once: it sees min(depth + 1, w) keys
            for i in range(len(p)):
                by_token[tuple(p[:i + 1])] = min(i + 1, w or i + 1)
        assert tree_attention_entries(depth, w) == sum(by_token.values()), w
    model = tiny_sliding("qwen3")
    fm = FlopModel.of(model)
    per_layer = 4.0 * 2 * 8
    assert fm.attention_per_entry == per_layer and fm.windowed == ((4, 2 * per_layer),)
    lens = [12, 3]
    want = 3.0 * fm.linear_per_token * 15 + 3.5 * per_layer * (path_attention_entries(lens)
                                                               + 2 * path_attention_entries(lens, 4))
    assert fm.train(15, lambda w: path_attention_entries(lens, w)) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="sliding-window layers"):
        fm.train(15, path_attention_entries(lens))


def test_harness_sliding_window_model_tree_equals_per_path(tmp_path):
    """HF Mistral with a window of 5 on paths of 24 tokens: the per-path baselines apply the window (their loss is
    the stock model's), the packed flex baseline is skipped naming why, and the tree equals per path."""
    from benchmarks import harness
    from treecompile import Tree

    rc = harness.main(["--device", "cpu", "--tiny", "--model", "hf-mistral-tiny-w5", "--dtype", "float64",
                       "--suite", "sweep", "--por", "0.7", "--paths", "4", "--path-len", "24", "--contenders",
                       "eager_per_path", "compiled_per_path", "packed_flex", "tree", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["contender"]: r for r in csv.DictReader(open(tmp_path / "results.csv"))}
    assert rows["packed_flex"]["status"] == "skipped: sliding-window layers: this packed baseline's document mask " \
                                            "has no window"
    for name in ("eager_per_path", "compiled_per_path(eager: CPU)", "tree"):
        assert rows[name]["status"] == "ok", rows[name]
    tree = rows["tree"]
    assert float(tree["loss_rel_dev"]) < 1e-9 and float(tree["grad_cos"]) > 1 - 1e-9, tree
    # the per-path loss is the stock model's (HF's own sliding mask): the harness's reference applied the window
    spec = harness.model_specs()["hf-mistral-tiny-w5"]
    model = spec.build("cpu", torch.float64)
    case = harness.bench_cases(harness.build_parser().parse_args(
        ["--tiny", "--suite", "sweep", "--por", "0.7", "--paths", "4", "--path-len", "24"]), 512)[0]
    coef = Tree.from_paths([list(p) for p in case.paths]).path_coefficients("sum").tolist()
    with torch.no_grad():
        want = sum(float(harness._path_loss(model(torch.tensor([p]), use_cache=False).logits, torch.tensor(p), c))
                   for p, c in zip(case.paths, coef))
    assert float(rows["eager_per_path"]["loss"]) == pytest.approx(want, rel=1e-12)
    assert 1.0 < float(tree["bound"]) < float(tree["path_tokens"]) / float(tree["tree_tokens"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("varlen", [False, True])
def test_fa4_baseline_window_equals_masked_sdpa(varlen):
    """The FA4 baselines' window (``window_size_left = W - 1``): output and q/k/v gradients of a window of 8 (one
    key more or less moves a row by ~1/8, far above bf16's error; GQA 4:2, head dim 128, bf16) within 2x bf16
    SDPA's error against a float32 SDPA under the window mask; varlen: three sequences packed, the window cut at
    each sequence start."""
    from benchmarks import fa4_baselines
    from benchmarks.hf_models import window_mask
    from treecompile.ops.fa4_tree_attention import fa4_unusable_reason

    if fa4_unusable_reason():
        pytest.skip(fa4_unusable_reason())
    W, lens = 8, [300, 5, 400]
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = sum(lens)
    q, k, v = (torch.randn(1, h, n, 128, device="cuda", generator=gen) for h in (4, 2, 2))
    mask = torch.zeros(n, n, dtype=torch.bool, device="cuda")
    starts = [0]
    for L in lens:
        s = starts[-1]
        mask[s:s + L, s:s + L] = window_mask(L, W, "cuda")
        starts.append(s + L)
    if not varlen:  # one sequence
        mask = window_mask(n, W, "cuda")

    def run(fn, dtype, **kw):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*xs, **kw)
        g = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        out.backward(g.to(dtype))
        return [out.float()] + [x.grad.float() for x in xs]

    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = run(sdpa, torch.float32, attn_mask=mask, enable_gqa=True)
    low = run(sdpa, torch.bfloat16, attn_mask=mask, enable_gqa=True)
    if varlen:
        fa4_baselines.Varlen.cu_seqlens = torch.tensor(starts, device="cuda", dtype=torch.int32)
        fa4_baselines.Varlen.max_seqlen = max(lens)
        got = run(fa4_baselines.fa4_varlen_sdpa, torch.bfloat16, is_causal=True, window=W)
    else:
        got = run(fa4_baselines.fa4_causal_sdpa, torch.bfloat16, is_causal=True, window=W)
    for name, r, lo, g in zip(("out", "dq", "dk", "dv"), ref, low, got):
        err, base = float((g - r).abs().max()), float((lo - r).abs().max())
        assert err <= 2 * base, (name, err, base)
