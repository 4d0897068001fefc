"""Run one model type: build tiny config, compile, compare tree vs per-path. Prints JSON lines (one per stage)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, "/work/main")
sys.path.insert(0, "/work/main/tests")

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as MAPPING

import treecompile
from treecompile import Tree, reference

PATHS = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 10], [1, 2, 11, 12, 13, 14, 15], [1, 2, 3, 4, 5, 6], [1, 7]]
PATHS_SINGLE = [[1, 2, 3, 4, 5, 6, 7, 8]]
PATHS_ONETOK = [[1, 2, 3, 4], [5], [1, 2, 6]]

# canonical knob -> (value, synonyms). A knob is set on every synonym that is a field / attribute_map key.
KNOBS = [
    (64, ["vocab_size", "n_words"]),
    (32, ["hidden_size", "n_embd", "d_model", "emb_dim", "dim_model_base"]),
    (2, ["num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers",
         "encoder_layers", "num_encoder_layers"]),
    (4, ["num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "attention_heads",
         "encoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads"]),
    (2, ["num_key_value_heads", "num_kv_heads"]),
    (48, ["intermediate_size", "n_inner", "decoder_ffn_dim", "encoder_ffn_dim", "ffn_dim", "d_inner", "dff",
          "dim_ff", "feed_forward_size", "ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size",
          "prefix_dense_intermediate_size"]),
    (256, ["max_position_embeddings", "n_positions", "max_target_positions", "n_ctx", "max_seq_len",
           "context_length", "max_source_positions"]),
    (8, ["head_dim", "dim_head", "d_head", "kv_channels", "attention_head_size", "attention_head_dim",
         "swa_head_dim"]),
    (0, ["pad_token_id", "pad_index"]),
    (1, ["bos_token_id", "bos_index", "decoder_start_token_id"]),
    (2, ["eos_token_id", "eos_index"]),
    # MoE
    (4, ["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"]),
    (2, ["num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts"]),
    (16, ["moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
          "moe_shared_expert_intermediate_size", "shared_intermediate_size", "shared_experts_intermediate_size"]),
    (1, ["n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "topk_group"]),
    (1, ["first_k_dense_replace", "num_dense_layers"]),
    (0.0, ["router_jitter_noise", "input_jitter_noise"]),
    # MLA
    (16, ["q_lora_rank", "kv_lora_rank", "o_lora_rank"]),
    (4, ["qk_rope_head_dim", "qk_nope_head_dim"]),
    (8, ["v_head_dim"]),
    # SSM / linear attention
    (8, ["state_size", "mamba_d_state", "ssm_state_size"]),
    (4, ["mamba_n_heads", "mamba_num_heads", "n_mamba_heads"]),
    (16, ["mamba_d_head", "mamba_head_dim"]),
    (2, ["linear_num_key_heads"]),
    (4, ["linear_num_value_heads"]),
    (8, ["linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"]),
    (2, ["index_n_heads", "indexer_n_heads"]),
    (8, ["index_head_dim", "indexer_head_dim"]),
    (0, ["num_mtp_layers", "num_nextn_predict_layers"]),
    (1, ["pretraining_tp"]),
    (True, ["is_decoder"]),
    (False, ["add_cross_attention", "use_sliding_window"]),
    (None, ["sliding_window"]),
]


def config_fields(ccls):
    names = {f.name for f in dataclasses.fields(ccls)} if dataclasses.is_dataclass(ccls) else set()
    return names, set(getattr(ccls, "attribute_map", {}) or {})


def tiny_kwargs(ccls, extra=None):
    fields, amap = config_fields(ccls)
    kw = {}
    for value, names in KNOBS:
        for n in names:
            if n in fields or n in amap:
                kw[n] = value
    # dropout-ish floats -> 0
    try:
        defaults = ccls()
    except Exception:
        defaults = None
    for n in fields:
        low = n.lower()
        if ("dropout" in low or "pdrop" in low or "layerdrop" in low or low in ("dropout_p", "attention_dropout")):
            v = getattr(defaults, n, 0.0) if defaults is not None else 0.0
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                kw[n] = 0.0
    if "kv_lora_rank" in fields and "num_key_value_heads" in kw:  # MLA: no GQA
        kw["num_key_value_heads"] = 4
    kw.update(extra or {})
    return kw


def make_config(ccls, extra=None):
    kw = tiny_kwargs(ccls, extra)
    drop = []
    for _ in range(40):  # drop kwargs that are rejected
        try:
            cfg = ccls(**kw)
            break
        except Exception as e:
            msg = str(e)
            bad = [k for k in kw if k in msg and k not in (extra or {})]
            if not bad:
                raise
            k = max(bad, key=len)
            drop.append((k, msg[:150]))
            kw.pop(k)
    else:
        raise RuntimeError("could not build config")
    # layer_types: sliding -> full attention (sliding windows off)
    lt = getattr(cfg, "layer_types", None)
    if isinstance(lt, (list, tuple)) and "layer_types" not in (extra or {}) and any(
            "slid" in str(t) or "local" in str(t) for t in lt):
        try:
            kw2 = dict(kw, layer_types=["full_attention" if ("slid" in str(t) or "local" in str(t)) else t for t in lt])
            cfg = ccls(**kw2)
            kw = kw2
        except Exception as e:
            drop.append(("layer_types-override", str(e)[:150]))
    return cfg, kw, drop


def flat_grads(loss, params, retain_graph=False):
    gs = torch.autograd.grad(loss, params, retain_graph=retain_graph, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for g, p in zip(gs, params)])


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-300))


def emit(d):
    print("@@" + json.dumps(d, default=str), flush=True)


def compare(model, tmodel, paths, grads=True, noise=False):
    batch = Tree.from_paths(paths).to_batch()
    params = [p for p in model.parameters() if p.requires_grad]
    out = tmodel(batch)
    ref = reference.run(model, paths)
    res = dict(loss_tree=float(out.loss), loss_ref=float(ref.loss))
    res["loss_rel"] = abs(float(out.loss - ref.loss)) / max(abs(float(ref.loss)), 1e-300)
    lp = 0.0
    for a, r in zip(batch.path_logprobs(out.logprobs.detach()), ref.logprobs):
        lp = max(lp, float((a - r.detach()).abs().max()))
    res["lp_maxdiff"] = lp
    if grads and out.loss.requires_grad:
        g_tree = flat_grads(out.loss, params)
        g_ref = flat_grads(ref.loss, params, retain_graph=noise)
        res["grad_rel"] = rel(g_tree, g_ref)
        res["grad_norm_ref"] = float(g_ref.norm())
        if noise:
            from helpers import reference_noise
            try:
                gn, ln = reference_noise(model, paths, None, None, batch, ref, params, g_ref)
                res["noise_grad_rel"], res["noise_loss_abs"] = gn, ln
            except Exception as e:
                res["noise_err"] = repr(e)[:200]
    return res


def err_info(e):
    tb = traceback.extract_tb(e.__traceback__)
    frames = [f"{os.path.relpath(f.filename, '/')}:{f.lineno}:{f.name}" for f in tb[-4:]]
    return dict(exc_type=type(e).__module__ + "." + type(e).__name__, msg=str(e)[:300], frames=frames)


def run_mode(model, mode):
    t = time.time()
    try:
        tmodel = treecompile.compile(model)
    except Exception as e:
        emit(dict(stage=f"{mode}_compile", ok=False, t=time.time() - t, **err_info(e)))
        return None
    pr = {}
    try:
        pr = {k: getattr(v, "count", None) for k, v in tmodel.pass_results.items()}
    except Exception:
        pass
    emit(dict(stage=f"{mode}_compile", ok=True, t=time.time() - t, passes=pr))
    for name, paths in (("main", PATHS), ("single", PATHS_SINGLE), ("onetok", PATHS_ONETOK)):
        t = time.time()
        try:
            r = compare(model, tmodel, paths, grads=True)
            bad = not (r["loss_rel"] <= 1e-6 and r["lp_maxdiff"] <= 1e-6 and r.get("grad_rel", 0) <= 1e-6)
            if bad and name == "main":
                r = compare(model, tmodel, paths, grads=True, noise=True)
            emit(dict(stage=f"{mode}_{name}", ok=True, t=time.time() - t, **r))
        except Exception as e:
            emit(dict(stage=f"{mode}_{name}", ok=False, t=time.time() - t, **err_info(e)))
    return tmodel


def build(cls, extra):
    ccls = cls.config_class
    extra = dict(extra)
    post = extra.pop("_post", None)
    cfg, kw, drop = make_config(ccls, extra)
    torch.manual_seed(0)
    model = cls(cfg).double().eval()
    if post:
        getattr(model, post[0])(*post[1:])
    if hasattr(model, "set_experts_implementation"):  # grouped_mm refuses float64
        try:
            model.set_experts_implementation("eager")
        except Exception:
            pass
    return cfg, kw, drop, model


def main(mt, extra_json=None):
    clsname = MAPPING[mt]
    extra = json.loads(extra_json) if extra_json else {}
    retried = None
    for attempt in range(2):
        try:
            cls = getattr(transformers, clsname)
            cfg, kw, drop, model = build(cls, extra)
            n = sum(p.numel() for p in model.parameters())
        except Exception as e:
            emit(dict(stage="build", ok=False, cls=clsname, **err_info(e)))
            return
        # per-path reference must run at all
        try:
            with torch.no_grad():
                reference.run(model, PATHS[:1])
            break
        except Exception as e:
            if attempt == 0 and "sliding_window" in str(e) and "sliding_window" not in extra:
                # HF builds a sliding mask even with no sliding layers: give it a window but keep every layer full
                extra = dict(extra, sliding_window=4096)
                retried = "sliding_window=4096 (all layers full attention)"
                continue
            emit(dict(stage="build", ok=True, cls=clsname, nparams=n))
            emit(dict(stage="ref", ok=False, **err_info(e)))
            return
    emit(dict(stage="build", ok=True, cls=clsname, config=type(cfg).__name__, nparams=n, dropped=drop,
              retried=retried, extra=extra,
              hidden=getattr(cfg, "hidden_size", None), layers=getattr(cfg, "num_hidden_layers", None),
              layer_types=getattr(cfg, "layer_types", None),
              attn_impl=getattr(cfg, "_attn_implementation", None)))
    tm = run_mode(model, "eval")
    if tm is not None:
        del tm
        torch.manual_seed(0)
        model.train()
        run_mode(model, "train")


if __name__ == "__main__":
    torch.set_num_threads(2)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
