"""Where one tree GDN layer's fwd+bwd time goes (issue 17 item 3: planned calls vs one fla varlen call).
Synthetic 16 x 2,048 POR 0.5, Qwen3.5 linear-attention shapes (16 + 16 heads of 128), bf16, H100."""
import json, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, ".")
from benchmarks import hybrid_bench as HB
from treecompile import Tree
from treecompile.ops.fla_gdn import tree_gated_delta_rule_fla, _cached_plan, call_cost_rows
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
H, HV, DK, DV = HB.H, HB.HV, HB.DK, HB.DV
paths = next(iter(HB.bench_trees("syn", 1000).values()))
dev = "cuda"
b = Tree.from_paths(paths).to_batch(device=dev)
T = b.seq_len
gen = torch.Generator(device=dev).manual_seed(0)
mk = lambda *s: torch.randn(*s, device=dev, generator=gen)
lp = torch.bfloat16
xs = [mk(1, T, H, DK).to(lp), mk(1, T, H, DK).to(lp), mk(1, T, HV, DV).to(lp),
      torch.nn.functional.logsigmoid(mk(1, T, HV)) * 0.1, torch.rand(1, T, HV, device=dev).to(lp)]
xs = [x.requires_grad_() for x in xs]
do = mk(1, T, HV, DV).to(lp)
nodes = (b.node_start, b.node_end, b.node_parent, b.node_level)
one = torch.tensor([0, T], device=dev)
h0 = torch.zeros(1, HV, DK, DV, device=dev)
import importlib.util
_spec = importlib.util.spec_from_file_location("fla_gdn_old", ".gpuwork/fla_gdn_old.py")
old = importlib.util.module_from_spec(_spec); sys.modules["fla_gdn_old"] = old; _spec.loader.exec_module(old)
fns = {
    "one_fla_call": lambda: chunk_gated_delta_rule(*xs, initial_state=h0, output_final_state=True, cu_seqlens=one,
                                                   use_qk_l2norm_in_kernel=True)[0],
    "tree_planned": lambda: tree_gated_delta_rule_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True),
    "tree_r0": lambda: tree_gated_delta_rule_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True, replay_max=0),
    "tree_r0_slices_s8": lambda: old.tree_gated_delta_rule_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True, replay_max=0),
    "tree_r256": lambda: tree_gated_delta_rule_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True, replay_max=256),
    "tree_r256_slices_s8": lambda: old.tree_gated_delta_rule_fla(*xs, *nodes, use_qk_l2norm_in_kernel=True, replay_max=256),
}
for r in (None, 0, 256):
    p = _cached_plan(b.node_start, b.node_end, b.node_parent, r)
    print("plan", r, "calls", p.calls, "levels", p.levels, "replayed", p.replayed_tokens, flush=True)
def step(f):
    torch.autograd.backward(f(), do)
    for x in xs: x.grad = None
for name, f in fns.items():
    for _ in range(3): step(f)
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); step(f); th = time.perf_counter(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t0, th - t0))
    ts.sort()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        step(f); torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kern_ms = sum(e.device_time for e in evs) / 1e3 if evs else 0
    if evs:
        span = (max(e.time_range.end for e in evs) - min(e.time_range.start for e in evs)) / 1e3
    else:
        span = 0
    ka = prof.key_averages()
    top = sorted([e for e in ka if e.self_device_time_total > 0], key=lambda e: -e.self_device_time_total)[:8]
    cpu_top = sorted([e for e in ka], key=lambda e: -e.self_cpu_time_total)[:5]
    print(json.dumps({"variant": name, "step_ms": round(ts[2][0] * 1e3, 2), "host_ms": round(ts[2][1] * 1e3, 2),
                      "kernels": len(evs), "kernel_sum_ms": round(kern_ms, 2), "gpu_span_ms": round(span, 2)}), flush=True)
    for e in top:
        print(f"   {e.self_device_time_total/1e3:8.2f} ms  n={e.count:4d}  {e.key[:110]}")
    print("   host self-CPU top:")
    for e in cpu_top:
        print(f"   {e.self_cpu_time_total/1e3:8.2f} ms  n={e.count:4d}  {e.key[:110]}")

# same outputs / input gradients: new (split) vs session 8 (slices)
def og(f):
    o = f(); gr = torch.autograd.grad(o, xs, do); return [o.float()] + [x.float() for x in gr]
for a, b_ in (("tree_r0", "tree_r0_slices_s8"), ("tree_r256", "tree_r256_slices_s8")):
    A, B = og(fns[a]), og(fns[b_])
    print(a, "vs", b_, "max abs diff", max(float((x - y).abs().max()) for x, y in zip(A, B)))
