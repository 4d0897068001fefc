"""GPU equivalence and step-time checks of compiled bf16 trees (dense and hybrid models), one run.

For a Qwen3-0.6B-shaped dense model and a Qwen3.5-shaped hybrid model with random weights, on a
synthetic branching tree of 8k-16k unique tokens: the tree loss against the per-path reference loss
(same model, bf16, eager, each path alone), the cosine similarity of the full parameter gradients,
and fwd+bwd step times (optimizer excluded) of the tree (compiled) vs the per-path eager baseline.
For the hybrid model also the GDN op's fwd+bwd time on the tree vs on each path separately.
Usage: python benchmarks/gpu_checks.py [--out results.json]; ``--moe``: an HF Qwen3-MoE model of the
Qwen3-30B-A3B layer shape instead (``--moe-layers N``; its experts through grouped GEMMs on the tree).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

import treecompile
from treecompile import Tree, reference
from treecompile.models import DenseConfig, DenseForCausalLM, HybridConfig, HybridForCausalLM


def branching_paths(num_paths: int, prompt: int, seg: int, vocab: int, seed: int = 0):
    rnd = random.Random(seed)
    paths = [[rnd.randrange(vocab) for _ in range(prompt + seg)]]
    while len(paths) < num_paths:
        base = paths[rnd.randrange(len(paths))]
        cut = rnd.randrange(prompt, len(base))
        paths.append(base[:cut] + [rnd.randrange(vocab) for _ in range(rnd.randrange(seg // 2, seg * 3 // 2))])
    return paths


# a Qwen3.5-shaped hybrid small enough for one GPU call: 12 layers (9 GDN + 3 gated attention)
SMALL_HYBRID = HybridConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=12, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                            linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320)


def init_(model, std: float = 0.02):
    """HF-style init (normal(0, std) matrices and embeddings) so that losses look like an LM's."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    return model


def timed(fn, iters):
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def flat_grads(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def check(name, model, paths, iters=5, *, gdn_kernel: str = "auto"):
    tree = Tree.from_paths(paths)
    batch = tree.to_batch(device="cuda")
    res = {"model": name, "paths": len(paths), "path_tokens": tree.num_path_tokens, "tree_tokens": tree.num_tokens,
           "por": round(tree.por, 4), "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}

    def per_path_step():
        """The per-path baseline: each path alone, forward + backward ("sum" normalization)."""
        model.zero_grad(set_to_none=True)
        total = 0.0
        for p in paths:
            loss = reference.run(model, [p], device="cuda").loss / len(paths)
            loss.backward()
            total += float(loss)
        return total

    res["ref_loss"] = per_path_step()
    g_ref = flat_grads(model)
    res["per_path_eager_s"] = timed(per_path_step, 3)

    t0 = time.perf_counter()
    tm = treecompile.compile(model, gdn_kernel=gdn_kernel)
    res["capture_rewrite_s"] = time.perf_counter() - t0

    def tree_step():
        model.zero_grad(set_to_none=True)
        out = tm(batch)
        out.loss.backward()
        return out

    t0 = time.perf_counter()
    out = tree_step()
    torch.cuda.synchronize()
    res["first_step_incl_compile_s"] = time.perf_counter() - t0
    out = tree_step()
    g_tree = flat_grads(model)
    res["tree_loss"] = float(out.loss)
    res["loss_rel_diff"] = abs(res["tree_loss"] - res["ref_loss"]) / abs(res["ref_loss"])
    res["grad_cosine"] = float(torch.nn.functional.cosine_similarity(g_tree, g_ref, dim=0))
    torch.cuda.reset_peak_memory_stats()
    res["tree_compiled_s"] = timed(tree_step, iters)
    res["tree_peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    res["speedup_vs_per_path_eager"] = res["per_path_eager_s"] / res["tree_compiled_s"]
    res["work_bound_linear"] = tree.num_path_tokens / tree.num_tokens
    print(json.dumps(res), flush=True)
    return res, tree


def gdn_layer_time(cfg: HybridConfig, tree: Tree, paths):
    from treecompile.ops.tree_gdn import sequence_nodes, tree_gated_delta_rule

    H, Hv, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    b = tree.to_batch(device="cuda")

    def inputs(T):
        q = torch.randn(1, T, H, Dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, T, H, Dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, T, Hv, Dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = (-torch.rand(1, T, Hv, device="cuda")).requires_grad_()
        beta = torch.rand(1, T, Hv, device="cuda", dtype=torch.bfloat16).requires_grad_()
        return q, k, v, g, beta

    xs = inputs(b.seq_len)

    def tree_call():
        o = tree_gated_delta_rule(*xs, b.node_start, b.node_end, b.node_parent, b.node_level, None,
                                  use_qk_l2norm_in_kernel=True)
        o.float().sum().backward()

    per = [inputs(len(p)) for p in paths]
    nodes = [sequence_nodes(1, len(p), device="cuda") for p in paths]

    def path_calls():
        for x, n in zip(per, nodes):
            o = tree_gated_delta_rule(*x, *n, None, use_qk_l2norm_in_kernel=True)
            o.float().sum().backward()

    tree_call()
    path_calls()
    return {"gdn_tree_s": timed(tree_call, 3), "gdn_per_path_s": timed(path_calls, 3)}


def moe_main(args):
    """An HF Qwen3-MoE model with the Qwen3-30B-A3B layer shape (``--moe-layers`` layers, random weights, bf16):
    the per-path eager baseline (HF's own experts implementation) vs the compiled tree, whose experts
    ``lower_cuda`` runs as ``treecompile::moe_experts_grouped`` (grouped GEMMs)."""
    import transformers

    if __package__:
        from benchmarks.hf_models import qwen3_30b_a3b_config
    else:  # run as a script: benchmarks/ is on sys.path
        from hf_models import qwen3_30b_a3b_config

    cfg = qwen3_30b_a3b_config(args.moe_layers).build()  # the harness's qwen3-30b-a3b-<N>l shape
    torch.manual_seed(0)
    model = init_(transformers.Qwen3MoeForCausalLM(cfg)).to("cuda", torch.bfloat16)
    paths = branching_paths(8, prompt=3000, seg=1500, vocab=cfg.vocab_size, seed=2)
    res, _ = check(f"Qwen3-30B-A3B layer shape, {args.moe_layers} layers (HF Qwen3MoeForCausalLM)", model, paths,
                   iters=3)
    res["hf_experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    res["transformers"] = transformers.__version__
    print(json.dumps(res), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--moe", action="store_true", help="only the MoE check (HF Qwen3-MoE, Qwen3-30B-A3B layer shape)")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--skip-hybrid", action="store_true")
    ap.add_argument("--skip-dense", action="store_true")
    args = ap.parse_args()
    if args.moe:
        return moe_main(args)
    torch.manual_seed(0)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(env), flush=True)
    results = [env]
    cfg = DenseConfig.qwen3_0_6b()
    paths = branching_paths(8, prompt=3000, seg=1500, vocab=cfg.vocab_size)
    model = init_(DenseForCausalLM(cfg)).to("cuda", torch.bfloat16) if not args.skip_dense else None
    if model is not None:
        results.append(check("qwen3-0.6b-shaped dense", model, paths)[0])
    if args.out and model is not None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    del model
    torch.cuda.empty_cache()
    if not args.skip_hybrid:
        hcfg = HybridConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=12, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                            linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320)
        hpaths = branching_paths(6, prompt=1500, seg=1200, vocab=hcfg.vocab_size, seed=1)
        hmodel = init_(HybridForCausalLM(hcfg)).to("cuda", torch.bfloat16)
        res, tree = check("qwen3.5-shaped hybrid (12 layers, 9 GDN)", hmodel, hpaths, iters=3)
        res.update(gdn_layer_time(hcfg, tree, hpaths))
        print(json.dumps(res), flush=True)
        results.append(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)




def oracle_check(model_bf16, paths):
    """Gradient cosines of bf16 runs against a float32 per-path oracle (same weights)."""
    import copy

    def per_path_grads(model):
        model.zero_grad(set_to_none=True)
        for p in paths:
            (reference.run(model, [p], device="cuda").loss / len(paths)).backward()
        return flat_grads(model)

    m32 = copy.deepcopy(model_bf16).float()
    g32 = per_path_grads(m32)
    del m32
    torch.cuda.empty_cache()
    g_pp = per_path_grads(model_bf16)
    batch = Tree.from_paths(paths).to_batch(device="cuda")
    out = {}
    for name, opts in (("tree_compiled", {}), ("tree_eager_flex", {"compile_cuda": False})):
        tm = treecompile.compile(model_bf16, **opts)
        model_bf16.zero_grad(set_to_none=True)
        tm(batch).loss.backward()
        g = flat_grads(model_bf16)
        out[f"cos({name}, fp32 oracle)"] = float(torch.nn.functional.cosine_similarity(g, g32, dim=0))
        out[f"cos({name}, bf16 per-path)"] = float(torch.nn.functional.cosine_similarity(g, g_pp, dim=0))
    out["cos(bf16 per-path, fp32 oracle)"] = float(torch.nn.functional.cosine_similarity(g_pp, g32, dim=0))
    print(json.dumps(out), flush=True)
    return out


def oracle_main():
    torch.manual_seed(0)
    hcfg = SMALL_HYBRID
    hpaths = branching_paths(6, prompt=1500, seg=1200, vocab=hcfg.vocab_size, seed=1)
    oracle_check(init_(HybridForCausalLM(hcfg)).to("cuda", torch.bfloat16), hpaths)
    cfg = DenseConfig.qwen3_0_6b()
    paths = branching_paths(8, prompt=3000, seg=1500, vocab=cfg.vocab_size)
    oracle_check(init_(DenseForCausalLM(cfg)).to("cuda", torch.bfloat16), paths)


def fla_main():
    """Hybrid step with the fla GDN kernel (compiled) vs the per-path eager baseline."""
    torch.manual_seed(0)
    hcfg = SMALL_HYBRID
    hpaths = branching_paths(6, prompt=1500, seg=1200, vocab=hcfg.vocab_size, seed=1)
    model = init_(HybridForCausalLM(hcfg)).to("cuda", torch.bfloat16)
    check("qwen3.5-shaped hybrid, fla GDN", model, hpaths, iters=3, gdn_kernel="fla")

if __name__ == "__main__":
    import sys

    if "--oracle" in sys.argv:
        oracle_main()
    elif "--fla" in sys.argv:
        fla_main()
    else:
        main()

