"""Splitting a tree into partitions of at most C tokens.

Two planners, measured against each other (metrics: :mod:`treecompile.runtime.metrics`):

**Packed partitioning** (:func:`pack`, the Tree Packing of arXiv 2511.00413).  Each partition is a
self-contained, prefix-closed sub-forest: the union of the root-to-leaf paths of a group of leaves.
It repeats the shared prefix tokens it needs, so partitions run independently with the ordinary
tree graph.  Every whole-tree token is *owned* by exactly one partition (the first, in plan order,
that contains it) and only there carries its whole-tree loss weight; elsewhere its weight is 0 (it
is computed for context only).  The sum of partition losses is then the whole-tree loss for every
normalization, loss mask and path weight, since a token's log-probability in any prefix-closed
partition equals its whole-tree one.  Cost = tokens computed = sum of partition sizes.

The heuristic is linear: traverse the radix nodes depth first, visiting children deepest subtree
first (so deep leaves are allocated first and leaves of similar depth sit next to each other), and
add leaves to the open partition while its size stays <= C.  In any DFS order of leaves the union of
a run of consecutive leaves grows by ``len(leaf) - lcp(previous leaf, leaf)``, which gives the size
without touching tokens.  Exact optima for small trees: :mod:`treecompile.runtime.optimal_partition`.

**Redundancy-free partitioning** (:func:`partition_redundancy_free`).  Partitions are disjoint and
cover every token once (ERR == POR at every budget); a path may span several partitions.  Each
partition is a group of connected pieces that all hang below one token ``h`` of an earlier
partition (or below nothing).  Its tokens attend to their ancestors outside the partition, which
are exactly the tokens from the root to ``h`` (the *boundary*, ``depth[h] + 1`` tokens, root first,
so boundary position == depth; ``h`` is the boundary's last token, ``partition.boundary_last``).
Those are fed as per-layer K/V (GDN: the recurrent state after ``h`` and the conv inputs of the
boundary's last K-1 tokens) instead of being recomputed; their gradients flow back into the earlier
partition's graph.  The partitions form a tree (parent = the partition owning ``h``);
:meth:`RedundancyFreePlan.schedule` runs forwards in pre-order and each backward after its
descendants', so the activations alive at any time are one chain of partitions.

The planner cuts heavy paths into *chunks* (partitions of one path's tokens, with partitions below
them; the chain bound may add whole subtrees hanging below them) and packs the light subtrees hanging
below each chunk's tokens first-fit decreasing (the pieces of one partition share its boundary).  What
C bounds is the plan's ``bound``: ``"chain"`` the tokens of every chain of partitions, i.e. the
activations alive at once, as a packed partition's (needs every path to fit C); ``"partition"`` each
partition, any C (a chain then holds up to ``longest path + C``).

Both plans give per-partition :class:`~treecompile.tree.TreeBatch` objects (``plan.batch(i)``, built
by :meth:`TreeBatch.from_tokens` from the whole tree: a partition's DFS order is the whole tree's
restricted to it) and the map from partition tokens to whole-tree DFS tokens (``partition.tokens``,
ascending).  Redundancy-free plans are run by :mod:`treecompile.runtime.redundancy_free`.
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass, field

import torch

from treecompile.host_values import repeat_counts
from treecompile.runtime.metrics import Reuse, reuse
from treecompile.tree import DEFAULT_CONV_KERNEL, NORMALIZATIONS, Tree, TreeBatch, ancestor_index, is_integer

__all__ = ["MODES", "PackedPartition", "PackedPlan", "pack", "RedundancyFreePartition", "RedundancyFreePlan",
           "partition_redundancy_free", "TreeShape", "check_capacity", "leaf_order", "first_fit_decreasing"]

# The partitioned training modes, each with its partitioner here (``pack``, ``partition_redundancy_free``);
# None: each tree whole (``treecompile stats`` calls it "whole").  Defined here, not in runtime/train.py,
# so that ``treecompile stats`` lists them without importing the training step (and the passes it loads).
MODES = ("packed", "redundancy_free")


# ---------------------------------------------------------------------------------------------- shape
class TreeShape:
    """Node-level view of a tree as Python lists (what the planners loop over), built once."""

    def __init__(self, tree: Tree):
        self.tree = tree
        self.start = tree.node_start.tolist()
        self.end = tree.node_end.tolist()
        self.parent = tree.node_parent.tolist()
        self.num_nodes = n = len(self.start)
        # tokens from the root through the node's first token's predecessor
        self.depth0 = tree.depth[tree.node_start].tolist()
        self.children: list[list[int]] = [[] for _ in range(n)]
        for c, p in enumerate(self.parent):
            if p >= 0:
                self.children[p].append(c)
        self.roots = [c for c, p in enumerate(self.parent) if p < 0]
        # height[n]: the longest root-to-leaf length (tokens) through n
        h = [self.depth0[i] + self.end[i] - self.start[i] for i in range(n)]
        for c in range(n - 1, -1, -1):  # children come after their parent in DFS order
            p = self.parent[c]
            if p >= 0 and h[c] > h[p]:
                h[p] = h[c]
        self.height = h

    def is_leaf(self, n: int) -> bool:
        return not self.children[n]

    def leaf_len(self, n: int) -> int:
        """Tokens on the root-to-leaf path ending at leaf node n's last token."""
        return self.depth0[n] + self.end[n] - self.start[n]

    def ancestors(self, n: int) -> list[int]:
        """n and its ancestor nodes, root first."""
        out = []
        while n >= 0:
            out.append(n)
            n = self.parent[n]
        return out[::-1]


def check_capacity(capacity) -> int:
    """``capacity`` as a Python int (numpy and 0-d tensor integers accepted); ValueError unless a positive integer."""
    if isinstance(capacity, bool) or not is_integer(capacity) or int(capacity) < 1:
        raise ValueError(f"capacity: expected a positive integer token budget, got {capacity!r}")
    return int(capacity)


def _ranges_to_index(starts: list[int], ends: list[int]) -> torch.Tensor:
    """concat(arange(s, e)) for the given ranges, vectorised (a cumsum of unit steps that jump at
    each range start; repeat_interleave is avoided: it is erratically slow on a busy CPU)."""
    s = torch.tensor(starts, dtype=torch.long)
    e = torch.tensor(ends, dtype=torch.long)
    keep = e > s
    s, e = s[keep], e[keep]
    if s.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    lens = e - s
    offs = torch.cumsum(lens, 0) - lens
    steps = torch.ones(int(offs[-1] + lens[-1]), dtype=torch.long)
    jump = s.clone()
    jump[1:] -= e[:-1] - 1
    steps[offs] = jump
    return torch.cumsum(steps, 0)


def _merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and out[-1][1] == s:
            out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


class _WeightCache:
    def __init__(self, tree: Tree):
        self.tree = tree
        self._w: dict[str, torch.Tensor] = {}

    def __call__(self, normalize: str) -> torch.Tensor:
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize: expected one of {NORMALIZATIONS}, got {normalize!r}")
        if normalize not in self._w:
            self._w[normalize] = self.tree.token_weights(normalize)
        return self._w[normalize]


def _pad(t: torch.Tensor, n: int, value) -> torch.Tensor:
    """``t`` with ``n`` rows of ``value`` appended."""
    if n == 0:
        return t
    return torch.cat([t, torch.full((n,) + tuple(t.shape[1:]), value, dtype=t.dtype)])


# --------------------------------------------------------------------------------------------- packed
@dataclass(frozen=True)
class PackedPartition:
    """One prefix-closed partition of a packed plan.

    ``tokens``: whole-tree DFS indices, ascending (= the partition batch's DFS order); ``owned``: bool
    per partition token, True where this partition carries the token's loss weight; ``leaves``:
    whole-tree DFS index of each leaf token it holds; ``nodes``: whole-tree radix nodes (all whole);
    ``paths``: ids of the paths assigned to it (those whose last token it owns; each lies in it whole).
    """

    index: int
    tokens: torch.Tensor
    owned: torch.Tensor
    leaves: torch.Tensor
    nodes: torch.Tensor
    paths: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


class _PlanCost:
    """What both plans share: their length, tokens computed, and POR/ERR."""

    def __len__(self) -> int:
        return len(self.partitions)

    @property
    def cost(self) -> int:
        """Tokens computed: the sum of partition sizes (packed: shared prefixes once per partition;
        redundancy-free: every unique token exactly once)."""
        return sum(p.num_tokens for p in self.partitions)

    def reuse(self) -> Reuse:
        return reuse(self.tree, self.cost)

    def _index(self, i) -> int:
        """Partition ``i`` checked: an integer in ``[0, len)`` (a negative index would quietly count from the end)."""
        try:
            if isinstance(i, bool):
                raise TypeError
            i = operator.index(i)  # ints, NumPy integers, one-element integer tensors
        except TypeError:
            raise TypeError(f"partition index: expected an integer, got {type(i).__name__}") from None
        if not 0 <= i < len(self.partitions):
            raise IndexError(f"partition index {i}: this plan has {len(self.partitions)} partitions (0 to "
                             f"{len(self.partitions) - 1})")
        return i

    def _whole_tree_weights(self, weights, what: str = "weights") -> torch.Tensor:
        """``weights`` given for the whole tree, checked: one finite float per whole-tree DFS token (``[T]``), as
        :meth:`TreeBatch.from_tokens` checks a batch's own; indexing them by the partition's tokens would
        otherwise take another tree's weights, or the first T of them, without a word."""
        T = self.tree.num_tokens
        w = torch.as_tensor(weights)
        if w.dtype == torch.bool or w.is_complex():
            raise ValueError(f"{what}: expected float weights, got dtype {w.dtype}")
        w = w.to(torch.float64)
        if w.dim() != 1 or w.numel() != T:
            raise ValueError(f"{what}: expected the whole tree's weights, shape [{T}] (one per DFS token of the "
                             f"plan's tree), got {tuple(w.shape)}")
        if not bool(torch.isfinite(w).all()):
            t = int(torch.nonzero(~torch.isfinite(w))[0])
            raise ValueError(f"{what}: whole-tree token {t}: not finite ({w[t].item()})")
        return w


@dataclass
class PackedPlan(_PlanCost):
    tree: Tree
    capacity: int
    partitions: list[PackedPartition]
    order: str
    _shape: TreeShape = field(repr=False, default=None)
    _weights: _WeightCache = field(repr=False, default=None)


    def leaf_paths(self, i: int) -> list[list[int]]:
        """Token ids of the root-to-leaf paths of partition i (the paths its Tree is built from)."""
        sh, ids = self._shape, self.tree.input_ids
        out = []
        for leaf in self.partitions[i].leaves.tolist():
            nodes = sh.ancestors(int(self.tree.node_id[leaf]))
            idx = _ranges_to_index([sh.start[a] for a in nodes], [sh.end[a] for a in nodes])
            out.append(ids[idx].tolist())
        return out

    def batch(self, i: int, *, normalize: str = "sum", weights: torch.Tensor | None = None,
              pad_to_multiple: int | None = None, device=None, conv_kernel: int = DEFAULT_CONV_KERNEL) -> TreeBatch:
        """Partition i as a TreeBatch (:meth:`TreeBatch.from_tokens` of its tokens): ``loss_weight`` is
        the whole tree's weight on owned tokens, 0 elsewhere; ``weights`` (whole-tree DFS ``[T]``)
        replaces the tree's own weights of ``normalize`` (e.g. a step's, ``normalization.partition_batch``).
        ``tree`` is None; ``extras``: ``tokens`` (partition token -> whole-tree DFS index), ``owned``,
        ``whole_tree`` (this plan's tree) and ``paths`` (the whole-tree paths assigned to it), which
        the objectives read (:mod:`treecompile.runtime.objectives`)."""
        w = self._weights(normalize) if weights is None else self._whole_tree_weights(weights)
        part = self.partitions[self._index(i)]
        tok = part.tokens
        lw = torch.where(part.owned, w[tok], torch.zeros((), dtype=torch.float64))
        b = TreeBatch.from_tokens(self.tree, tok, weights=lw, normalize=normalize, conv_kernel=conv_kernel,
                                  pad_to_multiple=pad_to_multiple, num_paths=part.paths.numel())
        b.extras.update(owned=part.owned, whole_tree=self.tree, paths=part.paths)
        return b.to(device) if device is not None else b

    def batches(self, **kw) -> list[TreeBatch]:
        return [self.batch(i, **kw) for i in range(len(self))]


def leaf_order(sh: TreeShape, order: str) -> tuple[list[int], list[int]]:
    """Leaf nodes in a DFS traversal, and each leaf's LCP (tokens) with the previous leaf."""
    if order not in ("deepest", "dfs"):
        raise ValueError(f"order: expected 'deepest' or 'dfs', got {order!r}")
    key = (lambda c: (-sh.height[c], c)) if order == "deepest" else (lambda c: c)
    roots = sorted(sh.roots, key=key)
    stack = roots[::-1]
    leaves, lcps = [], []
    pending = 0
    fresh = True  # the next visited node is the first after a leaf: its start depth is the LCP
    while stack:
        n = stack.pop()
        if fresh:
            pending, fresh = sh.depth0[n], False
        ch = sh.children[n]
        if not ch:
            leaves.append(n)
            lcps.append(pending)
            fresh = True
        else:
            stack.extend(sorted(ch, key=key)[::-1])
    return leaves, lcps


def pack(tree: Tree, capacity: int, *, order: str = "deepest") -> PackedPlan:
    """Packed partitioning (Tree Packing): prefix-closed partitions of at most ``capacity`` tokens.

    ``order="deepest"`` visits children deepest subtree first (the paper's heuristic); ``"dfs"`` keeps
    the tree's own child order.  Raises ValueError, naming the path, if a path is longer than C.
    """
    C = check_capacity(capacity)
    longest = int(tree.path_lengths.max())
    if longest > C:
        p = int(tree.path_lengths.argmax())
        raise ValueError(f"path {p} has {longest} tokens, more than the budget C={C}: packed partitioning "
                         f"needs every path whole in one partition (use partition_redundancy_free)")
    sh = TreeShape(tree)
    leaves, lcps = leaf_order(sh, order)
    groups: list[list[int]] = []
    run = C + 1
    for n, l in zip(leaves, lcps):
        ln = sh.leaf_len(n)
        if run + ln - l > C:  # open a new partition (the first leaf always does)
            groups.append([n])
            run = ln
        else:
            groups[-1].append(n)
            run += ln - l
    # materialise: each partition's node set = union of its leaves' ancestor chains
    mark = [-1] * sh.num_nodes
    owner = [-1] * sh.num_nodes
    node_sets = []
    for g, group in enumerate(groups):
        nodes = []
        for leaf in group:
            a = leaf
            while a >= 0 and mark[a] != g:
                mark[a] = g
                nodes.append(a)
                if owner[a] < 0:
                    owner[a] = g
                a = sh.parent[a]
        nodes.sort()
        node_sets.append(nodes)
    owner_t = torch.tensor(owner, dtype=torch.long)
    path_owner = owner_t[tree.node_id[tree.path_end]]
    path_order = torch.argsort(path_owner, stable=True)
    path_counts = torch.bincount(path_owner, minlength=len(groups)).tolist()
    path_split = path_order.split(path_counts)
    all_nodes = [a for nodes in node_sets for a in nodes]
    all_tok = _ranges_to_index([sh.start[a] for a in all_nodes], [sh.end[a] for a in all_nodes])
    sizes = [sum(sh.end[a] - sh.start[a] for a in nodes) for nodes in node_sets]
    parts = []
    for g, (nodes, tok) in enumerate(zip(node_sets, all_tok.split(sizes))):
        owned = owner_t[tree.node_id[tok]] == g
        leaf_tok = torch.tensor([sh.end[n] - 1 for n in groups[g]], dtype=torch.long)
        parts.append(PackedPartition(index=g, tokens=tok, owned=owned, leaves=leaf_tok,
                                     nodes=torch.tensor(nodes, dtype=torch.long), paths=path_split[g]))
    return PackedPlan(tree=tree, capacity=C, partitions=parts, order=order, _shape=sh,
                      _weights=_WeightCache(tree))


# ---------------------------------------------------------------------------------- redundancy-free
@dataclass(frozen=True)
class RedundancyFreePartition:
    """One partition of a redundancy-free plan.

    ``tokens``: whole-tree DFS indices, ascending; ``ranges``: the same as merged [start, end) DFS
    ranges; ``boundary_last``: the whole-tree token every piece hangs below, the last token of the
    partition's boundary (-1: below nothing, no boundary); ``parent``: the partition owning
    ``boundary_last`` (-1 for none); ``ancestors``: the partition chain from the root
    partition to the parent (all earlier in the plan); ``children``: partitions hanging below it.
    """

    index: int
    tokens: torch.Tensor
    ranges: list[tuple[int, int]]
    boundary_last: int
    parent: int
    ancestors: tuple[int, ...]
    children: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()


@dataclass
class RedundancyFreePlan(_PlanCost):
    tree: Tree
    capacity: int
    partitions: list[RedundancyFreePartition]
    bound: str = "partition"  # what capacity bounds: "chain" (every chain of partitions) or "partition"
    _shape: TreeShape = field(repr=False, default=None)
    _weights: _WeightCache = field(repr=False, default=None)
    _owner: torch.Tensor = field(repr=False, default=None)
    # whole-tree DFS loss weights [T] used by batch() instead of the normalization's (e.g. a policy
    # gradient's sum_p c_p A_p m[p,t]); set with dataclasses.replace(plan, token_weights=w)
    token_weights: torch.Tensor | None = None


    @property
    def owner(self) -> torch.Tensor:
        """[T]: the partition holding each whole-tree token."""
        return self._owner

    def boundary(self, i: int) -> torch.Tensor:
        """Whole-tree DFS indices of the tokens partition i attends to but does not hold: the
        tokens from the root to ``boundary_last``, root first (entry j has depth j).  Empty for a
        partition hanging below nothing."""
        h = self.partitions[i].boundary_last
        if h < 0:
            return torch.empty(0, dtype=torch.long)
        sh = self._shape
        nodes = sh.ancestors(int(self.tree.node_id[h]))
        ends = [sh.end[a] for a in nodes]
        ends[-1] = h + 1
        return _ranges_to_index([sh.start[a] for a in nodes], ends)

    def boundary_rows(self, i: int) -> torch.Tensor:
        """Whole-tree DFS indices of partition i's tokens that lie on a later partition's boundary
        (their per-layer K/V rows must be kept and handed on), ascending."""
        own = []
        for c in self.partitions[i].children:
            b = self.boundary(c)
            own.append(b[self._owner[b] == i])
        if not own:
            return torch.empty(0, dtype=torch.long)
        return torch.unique(torch.cat(own))

    def schedule(self) -> list[tuple[str, int]]:
        """("forward", i) / ("backward", i) events: forwards in pre-order (parents first), each
        backward once all partitions hanging below it are done.  Alive at any time: one chain."""
        events: list[tuple[str, int]] = []
        roots = [p.index for p in self.partitions if p.parent < 0]
        stack: list[tuple[int, bool]] = [(r, False) for r in reversed(roots)]
        while stack:
            i, done = stack.pop()
            if done:
                events.append(("backward", i))
                continue
            events.append(("forward", i))
            stack.append((i, True))
            stack.extend((c, False) for c in reversed(self.partitions[i].children))
        return events

    def peak_chain_tokens(self) -> int:
        """Max over partitions of the tokens held by its chain (itself and its ancestors): the
        activations alive at once under :meth:`schedule`."""
        sizes = [p.num_tokens for p in self.partitions]
        chain = [0] * len(sizes)
        for p in self.partitions:  # parents come first
            chain[p.index] = sizes[p.index] + (chain[p.parent] if p.parent >= 0 else 0)
        return max(chain)

    def batch(self, i: int, *, normalize: str = "sum", weights: torch.Tensor | None = None,
              pad_to_multiple: int | None = None, device=None, conv_kernel: int = DEFAULT_CONV_KERNEL) -> TreeBatch:
        """Partition i as a TreeBatch over its own tokens (:meth:`TreeBatch.from_tokens`); links to the
        boundary are in ``extras``.

        Token tensors index the partition's tokens (ascending whole-tree order): ``position_ids`` are
        whole-tree depths, ``pred_index``/``conv_index``/``subtree_end``/nodes are local, with -1 where
        the predecessor lies in the boundary; ``loss_weight`` is the whole-tree weight (each token is
        in exactly one partition): ``weights`` (whole-tree DFS ``[T]``) if given, else the plan's
        ``token_weights`` if set, else the tree's weights of ``normalize``.  ``tree`` is None (a
        partition is not a set of whole paths).  Padding (``pad_to_multiple``) is
        :meth:`TreeBatch.padded`'s: one extra root node.
        ``extras`` (B = boundary length = ``depth[boundary_last] + 1``, boundary position j holds
        depth j; token entries padded with -1, ``boundary_visible`` with 0):

        - ``tokens [T]``: whole-tree DFS index of each partition token;
        - ``boundary_index [B]``: whole-tree DFS indices of the boundary tokens (whose K/V are fed);
        - ``boundary_visible [T]``: token q sees boundary entries ``j < boundary_visible[q]``;
        - ``pred_boundary [T]``: boundary position of q's predecessor when it is in the boundary, else -1;
        - ``conv_boundary_index [T, K-1]``: boundary position of the j+1-th preceding token when it is
          in the boundary, else -1 (``conv_index`` holds the local ones);
        - ``node_boundary_parent [num_nodes]``: boundary position of the token a local root node hangs
          below (its GDN initial state is the recurrent state after that token), else -1.
        """
        i = self._index(i)
        if weights is not None:
            weights = self._whole_tree_weights(weights)
        elif self.token_weights is not None:
            weights = self._whole_tree_weights(self.token_weights, "token_weights")
        else:
            weights = self._weights(normalize)
        tree = self.tree
        tok = self.partitions[i].tokens
        n = tok.numel()
        # a node ends at each token a child partition hangs below (the executor hands its state on)
        lasts = torch.tensor([self.partitions[c].boundary_last for c in self.partitions[i].children],
                             dtype=torch.long)
        b = TreeBatch.from_tokens(tree, tok, weights=weights[tok], normalize=normalize, conv_kernel=conv_kernel,
                                  pad_to_multiple=pad_to_multiple, node_ends=lasts,
                                  num_paths=int((self._owner[tree.path_end] == i).sum()))
        # the context outside the partition: along a path it is the boundary, position == depth
        bnd = self.boundary(i)
        ctx = ancestor_index(tree.pred, max(conv_kernel - 1, 1), rows=tok)  # column 0: the predecessor
        g = ctx.clamp(min=0)
        ctx_bnd = torch.where((ctx >= 0) & (self._owner[g] != i), tree.depth[g], -1)
        pred_boundary = ctx_bnd[:, 0]
        # boundary entries seen: subtree_end along the boundary is non-increasing
        visible = torch.searchsorted(-tree.subtree_end[bnd], -tok, right=False) if bnd.numel() \
            else torch.zeros(n, dtype=torch.long)
        T, Nn = b.seq_len, b.num_nodes
        real_nodes = b.node_start[:Nn] < n
        node_boundary_parent = torch.full((Nn,), -1, dtype=torch.long)
        node_boundary_parent[real_nodes] = pred_boundary[b.node_start[real_nodes]]
        b.extras.update(boundary_index=bnd, boundary_visible=_pad(visible, T - n, 0),
                        pred_boundary=_pad(pred_boundary, T - n, -1),
                        conv_boundary_index=_pad(ctx_bnd[:, :conv_kernel - 1], T - n, -1),
                        node_boundary_parent=node_boundary_parent)
        return b.to(device) if device is not None else b

    def batches(self, **kw) -> list[TreeBatch]:
        return [self.batch(i, **kw) for i in range(len(self))]


def first_fit_decreasing(sizes: list[int], C: int) -> list[list[int]]:
    """Indices of items grouped into bins of total size <= C (each item <= C): items largest
    first, each into the bin with the least room that still fits it (bisect over sorted rooms)."""
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # sorted (room, bin index)
    for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        z = sizes[k]
        j = bisect.bisect_left(rooms, (z, -1))
        if j < len(rooms):
            room, b = rooms.pop(j)
            bins[b].append(k)
            bisect.insort(rooms, (room - z, b))
        else:
            bins.append([k])
            bisect.insort(rooms, (C - z, len(bins) - 1))
    return bins


RF_BOUNDS = ("auto", "chain", "partition")
# most radix nodes one chunk of a heavy path takes under ``bound="chain"`` (the extension test is linear in the
# chunk's nodes: a cap keeps planning linear in the tree on combs of one-token nodes)
CHAIN_CHUNK_NODES = 512


def partition_redundancy_free(tree: Tree, capacity: int, *, bound: str = "auto") -> RedundancyFreePlan:
    """Disjoint partitions covering every token once, in a tree of partitions run one chain at a time.

    ``bound`` says what ``capacity`` (C) bounds:

    - ``"chain"``: the tokens of every chain of partitions (a partition and its ancestors: the activations alive
      at once under :meth:`RedundancyFreePlan.schedule`), so the peak is that of a packed partition of C tokens
      (:func:`pack`) while every token is still computed once.  Needs every path to fit (C >= the longest
      path: a path's tokens all lie on one chain); a ValueError names the path otherwise.
    - ``"partition"``: the tokens of each partition, any C >= 1 (a path longer than C spans several
      partitions); the chains hold at most ``longest path + C`` tokens.
    - ``"auto"`` (default): ``"chain"`` when every path fits C, else ``"partition"``
      (``plan.bound`` says which ran).

    Both planners cut the tree into *chunks* along heavy paths (a partition of one path's tokens, with
    partitions below it; under ``"chain"`` it may also take subtrees hanging below it whole) and pack the
    light subtrees hanging below a chunk's tokens first-fit decreasing into partitions with none below them
    (:func:`_partition_bound_pieces`, :func:`_chain_bound_pieces`).
    """
    if bound not in RF_BOUNDS:
        raise ValueError(f"bound must be one of {RF_BOUNDS}, got {bound!r}")
    C = check_capacity(capacity)
    sh = TreeShape(tree)
    size = [sh.end[v] - sh.start[v] for v in range(sh.num_nodes)]
    for v in range(sh.num_nodes - 1, -1, -1):  # children come after their parent in DFS order
        p = sh.parent[v]
        if p >= 0:
            size[p] += size[v]
    sub_end = tree.node_subtree_end.tolist()
    longest = max(sh.height, default=0)
    if bound == "auto":
        bound = "chain" if longest <= C else "partition"
    if bound == "chain":
        if longest > C:
            p = int(tree.path_lengths.argmax())
            raise ValueError(f"bound='chain' needs every path to fit the budget: path {p} has {longest} tokens, "
                             f"more than C={C} (bound='partition' splits it)")
        raw = _chain_bound_pieces(sh, size, sub_end, C)
    else:
        raw = _partition_bound_pieces(tree, sh, size, sub_end, C)
    return _plan_from_pieces(tree, sh, C, bound, raw)


def _ranges_of(sh: TreeShape, sub_end: list[int], nodes: list[int]) -> list[tuple[int, int]]:
    """The DFS ranges of the subtrees rooted at ``nodes``."""
    return [(sh.start[c], sub_end[c]) for c in nodes]


def _partition_bound_pieces(tree: Tree, sh: TreeShape, size: list[int], sub_end: list[int], C: int) -> list:
    """``bound="partition"``: (boundary's last token, DFS ranges) per partition, each of <= C tokens.

    A node whose subtree holds more than C tokens is *heavy*.  Heavy nodes are split into heavy
    paths (each continues into its largest heavy child); a heavy path's tokens are cut into chunks
    of C, each a partition hanging below its first token's predecessor.  The light subtrees (<= C
    tokens, one DFS range each) hanging below a heavy node's last token (or below nothing, for light
    roots) are packed first-fit decreasing into partitions of <= C.  Light partitions have no
    partition below them, and a partition with children holds only tokens of one path, so the
    activations alive at once (a chain) are at most ``longest path + C`` tokens.
    """
    raw: list[tuple[int, list[tuple[int, int]]]] = []  # (boundary's last token, DFS ranges)

    def pack_light(last: int, light: list[int]) -> None:
        for group in first_fit_decreasing([size[c] for c in light], C):
            raw.append((last, _ranges_of(sh, sub_end, [light[k] for k in group])))

    pack_light(-1, [r for r in sh.roots if size[r] <= C])
    heads = [r for r in sh.roots if size[r] > C]  # tops of heavy paths
    while heads:
        v = heads.pop()
        chunk: list[tuple[int, int]] = []
        room = C
        last = int(tree.pred[sh.start[v]])
        while v >= 0:  # walk down the heavy path
            s, e = sh.start[v], sh.end[v]
            while s < e:
                take = min(room, e - s)
                chunk.append((s, s + take))
                s += take
                room -= take
                if room == 0:
                    raw.append((last, chunk))
                    last, chunk, room = s - 1, [], C
            heavy = [c for c in sh.children[v] if size[c] > C]
            pack_light(e - 1, [c for c in sh.children[v] if size[c] <= C])
            nxt = max(heavy, key=lambda c: (size[c], -c)) if heavy else -1
            heads.extend(c for c in heavy if c != nxt)
            v = nxt
        if chunk:
            raw.append((last, chunk))
    return raw


def _chain_bound_pieces(sh: TreeShape, size: list[int], sub_end: list[int], C: int) -> list:
    """``bound="chain"``: (boundary's last token, DFS ranges) per partition, every chain of <= C tokens
    (every path fits C).

    Children hanging below one token (or the roots, below nothing) get a *room*: C less the tokens of the
    chain above them.  Those whose subtree fits the room are packed first-fit decreasing into partitions of
    at most the room, with no partition below them.  Each other one starts a *chunk*: a partition of whole
    radix nodes down the path to its tallest leaf, whose children (the chunk's side subtrees and the
    path's continuation) hang below their parent node's last token with the room left after the chunk.
    The chunk goes on into the next node of its path while (a) every subtree left hanging still fits the
    smaller room (its longest path, so that a chain can always be found below) and (b) an estimate of the
    partitions it leaves behind does not grow: per hanging token, the light subtrees' tokens over the room
    (rounded up) plus, per subtree larger than the room, its tokens over the room.  Taking the next node
    saves the partition that would start there; it is worth it unless the smaller room splits the
    subtrees already hanging into more partitions (a wide node's children: the chunk stops above them).
    Then whole groups of subtrees hanging below one of the chunk's tokens move into the chunk where that saves
    partitions (``absorb``): a chunk may hold more than one path's tokens.  Every chain then holds at most
    C tokens: a chunk's tokens are counted in its room, and what hangs below it gets what is left.
    """
    height, depth0 = sh.height, sh.depth0
    length = [sh.end[v] - sh.start[v] for v in range(sh.num_nodes)]

    def longest(v: int) -> int:  # tokens of the longest path from v's first token down
        return height[v] - depth0[v]

    def estimate(kids: list[int], room: int) -> int:
        if not kids:
            return 0
        light = sum(size[c] for c in kids if size[c] <= room)
        return -(-light // room) + sum(-(-size[c] // room) for c in kids if size[c] > room)

    def absorb(groups: list, pieces: list, left: int) -> int:
        """Moves whole groups of subtrees hanging below one chunk token (``groups``: (token, subtree roots)) into
        the chunk (``pieces``, its DFS ranges), smallest first, where that saves partitions: the group fits the
        room ``left``, the others' longest paths still fit what is left, and the estimate of the others'
        partitions grows by less than the group's own.  Returns the room left below the chunk (``groups`` keeps
        the rest)."""
        tokens = {i: sum(size[c] for c in h) for i, (_, h) in enumerate(groups)}
        kept = set(tokens)
        for i in sorted(tokens, key=lambda i: tokens[i]):
            if tokens[i] > left:
                break
            others = [groups[j][1] for j in kept if j != i]
            room = left - tokens[i]
            if room < max((longest(c) for h in others for c in h), default=0):
                continue
            before = sum(estimate(h, left) for h in others) + estimate(groups[i][1], left)
            if sum(estimate(h, room) for h in others) >= before:
                continue
            kept.discard(i)
            pieces.extend(_ranges_of(sh, sub_end, groups[i][1]))
            left = room
        groups[:] = [g for j, g in enumerate(groups) if j in kept]
        return left

    raw: list[tuple[int, list[tuple[int, int]]]] = []
    todo: list[tuple[int, list[int], int]] = [(-1, list(sh.roots), C)]  # (hanging below token, nodes, room)
    while todo:
        last, kids, room = todo.pop()
        light = [c for c in kids if size[c] <= room]
        for group in first_fit_decreasing([size[c] for c in light], room):
            raw.append((last, _ranges_of(sh, sub_end, [light[k] for k in group])))
        for v in kids:
            if size[v] <= room:
                continue
            # a chunk from v: path nodes, and per path node the children it leaves hanging
            path, hanging = [v], []
            L, tallest = length[v], 0  # chunk tokens; longest path among the subtrees left hanging
            while len(path) < CHAIN_CHUNK_NODES:
                k = path[-1]
                if not sh.children[k]:
                    break
                nxt = max(sh.children[k], key=lambda c: (height[c], size[c], -c))
                sides = [c for c in sh.children[k] if c != nxt]
                here, there = room - L, room - L - length[nxt]
                if size[nxt] <= here:  # the path's rest fits as it is: it hangs below k with its siblings
                    break
                below = max([longest(c) for c in sh.children[nxt]] + [longest(c) for c in sides] + [tallest])
                if there < below:
                    break
                left_behind = hanging + [sides]
                if sum(estimate(h, there) for h in left_behind) > sum(estimate(h, here) for h in left_behind):
                    break
                hanging.append(sides)
                tallest = max([tallest] + [longest(c) for c in sides])
                path.append(nxt)
                L += length[nxt]
            pieces = [(sh.start[k], sh.end[k]) for k in path]
            groups = [(sh.end[k] - 1, h) for k, h in zip(path, hanging + [sh.children[path[-1]]]) if h]
            left = absorb(groups, pieces, room - L)
            raw.append((last, pieces))
            todo.extend((h_last, h, left) for h_last, h in groups)
    return raw


def _plan_from_pieces(tree: Tree, sh: TreeShape, C: int, bound: str, raw: list) -> RedundancyFreePlan:
    """The plan of the planners' (boundary's last token, DFS ranges) partitions."""
    # tokens, owners, the partition tree, then renumber in pre-order (parents first)
    T = tree.num_tokens
    rngs = [_merge_ranges(r) for _, r in raw]
    flat = [x for r in rngs for x in r]
    all_tok = _ranges_to_index([a for a, _ in flat], [b for _, b in flat])
    toks = list(all_tok.split([sum(b - a for a, b in r) for r in rngs]))
    owner = torch.full((T,), -1, dtype=torch.long)
    owner[all_tok] = repeat_counts(torch.arange(len(raw)), torch.tensor([t.numel() for t in toks], dtype=torch.long))
    lasts = [h for h, _ in raw]
    parent = [int(owner[h]) if h >= 0 else -1 for h in lasts]
    kids: list[list[int]] = [[] for _ in raw]
    for k, p in enumerate(parent):
        if p >= 0:
            kids[p].append(k)
    first = [int(t[0]) for t in toks]
    order: list[int] = []
    stack = sorted((k for k, p in enumerate(parent) if p < 0), key=lambda k: first[k], reverse=True)
    while stack:
        k = stack.pop()
        order.append(k)
        stack.extend(sorted(kids[k], key=lambda c: (lasts[c], first[c]), reverse=True))
    new = {k: i for i, k in enumerate(order)}
    parts = []
    anc: list[tuple[int, ...]] = []
    for i, k in enumerate(order):
        p = new[parent[k]] if parent[k] >= 0 else -1
        anc.append(() if p < 0 else anc[p] + (p,))
        parts.append(RedundancyFreePartition(
            index=i, tokens=toks[k], ranges=rngs[k], boundary_last=lasts[k], parent=p, ancestors=anc[i],
            children=tuple(new[c] for c in sorted(kids[k], key=lambda c: (lasts[c], first[c])))))
    remap = torch.tensor([new[k] for k in range(len(raw))], dtype=torch.long)
    return RedundancyFreePlan(tree=tree, capacity=C, partitions=parts, bound=bound, _shape=sh,
                              _weights=_WeightCache(tree), _owner=remap[owner])
