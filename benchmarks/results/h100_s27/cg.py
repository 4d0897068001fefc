"""Session 27: the tree step with inductor's CUDA graphs between treecompile's custom ops (an experiment before
any option exists).  --cuda-graphs sets, before the first compile: ``triton.cudagraphs`` (what
``mode="reduce-overhead"`` sets), ``graph_partition`` and ``custom_should_partition_ops`` = every
``treecompile::`` op, so the ops that plan on the host (attention segments, fla GDN levels, the fused head) run
eagerly between graph replays.  --torch-moe: the MoE experts' elementwise work as the torch ops it was before
``ops/moe_triton.py`` (the A/B of that change).  Prints one JSON row: the first steps' losses and gradient checksums (the
float64 sum of squares of every gradient, for the A/B against a run without), then the timed steps.

    python benchmarks/results/h100_s27/cg.py --model qwen3-0.6b --agentic parallel-tools [--cuda-graphs]
"""
import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from benchmarks import harness  # noqa: E402


def treecompile_ops():
    import treecompile.ops  # noqa: F401  (registers the ops)
    import treecompile.ops.fla_gdn  # noqa: F401
    import treecompile.ops.logprobs_kept  # noqa: F401
    import treecompile.ops.logprobs_triton  # noqa: F401
    import treecompile.ops.moe_grouped  # noqa: F401
    import treecompile.ops.varlen_tree_attention  # noqa: F401
    names = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("treecompile::")})
    return names


def partition_multi_outputs(ops):
    """torch 2.11's graph partition puts the ``MultiOutput`` nodes that unpack a partitioned op's tuple result into
    the next (CUDA graph) partition, which then takes the tuple itself as an input and cannot record it (an
    assert in ``_allocate_and_copy_recording_inputs``).  Partition those nodes with their op."""
    from torch._inductor import ir, scheduler
    from torch._inductor.utils import get_op_names

    names = set(ops)
    orig = scheduler.Scheduler.should_partition

    def should_partition(self, node):
        reason = orig(self, node)
        if reason is None and isinstance(node.node, ir.MultiOutput):
            src = node.node
            while isinstance(src, ir.MultiOutput):
                src = src.inputs[0]
            op = getattr(src, "op_overload", None)
            if isinstance(src, ir.FallbackKernel) and op is not None and get_op_names(op)[0] in names:
                return "MultiOutput of a partitioned op"
        return reason

    scheduler.Scheduler.should_partition = should_partition


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--agentic", default="parallel-tools")
    ap.add_argument("--agentic-scale", type=float, default=1.0)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--check", type=int, default=4, help="first steps whose loss and gradient checksum are printed")
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--torch-moe", action="store_true", help="the routed experts' elementwise work as torch ops "
                    "(before ops/moe_triton.py), for the A/B")
    ap.add_argument("--no-asserts", action="store_true", help="cudagraph trees' slow-path pool asserts off")
    args = ap.parse_args()
    import torch._inductor.config as ic
    info = {"torch": torch.__version__, "graph_partition_default": ic.graph_partition,
            "has_custom_should_partition_ops": hasattr(ic, "custom_should_partition_ops"),
            "has_tag_cudagraph_unsafe": hasattr(torch.Tag, "cudagraph_unsafe")}
    if args.cuda_graphs:
        ops = treecompile_ops()
        ic.triton.cudagraphs = True
        ic.graph_partition = True
        ic.custom_should_partition_ops = ops
        partition_multi_outputs(ops)
        info["partition_ops"] = ops
        torch._logging.set_logs(perf_hints=True)
        if args.no_asserts:
            ic.triton.slow_path_cudagraph_asserts = False
            info["slow_path_cudagraph_asserts"] = False
    if args.torch_moe:
        from treecompile.ops import moe_triton
        moe_triton.usable = lambda t: False
    print("#", json.dumps(info), flush=True)
    steps = harness.cuda_steps(args.model, agentic=args.agentic or None, agentic_scale=args.agentic_scale,
                               iters=args.iters)
    step = steps.tree_step()[0]
    params = [p for p in steps.model.parameters() if p.requires_grad]
    checks = []
    t0 = time.perf_counter()
    for i in range(args.check):
        loss = float(step())
        g = sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None)
        checks.append((loss, g))
        if i == 0:
            first = time.perf_counter() - t0
    times, hosts = [], []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    st = sorted(times)
    row = {"model": args.model, "tree": steps.case.name, "cuda_graphs": args.cuda_graphs, "torch_moe": args.torch_moe,
           "tree_tokens": steps.tree.num_tokens, "first_s": round(first, 2),
           "losses": [c[0] for c in checks], "grad_sq": [c[1] for c in checks],
           "step_ms": round(statistics.median(times) * 1e3, 2), "lq_ms": round(st[len(st) // 4] * 1e3, 2),
           "min_ms": round(st[0] * 1e3, 2), "host_ms": round(statistics.median(hosts) * 1e3, 2),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "steps_ms": [round(t * 1e3, 1) for t in times]}
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
