"""CPU cost model of tree attention tiles (issue 16 item 2): what each token layout leaves the kernel to do.

For each tree (the synthetic and deep agentic trees of bench_fa4_attention.py) and layout, count the
128x128 tiles a block-sparse kernel computes (non-empty), those of them that are partial (evaluate the
mask_mod on every entry), and the useful fraction = unmasked entries of the real tokens / computed tile
entries: the ceiling on TF/s-over-unmasked-entries relative to the kernel's dense rate (causal at the same
T has 0.99+).  No GPU; tile classes from ``flex_tree_attention.tree_block_classes`` (exact, tested).

Layouts:
- ``dfs``: the batch's own order (what the lowering runs by default);
- ``heavy_first``: the same tree, children visited largest subtree first (``ops/tree_layout.py``;
  ``attention_layout="heavy_first"``);
- ``varlen``: no token order: FA4's varlen causal kernel over the tree's segments (``attention_kernel="fa4_varlen"``,
  ops/varlen_tree_attention.py); tiles per segment, ``gathered_x_T`` = key rows it gathers / T, ``op_plan`` =
  what that op runs for the tree (the segments up to ``VARLEN_GATHER_LIMIT`` x T, else the dfs block-sparse tiles);
- ``heavy_first+qpad{B}%``: on top of heavy_first, the QUERY side padded (pad rows inserted before chosen
  node starts so they land on 128-row boundaries, greedily, at most B % more query rows; keys unpadded,
  because a padded key must be masked for every real query and so makes its kv block partial).  Modelled
  only (not implemented): it says how much aligning query tiles to subtree ends would add.

FA4 on sm90 with D=128 runs 128x128 forward tiles (bwd 64x128) and takes sparse blocks that are multiples
of its tiles, so 128x128 is the smallest BlockMask tile there (see the report in RESULTS.md).

Run:  python benchmarks/tile_cost_model.py [--sizes 16384,32768,65536] [--pors 0.5,0.9] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import TreeSpec, random_tree_paths  # noqa: E402
from bench_fa4_attention import DEEP  # noqa: E402
from trees import agentic_paths, harness_tree_paths  # noqa: E402

from treecompile import Tree  # noqa: E402
from treecompile.tree import DEFAULT_ORDER, ORDERS  # noqa: E402
from treecompile.ops.flex_tree_attention import tree_block_classes  # noqa: E402
from treecompile.ops.tree_layout import heavy_first_order, permuted_subtree_end  # noqa: E402
from treecompile.ops.varlen_tree_attention import BlockSparsePlan, segment_plan, tree_attention_plan  # noqa: E402

BLOCK = 128


def interval_tile_classes(lo: torch.Tensor, hi: torch.Tensor, q_len: int, block: int = BLOCK):
    """(partial, full) ``[nq, nk]`` for the rule "query q sees key k iff lo[k] <= q < hi[k]" (lo increasing,
    lo < hi), queries 0..q_len-1: exact (a tile is non-empty iff some key with lo < q_end has hi > q_start)."""
    T = lo.numel()
    nk, nq = -(-T // block), -(-q_len // block)
    big = torch.iinfo(torch.int64).max // 2
    lo_b = torch.nn.functional.pad(lo, (0, nk * block - T), value=big).view(nk, block)
    hi_b = torch.nn.functional.pad(hi, (0, nk * block - T), value=0).view(nk, block)
    q0 = torch.arange(nq) * block
    q1 = (q0 + block).clamp(max=q_len)
    cnt = torch.searchsorted(lo_b.contiguous(), q1.expand(nk, nq).contiguous())  # keys with lo < q1
    cm = torch.cummax(hi_b, 1).values
    reach = torch.where(cnt > 0, cm.gather(1, (cnt - 1).clamp(min=0)), torch.zeros_like(cnt))
    nonempty = (reach > q0[None, :]).T
    full = ((lo_b.amax(1)[None, :] <= q0[:, None]) & (hi_b.amin(1)[None, :] >= q1[:, None]))
    return nonempty & ~full, full


def q_padded(se: torch.Tensor, budget: float, thr: int, block: int = BLOCK):
    """Query positions with pad rows before node starts whose pad to the next ``block`` boundary is <= thr,
    in order, while the pads stay within ``budget * T``: (lo, hi, q_len, pads)."""
    T = se.numel()
    cut = torch.ones(T, dtype=torch.bool)
    cut[1:] = se[1:] != se[:-1]
    starts = torch.nonzero(cut).flatten().tolist()[1:]
    shift = torch.zeros(T + 1, dtype=torch.int64)
    off, cap = 0, int(budget * T)
    for s in starts:
        p = (-(s + off)) % block
        if 0 < p <= thr and off + p <= cap:
            off += p
            shift[s] += p
    qpos = torch.arange(T + 1) + torch.cumsum(shift, 0)
    q_len = -(-int(qpos[T]) // block) * block
    qpos[T] = q_len
    return qpos[:T], qpos[se], q_len, off


def varlen_tiles(plan, block: int = BLOCK) -> tuple[int, int]:
    """(computed, partial) tiles of a varlen causal kernel over ``plan``'s segments (ops/varlen_tree_attention.py):
    segment j is bottom-right causal, ``n`` queries over ``m`` keys (query i sees keys ``< m - n + i + 1``); a
    tile is computed if any entry is visible, partial unless all ``block x block`` entries are (the diagonal and
    the ragged last row/column of tiles: FA masks both by position, no mask_mod).  The tail (tokens that see
    only themselves) is not the kernel's."""
    computed = partial = 0
    cq, ck = plan.cu_seqlens_q_host, plan.cu_seqlens_k_host
    for j in range(plan.segments):
        n, m = cq[j + 1] - cq[j], ck[j + 1] - ck[j]
        qb = torch.arange(-(-n // block))
        q_lo, q_hi = qb * block, torch.clamp((qb + 1) * block, max=n)  # rows [q_lo, q_hi)
        reach = m - n + q_hi  # keys [0, reach) are visible to some row of the q tile
        nk = -(-reach // block)
        full_k = torch.clamp((m - n + q_lo + 1) // block, min=0)  # kv tiles every row sees whole
        full_k = torch.where(q_hi - q_lo == block, torch.minimum(full_k, torch.full_like(full_k, m // block)), 0)
        computed += int(nk.sum())
        partial += int((nk - full_k).sum())
    return computed, partial


def layout_row(case, layout, partial, full, nnz, pads=0) -> dict:
    P, F = int(partial.sum()), int(full.sum())
    return dict(tree=case, layout=layout, tiles=P + F, partial=P, partial_pct=round(100 * P / (P + F), 1),
                useful=round(nnz / ((P + F) * BLOCK * BLOCK), 3), pad_rows=pads)


def model_tree(case: str, tree: Tree, budgets=(0.05, 0.10)) -> list[dict]:
    se = tree.to_batch(pad_to_multiple=BLOCK).subtree_end
    T = se.numel()
    nnz = int((se - torch.arange(T)).sum())
    rows = [layout_row(case, "dfs", *tree_block_classes(se), nnz)]
    t0 = time.perf_counter()
    order = heavy_first_order(se)
    ms = 1e3 * (time.perf_counter() - t0)
    se2 = permuted_subtree_end(se, order)
    rows.append(layout_row(case, "heavy_first", *tree_block_classes(se2), nnz) | dict(order_ms=round(ms, 1)))
    for b in budgets:
        best = None
        for thr in (8, 16, 32, 48, 64, 96, 127):
            lo, hi, q_len, pads = q_padded(se2, b, thr)
            r = layout_row(case, f"heavy_first+qpad{round(100 * b)}%", *interval_tile_classes(lo, hi, q_len), nnz,
                           pads)
            cost = r["tiles"] + 0.3 * r["partial"]  # a partial tile assumed 1.3x a full one (mask_mod)
            if best is None or cost < best[0]:
                best = (cost, r | dict(thr=thr))
        rows.append(best[1])
    plan = segment_plan(se)
    tiles, part = varlen_tiles(plan)
    rows.append(dict(tree=case, layout="varlen", tiles=tiles, partial=part, partial_pct=round(100 * part / tiles, 1),
                     useful=round((nnz - (T - plan.tail)) / (tiles * BLOCK * BLOCK), 3), pad_rows=0,
                     gathered_x_T=round(plan.gathered / T, 2),
                     op_plan="block_sparse" if isinstance(tree_attention_plan(se, block_sparse=True), BlockSparsePlan)
                     else "segments"))  # the op's own choice for this tree
    causal_tiles = (T // BLOCK) * (T // BLOCK + 1) // 2
    for r in rows:
        r.update(T=T, causal_useful=round(T * (T + 1) / 2 / (causal_tiles * BLOCK * BLOCK), 3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16384,32768,65536")
    ap.add_argument("--pors", default="0.5,0.9")
    ap.add_argument("--deep", default="deep-16k,deep-32k")
    ap.add_argument("--harness", default="", help="the harness's synthetic trees, comma-separated PATHSxLEN@POR")
    ap.add_argument("--out", default=None, help="folder for tile_cost_model.{json,md}")
    ap.add_argument("--order", default=DEFAULT_ORDER, choices=ORDERS,
                    help="how the trees are serialised (Tree.from_paths' order; default %(default)s, the library's; "
                         "'lex' is the sorted order, every tree's before session 46)")
    a = ap.parse_args()
    cases = []
    for T in [int(s) for s in a.sizes.split(",") if s]:
        for por in [float(p) for p in a.pors.split(",") if p]:
            tree = Tree.from_paths(random_tree_paths(TreeSpec(T, por)), order=a.order)
            cases.append((f"syn T={T} POR={tree.por:.2f}", tree))
    for item in [x for x in a.harness.split(",") if x]:
        tree = Tree.from_paths(harness_tree_paths(item), order=a.order)
        cases.append((f"harness {item} T={tree.num_tokens} POR={tree.por:.2f}", tree))
    for spec in DEEP:
        if spec.name in a.deep.split(","):
            tree = Tree.from_paths(agentic_paths(spec), order=a.order)
            cases.append((f"agentic {spec.name} T={tree.num_tokens} POR={tree.por:.2f}", tree))
    rows = []
    for case, tree in cases:
        for r in model_tree(case, tree):
            print(json.dumps(r), flush=True)
            rows.append(r)
    text = tabulate(rows, headers="keys", tablefmt="github")
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        for name, data in (("tile_cost_model.md", text + "\n"), ("tile_cost_model.json", json.dumps(rows, indent=1))):
            tmp = os.path.join(a.out, name + ".tmp")
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, os.path.join(a.out, name))


if __name__ == "__main__":
    main()
