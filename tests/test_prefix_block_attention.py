"""The shared-prefix-block prototype (benchmarks/prefix_block_attention.py) against the dense tree mask in float64:
its plan's segments and blocks attend each pair of the mask once, and its forward and backward (the segment part
with the merged log-sum-exp, the block part, the merge) equal the dense reference's to the float32 log-sum-exp's
rounding."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from benchmarks.prefix_block_attention import prefix_block_attention, prefix_block_plan
from tests.strategies import ODD_TREES
from tests.test_fa4_tree_attention import forest_paths
from treecompile import Tree
from treecompile.ops import varlen_tree_attention as vta
from treecompile.ops.tree_attention import tree_attention_reference

TREES = {"forest_240": forest_paths(240, 3, seed=4), "fanout": [[1, 2, 3, 4, 5, 6, 7, 8, i, i + 1] for i in range(20, 30)],
         **{name: ODD_TREES[name] for name in sorted(ODD_TREES)}}


def _attended_pairs(plan, blocks, T):
    """(query, key) pairs the plan's segments and blocks attend, counted."""
    pairs = Counter()
    idx, cq, ck = plan.key_index.tolist(), plan.cu_seqlens_q_host, plan.cu_seqlens_k_host
    for j in range(plan.segments):
        n, m = cq[j + 1] - cq[j], ck[j + 1] - ck[j]
        for i in range(n):
            for r in range(m - n + i + 1):
                pairs[(cq[j] + i, idx[ck[j] + r])] += 1
    for t in range(plan.tail, T):
        pairs[(t, t)] += 1
    for q0, q1, k0, k1 in blocks:
        for q in range(q0, q1):
            for k in range(k0, k1):
                pairs[(q, k)] += 1
    return pairs


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("pad_to", [None, 16])
def test_plan_attends_each_pair_of_the_mask_once(name, pad_to):
    b = Tree.from_paths(TREES[name]).to_batch(pad_to_multiple=pad_to)
    se, T = b.subtree_end, b.seq_len
    plan, blocks = prefix_block_plan(se)
    want = Counter({(q, k): 1 for k in range(T) for q in range(k, int(se[k]))})
    assert _attended_pairs(plan, blocks, T) == want
    assert plan.gathered <= vta.segment_plan(se).gathered


def test_fanout_tree_gathers_its_prompt_once():
    """Ten paths sharing 8 prompt tokens: one block of the prompt's 8 keys, and the segments gather none of it."""
    b = Tree.from_paths(TREES["fanout"]).to_batch()
    plan, blocks = prefix_block_plan(b.subtree_end)
    full = vta.segment_plan(b.subtree_end)
    assert len(blocks) == 1 and blocks[0][2:] == (0, 8)
    assert full.gathered - plan.gathered == 8 * 9  # the nine segments under the first no longer gather the prompt


@pytest.mark.parametrize("name", ["forest_240", "forest", "fanout", "one_token_nodes", "wide_fanout_64"])
@pytest.mark.parametrize("pad_to", [None, 16])
def test_forward_and_backward_equal_the_dense_reference(name, pad_to):
    b = Tree.from_paths(TREES[name]).to_batch(pad_to_multiple=pad_to)
    T, se = b.seq_len, b.subtree_end
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, T, h, 8, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
               for h in (4, 2, 2))
    do = torch.randn(1, 4, T, 8, generator=g, dtype=torch.float64)
    got = prefix_block_attention(q, k, v, se)
    grads = torch.autograd.grad(got, (q, k, v), do)
    ref = tree_attention_reference(q, k, v, se)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    # the merge weights exp(lse_part - lse) come from the op's float32 log-sum-exps (FA4's): each weight, and each
    # probability of the parts' backward, is off by up to 2^-24 (|lse_part| + |lse|) relative; a factor 4 for the
    # sums of such terms.  Against each result's largest entry
    scores = (q.detach() @ k.detach().repeat_interleave(2, 1).transpose(-1, -2)) * 8 ** -0.5
    visible = (torch.arange(T)[None, :] <= torch.arange(T)[:, None]) & (torch.arange(T)[:, None] < se[None, :])
    lse_max = float(torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1).abs().max())
    bound = 4 * 2 * 2 ** -24 * lse_max
    for what, x, r in zip(("out", "dq", "dk", "dv"), (got, *grads), (ref, *ref_grads)):
        err = float((x - r).detach().abs().max()) / float(r.detach().abs().max())
        assert err <= bound, (what, err, bound)
    assert bound < 1e-5  # the bound stays far below an error of the attention itself


def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from treecompile.ops import fa4_tree_attention as fa4

    return fa4.fa4_unusable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("T,roots,pad_to,H,Hkv,D", [(1000, 3, 1024, 4, 2, 128), (2900, 1, 3072, 16, 8, 128),
                                                    (700, 1, None, 4, 2, 128)])
def test_fa4_prefix_block_vs_fp64_oracle(T, roots, pad_to, H, Hkv, D):
    """The FA4 path (the segment call, FA4's non-causal call per block, the bf16 merge): output and gradients
    within 2x the bf16 dense kernel's error against the float64 oracle, as the library's tree kernels are held."""
    from tests.test_fa4_tree_attention import assert_bf16_tree_kernel_near_oracle

    def attend(b, scale):
        assert prefix_block_plan(b.subtree_end)[1]  # the forest has blocks to merge
        return lambda q, k, v: prefix_block_attention(q, k, v, b.subtree_end, scale=scale)

    assert_bf16_tree_kernel_near_oracle(attend, T, roots, pad_to, H, Hkv, D)
