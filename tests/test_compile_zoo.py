"""More unmodified HF causal LMs (tiny random configs, float64) on a tree, and dropout handling."""

from __future__ import annotations

import warnings

import pytest
import torch

import treecompile
from treecompile import Tree, reference
from treecompile.passes import PassError
from helpers import KeepFloat64, flat_grads, float64_reference, materialized_run_is_exact, reference_noise, rel

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
ZOO = {  # name: (model class, config class, config kwargs) - what each adds to the Llama/Qwen3 tests
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", COMMON),  # q/k/v biases
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(COMMON, sliding_window=None)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", COMMON),  # fused qkv / gate_up
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(COMMON, head_dim=8)),  # scaled embeddings, (1+w) norms
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", COMMON),  # post-norms, q/k norms over all heads
    "granite": ("GraniteForCausalLM", "GraniteConfig", COMMON),  # logit/residual/attention multipliers
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",  # partial rotary, parallel residual
                 dict(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=48, max_position_embeddings=256)),
    "phi": ("PhiForCausalLM", "PhiConfig",  # partial rotary, lm_head bias
            dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=256)),
    "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Config",  # NoPE layers (every 4th layer has no RoPE)
                dict(COMMON, num_hidden_layers=4)),
    "falcon": ("FalconForCausalLM", "FalconConfig",  # kv heads broadcast_to the query heads, parallel attention/MLP
               dict(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    new_decoder_architecture=True, num_kv_heads=2, bias=False, max_position_embeddings=256)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config",  # learned absolute positions (wpe), no RoPE
             dict(vocab_size=37, n_embd=32, n_layer=2, n_head=4, n_positions=256, attn_pdrop=0.0,
                  resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=1, eos_token_id=2)),
}
PATHS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 10], [1, 2, 11, 12, 13, 14, 15], [1, 2, 3, 4, 5, 6], [1, 7]]


@pytest.mark.parametrize("name", sorted(ZOO))
def test_hf_model_tree_equals_per_path(name):
    mcls, ccls, kw = ZOO[name]
    if not hasattr(transformers, mcls):
        pytest.skip(f"transformers has no {mcls}")
    torch.manual_seed(0)
    model = getattr(transformers, mcls)(getattr(transformers, ccls)(**kw)).double()
    tmodel = treecompile.compile(model)
    assert tmodel.pass_results["rewrite_attention"].count == model.config.num_hidden_layers  # one per layer
    assert tmodel.pass_results["rewrite_positions"].count >= 1
    batch = Tree.from_paths(PATHS).to_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    out = tmodel(batch)
    ref = reference.run(model, PATHS)
    g_tree, g_ref = flat_grads(out.loss, params), flat_grads(ref.loss, params, retain_graph=True)  # noise reads ref
    g_err, loss_err = rel(g_tree, g_ref), abs(float(out.loss - ref.loss))

    def within(g_noise, loss_noise):
        return g_err <= 10 * g_noise + 1e-12 and loss_err <= 10 * loss_noise + 1e-12 * abs(float(ref.loss))

    g_noise, loss_noise = reference_noise(model, PATHS, None, None, batch, ref, params, g_ref, enough=within)
    assert g_err <= 10 * g_noise + 1e-12
    assert loss_err <= 10 * loss_noise + 1e-12 * abs(float(ref.loss))
    for a, r in zip(batch.path_logprobs(out.logprobs.detach()), ref.logprobs):
        assert float((a - r.detach()).abs().max()) <= 1e-6  # float32 internals: per-token log-probs agree
    # the compiled CUDA lowering's position-only values (RoPE's cos/sin from inv_freq and the positions),
    # computed once: the same graph values bit for bit; GPT-2's learned positions read a parameter (none)
    tables = 0 if name == "gpt2" else 2
    assert materialized_run_is_exact(tmodel, batch) == tables
    with warnings.catch_warnings():  # the CUDA lowering built on CPU: its kernel choices warn (no fla, no GPU)
        warnings.simplefilter("ignore")
        lowering = tmodel.program._cuda_state().lowering
    assert lowering.materialized == tables  # the program hands lower_cuda its buffers (inv_freq)


class WithDropout(torch.nn.Module):
    def __init__(self, p=0.1):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.drop = torch.nn.Dropout(p)
        self.head = torch.nn.Linear(8, 11)

    def forward(self, ids):
        x = self.drop(self.emb(ids))[:, None]
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
        return self.head(x[:, 0])


def test_active_dropout_is_refused_naming_the_module():
    with pytest.raises(PassError, match=r"module drop \(Dropout\).*dropout p=0.1 is active"):
        treecompile.compile(WithDropout().train())


def test_dropout_in_eval_mode_or_allowed():
    torch.manual_seed(0)
    model = WithDropout().double().eval()
    tm = treecompile.compile(model)  # captured in eval mode: dropout is the identity
    paths = [[1, 2, 3], [1, 2, 4, 5]]
    torch.testing.assert_close(tm(Tree.from_paths(paths).to_batch()).loss, reference.run(model, paths).loss,
                               rtol=1e-12, atol=0)
    allowed = treecompile.compile(WithDropout().train(), allow_dropout=True)
    assert allowed.pass_results["check_dropout"].info["active_dropout"] == 1


SLIDING = {"mistral": ("MistralForCausalLM", "MistralConfig", {}),
           "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(use_sliding_window=True, max_window_layers=0)),
           "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(head_dim=8, num_hidden_layers=3,
                                                                    sliding_window_pattern=2)),
           # eager attention (no SDPA path): soft-capped scores, sliding layers between global ones
           "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(head_dim=8, num_hidden_layers=3))}
# deep enough that the window cuts every path, with branches below and above the window's reach
DEEP_PATHS = [list(range(1, 15)), [1, 2, 3, 4, 5, 6, 20, 21, 22, 23, 24], [1, 2, 30, 31, 32, 33, 34, 35, 36],
              [1, 2, 3, 4, 5, 6, 20, 21, 25], [9, 8]]


def _sliding_model(family, window):
    mcls, ccls, kw = SLIDING[family]
    if not hasattr(transformers, mcls):
        pytest.skip(f"transformers has no {mcls}")
    torch.manual_seed(0)
    return getattr(transformers, mcls)(getattr(transformers, ccls)(**{**COMMON, "sliding_window": window, **kw}))


@pytest.mark.parametrize("family, window", [("mistral", 3), ("mistral", 4096), ("qwen2", 4), ("gemma3", 5),
                                            ("gemma2", 4), ("gemma2", 4096)])
def test_hf_sliding_window_on_a_tree(family, window):
    """A sliding window of W tokens: each token sees the W - 1 tokens above it on its own path, as in the per-path
    run (SDPA: ``tree_attention_windowed``; eager attention: ``tree_attention_biased`` with a window; the window
    read off the model's mask and checked past it)."""
    model = _sliding_model(family, window).double()
    tmodel = treecompile.compile(model)
    layers = model.config.num_hidden_layers
    types = getattr(model.config, "layer_types", None) or ["sliding_attention"] * layers
    eager = family == "gemma2"
    info = tmodel.pass_results["rewrite_causal_attention" if eager else "rewrite_attention"]
    assert info.count == layers and info.info["windowed"] == types.count("sliding_attention") > 0
    if eager:
        assert info.info["softcapped"] == layers
    assert_tree_equals_per_path(model, tmodel, DEEP_PATHS)


def test_float64_reference_measures_the_models_float32_steps():
    """The upper bounds' last noise figure, (e) of ``helpers.reference_noise``: Gemma 2 runs its eager softmax in
    float32 (a tree row sums a path's keys in other vector lanes than the path's own row, so the tree can round
    otherwise where every per-path computation rounds alike); under ``KeepFloat64`` the same model
    keeps them in float64, and its distance from the reference is float32-sized: nonzero, and far below what a
    wrong attention gives."""
    with KeepFloat64():
        x = torch.randn(5, dtype=torch.float64)
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64 and x.float() is x
        assert x.to(torch.float32).dtype == torch.float64 == torch.zeros(2, dtype=torch.float32).dtype
        assert torch.arange(3).float().dtype == torch.float64  # positions made float, as rotary embeddings do
    model = _sliding_model("gemma2", 4096).double()
    params = [p for p in model.parameters() if p.requires_grad]
    ref = reference.run(model, DEEP_PATHS)
    loss, g = float64_reference(model, DEEP_PATHS, None, None, params)
    assert 1e-12 < abs(float(loss - ref.loss)) / abs(float(ref.loss)) < 1e-7
    assert 1e-12 < rel(g, flat_grads(ref.loss, params)) < 1e-5


def test_float64_reference_of_a_checkpointed_model():
    """Activation checkpointing recomputes in the autograd engine, where ``KeepFloat64`` does not reach (the
    recompute would be float32 where the forward was float64): (e) runs with the HF layers' flag off, gives the
    values it gives without checkpointing, and leaves the flag on."""
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).double()
    params, paths = list(model.parameters()), [[1, 2, 3, 4], [1, 2, 5]]
    want = float64_reference(model, paths, None, None, params)
    model.gradient_checkpointing_enable()
    model.train()
    got = float64_reference(model, paths, None, None, params)
    assert float(got[0]) == float(want[0]) and torch.equal(got[1], want[1])
    assert all(m.gradient_checkpointing for m in model.model.layers)


@pytest.mark.parametrize("family, window, message", [
    ("mistral", 100_000, r"compares positions with 100000 .*at most 8192"),  # too large to check past: refused by name
    # eager attention probes its scores up to 8,192 tokens too
    ("gemma2", 10_000,
     r"hand-written attention whose mask or bias compares positions with 10000 .*\[10002, 10002\] scores"),
])
def test_hf_sliding_window_past_the_check_is_refused(family, window, message):
    """A sliding window is causal at every length up to the window, so a mask checked at short lengths alone would
    pass it as causal (it did, for any window over 9 tokens): the check evaluates the mask past every number it
    holds, and refuses by name a number too large to check past."""
    with pytest.raises(PassError, match=message):
        treecompile.compile(_sliding_model(family, window).double())


def assert_tree_equals_per_path(model, tmodel, paths):
    """Loss and every gradient within 10x the reference's own rounding (``helpers.reference_noise``)."""
    batch = Tree.from_paths(paths).to_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    out = tmodel(batch)
    ref = reference.run(model, paths)
    g_tree, g_ref = flat_grads(out.loss, params), flat_grads(ref.loss, params, retain_graph=True)
    g_err, loss_err = rel(g_tree, g_ref), abs(float(out.loss - ref.loss))

    def within(g_noise, loss_noise):
        return g_err <= 10 * g_noise + 1e-12 and loss_err <= 10 * loss_noise + 1e-12 * abs(float(ref.loss))

    g_noise, loss_noise = reference_noise(model, paths, None, None, batch, ref, params, g_ref, enough=within)
    assert within(g_noise, loss_noise), (g_err, loss_err, g_noise, loss_noise)


MOE = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


MLA = dict(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, head_dim=4, qk_rope_head_dim=4, qk_nope_head_dim=4,
           v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
           n_group=1, topk_group=1, first_k_dense_replace=1)


@pytest.mark.parametrize("mcls, ccls, kw", [
    # forward(input_ids, **kwargs): use_cache goes through the config, not a dynamic_shapes key torch.export refuses
    ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(MOE, num_local_experts=4, num_experts_per_tok=2)),
    # attn_output.transpose(1, 2).view(1, T, -1) after its SDPA: the tree attention's result keeps SDPA's layout
    ("AfmoeForCausalLM", "AfmoeConfig", dict(MOE, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                             num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1,
                                             sliding_window=4096, layer_types=["full_attention"] * 2)),
    # MLA's expand_kv fills key_states = kv.new_empty(...) by slices (new_empty reads only kv's dtype/device)
    ("DeepseekV3ForCausalLM", "DeepseekV3Config", {**MOE, **MLA}),
    # and DeepSeek-V2's RoPE: torch.polar + view_as_complex / view_as_real
    ("DeepseekV2ForCausalLM", "DeepseekV2Config", {**MOE, **MLA}),
    # eager attention: float32 scores plus a float64 mask (the softmax runs in float64, as the model's does)
    ("GPTJForCausalLM", "GPTJConfig", dict(vocab_size=37, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                           n_positions=256, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    # and the mask added before the scale: finfo.min / sqrt(d) still masks
    ("CodeGenForCausalLM", "CodeGenConfig", dict(vocab_size=37, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                                 n_positions=256, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    # scores made by baddbmm as [heads, T, T] and viewed to [1, heads, T, T] before the softmax (session 46)
    ("GPTNeoXJapaneseForCausalLM", "GPTNeoXJapaneseConfig", dict(vocab_size=37, hidden_size=32, num_hidden_layers=2,
                                                                 num_attention_heads=4, max_position_embeddings=256,
                                                                 hidden_dropout=0.0, attention_dropout=0.0)),
    # hierarchical cycles, the first inner cycle of each outer one under torch.no_grad() (session 46: those regions
    # are inlined on detached inputs, frontend.inline_no_grad)
    ("HrmTextForCausalLM", "HrmTextConfig", dict(MOE, head_dim=8)),
    # transformers 5.24 (session 35): recurrent depth, the middle layer called twice per forward (one module, two
    # attention sites), unit-norm hidden states, float32 logits scaled per token
    ("DoryForCausalLM", "DoryConfig", dict(MOE, head_dim=8, num_hidden_layers=3, n_input_layers=1,
                                           n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2,
                                           sliding_window=4, layer_types=["sliding_attention", "full_attention",
                                                                          "sliding_attention"])),
])
def test_hf_models_found_by_the_zoo_sweep(mcls, ccls, kw):
    """Families a sweep over transformers' causal LMs found refused by treecompile's own bugs or by token rules
    stricter than the ops (sessions 28, 29), and new families of a transformers release (session 35)."""
    if not hasattr(transformers, mcls):
        pytest.skip(f"transformers has no {mcls}")
    torch.manual_seed(0)
    model = getattr(transformers, mcls)(getattr(transformers, ccls)(**kw)).double().eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    use_cache = model.config.use_cache
    tmodel = treecompile.compile(model)
    assert model.config.use_cache == use_cache  # set for the capture only
    if mcls == "DoryForCausalLM":  # 3 layers, the middle one looped twice: 4 attention sites
        assert tmodel.pass_results["rewrite_attention"].count == 4
    if mcls == "HrmTextForCausalLM":  # 2 outer cycles x (3 inner + 1 outer) stacks of 2 layers, every one rewritten
        assert tmodel.pass_results["rewrite_attention"].count == 16
    assert_tree_equals_per_path(model, tmodel, PATHS)


@pytest.mark.parametrize("mcls, ccls, kw", [
    ("GraniteSWAForCausalLM", "GraniteSWAConfig", {}),
    ("GraniteMoeSWAForCausalLM", "GraniteMoeSWAConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
])
def test_hf_sinks_as_a_post_softmax_scale(mcls, ccls, kw):
    """GraniteSWA's attention sinks (transformers 5.24): eager attention scaled after ``probs @ v`` by
    ``sigmoid(logsumexp(scores) - sink)``, the same function as one more logit per row in the softmax.  Refused in
    session 45 (the logsumexp over the scores mixes tokens); now the tree attention op with that sink column, on a
    full and a 4-token sliding layer, with random sinks; equal to per-path (the sinks' gradients too)."""
    if not hasattr(transformers, mcls):
        pytest.skip(f"transformers has no {mcls}")
    torch.manual_seed(0)
    cfg = getattr(transformers, ccls)(**{**MOE, **kw, "sliding_window": 4,
                                         "layer_types": ["sliding_attention", "full_attention"]})
    model = getattr(transformers, mcls)(cfg).double().eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    assert len(sinks) == 2
    with torch.no_grad():
        for p in sinks:
            p.normal_(0.0, 2.0)
    tmodel = treecompile.compile(model)
    info = tmodel.pass_results["rewrite_causal_attention"]
    assert info.count == 2 and info.info["with_sinks"] == 2 and info.info["windowed"] == 1
    assert_tree_equals_per_path(model, tmodel, DEEP_PATHS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [16, 100])
def test_hf_sliding_window_on_cuda(window):
    """HF Mistral (float32, CUDA) with a sliding window, compiled and lowered for CUDA: its windowed tree
    attention runs FlexAttention under the pruned window BlockMask.  Loss and gradients against the float64
    per-path oracle within 2x the float32 per-path run's own error (plus one float32 rounding)."""
    import copy
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     max_position_embeddings=4096, sliding_window=window)
    oracle = transformers.MistralForCausalLM(cfg).double()
    model = copy.deepcopy(oracle).float().cuda()
    g = torch.Generator().manual_seed(window)
    trunk = torch.randint(1, 97, (150,), generator=g).tolist()
    paths = [trunk[:n] + torch.randint(1, 97, (m,), generator=g).tolist()
             for n, m in [(150, 60), (40, 120), (120, 30), (0, 50), (149, 1)]]
    tm = treecompile.compile(model)
    assert tm.pass_results["rewrite_attention"].info["windowed"] == 2
    assert_cuda_float32_within_per_path_error(tm, model, oracle, paths)


def assert_cuda_float32_within_per_path_error(tmodel, model, oracle, paths):
    """``tmodel`` (compiled from ``model``, float32 on CUDA) against the float64 per-path ``oracle`` (a CPU copy
    of the same weights): loss and gradients within 2x the float32 per-path run's own error, plus one float32
    rounding."""
    out = tmodel(Tree.from_paths(paths).to_batch(device="cuda"))
    ref32, ref64 = reference.run(model, paths), reference.run(oracle, paths)
    params32, params64 = list(model.parameters()), list(oracle.parameters())
    g_tree, g_ref = flat_grads(out.loss, params32), flat_grads(ref32.loss, params32)
    g_oracle = flat_grads(ref64.loss, params64)
    u = torch.finfo(torch.float32).eps / 2
    for name, got, ref, want in (("loss", out.loss, ref32.loss, ref64.loss), ("grad", g_tree, g_ref, g_oracle)):
        e_tree = rel(got.detach().double().cpu(), want.detach().double())
        e_ref = rel(ref.detach().double().cpu(), want.detach().double())
        assert e_tree <= 2 * e_ref + u, f"{name}: tree error {e_tree:.3g} > 2 * per-path float32 {e_ref:.3g} + {u:.1g}"


def test_hf_experts_without_a_treecompile_op_run_their_own_forward(tmp_path):
    """gpt-oss: experts with biases, interleaved [gate, up] and a clamped SwiGLU (no ``moe_experts`` layout) run
    as ``treecompile::experts_module`` (their own eager forward, one opaque call); its eager attention has sinks
    and subtracts the row maximum, and every other layer slides a window.  Exact on a deep tree; saving the
    program is refused by name (the op names a module of this process)."""
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("transformers has no GptOssForCausalLM")
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**{**MOE, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
                                       "sliding_window": 4, "num_hidden_layers": 2,
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    model = transformers.GptOssForCausalLM(cfg).double().train()
    model.set_experts_implementation("eager")
    tmodel = treecompile.compile(model)
    info = tmodel.pass_results["rewrite_causal_attention"].info
    assert tmodel.pass_results["rewrite_causal_attention"].count == 2
    assert info["with_sinks"] == 2 and info["windowed"] == 1
    ops = [n.target for n in tmodel.graph_module.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.treecompile.experts_module.default) == 2
    assert_tree_equals_per_path(model, tmodel, DEEP_PATHS)
    with pytest.raises(ValueError, match=r"experts_module.*GptOssExperts.*cannot be saved"):
        treecompile.save(tmodel, tmp_path / "gpt_oss")
    assert not (tmp_path / "gpt_oss").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_hf_gpt_oss_on_cuda():
    """gpt-oss (float32, CUDA) compiled and lowered for CUDA: ``experts_module`` (its own eager experts loop), the
    dense eager attention with sinks and a sliding window.  Loss and gradients against the float64 per-path
    oracle within 2x the float32 per-path run's own error (plus one float32 rounding)."""
    import copy
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**{**MOE, "vocab_size": 97, "hidden_size": 64, "head_dim": 16,
                                       "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    oracle = transformers.GptOssForCausalLM(cfg).double()
    oracle.set_experts_implementation("eager")
    model = copy.deepcopy(oracle).float().cuda()
    assert_cuda_float32_within_per_path_error(treecompile.compile(model), model, oracle, DEEP_PATHS)


def test_windowed_layers_lowered_to_flex_under_their_window_mask(monkeypatch):
    """Gemma 3's sliding layers (W = 5) are lowered to FlexAttention under one window block mask input shared by
    both (its kernel resolved at trace time as the causal layers'); the causal layers keep their own.  Under
    ``attention_kernel="fa4_varlen"`` both kinds take the varlen ops (the sliding ones FA4's own window over the
    segments), with no block mask; ``"auto"`` keeps flex for a float64 record (FA4 takes half precision)."""
    import treecompile.passes.lower_cuda as tc_cuda
    from treecompile.ops.flex_tree_attention import tree_window_block_mask
    tmodel = treecompile.compile(_sliding_model("gemma3", 5).double())
    for compiled, fn in ((True, tc_cuda._flex_windowed), (False, tc_cuda._flex_windowed_eager)):
        low = tc_cuda.lower_cuda(tmodel.graph_module, tc_cuda.CudaOptions(compile_cuda=compiled,
                                                                         gdn_kernel="reference"))
        targets = [n.target for n in low.graph_module.graph.nodes if n.op == "call_function"]
        assert targets.count(fn) == 2 and torch.ops.treecompile.tree_attention_windowed.default not in targets
        assert low.attention == 1 and low.windows == (5,)
        phs = [p for p in low.graph_module.graph.nodes if p.op == "placeholder"]
        assert [p.name for p in phs[-2:]] == ["tree_block_mask", "tree_window_block_mask_5"]
        assert len(phs[-1].users) == 2 and all(u.target is fn for u in phs[-1].users)
    batch = Tree.from_paths(DEEP_PATHS).to_batch()
    with pytest.raises(TypeError, match=r"sliding-window attention \(windows \[5\]\): pass the batch's position_ids"):
        tc_cuda.attention_inputs(batch.subtree_end, low)
    tree_mask, window_mask = tc_cuda.attention_inputs(batch.subtree_end, low, position_ids=batch.position_ids)
    want = tree_window_block_mask(batch.subtree_end, batch.position_ids, 5)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks"):
        assert torch.equal(getattr(window_mask, name), getattr(want, name)), name
    assert tuple(tree_mask.seq_lengths) == (batch.seq_len,) * 2
    monkeypatch.setattr(tc_cuda, "fa4_unusable_reason", lambda q=None: None)  # as on a Hopper with FA4
    low = tc_cuda.lower_cuda(tmodel.graph_module, tc_cuda.CudaOptions(attention_kernel="fa4_varlen",
                                                                     gdn_kernel="reference"))
    assert low.windows == () and low.attention == 0 and low.attention_varlen == 1 and low.windowed_varlen == 2
    calls = [n for n in low.graph_module.graph.nodes if n.target is tc_cuda._varlen_windowed]
    assert len(calls) == 2 and all(n.args[3].name == "tree_subtree_end" and n.args[4].name == "tree_position_ids"
                                   and n.args[5] == 5 for n in calls)
    low = tc_cuda.lower_cuda(tmodel.graph_module, tc_cuda.CudaOptions(attention_kernel="auto", gdn_kernel="reference"))
    assert low.windows == (5,) and low.windowed_varlen == 0


def test_gemma3n_text_with_pointwise_aliases_equals_per_path():
    """HF Gemma 3n's text model (AltUp, LAuReL, per-layer inputs) multiplies by ``torch.multiply``, an alias that is
    not tagged pointwise and that torch.export keeps under its name: the token-locality pass refused it until
    session 45 (``token_axis.POINTWISE_ALIASES``).  In eval mode (in train mode HF's code leaves torch.export a
    fake constant, refused at capture) the tree equals the per-path runs."""
    if not hasattr(transformers, "Gemma3nForCausalLM"):
        pytest.skip("transformers has no Gemma3nForCausalLM")
    torch.manual_seed(0)
    cfg = transformers.Gemma3nTextConfig(**dict(COMMON, head_dim=8, num_kv_shared_layers=0,
                                                vocab_size_per_layer_input=37, hidden_size_per_layer_input=8,
                                                laurel_rank=4, layer_types=["full_attention"] * 2))
    model = transformers.Gemma3nForCausalLM(cfg).double().eval()
    assert_tree_equals_per_path(model, treecompile.compile(model), PATHS)

