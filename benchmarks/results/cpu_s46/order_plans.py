"""Session 46: does the Tree's serialisation order (lex against heavy_first) change the GDN call plans, Tree Packing or
the redundancy-free partitions on the benchmark trees?  Run from the repository root: PYTHONPATH=. python THIS."""
import torch
from treecompile import Tree
from treecompile.ops import fla_gdn
from treecompile.runtime.partition import pack
from benchmarks.trees import synthetic_paths, agentic_paths, agentic_specs
cases = {f"syn 16x2048 POR{p}": synthetic_paths(16, 2048, p, vocab=248320, seed=0) for p in (0.5, 0.75, 0.9)}
for sp in agentic_specs(1.0):
    cases[sp.name] = agentic_paths(sp)
for name, paths in cases.items():
    paths = [list(p) for p in paths]
    out = []
    for o in ("lex", "heavy_first"):
        t = Tree.from_paths(paths, order=o)
        b = t.to_batch(pad_to_multiple=64)
        p = fla_gdn.cheapest_plan(b.node_start, b.node_end, b.node_parent, call_cost_rows=fla_gdn.CALL_COST_ROWS)
        pl = pack(t, 8192)
        out.append(f"{o}: calls {p.calls} rows {int(p.index.numel())} identity {p.identity} read {p.rows_read(False)} | packs@8192 {len(pl.partitions)}")
    print(f"{name:24s} T={t.num_tokens:6d}  " + "  ||  ".join(out))
from treecompile.runtime.partition import partition_redundancy_free
for name, paths in cases.items():
    paths = [list(p) for p in paths]
    r = []
    for o in ("lex", "heavy_first"):
        t = Tree.from_paths(paths, order=o)
        plan = partition_redundancy_free(t, 4096)
        r.append(f"{o}: {len(plan.partitions)} parts, max {max(p.num_tokens for p in plan.partitions)}")
    print(f"rf@4096 {name:22s} " + " || ".join(r))
