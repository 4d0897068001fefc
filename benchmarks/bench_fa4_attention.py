"""Tree attention through FlashAttention-4 on Hopper vs FA4's own causal kernel, fwd+bwd (issue 16 item 1).

Contenders at each tree (one H100/H200, bf16, Qwen3 attention shape H=16, Hkv=8, D=128, inputs in the
model's layout: ``[B, T, H, D]`` storage viewed as ``[B, H, T, D]``):

- ``cudnn_causal`` / ``fa4_causal``: dense causal attention over the tree's T tokens (cuDNN SDPA with k/v
  repeated for GQA inside the timed call; ``flash_attn.cute.flash_attn_func(causal=True)``);
- ``flex_triton``: compiled FlexAttention's Triton kernel under the tree BlockMask (tuned options);
- ``fa4_flex``: the same BlockMask through FlexAttention's ``BACKEND="FLASH"`` (FA4 kernels);
- ``fa4_direct``: ``flash_attn.cute.flash_attn_func`` with a CuTe mask_mod and the BlockMask's lists;
- ``fa4_varlen``: the op of ``attention_kernel="fa4_varlen"`` (``ops/varlen_tree_attention.py``) as it chooses per
  tree: FA4's varlen causal kernel over the tree's segments, each attending to its gathered path prefix (gather
  and scatter timed), or, where the segments would gather more than ``VARLEN_GATHER_LIMIT`` x T rows, FA4's
  block-sparse kernels under the tree mask; the row's ``plan`` says which.  Since session 58 a segment plan's
  forward that keeps no rows (the bench keeps none) runs FA4's block-sparse kernels (``UNKEPT_FORWARD``; ``plan``
  "block_sparse fwd, segments bwd");
- ``fa4_segments``: the same op held to the segments whatever they gather, forward and backward (the varlen
  kernel's own rate);
- ``fa4_block_sparse``: the same op held to its block-sparse plan whatever the segments would gather (FA4's
  block-sparse kernels under the tree mask, the op's own call): with ``fa4_segments``, both sides of
  ``VARLEN_GATHER_LIMIT`` on one tree;
- ``fa4_varlen_heavy_first``: ``fa4_varlen`` with its block-sparse plan in the heaviest-child-first order
  (``varlen_tree_attention.BLOCK_SPARSE_LAYOUT = "heavy_first"``: q/k/v permuted in and the output back inside the
  op, timed); the same as ``fa4_varlen`` where the tree takes the segments;
- ``fa4_prefix_block``: the prototype of ``prefix_block_attention.py``: the segments without each tree's shared
  prefix, which every later token attends as one full block read in place (FA4's non-causal kernel), the two
  parts merged by their log-sum-exps;
- ``fa4_varlen_index_add``: ``fa4_varlen`` with the key/value gradients of the gathered copies summed the way the
  op did before session 20 (``index_add_`` into a zeroed float32 buffer, then rounded) instead of
  ``ops/key_copies.py``'s kernel: the same-machine comparison for that change;
- ``fa4_varlen_kv_expanded``: ``fa4_varlen`` with grouped-query K/V expanded to the query heads in the segments'
  gather (``varlen_tree_attention.KV_HEADS = "expanded"``: FA4's backward writes per-head dK/dV, no float32
  accumulators over the gathered rows); the same as ``fa4_varlen`` where the tree takes the block-sparse plan or
  H == Hkv, and where "auto" (the default since session 53) expands already, groups of at most two;
- ``fa4_varlen_unkept_block_sparse``: ``fa4_varlen`` with its forward on FA4's block-sparse kernels where a segment
  plan keeps no rows (``varlen_tree_attention.UNKEPT_FORWARD = "block_sparse"``, the default since session 58, so
  the same as ``fa4_varlen`` unless the setting was changed; the bench keeps none): no gather in the forward, the
  segments' backward (which gathers) as before;
- ``fa4_varlen_unkept_segments``: ``fa4_varlen`` with the forward of a segment plan on the segments, gathering the
  rows it does not keep (``UNKEPT_FORWARD = "segments"``, ``fa4_varlen`` before session 58);
- ``fa4_varlen_kv_grouped``: ``fa4_varlen`` with the model's kv heads whatever the group size (``KV_HEADS =
  "grouped"``, the default before session 53);
- ``fa4_flex_heavy``: ``fa4_flex`` in the heaviest-first order (``attention_layout="heavy_first"``,
  ops/tree_layout.py): q/k/v gathered into that order, the BlockMask of that order, the output gathered
  back, all inside the timed call (what the lowering runs);
- ``fa4_flex_heavy_kernel``: the kernel alone on inputs already in that order (no gathers): the ceiling
  of a model that kept the whole sequence in that order;
- ``flex_triton_heavy``: the Triton flex kernel in that order, with the gathers;
- ``paths_fa4_varlen``: what the per-path baselines pay for the same tree: FA4's varlen causal kernel over
  the tree's paths packed into one sequence (``cu_seqlens``; path tokens, not tree tokens).  Its rows say
  how much of the FLOP bound the tree's attention keeps (``x_paths`` = its time / the tree contender's).

Every row has ``bwd_ms`` = fwd+bwd - fwd.  Tree statistics add the backward's balance: FA4's sm90 backward
runs one CTA per (kv block, head) over the q blocks that see it, so ``kv_qtiles_max`` / ``kv_qtiles_mean``
(q tiles per kv block) is how much longer the longest CTA runs than the average one.

TF/s over UNMASKED entries (fwd 4*H*D*nnz, bwd 2.5x fwd; causal nnz = T(T+1)/2); ``% FA4 causal`` =
tree TF/s / FA4 causal TF/s at the same T (the issue's target: >= 90 %).  ``out err``: norm-relative
error of the bf16 output on 128 sampled rows vs an fp32 dense-mask softmax.

Trees: synthetic (bench_attention.random_tree_paths, 16 paths) at the requested sizes and PORs, the harness's
synthetic (``--harness``) and agentic (``--agentic``) trees, and deep short-node agentic trees (benchmarks/trees.py,
50+ levels, ~90-token nodes).

Run on a GPU:  python benchmarks/bench_fa4_attention.py [--sizes 16384,32768,65536] [--out DIR]
Layouts only (issue 16 item 2, ~3 min on an H100): --pors 0.5,0.9 --contenders fa4_flex,fa4_flex_heavy,
fa4_flex_heavy_kernel --out DIR  (DIR gets fa4_attention.{md,json} and fa4_attention_{rows,trees}.csv)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from tabulate import tabulate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import H, HKV, D, DTYPE, TreeSpec, random_tree_paths, sampled_rows_error, tree_stats  # noqa: E402
from trees import AgenticSpec, agentic_paths, agentic_specs, harness_tree_paths  # noqa: E402

from treecompile import Tree  # noqa: E402
from treecompile.tree import DEFAULT_ORDER, ORDERS  # noqa: E402
from treecompile.ops import fa4_tree_attention as fa4  # noqa: E402
from treecompile.ops import flex_tree_attention as fta  # noqa: E402
from treecompile.ops.tree_layout import heavy_first_order, permuted_subtree_end, reordered_attention  # noqa: E402
from treecompile.ops import varlen_tree_attention as vta  # noqa: E402
from treecompile.ops.varlen_tree_attention import tree_attention_varlen  # noqa: E402

DEEP = [  # deep agentic trees with short nodes (20-200 tokens), 50+ levels
    AgenticSpec("deep-16k", prompt=800, turns=52, think=60, action=25, observation=50, fanout=2,
                fanout_turns=(20, 40), seed=7),
    AgenticSpec("deep-32k", prompt=1000, turns=56, think=70, action=30, observation=60, fanout=2,
                fanout_turns=(12, 28, 44), seed=8),
]


def set_shape(heads: int, kv_heads: int, head_dim: int) -> None:
    """The attention shape every case runs (module globals read by :func:`inputs` and the TF/s of :func:`row`)."""
    global H, HKV, D
    if heads % kv_heads:
        raise SystemExit(f"--shape: {heads} heads is not a multiple of {kv_heads} kv heads")
    H, HKV, D = heads, kv_heads, head_dim


def versions() -> dict:
    import triton

    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, python=platform.python_version())
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("flash-attn-4", "nvidia-cutlass-dsl", "tilelang", "flash-linear-attention"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def inputs(T, seed):
    """Leaves in the model's layout [1, T, H, D]; contenders see [1, H, T, D] views."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda h: torch.randn(1, T, h, D, device="cuda", dtype=DTYPE, generator=g)  # noqa: E731
    q, k, v = (mk(h).requires_grad_() for h in (H, HKV, HKV))
    do = mk(H).transpose(1, 2)
    return q, k, v, do


def timed(fn, q, k, v, do):
    """(fwd ms, fwd+bwd ms, first-call s): do_bench medians after one warm call."""
    from triton.testing import do_bench

    view = lambda x: x.transpose(1, 2)  # noqa: E731
    t0 = time.perf_counter()
    fn(view(q), view(k), view(v)).backward(do)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    f = do_bench(lambda: fn(view(q), view(k), view(v)), warmup=25, rep=200, return_mode="median")
    fb = do_bench(lambda: fn(view(q), view(k), view(v)).backward(do), warmup=25, rep=200,
                  grad_to_none=[q, k, v], return_mode="median")
    return f, fb, first


def row(case, name, fn, q, k, v, do, nnz, se=None) -> dict:
    r = dict(case=case, contender=name)
    try:
        f, fb, first = timed(fn, q, k, v, do)
        flops = 4.0 * H * D * nnz
        r.update(fwd_ms=round(f, 3), fwdbwd_ms=round(fb, 3), bwd_ms=round(fb - f, 3),
                 fwd_tfs=round(flops / f / 1e9, 1), bwd_tfs=round(2.5 * flops / max(fb - f, 1e-6) / 1e9, 1),
                 fwdbwd_tfs=round(3.5 * flops / fb / 1e9, 1), first_s=round(first, 1))
        if se is not None:
            with torch.no_grad():
                out = fn(*(x.detach().transpose(1, 2) for x in (q, k, v)))
            r["out_err"] = f"{sampled_rows_error(out, *(x.detach().transpose(1, 2) for x in (q, k, v)), se):.1e}"
    except torch.cuda.OutOfMemoryError:
        r["error"] = "OOM"
    except Exception as e:  # a kernel that refuses is a row
        r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        q.grad = k.grad = v.grad = None
        torch.cuda.empty_cache()
    print(json.dumps(r), flush=True)
    return r


def causal_fns():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn(q, k, v):
        r = q.shape[1] // k.shape[1]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)

    def fa4_causal(q, k, v):
        from flash_attn.cute import flash_attn_func

        o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return (o[0] if isinstance(o, tuple) else o).transpose(1, 2)

    return {"cudnn_causal": cudnn, "fa4_causal": fa4_causal}


def kv_balance(se) -> dict:
    """q tiles per kv block of the tree mask (128x128): the work of each backward CTA (max and mean)."""
    partial, full = fta.tree_block_classes(se, block_size=(128, 128))
    per_kv = (partial | full).sum(0).float()
    return dict(kv_qtiles_max=int(per_kv.max()), kv_qtiles_mean=round(float(per_kv.mean()), 1))


def paths_varlen(tree, seed):
    """(fn, q, k, v, do, nnz): FA4 varlen causal over the tree's paths packed into one sequence."""
    from flash_attn.cute import flash_attn_varlen_func

    lengths = (tree.path_offsets[1:] - tree.path_offsets[:-1]).tolist()
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    mx = max(lengths)
    q, k, v, do = inputs(int(cu[-1]), seed)

    def fn(q_, k_, v_):  # [1, H, T, D] views of [1, T, H, D] storage, as every contender gets
        o = flash_attn_varlen_func(q_.transpose(1, 2)[0], k_.transpose(1, 2)[0], v_.transpose(1, 2)[0],
                                   cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=True)
        return (o[0] if isinstance(o, tuple) else o)[None].transpose(1, 2)

    return fn, q, k, v, do, sum(n * (n + 1) // 2 for n in lengths)


def heavy_layout(se):
    """(order, BlockMask of that order, host+device ms to build both)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    order = heavy_first_order(se)
    bm = fta.tree_block_mask(permuted_subtree_end(se, order), validate=False)
    torch.cuda.synchronize()
    return order, bm, 1e3 * (time.perf_counter() - t0)


def _with_op_setting(name: str, value, fn, *args, **kw):
    """``fn(*args, **kw)`` with the varlen op's module attribute ``name`` set to ``value`` for everything ``fn`` runs
    (forward and backward), put back after, also when it raises."""
    return _with_op_settings({name: value}, fn, *args, **kw)


def _with_op_settings(settings: dict, fn, *args, **kw):
    """:func:`_with_op_setting` of several attributes at once (``settings``: name -> value)."""
    from unittest import mock

    with mock.patch.multiple(vta, **settings):
        return fn(*args, **kw)


def segments_only(fn, *args):
    """``fn(*args)`` with the varlen op held to its segment plan (no block-sparse choice), its forward too (it
    gathers the rows: ``UNKEPT_FORWARD = "segments"``)."""
    return _with_op_settings({"UNKEPT_FORWARD": "segments", "VARLEN_GATHER_LIMIT": float("inf")}, fn, *args)


def block_sparse_only(fn, *args):
    """``fn(*args)`` with the varlen op held to its block-sparse plan (where FA4's block-sparse tiles take the head
    dim; else the segments, as the op chooses)."""
    return _with_op_setting("VARLEN_GATHER_LIMIT", 0.0, fn, *args)


def block_sparse_heavy_first(fn, *args, **kw):
    """``fn(*args, **kw)`` with the varlen op's block-sparse plan in the heaviest-child-first order (the op keeps its
    plan per order)."""
    return _with_op_setting("BLOCK_SPARSE_LAYOUT", "heavy_first", fn, *args, **kw)


def index_add_sums(fn, *args, **kw):
    """``fn(*args, **kw)`` with the varlen op's per-token copy sums done by ``index_add_`` into float32 (as before
    session 20)."""
    from treecompile.ops.key_copies import sum_copies_index_add

    def sums(src, runs, key_index, T, config=None, *, zero_tail=True, rep=1):  # sum_copies' signature
        return sum_copies_index_add(src, key_index, T, rep)  # (its tail rows zero: what zero_tail=False allows)

    return _with_op_setting("sum_copies", sums, fn, *args, **kw)


def kv_expanded(fn, *args, **kw):
    """``fn(*args, **kw)`` with the varlen op's segments reading K/V expanded to the query heads (forward and
    backward)."""
    return _with_op_setting("KV_HEADS", "expanded", fn, *args, **kw)


def unkept_block_sparse(fn, *args, **kw):
    """``fn(*args, **kw)`` with the varlen op's forwards that keep no rows on the block-sparse kernels."""
    return _with_op_setting("UNKEPT_FORWARD", "block_sparse", fn, *args, **kw)


def unkept_segments(fn, *args, **kw):
    """``fn(*args, **kw)`` with the varlen op's forwards that keep no rows on the segments (they gather)."""
    return _with_op_setting("UNKEPT_FORWARD", "segments", fn, *args, **kw)


def kv_grouped(fn, *args, **kw):
    """``fn(*args, **kw)`` with the varlen op's segments handing the kernel the model's kv heads (forward and
    backward)."""
    return _with_op_setting("KV_HEADS", "grouped", fn, *args, **kw)


# the varlen op's rows timed under one of its module settings: row name -> the wrapper that sets it
SETTING_ROWS = {"fa4_varlen_index_add": index_add_sums, "fa4_varlen_heavy_first": block_sparse_heavy_first,
                "fa4_varlen_kv_expanded": kv_expanded, "fa4_varlen_kv_grouped": kv_grouped,
                "fa4_varlen_unkept_block_sparse": unkept_block_sparse, "fa4_varlen_unkept_segments": unkept_segments}


# the rows that run the varlen op's forwards without kept rows under a setting of their own (the rest: the module's)
UNKEPT_ROWS = {"fa4_segments": "segments", "fa4_varlen_unkept_block_sparse": "block_sparse",
               "fa4_varlen_unkept_segments": "segments"}


def plan_kind(se, q) -> str:
    """Which plan the varlen op takes for this tree and these inputs: "segments" or "block_sparse"."""
    return "block_sparse" if isinstance(vta._plan(se, q), vta.BlockSparsePlan) else "segments"


def tree_fns(se, bm, which, heavy=None):
    opts = dict(fta.HOPPER_KERNEL_OPTIONS)
    out = {}
    if "flex_triton" in which:
        # the options the lowering passes (tuned for D=128 on Hopper; flex's defaults otherwise, e.g. D=256)
        out["flex_triton"] = lambda q, k, v: fta.tree_attention_flex(q, k, v, bm, enable_gqa=True,
                                                                    kernel_options=fta.kernel_options_for(q))
    if "fa4_flex" in which:
        out["fa4_flex"] = lambda q, k, v: fa4.tree_attention_fa4(q, k, v, bm, enable_gqa=True)
    # no BlockMask: the op's plan, built on the first call and kept for se; main() runs the rows of SETTING_ROWS
    # under their setting (the backward too)
    if "fa4_varlen" in which:
        out["fa4_varlen"] = lambda q, k, v: tree_attention_varlen(q, k, v, se)
    if "fa4_varlen_index_add" in which:
        out["fa4_varlen_index_add"] = lambda q, k, v: tree_attention_varlen(q, k, v, se)
    if "fa4_varlen_kv_expanded" in which:
        out["fa4_varlen_kv_expanded"] = lambda q, k, v: tree_attention_varlen(q, k, v, se)
    if "fa4_varlen_kv_grouped" in which:
        out["fa4_varlen_kv_grouped"] = lambda q, k, v: tree_attention_varlen(q, k, v, se)
    if "fa4_varlen_unkept_block_sparse" in which:
        out["fa4_varlen_unkept_block_sparse"] = lambda q, k, v: tree_attention_varlen(q, k, v, se)
    if "fa4_varlen_unkept_segments" in which:
        out["fa4_varlen_unkept_segments"] = lambda q, k, v: tree_attention_varlen(q, k, v, se)
    if "fa4_varlen_heavy_first" in which:  # main() runs its row in that order (the backward too)
        se_hf = se.clone()  # a tensor of its own: the op keeps one plan per subtree_end tensor
        out["fa4_varlen_heavy_first"] = lambda q, k, v: tree_attention_varlen(q, k, v, se_hf)
    if "fa4_segments" in which:  # a tensor of its own: the op keeps one plan per subtree_end tensor
        se_seg = se.clone()
        out["fa4_segments"] = lambda q, k, v: segments_only(tree_attention_varlen, q, k, v, se_seg)
    if "fa4_block_sparse" in which:  # a tensor of its own, as fa4_segments'
        se_bs = se.clone()
        out["fa4_block_sparse"] = lambda q, k, v: block_sparse_only(tree_attention_varlen, q, k, v, se_bs)
    if "fa4_prefix_block" in which:  # the prototype: each tree's shared prefix as one full block, read in place
        from prefix_block_attention import prefix_block_attention

        se_pb = se.clone()  # a tensor of its own: the prototype keeps one plan per subtree_end tensor
        out["fa4_prefix_block"] = lambda q, k, v: prefix_block_attention(q, k, v, se_pb)
    if "fa4_direct" in which:
        sparse = fa4.fa4_block_sparse_tensors(bm)
        out["fa4_direct"] = lambda q, k, v: fa4.tree_attention_fa4_direct(q, k, v, se, bm, block_sparse=sparse)
    if heavy is not None:
        order, bm_h, _ = heavy
        if "fa4_flex_heavy" in which:
            out["fa4_flex_heavy"] = lambda q, k, v: reordered_attention(
                lambda a, b, c: fa4.tree_attention_fa4(a, b, c, bm_h, enable_gqa=True), q, k, v, order)
        if "flex_triton_heavy" in which:
            out["flex_triton_heavy"] = lambda q, k, v: reordered_attention(
                lambda a, b, c: fta.tree_attention_flex(a, b, c, bm_h, enable_gqa=True, kernel_options=opts),
                q, k, v, order)
    return out


# the tree contenders (module docstring); FA4's and cuDNN's causal kernels run at every T as the reference
CONTENDERS = ("flex_triton", "fa4_flex", "fa4_direct", "fa4_varlen", "fa4_varlen_index_add", "fa4_varlen_heavy_first",
              "fa4_varlen_kv_expanded", "fa4_varlen_kv_grouped", "fa4_varlen_unkept_block_sparse",
              "fa4_varlen_unkept_segments", "fa4_segments",
              "fa4_block_sparse", "fa4_prefix_block", "fa4_flex_heavy", "fa4_flex_heavy_kernel", "flex_triton_heavy",
              "paths_fa4_varlen")


def contender_names(arg: str) -> list[str]:
    """``--contenders``' comma-separated names, each one of :data:`CONTENDERS` (else SystemExit naming it)."""
    which = [x for x in arg.split(",") if x]
    unknown = [x for x in which if x not in CONTENDERS]
    if unknown or not which:
        raise SystemExit(f"--contenders: unknown {unknown} (choose from {', '.join(CONTENDERS)})" if unknown
                         else "--contenders: none given")
    return which


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16384,32768,65536")
    ap.add_argument("--pors", default="0.5,0.75,0.9")
    ap.add_argument("--deep", default="deep-16k,deep-32k", help="agentic deep trees ('none' for none)")
    ap.add_argument("--harness", default="", help="the harness's synthetic trees, comma-separated "
                    "PATHSxLEN@POR (e.g. 32x2048@0.5: trees.synthetic_paths, the end-to-end tree at 32k)")
    ap.add_argument("--agentic", default="", help="the harness's agentic trees, comma-separated names of "
                    "trees.agentic_specs (e.g. deep-agent,parallel-tools: the end-to-end rows' trees)")
    ap.add_argument("--contenders", default="flex_triton,fa4_flex,fa4_direct")
    ap.add_argument("--order", default=DEFAULT_ORDER, choices=ORDERS,
                    help="how the trees are serialised (Tree.from_paths' order; default %(default)s, the library's; "
                         "'lex' is the sorted order, every tree's before session 46)")
    ap.add_argument("--out", default=None, help="folder for fa4_attention.{json,md}")
    ap.add_argument("--shape", default=f"{H}:{HKV}:{D}", help="heads:kv_heads:head_dim (default %(default)s; "
                    "the Qwen3.5 hybrids' attention: 8:2:256)")
    a = ap.parse_args()
    set_shape(*(int(x) for x in a.shape.split(":")))
    for key in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 512)
    cond = versions()
    cond.update(dtype="bfloat16", heads=H, kv_heads=HKV, head_dim=D)
    print(json.dumps(cond), flush=True)
    which = contender_names(a.contenders)
    cases = []  # (case name, T, Tree)
    for T in [int(s) for s in a.sizes.split(",") if s]:
        for por in [float(p) for p in a.pors.split(",") if p]:
            tree = Tree.from_paths(random_tree_paths(TreeSpec(T, por)), order=a.order)
            cases.append((f"syn T={T} POR={tree.por:.2f}", tree))
    for item in [x for x in a.harness.split(",") if x]:
        tree = Tree.from_paths(harness_tree_paths(item), order=a.order)
        cases.append((f"harness {item} T={tree.num_tokens} POR={tree.por:.2f}", tree))
    try:
        specs = agentic_specs(names=[x for x in a.agentic.split(",") if x]) if a.agentic else []
    except ValueError as e:
        raise SystemExit(f"--agentic: {e}") from None
    for spec in specs:
        tree = Tree.from_paths(agentic_paths(spec), order=a.order)
        cases.append((f"harness agentic {spec.name} T={tree.num_tokens} POR={tree.por:.2f}", tree))
    for spec in DEEP:
        if a.deep != "none" and spec.name in a.deep.split(","):
            tree = Tree.from_paths(agentic_paths(spec), order=a.order)
            cases.append((f"agentic {spec.name} T={tree.num_tokens} POR={tree.por:.2f}", tree))
    stats, rows = [], []
    causal = {}
    for case, tree in cases:
        T = tree.num_tokens
        Tp = -(-T // 128) * 128  # whole 128-blocks, as the length buckets of the lowering are
        batch = tree.to_batch(pad_to_multiple=128, device="cuda")
        se = batch.subtree_end
        st = tree_stats(tree, se[:T].contiguous())
        mask_ms = []  # the BlockMask from node intervals: the median of 5 after a warm-up (the first call of the
        for _ in range(6):  # process pays for its kernels' first launch: 69 ms in session 36's first case)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bm = fta.tree_block_mask(se, validate=False)
            torch.cuda.synchronize()
            mask_ms.append(1e3 * (time.perf_counter() - t0))
        mask_ms = sorted(mask_ms[1:])[2]
        heavy = heavy_layout(se) if any("heavy" in w for w in which) else None
        levels = int(batch.node_level.max()) + 1
        extra = dict(mask_ms=round(mask_ms, 2))
        if heavy is not None:
            h = tree_stats(tree, permuted_subtree_end(se, heavy[0])[:T].contiguous())
            extra.update(heavy_tiles_full=h["tiles_full"], heavy_tiles_partial=h["tiles_partial"],
                         heavy_tile_util=h["tile_util"], heavy_layout_ms=round(heavy[2], 2))
        stats.append(dict(case=case, T_padded=Tp, levels=levels, **st, **kv_balance(se), **extra))
        q, k, v, do = inputs(Tp, seed=T)
        if Tp not in causal:
            causal[Tp] = {}
            for name, fn in causal_fns().items():
                r = row(f"causal T={Tp}", name, fn, q, k, v, do, Tp * (Tp + 1) // 2)
                rows.append(r)
                causal[Tp][name] = r
        # padding tokens see only themselves: count their entries so TF/s match the kernel's work
        nnz = int((se.cpu() - torch.arange(Tp)).sum())
        ref = causal[Tp].get("fa4_causal", {}).get("fwdbwd_tfs")
        fns = tree_fns(se, bm, which, heavy)
        if heavy is not None and "fa4_flex_heavy_kernel" in which:  # the kernel on inputs already in that order
            fns["fa4_flex_heavy_kernel"] = lambda q_, k_, v_, bm_h=heavy[1]: fa4.tree_attention_fa4(
                q_, k_, v_, bm_h, enable_gqa=True)
        for name, fn in fns.items():
            if name == "fa4_flex_heavy_kernel":  # same data, permuted once outside the timed call
                qh, kh, vh = (x.detach()[:, heavy[0][0]].requires_grad_() for x in (q, k, v))
                r = row(case, name, fn, qh, kh, vh, do, nnz)
                del qh, kh, vh
            elif name in SETTING_ROWS:
                r = SETTING_ROWS[name](row, case, name, fn, q, k, v, do, nnz, se)
            else:
                r = row(case, name, fn, q, k, v, do, nnz, se)
            if name == "fa4_varlen" or name == "fa4_segments" or name in SETTING_ROWS:
                r["plan"] = "segments" if name == "fa4_segments" else plan_kind(se, q)
            if (r.get("plan") == "segments" and UNKEPT_ROWS.get(name, vta.UNKEPT_FORWARD) == "block_sparse"
                    and fa4.fa4_input_reason(q) is None):  # no rows kept in the bench: every forward reads in place
                r["plan"] = "block_sparse fwd, segments bwd"
            if name == "fa4_block_sparse":  # the plan its own subtree_end got under the forced limit
                r["plan"] = "block_sparse" if fa4.fa4_input_reason(q) is None else "segments"
            if name == "fa4_prefix_block":
                from prefix_block_attention import prefix_block_plan

                pb_plan, pb_blocks = prefix_block_plan(se)
                r["plan"] = f"segments G={pb_plan.gathered} + {len(pb_blocks)} blocks"
            if ref and "fwdbwd_tfs" in r:
                r["pct_fa4_causal"] = round(100 * r["fwdbwd_tfs"] / ref, 1)
            rows.append(r)
        del q, k, v, do
        if "paths_fa4_varlen" in which:  # the baselines' attention over the same tree's paths
            try:
                fn, *xs, nnz_p = paths_varlen(tree, seed=T)
                r = row(case, "paths_fa4_varlen", fn, *xs, nnz_p)
                del xs
            except Exception as e:  # a kernel that refuses is a row
                r = dict(case=case, contender="paths_fa4_varlen", error=f"{type(e).__name__}: {str(e)[:160]}")
            if ref and "fwdbwd_tfs" in r:  # FA4's own rate on the tree's rows, against its causal rate at T
                r["pct_fa4_causal"] = round(100 * r["fwdbwd_tfs"] / ref, 1)
            for t in rows:  # x_paths: the tree contender's speed-up over the baselines' attention
                if t["case"] == case and t is not r and "fwdbwd_ms" in t and "fwdbwd_ms" in r:
                    t["x_paths_fwd"] = round(r["fwd_ms"] / t["fwd_ms"], 3)
                    t["x_paths_bwd"] = round(r["bwd_ms"] / t["bwd_ms"], 3)
                    t["x_paths"] = round(r["fwdbwd_ms"] / t["fwdbwd_ms"], 3)
            rows.append(r)
    text = ["Conditions: " + json.dumps(cond) + "; TF/s over unmasked entries (fwd 4*H*D*nnz, bwd 2.5x fwd); "
            "do_bench medians; inputs in the model layout ([B,T,H,D] storage); trees padded to whole 128-blocks.",
            "", tabulate(stats, headers="keys", tablefmt="github"), "",
            tabulate(rows, headers="keys", tablefmt="github"), ""]
    out = "\n".join(text)
    print(out, flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        for name, text in (("fa4_attention.md", out),
                           ("fa4_attention.json", json.dumps(dict(cond=cond, stats=stats, rows=rows), indent=1))):
            path = os.path.join(a.out, name)  # temp then rename: no half-written file
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        for name, table in (("fa4_attention_rows.csv", rows), ("fa4_attention_trees.csv", stats)):
            write_csv(os.path.join(a.out, name), table)


def write_csv(path: str, table: list[dict]) -> None:
    """One header over every key that any row has (rows that lack one leave it empty); temp then rename."""
    import csv

    keys = list(dict.fromkeys(k for r in table for k in r))
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(table)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
