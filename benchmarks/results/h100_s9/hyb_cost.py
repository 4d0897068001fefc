"""Hybrid e2e tree step (qwen3.5-hybrid-0.8b, 24 layers, 16 x 2048 POR 0.5, H100 bf16) under fla plans of
different call costs: does the per-call host cost hide behind GPU work in a whole step?"""
import json, os, sys, time
import torch
sys.path.insert(0, ".")
from benchmarks import harness as H
import treecompile.ops.fla_gdn as FG
spec = H.model_specs()["qwen3.5-hybrid-0.8b"]
dev = torch.device("cuda")
torch.manual_seed(0)
model = spec.build(dev, torch.bfloat16)
case = H.synthetic_cases([0.5], 16, 2048, spec.config.vocab_size)[0]
cfg = H.BenchConfig(device="cuda", dtype="bfloat16", iters=3, capacity=8192)
steps = H.Steps(model, spec, case, cfg, {})
step = steps.tree_step()[0]
t0 = time.perf_counter(); step(); torch.cuda.synchronize(); print("first_s", round(time.perf_counter() - t0, 1), flush=True)
res = []
for cost in (12288, 4096, 1024, 0):
    FG.CALL_COST_ROWS = cost
    FG._LAST = ()
    step(); torch.cuda.synchronize()
    plan = FG._LAST[-1] if FG._LAST else None
    ts = []
    for _ in range(4):
        t0 = time.perf_counter(); step(); th = time.perf_counter(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0, th - t0))
    ts.sort()
    r = dict(call_cost_rows=cost, step_s=round(ts[1][0], 4), host_s=round(ts[1][1], 4),
             calls=plan.calls if plan is not None else None, rows=int(plan.index.numel()) if plan is not None else None)
    res.append(r); print(json.dumps(r, default=str), flush=True)
open(os.path.join(os.environ.get("OUT", "."), "hyb_cost.jsonl"), "w").write("\n".join(json.dumps(r, default=str) for r in res) + "\n")
