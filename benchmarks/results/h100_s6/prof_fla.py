"""Host vs GPU time of the planned tree GDN layer (fwd+bwd), syn POR 0.5 16k: is a fla call host-bound?"""
import cProfile, io, pstats, sys, time, json
import torch
sys.path.insert(0, ".")
from benchmarks.hybrid_bench import bench_trees, H, HV, DK, DV
from treecompile import Tree
from treecompile.ops.fla_gdn import tree_gated_delta_rule_fla, _cached_plan

paths = next(iter(bench_trees("syn", 151936).values()))
b = Tree.from_paths(paths).to_batch(device="cuda")
T = b.seq_len
g = torch.Generator(device="cuda").manual_seed(0)
mk = lambda *s: torch.randn(*s, device="cuda", generator=g)
xs = [mk(1, T, H, DK).bfloat16(), mk(1, T, H, DK).bfloat16(), mk(1, T, HV, DV).bfloat16(),
      torch.nn.functional.logsigmoid(mk(1, T, HV)) * 0.1, torch.rand(1, T, HV, device="cuda").bfloat16()]
xs = [x.requires_grad_() for x in xs]
do = mk(1, T, HV, DV).bfloat16()
nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
out = {}
for r in (0, None):
    def step():
        o = tree_gated_delta_rule_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True, replay_max=r)
        torch.autograd.backward(o, do)
        for x in xs:
            x.grad = None
    step(); step(); torch.cuda.synchronize()
    plan = _cached_plan(b.node_start, b.node_end, b.node_parent, r)
    # host time: time until the calls return (GPU queue not drained), then drain
    t0 = time.perf_counter(); step(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(); torch.cuda.synchronize()
    ev = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ev)
    top = sorted(ev, key=lambda e: -e.self_device_time_total)[:8]
    key = f"replay_{r}"
    out[key] = {"calls": plan.calls, "rows": len(plan.index), "host_ms": round((t1 - t0) * 1e3, 2),
                "wall_ms": round((t2 - t0) * 1e3, 2), "gpu_kernel_ms": round(gpu_us / 1e3, 2),
                "top_kernels": [(e.key[:60], round(e.self_device_time_total / 1e3, 2), e.count) for e in top]}
    pr = cProfile.Profile(); pr.enable(); step(); torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    out[key]["cprofile_tottime"] = s.getvalue()[-6000:]
    print(json.dumps({k: v for k, v in out[key].items() if k != "cprofile_tottime"}), flush=True)
import os
with open(os.path.join(os.environ.get("OUT", "."), "prof_fla.json"), "w") as f:
    json.dump(out, f, indent=1)
print(out["replay_0"]["cprofile_tottime"][:4000])
