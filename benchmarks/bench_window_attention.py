"""Sliding-window tree attention on CUDA: ``treecompile::tree_attention_windowed`` (FlexAttention under
``tree_window_block_mask``) against full tree attention (``tree_block_mask``) and SDPA causal over the same T.

For each tree (``trees.synthetic_paths``: 16 paths, POR 0.5) and window W: fwd and fwd+bwd median ms
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
from trees import synthetic_paths  # noqa: E402

from treecompile import Tree  # noqa: E402
from treecompile.ops.flex_tree_attention import tree_attention_flex, tree_block_mask, tree_window_block_mask  # noqa: E402
from treecompile.ops.tree_attention import tree_attention_windowed, tree_window_mask  # noqa: E402

H, HKV, D = 16, 8, 128


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
    args = ap.parse_args()
    rows = []
    for L in args.path_len:
        batch = Tree.from_paths(synthetic_paths(16, L, 0.5, seed=L)).to_batch(device="cuda")
        se, pos, T = batch.subtree_end, batch.position_ids, batch.seq_len
        g = torch.Generator(device="cuda").manual_seed(L)
        q, k, v = (torch.randn(1, h, T, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
                   for h in (H, HKV, HKV))
        do = torch.randn(1, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16)
        cases = [("tree (no window)", None)] + [(f"tree, window {w}", w) for w in args.windows]
        for name, w in cases:
            if w is None:
                bm = tree_block_mask(se)
                mask = tree_window_mask(se, pos, T + 1)
                fn = lambda a, b, c: tree_attention_flex(a, b, c, bm, enable_gqa=True)  # noqa: E731
            else:
                bm = tree_window_block_mask(se, pos, w)
                mask = tree_window_mask(se, pos, w)
                fn = lambda a, b, c, w=w: tree_attention_windowed(a, b, c, se, pos, w)  # noqa: E731
            entries = int(mask.sum())
            fwd, fb = timed(fn, q, k, v, do)
            flops = 4 * D * entries * H
            err = sampled_error(fn(q, k, v).detach(), q, k, v, mask)
            tiles = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
            rows.append(dict(path_len=L, T=T, case=name, window=w, visible=entries, tiles=tiles, fwd_ms=fwd,
                             fwdbwd_ms=fb, fwd_tfs=flops / fwd / 1e9, fwdbwd_tfs=2.5 * flops / fb / 1e9, err=err))
            print(json.dumps(rows[-1]), flush=True)
            del mask
        causal = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            a, b, c, is_causal=True, enable_gqa=True)
        fwd, fb = timed(causal, q, k, v, do)
        flops = 4 * D * (T * (T + 1) // 2) * H
        rows.append(dict(path_len=L, T=T, case="SDPA causal over T", window=None, visible=T * (T + 1) // 2,
                         tiles=None, fwd_ms=fwd, fwdbwd_ms=fb, fwd_tfs=flops / fwd / 1e9,
                         fwdbwd_tfs=2.5 * flops / fb / 1e9, err=None))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  rows=rows), indent=1))


if __name__ == "__main__":
    main()
