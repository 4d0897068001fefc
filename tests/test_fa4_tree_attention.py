"""FA4 tree attention (treecompile/ops/fa4_tree_attention.py).

CPU: the tile lists FA4 reads (the BlockMask's kv lists forward, its q lists backward, at FA4's 128x128
sparse blocks) expand to exactly the dense tree mask on odd trees (1-token nodes, several roots, T not a
multiple of 128, padding), and the FA4 availability check names its reason.  GPU (``-m gpu``, needs
flash-attn-4 on sm_90+): FA4 tree attention through flex FLASH and through the direct CuTe call, output
and q/k/v gradients within 2x the bf16 dense kernel's error against a float64 dense-mask oracle.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers import deterministic_algorithms
from tests.strategies import ODD_TREES
from tests.test_flex_tree_attention import ancestor_mask, check_block_mask, dense_sdpa, out_and_grads, rel_err
import treecompile
from treecompile import Tree
from treecompile.ops import fa4_tree_attention as fa4
from treecompile.ops.flex_tree_attention import tree_block_mask

FA4_BLOCK = (128, 128)


def forest_paths(num_tokens: int, roots: int, seed: int) -> list[list[int]]:
    """Several roots, each a random branching tree with 1-token nodes mixed in (fresh token ids)."""
    rng = random.Random(seed)
    nxt = iter(range(10**9))
    paths: list[list[int]] = []
    total = 0
    for r in range(roots):
        share = (num_tokens - total) // (roots - r)
        tree = [[next(nxt) for _ in range(rng.randint(1, max(1, share // 3)))]]
        used = len(tree[0])
        while used < share:
            base = rng.choice(tree)
            keep = rng.randint(max(0, len(base) - 2), len(base)) if rng.random() < 0.5 else rng.randint(1, len(base))
            new = min(share - used, rng.choice([1, 1, 2, rng.randint(1, max(1, share // 5))]))
            tree.append(base[:keep] + [next(nxt) for _ in range(new)])
            used += new
        paths += tree
        total += used
    return paths


# ---------------------------------------------------------------------------- tile lists (CPU)
@pytest.mark.parametrize("name", sorted(ODD_TREES))
@pytest.mark.parametrize("pad_to", [None, 128, 300])
def test_fa4_tiles_odd_trees(name, pad_to):
    b = Tree.from_paths(ODD_TREES[name]).to_batch(pad_to_multiple=pad_to)
    check_block_mask(b.subtree_end, b.pred_index, FA4_BLOCK)


@pytest.mark.parametrize("T,roots,pad_to", [(127, 1, None), (129, 3, None), (300, 2, 384), (517, 5, None),
                                            (700, 4, 1000), (1025, 7, 1152)])
def test_fa4_tiles_forests_and_ragged_lengths(T, roots, pad_to):
    b = Tree.from_paths(forest_paths(T, roots, seed=T)).to_batch(pad_to_multiple=pad_to)
    assert b.num_tokens == T
    check_block_mask(b.subtree_end, b.pred_index, FA4_BLOCK)


def test_fa4_unusable_reason_names_the_cause():
    reason = fa4.fa4_unusable_reason(torch.empty(1, 2, 4, 128))
    assert reason is not None
    assert "flash-attn-4" in reason or "CUDA" in reason or "torch" in reason
    if fa4._import_reason() is None and torch.cuda.is_available():
        assert "bf16/fp16" in fa4.fa4_unusable_reason(torch.empty(1, 2, 4, 128, device="cuda"))
        assert "head_dim 256" in fa4.fa4_unusable_reason(torch.empty(1, 2, 4, 256, device="cuda",
                                                                     dtype=torch.bfloat16))


def test_fa4_refuses_with_reason():
    b = Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch()
    bm = tree_block_mask(b.subtree_end)
    q = torch.randn(1, 2, b.seq_len, 64)
    with pytest.raises(RuntimeError, match="FA4 tree attention: "):
        fa4.tree_attention_fa4(q, q, q, bm)


# ---------------------------------------------------------------------------- kernels (GPU)
def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return fa4.fa4_unusable_reason(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16))


CASES = [  # (tree tokens, roots, padded length, heads, kv heads, head dim)
    (63, 1, 128, 4, 2, 128),
    (1000, 3, 1024, 4, 2, 128),
    (2900, 1, 3072, 16, 8, 128),
    (1500, 2, 1536, 4, 4, 64),
    (700, 1, None, 4, 2, 128),  # T not a multiple of 128
]


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("kind", ["flex_flash", "direct"])
@pytest.mark.parametrize("T,roots,pad_to,H,Hkv,D", CASES,
                         ids=[f"T{c[0]}_r{c[1]}_pad{c[2]}_H{c[3]}kv{c[4]}_D{c[5]}" for c in CASES])
def test_fa4_tree_attention_vs_fp64_oracle(kind, T, roots, pad_to, H, Hkv, D):
    def attend(b, scale):
        bm = tree_block_mask(b.subtree_end)
        if kind == "flex_flash":
            return lambda q, k, v: fa4.tree_attention_fa4(q, k, v, bm, scale=scale, enable_gqa=H != Hkv)
        return lambda q, k, v: fa4.tree_attention_fa4_direct(q, k, v, b.subtree_end, bm, scale=scale)

    assert_bf16_tree_kernel_near_oracle(attend, T, roots, pad_to, H, Hkv, D)


def assert_bf16_tree_kernel_near_oracle(attend, T, roots, pad_to, H, Hkv, D):
    """``attend(batch, scale)`` -> ``fn(q, k, v)`` on a CUDA forest of T tokens: its bf16 output and q/k/v
    gradients within 2x the bf16 dense kernel's error against a float64 dense-mask oracle."""
    b = Tree.from_paths(forest_paths(T, roots, seed=T + D)).to_batch(pad_to_multiple=pad_to, device="cuda")
    L = b.seq_len
    dense = ancestor_mask(b.pred_index.cpu()).cuda()
    scale = D ** -0.5
    g = torch.Generator(device="cuda").manual_seed(T)
    q, k, v = (torch.randn(1, L, h, D, device="cuda", generator=g).transpose(1, 2) for h in (H, Hkv, Hkv))
    do = torch.randn(1, H, L, D, device="cuda", generator=g)

    def run(fn, dt):
        return out_and_grads(fn, q, k, v, do, dt)

    oracle = run(lambda a, b_, c: dense_sdpa(a, b_, c, dense, scale), torch.float64)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        ref = run(lambda a, b_, c: dense_sdpa(a, b_, c, dense, scale), torch.bfloat16)
    got = run(attend(b, scale), torch.bfloat16)
    u = torch.finfo(torch.bfloat16).eps / 2
    for name, f, r, o in zip(("out", "dq", "dk", "dv"), got, ref, oracle):
        assert torch.isfinite(f).all(), name
        ef, er = rel_err(f, o), rel_err(r, o)
        assert ef <= 2 * er + u, f"{name}: tree kernel error {ef:.3g} > 2 * dense bf16 error {er:.3g} + {u:.1g}"


# ---------------------------------------------------------------------------- the lowering's option (CPU)
def test_attention_kernel_option_is_checked():
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.passes.lower_cuda import CudaOptions

    with pytest.raises(ValueError, match="attention_kernel"):
        CudaOptions(attention_kernel="triton")
    with pytest.raises(ValueError, match="attention_kernel"):
        treecompile.compile(DenseForCausalLM(DenseConfig.tiny()), attention_kernel="cudnn")


def test_lowering_carries_the_attention_kernel():
    from treecompile.models import DenseConfig, DenseForCausalLM
    from treecompile.passes import lower_cuda as lc

    tm = treecompile.compile(DenseForCausalLM(DenseConfig.tiny()))
    for kernel in (k for k in lc.ATTENTION_KERNELS if k != "fa4_varlen"):  # that one: test_varlen_tree_attention
        low = lc.lower_cuda(tm.graph_module, lc.CudaOptions(gdn_kernel="reference", attention_kernel=kernel))
        calls = [n for n in low.graph_module.graph.nodes if n.target is lc._flex]
        assert len(calls) == 2 and all(n.args[5] == kernel for n in calls)
        # the installation/device probe is made at lowering time (here: no FA4 on this machine)
        assert all((n.args[6] is None) == (kernel == "flex" or lc.fa4_unusable_reason() is None) for n in calls)


def test_resolve_attention_kernel(monkeypatch):
    import warnings

    from treecompile.passes import lower_cuda as lc

    q = torch.empty(1, 2, 8, 128)  # CPU: FA4 cannot run it
    monkeypatch.setattr(lc, "_WARNED", set())
    assert lc.resolve_attention_kernel("flex", q) == "flex"
    with pytest.raises(RuntimeError, match="attention_kernel='fa4': "):
        lc.resolve_attention_kernel("fa4", q)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lc.resolve_attention_kernel("auto", q) == "flex"
        assert lc.resolve_attention_kernel("auto", q) == "flex"
    assert len([w for w in caught if "attention_kernel='auto'" in str(w.message)]) == 1  # once per reason
    # a setup probe made at lowering time: only the inputs are checked when the graph is traced
    assert lc.resolve_attention_kernel("auto", q, "no CUDA device") == "flex"
    with pytest.raises(RuntimeError, match="runs on CUDA"):
        lc.resolve_attention_kernel("fa4", q, None)  # installed and usable, but the inputs are on CPU
    monkeypatch.setattr(lc, "fa4_unusable_reason", lambda q_=None: None)  # where FA4 can run
    assert lc.resolve_attention_kernel("auto", q) == "fa4" and lc.resolve_attention_kernel("fa4", q) == "fa4"
    monkeypatch.setattr(lc, "fa4_input_reason", lambda q_: None)
    assert lc.resolve_attention_kernel("auto", q, None) == "fa4"


def test_saved_program_takes_the_kernel_at_load(tmp_path):
    from helpers import cached_compile, cached_model, tiny_dense
    from treecompile import saved

    tm = cached_compile(cached_model("dense-tiny", tiny_dense))
    saved.save(tm, tmp_path / "p")
    for kernel in ("flex", "fa4"):
        lm = saved.load(tmp_path / "p", attention_kernel=kernel)
        assert lm.program.options.attention_kernel == kernel
    b = Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch()
    assert torch.equal(lm(b).logprobs, tm(b).logprobs)  # the "fa4" load; CPU: no lowering


def test_fa4_mask_end_pads_to_whole_kv_blocks_with_unseen_columns():
    from treecompile.ops.fa4_tree_attention import fa4_mask_end

    se = torch.tensor([3, 2, 3, 4, 5])
    got = fa4_mask_end(se, 4)
    assert got.dtype == torch.int32 and got.tolist() == [3, 2, 3, 4, 5, 0, 0, 0]  # 0: no query sees a pad column
    assert fa4_mask_end(se[:4], 4).tolist() == [3, 2, 3, 4]  # already whole blocks


def test_direct_call_refuses_deterministic_mode():
    """``tree_attention_fa4_direct``'s backward sums by atomics: under ``torch.use_deterministic_algorithms(True)``
    it raises before any kernel (no FA4 needed to see it), and warns under ``warn_only=True``."""
    b = Tree.from_paths([[1, 2, 3], [1, 4]]).to_batch()
    q = torch.zeros(1, 2, b.seq_len, 8)
    with deterministic_algorithms(True), pytest.raises(RuntimeError, match="not deterministic.*tree_attention_varlen"):
        fa4.tree_attention_fa4_direct(q, q, q, b.subtree_end, None)
    with deterministic_algorithms(True, warn_only=True), pytest.warns(UserWarning, match="warn_only=True"), \
            pytest.raises(Exception):
        fa4.tree_attention_fa4_direct(q, q, q, b.subtree_end, None)  # then fails on the missing block mask
