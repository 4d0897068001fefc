"""Tree attention (compiled FlexAttention + tree BlockMask) against dense causal SDPA, fwd+bwd, on CUDA.

TF/s are counted on UNMASKED entries for every contender: a tree of T tokens does
4 * H * D * nnz FLOPs forward (nnz = sum_k (subtree_end[k] - k) visible (q, k) pairs per head) and
2.5x that backward; causal SDPA at the same T does the same per entry with nnz = T (T + 1) / 2.
The ratio of the two TF/s is how close the tree kernel comes to the best dense kernel per useful entry.

Steps: (1) trees of the requested sizes/POR (a random branching generator of our own, built with
Tree.from_paths), their tile statistics and the BlockMask build time; (2) a sweep of kernel options at
one size; (3) the best options and torch's stock options at every size, beside cuDNN / flash SDPA
(causal) and flex on a single-path tree (the causal mask through the same kernel).

Run on a GPU:  python benchmarks/bench_attention.py [--quick] [--out RESULTS_section.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import time
from dataclasses import dataclass

import torch
from tabulate import tabulate

from treecompile import Tree
from treecompile.ops import flex_tree_attention as fta

H, HKV, D = 16, 8, 128  # Qwen3-0.6B attention shapes
DTYPE = torch.bfloat16


@dataclass(frozen=True)
class TreeSpec:
    tokens: int
    por: float
    paths: int = 16
    seed: int = 0


@dataclass(frozen=True)
class KernelConfig:
    name: str
    options: tuple = ()  # sorted (key, value) pairs of FlexAttention kernel options
    block: tuple = (128, 128)  # sparse BlockMask tile (q, kv)

    @property
    def kernel_options(self) -> dict:
        return dict(self.options)


def kc(name, block=(128, 128), **opts) -> KernelConfig:
    return KernelConfig(name, tuple(sorted(opts.items())), block)


SAFE = dict(ROWS_GUARANTEED_SAFE=True)
SWEEP = [
    kc("tuned", **fta.HOPPER_KERNEL_OPTIONS),  # what tree_attention_flex uses on sm_90 (bf16/fp16, D=128)
    kc("stock"),  # torch's H100 defaults: fwd 128x64 s3 w8; bwd M1 64 N1 128 M2 128 N2 64 s3 w8
    kc("safe", **SAFE),
    kc("safe+fwd128x128s2", **SAFE, fwd_BLOCK_M=128, fwd_BLOCK_N=128, fwd_num_stages=2, fwd_num_warps=8),
    kc("safe+fwd128x128s3", **SAFE, fwd_BLOCK_M=128, fwd_BLOCK_N=128, fwd_num_stages=3, fwd_num_warps=8),
    kc("safe+fwd128x128s2+fwd_tma", **SAFE, fwd_BLOCK_M=128, fwd_BLOCK_N=128, fwd_num_stages=2, fwd_num_warps=8,
       fwd_USE_TMA=True),
    kc("safe+fwd_tma", **SAFE, fwd_USE_TMA=True),
    kc("safe+bwd_w4", **SAFE, bwd_num_warps=4),
    kc("safe+bwd32x128", **SAFE, bwd_BLOCK_M1=32, bwd_BLOCK_N1=128, bwd_BLOCK_M2=128, bwd_BLOCK_N2=32),
    # measured worse on an H200 in the first run (RESULTS.md): bwd_num_stages=2, USE_TMA (fwd+bwd),
    # PRESCALE_QK; a (128, 64) sparse tile finds no backward config (torch filters its default
    # bwd config by the sparse tile before applying overrides)
]


@dataclass
class Result:
    case: str
    contender: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_tfs: float | None = None
    fwdbwd_tfs: float | None = None
    error: str | None = None


# ---------------------------------------------------------------------------------------- trees
def random_tree_paths(spec: TreeSpec) -> list[list[int]]:
    """``spec.paths`` paths of equal length whose union has exactly ``spec.tokens`` unique tokens.

    Path length L = tokens / (paths * (1 - por)) gives the requested prefix overlap ratio; each new
    path copies a prefix of a random earlier path and appends fresh tokens (new ids, so no accidental
    merges), the fresh part drawn around its mean and the last path taking what is left.
    """
    rng = random.Random(spec.seed)
    P, T = spec.paths, spec.tokens
    L = max(1, round(T / (P * (1.0 - spec.por))))
    if P == 1 or L >= T:
        return [list(range(T))]
    nxt = iter(range(10**9))
    paths = [[next(nxt) for _ in range(L)]]
    left = T - L
    mean_new = left / (P - 1)
    for i in range(1, P):
        new = left if i == P - 1 else max(1, min(L, left - (P - 1 - i), round(rng.uniform(0.5, 1.5) * mean_new)))
        new = min(new, left)
        if new <= 0:
            break
        base = rng.choice(paths)
        keep = max(0, L - new)
        paths.append(base[:keep] + [next(nxt) for _ in range(new)])
        left -= new
    if left > 0:  # the last path was capped at L fresh tokens: put the rest on a fresh root
        paths.append([next(nxt) for _ in range(left)])
    return paths


def tree_stats(tree: Tree, se: torch.Tensor, block=(128, 128)) -> dict:
    T = tree.num_tokens
    nnz = int((se.cpu() - torch.arange(T)).sum())
    partial, full = fta.tree_block_classes(se, block_size=block)
    n_partial, n_full = int(partial.sum()), int(full.sum())
    tile = block[0] * block[1]
    return dict(T=T, paths=tree.num_paths, POR=round(tree.por, 3), nodes=tree.num_nodes,
                mean_node=round(T / tree.num_nodes, 1), nnz=nnz, density=round(nnz / (T * (T + 1) / 2), 3),
                tiles_full=n_full, tiles_partial=n_partial,
                tile_util=round(nnz / ((n_full + n_partial) * tile), 3))


# ---------------------------------------------------------------------------------------- timing
def bench_fwd_bwd(fn, q, k, v, do):
    from triton.testing import do_bench

    def fwd():
        return fn(q, k, v)

    def fwdbwd():
        fn(q, k, v).backward(do)

    fwdbwd()  # compile / warm
    torch.cuda.synchronize()
    f = do_bench(fwd, warmup=25, rep=200, return_mode="median")
    fb = do_bench(fwdbwd, warmup=25, rep=200, grad_to_none=[q, k, v], return_mode="median")
    return f, fb


def run_contender(case, name, fn, q, k, v, do, nnz) -> Result:
    r = Result(case, name)
    try:
        r.fwd_ms, r.fwdbwd_ms = bench_fwd_bwd(fn, q, k, v, do)
        flops = 4.0 * H * D * nnz
        r.fwd_tfs = flops / (r.fwd_ms * 1e-3) / 1e12
        r.fwdbwd_tfs = 3.5 * flops / (r.fwdbwd_ms * 1e-3) / 1e12
    except torch.cuda.OutOfMemoryError:
        r.error = "OOM"
    except Exception as e:  # a failed compile or backend is a row, not a crash
        r.error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    finally:
        q.grad = k.grad = v.grad = None
    torch.cuda.empty_cache()
    return r


def sampled_rows_error(out, q, k, v, se, rows=128, seed=0, device="cuda") -> float:
    """Norm-relative error of ``out`` on sampled query rows vs an fp32 dense-mask softmax (all heads)."""
    T = q.shape[2]
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = torch.randint(0, T, (rows,), device="cuda", generator=g)
    rep = q.shape[1] // k.shape[1]
    kk, vv = (x[0].float().repeat_interleave(rep, 0) for x in (k, v))  # [H, T, D]
    s_ = (q[0, :, r].float() @ kk.transpose(1, 2)) * D ** -0.5  # [H, rows, T]
    ar = torch.arange(T, device="cuda")
    vis = (ar[None, :] <= r[:, None]) & (r[:, None] < se[None, :])
    ref = torch.softmax(s_.masked_fill(~vis, float("-inf")), -1) @ vv
    got = out[0, :, r].float()
    return float((got - ref).norm() / ref.norm())


def inputs(T, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, H, T, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    k = torch.randn(1, HKV, T, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    v = torch.randn(1, HKV, T, D, device="cuda", dtype=DTYPE, generator=g).requires_grad_()
    do = torch.randn(1, H, T, D, device="cuda", dtype=DTYPE, generator=g)
    return q, k, v, do


def flex_fn(bm, cfg: KernelConfig):
    opts = cfg.kernel_options
    return lambda q, k, v: fta.tree_attention_flex(q, k, v, bm, enable_gqa=True, kernel_options=opts)


def sdpa_fn(backend):
    from torch.nn.attention import sdpa_kernel

    def f(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return f


def sdpa_repeat_fn(backend):
    """SDPA with k/v repeated to H heads (for backends without native GQA); repeat cost included."""
    from torch.nn.attention import sdpa_kernel

    def f(q, k, v):
        r = q.shape[1] // k.shape[1]
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True)
    return f


def dense_row(name, case, se, q, k, v, do, nnz, ref) -> dict:
    """Time one dense decomposition of the tree (plan built outside the timed call) -> a table row."""
    from treecompile.ops.dense_tree_attention import segmented_tree_attention, tree_varlen_plan, varlen_tree_attention

    plan = tree_varlen_plan(se)
    if name == "segmented_cudnn":
        fn = lambda q_, k_, v_: segmented_tree_attention(q_, k_, v_, plan)  # noqa: E731
    elif name.startswith("varlen_"):
        backend = name.split("_", 1)[1]
        fn = lambda q_, k_, v_: varlen_tree_attention(q_, k_, v_, plan, backend=backend)  # noqa: E731
    else:
        raise ValueError(f"--dense: unknown decomposition {name!r}")
    row = dict(case=case, contender=name, segments=plan.num_segments, path_tokens=plan.path_tokens)
    try:
        t0 = time.perf_counter()
        fn(q, k, v).backward(do)
        torch.cuda.synchronize()
        row["cold ms"] = fmt(1e3 * (time.perf_counter() - t0))
        row["out err"] = f"{sampled_rows_error(fn(q, k, v).detach(), q.detach(), k.detach(), v.detach(), se):.1e}"
    except Exception as e:  # a kernel that refuses the shapes is a row
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    finally:
        q.grad = k.grad = v.grad = None
    r = run_contender(case, name, fn, q, k, v, do, nnz)
    row.update({"fwd TF/s": fmt(r.fwd_tfs), "fwd+bwd TF/s": fmt(r.fwdbwd_tfs), "fwd+bwd ms": fmt(r.fwdbwd_ms, 2)})
    if r.error:
        row["error"] = r.error
    elif ref is not None:
        row["% of SDPA (fwd / fwd+bwd)"] = f"{100 * r.fwd_tfs / ref.fwd_tfs:.0f} / {100 * r.fwdbwd_tfs / ref.fwdbwd_tfs:.0f}"
    row["_result"] = r
    return row


def build_time_ms(se, block, validate):
    from triton.testing import do_bench
    return do_bench(lambda: fta.tree_block_mask(se, block_size=block, validate=validate),
                    warmup=10, rep=100, return_mode="median")


def fmt(x, nd=1):
    return "" if x is None else f"{x:.{nd}f}"


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16384,32768,65536")
    ap.add_argument("--pors", default="0.5,0.85")
    ap.add_argument("--sweep-size", type=int, default=32768)
    ap.add_argument("--sweep", default="all", help="comma-separated config names, or 'all', or 'none'")
    ap.add_argument("--quick", action="store_true", help="small sizes, two configs (smoke test)")
    ap.add_argument("--dense", default="varlen_flash,segmented_cudnn",
                    help="dense decompositions to time beside flex (treecompile/ops/dense_tree_attention.py): comma-separated "
                         "from varlen_flash, segmented_cudnn; 'none' for none")
    ap.add_argument("--out", default=None, help="write the markdown section here")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.quick:
        a.sizes, a.sweep_size, a.sweep = "4096", 4096, "stock,safe"
    for key, val in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 512),
                     ("accumulated_cache_size_limit", 512)):  # one compile per (size, kernel options)
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, val)
    sizes = [int(s) for s in a.sizes.split(",")]
    pors = [float(p) for p in a.pors.split(",")]
    from torch.nn.attention import SDPBackend
    import triton

    cond = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda, python=platform.python_version(), dtype=str(DTYPE).replace("torch.", ""),
                heads=H, kv_heads=HKV, head_dim=D)
    print(cond, flush=True)

    # ---- trees, stats, BlockMask build time
    trees = {}
    stat_rows, build_rows = [], []
    for T in sizes:
        for por in pors:
            spec = TreeSpec(T, por)
            t0 = time.perf_counter()
            tree = Tree.from_paths(random_tree_paths(spec))
            t_tree = time.perf_counter() - t0
            assert tree.num_tokens == T, (tree.num_tokens, T)
            se = tree.subtree_end.cuda()
            case = f"T={T} POR={tree.por:.2f}"
            trees[case] = (T, se, tree)
            st = tree_stats(tree, se)
            stat_rows.append(dict(case=case, **st, from_paths_s=round(t_tree, 2)))
            build_rows.append(dict(case=case, block="128x128",
                                   build_ms=round(build_time_ms(se, (128, 128), False), 3),
                                   build_validated_ms=round(build_time_ms(se, (128, 128), True), 3)))
    print(tabulate(stat_rows, headers="keys", tablefmt="github"), flush=True)
    print(tabulate(build_rows, headers="keys", tablefmt="github"), flush=True)

    results: list[Result] = []
    # ---- sweep of kernel options at one size (the first POR)
    sweep = [] if a.sweep == "none" else SWEEP if a.sweep == "all" else [c for c in SWEEP if c.name in a.sweep.split(",")]
    sweep_case = next(c for c in trees if trees[c][0] == a.sweep_size)
    T, se, tree = trees[sweep_case]
    nnz = tree_stats(tree, se)["nnz"]
    q, k, v, do = inputs(T)
    sweep_res = []
    for cfg in sweep:
        bm = fta.tree_block_mask(se, block_size=cfg.block)
        t0 = time.perf_counter()
        r = run_contender(sweep_case, cfg.name, flex_fn(bm, cfg), q, k, v, do, nnz)
        print(f"sweep {cfg.name}: {r} ({time.perf_counter() - t0:.0f} s incl. compile)", flush=True)
        sweep_res.append((cfg, r))
    ok = [(c, r) for c, r in sweep_res if r.error is None]
    best = min(ok, key=lambda cr: cr[1].fwdbwd_ms)[0] if ok else SWEEP[0]
    # ROWS_GUARANTEED_SAFE ("safe") is wrong for trees with padding or several roots (NaN rows, see
    # flex_tree_attention.py); it is swept only to show it buys nothing measurable.
    stock = kc("stock")
    print(f"best config: {best}", flush=True)
    del q, k, v, do

    # ---- all sizes: SDPA baselines, flex causal (single path), flex tree stock and best, dense decompositions
    main_rows, dense_rows = [], []
    dense = [] if a.dense == "none" else a.dense.split(",")
    for T in sizes:
        q, k, v, do = inputs(T, seed=T)
        causal_nnz = T * (T + 1) // 2
        base = {}
        for nm, fn in (("sdpa_cudnn", sdpa_repeat_fn(SDPBackend.CUDNN_ATTENTION)),
                       ("sdpa_flash", sdpa_fn(SDPBackend.FLASH_ATTENTION))):
            r = run_contender(f"T={T} causal", nm, fn, q, k, v, do, causal_nnz)
            results.append(r)
            base[nm] = r
            print(r, flush=True)
        good = [r for r in base.values() if r.error is None]
        ref = max(good, key=lambda r: r.fwdbwd_tfs) if good else None
        chain = fta.tree_block_mask(torch.full((T,), T, device="cuda"))
        r = run_contender(f"T={T} causal", f"flex_causal[{best.name}]", flex_fn(chain, best), q, k, v, do, causal_nnz)
        results.append(r)
        print(r, flush=True)
        for case, (Tc, se, tree) in trees.items():
            if Tc != T:
                continue
            nnz = tree_stats(tree, se)["nnz"]
            row = dict(case=case)
            if ref is not None:
                row.update({"baseline": ref.contender, "base fwd TF/s": fmt(ref.fwd_tfs),
                            "base fwd+bwd TF/s": fmt(ref.fwdbwd_tfs)})
            if r.error is None and ref is not None:
                row["flex causal fwd+bwd %"] = fmt(100 * r.fwdbwd_tfs / ref.fwdbwd_tfs)
            for cfg in (stock, best) if best != stock else (stock,):
                bm = fta.tree_block_mask(se, block_size=cfg.block)
                fn = flex_fn(bm, cfg)
                rr = run_contender(case, f"flex_tree[{cfg.name}]", fn, q, k, v, do, nnz)
                results.append(rr)
                if rr.error is None:  # same compiled graph as timed (grad mode on), output detached
                    try:
                        err = f"{sampled_rows_error(fn(q, k, v).detach(), q.detach(), k.detach(), v.detach(), se):.1e}"
                    except Exception as e:
                        err = f"{type(e).__name__}"
                    row[f"{'stock' if cfg == stock else 'tuned'} out err"] = err
                print(rr, flush=True)
                tag = "stock" if cfg == stock else "tuned"
                if rr.error:
                    row[f"{tag}"] = rr.error
                    continue
                row[f"{tag} fwd TF/s"] = fmt(rr.fwd_tfs)
                row[f"{tag} fwd+bwd TF/s"] = fmt(rr.fwdbwd_tfs)
                row[f"{tag} fwd+bwd ms"] = fmt(rr.fwdbwd_ms, 2)
                if ref is not None:
                    row[f"{tag} % of SDPA (fwd / fwd+bwd)"] = (f"{100 * rr.fwd_tfs / ref.fwd_tfs:.0f} / "
                                                               f"{100 * rr.fwdbwd_tfs / ref.fwdbwd_tfs:.0f}")
            main_rows.append(row)
            for nm in dense:
                drow = dense_row(nm, case, se, q, k, v, do, nnz, ref)
                results.append(drow.pop("_result"))
                dense_rows.append(drow)
                print(drow, flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()

    sweep_rows = [dict(config=c.name, options=json.dumps(c.kernel_options), fwd_ms=fmt(r.fwd_ms, 3),
                       fwdbwd_ms=fmt(r.fwdbwd_ms, 3), fwd_tfs=fmt(r.fwd_tfs), fwdbwd_tfs=fmt(r.fwdbwd_tfs),
                       error=r.error or "") for c, r in sweep_res]
    base_rows = [dataclasses.asdict(r) for r in results if r.case.endswith("causal")]
    for d in base_rows:
        for key in ("fwd_ms", "fwdbwd_ms", "fwd_tfs", "fwdbwd_tfs"):
            d[key] = fmt(d[key], 3 if key.endswith("ms") else 1)
    text = ["## Tree attention", "",
            "Conditions: " + ", ".join(f"{k_}={v_}" for k_, v_ in cond.items()) +
            "; GQA via enable_gqa (cuDNN SDPA gets k/v repeated inside the timed call); TF/s on unmasked entries "
            "(fwd 4*H*D*nnz, bwd 2.5x fwd); do_bench medians; out err = norm-relative error of the bf16 output on 128 "
            "sampled query rows vs an fp32 dense-mask softmax.", "",
            "Trees (random branching generator in this file, 16 equal-length paths):", "",
            tabulate(stat_rows, headers="keys", tablefmt="github"), "",
            "BlockMask build (tree_block_mask, CUDA events, median):", "",
            tabulate(build_rows, headers="keys", tablefmt="github"), "",
            f"Kernel-option sweep at {sweep_case}:", "",
            tabulate(sweep_rows, headers="keys", tablefmt="github"), "",
            f"Best: `{best.name}` = `{json.dumps(best.kernel_options)}`", "",
            "Causal baselines at each T (same per-entry FLOP count):", "",
            tabulate(base_rows, headers="keys", tablefmt="github"), "",
            "Tree attention vs the best causal SDPA at the same T:", "",
            tabulate(main_rows, headers="keys", tablefmt="github"), ""]
    if dense_rows:
        text += ["Dense decompositions (treecompile/ops/dense_tree_attention.py) vs the best causal SDPA at the same T; "
                 "cold = first fwd+bwd (cuDNN builds an execution plan per new shape):", "",
                 tabulate(dense_rows, headers="keys", tablefmt="github"), ""]
    out = "\n".join(text)
    print(out, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(cond=cond, stats=stat_rows, build=build_rows, sweep=sweep_rows,
                           results=[dataclasses.asdict(r) for r in results]), f, indent=1)


if __name__ == "__main__":
    main()
