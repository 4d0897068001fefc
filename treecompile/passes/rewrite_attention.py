"""rewrite_attention: every causal SDPA becomes ``treecompile::tree_attention`` (``_windowed`` under a sliding window).

Two forms are accepted:
- ``is_causal=True`` with no mask (plain PyTorch models);
- an explicit mask computed from the sequence length alone (Hugging Face transformers builds one
  from ``cache_position``/``position_ids`` under export).  The mask subgraph is extracted and
  evaluated at a few lengths and at one past every number it holds (a sliding window of W tokens is
  causal up to length W: sampled at short lengths alone it would pass): it must depend on no input
  *values*, hold only 0 and mask values if it is a float mask (-inf or at most ``FLOAT_MASKED_MAX``: no additive
  bias), and equal the causal mask, or the causal mask under a sliding window of W tokens (``q - W < k <= q``,
  W read off the mask and checked at every length), else the attention is refused (and a number too large to
  check past is refused by name).  A window becomes ``tree_attention_windowed`` with the batch's depth
  positions: on a path the depth difference is the distance, so each token sees the W - 1 tokens above it on
  its own path, as the per-path run does.  After the rewrite the mask subgraph is dead and is removed.
A ``repeat_kv`` (unsqueeze -> expand -> reshape of K/V) feeding SDPA is folded into native GQA.
Anything else (no mask and ``is_causal=False``: a bidirectional encoder; a mask that reads user
inputs; chunked attention; dropout) raises ``UnsupportedModelError`` naming the node and source line.
"""

from __future__ import annotations


import torch
from torch import fx

import treecompile.ops.tree_attention  # noqa: F401  (registers treecompile::tree_attention)
from treecompile.passes.base import (SCALED_NOTE, PassContext, PassResult, UnsupportedModelError, ancestors,
                                     causal_window_mask, largest_index_literal, last_row_window, remove_dead_code,
                                     where)
from treecompile.passes.token_axis import same

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
TREE_ATTENTION = torch.ops.treecompile.tree_attention.default
TREE_ATTENTION_WINDOWED = torch.ops.treecompile.tree_attention_windowed.default
_SHAPE_ONLY = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}
_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_COPIES = {aten.clone.default, aten.contiguous.default}
# the mask subgraph is evaluated at these lengths, and at one past the largest number it holds (a window, an
# offset; base.largest_index_literal) when that is at most MASK_CHECK_MAX_LEN (a [T, T] mask and its index intermediates
# are materialized)
MASK_CHECK_LENGTHS = (1, 5, 11)
MASK_CHECK_MAX_LEN = 8192
# a float mask's entries are 0 (attend) or at most this (masked: the softmax weight exp(value + score gap) is exactly
# 0 in every float dtype unless a visible score exceeds the masked one by thousands); anything between is an
# additive bias (ALiBi folded into the mask, a finite "soft" mask), which tree attention does not add
FLOAT_MASKED_MAX = -1e4


def _sdpa_args(node: fx.Node):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    a = dict(zip(names, node.args))
    a.update(node.kwargs)
    return (a["query"], a["key"], a["value"], a.get("attn_mask"), a.get("dropout_p", 0.0),
            a.get("is_causal", False), a.get("scale"), a.get("enable_gqa", False))


def _ancestors(node: fx.Node) -> list[fx.Node]:
    seen = ancestors(node)
    return [n for n in node.graph.nodes if n in seen]  # topological order


def _check_mask(mask: fx.Node, sdpa: fx.Node, ctx: PassContext, cache: dict) -> int | None:
    """The mask must be computed from the input's shape alone and be the causal mask (returns None) or the causal
    mask under a sliding window of W tokens, ``q - W < k <= q`` (returns W)."""
    if mask not in cache:
        try:
            cache[mask] = _mask_window(mask, sdpa, ctx)
        except UnsupportedModelError as e:
            cache[mask] = e
    if isinstance(cache[mask], UnsupportedModelError):
        raise cache[mask]
    return cache[mask]


def _mask_window(mask: fx.Node, sdpa: fx.Node, ctx: PassContext) -> int | None:
    nodes = _ancestors(mask)
    for n in nodes:
        if n.op == "placeholder":
            data_users = [u for u in n.users if u in nodes and u.target not in _SHAPE_ONLY]
            if data_users:
                raise UnsupportedModelError(
                    f"{where(sdpa)}: the attention mask reads the values of input '{n.name}' "
                    f"(e.g. a padding mask); tree attention replaces only causal masks")
    # evaluate the mask subgraph alone at a few lengths
    g = fx.Graph()
    env = {}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[mask])
    sub = fx.GraphModule(ctx.gm, g)
    phs = [n for n in nodes if n.op == "placeholder"]
    bound = largest_index_literal(nodes)
    past = int(bound) + 2  # a pattern at offset c shows at length c + 2 (where q - k > c exists)
    if past > MASK_CHECK_MAX_LEN:
        raise UnsupportedModelError(
            f"{where(sdpa)}: the attention mask subgraph compares positions with {bound:g} (a sliding window or an "
            f"offset?{SCALED_NOTE}): checking what the mask is past it would take a [{past}, {past}] mask (at most "
            f"{MASK_CHECK_MAX_LEN}); tree attention replaces causal masks and sliding windows up to "
            f"{MASK_CHECK_MAX_LEN - 2} tokens")
    allowed = {}
    for T in MASK_CHECK_LENGTHS + ((past,) if past > max(MASK_CHECK_LENGTHS) else ()):
        args = []
        for p in phs:
            v = p.meta["val"]
            shape = [T if isinstance(s, torch.SymInt) else int(s) for s in v.shape]
            # on the device the model was captured on: the subgraph may hold constants made there
            # (e.g. ``arange(..., device=cuda)``), and mixing devices would fail the evaluation
            args.append(torch.zeros(shape, dtype=v.dtype, device=v.device))
        try:
            with torch.no_grad():
                m = sub(*args)
        except Exception as e:  # noqa: BLE001 - report, do not guess
            raise UnsupportedModelError(f"{where(sdpa)}: cannot evaluate the attention mask subgraph "
                                        f"to check that it is causal ({type(e).__name__}: {e})") from e
        if m.dtype != torch.bool:
            biased = ~((m == 0) | (m <= FLOAT_MASKED_MAX))  # NaN too
            if bool(biased.any()):
                value = float(m[biased].flatten()[0])
                raise UnsupportedModelError(
                    f"{where(sdpa)}: the float attention mask holds {value:g} (checked at length {T}): its entries "
                    f"must be 0 (attend) or a mask value (-inf, or at most {FLOAT_MASKED_MAX:g}); other values are an "
                    f"additive bias (e.g. ALiBi or a finite soft mask), which tree attention does not apply")
            m = m == 0
        allowed[T] = m.cpu()
        if allowed[T].shape[-2:] != (T, T):
            raise UnsupportedModelError(f"{where(sdpa)}: the attention mask has shape {tuple(allowed[T].shape)} at "
                                        f"length {T}, not [.., {T}, {T}]")
    # the window the last row of the longest probe shows (every row of a causal mask sees all T keys there)
    window = last_row_window(allowed[max(allowed)])
    for T, a in allowed.items():
        if window < 1:  # the last row sees nothing: not a window over the causal mask
            raise UnsupportedModelError(f"{where(sdpa)}: the attention mask hides every key from the last query "
                                        f"(checked at length {T}); tree attention replaces causal attention and "
                                        f"sliding windows over it")
        if not bool((a == causal_window_mask(T, window)).all()):
            raise UnsupportedModelError(
                f"{where(sdpa)}: the attention mask is neither the causal mask nor a sliding window over it "
                f"(checked at length {T}: e.g. bidirectional, chunked or padding); tree attention replaces causal "
                f"attention and sliding windows over it")
    return None if window >= max(allowed) else window


def _fold_repeat_kv(x: fx.Node, num_q_heads: int):
    """If ``x`` is repeat_kv(src) (unsqueeze(2) -> expand -> reshape), return src, else x."""
    if not (isinstance(x, fx.Node) and x.target in _VIEWS):
        return x
    e = x.args[0]
    while isinstance(e, fx.Node) and e.target in _COPIES:
        e = e.args[0]
    if not (isinstance(e, fx.Node) and e.target == aten.expand.default):
        return x
    u = e.args[0]
    if not (isinstance(u, fx.Node) and u.target == aten.unsqueeze.default and u.args[1] in (2, -3)):
        return x
    src = u.args[0]
    sv, ev, xv = src.meta["val"], e.meta["val"], x.meta["val"]
    if sv.dim() != 4 or ev.dim() != 5 or xv.dim() != 4:
        return x
    B, KV, T, D = sv.shape
    if ev.shape[1] != KV or xv.shape[1] != KV * ev.shape[2] or xv.shape[1] != num_q_heads:
        return x
    return src


def _check_token_axis(node: fx.Node, ctx: PassContext, **qkv: fx.Node) -> None:
    """SDPA attends over dim -2: tree attention needs the T tokens there, ``[1, heads, T, head_dim]``, and nowhere
    else.  SDPA on ``[1, T, heads, head_dim]`` (no transpose) attends over the heads of each token alone: rewritten
    as tree attention it failed at run time, or ran silently wrong on a tree of exactly ``heads`` tokens."""
    for name, x in qkv.items():
        shape = tuple(x.meta["val"].shape)
        elsewhere = any(same(d, ctx.seq_len) for d in shape[:2] + shape[3:])
        if len(shape) != 4 or not same(shape[2], ctx.seq_len) or elsewhere:
            raise UnsupportedModelError(
                f"{where(node)}: SDPA's {name} has shape {list(shape)} (T = {ctx.seq_len} tokens); tree attention "
                f"needs [1, heads, T, head_dim] with the tokens on dim 2 alone: SDPA attends over dim -2, so "
                f"attention over another axis mixes the tokens differently (transpose the heads and tokens first)")


def rewrite_attention(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    count, folded, windowed = 0, 0, 0
    mask_cache: dict = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != SDPA:
            continue
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(node)
        if isinstance(dropout_p, (int, float)) and dropout_p != 0.0:
            raise UnsupportedModelError(f"{where(node)}: attention dropout p={dropout_p} cannot be made "
                                        f"identical to the per-path run; set it to 0 for training on trees")
        if mask is None and not is_causal:
            raise UnsupportedModelError(f"{where(node)}: attention is not causal (no mask and is_causal=False, "
                                        f"as in a bidirectional encoder); treecompile rewrites causal LMs only")
        window = None
        if mask is not None:
            if is_causal:
                raise UnsupportedModelError(f"{where(node)}: SDPA with both a mask and is_causal=True")
            window = _check_mask(mask, node, ctx, mask_cache)
        if q.meta["val"].dim() != 4:
            raise UnsupportedModelError(
                f"{where(node)}: attention on a {q.meta['val'].dim()}-D query of shape {tuple(q.meta['val'].shape)}; "
                "treecompile rewrites scaled_dot_product_attention on [batch, heads, tokens, head_dim] (batch 1): "
                "keep the batch dimension (e.g. q[None] for a [heads, tokens, head_dim] query)")
        H = q.meta["val"].shape[1]
        k2, v2 = _fold_repeat_kv(k, H), _fold_repeat_kv(v, H)
        if k2 is not k and v2 is not v:
            k, v = k2, v2
            folded += 1
        if q.meta["val"].shape[0] != 1:
            raise UnsupportedModelError(f"{where(node)}: attention batch size must be 1 on a tree batch")
        _check_token_axis(node, ctx, q=q, k=k, v=v)
        with gm.graph.inserting_before(node):
            if window is None:
                new = ctx.call(TREE_ATTENTION, (q, k, v, ctx.tree_input("subtree_end"), scale), like=node)
            else:
                new = ctx.call(TREE_ATTENTION_WINDOWED, (q, k, v, ctx.tree_input("subtree_end"),
                                                         ctx.tree_input("position_ids"), window, scale), like=node)
                windowed += 1
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        count += 1
    if count:
        remove_dead_code(gm)
    return PassResult(count, {"repeat_kv_folded": folded, "windowed": windowed})


