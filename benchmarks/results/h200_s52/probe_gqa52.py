# Session 52: what the segments plan's attention costs with FA4's GQA path against K/V expanded to the query heads.
#
# The segments plan gathers every segment's keys (G = 30,365 rows for parallel-tools' 10,066 tokens).  With GQA
# (16 query heads, 8 kv heads) FA4's backward accumulates dK/dV of the G rows in float32 buffers it zero-fills,
# then converts them (two postprocess kernels); the op then sums the copies per token.  With K/V expanded to 16
# heads FA4 writes dK/dV directly (no accumulator, no fill, no conversion), at twice the gathered bytes and a sum
# over head pairs.  Per layer, GPU time (CUDA events, the host held back by a sleep kernel first), medians of R:
#   gqa:      gather K, V [G, 8, D]; FA4 forward; FA4 backward; sum the copies of dK, dV [T, 8, D]
#   expanded: gather K, V [G, 16, D] (one index_select each from a broadcast view); FA4 forward; FA4 backward;
#             sum the copies of dK, dV over 16 heads, then the head pairs
#   kernels:  the expanded form through treecompile's own gather_keys and sum_copies(rep=2) (added after the run
#             recorded in probe_gqa52.txt; the next run prints these rows too)
# Trees: agentic parallel-tools, and 16 x 2,048 at POR 0.5.  Run on the device after `source pre.sh`:
#   python benchmarks/results/h200_s52/probe_gqa52.py   ($OUT/probe_gqa52.txt by the caller)
import os
import statistics
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.trees import agentic_paths, agentic_specs, synthetic_paths  # noqa: E402
from treecompile import Tree  # noqa: E402
from treecompile.host_values import to_device_with_host  # noqa: E402
from treecompile.ops import varlen_tree_attention as vta  # noqa: E402
from treecompile.ops.key_copies import sum_copies  # noqa: E402

try:  # session 52's kernels for the expanded form (the first run predates them)
    from treecompile.ops.key_copies import gather_keys  # noqa: E402
    KERNELS = True
except ImportError:
    KERNELS = False

R = 15
dev = torch.device("cuda")
# heads from the environment (session 53: H=32 HKV=8, Qwen3-4B's groups of four); session 52 ran 16 / 8
H, HKV, D = int(os.environ.get("H", 16)), int(os.environ.get("HKV", 8)), 128
scale = D ** -0.5


def timed(fn, reps=R):
    """GPU ms of fn() per call: each call between two events, the host held back by a sleep kernel before."""
    out = []
    for _ in range(reps):
        torch.cuda._sleep(20_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def run(name, paths):
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    se = Tree.from_paths(paths).to_batch().subtree_end
    T = se.numel()
    plan = vta.tree_attention_plan(to_device_with_host(se, dev), block_sparse=False)
    if not isinstance(plan, vta.SegmentPlan):
        print(f"{name}: not a segments plan ({type(plan).__name__}); skipped")
        return
    G = plan.gathered
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
    dout = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    idx = plan.key_index
    kw = dict(cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q,
              max_seqlen_k=plan.max_seqlen_k)
    rep = H // HKV

    def gather(expanded):
        if expanded == "kernels":  # treecompile's own (varlen_tree_attention.KV_HEADS = "expanded"; after the run)
            return gather_keys(k, idx, rep), gather_keys(v, idx, rep)
        if expanded:  # [T, HKV, rep, D] broadcast view, gathered to [G, HKV * rep, D] in one kernel each
            return (k[:, :, None].expand(T, HKV, rep, D).index_select(0, idx).view(G, H, D),
                    v[:, :, None].expand(T, HKV, rep, D).index_select(0, idx).view(G, H, D))
        return k.index_select(0, idx), v.index_select(0, idx)

    def fwd(kg, vg):
        return _flash_attn_fwd(q, kg, vg, softmax_scale=scale, causal=True, return_lse=True, **kw)[:2]

    def bwd(kg, vg, o, lse):
        return _flash_attn_bwd(q, kg, vg, o, dout, lse, scale, True, **kw)[:3]

    def sums(dkg, dvg, expanded):
        if expanded == "kernels":  # the heads of a group summed inside the copy sums
            return (sum_copies(dkg, plan.copies, idx, T, rep=rep), sum_copies(dvg, plan.copies, idx, T, rep=rep))
        dk, dv = sum_copies(dkg, plan.copies, idx, T), sum_copies(dvg, plan.copies, idx, T)
        if expanded:
            dk, dv = dk.view(T, HKV, rep, D).sum(2), dv.view(T, HKV, rep, D).sum(2)
        return dk, dv

    ref = None
    for expanded in (False, True, False, True) + (("kernels",) * 2 if KERNELS else ()):
        kg, vg = gather(expanded)
        o, lse = fwd(kg, vg)
        dq, dkg, dvg = bwd(kg, vg, o, lse)
        dk, dv = sums(dkg, dvg, expanded)
        torch.cuda.synchronize()
        if ref is None:
            ref = (o.float(), dq.float(), dk.float(), dv.float())
        else:  # the two forms compute the same attention; report how far apart (bf16 rounding of dK/dV differs)
            diff = [float((a - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                    for a, b in zip(ref, (o, dq, dk, dv))]
        t = {"gather": timed(lambda: gather(expanded)),
             "fwd": timed(lambda: fwd(kg, vg)),
             "bwd": timed(lambda: bwd(kg, vg, o, lse)),
             "sums": timed(lambda: sums(dkg, dvg, expanded))}
        t["total"] = sum(t.values())
        form = {False: "gqa     ", True: "expanded", "kernels": "kernels "}[expanded]
        print(f"{name:15s} T {T:6d} G {G:6d} {form}: "
              + "  ".join(f"{key} {ms:7.3f}" for key, ms in t.items()) + " ms"
              + ("" if not expanded else "   max rel diff to gqa (out, dq, dk, dv): "
                 + ", ".join(f"{x:.1e}" for x in diff)), flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), f"H {H} HKV {HKV} D {D}")
    spec = list(agentic_specs(1.0, ["parallel-tools"]))[0]
    run("parallel-tools", agentic_paths(spec))
    run("16x2048 POR 0.5", synthetic_paths(16, 2048, 0.5, seed=0))
