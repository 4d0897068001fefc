"""Session 45: HF causal LMs and config variants the sweep's default configs do not reach (new decoder architecture,
rope scalings, biases, soft-capping, tensor-parallel slices, sliding windows), tiny, float64, tree vs per-path reference
with the zoo test's bound (10x the reference's own rounding noise: ``worker.compare``, ``classify_s45.within_noise``).  PYTHONPATH=. python notes/hf_sweep/variants_s45.py [NAME...]"""
import os, re, sys, warnings
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, transformers
import treecompile
from classify_s45 import within_noise
from worker import PATHS, compare

C = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(C, num_experts=4, num_experts_per_tok=2, num_local_experts=4, moe_intermediate_size=16)
CASES = {
    "Llama": ("LlamaConfig", C), "Mixtral": ("MixtralConfig", dict(MOE, experts_implementation="eager")),
    "Starcoder2": ("Starcoder2Config", dict(C, sliding_window=None)), "StableLm": ("StableLmConfig", C),
    "Cohere": ("CohereConfig", C), "Cohere2": ("Cohere2Config", dict(C, sliding_window=4, head_dim=8)),
    "Olmo": ("OlmoConfig", C), "Nemotron": ("NemotronConfig", dict(C, head_dim=8)),
    "Glm": ("GlmConfig", dict(C, head_dim=8)), "Glm4": ("Glm4Config", dict(C, head_dim=8)),
    "Falcon": ("FalconConfig", dict(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    new_decoder_architecture=True, num_kv_heads=2, bias=False)),
    "FalconAlibi": ("FalconConfig", dict(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         alibi=True)),
    "OPT": ("OPTConfig", dict(vocab_size=37, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
                               max_position_embeddings=256, word_embed_proj_dim=32, dropout=0.0)),
    "XGLM": ("XGLMConfig", dict(vocab_size=37, d_model=32, num_layers=2, attention_heads=4, ffn_dim=48,
                                 max_position_embeddings=256, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
    "GPTBigCode": ("GPTBigCodeConfig", dict(vocab_size=37, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                             attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)),
    "GPTNeo": ("GPTNeoConfig", dict(vocab_size=37, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=256,
                                     attention_types=[[["global", "local"], 1]], window_size=4,
                                     attention_dropout=0.0, resid_dropout=0.0, embed_dropout=0.0)),
    "Mpt": ("MptConfig", dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4, max_seq_len=256)),
    "Exaone4": ("Exaone4Config", dict(C, head_dim=8)), "Ernie4_5": ("Ernie4_5Config", dict(C, head_dim=8)),
    "SeedOss": ("SeedOssConfig", dict(C, head_dim=8)), "Apertus": ("ApertusConfig", dict(C, head_dim=8)),
    "Arcee": ("ArceeConfig", C), "Qwen2Moe": ("Qwen2MoeConfig", dict(MOE, shared_expert_intermediate_size=16, experts_implementation="eager")),
    "Helium": ("HeliumConfig", dict(C, head_dim=8)), "Ministral": ("MinistralConfig", dict(C, head_dim=8, sliding_window=None)),
    "Persimmon": ("PersimmonConfig", dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=256)),
    "Dbrx": ("DbrxConfig", None), "Mamba": ("MambaConfig", dict(vocab_size=37, hidden_size=32, num_hidden_layers=2)),
    "Jamba": ("JambaConfig", dict(C, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                                  expert_layer_period=2, mamba_d_state=4, use_mamba_kernels=False)),
    "BitNet": ("BitNetConfig", C), "Doge": ("DogeConfig", None), "Diffllama": ("DiffLlamaConfig", dict(C, head_dim=8)),
    "Olmo3": ("Olmo3Config", dict(C, sliding_window=4)),
    "LlamaDynamic": ("LlamaConfig", dict(C, max_position_embeddings=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "LlamaDynamicLong": ("LlamaConfig", dict(C, max_position_embeddings=256, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "LlamaYarn": ("LlamaConfig", dict(C, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "LlamaLlama3": ("LlamaConfig", dict(C, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "LlamaBias": ("LlamaConfig", dict(C, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "Gemma2Softcap": ("Gemma2Config", dict(C, head_dim=8, final_logit_softcapping=5.0, attn_logit_softcapping=3.0, sliding_window=4)),
    "Gemma3Softcap": ("Gemma3TextConfig", dict(C, head_dim=8, final_logit_softcapping=5.0, sliding_window=4, num_hidden_layers=3)),
    "LlamaTp": ("LlamaConfig", dict(C, pretraining_tp=2)),
    "Qwen3Sliding": ("Qwen3Config", dict(C, head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "MistralSliding": ("MistralConfig", dict(C, sliding_window=3)),
    "Phi3LongRope": ("Phi3Config", dict(C, max_position_embeddings=16, original_max_position_embeddings=4,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.1, 2.2, 2.3]})),
}
names = sys.argv[1:] or list(CASES)
for name in names:
    ccls, kw = CASES[name]
    base = re.sub(r"(Alibi|Dynamic|DynamicLong|Yarn|Llama3|Bias|LongRope|Softcap|Tp|Sliding)$", "", name)
    mcls = ("DiffLlama" if name == "Diffllama" else base) + "ForCausalLM"
    if ccls == "Gemma3TextConfig": mcls = "Gemma3ForCausalLM"
    if not hasattr(transformers, mcls) or not hasattr(transformers, ccls):
        print(f"{name}: SKIP (no {mcls})", flush=True); continue
    try:
        torch.manual_seed(0)
        cfg = getattr(transformers, ccls)(**(kw or {}))
        if kw is None:
            print(f"{name}: SKIP (no config)", flush=True); continue
        model = getattr(transformers, mcls)(cfg).double().eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tm = treecompile.compile(model)
    except Exception as e:
        msg = str(e).replace("\n", " ")[:300]
        print(f"{name}: REFUSED/ERROR at compile {type(e).__name__}: {msg}", flush=True); continue
    try:
        r = compare(model, tm, PATHS, grads=True, noise=True)  # the sweep worker's comparison, noise included
        loss_err = abs(r["loss_tree"] - r["loss_ref"])
        print(f"{name}: {'EXACT' if within_noise(r) else '*** WRONG ***'} g_err {r['grad_rel']:.2e} "
              f"(noise {r['noise_grad_rel']:.2e}) loss_err {loss_err:.2e} (noise {r['noise_loss_abs']:.2e}) "
              f"logprob {r['lp_maxdiff']:.2e}", flush=True)
    except Exception as e:
        msg = str(e).replace("\n", " ")[:300]
        print(f"{name}: ERROR at run {type(e).__name__}: {msg}", flush=True)
