"""Agentic parallel-tools @1.5 hybrid tree step (24 layers): step vs host time, kernel time, top kernels and top host ops."""
import json, os, sys, time
import torch
sys.path.insert(0, ".")
from benchmarks import harness as H
import treecompile.ops.fla_gdn as FG
OUT = os.environ.get("OUT", ".")
spec = H.model_specs()["qwen3.5-hybrid-0.8b"]
dev = torch.device("cuda")
model = spec.build(dev, torch.bfloat16)
case = H.agentic_cases(1.5, spec.config.vocab_size, ["parallel-tools"])[0]
cfg = H.BenchConfig(device="cuda", dtype="bfloat16", iters=3, capacity=8192)
steps = H.Steps(model, spec, case, cfg, {})
step = steps.tree_step()[0]
t0 = time.perf_counter(); step(); torch.cuda.synchronize(); print("first_s", round(time.perf_counter() - t0, 1), flush=True)
ts = []
for _ in range(5):
    t0 = time.perf_counter(); step(); th = time.perf_counter(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0, th - t0))
ts.sort()
res = [dict(step_s=round(ts[2][0], 4), host_s=round(ts[2][1], 4), tree_tokens=steps.tree.num_tokens)]
print(json.dumps(res[0]), flush=True)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
ka = prof.key_averages()
rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in ka if e.self_device_time_total > 0), key=lambda x: -x[1])
print("kernel time total ms", round(sum(r[1] for r in rows), 1), "kernels", sum(r[2] for r in rows))
for k, ms, n in rows[:30]:
    print(f"{ms:9.2f} ms {n:6d}  {k[:120]}")
host = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in ka), key=lambda x: -x[1])
print("host self time total ms", round(sum(r[1] for r in host), 1))
for k, ms, n in host[:30]:
    print(f"{ms:9.2f} ms {n:6d}  {k[:120]}")
res.append({"top_kernels": [(k[:120], round(ms, 2), n) for k, ms, n in rows[:60]],
            "top_host": [(k[:120], round(ms, 2), n) for k, ms, n in host[:60]]})
open(os.path.join(OUT, "agentic_prof.jsonl"), "w").write("\n".join(json.dumps(r, default=str) for r in res) + "\n")
