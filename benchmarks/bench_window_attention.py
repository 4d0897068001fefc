"""Sliding-window tree attention on CUDA: ``treecompile::tree_attention_windowed`` (FlexAttention under
``tree_window_block_mask``) against full tree attention (``tree_block_mask``) and SDPA causal over the same T.

Cases per window: ``op`` (the registered op called eagerly: FlexAttention inside it, a backward that recomputes the
forward), ``lowered`` (compiled FlexAttention under the window block mask with flex's own backward) with each
``--configs`` kernel-option set of flex's Triton kernel (``default`` = the committed ``WINDOW_KERNEL_OPTIONS``),
``fa4`` (the FLASH backend, where flash-attn-4 runs) and ``fa4_varlen`` (what ``lower_cuda`` makes of it under
``"auto"`` where FA4 runs: FA4's varlen kernel with its own window over the windowed segments).

For each tree (``trees.synthetic_paths``: 16 paths, POR 0.5; ``--agentic`` adds agentic trees) and window W: fwd and fwd+bwd median ms
(``triton.testing.do_bench``), the visible entries of each mask (TF/s counted over them: 4 * D * entries per
head forward, 2.5x that fwd+bwd), the listed tiles, and the output's error on 128 sampled query rows against a
float64 dense reference.  bf16, H=16, Hkv=8, D=128.  Usage: ``python benchmarks/bench_window_attention.py
[--out FILE.json]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees import agentic_paths, agentic_specs, synthetic_paths  # noqa: E402

from treecompile import Tree  # noqa: E402
from treecompile.ops.fa4_tree_attention import FA4_KERNEL_OPTIONS, fa4_unusable_reason  # noqa: E402
from treecompile.ops.flex_tree_attention import (WINDOW_KERNEL_OPTIONS, tree_attention_flex, tree_block_mask,  # noqa: E402
                                                 tree_window_block_mask)
from treecompile.ops.tree_attention import tree_attention_windowed, tree_window_mask  # noqa: E402
from treecompile.ops.varlen_tree_attention import tree_attention_varlen_windowed, windowed_plan  # noqa: E402

H, HKV, D = 16, 8, 128
# flex Triton kernel options tried for the windowed mask (--configs picks by name)
CONFIGS = {
    "default": WINDOW_KERNEL_OPTIONS,
    "torch": {},
    "m128n128s2w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_stages": 2, "fwd_num_warps": 8},  # = default
    "m128n64s3w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 3, "fwd_num_warps": 8},
    "m64n128s3w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_stages": 3, "fwd_num_warps": 4},
    "m128n64s2w4": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_stages": 2, "fwd_num_warps": 4},
}


def timed(fn, q, k, v, do):
    from triton.testing import do_bench

    fn(q, k, v).backward(do)
    torch.cuda.synchronize()
    fwd = do_bench(lambda: fn(q, k, v), warmup=25, rep=200, return_mode="median")
    fb = do_bench(lambda: fn(q, k, v).backward(do), warmup=25, rep=200, grad_to_none=[q, k, v],
                  return_mode="median")
    return fwd, fb


def sampled_error(out, q, k, v, mask, rows=128, seed=0) -> float:
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.randint(0, q.shape[2], (rows,), generator=g).cuda()
    rep = H // HKV
    kk, vv = (x.double().repeat_interleave(rep, 1) for x in (k, v))
    s = (q.double()[:, :, idx] @ kk.transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~mask[idx], float("-inf"))
    ref = torch.softmax(s, -1) @ vv
    return float((out.double()[:, :, idx] - ref).norm() / ref.norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--path-len", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--windows", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--configs", nargs="+", default=["default"], choices=sorted(CONFIGS))
    ap.add_argument("--no-op", action="store_true", help="skip the op called eagerly")
    ap.add_argument("--agentic", nargs="*", default=[], help="agentic_specs names to add (e.g. deep-agent)")
    ap.add_argument("--no-lowered", action="store_true", help="skip flex's Triton kernel under the window mask")
    args = ap.parse_args()
    fa4 = fa4_unusable_reason() is None
    print(f"fa4: {fa4_unusable_reason() or 'usable'}", flush=True)
    rows = []
    specs = {s.name: s for s in agentic_specs()}
    trees = [(L, synthetic_paths(16, L, 0.5, seed=L)) for L in args.path_len]
    trees += [(name, agentic_paths(specs[name])) for name in args.agentic]
    for L, paths in trees:
        batch = Tree.from_paths(paths).to_batch(device="cuda")
        se, pos, T = batch.subtree_end, batch.position_ids, batch.seq_len
        g = torch.Generator(device="cuda").manual_seed(T)
        q, k, v = (torch.randn(1, h, T, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
                   for h in (H, HKV, HKV))
        do = torch.randn(1, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16)
        cases = [("tree (no window)", None, "flex", None)] + ([("tree (no window)", None, "fa4", None)] if fa4 else [])
        for w in args.windows:
            cases += [] if args.no_op else [(f"tree, window {w}", w, "op", None)]
            cases += [] if args.no_lowered else [(f"tree, window {w}", w, f"lowered {c}", CONFIGS[c])
                                                 for c in args.configs]
            cases += [(f"tree, window {w}", w, how, None) for how in ("fa4", "fa4_varlen")] if fa4 else []
        for name, w, how, opts in cases:
            if w is None:
                bm = tree_block_mask(se)
                mask = tree_window_mask(se, pos, T + 1)
                ko = dict(FA4_KERNEL_OPTIONS) if how == "fa4" else None
                fn = lambda a, b, c, ko=ko: tree_attention_flex(a, b, c, bm, enable_gqa=True,  # noqa: E731
                                                                 kernel_options=ko)
            else:
                bm = tree_window_block_mask(se, pos, w)
                mask = tree_window_mask(se, pos, w)
                if how == "op":
                    fn = lambda a, b, c, w=w: tree_attention_windowed(a, b, c, se, pos, w)  # noqa: E731
                elif how == "fa4_varlen":  # FA4's varlen kernel with its window over the windowed segments
                    plan = windowed_plan(se, pos, w)
                    print(json.dumps(dict(T=T, window=w, gathered=None if plan is None else plan.gathered,
                                          segments=None if plan is None else plan.segments)), flush=True)
                    fn = lambda a, b, c, w=w: tree_attention_varlen_windowed(a, b, c, se, pos, w)  # noqa: E731
                else:
                    ko = dict(FA4_KERNEL_OPTIONS) if how == "fa4" else dict(opts)
                    fn = lambda a, b, c, bm=bm, ko=ko: tree_attention_flex(a, b, c, bm, enable_gqa=True,  # noqa: E731
                                                                            kernel_options=ko)
            entries = int(mask.sum())
            try:
                fwd, fb = timed(fn, q, k, v, do)
            except Exception as e:  # a config that does not fit the device: say so, go on
                rows.append(dict(path_len=L, T=T, case=name, how=how, window=w, failed=f"{type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200]}"))
                print(json.dumps(rows[-1]), flush=True)
                continue
            flops = 4 * D * entries * H
            err = sampled_error(fn(q, k, v).detach(), q, k, v, mask)
            tiles = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
            rows.append(dict(path_len=L, T=T, case=name, how=how, window=w, visible=entries, tiles=tiles,
                             full_tiles=int(bm.full_kv_num_blocks.sum()), fwd_ms=fwd, fwdbwd_ms=fb,
                             fwd_tfs=flops / fwd / 1e9, fwdbwd_tfs=2.5 * flops / fb / 1e9, err=err))
            print(json.dumps(rows[-1]), flush=True)
            del mask
        causal = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            a, b, c, is_causal=True, enable_gqa=True)
        fwd, fb = timed(causal, q, k, v, do)
        flops = 4 * D * (T * (T + 1) // 2) * H
        rows.append(dict(path_len=L, T=T, case="SDPA causal over T", how="sdpa", window=None, visible=T * (T + 1) // 2,
                         tiles=None, fwd_ms=fwd, fwdbwd_ms=fb, fwd_tfs=flops / fwd / 1e9,
                         fwdbwd_tfs=2.5 * flops / fb / 1e9, err=None))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  rows=rows), indent=1))


if __name__ == "__main__":
    main()
