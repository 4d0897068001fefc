"""Where the hybrid tree step's HOST time goes (qwen3.5-hybrid-0.8b, 24 layers, 16 x 2048 POR 0.5, H100 bf16)."""
import json, os, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, ".")
from benchmarks import harness as H
spec = H.model_specs()["qwen3.5-hybrid-0.8b"]
torch.manual_seed(0)
model = spec.build(torch.device("cuda"), torch.bfloat16)
case = H.synthetic_cases([0.5], 16, 2048, spec.config.vocab_size)[0]
cfg = H.BenchConfig(device="cuda", dtype="bfloat16", iters=3, capacity=8192)
step = H.Steps(model, spec, case, cfg, {}).tree_step()[0]
t0 = time.perf_counter(); step(); torch.cuda.synchronize(); print("first_s", round(time.perf_counter() - t0, 1), flush=True)
step(); step(); torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t0 = time.perf_counter(); step(); th = time.perf_counter(); torch.cuda.synchronize(); t1 = time.perf_counter()
print("profiled step_s", round(t1 - t0, 3), "host_s", round(th - t0, 3), flush=True)
ka = prof.key_averages()
rows = sorted(ka, key=lambda e: -e.self_cpu_time_total)[:45]
out = [(e.key[:90], round(e.self_cpu_time_total / 1e3, 1), round(e.cpu_time_total / 1e3, 1), e.count) for e in rows]
for r in out:
    print("  ", r, flush=True)
tot = sorted(ka, key=lambda e: -e.cpu_time_total)[:30]
print("by total cpu:")
for e in tot:
    print("  ", (e.key[:90], round(e.cpu_time_total / 1e3, 1), e.count), flush=True)
json.dump({"self": out, "total": [(e.key[:90], round(e.cpu_time_total / 1e3, 1), e.count) for e in tot]},
          open(os.path.join(os.environ.get("OUT", "."), "prof_host.json"), "w"), indent=1)
