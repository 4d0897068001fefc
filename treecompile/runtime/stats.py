"""What ``treecompile stats`` reports, as data: per tree and in total, paths, tokens, POR, and the
computed tokens / ERR / partition count of each training mode at a token budget.

    rows = [{"tree_id": t.tree_id, **tree_stats(t.tree, 8192)} for t in read_trajectories(path)]
    print(stats_table(rows, total_stats(rows)))
"""

from __future__ import annotations

from tabulate import tabulate

from treecompile.runtime.metrics import reuse
from treecompile.runtime.partition import MODES, pack, partition_redundancy_free
from treecompile.tree import Tree

__all__ = ["stats_modes", "tree_stats", "total_stats", "stats_table"]


def stats_modes() -> tuple[str, ...]:
    """The modes reported: ``whole`` (one batch per tree) and ``train_step``'s partitioned modes."""
    return ("whole", *MODES)


def tree_stats(tree: Tree, budget: int) -> dict:
    """Paths, path tokens, unique tokens, POR and ERR/partitions per partitioning mode at ``budget``."""
    row = {"paths": tree.num_paths, "path_tokens": tree.num_path_tokens, "unique_tokens": tree.num_tokens,
           "por": tree.por, "modes": {}}
    row["modes"]["whole"] = {"computed_tokens": tree.num_tokens, "err": reuse(tree).err, "partitions": 1}
    longest = int(tree.path_lengths.max())
    if longest <= budget:
        plan = pack(tree, budget)
        r = plan.reuse()
        row["modes"]["packed"] = {"computed_tokens": r.computed_tokens, "err": r.err, "partitions": len(plan)}
    else:
        row["modes"]["packed"] = {"computed_tokens": None, "err": None, "partitions": None,
                                  "why": f"a path of {longest} tokens exceeds the budget {budget}"}
    rf = partition_redundancy_free(tree, budget)
    r = rf.reuse()
    row["modes"]["redundancy_free"] = {"computed_tokens": r.computed_tokens, "err": r.err, "partitions": len(rf)}
    return row


def total_stats(rows: list[dict]) -> dict:
    """Token-summed totals (POR/ERR over summed tokens); a mode that some tree cannot run is None."""
    pt = sum(r["path_tokens"] for r in rows)
    ut = sum(r["unique_tokens"] for r in rows)
    tot = {"trees": len(rows), "paths": sum(r["paths"] for r in rows), "path_tokens": pt, "unique_tokens": ut,
           "por": 1 - ut / pt, "modes": {}}
    for mode in stats_modes():
        ms = [r["modes"][mode] for r in rows]
        if any(m["computed_tokens"] is None for m in ms):
            n = sum(m["computed_tokens"] is None for m in ms)
            tot["modes"][mode] = {"computed_tokens": None, "err": None, "partitions": None,
                                  "why": f"{n} tree(s) have a path longer than the budget"}
        else:
            c = sum(m["computed_tokens"] for m in ms)
            tot["modes"][mode] = {"computed_tokens": c, "err": 1 - c / pt, "partitions": sum(m["partitions"] for m in ms)}
    return tot


def stats_table(rows: list[dict], total: dict) -> str:
    """``rows`` (each ``{"tree_id": ..., **tree_stats(...)}``) and their total as a github table."""

    def fmt(m, key):
        v = m[key]
        return "-" if v is None else f"{v:.4f}" if key == "err" else v

    headers = ["tree", "paths", "path tok", "unique tok", "POR", "bound 1/(1-POR)"]
    modes = stats_modes()
    for mode in modes:
        headers += [f"ERR {mode}", f"parts {mode}"]
    table = []
    for r in rows + [{"tree_id": "TOTAL", **total}]:
        line = [r["tree_id"], r["paths"], r["path_tokens"], r["unique_tokens"], f"{r['por']:.4f}",
                f"{1 / (1 - r['por']):.2f}x" if r["por"] < 1 else "inf"]
        for mode in modes:
            line += [fmt(r["modes"][mode], "err"), fmt(r["modes"][mode], "partitions")]
        table.append(line)
    return tabulate(table, headers=headers, tablefmt="github")
