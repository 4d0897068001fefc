# Session 42 (issue 16): FA4's varlen forward through its Python interface against the recorded launch
# (treecompile/ops/fa4_replay.py), on the H200's host.
#   1. per call, the GPU held busy by a sleep kernel (so the host never waits): the interface alone (`_fwd`, replay
#      off), the replayed launch, and the whole op (`tree_attention_varlen_fwd`: gather, buffers, kernel) each way,
#      on one layer of Qwen3-0.6B's shapes on the agentic parallel-tools tree (H 16, Hkv 8, D 128, bf16);
#   2. the compiled 0.6B tree step on that tree, replay on / off alternately (two rounds of 10 steps each, medians),
#      and the forward's host time with the GPU held busy.
# Run on the device from the repository root: python benchmarks/results/h200_s42/probe_replay.py
import statistics
import time

import torch

from benchmarks import harness
from treecompile.ops import fa4_replay
from treecompile.ops import varlen_tree_attention as vta


def held(fn, n):
    """Host ms per call of fn() while a sleep kernel keeps the GPU busy (no call waits for the device)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e3
    torch.cuda.synchronize()
    return dt


steps = harness.cuda_steps("qwen3-0.6b", agentic="parallel-tools", iters=10)
batch = steps.tree.to_batch(normalize=steps.cfg.normalize, device="cuda")
T, H, Hkv, D = batch.seq_len, 16, 8, 128
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(1, T, h, D, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
           for h in (H, Hkv, Hkv))
plan = vta._plan(batch.subtree_end, q)
print(f"tree T {T} ({steps.tree.num_tokens} tokens), plan {type(plan).__name__}, segments "
      f"{getattr(plan, 'segments', '-')}, gathered {plan.gathered}, tail {plan.tail}")
q_t, k_t, v_t = (vta._tokens_major(x) for x in (q, k, v))
kg, vg = plan.keys(k_t, v_t)
n = plan.tail
out, lse = q_t.new_empty((T, H, D)), torch.empty((H, T), dtype=torch.float32, device="cuda")
fwd = lambda: vta._fwd(q_t[:n], kg, vg, plan, 0.088, out=out[:n], lse=lse[:, :n])
op = lambda: torch.ops.treecompile.tree_attention_varlen_fwd(q, k, v, batch.subtree_end, 0.088)
for enabled in (False, True, False, True):
    fa4_replay.ENABLED = enabled
    for _ in range(3):
        fwd(), op()
    torch.cuda.synchronize()
    print(f"replay {'on ' if enabled else 'off'}: FA4 forward call {held(fwd, 50) * 1e3:7.1f} us, whole op "
          f"{held(op, 50) * 1e3:7.1f} us  (counts {fa4_replay.pop_counts()})")
fa4_replay.ENABLED = True
torch.cuda.synchronize()
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
e0.record()
for _ in range(20):
    fwd()
e1.record()
torch.cuda.synchronize()
print(f"the kernel alone (GPU, back to back): {e0.elapsed_time(e1) / 20 * 1e3:.1f} us per call")

step, _, _ = steps.tree_step()
tm = steps._tree_model()
t0 = time.perf_counter()
step()
torch.cuda.synchronize()
print(f"first step {time.perf_counter() - t0:.1f} s")
times = {True: [], False: []}
for rnd in range(2):
    for enabled in (True, False):
        fa4_replay.ENABLED = enabled
        step()
        for _ in range(10):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times[enabled].append(time.perf_counter() - t0)
for enabled in (True, False):
    print(f"step, replay {'on ' if enabled else 'off'}: median {statistics.median(times[enabled]) * 1e3:.1f} ms "
          f"(min {min(times[enabled]) * 1e3:.1f}, n {len(times[enabled])})")
print("counts", fa4_replay.pop_counts())
tm.prepare(batch)
for enabled in (True, False):
    fa4_replay.ENABLED = enabled
    for _ in range(2):
        steps.zero()
        tm(batch).loss.backward()
    torch.cuda.synchronize()
    ms = [held(lambda: tm(batch), 1) for _ in range(5)]
    torch.cuda.synchronize()
    e0.record()
    o = tm(batch)
    e1.record()
    torch.cuda.synchronize()
    print(f"forward, replay {'on ' if enabled else 'off'}: host {statistics.median(ms):.1f} ms with the GPU held, "
          f"GPU {e0.elapsed_time(e1):.1f} ms from its first to its last event when not held")
    del o
