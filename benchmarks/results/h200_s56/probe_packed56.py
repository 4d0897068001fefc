"""Session 56: why session 55's compiled packed baseline at C = T/4 took 0.613 s a step against the compiled whole
tree's 0.164 s (for 1.3x the tokens).  Qwen3-0.6B shape, 16 x 2,048 POR 0.5, pack(tree, T/4), compiled graphs,
"auto", bf16, one H200, the benchmark's own step (``harness.batches_step``: alternating batch tensors, each next
batch prepared after a backward).  Prints the packs, the first step, dynamo's compile counters after each of the
next steps (a recompile per step would show), the median of 3 steps, one step timed batch by batch (synchronized),
and one profiled step.  Usage: python benchmarks/results/h200_s56/probe_packed56.py [C]"""

import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters

import treecompile
from benchmarks.harness import batches_step, model_specs
from benchmarks.trees import synthetic_paths
from treecompile import Tree
from treecompile.program import bucket_length
from treecompile.runtime.partition import pack

dev = torch.device("cuda")
spec = model_specs()["qwen3-0.6b"]
model = spec.build(dev, torch.bfloat16)
for p in model.parameters():
    p.grad = torch.zeros_like(p)
tree = Tree.from_paths(synthetic_paths(16, 2048, 0.5, vocab=spec.config.vocab_size))
C = int(sys.argv[1]) if len(sys.argv) > 1 else tree.num_tokens // 4
plan = pack(tree, C)
print(f"== packs: {[(p.num_tokens, bucket_length(p.num_tokens)) for p in plan.partitions]}", flush=True)
tm = treecompile.compile(model, compile_cuda=True, attention_kernel="auto")


def zero():
    for p in model.parameters():
        p.grad.zero_()


def make():
    return plan.batches(device=dev)


step = batches_step(tm, make(), zero, make)


def timed():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


print(f"== first step {timed():.1f} s, {dict(counters['stats'])}", flush=True)
for i in range(4):
    t = timed()
    print(f"== step {i + 2}: {t:.4f} s, {dict(counters['stats'])}", flush=True)
times = [timed() for _ in range(3)]
print(f"== median of 3: {statistics.median(times):.4f} s ({', '.join(f'{t:.4f}' for t in times)})", flush=True)
batches = make()
zero()
for b in batches:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = tm(b)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out.loss.backward()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"== batch {b.num_tokens} tokens (seq {b.seq_len}): fwd {t1 - t0:.4f} s, bwd {t2 - t1:.4f} s", flush=True)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    step()
    torch.cuda.synchronize()
ka = prof.key_averages()
print(f"== profiled step: kernels {sum(e.self_device_time_total for e in ka) / 1e3:.1f} ms", flush=True)
print(ka.table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=60), flush=True)
print(ka.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=60), flush=True)
