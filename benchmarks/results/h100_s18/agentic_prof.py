"""Hybrid tree step (Qwen3.5-hybrid-0.8B, 24 layers) on the agentic parallel-tools @1.5 tree, or 16 x 2,048 POR 0.5
with ``syn``: step vs host-until-return time, kernel time by kind, top kernels and top host ops (session 11's
script plus a breakdown by kind).  Usage: python agentic_prof.py [agentic|syn]"""
import json, os, sys, time
import torch
sys.path.insert(0, ".")
from benchmarks import harness as H
OUT = os.environ.get("OUT", ".")
case_name = sys.argv[1] if len(sys.argv) > 1 else "agentic"
spec = H.model_specs()["qwen3.5-hybrid-0.8b"]
dev = torch.device("cuda")
model = spec.build(dev, torch.bfloat16)
if case_name == "agentic":
    case = H.agentic_cases(1.5, spec.config.vocab_size, ["parallel-tools"])[0]
else:
    case = H.synthetic_cases([0.5], 16, 2048, spec.config.vocab_size)[0]
cfg = H.BenchConfig(device="cuda", dtype="bfloat16", iters=3, capacity=8192)
steps = H.Steps(model, spec, case, cfg, {})
step = steps.tree_step()[0]
t0 = time.perf_counter(); step(); torch.cuda.synchronize(); print("first_s", round(time.perf_counter() - t0, 1), flush=True)
ts = []
for _ in range(5):
    t0 = time.perf_counter(); step(); th = time.perf_counter(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0, th - t0))
ts.sort()
res = [dict(case=case_name, step_s=round(ts[2][0], 4), host_s=round(ts[2][1], 4), tree_tokens=steps.tree.num_tokens)]
print(json.dumps(res[0]), flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
ka = prof.key_averages()
rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in ka if e.self_device_time_total > 0), key=lambda x: -x[1])
# GPU busy time: union of kernel intervals
iv = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
busy, cur_s, cur_e = 0.0, None, None
for s, e in iv:
    if cur_e is None or s > cur_e:
        if cur_e is not None: busy += cur_e - cur_s
        cur_s, cur_e = s, e
    else:
        cur_e = max(cur_e, e)
if cur_e is not None: busy += cur_e - cur_s
span = (iv[-1][1] - iv[0][0]) if iv else 0
def kind(k):
    k = k.lower()
    if "nvjet" in k or "gemm" in k or k.startswith("aten::mm") or "addmm" in k or "cutlass" in k and "flash" not in k: return "gemm"
    if "flash" in k or "fmha" in k or "flex" in k or "attention" in k: return "attention"
    if "chunk" in k or "gated_delta" in k or "kernel_kernel" in k or "wy" in k or "recompute_w_u" in k or "l2norm" in k or "cumsum" in k or "solve_tril" in k or "kkt" in k: return "gdn"
    if "conv" in k: return "conv"
    if "gather" in k or "index" in k or "scatter" in k: return "gather/index"
    if "copy" in k or "memset" in k or "memcpy" in k or "fill" in k: return "copy/memset"
    if "triton" in k: return "triton(inductor)"
    return "other"
by = {}
for k, ms, n in rows:
    if k.startswith(("aten::", "treecompile::", "TreeGDN", "ChunkGated", "Activity")) or "Backward" in k or "Function" in k:
        continue  # op-level rows duplicate their kernels' time
    by[kind(k)] = by.get(kind(k), 0.0) + ms
res[0].update(gpu_busy_ms=round(busy / 1e3, 1), gpu_span_ms=round(span / 1e3, 1),
              kernel_ms_by_kind={k: round(v, 1) for k, v in sorted(by.items(), key=lambda x: -x[1])})
print(json.dumps(res[0]), flush=True)
for k, ms, n in rows[:40]:
    print(f"{ms:9.2f} ms {n:6d}  {k[:120]}")
host = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in ka), key=lambda x: -x[1])
print("host self time total ms", round(sum(r[1] for r in host), 1))
for k, ms, n in host[:40]:
    print(f"{ms:9.2f} ms {n:6d}  {k[:120]}")
res.append({"top_kernels": [(k[:120], round(ms, 2), n) for k, ms, n in rows[:80]],
            "top_host": [(k[:120], round(ms, 2), n) for k, ms, n in host[:80]]})
open(os.path.join(OUT, f"prof_{case_name}.jsonl"), "w").write("\n".join(json.dumps(r, default=str) for r in res) + "\n")
try:
    prof.export_chrome_trace(os.path.join(OUT, f"trace_{case_name}.json"))
    os.system(f"gzip -f {os.path.join(OUT, f'trace_{case_name}.json')}")
except Exception as e:  # noqa: BLE001
    print("trace:", e)
