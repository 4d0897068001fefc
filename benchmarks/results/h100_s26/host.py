"""Where the tree step's host time goes (session 26): one harness tree step on CUDA, timed (median of --iters,
host time until the step returns), then --prof steps under cProfile (the host's Python functions by own time and
by cumulative time).  --cpp-wrapper: inductor's C++ wrapper (torch._inductor.config.cpp_wrapper) for the A/B;
--old: session 25's varlen tail and lifted-value lookup (old_paths.py) for the A/B of this session's change;
--no-cprofile: the timed steps only.

    python benchmarks/results/h100_s26/host.py --model qwen3-0.6b --agentic parallel-tools [--cpp-wrapper] [--old]
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from benchmarks import harness  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--agentic", default="parallel-tools")
    ap.add_argument("--agentic-scale", type=float, default=1.0)
    ap.add_argument("--contender", default="tree")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--prof", type=int, default=2)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--cpp-wrapper", action="store_true")
    ap.add_argument("--old", action="store_true", help="session 25's varlen tail and lifted-value lookup "
                    "(old_paths.py), for an A/B on one machine")
    ap.add_argument("--no-cprofile", action="store_true")
    args = ap.parse_args()
    if args.old:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import old_paths
        old_paths.install()
    if args.cpp_wrapper:
        import torch._inductor.config as ic
        ic.cpp_wrapper = True
    steps = harness.cuda_steps(args.model, agentic=args.agentic or None, agentic_scale=args.agentic_scale,
                               iters=args.iters)
    made = steps.tree_step() if args.contender == "tree" else getattr(steps, args.contender)()
    step = made[0] if isinstance(made, tuple) else made
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    times, hosts = [], []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    row = {"contender": args.contender, "model": args.model, "tree": steps.case.name, "cpp_wrapper": args.cpp_wrapper,
           "old": args.old,
           "tree_tokens": steps.tree.num_tokens, "first_s": round(first, 2),
           "step_ms": round(statistics.median(times) * 1e3, 2), "host_ms": round(statistics.median(hosts) * 1e3, 2),
           "steps_ms": [round(t * 1e3, 1) for t in times]}
    print(json.dumps(row), flush=True)
    if args.no_cprofile:
        return
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(args.prof):
        step()
    pr.disable()
    torch.cuda.synchronize()
    print(f"# cProfile: {args.prof} steps in {(time.perf_counter() - t0) * 1e3:.1f} ms (profiled)")
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).strip_dirs().sort_stats(key).print_stats(args.top)
        print(f"# by {key}")
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[-12000:])


if __name__ == "__main__":
    main()
