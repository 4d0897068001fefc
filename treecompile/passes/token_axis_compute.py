"""Token-axis rules for ops that compute across dims: reductions, scans, contractions, norms; the table.

See :mod:`treecompile.passes.token_axis` for what a rule is.
"""

from __future__ import annotations

import torch
from torch import fx

from treecompile.passes.token_axis import (
    ALONG_DIM, ATTENTIONS, BATCH_NORMS, COMPLEX_VIEWS, CONVS, GROUP_NORMS, LAST_TWO, LAYER_NORMS, MATMULS, PADS, PERMUTES,
    RESHAPES, SLICES, SPLITS, Mixes, Op, _aligned, _packets, cat, diagonal, dims_arg, elementwise, embedding,
    expand, gather, index, index_put, index_select, is_elementwise, one_hot, pad, permute, repeat_interleave,
    reshape, same, scatter, select, slice_, split, unfold, complex_view)

aten = torch.ops.aten


def reduction(c: Op) -> set[int]:
    x = c.args.get("self", c.args.get("input"))
    nd = c.nd(x)
    dims = dims_arg(c.args.get("dim"), nd)
    t = c.tok(x)
    if t & set(dims):
        raise Mixes(f"reduces over the sequence axis (dim {sorted(t)[0]}): every token would see the whole "
                    f"DFS sequence")
    keep = bool(c.args.get("keepdim"))
    res = t if keep else {s - sum(r < s for r in dims) for s in t}
    outs = c.out if isinstance(c.out, (tuple, list)) else (c.out,)
    want = nd if keep else nd - len(set(dims))
    if any(isinstance(o, torch.Tensor) and o.dim() != want for o in outs):
        raise Mixes("a reduction whose output rank is not its input's minus the reduced dims")
    return tuple(res for _ in outs) if isinstance(c.out, (tuple, list)) else res


def along_dim(c: Op):
    x = c.args.get("self", c.args.get("input", c.args.get("grad_output")))
    nd = c.nd(x)
    p = c.op.overloadpacket
    if p in LAST_TWO:
        dims = [nd - 2, nd - 1]
    elif p in (aten.flip, aten.roll):
        dims = dims_arg(c.args.get("dims"), nd)
    else:
        dims = dims_arg(c.args.get("dim"), nd)
    t = c.tok(x)
    if t & set(dims):
        what = {aten.cumsum: "a prefix sum", aten.cumprod: "a prefix product", aten.flip: "a reversal",
                aten.roll: "a rotation", aten.sort: "a sort", aten.argsort: "a sort", aten.topk: "a top-k",
                aten.tril: "a triangular mask", aten.triu: "a triangular mask"}.get(p, p.__name__)
        raise Mixes(f"computes {what} along the sequence axis")
    outs = c.out if isinstance(c.out, (tuple, list)) else (c.out,)
    if any(o.dim() != nd for o in outs):
        raise Mixes("changes the rank")
    return tuple(t for _ in outs) if isinstance(c.out, (tuple, list)) else t


def linear(c: Op) -> set[int]:
    x, w, b = c.args["input"], c.args["weight"], c.args.get("bias")
    if c.tok(w) or c.tok(b):
        raise Mixes("uses per-token values as the weight of a linear layer")
    t = c.tok(x)
    if c.nd(x) - 1 in t:
        raise Mixes("contracts the sequence axis (a linear map over positions)")
    return t


def _matmul(c: Op, a, b) -> set[int]:
    na, nb, R = c.nd(a), c.nd(b), c.out_nd
    ka = na - 1
    kb = 0 if nb == 1 else nb - 2
    if ka in c.tok(a) or kb in c.tok(b):
        raise Mixes("contracts the sequence axis (e.g. attention weights @ values, or a matrix over positions): "
                    "every token would read every DFS position")
    batch = R - (na > 1) - (nb > 1)
    res = set()
    for d in c.tok(a):
        res.add(batch if d == na - 2 else d + batch - (na - 2))
    for d in c.tok(b):
        res.add(R - 1 if d == nb - 1 else d + batch - (nb - 2))
    if len(res) > 1:
        raise Mixes("pairs every token with every other token (e.g. attention scores q @ k^T of shape [T, T])")
    return res


def matmul(c: Op) -> set[int]:
    p = c.op.overloadpacket
    names = {aten.addmm: ("mat1", "mat2"), aten.addmm_: ("mat1", "mat2"), aten.baddbmm: ("batch1", "batch2"),
             aten.baddbmm_: ("batch1", "batch2"), aten.addmv: ("mat", "vec"), aten.mv: ("self", "vec")}
    an, bn = names.get(p, ("self", "mat2" if p in (aten.mm, aten.bmm) else "other" if p == aten.matmul else "tensor"))
    res = _matmul(c, c.args[an], c.args[bn])
    if p in (aten.addmm, aten.addmm_, aten.baddbmm, aten.baddbmm_, aten.addmv):
        s = c.args["self"]
        res |= _aligned(c.nd(s), c.out_nd, c.tok(s))
    return res


def einsum(c: Op) -> set[int]:
    eq = c.args["equation"].replace(" ", "")
    xs = list(c.args["tensors"])
    lhs, _, rhs = eq.partition("->")
    specs = lhs.split(",")
    free = [ch for ch in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if ch not in eq]
    ell = max((c.nd(x) - len(s.replace("...", "")) for x, s in zip(xs, specs) if "..." in s), default=0)
    fill = "".join(free[:ell])
    specs = [s.replace("...", fill[ell - (c.nd(x) - len(s.replace("...", ""))):]) for x, s in zip(xs, specs)]
    if not _:
        counts = {ch: sum(s.count(ch) for s in specs) for ch in set("".join(specs))}
        rhs = fill + "".join(sorted(ch for ch, n in counts.items() if n == 1 and ch not in fill))
    rhs = rhs.replace("...", fill)
    res = set()
    for x, s in zip(xs, specs):
        for d in c.tok(x):
            if s[d] not in rhs:
                raise Mixes(f"contracts the sequence axis (einsum {c.args['equation']!r} sums over it)")
            res.add(rhs.index(s[d]))
    if len(res) > 1:
        raise Mixes("pairs every token with every other token (a [T, T] interaction)")
    return res


def convolution(c: Op) -> set[int]:
    x, w = c.args["input"], c.args["weight"]
    if c.tok(w) or c.tok(c.args.get("bias")):
        raise Mixes("convolves with per-token weights")
    nd, k = c.nd(x), c.nd(w) - 2
    first_spatial = nd - k
    t = c.tok(x)
    res = set()
    for d in t:
        if d == first_spatial - 1:
            raise Mixes("contracts the sequence axis as conv channels")
        if d >= first_spatial:
            s = d - first_spatial
            ks = c.val(w).shape[2 + s]
            pad = c.args.get("padding")
            pad = pad if isinstance(pad, str) else (list(pad) * k if len(pad) == 1 else list(pad))[s]
            stride = c.args.get("stride")
            stride = (list(stride) * k if len(stride) == 1 else list(stride))[s]
            if not (same(ks, 1) and pad in (0, "valid") and stride == 1 and not c.args.get("transposed")):
                raise Mixes(f"convolves along the sequence axis (kernel size {ks}: a window over neighbouring "
                            f"DFS tokens, e.g. a causal conv)")
        res.add(d)
    return res


def attention(c: Op) -> set[int]:
    q, k, v, m = (c.args[n] for n in ("query", "key", "value", "attn_mask"))
    R = c.out_nd
    if (c.nd(k) - 2) in c.tok(k) or (c.nd(v) - 2) in c.tok(v) or (isinstance(m, fx.Node) and c.nd(m) - 1 in c.tok(m)):
        raise Mixes("attends over the sequence axis without the tree mask (attention that rewrite_attention "
                    "did not turn into tree_attention)")
    if any(c.nd(x) - 1 in c.tok(x) for x in (q, k, v)):
        raise Mixes("contracts the sequence axis as the attention feature dim")
    res = set()
    for x in (q, k, v, m):
        if isinstance(x, fx.Node):
            res |= _aligned(c.nd(x), R, c.tok(x))
    return res


def layer_norm(c: Op):
    x = c.args.get("input", c.args.get("self"))
    k = len(c.args["normalized_shape"])
    t = c.tok(x)
    if any(d >= c.nd(x) - k for d in t):
        raise Mixes("normalizes over the sequence axis")
    return tuple(t for _ in c.out) if isinstance(c.out, (tuple, list)) else t


def group_norm(c: Op):
    x = c.args["input"]
    t = c.tok(x)
    if t - {0}:
        raise Mixes("normalizes groups of channels over the sequence axis")
    return tuple(t if isinstance(o, torch.Tensor) and o.dim() > 0 else set() for o in c.out) \
        if isinstance(c.out, (tuple, list)) else t


def batch_norm(c: Op):
    x = c.args["input"]
    t = c.tok(x)
    training = c.op.overloadpacket != aten._native_batch_norm_legit_no_training and bool(c.args.get("training", True))
    if training and t - {1}:
        raise Mixes("uses batch statistics over the sequence axis")
    outs = c.out if isinstance(c.out, (tuple, list)) else (c.out,)
    res = tuple(t if i == 0 else set() for i in range(len(outs)))
    return res if isinstance(c.out, (tuple, list)) else res[0]


RULES = {}
for _set, _rule in [(RESHAPES, reshape), (PERMUTES, permute), (SLICES, slice_), (SPLITS, split),
                    (ALONG_DIM | LAST_TWO, along_dim), (MATMULS, matmul), (CONVS, convolution),
                    (ATTENTIONS, attention), (LAYER_NORMS, layer_norm), (GROUP_NORMS, group_norm),
                    (BATCH_NORMS, batch_norm), (PADS, pad),
                    (_packets("select"), select), (_packets("cat", "concat", "concatenate", "stack"), cat),
                    (_packets("expand", "repeat", "expand_as", "broadcast_to"), expand), (COMPLEX_VIEWS, complex_view),
                    (_packets("index_select"), index_select),
                    (_packets("repeat_interleave"), repeat_interleave),
                    (_packets("index", "_unsafe_index"), index), (_packets("index_put", "index_put_"), index_put),
                    (_packets("gather"), gather),
                    (_packets("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
                              "scatter_reduce_", "index_add", "index_add_", "index_copy", "index_copy_",
                              "index_fill", "index_fill_"), scatter),
                    (_packets("embedding"), embedding), (_packets("one_hot"), one_hot), (_packets("linear"), linear),
                    (_packets("einsum"), einsum), (_packets("unfold"), unfold), (_packets("diagonal"), diagonal)]:
    for _p in _set:
        RULES[_p] = _rule


def rule_for(op):
    """The rule for an aten op overload, or None (then only token-free inputs are accepted)."""
    p = op.overloadpacket
    if p in RULES:
        return RULES[p]
    if is_elementwise(op):
        return elementwise
    if any(a.name == "keepdim" for a in op._schema.arguments):
        return reduction
    return None
