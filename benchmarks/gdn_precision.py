"""Where does the hybrid tree's bf16 gradient cosine of 0.9856 come from? (issue 17 item 1; GPU only)

Part A, op level (Qwen3.5 GDN head shape, H=16, Dk=Dv=128): fla's ``chunk_gated_delta_rule`` on one
sequence and the tree GDN through fla on a branching tree, in fp32 and bf16, against the float64
reference op (``treecompile::tree_gated_delta_rule``); norm-relative error of o, dq, dk, dv, dg, dbeta.
A wrong fla backward (fla #984: dk/dbeta of ``prepare_wy_repr_bwd``) shows as a large fp32 error.

Part B, model level (the Qwen3.5-shaped hybrid of gpu_checks.py, bf16, same paths): parameter-gradient
cosines against an fp32 per-path oracle (the model's own fp32 GDN), overall and per parameter group,
for: per-path bf16 with the model's own GDN (the baseline of issue 17), per-path bf16 through fla (each
path a one-path tree), the tree through fla (eager graph and compiled), the tree with the reference GDN
op, and the tree through fla with the GDN inputs upcast to fp32 (``fla_gdn`` precision option).

Part B runs on ``--model``: the Qwen3.5-shaped hybrid above (default) or ``qwen3-next-moe-small`` (the
Qwen3-Next / Qwen3.5-MoE shape of the harness: routed experts + a shared expert per layer; issue 17 item 4).
At random init bf16 rounding flips 16-19 % of that model's top-2 decisions, and the cosines then measure the
flips (RESULTS.md, session 8); ``--route-all`` routes every token to every expert (softmax weights over all
8), which leaves no decision to flip: the MoE layers stay token-local and trained, and the cosines measure
the tree.

Usage: python benchmarks/gdn_precision.py [--skip-model] [--model NAME] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_checks import SMALL_HYBRID, branching_paths, flat_grads, init_  # noqa: E402

import treecompile  # noqa: E402
from treecompile import Tree, reference  # noqa: E402
from treecompile.models import HybridForCausalLM  # noqa: E402
from treecompile.ops import fla_gdn  # noqa: E402
from treecompile.ops.tree_gdn import sequence_nodes, tree_gated_delta_rule  # noqa: E402

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def op_inputs(T, H, Hv, D, gen):
    mk = lambda *s: torch.randn(*s, generator=gen, device="cuda", dtype=torch.float64)  # noqa: E731
    q, k, v = mk(1, T, H, D), mk(1, T, H, D), mk(1, T, Hv, D)
    g = F.logsigmoid(mk(1, T, Hv)) * 0.5  # log decay in (-inf, 0), mostly near -0.3
    beta = torch.rand(1, T, Hv, generator=gen, device="cuda", dtype=torch.float64)
    return [q, k, v, g, beta]


def op_grads(fn, xs, nodes, do, dtype, **kw):
    xs = [x.detach().to(dtype).requires_grad_() for x in xs]
    o = fn(*xs, *nodes, None, use_qk_l2norm_in_kernel=True, **kw)
    grads = torch.autograd.grad(o, xs, do.to(o.dtype))
    return [o.detach()] + list(grads)


def part_a(out: dict) -> None:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    gen = torch.Generator(device="cuda").manual_seed(0)
    H = Hv = 16
    D = 128
    T = 4096
    xs = op_inputs(T, H, Hv, D, gen)
    do = torch.randn(1, T, Hv, D, generator=gen, device="cuda", dtype=torch.float64)
    nodes = sequence_nodes(1, T, device="cuda")
    ref = op_grads(tree_gated_delta_rule, xs, nodes, do, torch.float64)

    def fla_seq(q, k, v, g, beta, *_nodes_and_init, use_qk_l2norm_in_kernel):
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]

    for dt in (torch.float32, torch.bfloat16):
        got = op_grads(fla_seq, xs, nodes, do, dt)
        out[f"A fla one sequence T={T} {str(dt)[6:]}"] = {n: f"{rel(a, b):.2e}" for n, a, b in zip(NAMES, got, ref)}
        got = op_grads(tree_gated_delta_rule, xs, nodes, do, dt)  # reference op in low precision (fp32 inside)
        out[f"A reference op one sequence T={T} {str(dt)[6:]}"] = {n: f"{rel(a, b):.2e}" for n, a, b in
                                                               zip(NAMES, got, ref)}
        print(json.dumps(out), flush=True)
    # a branching tree with short and long nodes
    paths = branching_paths(6, prompt=1500, seg=1200, vocab=1000, seed=1)
    b = Tree.from_paths(paths).to_batch(pad_to_multiple=64, device="cuda")
    T = b.seq_len
    xs = op_inputs(T, H, Hv, D, gen)
    do = torch.randn(1, T, Hv, D, generator=gen, device="cuda", dtype=torch.float64)
    nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
    ref = op_grads(tree_gated_delta_rule, xs, nodes, do, torch.float64)
    real = torch.arange(b.num_tokens, device="cuda")
    for dt in (torch.float32, torch.bfloat16):
        for name, kw in (("fla tree", {}), ("fla tree fp32 inputs", {"compute_dtype": torch.float32})):
            if kw and dt == torch.float32:
                continue
            got = op_grads(fla_gdn.tree_gated_delta_rule_fla, xs, nodes, do, dt, **kw)
            out[f"A {name} T={b.num_tokens} levels={int(b.node_level.max()) + 1} {str(dt)[6:]}"] = {
                n: f"{rel(a[:, real], c[:, real]):.2e}" for n, a, c in zip(NAMES, got, ref)}
            print(json.dumps(out), flush=True)


GROUPS = (("gdn", "linear_attn"), ("attn", "self_attn"), ("mlp", "mlp"), ("router", "mlp.gate."), ("embed", "embed"),
          ("norm", "norm"))


def grads_by_group(model):
    out = {}
    for g, key in GROUPS:
        ps = [p.grad.float().flatten() for n, p in model.named_parameters() if key in n and p.grad is not None]
        if ps:
            out[g] = torch.cat(ps)
    out["all"] = flat_grads(model)
    return out


def cosines(g, ref):
    return {k: round(float(F.cosine_similarity(g[k], ref[k], dim=0)), 5) for k in ref if k in g}


def part_b(out: dict, fp32_inputs_only: bool = False, model_name: str = "qwen3.5-hybrid-small",
           router_std: float | None = None, skip_fp32_inputs: bool = False, route_all: bool = False) -> None:
    import dataclasses

    from harness import model_specs

    cfg = SMALL_HYBRID if model_name == "qwen3.5-hybrid-small" else model_specs()[model_name].config
    out["B model"] = model_name
    if route_all:  # top-k = every expert: no selection for rounding to flip; the router still trains (softmax)
        if not getattr(cfg, "num_experts", 0):
            raise ValueError(f"--route-all: {model_name} has no experts")
        cfg = dataclasses.replace(cfg, num_experts_per_tok=cfg.num_experts)
        out["B route_all"] = f"top-{cfg.num_experts} of {cfg.num_experts} experts"
    torch.manual_seed(0)
    paths = branching_paths(6, prompt=1500, seg=1200, vocab=cfg.vocab_size, seed=1)
    model = init_(HybridForCausalLM(cfg))
    if router_std is not None:  # a confident router (as trained ones are): fewer top-k flips under rounding
        out["B router_std"] = router_std
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, router_std)
    model = model.to("cuda", torch.bfloat16)
    batch = Tree.from_paths(paths).to_batch(device="cuda")
    n = len(paths)

    k = getattr(cfg, "num_experts_per_tok", 0) or 0

    def per_path(m, routes=None):
        """Gradients of the per-path runs; ``routes`` (a list) collects each MoE layer's top-k experts."""
        hooks = [mod.register_forward_hook(lambda _m, _i, logits: routes.append(
            logits.float().flatten(0, -2).topk(k, dim=-1).indices.sort(dim=-1).values.cpu()))
            for name, mod in m.named_modules() if routes is not None and k and name.endswith("mlp.gate")]
        try:
            m.zero_grad(set_to_none=True)
            for p in paths:
                (reference.run(m, [p], device="cuda").loss / n).backward()
        finally:
            for h in hooks:
                h.remove()
        return grads_by_group(m)

    t0 = time.perf_counter()
    m32 = copy.deepcopy(model).float()
    routes32, routes16 = [], []
    oracle = per_path(m32, routes32)
    del m32
    torch.cuda.empty_cache()
    out["B oracle_s"] = round(time.perf_counter() - t0, 1)
    res = {}
    res["per-path bf16, model GDN (baseline)"] = cosines(per_path(model, routes16), oracle)
    if routes32:  # how often rounding alone changes a token's experts (what a cosine to the oracle then measures)
        flips = sum(int((a != b).any(-1).sum()) for a, b in zip(routes32, routes16))
        out["B top-k sets changed by bf16 (per-path baseline vs oracle)"] = \
            f"{flips} of {sum(a.shape[0] for a in routes32)} token-layers"
    print(json.dumps(res), json.dumps({k_: v for k_, v in out.items() if k_.startswith("B top-k")}), flush=True)

    def tree_run(tm, b):
        model.zero_grad(set_to_none=True)
        tm(b).loss.backward()
        return grads_by_group(model)

    tm = treecompile.compile(model, gdn_kernel="fla", compile_cuda=False)
    if fp32_inputs_only:  # per-path and tree through fla with the GDN inputs upcast to fp32
        prev = fla_gdn.COMPUTE_DTYPE
        fla_gdn.COMPUTE_DTYPE = torch.float32
        try:
            model.zero_grad(set_to_none=True)
            for p in paths:
                (tm(Tree.from_paths([p]).to_batch(device="cuda")).loss / n).backward()
            res["per-path bf16, fla GDN fp32 inputs"] = cosines(grads_by_group(model), oracle)
            print(json.dumps(res), flush=True)
            res["tree bf16, fla GDN fp32 inputs (eager graph)"] = cosines(tree_run(tm, batch), oracle)
        finally:
            fla_gdn.COMPUTE_DTYPE = prev
        out["B cosines vs fp32 per-path oracle"] = res
        print(json.dumps(res), flush=True)
        return
    model.zero_grad(set_to_none=True)
    for p in paths:
        (tm(Tree.from_paths([p]).to_batch(device="cuda")).loss / n).backward()
    res["per-path bf16, fla GDN"] = cosines(grads_by_group(model), oracle)
    res["tree bf16, fla GDN (eager graph)"] = cosines(tree_run(tm, batch), oracle)
    print(json.dumps(res), flush=True)
    # the tree through fla with fp32 GDN inputs (fla_gdn.COMPUTE_DTYPE switch), then the compiled run
    prev = fla_gdn.COMPUTE_DTYPE
    # compiled runs first (what training runs: the conv as shifted products by default, session 18; fla's conv before)
    variants = [("tree bf16, fla GDN (compiled, as issue 17)", dict(gdn_kernel="fla"), None),
                ("tree bf16, fla GDN + fla conv (compiled)", dict(gdn_kernel="fla", conv_kernel="fla"), None),
                ("tree bf16, reference GDN op (eager graph)", dict(gdn_kernel="reference", compile_cuda=False), None),
                ("tree bf16, fla GDN fp32 inputs (eager graph)", dict(gdn_kernel="fla", compile_cuda=False),
                 torch.float32)]
    if skip_fp32_inputs:
        variants = [v for v in variants if v[2] is None]
    for name, opts, cdt in variants:
        fla_gdn.COMPUTE_DTYPE = cdt
        try:
            t0 = time.perf_counter()
            res[name] = cosines(tree_run(treecompile.compile(model, **opts), batch), oracle)
            res[name]["s"] = round(time.perf_counter() - t0, 1)
        except Exception as e:  # a variant that fails is a row
            res[name] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            fla_gdn.COMPUTE_DTYPE = prev
        out["B cosines vs fp32 per-path oracle"] = res
        print(json.dumps(res), flush=True)
    out["B cosines vs fp32 per-path oracle"] = res
    print(json.dumps(res), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-model", action="store_true")
    ap.add_argument("--skip-op", action="store_true")
    ap.add_argument("--fp32-inputs-only", action="store_true",
                    help="model level: only the oracle, the baseline and fla with fp32 GDN inputs")
    ap.add_argument("--model", default="qwen3.5-hybrid-small", choices=("qwen3.5-hybrid-small", "qwen3-next-moe-small"),
                    help="the hybrid of part B")
    ap.add_argument("--router-std", type=float, default=None,
                    help="MoE models: re-draw the router weights with this std (default: the 0.02 of every matrix)")
    ap.add_argument("--skip-fp32-inputs", action="store_true", help="model level: leave out the fp32-input variant")
    ap.add_argument("--route-all", action="store_true",
                    help="MoE models: route every token to every expert (top-k = all), so that bf16 rounding cannot "
                         "flip a routing decision and the cosines measure the rest (the tree) alone")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import triton
    from importlib.metadata import version

    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "fla": version("flash-linear-attention"), "tilelang": version("tilelang")}
    print(json.dumps(out), flush=True)
    try:
        if not a.skip_op:
            part_a(out)
        if not a.skip_model:
            part_b(out, a.fp32_inputs_only, a.model, a.router_std, a.skip_fp32_inputs, a.route_all)
    finally:
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()
