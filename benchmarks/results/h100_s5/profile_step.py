"""Profile one tree step and one packed FA4 varlen step of the harness: where the time goes."""
import sys, json, torch
from torch.profiler import profile, ProfilerActivity
from benchmarks import harness as H
model_name, out = sys.argv[1], sys.argv[2]
spec = H.model_specs()[model_name]
dev = torch.device("cuda")
model = spec.build(dev, torch.bfloat16)
case = H.synthetic_cases([0.5], 16, 2048, spec.config.vocab_size)[0]
cfg = H.BenchConfig(device="cuda", dtype="bfloat16", iters=3, capacity=16384)
steps = H.Steps(model, spec, case, cfg, {})
res = {}
for name in ("tree", "packed_fa4_varlen"):
    step = steps.tree_step()[0] if name == "tree" else getattr(steps, name)()
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step(); torch.cuda.synchronize()
    ka = prof.key_averages()
    rows = sorted([e for e in ka if e.device_time_total > 0], key=lambda e: -e.self_device_time_total)[:40]
    tot = sum(e.self_device_time_total for e in ka)
    res[name] = {"total_ms": tot / 1e3, "top": [(e.key[:110], round(e.self_device_time_total / 1e3, 2), e.count) for e in rows]}
    print(name, "total device ms", tot / 1e3, flush=True)
    for r in res[name]["top"][:25]:
        print("  ", r, flush=True)
json.dump(res, open(out, "w"), indent=1)
