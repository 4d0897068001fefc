"""Tree causal conv1d fwd+bwd: ``treecompile::tree_causal_conv1d`` vs the same math in column layout.

Session 8's op gathered the K-1 path predecessors along T of ``x [B, C, T]`` and its backward scatter-added them
back (``index_add`` over dim 2: strided, colliding); the hybrid profile of session 8 (results/h100_s8) showed that
``index_add`` at 13.8 ms + its ``aten::index`` at 7.8 ms for 6 GDN layers of a 16k-token tree.  The op now works
in row layout on ``x.transpose(1, 2) [B, T, C]`` (HF hands the op a transpose of that): ``index_select`` of whole
C-rows forward, ``index_add`` of contiguous C-rows backward.  ``cols`` below is session 8's column-layout math
(autograd through it).  Both eager and ``torch.compile``; outputs and gradients are compared with the op's.
H100 bf16 (session 9): op 9.2 ms compiled / 15.2 eager, cols 13.6 / 62.7 (RESULTS.md, Session 9).
With flash-linear-attention installed (CUDA) two more rows: ``fla`` is ``treecompile::tree_causal_conv1d_fla``
(what ``lower_cuda`` runs with the fla GDN kernel: fla's varlen conv over the tree's chains, ops/fla_conv.py),
``fla_no_tree`` one fla conv over the same T tokens as one sequence (no tree: the floor).
``shifts`` is ``ops.tree_conv_shifts`` (what a compiled CUDA graph runs: since session 19 its backward is the Triton
kernels of ``ops.tree_conv_triton``), ``shifts_inductor`` the same with session 18's backward (inductor's shifted
products), ``shifts_no_tree`` the same conv over the T tokens as one sequence as plain shifted products (inductor's
floor for that math).

Usage: python benchmarks/bench_tree_conv.py [--tiny] [--agentic NAME [--scale S]]
(default: CUDA, bf16, C = 6144, 16 x 2,048 POR 0.5; ``--agentic parallel-tools``: that agentic tree at scale S)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trees import agentic_paths, agentic_specs, synthetic_paths  # noqa: E402

from treecompile import Tree  # noqa: E402
from treecompile.ops.tree_conv import tree_causal_conv1d  # noqa: E402


def cols(x, w, bias, ci):
    """Session 8's op forward (silu) in column layout [B, C, T]; autograd gives its column-layout backward."""
    B, C, T = x.shape
    K = w.shape[1]
    xw = x.to(w.dtype)
    ctx = xw[:, :, ci.clamp(min=0).reshape(-1)].reshape(B, C, T, -1) * (ci >= 0).to(w.dtype)
    y = xw * w[None, :, K - 1, None] + (ctx * w[:, :K - 1].flip(1)[None, :, None, :]).sum(-1) + bias[None, :, None]
    return F.silu(y).to(x.dtype)


def op(x, w, bias, ci):
    return tree_causal_conv1d(x, w, bias, ci, "silu")


def fla_op(x, w, bias, ci):
    from treecompile.ops.fla_conv import tree_causal_conv1d_fla

    return tree_causal_conv1d_fla(x, w, bias, ci, "silu")


def fla_no_tree(x, w, bias, ci):
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x.transpose(1, 2), w, bias, activation="silu")[0].transpose(1, 2)


def shifts(x, w, bias, ci):
    from treecompile.ops.tree_conv_shifts import tree_causal_conv1d_shifts

    return tree_causal_conv1d_shifts(x, w, bias, ci, "silu")


def shifts_inductor(x, w, bias, ci):
    from treecompile.ops.tree_conv_shifts import tree_causal_conv1d_shifts_inductor

    return tree_causal_conv1d_shifts_inductor(x, w, bias, ci, "silu")


def shifts_no_tree(x, w, bias, ci):
    """The same conv over the T tokens as one sequence as K shifted products (what the packed baseline's
    ``reset_conv1d`` does, without its sequence-start masks): with torch.compile, inductor's floor."""
    K, n = w.shape[1], x.shape[-1]
    xw = x.to(w.dtype)
    out = xw * w[:, K - 1, None] + bias[:, None]
    for j in range(1, K):
        out = out + F.pad(xw, (j, 0))[..., :n] * w[:, K - 1 - j, None]
    return F.silu(out).to(x.dtype)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="CPU, float64, 8 channels, 4 x 64 tokens, eager only")
    ap.add_argument("--agentic", metavar="NAME", help="an agentic tree (benchmarks/trees.py) instead of the synthetic one")
    ap.add_argument("--scale", type=float, default=1.5, help="the agentic tree's scale")
    ap.add_argument("--only", help="comma-separated contenders (default: all)")
    ap.add_argument("--profile", action="store_true", help="also print each contender's CUDA kernels (one step)")
    a = ap.parse_args()
    dev, dt, C, (n, L), modes = (("cpu", torch.float64, 8, (4, 64), ("eager",)) if a.tiny else
                                 ("cuda", torch.bfloat16, 6144, (16, 2048), ("eager", "compiled")))
    K = 4
    if a.agentic:
        spec = {s.name: s for s in agentic_specs(0.03 if a.tiny else a.scale)}[a.agentic]
        paths = agentic_paths(spec)
    else:
        paths = synthetic_paths(n, L, 0.5)
    ci = Tree.from_paths(paths).to_batch(conv_kernel=K).conv_index.to(dev)
    T = ci.shape[0]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.manual_seed(0)
    x0 = torch.randn(1, T, C, device=dev, dtype=dt)
    w = torch.randn(C, K, device=dev, dtype=dt, requires_grad=True)
    bias = torch.randn(C, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn(1, T, C, device=dev, dtype=dt)
    res, outs = {"T": T, "C": C, "device": dev, "dtype": str(dt), "torch": torch.__version__}, {}
    contenders = [("op", op), ("cols", cols), ("shifts", shifts), ("shifts_inductor", shifts_inductor),
                  ("shifts_no_tree", shifts_no_tree)]
    if dev == "cuda":
        try:
            import fla.modules.causal_conv1d  # noqa: F401
            contenders += [("fla", fla_op), ("fla_no_tree", fla_no_tree)]
        except ImportError as e:
            print(f"fla rows skipped: {e}", flush=True)
    only = set(a.only.split(",")) if a.only else {name for name, _ in contenders}
    contenders = [c for c in contenders if c[0] in only]
    if "op" not in only:
        contenders.append(("op", op))  # the reference of the rel diffs below, eagerly only
    for name, fn in contenders:
        for mode in modes:
            if name not in only and mode != "eager":
                continue
            if name.startswith("fla") and mode == "compiled":
                continue  # opaque kernels: compiling around them changes nothing
            f = torch.compile(fn, dynamic=False) if mode == "compiled" else fn
            x = x0.clone().requires_grad_()

            def step():
                y = f(x.transpose(1, 2), w, bias, ci)
                return torch.autograd.grad(y.transpose(1, 2), (x, w, bias), g)

            for _ in range(3):
                step()
            sync()
            ts = []
            for _ in range(10):
                t0 = time.perf_counter()
                r = step()
                sync()
                ts.append(time.perf_counter() - t0)
            res[f"{name} {mode} ms"] = round(sorted(ts)[5] * 1e3, 3)
            if a.profile and dev == "cuda":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    step()
                    sync()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))
            outs[f"{name} {mode}"] = [t.double() for t in r]
            print(name, mode, res[f"{name} {mode} ms"], "ms fwd+bwd", flush=True)
    ref = outs["op eager"]
    for k, v in outs.items():
        if k.startswith(("fla_no_tree", "shifts_no_tree")):
            continue  # another function (no tree)
        res[f"{k} rel diff (dx, dw, dbias) vs op eager"] = [float((p - q).norm() / q.norm()) for p, q in zip(v, ref)]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
