"""Where the token axis goes through one op: the rules ``verify_token_locality`` applies.

A tensor's *token axis* is the dim indexed by the DFS token (size ``T``, the symbolic sequence
length of ``input_ids [1, T]``).  Every rule below answers, for one op and the token axes of its
tensor inputs: does the op treat tokens independently, and which output dim carries them?  It
returns the output's token dims (a set, or a tuple of sets for tuple outputs) or raises
:class:`Mixes` with the reason.  Rules are chosen by what an op does to dims, read from its schema
and the arguments (which dims it reduces, indexes, shifts, contracts), not from model patterns:

- elementwise ops (the ``pointwise`` tag, copies/casts): dims align right to left (broadcasting);
- reshapes/views: the token dim survives iff some output dim of size T has the same row-major
  prefix product (``[1, T, H*D] -> [1, T, H, D]`` keeps it; ``[1, T, D] -> [T*D]`` does not);
- permutes, expands, squeezes, slices/selects/splits/cat/stack/pads along *other* dims; a slice
  along the token dim only when it is the full range;
- reductions (ops with a ``keepdim`` argument), scans/sorts/softmax/flip/roll (a ``dim``/``dims``
  argument), norms over the trailing dims, gathers/scatters: accepted when the token dim is not
  among the dims they act along;
- contractions (linear, matmul, einsum, conv, attention): the token dim must not be contracted,
  convolved or attended over, and at most one operand may carry it at a given output dim.
Anything not covered raises :class:`Mixes` when an input carries the token axis.  This module holds
the shared pieces and the data-movement rules; :mod:`token_axis_compute` the arithmetic ones and the
table (:func:`~treecompile.passes.token_axis_compute.rule_for`).
"""

from __future__ import annotations

import functools
import math

import sympy
import torch
from torch import fx

aten = torch.ops.aten


class Mixes(Exception):
    """The op mixes tokens (or cannot be shown not to); ``args[0]`` says how."""


# ------------------------------------------------------------------------------------------ shapes
def expr(s):
    return s.node.expr if isinstance(s, torch.SymInt) else sympy.Integer(int(s))


def same(a, b) -> bool:
    return sympy.expand(expr(a) - expr(b)) == 0


def prod(xs):
    return math.prod([expr(x) for x in xs], start=sympy.Integer(1))


def norm_dim(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def dims_arg(d, nd: int) -> list[int]:
    """A ``dim``/``dims`` argument as a list of non-negative dims; None/[] means all."""
    if d is None or (isinstance(d, (list, tuple)) and len(d) == 0):
        return list(range(nd))
    if isinstance(d, int):
        return [norm_dim(d, max(nd, 1))]
    return [norm_dim(int(x), max(nd, 1)) for x in d]


# ------------------------------------------------------------------------------------------ op sets
def _packets(*names):
    return {getattr(aten, n) for n in names if hasattr(aten, n)}


ELEMENTWISE = _packets(  # not tagged pointwise, but elementwise (casts, copies, conditionals)
    "where", "_to_copy", "to", "type_as", "contiguous", "alias", "detach", "detach_", "lift_fresh_copy",
    "copy_", "copy", "fill_", "fill", "zero_", "masked_fill", "masked_fill_", "dropout", "native_dropout",
    "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "clone", "zeros_like", "ones_like",
    "empty_like", "full_like", "_assert_tensor_metadata", "nan_to_num", "bernoulli", "rand_like", "randn_like")
# torch's aliases of pointwise ops (torch.multiply, torch.divide, torch.special.expit, ...): not tagged pointwise,
# and kept under their own names in an exported graph (HF Gemma 3n's torch.multiply, session 45)
POINTWISE_ALIASES = _packets(
    "multiply", "multiply_", "subtract", "subtract_", "divide", "divide_", "true_divide", "true_divide_",
    "floor_divide", "floor_divide_", "greater", "greater_", "greater_equal", "greater_equal_", "less", "less_",
    "less_equal", "less_equal_", "not_equal", "not_equal_", "absolute", "absolute_", "negative", "negative_",
    "arccos", "arccos_", "arcsin", "arcsin_", "arctan", "arctan_", "arctan2", "arctan2_", "arccosh", "arccosh_",
    "arcsinh", "arcsinh_", "arctanh", "arctanh_", "fix", "fix_", "clip", "clip_", "rsub", "log_sigmoid",
    "special_expit", "special_erf", "special_erfc", "special_erfinv", "special_logit", "special_exp2",
    "special_expm1", "special_log1p", "special_round", "special_sinc", "special_ndtr", "special_i0",
    "special_xlogy", "special_psi", "special_digamma", "special_gammaln")
ELEMENTWISE = ELEMENTWISE | POINTWISE_ALIASES
RANDOM = _packets("bernoulli", "rand_like", "randn_like", "randint_like", "normal", "uniform_", "normal_")
RESHAPES = _packets("view", "reshape", "_unsafe_view", "view_copy", "_reshape_alias", "flatten", "unflatten",
                    "squeeze", "squeeze_", "unsqueeze", "unsqueeze_", "reshape_as", "view_as")
COMPLEX_VIEWS = _packets("view_as_real", "view_as_complex")  # [.., n, 2] real <-> [.., n] complex
COMPLEX_ELEMENTWISE = _packets("polar", "complex", "real", "imag", "angle")  # elementwise, not tagged pointwise
PERMUTES = _packets("permute", "transpose", "t", "movedim", "swapaxes", "swapdims", "numpy_T", "mT")
SLICES = _packets("slice", "narrow", "slice_copy")
SPLITS = _packets("split", "split_with_sizes", "chunk", "unsafe_split", "unsafe_split_with_sizes",
                  "unsafe_chunk", "tensor_split", "unbind")
ALONG_DIM = _packets(  # act along `dim`/`dims`, batched over every other dim
    "softmax", "_softmax", "log_softmax", "_log_softmax", "cumsum", "cumsum_", "cumprod", "cumprod_",
    "cummax", "cummin", "logcumsumexp", "_logcumsumexp", "sort", "argsort", "topk", "flip", "roll", "glu",
    "linalg_cross", "cross", "_softmax_backward_data", "_log_softmax_backward_data")
LAST_TWO = _packets("tril", "triu", "tril_", "triu_")  # batched matrix ops on the last two dims
MATMULS = _packets("matmul", "mm", "bmm", "dot", "vdot", "mv", "addmm", "baddbmm", "addmv", "addmm_", "baddbmm_")
CONVS = _packets("convolution", "_convolution", "conv1d", "conv2d", "conv3d")
ATTENTIONS = _packets("scaled_dot_product_attention")
LAYER_NORMS = _packets("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm")
GROUP_NORMS = _packets("group_norm", "native_group_norm")
BATCH_NORMS = _packets("_native_batch_norm_legit_no_training", "batch_norm", "native_batch_norm",
                       "_native_batch_norm_legit", "_native_batch_norm_legit_functional")
PADS = _packets("constant_pad_nd", "pad", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
                "replication_pad1d", "replication_pad2d", "replication_pad3d", "_pad_circular")
# arguments an op reads only for their dtype/device/shape, never their values (they carry no token data)
SHAPE_ARGS = {p: ("self",) for p in _packets("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")}
SHAPE_ARGS.update({p: ("other",) for p in _packets("expand_as", "reshape_as", "view_as")})
UNIFORM_FACTORIES = _packets(  # values do not depend on the index: constant along every axis
    "empty", "zeros", "ones", "full", "new_empty", "new_zeros", "new_ones", "new_full", "empty_strided",
    "new_empty_strided", "scalar_tensor", "zeros_like", "ones_like", "empty_like", "full_like", "expand",
    "repeat", "expand_as", "broadcast_to")
SHAPE_ONLY = _packets("sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_assert_scalar",
                      "sym_constrain_range", "sym_constrain_range_for_size", "_assert_tensor_metadata")


def is_elementwise(op) -> bool:
    return torch.Tag.pointwise in op.tags or op.overloadpacket in ELEMENTWISE | COMPLEX_ELEMENTWISE


def bound_args(node: fx.Node) -> dict:
    """``node``'s arguments by schema name (an OpOverload target); absent ones get their default or None."""
    args = {}
    for i, a in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            args[a.name] = node.args[i]
        elif a.name in node.kwargs:
            args[a.name] = node.kwargs[a.name]
        else:
            args[a.name] = a.default_value if a.has_default_value() else None
    return args


# ------------------------------------------------------------------------------------------ rules
class Op:
    """One call: its bound arguments and the token dims of its tensor inputs."""

    def __init__(self, node: fx.Node, tok, t_dims, layout, T):
        self.node, self.op, self._tok, self.t_dims, self.layout, self.T = node, node.target, tok, t_dims, layout, T
        self.new_layout = None  # set by a rule that changes how the token dim is laid out (reshape)
        self.allow_random = False  # random values per token (allow_dropout=True)
        self.args = bound_args(node)
        self.out = node.meta.get("val")

    def tok(self, x) -> set[int]:
        return set(self._tok(x)) if isinstance(x, fx.Node) else set()

    @staticmethod
    def val(x):
        return x.meta["val"] if isinstance(x, fx.Node) else x

    def nd(self, x) -> int:
        return self.val(x).dim()

    def tensors(self) -> list[fx.Node]:
        flat = fx.node.map_aggregate(list(self.args.values()), lambda a: a)
        out = []
        fx.node.map_arg(flat, out.append)
        return [n for n in out if isinstance(n.meta.get("val"), torch.Tensor)]

    @property
    def out_nd(self) -> int:
        return self.out.dim()


def _aligned(x_nd: int, out_nd: int, dims: set[int]) -> set[int]:
    return {out_nd - x_nd + d for d in dims}


def elementwise(c: Op) -> set[int]:
    first = c.args.get("self", c.args.get("input"))
    srcs = [first] if c.op.overloadpacket in (aten.type_as,) else c.tensors()
    if c.op.overloadpacket in RANDOM and not c.allow_random and (any(c.tok(x) for x in srcs) or c.t_dims(c.out)):
        raise Mixes("draws random values per DFS position: a token shared by several paths would draw "
                    "one value for all of them (allow_dropout=True accepts that, as for dropout)")
    out = set()
    for x in srcs:
        out |= _aligned(c.nd(x), c.out_nd, c.tok(x))
    return out


# sympy.simplify is a pure function of an immutable expression and costs milliseconds a call; the
# same few shape expressions recur in every layer (and every compile), so it is memoized.
_simplify = functools.lru_cache(maxsize=4096)(sympy.simplify)


def _whole(e, T) -> bool:
    """``e`` is a positive integer that does not depend on the sequence length."""
    e = _simplify(e)
    return T.free_symbols.isdisjoint(e.free_symbols) and bool(e.is_integer) and bool(e.is_positive)


def reshape(c: Op) -> set[int]:
    """Row-major reinterpretation.  A token dim may be merged with neighbours: its layout ``(outer,
    inner)`` says the dim has size ``outer * T * inner`` with the token index ``(i // inner) % T``.
    The token survives iff some output dim holds the factor T at the same row-major place."""
    x = c.args.get("self", c.args.get("input"))
    ins, outs = list(c.val(x).shape), list(c.out.shape)
    res = set()
    for d in c.tok(x):
        outer, inner = c.layout(x)
        pre, post = prod(ins[:d]) * outer, inner * prod(ins[d + 1:])
        for j in range(len(outs)):
            o = _simplify(pre / prod(outs[:j]))
            if not _whole(o, c.T):
                continue
            i = _simplify(expr(outs[j]) / (o * c.T))
            if _whole(i, c.T) and sympy.expand(i * prod(outs[j + 1:]) - post) == 0:
                res.add(j)
                c.new_layout = (o, i)
                break
        else:
            raise Mixes(f"reshapes {list(ins)} -> {list(outs)}, cutting the sequence axis apart")
    return res


def permute(c: Op) -> set[int]:
    x = c.args["self"]
    nd = c.nd(x)
    p = c.op.overloadpacket
    order = list(range(nd))
    if p == aten.permute:
        order = [norm_dim(d, nd) for d in c.args["dims"]]
    elif p in (aten.transpose, aten.swapaxes, aten.swapdims):
        a = norm_dim(c.args.get("dim0", c.args.get("axis0", 0)), nd)
        b = norm_dim(c.args.get("dim1", c.args.get("axis1", 0)), nd)
        order[a], order[b] = order[b], order[a]
    elif p in (aten.t, aten.numpy_T):
        order = order[::-1]
    elif p == aten.mT:
        order[-1], order[-2] = order[-2], order[-1]
    else:  # movedim
        src = dims_arg(c.args["source"], nd)
        dst = dims_arg(c.args["destination"], nd)
        rest = [d for d in range(nd) if d not in src]
        order = [None] * nd
        for s, t in zip(src, dst):
            order[t] = s
        it = iter(rest)
        order = [o if o is not None else next(it) for o in order]
    return {order.index(d) for d in c.tok(x)}


def slice_(c: Op) -> set[int]:
    x = c.args.get("self", c.args.get("input"))
    d = norm_dim(c.args.get("dim", 0), c.nd(x))
    if d in c.tok(x) and not same(c.out.shape[d], c.val(x).shape[d]):
        raise Mixes("slices the sequence axis (keeps some DFS positions, e.g. a shift or the last token): "
                    "the DFS neighbour of a token is not its path neighbour")
    return c.tok(x)


def select(c: Op) -> set[int]:
    x = c.args["self"]
    d = norm_dim(c.args["dim"], c.nd(x))
    if d in c.tok(x):
        raise Mixes("reads one DFS position of the sequence (e.g. the first or last token); on a tree that "
                    "is not the same token on every path")
    return {t - (t > d) for t in c.tok(x)}


def split(c: Op):
    x = c.args["self"]
    d = norm_dim(c.args.get("dim", 0), c.nd(x))
    pieces = c.out
    if d in c.tok(x) and not (len(pieces) == 1 and same(pieces[0].shape[d], c.val(x).shape[d])):
        raise Mixes("splits the sequence axis into pieces of DFS positions")
    drop = c.op.overloadpacket == aten.unbind
    return tuple({t - (drop and t > d) for t in c.tok(x)} for _ in pieces)


def cat(c: Op) -> set[int]:
    xs = [x for x in c.args["tensors"] if isinstance(x, fx.Node)]
    stack = c.op.overloadpacket == aten.stack
    d = norm_dim(c.args.get("dim", 0), c.out_nd)
    res = set()
    for x in xs:
        t = {s + (stack and s >= d) for s in c.tok(x)}
        if d in t:
            raise Mixes("concatenates along the sequence axis (e.g. prepends padding to shift tokens)")
        res |= t
    return res


def complex_view(c: Op) -> set[int]:
    """``view_as_complex`` folds the trailing pair dim ``[.., n, 2] -> [.., n]``, ``view_as_real`` unfolds it
    (complex rotary embeddings, DeepSeek-V2): every other dim keeps its place.  The pair dim has size 2, so it is
    never the token dim."""
    return c.tok(c.args["self"])


def expand(c: Op) -> set[int]:
    """``expand``/``repeat``/``expand_as``/``broadcast_to``: broadcast to a shape (for ``expand_as``, the other
    tensor's; only its shape is read)."""
    x = c.args["self"]
    res = _aligned(c.nd(x), c.out_nd, c.tok(x))
    if c.op.overloadpacket == aten.repeat:
        reps = c.args["repeats"]
        if any(not same(reps[d], 1) for d in res):
            raise Mixes("repeats the sequence axis")
    return res


def repeat_interleave(c: Op) -> set[int]:
    """``x.repeat_interleave(n, dim)``: repeats entries along ``dim`` (e.g. GDN's k heads to v heads); a
    token's values stay its own unless ``dim`` is the token axis (then tokens are duplicated and the
    sequence grows) or ``dim`` is None (the input is flattened first)."""
    x = c.args["self"]
    t = c.tok(x)
    dim = c.args.get("dim")
    if dim is None:
        if t:
            raise Mixes("flattens the sequence axis into its repeats (repeat_interleave without dim)")
        return set()
    if norm_dim(dim, c.nd(x)) in t:
        raise Mixes("repeats tokens along the sequence axis")
    reps = c.args.get("repeats")
    if isinstance(reps, fx.Node) and c.tok(reps):
        raise Mixes("repeats counts read from the sequence")
    return t


def index_select(c: Op) -> set[int]:
    x, idx = c.args["self"], c.args["index"]
    d = norm_dim(c.args["dim"], c.nd(x))
    if d in c.tok(x):
        raise Mixes("gathers along the sequence axis with computed indices (a token reads another DFS position)")
    return c.tok(x) | ({d} if c.tok(idx) else set())


def _index_layout(c: Op, x, indices):
    """Output dims of ``x[indices]`` (advanced indexing): (dims from x, dims from the index tensors)."""
    nd = c.nd(x)
    pos = [i for i, ix in enumerate(indices) if ix is not None]
    tx = c.tok(x)
    if tx & set(pos):
        raise Mixes("indexes the sequence axis with computed indices (a token reads another DFS position)")
    bnd = max([c.nd(indices[i]) for i in pos] or [0])
    adjacent = pos == list(range(pos[0], pos[-1] + 1)) if pos else True
    start = pos[0] if (pos and adjacent) else 0
    kept = [d for d in range(nd) if d not in pos]
    mapping = {}
    for d in kept:
        before = sum(k < d for k in kept) if not adjacent else (d if d < start else d - len(pos))
        mapping[d] = before + (bnd if (not adjacent or d > start) else 0)
    res = {mapping[d] for d in tx}
    for i in pos:
        res |= {start + bnd - c.nd(indices[i]) + s for s in c.tok(indices[i])}
    return res


def index(c: Op) -> set[int]:
    return _index_layout(c, c.args["self"], list(c.args["indices"]))


def index_put(c: Op) -> set[int]:
    x, indices, values = c.args["self"], list(c.args["indices"]), c.args["values"]
    if any(ix is not None and c.tok(ix) for ix in indices):
        raise Mixes("writes at positions computed from per-token data (a scatter of tokens)")
    view = _index_layout(c, x, indices)  # token dims of x[indices], the place ``values`` broadcasts into
    n_idx = [ix for ix in indices if ix is not None]
    view_nd = c.nd(x) - len(n_idx) + max([c.nd(ix) for ix in n_idx] or [0])
    if not _aligned(c.nd(values), view_nd, c.tok(values)) <= view:
        raise Mixes("writes per-token values at positions of other tokens")
    return c.tok(x)


def gather(c: Op) -> set[int]:
    x, idx = c.args["self"], c.args["index"]
    d = norm_dim(c.args["dim"], c.nd(x))
    if d in c.tok(x):
        raise Mixes("gathers along the sequence axis with computed indices (a token reads another DFS position)")
    return c.tok(x) | c.tok(idx)


def scatter(c: Op) -> set[int]:
    x, idx = c.args["self"], c.args.get("index")
    d = norm_dim(c.args["dim"], c.nd(x))
    srcs = [s for s in (c.args.get("src"), c.args.get("source")) if isinstance(s, fx.Node)]
    rows = c.op.overloadpacket in (aten.index_add, aten.index_add_, aten.index_copy, aten.index_copy_,
                                   aten.index_fill, aten.index_fill_)
    if d in c.tok(x) or any(d in c.tok(s) for s in srcs) or (c.tok(idx) if rows else d in c.tok(idx)):
        raise Mixes("scatters along the sequence axis or into rows chosen per token (writes several tokens "
                    "into shared places)")
    res = c.tok(x) | (set() if rows else c.tok(idx))
    for s in srcs:
        res |= c.tok(s)
    return res


def embedding(c: Op) -> set[int]:
    if c.tok(c.args["weight"]):
        raise Mixes("looks up rows of a per-token table")
    return c.tok(c.args["indices"])


def one_hot(c: Op) -> set[int]:
    return c.tok(c.args["self"])


def pad(c: Op) -> set[int]:
    x = c.args.get("self", c.args.get("input"))
    nd, p = c.nd(x), list(c.args.get("pad") or c.args.get("padding"))
    for i in range(len(p) // 2):
        d = nd - 1 - i
        if d in c.tok(x) and not (same(p[2 * i], 0) and same(p[2 * i + 1], 0)):
            raise Mixes("pads along the sequence axis (shifts tokens, e.g. a token shift or a causal conv's "
                        "left padding)")
    return c.tok(x)


def unfold(c: Op) -> set[int]:
    x = c.args["self"]
    d = norm_dim(c.args["dimension"], c.nd(x))
    if d in c.tok(x):
        raise Mixes("takes sliding windows along the sequence axis")
    return c.tok(x)


def diagonal(c: Op) -> set[int]:
    x = c.args.get("self", c.args.get("input"))
    nd = c.nd(x)
    a, b = norm_dim(c.args.get("dim1", 0), nd), norm_dim(c.args.get("dim2", 1), nd)
    t = c.tok(x)
    if t & {a, b}:
        raise Mixes("reads a diagonal across the sequence axis")
    return {d - (d > a) - (d > b) for d in t}
