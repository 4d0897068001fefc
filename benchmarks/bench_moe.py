"""One MoE layer's routed experts, fwd+bwd: ``treecompile::moe_experts`` vs ``treecompile::moe_experts_grouped``.

The reference op loops over the experts on the host (offsets read with a host sync, two matmuls per expert
forward, recomputed activations and five backward, ``index_add``); the grouped op (what ``lower_cuda`` runs
on Hopper for bf16 experts) sorts the routed pairs on the device and runs ``torch._grouped_mm``.  Shape:
Qwen3-30B-A3B's MoE layer (hidden 2048, moe_intermediate 768, 128 experts, top-8), bf16, router logits
random normal (softmax top-8: nearly uniform load).  Each contender: 3 warm-up steps, then the median of
10 CUDA-event-timed steps of forward + backward (gradients of hidden, routing weights and both expert
weights); its peak memory above the inputs.  ``model TF/s`` counts 3x the forward's expert GEMM FLOPs
(18 * T * k * D * I), the same for both.  Outputs and gradients of the two are compared (norm-relative).

Usage: python benchmarks/bench_moe.py [--tokens 4096 16384] [--out moe.json] [--tiny]
(``--tiny``: CPU, float32, D=64, I=32, E=8, k=2, T=256: checks the script, times nothing meaningful.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from treecompile.ops import moe, moe_grouped  # noqa: E402,F401  (registers both ops)

OPS = torch.ops.treecompile
CONTENDERS = {"reference": OPS.moe_experts, "grouped": OPS.moe_experts_grouped}


@dataclass(frozen=True)
class Shape:
    hidden: int = 2048
    intermediate: int = 768
    experts: int = 128
    top_k: int = 8


@dataclass
class Row:
    tokens: int
    contender: str
    ms: float | None
    model_tflops: float | None
    peak_gib: float | None
    rel_diff_vs_reference: list | None = None  # out, d_hidden, d_weights, d_gate_up, d_down
    error: str | None = None


def inputs(T: int, s: Shape, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(T, s.experts, device=device, generator=g)
    w, idx = logits.softmax(-1).topk(s.top_k, dim=-1)
    D, I, E = s.hidden, s.intermediate, s.experts
    hidden = torch.randn(T, D, device=device, generator=g).to(dtype)
    gu = (torch.randn(E, 2 * I, D, device=device, generator=g) / D ** 0.5).to(dtype)
    down = (torch.randn(E, D, I, device=device, generator=g) / I ** 0.5).to(dtype)
    grad_out = torch.randn(T, D, device=device, generator=g).to(dtype)
    return [hidden.requires_grad_(), idx, w.to(dtype).requires_grad_(), gu.requires_grad_(),
            down.requires_grad_()], grad_out


def step(op, ins, grad_out):
    out = op(*ins)
    return [out, *torch.autograd.grad(out, [x for x in ins if x.requires_grad], grad_out)]


def timed(op, ins, grad_out, device, reps=10, warmup=3):
    """(median ms of fwd+bwd, peak GiB above the inputs, the last step's results)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        res = step(op, ins, grad_out)
    del res
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        res = step(op, ins, grad_out)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30 if cuda else None
    return statistics.median(times), peak, [r.detach() for r in res]


def run(tokens, shape: Shape, device, dtype) -> list[Row]:
    rows = []
    for T in tokens:
        ins, grad_out = inputs(T, shape, device, dtype)
        flops = 18 * T * shape.top_k * shape.hidden * shape.intermediate
        results = {}
        for name, op in CONTENDERS.items():
            try:
                ms, peak, results[name] = timed(op, ins, grad_out, device)
                rows.append(Row(T, name, round(ms, 3), round(flops / ms / 1e9, 1),
                                None if peak is None else round(peak, 2)))
            except torch.OutOfMemoryError as e:  # a row, not a crash
                rows.append(Row(T, name, None, None, None, error=f"out of memory: {str(e)[:80]}"))
                torch.cuda.empty_cache()
            print(rows[-1], flush=True)
        if len(results) == 2:
            rows[-1].rel_diff_vs_reference = [
                float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))
                for a, b in zip(results["grouped"], results["reference"])]
        del ins, grad_out, results
    return rows


def conditions(device, dtype, shape: Shape) -> dict:
    c = {"torch": torch.__version__, "dtype": str(dtype), "shape": asdict(shape), "device": str(device)}
    if device.type == "cuda":
        c |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return c


def write_json(path: str, data: dict) -> None:
    d = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=d, delete=False, suffix=".tmp") as f:
        json.dump(data, f, indent=1)
    os.replace(f.name, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--out", help="write the rows and conditions as JSON here")
    ap.add_argument("--tiny", action="store_true", help="CPU, float32, a small shape: checks the script")
    a = ap.parse_args(argv)
    if a.tiny:
        device, dtype, shape, tokens = torch.device("cpu"), torch.float32, Shape(64, 32, 8, 2), [256]
    else:
        device, dtype, shape, tokens = torch.device("cuda"), torch.bfloat16, Shape(), a.tokens
    rows = run(tokens, shape, device, dtype)
    table = [{k: v for k, v in asdict(r).items() if k != "rel_diff_vs_reference"} for r in rows]
    try:
        from tabulate import tabulate

        print(tabulate(table, headers="keys", tablefmt="github"))
    except ImportError:
        for r in table:
            print(r)
    for r in rows:
        if r.rel_diff_vs_reference:
            print(f"T={r.tokens}: grouped vs reference, norm-relative (out, d_hidden, d_weights, d_gate_up, d_down):",
                  ", ".join(f"{x:.2e}" for x in r.rel_diff_vs_reference))
    data = {"conditions": conditions(device, dtype, shape), "rows": [asdict(r) for r in rows]}
    print(json.dumps(data["conditions"]))
    if a.out:
        write_json(a.out, data)
    return data


if __name__ == "__main__":
    main()
