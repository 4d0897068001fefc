"""Where the hybrid tree step's time goes vs packed fla varlen: Qwen3.5-hybrid-0.8b shape with 8 layers
(6 GDN + 2 attention; same per-layer shapes and head), 16 x 2048 POR 0.5, H100 bf16."""
import dataclasses, json, os, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, ".")
from benchmarks import harness as H
spec = H.model_specs()["qwen3.5-hybrid-0.8b"]
cfg_m = dataclasses.replace(spec.config, num_hidden_layers=8, layer_types=None)
spec = dataclasses.replace(spec, config=cfg_m)
dev = torch.device("cuda")
torch.manual_seed(0)
model = spec.build(dev, torch.bfloat16)
case = H.synthetic_cases([0.5], 16, 2048, cfg_m.vocab_size)[0]
cfg = H.BenchConfig(device="cuda", dtype="bfloat16", iters=3, capacity=8192)
steps = H.Steps(model, spec, case, cfg, {})
res = {}
for name in ("tree", "packed_fla_varlen"):
    t0 = time.perf_counter()
    step = steps.tree_step()[0] if name == "tree" else getattr(steps, name)()
    step(); torch.cuda.synchronize(); first = time.perf_counter() - t0
    step(); torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); step(); th = time.perf_counter(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0, th - t0))
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step(); torch.cuda.synchronize()
    ka = prof.key_averages()
    kern = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA or (e.self_device_time_total > 0 and e.cpu_time_total == 0)]
    rows = sorted([e for e in ka if e.self_device_time_total > 0], key=lambda e: -e.self_device_time_total)[:45]
    tot = sum(e.self_device_time_total for e in ka)
    res[name] = {"first_s": round(first, 1), "step_s": sorted(ts)[1][0], "host_s": sorted(ts)[1][1], "device_ms_sum": tot / 1e3,
                 "top": [(e.key[:100], round(e.self_device_time_total / 1e3, 2), e.count) for e in rows]}
    print(name, json.dumps({k: v for k, v in res[name].items() if k != "top"}), flush=True)
    for r in res[name]["top"][:40]:
        print("  ", r, flush=True)
    del step
with open(os.path.join(os.environ.get("OUT", "."), "prof_hybrid.json"), "w") as f:
    json.dump(res, f, indent=1)
