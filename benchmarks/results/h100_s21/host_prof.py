"""Where the host time of the hybrid tree step goes (issue 17: the 16k and agentic hybrid steps are host-bound).

    python host_prof.py [agentic|syn] [layer]

Builds the harness' compiled tree step (Qwen3.5-hybrid-0.8B, bf16), runs it once (compile), times 5 steps (step and
host-until-return), then runs 3 steps under cProfile and prints the top functions by self time and by cumulative
time.  With ``layer``: the same for one levelled tree GDN layer fwd+bwd (``benchmarks.hybrid_bench.layer_inputs``)
and one fla varlen call over the same tokens, 20 steps each."""
import cProfile, io, json, os, pstats, sys, time
import torch
sys.path.insert(0, ".")
OUT = os.environ.get("OUT", ".")
case_name = sys.argv[1] if len(sys.argv) > 1 else "agentic"
what = sys.argv[2] if len(sys.argv) > 2 else "step"


GC = {"n": 0, "s": 0.0, "gen2": 0}


def _gc_cb(phase, info, t0=[0.0]):
    if phase == "start":
        t0[0] = time.perf_counter()
    else:
        GC["n"] += 1
        GC["s"] += time.perf_counter() - t0[0]
        GC["gen2"] += info["generation"] == 2


def timed(step, k=5):
    ts = []
    for _ in range(k):
        t0 = time.perf_counter(); step(); th = time.perf_counter(); torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0, th - t0))
    ts.sort()
    return round(ts[k // 2][0] * 1e3, 2), round(ts[k // 2][1] * 1e3, 2)


def report(tag, step, n):
    import gc
    gc.callbacks.append(_gc_cb)
    GC.update(n=0, s=0.0, gen2=0)
    a = timed(step)
    print(json.dumps(dict(tag=tag + "_gc_stats_5_steps", collections=GC["n"], gen2=GC["gen2"], gc_ms=round(GC["s"] * 1e3, 1))))
    gc.disable()
    b = timed(step)
    gc.enable()
    gc.collect(); gc.freeze()
    c = timed(step)
    gc.unfreeze()
    gc.callbacks.remove(_gc_cb)
    print(json.dumps(dict(tag=tag + "_gc_variants", step_host_ms=a, gc_disabled=b, gc_frozen=c)), flush=True)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); step(); th = time.perf_counter(); torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0, th - t0))
    ts.sort()
    print(json.dumps(dict(tag=tag, step_ms=round(ts[2][0] * 1e3, 2), host_ms=round(ts[2][1] * 1e3, 2))), flush=True)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    pr.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats(key).print_stats(45)
        text = s.getvalue()
        print(f"==== {tag} by {key} ({n} steps)\n" + text[text.find("   ncalls"):], flush=True)
        open(os.path.join(OUT, f"cprof_{tag}_{key}.txt"), "w").write(text)
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    for f in ("new_tensor", "backend_impl", "nonzero", "'any'", "'item'", "'tolist'", "'cpu'", "_local_scalar_dense", "synchronize"):
        st.print_callers(f)
    open(os.path.join(OUT, f"cprof_{tag}_callers.txt"), "w").write(s.getvalue())


if what == "step":
    from benchmarks import harness as H
    steps = (H.cuda_steps("qwen3.5-hybrid-0.8b", agentic="parallel-tools", agentic_scale=1.5, capacity=8192)
             if case_name == "agentic" else H.cuda_steps("qwen3.5-hybrid-0.8b", capacity=8192))
    step = steps.tree_step()[0]
    t0 = time.perf_counter(); step(); torch.cuda.synchronize(); print("first_s", round(time.perf_counter() - t0, 1), flush=True)
    report(f"step_{case_name}", step, 3)
else:
    from benchmarks import prof_gdn_layer as P, hybrid_bench as hb
    paths = next(iter(hb.bench_trees(case_name, 1000, scale=hb.AGENTIC_SCALE).values()))
    fns, xs, do = P.variants(paths, "cuda")
    for name in ("one_fla_call", "tree_planned"):
        fn = fns[name]
        def step(fn=fn):
            torch.autograd.backward(fn(), do)
            for x in xs:
                x.grad = None
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        report(f"layer_{case_name}_{name}", step, 20)
