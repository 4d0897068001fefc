# Session 50: h200_s47/probe_plan.py's measurement (a CUDA batch moved with its host values remembered, one intra-op
# thread, median of 200 builds after 10, each on a fresh tensor) on the agentic trees parallel-tools and deep-agent
# (segments forced: block_sparse=False), this checkout's module against MODULE's, alternating, two rounds:
#   PYTHONPATH=. python probe_agentic.py [MODULE]
import importlib, sys, time, torch
from benchmarks.trees import agentic_paths, agentic_specs
from treecompile import Tree
from treecompile.host_values import to_device_with_host
from treecompile.ops import varlen_tree_attention as new


def plan_ms(mod, se: torch.Tensor, dev: str = "cuda") -> tuple[float, float]:
    """(median, min) ms of ``mod.tree_attention_plan`` over 200 builds after 10, each on a fresh copy of ``se`` on
    ``dev`` moved with its host values (also ``probe_pad50.py``'s and ``../h200_s54/probe_plan54.py``'s; ``dev``
    added in session 54, CUDA as before by default)."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    ses = [to_device_with_host(se, dev) for _ in range(210)]
    sync()
    ts = []
    for s in ses:
        t0 = time.perf_counter()
        mod.tree_attention_plan(s, block_sparse=False)
        ts.append(time.perf_counter() - t0)
    sync()
    ts = sorted(ts[10:])
    return ts[len(ts) // 2] * 1e3, ts[0] * 1e3


if __name__ == "__main__":
    torch.set_num_threads(1)
    mods = [("new", new)] + ([("old", importlib.import_module("treecompile.ops." + sys.argv[1]))]
                             if len(sys.argv) > 1 else [])
    for rnd in range(2):
        for spec in agentic_specs(1.0, ["parallel-tools", "deep-agent"]):
            se = Tree.from_paths(agentic_paths(spec)).to_batch().subtree_end
            for name, mod in mods[::(1 if rnd == 0 else -1)]:
                med, low = plan_ms(mod, se)
                print(f"round {rnd} {name} {spec.name:15s} T {se.numel():6d}  plan ms median {med:.3f}  min {low:.3f}",
                      flush=True)
