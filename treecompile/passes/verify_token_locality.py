"""verify_token_locality: prove that the rewritten graph treats every token on its own path.

Runs last.  On a tree batch the graph sees the DFS sequence of all paths; an op that mixes tokens
along that sequence (a mean over it, a shift, a prefix sum, attention without the tree mask, ...)
would read other branches and train silently wrong.  This pass walks every node (also inside
``wrap_with_set_grad_enabled``/``wrap_with_autocast`` bodies) and tracks the *token axis*: the dim
of size ``T`` (the symbolic length of ``input_ids [1, T]``) indexed by the DFS token.  It starts at
the placeholders (``input_ids`` dim 1, the tree and boundary inputs' ``T`` dims) and goes through
each op by the rules of :mod:`treecompile.passes.token_axis` (derived from what the op does to
dims: which it reduces, indexes, shifts, contracts).  Invariants on every value: at most one dim
carries tokens, its size is ``outer * T * inner`` with a known layout (``[1, T, H, D] -> [H*T, D]``
merges heads into it, ``-> [1, T, H*D]`` restores it), no other dim's size involves ``T``, and ``T``
itself is never used as a value (on a tree it counts all paths' tokens).

The contract for tree-aware code, which the pass accepts without looking inside:
- every op in the ``treecompile::`` namespace (tree_attention, the GDN/conv tree ops, the loss
  heads, and rewrites' ops): they take the tree inputs and compute along the token's path; each
  has a CPU reference tested against the per-path run;
- nodes that an earlier pass of the pipeline inserted (``meta["treecompile_pass"]``, set by
  ``run_passes``), e.g. rewrite_loss's gather at the path predecessor and its loss sum: they read
  tree inputs (``pred_index``), and each pass is tested against the per-path run.
Every tree op, every inserted node that the rules alone would refuse, and every refusal is a
:class:`TokenMixingSite` in ``PassResult.info["sites"]``.  New rewrite passes go before this one
(``PASSES[-1]``; ``BOUNDARY_PASSES`` puts ``expose_boundary`` just before it).  Refusals raise :class:`UnsupportedModelError` naming
each node, its op, the model's source line and why.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
from torch import fx

from treecompile.passes import token_axis as ta
from treecompile.passes.token_axis_compute import rule_for
from treecompile.passes.base import PassContext, PassResult, UnsupportedModelError, where

PASS_KEY = "treecompile_pass"  # node.meta key: the pass that inserted the node
MIXING = "mixes tokens along the sequence; on a tree this would read other branches"
_BODY_HOPS = ("wrap_with_set_grad_enabled", "wrap_with_autocast")
_POISON = "poison"  # downstream of a refused node: not checked again


@dataclass(frozen=True)
class TokenMixingSite:
    """An op that touches the token axis beyond treating tokens independently, and what became of it."""

    node: str  # graph node name
    op: str  # e.g. "treecompile.tree_attention.default", "aten.mean.dim"
    source: str  # where(node): module and the model's source line
    action: str  # "tree op" | "tree-aware" | "refused"
    detail: str  # who put the tree op there, or why it is refused

    def __str__(self) -> str:
        return f"{self.action}: {self.op} at {self.source}: {self.detail}"


def _has_tokens(s) -> bool:
    return any(_has_tokens(x) for x in s) if isinstance(s, tuple) else bool(s)


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


class _Verifier:
    def __init__(self, ctx: PassContext):
        self.allow_random = ctx.options.allow_dropout
        self.T = ta.expr(ctx.seq_len)
        self.sym = next(iter(self.T.free_symbols)) if self.T.free_symbols else None
        self.sites: list[TokenMixingSite] = []
        self.layout: dict = {}  # node -> (outer, inner) of its token dim when not (1, 1)
        self.refused = 0
        self.nodes = 0

    # ------------------------------------------------------------------ shapes
    def _involves_t(self, s) -> bool:
        return isinstance(s, (torch.SymInt, torch.SymFloat, torch.SymBool)) and self.sym in s.node.expr.free_symbols

    def t_dims(self, v) -> list[int]:
        if not isinstance(v, torch.Tensor):
            return []
        return [d for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt) and sympy.expand(s.node.expr - self.T) == 0]

    def _odd_dims(self, v) -> list:
        """Sizes that involve T but are not T (``T + 1``, ``T * D``): the axis cannot be tracked."""
        if not isinstance(v, torch.Tensor):
            return []
        return [s for s in v.shape if self._involves_t(s) and sympy.expand(s.node.expr - self.T) != 0]

    def from_shape(self, v):
        if isinstance(v, (tuple, list)):
            return tuple(self.from_shape(x) for x in v)
        return frozenset(self.t_dims(v))

    # ------------------------------------------------------------------ walk
    def run(self, gm: fx.GraphModule, state: dict) -> dict:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                state.setdefault(node, self.from_shape(node.meta.get("val")))
            elif node.op == "get_attr":
                state[node] = frozenset()
            elif node.op in ("call_function", "call_method", "call_module"):
                self.nodes += 1
                state[node] = self.visit(gm, node, state)
        return state

    def site(self, node, action, detail):
        self.sites.append(TokenMixingSite(node.name, _op_name(node.target), where(node), action, detail))

    def visit(self, gm, node: fx.Node, state: dict):
        ins = node.all_input_nodes
        if any(state.get(a) is _POISON for a in ins):
            return _POISON
        val = node.meta.get("val")
        if node.target is operator.getitem and isinstance(state.get(node.args[0]), tuple):
            if node.args[0] in self.layout:
                self.layout[node] = self.layout[node.args[0]]
            return state[node.args[0]][node.args[1]]
        try:
            return self._check(gm, node, state, val)
        except ta.Mixes as e:
            inserted = node.meta.get(PASS_KEY)
            if inserted:
                self.site(node, "tree-aware", f"inserted by {inserted}, tree-aware by construction (as a model op "
                                              f"it would be refused: {e.args[0]})")
                return self.from_shape(val)
            self.refused += 1
            self.site(node, "refused", f"{e.args[0]}: it {MIXING}")
            return _POISON

    def _tok(self, state):
        def tok(x):
            s = state.get(x, frozenset()) if isinstance(x, fx.Node) else frozenset()
            return s if isinstance(s, frozenset) else frozenset()
        return tok

    def _check(self, gm, node, state, val):
        target = node.target
        carries = [a for a in node.all_input_nodes if _has_tokens(state.get(a))]
        if carries and isinstance(target, torch._ops.OpOverload) and target.overloadpacket in ta.SHAPE_ARGS:
            read = []  # the nodes the op reads values from: every argument but the shape-only ones
            for name, arg in ta.bound_args(node).items():
                if name not in ta.SHAPE_ARGS[target.overloadpacket]:
                    fx.node.map_arg(arg, read.append)
            carries = [a for a in carries if a in read]
        if isinstance(target, torch._ops.OpOverload) and target.namespace == "treecompile":
            by = node.meta.get(PASS_KEY)
            self.site(node, "tree op", f"inserted by {by}" if by else "swapped in during capture")
            return self.from_shape(val)
        if isinstance(target, torch._ops.HigherOrderOperator) and target.__name__ in _BODY_HOPS:
            return self._body(gm, node, state)
        for a in node.all_input_nodes:
            v, s = a.meta.get("val"), state.get(a)
            if isinstance(v, torch.Tensor) and isinstance(s, frozenset):
                odd = [sz for d, sz in enumerate(v.shape) if d not in s and self._involves_t(sz)]
                if odd:
                    raise ta.Mixes(f"reads {a.name} whose size {odd[0]} mixes the sequence length with something "
                                   f"else; the token axis cannot be tracked")
        if not isinstance(target, torch._ops.OpOverload):
            if carries:
                raise ta.Mixes(f"{_op_name(target)} is not an op treecompile knows to treat tokens independently")
            if not isinstance(val, torch.Tensor) and not isinstance(val, (tuple, list)):
                return frozenset()  # shape arithmetic on sym ints
            return self._token_free(node, val, uniform=False)
        self._no_length_values(node)
        packet = target.overloadpacket
        if packet in ta.SHAPE_ONLY:
            return self.from_shape(val)
        if not carries:
            return self._token_free(node, val, uniform=packet in ta.UNIFORM_FACTORIES)
        rule = rule_for(target)
        if rule is None:
            raise ta.Mixes(self._unknown(node, val))
        layouts = {self.layout.get(a, (1, 1)) for a in carries}
        if len(layouts) > 1:
            raise ta.Mixes("combines tensors whose token axes are merged with other dims in different ways")
        c = ta.Op(node, self._tok(state), self.t_dims, lambda x: self.layout.get(x, (1, 1)), self.T)
        c.allow_random = self.allow_random
        try:
            mapped = rule(c)
        except ta.Mixes:
            raise
        except Exception as e:  # noqa: BLE001 - an op the rule cannot read is refused, not guessed
            raise ta.Mixes(f"could not be analysed ({type(e).__name__}: {e})") from e
        layout = c.new_layout or layouts.pop()
        if layout != (1, 1):
            self.layout[node] = layout
        return self._settle(node, val, mapped, layout)

    def _settle(self, node, val, mapped, layout=(1, 1)):
        """The output's token dim must be the rule's, of size outer * T * inner; no other size involves T."""
        if isinstance(val, (tuple, list)):
            mapped = mapped if isinstance(mapped, tuple) else tuple(mapped for _ in val)
            return tuple(self._settle(node, v, m, layout) for v, m in zip(val, mapped))
        if not isinstance(val, torch.Tensor):
            return frozenset()
        involved = {d for d, s in enumerate(val.shape) if self._involves_t(s)}
        if len(involved) > 1 or len(mapped) > 1:
            raise ta.Mixes(f"pairs every token with every other token (output {list(val.shape)})")
        if involved != set(mapped):
            raise ta.Mixes(f"moves the sequence axis where it cannot be followed (output {list(val.shape)})")
        for d in mapped:
            if sympy.expand(ta.expr(val.shape[d]) - layout[0] * self.T * layout[1]) != 0:
                raise ta.Mixes(f"changes the length of the sequence axis (output {list(val.shape)})")
        return frozenset(mapped)

    def _token_free(self, node, val, *, uniform: bool):
        """No input carries tokens: fine unless the op builds values along a new axis of length T."""
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if any(self.t_dims(v) or self._odd_dims(v) for v in vals):
            if not uniform:
                what = "counts DFS positions" if "arange" in _op_name(node.target) else \
                    "builds values that depend on the DFS position"
                raise ta.Mixes(f"{what} along an axis of length T (on a tree the i-th DFS token is not the "
                               f"i-th token of its path)")
            return self._settle(node, val, tuple(set(self.t_dims(v)) for v in vals) if isinstance(val, (tuple, list))
                                else set(self.t_dims(val)))
        return self.from_shape(val)

    def _no_length_values(self, node):
        """``T`` (or anything computed from it) passed where the op takes a value, not a size."""
        for i, a in enumerate(node.target._schema.arguments):
            arg = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if "int" in str(a.type) or arg is None:
                continue
            found = []
            fx.node.map_arg(arg, found.append)
            for n in found:
                if self._involves_t(n.meta.get("val")):
                    raise ta.Mixes(f"uses the sequence length as a value ({a.name}={n.name}); on a tree T counts "
                                   f"the tokens of all paths, not the length of the token's path")

    def _unknown(self, node, val) -> str:
        name = _op_name(node.target)
        kept = any(isinstance(v, torch.Tensor) and any(self._involves_t(s) for s in v.shape)
                   for v in (val if isinstance(val, (tuple, list)) else (val,)))
        if not kept:
            return (f"{name} collapses the sequence axis (a reduction over tokens, a read of single positions "
                    f"or data-dependent positions)")
        custom = "" if node.target.namespace == "aten" else \
            " (a custom op outside treecompile::; tree-aware ops belong in that namespace)"
        return f"{name} takes the sequence and is not known to treat tokens independently{custom}"

    def _body(self, gm, node, state):
        """A higher-order op that runs a subgraph on its operands: verify the body."""
        i = next(i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"
                 and isinstance(getattr(gm, a.target, None), fx.GraphModule))
        sub = getattr(gm, node.args[i].target)
        phs = [n for n in sub.graph.nodes if n.op == "placeholder"]
        inner = {}
        for ph, a in zip(phs, node.args[i + 1:]):
            inner[ph] = state.get(a, frozenset()) if isinstance(a, fx.Node) else frozenset()
            if a in self.layout:
                self.layout[ph] = self.layout[a]
        self.run(sub, inner)
        out = sub.graph.output_node().args[0]
        layouts = {self.layout[a] for a in (out if isinstance(out, (tuple, list)) else (out,)) if a in self.layout}
        if len(layouts) > 1:
            raise ta.Mixes("returns tensors whose token axes are merged with other dims in different ways")
        if layouts:
            self.layout[node] = layouts.pop()
        res = tuple(inner.get(a, frozenset()) if isinstance(a, fx.Node) else frozenset()
                    for a in (out if isinstance(out, (tuple, list)) else (out,)))
        if any(r is _POISON for r in res):
            return _POISON
        return res if isinstance(out, (tuple, list)) else res[0]


def verify_token_locality(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    v = _Verifier(ctx)
    v.run(gm, {})
    sites = tuple(v.sites)
    if v.refused:
        refused = [s for s in sites if s.action == "refused"]
        lines = "\n".join(f"  - {s.source}: {s.op} {s.detail}" for s in refused)
        raise UnsupportedModelError(
            f"{len(refused)} op(s) would mix tokens across the branches of a tree; treecompile cannot make "
            f"them exact (see README 'What is supported'):\n{lines}")
    return PassResult(0, {"sites": sites, "nodes": v.nodes,
                          "tree_ops": sum(s.action == "tree op" for s in sites),
                          "tree_aware": sum(s.action == "tree-aware" for s in sites)})
