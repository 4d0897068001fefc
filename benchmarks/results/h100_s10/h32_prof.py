"""32 x 2,048 POR 0.5 hybrid tree step: step/host time at several call costs, then one profiled step (top kernels)."""
import json, os, sys, time
import torch
sys.path.insert(0, ".")
from benchmarks import harness as H
import treecompile.ops.fla_gdn as FG
OUT = os.environ.get("OUT", ".")
spec = H.model_specs()["qwen3.5-hybrid-0.8b"]
dev = torch.device("cuda")
torch.manual_seed(0)
model = spec.build(dev, torch.bfloat16)
case = H.synthetic_cases([0.5], 32, 2048, spec.config.vocab_size)[0]
cfg = H.BenchConfig(device="cuda", dtype="bfloat16", iters=3, capacity=8192)
steps = H.Steps(model, spec, case, cfg, {})
step = steps.tree_step()[0]
t0 = time.perf_counter(); step(); torch.cuda.synchronize(); print("first_s", round(time.perf_counter() - t0, 1), flush=True)
res = []
for cost in (4096, 12288, 32768):
    FG.CALL_COST_ROWS = cost
    FG._LAST = ()
    step(); torch.cuda.synchronize()
    plan = FG._LAST[-1] if FG._LAST else None
    ts = []
    for _ in range(3):
        t0 = time.perf_counter(); step(); th = time.perf_counter(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0, th - t0))
    ts.sort()
    r = dict(call_cost_rows=cost, step_s=round(ts[1][0], 4), host_s=round(ts[1][1], 4),
             calls=plan.calls if plan is not None else None, rows=int(plan.index.numel()) if plan is not None else None,
             levels=getattr(plan, "levels", None))
    res.append(r); print(json.dumps(r, default=str), flush=True)
FG.CALL_COST_ROWS = 4096; FG._LAST = ()
step(); torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
ka = prof.key_averages()
rows = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in ka if e.self_device_time_total > 0), key=lambda x: -x[1])
tot = sum(r[1] for r in rows)
print("kernel time total ms", round(tot, 1), "kernels", sum(r[2] for r in rows))
for k, ms, n in rows[:45]:
    print(f"{ms:9.2f} ms {n:6d}  {k[:120]}")
res.append({"top": [(k[:120], round(ms, 2), n) for k, ms, n in rows[:60]]})
open(os.path.join(OUT, "h32_prof.jsonl"), "w").write("\n".join(json.dumps(r, default=str) for r in res) + "\n")
