"""rewrite_causal_attention: hand-written causal attention becomes ``tree_attention_biased``.

Eager attention written out (``q @ k^T``, a scale, optionally soft-capped by ``c * tanh(s / c)`` (Gemma 2), a
causal mask from ``triu``/``tril``/``masked_fill``/an additive ``-inf``/``finfo.min``, optionally a sliding window,
an additive position bias such as ALiBi, ``softmax`` (optionally over one more sink column per row, dropped
after: attention sinks; or, GraniteSWA's form of the same sinks, ``(probs @ v) * sigmoid(logsumexp(scores) - sink)``),
``@ v``; HF BLOOM's ``baddbmm`` form) mixes every token with every earlier DFS token.  The site is found
from the softmax: a softmax over the last dim of a ``[*, T, T]`` score tensor whose result, through
casts / a zero-probability dropout / views, is the left operand of a matmul with ``v``.  Walking back
from the scores through views, scalar scales, additions and masking (whose other operands must not
depend on the input ids) reaches the ``q @ k^T`` matmul.  The score subgraph ``g`` (scores as a
function of the product ``X = q @ k^T``) is then *evaluated* (``token_probe.Probe``):

1. on plain sequences of a few lengths, and of one past the largest number the mask and bias operands
   hold (a sliding window of W tokens is causal up to length W): ``g(X) - g(0) == c * X`` (soft-capped:
   ``softcap * tanh(c * X / softcap)``) on the entries that ``g(0)`` does not mask, where ``c`` is the product of
   the scalar scales on the path, and the unmasked entries are exactly the causal lower triangle, or that
   triangle under a window of W tokens (W read off the longest probe);
2. on a small tree: the bias ``g(0)`` that the graph computes from the tree's depth positions
   (``rewrite_positions``/``rewrite_scans`` ran before) equals, for every pair of tokens on one path,
   what the per-path run computes for that pair.

Then ``out = tree_attention_biased(q, k, v, subtree_end, g(0), c, softmax_dtype, position_ids, window, softcap,
sinks)`` (``g(0)`` recomputed in the graph from the side operands, None when it is zero on every allowed entry;
the window applied to depth differences; the sink column as the model computes it, which the verifier then
judges on its own).  Anything that fails a check is left alone (a bidirectional mask, a bias that reads the
input ids or that depends on the sequence length, a bias that the probe tree shows differs from the path's
(masks built from DFS indices included), a sink column the probs keep): the verifier refuses it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

import treecompile.ops.tree_attention  # noqa: F401  (registers treecompile::tree_attention_biased)
from treecompile.passes.base import (METADATA_ASSERTS, SCALED_NOTE, PassContext, PassResult, UnsupportedModelError,
                                     ancestors, causal_window_mask, largest_index_literal, last_row_window,
                                     remove_dead_code, where)
from treecompile.passes.token_probe import (PROBE_MAX_ENTRIES, Probe, NotProbeable, chain_batch, concrete_shape,
                                           probe_tree, token_dims, value_nodes)
from treecompile.tree import Tree

aten = torch.ops.aten
BIASED = torch.ops.treecompile.tree_attention_biased.default
SOFTMAX = {aten.softmax.int, aten._softmax.default}
PRODUCTS = {aten.matmul.default, aten.bmm.default}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
CASTS = {aten.to.dtype, aten._to_copy.default}
COPIES = {aten.clone.default, aten.contiguous.default, aten.alias.default}
ADDS = {aten.add.Tensor, aten.sub.Tensor, aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.where.self,
        aten.where.ScalarOther, aten.where.ScalarSelf}
SCALES = {aten.mul.Tensor, aten.div.Tensor}
PROBE_LENGTHS = (5, 11)
# the scores are also probed at one past the largest number their mask/bias operands hold (a sliding window of W
# tokens is causal at every length up to W) up to PROBE_MAX_LEN tokens, as rewrite_attention checks SDPA masks; past
# it the site is refused naming the number.  Scores [*, T, T] over token_probe.PROBE_MAX_ENTRIES entries are probed
# for the first of the leading (batch, head) dims only (_probe_value): the masks and biases broadcast over them
PROBE_MAX_LEN = 8192


def _users(n: fx.Node) -> list[fx.Node]:
    return [u for u in n.users if u.target not in METADATA_ASSERTS]


def _keeps_last2(n: fx.Node) -> bool:
    a, b = n.args[0].meta["val"].shape, n.meta["val"].shape
    return len(a) >= 2 and len(b) >= 2 and str(a[-2:]) == str(b[-2:])


def _softmax_dtype(sm: fx.Node, qk: fx.Node):
    """The dtype the model's softmax runs in: its ``dtype`` argument, else its input's where that is wider than
    the product's (float32 scores plus a float64 mask, GPT-J: the op would otherwise run the softmax in float32)."""
    if sm.target == aten._softmax.default:
        asked = torch.float32 if sm.args[2] else None
    else:
        asked = sm.args[2] if len(sm.args) > 2 else sm.kwargs.get("dtype")
    scores, product = sm.args[0].meta["val"].dtype, qk.meta["val"].dtype
    if asked is None and scores != product and torch.finfo(scores).eps < torch.finfo(product).eps:
        return scores
    return asked


def _drops_last_column(n: fx.Node) -> bool:
    """``x[..., :-1]``: a slice of the last dim from 0 that keeps all but its last entry."""
    a = n.args
    if n.target != aten.slice.Tensor or len(a) < 4 or a[2] != 0:
        return False
    x, out = a[0].meta["val"], n.meta["val"]
    return a[1] % x.dim() == x.dim() - 1 and str(out.shape[-1]) == str(x.shape[-1] - 1) \
        and str(out.shape[:-1]) == str(x.shape[:-1])


def _probs_to_pv(sm: fx.Node, sinks: bool = False):
    """From the softmax forward to the ``probs @ v`` matmul: (matmul, [softmax, ..., matmul]) or None.  ``sinks``:
    the softmax ran over the scores and a sink column, which ``[..., :-1]`` drops (once) before ``@ v``."""
    cur, chain = sm, [sm]
    while True:
        us = _users(cur)
        if len(us) != 1:
            return None
        u = us[0]
        chain.append(u)
        if u.target in PRODUCTS and u.args[0] is cur:
            return (u, chain) if not sinks else None
        if u.target in CASTS or u.target in COPIES:
            pass
        elif u.target == aten.dropout.default:
            if u.args[1] != 0 and u.args[2]:
                return None
        elif sinks and _drops_last_column(u):
            sinks = False
        elif u.target in VIEWS:
            if not _keeps_last2(u):
                return None
        else:
            return None
        cur = u


def _scores_to_qk(s: fx.Node, inputs: set):
    """Walk back from the scores to the ``q @ k^T`` product: (product node, chain, scale, softcap) or None.
    ``chain``: the nodes between them, product side first.  The scores are ``scale * X`` (+ masks and biases),
    or with one ``tanh`` on the way, ``softcap * tanh(scale * X / softcap)`` (+ masks and biases after it):
    Gemma 2's soft-capping; no addition may come before the ``tanh``."""
    chain, scale, cur = [], 1.0, s
    post = None  # the scale after the tanh (the softcap), once one was passed
    while True:
        t = cur.target
        if t in PRODUCTS or t == aten.baddbmm.default:
            if t == aten.baddbmm.default:
                alpha = cur.kwargs.get("alpha", 1)
                if not isinstance(alpha, (int, float)) or post is not None:
                    return None
                scale *= alpha
            if post is None:
                return cur, chain[::-1], scale, None
            return cur, chain[::-1], scale * post, post
        if cur.op != "call_function":
            return None
        ins = [a for a in cur.args if isinstance(a, fx.Node)]
        main = [a for a in ins if a in inputs]
        if len(main) != 1:
            return None
        if t in VIEWS or t in COPIES:
            if t in VIEWS and not _keeps_last2(cur):
                return None
        elif t in SCALES:
            other = [a for a in cur.args if a is not main[0]]
            if len(other) != 1 or not isinstance(other[0], (int, float)):
                return None
            scale = scale * other[0] if t == aten.mul.Tensor else scale / other[0]
        elif t == aten.tanh.default:
            if post is not None or scale == 0:
                return None
            post, scale = scale, 1.0
        elif post is not None:  # an addition (a bias or a mask) inside the tanh
            return None
        elif t == aten.sub.Tensor:
            if cur.args[0] is not main[0]:
                return None
        elif t not in ADDS:
            return None
        chain.append(cur)
        cur = main[0]


def rewrite_causal_attention(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    remove_dead_code(gm)  # e.g. nn.MultiheadAttention's head-averaged weights nobody reads: a second user of probs
    inputs = value_nodes(gm.graph, {ctx.input_node})
    probe = Probe(ctx)
    # other values for every tensor the graph reads besides the tree's (parameters, buffers, constants): the mask
    # and window must not move with them (a window held in a buffer was read off the first probe's random value)
    others = (Probe(ctx, seed=1, int_low=3), Probe(ctx, seed=2, int_low=100, float_scale=100.0))
    count, biased = 0, 0
    features = {"windowed": 0, "softcapped": 0, "with_sinks": 0}
    for sm in list(gm.graph.nodes):
        if sm.op != "call_function" or sm.target not in SOFTMAX:
            continue
        s, sinks = _split_sinks(_without_row_max(sm.args[0]))
        sv = s.meta["val"]
        if sv.dim() < 2 or sm.args[1] % sv.dim() != sv.dim() - 1 or not {sv.dim() - 2, sv.dim() - 1} <= set(
                token_dims(sv, ctx)):
            continue
        probs_chain = _probs_to_pv(sm, sinks is not None)
        found = _scores_to_qk(s, inputs) if probs_chain is not None else None
        if found is None:
            continue
        pv, probs_chain = probs_chain
        scaled_out = _lse_sink_scale(pv, s, ctx, inputs) if sinks is None else None
        qk, chain, scale, softcap = found
        if qk.target == aten.baddbmm.default:
            fused = qk
            qk, chain = _split_baddbmm(gm, ctx, qk, chain)
            if s is fused:  # the softmax read the baddbmm itself (nn.MultiheadAttention): now its replacement
                s = chain[-1]
        q, kt, v = qk.args[0], qk.args[1], pv.args[1]
        qkv, probs = qk.meta["val"], pv.args[0]
        # scores made as [batch * heads, T, T] and viewed to [batch, heads, T, T] before the softmax (GPT-NeoX
        # Japanese's baddbmm): with batch 1, q and k get the leading 1 back
        lead = str(probs.meta["val"].shape) == str(torch.Size([1, *qkv.shape]))
        if (token_dims(q.meta["val"], ctx)[-1:] != [q.meta["val"].dim() - 2]
                or token_dims(kt.meta["val"], ctx)[-1:] != [kt.meta["val"].dim() - 1]
                or token_dims(v.meta["val"], ctx)[-1:] != [v.meta["val"].dim() - 2]
                or (str(probs.meta["val"].shape) != str(qkv.shape) and not lead)):
            continue  # the input batch is [1, T]: leading dims are batch 1 times heads
        # the mask/bias operands' numbers: probed one past the largest (a window of W tokens shows at W + 2)
        past = int(largest_index_literal(ancestors(s) - ancestors(qk), data=(qk,))) + 2
        if past > PROBE_MAX_LEN:
            raise UnsupportedModelError(
                f"{where(sm)}: hand-written attention whose mask or bias compares positions with {past - 2} (a "
                f"sliding window?{SCALED_NOTE}): checking the scores past it takes [{past}, {past}] scores, more "
                f"than the "
                f"[{PROBE_MAX_LEN}, {PROBE_MAX_LEN}] it may probe; tree attention replaces the causal masks and "
                f"sliding windows it can check")
        lengths = PROBE_LENGTHS + ((past,) if past > max(PROBE_LENGTHS) else ())
        try:
            checked = _check_scores(probe, ctx, qk, s, scale, softcap, lengths)
            agains = [_check_scores(o, ctx, qk, s, scale, softcap, lengths) for o in others] \
                if checked is not None else []
        except NotProbeable:  # a size that is not a function of the length: left for the verifier
            checked = None
        if checked is None:
            continue
        moved = next((a for a in agains if a is None or a[1] != checked[1]), False)
        if moved is not False:
            raise UnsupportedModelError(
                f"{where(sm)}: hand-written attention whose mask moves with the values of the model's tensors "
                f"(parameters, buffers or constants: e.g. a window width held in a tensor; "
                f"{_mask_text(checked)} with one set of values, {_mask_text(moved)} with another); tree attention "
                f"replaces masks computed from positions alone")
        has_bias, window = checked[0] or any(a[0] for a in agains), checked[1]
        if lead and has_bias:
            continue  # a bias computed in the [batch * heads] layout: left to the verifier
        with gm.graph.inserting_before(pv):
            k = ctx.call(aten.transpose.int, (kt, -1, -2), like=qk)
            if lead:
                q, k = (ctx.call(aten.unsqueeze.default, (x, 0), like=x) for x in (q, k))
            bias = _bias_nodes(ctx, probe, qk, chain, s, lengths) if has_bias else None
            pos = ctx.tree_input("position_ids") if window is not None else None
            if scaled_out is not None:  # the sink logit of each row, as a column: [..., 1, 1] broadcast to [..., T, 1]
                sinks = ctx.call(aten.unsqueeze.default, (scaled_out[1], -1), like=scaled_out[1])
            new = ctx.call(BIASED, (q, k, v, ctx.tree_input("subtree_end"), bias, float(scale), _softmax_dtype(sm, qk),
                                    pos, window, None if softcap is None else float(softcap), sinks), like=sm)
        if str(new.meta["val"].shape) != str(pv.meta["val"].shape):
            gm.graph.erase_node(new)
            if scaled_out is not None:
                gm.graph.erase_node(sinks)
            continue
        if scaled_out is not None:  # the op's output is the scaled one: the scale's nodes (logsumexp too) go
            mul, _, scale_chain = scaled_out
            mul.replace_all_uses_with(new)
            _erase_dead(gm, scale_chain)
        pv.replace_all_uses_with(new)
        _erase_dead(gm, probs_chain)  # dead-code elimination keeps dropout (an impure op) alive
        count += 1
        biased += bool(has_bias)
        features["windowed"] += window is not None
        features["softcapped"] += softcap is not None
        features["with_sinks"] += sinks is not None
    if count:
        remove_dead_code(gm)
    return PassResult(count, {"with_bias": biased, **features} if count else {})


# a score at most this is masked (its softmax weight is 0): _allowed.  Below a written-out -1e4 mask value, so that
# the probe's scores added to it (-1e4 + s) still count as masked; exp(-1e3) is 0 in float32 and float64 alike
MASKED_MAX = -1e3


def _mask_text(checked: tuple | None) -> str:
    """What :func:`_check_scores`' result ``(has bias, window)`` (None: neither) says the mask is."""
    if checked is None:
        return "no causal mask"
    return "a causal mask" if checked[1] is None else f"a window of {checked[1]} tokens"


def _without_row_max(x: fx.Node) -> fx.Node:
    """``y - y.max(-1, keepdim=True).values`` (or ``amax``) -> ``y``: the softmax subtracts its row maximum
    itself, so the result is the same function of ``y`` (gpt-oss writes it out against bf16 overflow)."""
    if x.target != aten.sub.Tensor or len(x.args) != 2 or not isinstance(x.args[1], fx.Node):
        return x
    y, m = x.args
    if m.target is operator.getitem and m.args[1] == 0:
        m = m.args[0]
        ok = m.target == aten.max.dim
    else:
        ok = m.target == aten.amax.default
    if not ok or m.args[0] is not y:
        return x
    nd = y.meta["val"].dim()
    dims = m.args[1] if len(m.args) > 1 else m.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    keep = m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False)
    return y if [d % nd for d in dims] == [nd - 1] and keep else x


def _split_sinks(s: fx.Node):
    """``cat([scores, sink], -1)`` with a one-column ``sink`` (attention sinks: one more logit per query row, its
    probability dropped after the softmax) -> (scores, sink); anything else -> (s, None)."""
    if s.target not in (aten.cat.default, aten.concat.default):
        return s, None
    xs = s.args[0]
    dim = s.args[1] if len(s.args) > 1 else s.kwargs.get("dim", 0)
    if len(xs) != 2 or not all(isinstance(x, fx.Node) for x in xs):
        return s, None
    scores, sink = xs
    nd = scores.meta["val"].dim()
    if dim % nd != nd - 1 or sink.meta["val"].dim() != nd or sink.meta["val"].shape[-1] != 1:
        return s, None
    return scores, sink


def _lse_sink_scale(pv: fx.Node, s: fx.Node, ctx: PassContext, inputs: set):
    """GraniteSWA's attention sinks: ``out = (probs @ v) * cast(unsqueeze(sigmoid(cast(logsumexp(s, -1) - sink)), -1))``
    with ``probs = softmax(s)`` and ``sink`` one logit per row that depends on no token (e.g. ``sinks.view(1, -1, 1)``;
    ``inputs``: the nodes the input ids reach).
    That is the softmax over ``s`` and one more column ``sink`` whose probability is dropped, exactly:
    ``e^(s - lse) * e^lse / (e^lse + e^sink) = e^s / (e^lse + e^sink)``.  The logsumexp must read ``s`` itself: the
    softmax may read ``s - rowmax(s)`` (the same probabilities), a logsumexp of that would shift the sink by the max.
    -> (the ``mul``, the sink node, the scale's nodes from the logsumexp to the ``mul``) or None."""
    us = _users(pv)
    if len(us) != 1 or us[0].target != aten.mul.Tensor or len(us[0].args) != 2:
        return None
    mul = us[0]
    x = mul.args[1] if mul.args[0] is pv else mul.args[0] if mul.args[1] is pv else None
    if not isinstance(x, fx.Node) or x is pv:
        return None
    chain = [mul]

    def step(n, targets):  # n when its target is one of targets and its only user is the chain's last node
        if not isinstance(n, fx.Node) or n.target not in targets or _users(n) != [chain[-1]]:
            return None
        chain.append(n)
        return n

    def past_casts(n):
        while isinstance(n, fx.Node) and n.target in CASTS and step(n, CASTS) is not None:
            n = n.args[0]
        return n

    u = step(past_casts(x), {aten.unsqueeze.default})
    if u is None or u.args[1] % u.meta["val"].dim() != u.meta["val"].dim() - 1:
        return None
    sig = step(past_casts(u.args[0]), {aten.sigmoid.default})
    sub = step(past_casts(sig.args[0]), {aten.sub.Tensor}) if sig is not None else None
    if sub is None or len(sub.args) != 2 or sub.kwargs.get("alpha", 1) != 1:
        return None
    lse, sink = sub.args
    if not (isinstance(lse, fx.Node) and lse.target == aten.logsumexp.default and lse.args[0] is s
            and _users(lse) == [sub] and isinstance(sink, fx.Node)):
        return None
    nd = s.meta["val"].dim()
    dims = lse.args[1] if len(lse.args) > 1 else lse.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    keep = lse.args[2] if len(lse.args) > 2 else lse.kwargs.get("keepdim", False)
    sv = sink.meta["val"]
    if ([d % nd for d in dims] != [nd - 1] or keep or sv.dim() != nd - 1 or token_dims(sv, ctx)
            or sink in inputs):
        return None  # a sink per token, or one read off the input ids: not a per-row constant
    chain.append(lse)
    return mul, sink, list(reversed(chain))


def _erase_dead(gm: fx.GraphModule, chain: list[fx.Node]) -> None:
    """Erase ``chain`` (softmax ... probs @ v, all single-user) from its end, with their asserts."""
    for n in reversed(chain):
        for u in [u for u in n.users if u.target in METADATA_ASSERTS]:
            gm.graph.erase_node(u)
        if n.users:
            return
        gm.graph.erase_node(n)


def _split_baddbmm(gm, ctx, node, chain):
    """``baddbmm(b, q, kT, beta, alpha)`` -> ``alpha * bmm(q, kT) + beta * b`` (same math)."""
    b, q, kt = node.args[:3]
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    with gm.graph.inserting_before(node):
        prod = ctx.call(aten.bmm.default, (q, kt), like=node)
        scaled = ctx.call(aten.mul.Tensor, (prod, alpha), like=node) if alpha != 1 else prod
        side = ctx.call(aten.mul.Tensor, (b, beta), like=node) if beta != 1 else b
        new = ctx.call(aten.add.Tensor, (scaled, side), like=node)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return prod, ([scaled] if scaled is not prod else []) + [new] + chain


def _check_scores(probe: Probe, ctx: PassContext, qk: fx.Node, s: fx.Node, scale: float, softcap, lengths):
    """(has bias, window) if the scores are ``scale * X + bias`` (``softcap * tanh(scale * X / softcap) + bias``)
    under the causal mask, or under the causal mask and a sliding window of W tokens (``q - W < k``, W read off
    the longest probe), with a bias that is exact on trees at the probe ``lengths``
    (the sample lengths and one past every number the scores' operands hold); None otherwise (see the module
    docstring)."""
    gen = torch.Generator().manual_seed(0)
    has_bias, window = False, None
    for T in sorted(lengths, reverse=True):  # the longest first: it shows the window
        x = _probe_value(probe.random(qk, T, gen))
        zero = torch.zeros_like(x)
        outs = [probe.run([s], chain_batch(T), {qk: v}) for v in (zero, x)]
        if any(o is None for o in outs):
            return None
        s0, sx = (o[0] for o in outs)
        if s0.numel() != x.numel():
            return None
        s0, sx = s0.reshape(x.shape), sx.reshape(x.shape)
        allowed = _allowed(s0)
        if window is None:
            window = last_row_window(allowed)
            if window < 1:  # the last query sees nothing: neither causal nor a window
                return None
        visible = causal_window_mask(T, window).expand(x.shape)
        if not torch.equal(allowed, visible) or not torch.equal(_allowed(sx), visible):
            return None
        # the product's dtype too: float32 scores added to a float64 mask (GPT-J) are float64 but round as float32
        eps = max(torch.finfo(s0.dtype).eps, torch.finfo(x.dtype).eps)
        tol = 1e-9 if eps <= torch.finfo(torch.float64).eps else 1e3 * eps
        xs = scale * x[visible].double()
        want = xs if softcap is None else softcap * torch.tanh(xs / softcap)
        d = (sx - s0)[visible].double()
        if not torch.allclose(d, want, rtol=tol, atol=tol * float(want.abs().max())):
            return None
        has_bias = has_bias or bool((s0[visible] != 0).any())
    window = None if window >= max(lengths) else window
    if not has_bias:
        return False, window
    return (True, window) if _bias_exact_on_tree(probe, ctx, qk, s, max(lengths)) else None


def _probe_value(x: torch.Tensor) -> torch.Tensor:
    """``x`` (the product's value), or over :data:`~treecompile.passes.token_probe.PROBE_MAX_ENTRIES` entries its
    first entry of every leading dim (``[1, .., 1, T, T]``): the score ops broadcast it against their operands (a
    ``[1, 1, T, T]`` mask); an op that needs the full shape fails the probe, and the site is refused."""
    if x.numel() <= PROBE_MAX_ENTRIES:
        return x
    return x[(slice(0, 1),) * (x.dim() - 2)]


def _allowed(s: torch.Tensor) -> torch.Tensor:
    """Entries the softmax gives a nonzero weight: not -inf and not a mask value, at most ``MASKED_MAX`` (-1e3):
    a dtype's min, also after a scale (CodeGen adds ``finfo.min`` and then divides by sqrt(d)), or a written-out
    ``-1e9`` / ``-1e4`` plus the score.  Its softmax weight exp(score - row max) is exactly 0 where the row's
    largest visible score is more than ~745 (float64; ~104 in float32) above it: true of every model seen, but an
    assumption (scores near -995 under a -1000 mask would leave e^-5 and pass as masked).  Never a score a visible
    entry may have (a float16 ``finfo.min / 1e4`` is -6.55)."""
    return ~(torch.isneginf(s) | (s <= MASKED_MAX))


def _bias_exact_on_tree(probe: Probe, ctx: PassContext, qk: fx.Node, s: fx.Node, reach: int) -> bool:
    """The bias the graph computes on a tree equals the per-path bias on every pair of one path; the tree
    (:func:`token_probe.probe_tree`) has pairs whose DFS distance exceeds ``reach`` (the longest probe length: one
    past every number the bias holds) while their path distance does not."""
    tree = Tree.from_paths(probe_tree(reach), order="heavy_first")  # the long branch first (probe_tree)
    batch = tree.to_batch()
    zero = _probe_value(torch.zeros(concrete_shape(qk.meta["val"], ctx, batch.seq_len), dtype=qk.meta["val"].dtype))
    out = probe.run([s], batch, {qk: zero})
    if out is None or out[0].numel() != zero.numel():
        return False
    b_tree = out[0].reshape(zero.shape)
    starts = torch.cumsum(tree.path_lengths, 0) - tree.path_lengths
    for p, L in enumerate(tree.path_lengths.tolist()):
        idx = tree.path_index[int(starts[p]):int(starts[p]) + L]
        pzero = _probe_value(torch.zeros(concrete_shape(qk.meta["val"], ctx, L), dtype=qk.meta["val"].dtype))
        ref = probe.run([s], chain_batch(L), {qk: pzero})
        if ref is None or ref[0].numel() != pzero.numel():
            return False
        b_path = ref[0].reshape(pzero.shape)
        low = torch.ones(L, L, dtype=torch.bool).tril()
        got = b_tree[..., idx[:, None], idx[None, :]]
        if not torch.allclose(got[..., low], b_path[..., low], rtol=1e-12, atol=0):
            return False
    return True


def _is_mask_value(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x <= MASKED_MAX


def _masks_only(probe: Probe, side, lengths) -> bool:
    """An additive operand whose values are only 0 and -inf/finfo.min (a mask, not a bias) at every probe length
    (the sample lengths and one past every number the scores' operands hold: a bias that starts past some distance is
    zero at short lengths).  A number (``+ 1.0``) is a bias."""
    if not isinstance(side, fx.Node):
        return False
    for T in lengths:
        out = probe.run([side], chain_batch(T), {})
        if out is None or not out[0].dtype.is_floating_point:
            return False
        v = out[0]
        if not bool(((v == 0) | ~_allowed(v)).all()):
            return False
    return True


def _bias_nodes(ctx: PassContext, probe: Probe, qk: fx.Node, chain: list[fx.Node], s: fx.Node,
                lengths) -> fx.Node:
    """The scores with the product replaced by zeros (in the graph), in the product's shape.

    Masking steps are left out (``masked_fill``/``where`` with -inf/finfo.min, additions of an operand
    that holds only 0 and -inf): the op applies the tree mask, and on every pair the tree lets attend
    the masks do not fire (checked on the probe tree), so the bias there is unchanged; their
    subgraphs (``triu`` of DFS indices, ...) die."""
    val, g = qk.meta["val"], ctx.graph
    q, kt = qk.args[0], qk.args[1]
    shape = list(val.shape[:-2]) + [ctx.call(aten.sym_size.int, (q, q.meta["val"].dim() - 2)),
                                    ctx.call(aten.sym_size.int, (kt, kt.meta["val"].dim() - 1))]
    env = {qk: ctx.call(aten.zeros.default, (shape,), {"dtype": val.dtype, "device": val.device})}

    def pairwise(x):
        """``x``, or for a [.., T, .., T] operand (e.g. ALiBi's ``k_pos - q_pos``) a copy of its
        pairwise subgraph inserted by this pass: the bias proven on the probe tree is then built
        only from nodes the verifier knows this pass made, and the user's originals die unless
        something else reads them (which the verifier then judges on its own)."""
        if not isinstance(x, fx.Node) or x in env:
            return env.get(x, x)
        if len(token_dims(x.meta.get("val"), ctx)) < 2 or x.op != "call_function":
            return x
        env[x] = ctx.set_val(g.node_copy(x, pairwise))
        return env[x]

    prev = qk
    for n in chain:
        t, a = n.target, n.args
        skip = ((t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor) and a[0] is prev and _is_mask_value(a[2]))
                or (t == aten.where.ScalarOther and a[1] is prev and _is_mask_value(a[2]))
                or (t == aten.where.ScalarSelf and a[2] is prev and _is_mask_value(a[1]))
                or (t == aten.add.Tensor and len(a) == 2 and not n.kwargs
                    and _masks_only(probe, a[1] if a[0] is prev else a[0], lengths)))
        if skip:
            env[n] = env[prev]
        else:
            env[n] = ctx.set_val(g.node_copy(n, pairwise))
        prev = n
    out = env[s]
    if str(out.meta["val"].shape) != str(val.shape):
        out = ctx.call(aten.reshape.default, (out, shape))
    return out
