"""A sliding-window model's tree training step on CUDA: the windowed layers lowered into the compiled graph
(``lower_cuda``: FlexAttention under a window BlockMask fed per batch, flex's own backward) against the same
layers kept as the ``treecompile::tree_attention_windowed`` op (FlexAttention inside the op, a backward op that
recomputes the forward: what ran before the lowering existed).

HF Mistral with Qwen3-0.6B's layer shape (hidden 1024, 16 heads / 8 kv heads of 128, MLP 3072, vocabulary
151,936), ``--layers`` layers, bf16, random weights, every layer sliding with window ``--window``; tree
``trees.synthetic_paths(16, --path-len, 0.5)``.  Each variant in this process in turn: first step (compile
included), then the median of ``--iters`` fwd+bwd steps; loss and a gradient checksum (the variants run the same
math in another kernel order: bf16 noise apart, they agree).  Usage: ``python benchmarks/bench_window_step.py
[--window 512] [--variants lowered op lowered_flex] [--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees import synthetic_paths  # noqa: E402

import treecompile  # noqa: E402
import treecompile.passes.lower_cuda as lower_cuda  # noqa: E402

VARIANTS = {  # name -> (attention_kernel, lower the windowed layers)
    "lowered": ("auto", True),
    "lowered_flex": ("flex", True),
    "op": ("auto", False),
}


def model(layers: int, window: int):
    import transformers

    cfg = transformers.MistralConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                                     num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=8,
                                     head_dim=128, max_position_embeddings=40_960, sliding_window=window,
                                     tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(cfg).to(torch.bfloat16).cuda()


def step(tm, batch, params):
    for p in params:
        p.grad = None
    out = tm(batch)
    out.loss.backward()
    return out.loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--path-len", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    m = model(args.layers, args.window)
    params = list(m.parameters())
    paths = synthetic_paths(16, args.path_len, 0.5, seed=args.path_len)
    batch = treecompile.Tree.from_paths(paths).to_batch(device="cuda")
    rows = []
    reads = lower_cuda._reads_batch_depths
    for name in args.variants:
        kernel, lowered = VARIANTS[name]
        lower_cuda._reads_batch_depths = reads if lowered else (lambda n: False)
        try:
            tm = treecompile.compile(m, attention_kernel=kernel)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(tm, batch, params)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            times = []
            torch.cuda.reset_peak_memory_stats()
            for _ in range(args.iters):
                t0 = time.perf_counter()
                loss = step(tm, batch, params)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            checksum = float(sum(p.grad.double().abs().sum() for p in params if p.grad is not None))
            rows.append(dict(variant=name, attention_kernel=kernel, windows_lowered=lowered, T=batch.seq_len,
                             window=args.window, layers=args.layers, first_step_s=first,
                             step_ms=1e3 * statistics.median(times), min_ms=1e3 * min(times),
                             peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30, loss=float(loss),
                             grad_abs_sum=checksum))
        finally:
            lower_cuda._reads_batch_depths = reads
        print(json.dumps(rows[-1]), flush=True)
        del tm
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  rows=rows), indent=1))


if __name__ == "__main__":
    main()
