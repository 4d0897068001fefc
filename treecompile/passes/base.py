"""What every pass shares: the signature, the result, the context with the tree inputs.

A pass is ``fn(gm: GraphModule, ctx: PassContext) -> PassResult``; it edits ``gm.graph`` in place
and reports how many sites it rewrote.  New nodes get ``meta["val"]`` from the op's fake
implementation (``ctx.set_val``).  Tree inputs (positions, subtree ends, ...) are new placeholders
appended after the program's own, created on first use through ``ctx.tree_input(name)``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._guards import detect_fake_mode

__all__ = ["METADATA_ASSERTS", "CompileOptions", "PassContext", "PassResult", "UnsupportedModelError", "remove_dead_code",
           "ancestors", "largest_index_literal", "where"]

METADATA_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}


_FRESH = {torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default, torch.ops.aten.empty_like.default,
          torch.ops.aten.full_like.default, torch.ops.aten.zeros.default, torch.ops.aten.ones.default,
          torch.ops.aten.full.default, torch.ops.aten.empty.memory_format, torch.ops.aten.clone.default,
          torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default, torch.ops.aten.new_full.default,
          torch.ops.aten.new_empty.default}


def _writes_only_dead_fresh(n: fx.Node) -> bool:
    """An in-place aten op (``masked_fill_``, ``fill_``, ...) whose result nobody reads, writing into a tensor this
    graph allocated (``zeros_like`` ...) that nothing but such writes reads: the write is dead (nn.MultiheadAttention
    turns a bool mask into a float one with ``zeros_like(mask).masked_fill_(mask, -inf)``)."""
    if n.op != "call_function" or n.users or not isinstance(n.target, torch._ops.OpOverload):
        return False
    if not n.target._schema.name.endswith("_") or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    buf = n.args[0]
    return buf.target in _FRESH and all(u.op == "call_function" and not u.users and u.args and u.args[0] is buf
                                        and isinstance(u.target, torch._ops.OpOverload)
                                        and u.target._schema.name.endswith("_") for u in buf.users)


def remove_dead_code(gm: fx.GraphModule) -> None:
    """Dead-code elimination that also drops export's tensor-metadata asserts on dead values
    (they would otherwise keep a replaced subgraph, e.g. the causal mask, alive), and in-place writes into a
    dead tensor the graph allocated (:func:`_writes_only_dead_fresh`)."""
    def impure(n):
        return n.target not in METADATA_ASSERTS and n.is_impure() and not _writes_only_dead_fresh(n)

    gm.graph.eliminate_dead_code(is_impure_node=impure)
    # an assert whose checked value has no other user checks a dead value: drop it, then repeat
    while True:
        dead = [n for n in gm.graph.nodes if n.target in METADATA_ASSERTS
                and isinstance(n.args[0], fx.Node) and len(n.args[0].users) == 1]
        dead += [n for n in gm.graph.nodes if _writes_only_dead_fresh(n)]
        if not dead:
            break
        for n in dict.fromkeys(dead):
            gm.graph.erase_node(n)
        gm.graph.eliminate_dead_code(is_impure_node=impure)

def length_values(nodes, seq_len) -> dict:
    """Those of ``nodes`` that turn the sequence length ``T`` into a value: {node: what it does}.  On a tree ``T``
    counts the tokens of every path, so a value computed from it differs from every path's:
    - ``T`` as an operand that is not a size (``scalar_tensor(T)``, a comparison's, a fill's), or in an
      ``arange``'s start or step;
    - an op that reads the values of a tensor with a dim of length ``T`` and returns none (``ones(T).sum()``,
      ``dot``, ``ones(1, T) @ ones(T, 1)``, a pool to one entry), except a slice or select counted from the start;
    - a slice or select counted from the end (``x[-1]``), or of a tensor reordered along ``T`` (``flip``, ``roll``,
      ``sort``, ``topk``: ``arange(T).flip(0)[0]`` is ``T - 1``).
    The token-locality verifier refuses such nodes where they stay in the graph; a rewrite that absorbs them into a
    tree op would hide them (:func:`check_absorbed`).  Sizes (``int`` arguments: views, slices, pads, factories)
    and ``arange``'s end are not values."""
    from treecompile.passes.token_axis import SHAPE_ARGS, SHAPE_ONLY

    sym = None
    if isinstance(seq_len, torch.SymInt):
        free = seq_len.node.expr.free_symbols
        sym = next(iter(free)) if len(free) == 1 else None
    if sym is None:
        return {}

    def involves(v) -> bool:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return sym in v.node.expr.free_symbols
        return False

    def t_sized(v) -> bool:
        return isinstance(v, torch.Tensor) and any(involves(d) for d in v.shape)

    aten = torch.ops.aten
    found: dict = {}
    reordered: set = set()  # tensors whose entries along T are counted from the end (after flip, sort, ...)
    normalized: set = set()  # tensors whose every entry along T depends on all of them (softmax, layer_norm)
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem:  # one output of sort/topk/layer_norm
            for taint in (reordered, normalized):
                if n.args[0] in taint:
                    taint.add(n)
            continue
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        packet = n.target.overloadpacket
        if packet in SHAPE_ONLY:
            continue
        shape_only = SHAPE_ARGS.get(packet, ())
        read: list = []  # the nodes whose values the op reads
        for i, a in enumerate(n.target._schema.arguments):
            arg = n.args[i] if i < len(n.args) else n.kwargs.get(a.name)
            if arg is None or a.name in shape_only:
                continue
            here: list = []
            fx.node.map_arg(arg, here.append)
            read += here
            if (packet == aten.arange and a.name == "end") or ("int" in str(a.type) and packet != aten.arange):
                continue
            hit = next((x for x in here if involves(x.meta.get("val"))), None)
            if hit is not None and n not in found:
                found[n] = f"uses the sequence length as a value ({a.name}={hit.name})"
        if n in found:
            continue
        val = n.meta.get("val")
        outs = [o for o in (val if isinstance(val, (tuple, list)) else (val,)) if isinstance(o, torch.Tensor)]
        keeps_t = any(t_sized(o) for o in outs)
        for taint, sources, picks, ends, what in (
                (reordered, _REORDERS, _INDEXING, (), "reordered along the sequence (counted from its end)"),
                # a slice keeps a T-long dim (attention sinks drop their column so); picking entries does not.  A
                # contraction (``probs @ v``) ends the taint: over a causal mask each row depends on its prefix
                # only, and an unmasked one is non-causal (the verifier's), or leaves no T-dim (refused below)
                (normalized, _NORMALIZERS, _INDEXING - {aten.slice, aten.narrow}, _CONTRACTIONS,
                 "normalized along the sequence (each depends on its length)")):
            if packet in sources and _acts_along(n, involves):
                taint.add(n)
            elif packet not in ends and any(x in taint for x in read):
                if packet in picks or not keeps_t:
                    found[n] = f"reads entries of a tensor {what}"
                    break
                taint.add(n)
        if n in found:
            continue
        if packet in _INDEXING:
            x = n.args[0]
            dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
            start = n.args[2] if len(n.args) > 2 else n.kwargs.get("start", n.kwargs.get("index"))
            xv = x.meta.get("val") if isinstance(x, fx.Node) else None
            if (packet in (aten.slice, aten.select, aten.narrow) and isinstance(xv, torch.Tensor)
                    and isinstance(dim, int) and xv.dim() and involves(xv.shape[dim])
                    and ((isinstance(start, int) and start < 0)
                         or (isinstance(start, fx.Node) and involves(start.meta.get("val"))))):
                found[n] = "reads tokens counted from the end of the sequence"
            continue
        if outs and any(t_sized(x.meta.get("val")) for x in read) and not keeps_t:
            found[n] = "reads a tensor of the sequence's length and makes a value without a token axis"
    return found


# ops that reorder entries along a dim: after them, entry 0 of a T-long dim depends on T
_REORDERS = frozenset(getattr(torch.ops.aten, n) for n in ("flip", "roll", "sort", "argsort", "topk", "msort"))
# ops whose every output entry along a dim depends on the whole dim (over a T-long dim: on T)
_NORMALIZERS = frozenset(getattr(torch.ops.aten, n) for n in (
    "softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm", "native_layer_norm", "group_norm",
    "native_group_norm", "instance_norm", "rms_norm", "_fused_rms_norm"))
# matrix products: a normalized T-dim contracted with another tensor's (attention's ``probs @ v``)
_CONTRACTIONS = frozenset(getattr(torch.ops.aten, n) for n in (
    "mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "einsum", "linear", "dot", "vdot", "mv", "tensordot"))
# ops that pick entries by index: from the start of a position-made tensor they read no length
_INDEXING = frozenset(getattr(torch.ops.aten, n) for n in ("slice", "select", "narrow", "index", "index_select",
                                                            "gather", "take", "take_along_dim"))


def _acts_along(n: fx.Node, involves) -> bool:
    """Whether the reordering or normalizing op ``n`` acts along a dim of its input whose length involves ``T``
    (``topk`` over the experts of each token does not; ``flip(0)`` of an ``arange(T)`` does)."""
    x = n.args[0] if n.args else n.kwargs.get("self", n.kwargs.get("input"))
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(xv, torch.Tensor) or xv.dim() == 0:
        return False
    schema = n.target._schema.arguments
    args = {a.name: (n.args[i] if i < len(n.args) else n.kwargs.get(a.name, a.default_value))
            for i, a in enumerate(schema)}
    name = n.target.overloadpacket.__name__
    rank = xv.dim()
    if name == "msort":
        dims = [0]
    elif name in ("flip", "roll"):
        dims = list(args.get("dims") or ()) or list(range(rank))  # roll without dims rolls the flattened tensor
    elif "normalized_shape" in args:  # layer_norm, rms_norm: the last len(normalized_shape) dims
        dims = list(range(rank - len(args["normalized_shape"]), rank))
    elif name in ("group_norm", "native_group_norm"):
        dims = list(range(1, rank))
    elif name == "instance_norm":
        dims = list(range(2, rank))
    else:  # sort, argsort, topk, softmax and log_softmax: one dim
        dims = [args.get("dim", -1)]
    if not all(isinstance(d, int) for d in dims):
        return True  # a dim the graph computes: assume the worst
    return any(involves(xv.shape[d % rank]) for d in dims)


def check_absorbed(candidates: dict, gm: fx.GraphModule, pass_name: str) -> None:
    """Refuse when a rewrite erased (absorbed into its tree op) one of ``candidates`` (:func:`length_values` of the
    graph before it): the rewrite's probes evaluate its region at a few lengths, so a condition on the length
    that changes only below them (``shift(x) * (ones(T).sum() > 5)``, a mask made bidirectional for ``T < 4``)
    would vanish from the tree graph.  Left in the graph, the verifier would have refused it."""
    if not candidates:
        return
    now = set(gm.graph.nodes)
    for node, what in candidates.items():
        if node not in now:
            raise UnsupportedModelError(
                f"{where(node)}: {pass_name} would absorb {_op_text(node)}, which {what}; on a tree T counts the "
                f"tokens of all paths, and the rewrite's checks at a few sample lengths cannot show that this value "
                f"never matters (a condition on the sequence length)")


def _op_text(node: fx.Node) -> str:
    t = node.target
    return f"{t.namespace}.{t._schema.name.split('::')[-1]}" if isinstance(t, torch._ops.OpOverload) else str(t)


# name -> (dtype, shape in units of the sequence length T: "T", or ("T", k) for [T, k], or "N" nodes)
TREE_INPUTS = {
    "position_ids": (torch.long, "T"),
    "subtree_end": (torch.long, "T"),
    "pred_index": (torch.long, "T"),
    "loss_weight": (torch.float64, "T"),
    "conv_index": (torch.long, ("T", None)),
    "node_start": (torch.long, "N"),
    "node_end": (torch.long, "N"),
    "node_parent": (torch.long, "N"),
    "node_level": (torch.long, "N"),
}


class UnsupportedModelError(ValueError):
    """The captured model does something treecompile cannot make exact on trees."""


def where(node: fx.Node) -> str:
    """``node NAME (file.py:LINE in fn: code)`` from the node's stack trace, for error messages."""
    import re

    st = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip()]
    loc = ""
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r'File "([^"]+)", line (\d+), in (\S+)', lines[i])
        if m:
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            loc = f"{m.group(1)}:{m.group(2)} in {m.group(3)}" + (f": {code}" if code else "")
            break
    stack = node.meta.get("nn_module_stack") or {}
    module = ""
    if stack:
        path, typ = list(stack.values())[-1][:2]
        name = getattr(typ, "__name__", None) or str(typ).rsplit(".", 1)[-1].strip("'>")
        module = f" in module {path or '<root>'} ({name})"
    return f"node {node.name}{module}" + (f" ({loc})" if loc else "")


@dataclass
class PassResult:
    count: int  # sites rewritten; 0 means the graph is unchanged
    info: dict = field(default_factory=dict)  # what changed, for logs and the saved manifest


@dataclass(frozen=True)
class CompileOptions:
    """Options the passes read (``treecompile.compile`` documents them).

    logits_chunk: rows of logits per chunk in the fused loss (None: the head op picks, see
        ``ops.logprobs.default_chunk``).
    allow_dropout: accept active dropout (``check_dropout``).
    entropy: ``rewrite_loss`` also outputs each token's predicting-distribution entropy.
    router_aux: ``rewrite_router_loss``'s choice for a model's router aux loss (None: refuse it).
    output_names: the captured program's flat output names (``aux_loss``, ``router_logits.0``, ...).
    """

    logits_chunk: int | None = None
    allow_dropout: bool = False
    entropy: bool = False
    router_aux: str | None = None
    output_names: tuple[str, ...] | None = None

    def get(self, name: str, default=None):
        """Read an option by name: kept for ``rewrite_loss`` until it reads ``ctx.options.logits_chunk``."""
        return getattr(self, name, default)


class PassContext:
    """Shared state of one pipeline run over one captured graph."""

    def __init__(self, gm: fx.GraphModule, input_name: str, options: CompileOptions = CompileOptions()):
        self.gm = gm
        self.graph = gm.graph
        self.options = options
        phs = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.input_node = next(n for n in phs if n.name == input_name)
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in phs if "val" in n.meta])
        self.seq_len = self.input_node.meta["val"].shape[1]  # symbolic T
        self.tree_inputs: dict[str, fx.Node] = {}
        self._num_nodes = None
        self.conv_width = None

    # ------------------------------------------------------------------ inputs
    def tree_input(self, name: str, *, width: int | None = None) -> fx.Node:
        """The placeholder for batch field ``name`` (created on first use, after the others)."""
        if name in self.tree_inputs:
            return self.tree_inputs[name]
        dtype, shape = TREE_INPUTS[name]
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        with self.graph.inserting_after(last):
            node = self.graph.placeholder(f"tree_{name}")
        with self.fake_mode:
            if shape == "T":
                node.meta["val"] = torch.empty(self.seq_len, dtype=dtype, device=self.device)
            elif shape == "N":
                node.meta["val"] = torch.empty(self._node_count(), dtype=dtype, device=self.device)
            else:
                node.meta["val"] = torch.empty(self.seq_len, width, dtype=dtype, device=self.device)
        self.tree_inputs[name] = node
        return node

    def _node_count(self):
        if self._num_nodes is None:  # the node count: a size of its own, unrelated to T
            shape_env = self.fake_mode.shape_env
            self._num_nodes = shape_env.create_unbacked_symint() if shape_env is not None else 1
        return self._num_nodes

    @property
    def device(self) -> torch.device:
        return self.input_node.meta["val"].device

    # ------------------------------------------------------------------ nodes
    def set_val(self, node: fx.Node) -> fx.Node:
        """Compute ``node.meta["val"]`` by running its target on the inputs' fake values."""
        def val(a):
            return a.meta["val"] if isinstance(a, fx.Node) else a

        args = fx.node.map_aggregate(node.args, val)
        kwargs = fx.node.map_aggregate(node.kwargs, val)
        with self.fake_mode:
            node.meta["val"] = node.target(*args, **kwargs)
        return node

    def call(self, target, args, kwargs=None, *, like: fx.Node | None = None) -> fx.Node:
        """Create ``target(*args, **kwargs)`` at the current insertion point, with meta."""
        node = self.graph.call_function(target, tuple(args), kwargs or {})
        if like is not None:
            for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if k in like.meta:
                    node.meta[k] = like.meta[k]
        return self.set_val(node)


def largest_index_literal(nodes, data=()) -> float:
    """The largest absolute number among the arguments (lists and tuples walked, bools not counted) of ``nodes``
    that may bound an index pattern (a window, an offset, a distance where a bias starts) in a mask or score
    subgraph, 0 if none: integers below ``2**31`` (``INT64_MAX`` slice ends bound nothing), finite floats below
    ``FLOAT_LITERAL_LIMIT`` (larger floats are mostly fill values and scales: -1e4, -1e9, a dtype's min), and floats
    below ``2**31`` where they are a threshold or an offset (an operand of a comparison, a clamp, an add or
    subtract, a remainder or floor division: ``position < 9000.0``).  A threshold's number counts scaled back
    through the arithmetic inside ``nodes`` that makes its operand (:func:`_shrinks`: ``position * 0.1 < 9`` is
    ``position < 90``), up to ``INDEX_BOUND_CAP`` where nothing bounds it (a square root, a logarithm).  A pattern
    at offset c first shows at length c + 2.  ``data``: nodes outside ``nodes`` that hold data, not positions (the
    scores ``q @ k^T``, a shift's input); arithmetic on them and on parameters alone scales nothing
    (``tanh(scores / 30) * 30 + 1.0`` is a soft cap and a bias, not a window)."""
    largest = 0.0

    def visit(a, threshold: bool):
        nonlocal largest
        if isinstance(a, bool):
            return
        if isinstance(a, (int, float)):
            limit = 2 ** 31 if isinstance(a, int) or threshold else FLOAT_LITERAL_LIMIT
            if abs(a) < limit:  # nan and inf fail this too
                largest = max(largest, abs(a))
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x, threshold)

    shrink = _shrinks(nodes, data)
    for n in shrink:
        name = getattr(getattr(n.target, "_schema", None), "name", "")
        threshold = name.removeprefix("aten::") in THRESHOLD_OPS
        before, largest = largest, 0.0
        numbers = [*n.args, *n.kwargs.values()]
        if threshold:  # a threshold held in a tensor: full_like(pos, 9.0), torch.tensor(9.0)
            numbers += [c for c in map(_constant, n.all_input_nodes) if c is not None]
        for a in numbers:
            visit(a, threshold)
        scale = max((shrink.get(a, 1.0) for a in n.all_input_nodes), default=1.0)
        if threshold and largest > 0:  # this node's number, as a threshold on the unscaled positions
            largest = min(largest * scale, INDEX_BOUND_CAP)
        elif threshold and math.isinf(scale) and any(_numeric(a) for a in numbers):
            largest = INDEX_BOUND_CAP  # cos(0.01 * pos) > 0: a zero after an unbounded map stands for any number
        largest = max(before, largest)
    return largest


def _numeric(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _constant(n: fx.Node):
    """The one number every entry of ``n`` holds where the graph says so without running it: a factory's fill
    (``full``, ``full_like``, ``scalar_tensor``, ``new_full``), a tensor constant or buffer of equal entries
    (``torch.tensor(0.1)``), through copies and casts; else None."""
    for _ in range(8):
        if n.op == "get_attr":
            try:
                t = _attr(n)
            except AttributeError:
                return None
            if isinstance(t, torch.Tensor) and 0 < t.numel() <= 4096 and not t.is_meta:
                try:
                    flat = t.detach().reshape(-1)
                    if bool((flat == flat[0]).all()):
                        return float(flat[0])
                except RuntimeError:  # a fake or otherwise unreadable constant: no number known
                    return None
            return None
        if n.op != "call_function":
            return None
        name = getattr(getattr(n.target, "_schema", None), "name", "").removeprefix("aten::")
        if name in ("full", "scalar_tensor", "fill"):
            a = n.args[1] if name == "fill" else n.args[0 if name == "scalar_tensor" else 1]
            return float(a) if _numeric(a) else None
        if name in ("full_like", "new_full"):  # full_like(self, fill_value), new_full(self, size, fill_value)
            i = 1 if name == "full_like" else 2
            a = n.args[i] if len(n.args) > i else None
            return float(a) if _numeric(a) else None
        if name in ("lift_fresh_copy", "clone", "_to_copy", "to", "alias", "detach", "expand", "view", "reshape",
                    "unsqueeze", "squeeze") and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
            continue
        return None
    return None


def _attr(n: fx.Node):
    obj = n.graph.owning_module
    for part in str(n.target).split("."):
        obj = getattr(obj, part)
    return obj


# what largest_index_literal's bound is, for refusals that quote it
SCALED_NOTE = ("; a number in it times what the arithmetic on the positions before it divides by, unbounded after "
               "a square root, a logarithm, an exponential or a periodic function")
# the bound largest_index_literal reports for a threshold it cannot scale back (a square root, a logarithm, an
# exponential of positions before a comparison): past every probe length, so its callers refuse the region
INDEX_BOUND_CAP = float(2 ** 31)
# ops that compress numbers by an amount no literal shows (a threshold after them stands for a larger one)
# (the exponentials too: exp(-pos) > 1e-40 is pos < 92), or whose value repeats (sin, cos: a zero stands for any
# number)
_UNBOUNDED_SHRINK = frozenset({"sqrt", "rsqrt", "log", "log2", "log10", "log1p", "reciprocal", "atan", "atan2",
                               "tanh", "sigmoid", "erf", "erfc", "erfinv", "asinh", "acosh", "atanh", "asin", "acos",
                               "cbrt", "special_expit", "exp", "exp2", "expm1", "special_exp2", "special_expm1",
                               "special_erfc", "special_erfcx", "cos", "sin", "tan", "cosh", "sinh", "sinc",
                               "special_sinc", "softplus", "logit", "special_logit"})


def _literals(n: fx.Node) -> list[float]:
    """``n``'s number arguments, and the numbers its constant tensor operands hold (``pos * full_like(pos, 0.1)``)."""
    own = [a for a in (*n.args, *n.kwargs.values()) if _numeric(a)]
    return own + [c for c in map(_constant, n.all_input_nodes) if c is not None]


def _shrinks(nodes, data=()) -> dict:
    """{node: how much the arithmetic making it inside ``nodes`` compresses the numbers it starts from}: a threshold
    c on the node stands for one up to c times this on those numbers (``pos * 0.1 < 9`` is ``pos < 90``: 10;
    ``pos // 10``, ``pos / 10``: 10; a square root or logarithm: unbounded).  Products along a chain, the largest
    over a node's inputs; nodes in graph order, so inputs come first.  A node made from ``data`` and parameters
    alone compresses nothing (1): no position reaches it."""
    region = set(nodes)
    if not region:
        return {}
    graph = next(iter(region)).graph
    out: dict = {}
    data = set(data)
    for n in graph.nodes:
        if n not in region:
            continue
        if n.all_input_nodes and all(a in data or a.op == "get_attr" for a in n.all_input_nodes):
            data.add(n)
            out[n] = 1.0
            continue
        name = getattr(getattr(n.target, "_schema", None), "name", "").removeprefix("aten::").rstrip("_")
        lits = [abs(float(a)) for a in _literals(n)]
        own = 1.0
        if name in ("mul", "multiply", "lerp", "addcmul"):  # lerp's weight, addcmul's value scale a term
            own = max([1.0 / a for a in lits if 0 < a < 1], default=1.0)
        elif name in ("div", "divide", "true_divide", "floor_divide", "addcdiv"):
            own = max([a for a in lits if a > 1] + [1.0 / a for a in lits if name == "addcdiv" and 0 < a < 1],
                      default=1.0)
        elif name.lstrip("_") in ("rshift", "bitwise_right_shift"):  # pos >> 3 is pos // 8
            shifts = [a for a in lits if a >= 0]
            own = 2.0 ** min(max(shifts), 64) if shifts else math.inf
        elif name in ("pow", "float_power"):  # a root, a power of unknown exponent, or 2 ** pos: unbounded
            own = math.inf if any(a < 1 for a in lits) or not lits or _numeric(n.args[0]) else 1.0
        elif name in _UNBOUNDED_SHRINK:
            own = math.inf
        out[n] = own * max((out.get(a, 1.0) for a in n.all_input_nodes), default=1.0)
    return out


# ops whose scalar operand places an index pattern (a threshold or an offset) whatever its size
THRESHOLD_OPS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "clamp", "clamp_min", "clamp_max", "add", "sub",
                           "rsub", "remainder", "fmod", "floor_divide", "maximum", "minimum"})


FLOAT_LITERAL_LIMIT = 8192.0


def last_row_window(allowed: torch.Tensor) -> int:
    """The keys the last query row of a ``[.., T, T]`` bool mask sees, counted back from its diagonal: T for the
    causal mask, W under a sliding window of W tokens, 0 when it sees nothing (read off the first leading slice)."""
    T = allowed.shape[-1]
    last = allowed.reshape(-1, T, T)[0, T - 1]
    return T - int(last.nonzero()[0]) if bool(last.any()) else 0


def causal_window_mask(T: int, window: int) -> torch.Tensor:
    """``[T, T]`` bool: query ``i`` sees key ``j`` iff ``i - window < j <= i`` (the causal mask when window >= T)."""
    i = torch.arange(T)
    return (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)


def ancestors(node: fx.Node) -> set:
    """``node`` and every node it reads, transitively."""
    seen, stack = {node}, [node]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen
