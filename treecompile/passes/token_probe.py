"""Probing a piece of a captured graph: what does it compute along the token axis?

The mixer rewrites (``rewrite_token_shifts``, ``rewrite_causal_convs``, ``rewrite_causal_attention``)
find a candidate site by its shape metadata, then *evaluate* the piece of graph that forms it on
concrete tensors at a few sequence lengths (and on a small tree) and compare with the semantics they
would replace it by.  A site is rewritten only when the evaluation agrees; otherwise it is left
alone (the verifier refuses what no pass could prove).  This module holds what they share:

- :func:`value_nodes`: the nodes whose values depend on the *values* of user inputs or parameters
  (not only on their shapes, and not on the tree inputs ``tree_*``);
- :func:`token_dims` / :func:`involves_tokens`: which dims of a value are the sequence axis;
- :class:`Probe`: copies the ancestors of some nodes into a small graph, feeds given tensors for
  chosen nodes, the batch's fields for the tree inputs, zeros or seeded random values for the other
  placeholders (with the symbolic length replaced by a concrete one), and runs it;
- :func:`lengths_past_literals`: the sample lengths plus one past every number the piece holds (a mask
  ``position < 100`` only shows at length 101).
"""

from __future__ import annotations

import torch
from torch import fx

import math

from treecompile.passes.base import TREE_INPUTS, PassContext, ancestors, largest_index_literal
from treecompile.tree import Tree, TreeBatch, ancestor_index

__all__ = ["NotProbeable", "PROBE_MAX_ENTRIES", "PROBE_TREE", "Probe", "chain_batch", "concrete_shape",
           "involves_tokens", "lengths_past_literals", "probe_tree", "token_dims", "value_nodes"]

aten = torch.ops.aten
_SHAPE_ONLY = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}
# factories that read only the shape, dtype and device of their tensor argument
_LIKE = {aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default,
         aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default}

# a probe tree with the odd shapes: 1-token nodes, a path that is a prefix of another, fan-out 3,
# nodes shorter than a conv kernel, a second root
PROBE_TREE = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 9], [1, 2, 10, 11, 12, 13, 14, 15, 16],
              [1, 2, 10, 17], [1, 2, 10, 18, 19], [20, 21, 22]]


def probe_tree(reach: int) -> list[list[int]]:
    """:data:`PROBE_TREE`, and where ``reach`` (one past the largest distance a checked subgraph holds) exceeds
    what it spans, a long branch of ``reach`` tokens followed in DFS order by a short sibling branch: pairs of
    the sibling's path then lie ``> reach`` apart in the DFS sequence but a few tokens apart on their path, so a
    pattern built from DFS indices (``tril`` of a ``[T, T]`` tensor) instead of positions shows there.  The caller
    serialises it with ``order="heavy_first"`` (the long branch first, as above), not the Tree's default, so that
    the probe does not move when that default does."""
    if reach + 4 <= max(map(len, PROBE_TREE)):
        return PROBE_TREE
    return PROBE_TREE + [[90, 91] + list(range(1000, 1000 + reach)), [90, 91, 92, 93, 94]]


def _is_tree_input(n: fx.Node) -> bool:
    return n.op == "placeholder" and n.name.startswith("tree_") and n.name[5:] in TREE_INPUTS


def value_nodes(graph: fx.Graph, sources: set[fx.Node] | None = None) -> set[fx.Node]:
    """Nodes whose value depends on the values of ``sources`` (default: every user input, parameter,
    buffer and constant; never the tree inputs)."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            if not _is_tree_input(n) and (sources is None or n in sources):
                out.add(n)
        elif n.op == "call_function" and (n.target in _SHAPE_ONLY or n.target in _LIKE):
            continue
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _seq_symbol(ctx: PassContext):
    T = ctx.seq_len
    return T.node.expr if isinstance(T, torch.SymInt) else None


def involves_tokens(size, ctx: PassContext) -> bool:
    """Whether a dim size is an expression of the sequence length (T, T+1, 2T, ...)."""
    sym = _seq_symbol(ctx)
    return isinstance(size, torch.SymInt) and sym is not None and sym in size.node.expr.free_symbols


def token_dims(val, ctx: PassContext) -> list[int]:
    """Dims of ``val`` whose size is exactly the sequence length T."""
    sym = _seq_symbol(ctx)
    if sym is None or not isinstance(val, torch.Tensor):
        return []
    return [i for i, s in enumerate(val.shape) if isinstance(s, torch.SymInt) and s.node.expr == sym]


def concrete_shape(val, ctx: PassContext, T: int) -> list[int]:
    sym = _seq_symbol(ctx)
    out = []
    for s in val.shape:
        if isinstance(s, torch.SymInt):
            expr = s.node.expr
            if expr.free_symbols - {sym}:
                raise NotProbeable(f"a size {expr} that is not a function of the sequence length")
            out.append(int(expr.subs(sym, T)))
        else:
            out.append(int(s))
    return out


class NotProbeable(Exception):
    pass


# the most entries a probe tensor of one past every literal may have (:func:`lengths_past_literals`)
PROBE_MAX_ENTRIES = 1 << 24


def lengths_past_literals(lengths: tuple[int, ...], out: fx.Node, inputs, ctx: PassContext
                          ) -> tuple[int, ...] | None:
    """``lengths``, plus one past the largest number held by the nodes that make ``out`` from ``inputs`` (the
    region and its masks or bias operands, not the inputs' own subgraphs; :func:`largest_index_literal`): a pattern
    at a position or distance c first shows at length c + 2, so a check that samples only short lengths would
    take ``shift(x) * (position < 100)`` for a plain shift.  None when a probe at that length would exceed
    :data:`PROBE_MAX_ENTRIES` entries (the caller then leaves the site alone, for the verifier to refuse)."""
    below = set().union(*(ancestors(i) for i in inputs))
    past = int(largest_index_literal(ancestors(out) - below, data=inputs)) + 2
    if past <= max(lengths):
        return lengths
    try:
        size = max(math.prod(concrete_shape(n.meta["val"], ctx, past)) for n in (*inputs, out))
    except NotProbeable:
        return None
    return lengths + (past,) if size <= PROBE_MAX_ENTRIES else None


def chain_batch(T: int) -> TreeBatch:
    """The batch of one plain sequence of T tokens (what the captured graph was written for)."""
    return Tree.from_paths([list(range(T))]).to_batch()


class Probe:
    """Runs pieces of ``ctx.gm``'s graph on concrete tensors (see the module docstring)."""

    def __init__(self, ctx: PassContext, *, seed: int = 0, int_low: int = 0, float_scale: float = 1.0):
        self.ctx = ctx
        self.seed = seed
        self.int_low = int_low  # integer feeds are drawn from [int_low, int_low + 3)
        self.float_scale = float_scale  # float placeholder feeds (not given values) are float_scale * N(0, 1)

    def random(self, node: fx.Node, T: int, gen: torch.Generator) -> torch.Tensor:
        """A seeded random tensor shaped and typed like ``node``'s value at length ``T`` (CPU)."""
        val = node.meta["val"]
        shape = concrete_shape(val, self.ctx, T)
        if val.dtype.is_floating_point:
            return torch.randn(shape, generator=gen, dtype=torch.float64).to(val.dtype)
        if val.dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        return torch.randint(self.int_low, self.int_low + 3, shape, generator=gen).to(val.dtype)

    def run(self, outputs: list[fx.Node], batch: TreeBatch, given: dict[fx.Node, torch.Tensor]
            ) -> list[torch.Tensor] | None:
        """Values of ``outputs`` for the sequence length ``batch.seq_len``; ``given`` fixes nodes'
        values (the rest of their ancestors is not run).  None if the piece cannot be evaluated."""
        T = batch.seq_len
        seen, stack = set(outputs), list(outputs)
        while stack:
            n = stack.pop()
            if n in given:
                continue
            for a in n.all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    stack.append(a)
        nodes = [n for n in self.ctx.graph.nodes if n in seen]
        g, env, feeds = fx.Graph(), {}, []
        gen = torch.Generator().manual_seed(self.seed)
        try:
            for n in nodes:
                if n in given or n.op == "placeholder":
                    env[n] = g.placeholder(f"p{len(feeds)}")
                    feeds.append(given[n] if n in given else self._feed(n, batch, T, gen))
                else:
                    env[n] = g.node_copy(n, lambda a: env[a])
            g.output([env[o] for o in outputs])
            dev = self.ctx.device
            with torch.no_grad():
                outs = fx.GraphModule(self.ctx.gm, g)(*[f.to(dev) for f in feeds])
            return [o.cpu() for o in outs]
        except NotProbeable:
            return None
        except Exception:  # noqa: BLE001 - a piece that does not run at this length is not proven
            return None

    def _feed(self, n: fx.Node, batch: TreeBatch, T: int, gen: torch.Generator) -> torch.Tensor:
        if _is_tree_input(n):
            name = n.name[5:]
            if name == "conv_index":
                return ancestor_index(batch.pred_index, int(n.meta["val"].shape[1]))
            return getattr(batch, name)
        if n is self.ctx.input_node:
            return torch.zeros(concrete_shape(n.meta["val"], self.ctx, T), dtype=n.meta["val"].dtype)
        x = self.random(n, T, gen)
        return x * self.float_scale if x.dtype.is_floating_point and self.float_scale != 1.0 else x
