"""Trajectory trees and their DFS-serialised batches.

A :class:`Tree` merges token paths into a prefix tree with compressed (radix) nodes.  Every
trajectory counts as its own path, duplicates and prefixes of other paths included.  The tree is
stored already serialised in depth-first order, one entry per unique token.

Construction is vectorised so that 10M path tokens serialise in well under a second:

1. paths are sorted lexicographically (as bytes); in that order each path shares with its
   predecessor exactly its longest common prefix (LCP) with the whole set seen so far, and a
   depth-first pre-order of the trie is the concatenation of every path's *new* suffix
   ``path[lcp:]`` (the classic "trie size = sum(len - lcp)" identity);
2. the LCPs of sorted neighbours are computed with one vectorised comparison;
3. one Python loop over paths (not tokens) keeps the chain of segments of the current path, which
   gives each new suffix its attachment point (path predecessor) and the radix cut points;
4. nodes, subtree ends, levels, and the path -> DFS index map follow from those.

The walk serialises any *DFS leaf order* of the trie (one in which the paths through each node are contiguous),
not only the sorted one.  ``order="heavy_first"`` (the default since session 46) walks the paths a second time,
sorted by where their last tokens land in the pre-order that visits every node's children, and the roots, largest
subtree first (ties in sorted order).  Any DFS order gives the same results; this one decides how tree attention
tiles: the tokens that see a node but not its first child are its later children, so with the heavy child first
the light branches (a dropped reasoning turn, a short tool call) come last and fewer 128 x 128 tiles straddle a
mask edge (the deep-agent tree: 1,185 -> 439 partial tiles; FA4's block-sparse attention on deep agentic trees
44 -> 71 % of its causal rate on an H200, ``benchmarks/results/h200_s46``).  ``order="lex"`` keeps the sorted
order.  The cost is a second walk and a loop over the radix nodes: 1.2-1.6x the build (this CPU: 8.4M path
tokens 0.50 -> 0.63 s, 20k paths of 64 tokens 0.16 -> 0.25 s).

This module depends on nothing else in the package.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from array import array
from dataclasses import dataclass, field
from typing import Sequence

import torch

from treecompile.host_values import host_copy, remembered_host, repeat_counts, single_threaded_for, to_device_with_host

__all__ = ["Tree", "TreeBatch", "NORMALIZATIONS", "path_coefficients", "ancestor_index", "heavy_first_starts"]

NORMALIZATIONS = ("sum", "path_mean", "token_mean")
ORDERS = ("heavy_first", "lex")
DEFAULT_ORDER = "heavy_first"
DEFAULT_CONV_KERNEL = 4


# integer dtypes whose every value fits int64: a tensor or NumPy path of these is copied into the array as a block
_BLOCK_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32)


def _block_array(n: int, i: int) -> tuple[array, torch.Tensor]:
    """An ``array('q')`` of ``n`` zeros and an int64 tensor viewing it (for one copy of a whole path into it)."""
    if n == 0:
        raise ValueError(f"path {i}: empty path")
    a = array("q", bytes(8 * n))
    return a, torch.frombuffer(a, dtype=torch.int64)


def _as_int_array(p, i: int) -> array:
    """One path as an ``array('q')``; raises ValueError naming the path on bad input.  A tensor or NumPy array of
    an integer dtype that fits int64 is copied in one block (8M tokens: 0.01 s, where going through Python ints
    took 0.2 s for tensors and 0.6 s for NumPy arrays); a list or tuple, or a NumPy array of any other dtype (its
    first bad id named by position), is read by ``array`` itself; any other iterable is read into a list first."""
    if type(p) is list or type(p) is tuple:  # the common case first: no other test on the way
        pass
    elif isinstance(p, torch.Tensor):
        if p.dim() != 1:
            raise ValueError(f"path {i}: expected a 1-D sequence of token ids, got shape {tuple(p.shape)}")
        if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool:
            raise ValueError(f"path {i}: token ids must be integers, got dtype {p.dtype}")
        if p.dtype in _BLOCK_DTYPES:
            a, view = _block_array(p.numel(), i)
            view.copy_(p)
            return a
        p = p.tolist()
    elif type(p).__module__ == "numpy" and hasattr(p, "dtype") and hasattr(p, "ndim"):
        if p.ndim != 1:
            raise ValueError(f"path {i}: expected a 1-D sequence of token ids, got shape {tuple(p.shape)}")
        if p.dtype.kind == "i" or (p.dtype.kind == "u" and p.dtype.itemsize < 8):  # others: named by position below
            import numpy as np  # present: p is a NumPy array

            a, _ = _block_array(p.size, i)
            np.frombuffer(a, dtype=np.int64)[:] = p
            return a
        if p.dtype.kind == "O":  # Python objects (a bool among ints): their items, checked one by one below
            p = p.tolist()
    elif isinstance(p, (str, bytes, dict, set, frozenset)) or type(p).__name__ in ("dict_keys", "dict_values"):
        # a mapping or a set is not an ordered path (a dict's values were dropped, a set's order is its hash's)
        raise ValueError(f"path {i}: expected a sequence of token ids, got {type(p).__name__}")
    elif isinstance(p, numbers.Number):
        raise ValueError(f"path {i}: expected a sequence of token ids, got the number {p!r} (paths is a sequence "
                         "of paths: [[1, 2, 3]] for one path)")
    elif not isinstance(p, (list, tuple, range, array)):
        try:
            p = list(p)  # an iterator or another iterable: read once, then checked as a list
        except TypeError:
            raise ValueError(f"path {i}: expected a sequence of token ids, got {type(p).__name__}") from None
    if isinstance(p, (list, tuple)) and not set(map(type, p)) <= {int}:
        # anything but plain ints, checked item by item: bools are ints and array('q') would take them, as it
        # takes a bool or one-element tensor through __index__
        _refuse_non_int(p, i)
    try:
        a = array("q", p)
    except TypeError as e:  # floats, numpy bools, None, ...
        _refuse_non_int(p, i)
        raise ValueError(f"path {i}: token ids must be non-negative integers ({e})") from None
    except OverflowError as e:
        j = next((j for j, x in enumerate(p) if not -2 ** 63 <= int(x) < 2 ** 63), None)
        at = f", got {int(p[j])} at position {j}" if j is not None else ""
        raise ValueError(f"path {i}: token ids must be non-negative integers below 2**63{at} ({e})") from None
    if len(a) == 0:
        raise ValueError(f"path {i}: empty path")
    return a


def _first_outside(ids: torch.Tensor, vocab_size: int) -> int | None:
    """The first index of ``ids`` outside ``[0, vocab_size)``, or None."""
    if ids.numel() == 0:
        return None
    lo, hi = torch.aminmax(ids)
    if int(lo) >= 0 and int(hi) < vocab_size:
        return None
    return int(torch.nonzero((ids < 0) | (ids >= vocab_size))[0])


def _is_bool(x) -> bool:
    """A Python, NumPy or torch bool (an int to ``array`` and ``as_tensor``, never an id or a weight)."""
    return (isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool)
            or (type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_")))


def _refuse_non_int(p, i: int) -> None:
    """Raise ValueError naming the first id of path ``i`` that is not an integer (bools are not ids; a tensor is
    one only when it is a 0-d integer tensor)."""
    for j, x in enumerate(p):
        if isinstance(x, torch.Tensor):  # a 0-d integer tensor is an id (array takes it through __index__)
            integer = x.dim() == 0 and not (x.dtype.is_floating_point or x.is_complex())
        else:
            integer = isinstance(x, numbers.Integral)
        if _is_bool(x) or not integer:
            raise ValueError(f"path {i}: token ids must be integers, got {x!r} ({type(x).__name__}) at position {j}")


def _lcp(x: bytes, y: bytes) -> int:
    """Longest common prefix, in tokens, of two paths stored as 8-byte-per-token bytes.

    Binary search over prefix equality: each probe is one memcmp, so a pair costs O(log n) C calls.
    """
    n = min(len(x), len(y)) >> 3
    if x[:n << 3] == y[:n << 3]:
        return n
    lo, hi = 0, n  # invariant: prefixes of lo tokens agree, of hi tokens differ
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if x[:mid << 3] == y[:mid << 3]:
            lo = mid
        else:
            hi = mid
    return lo


def _walk_sorted(skeys: list[bytes]):
    """One loop over the sorted paths (not their tokens).

    For path i: its LCP with path i-1, where its new suffix starts in DFS order, the DFS index of its
    first new token's predecessor (the attachment point), where it ends, and the radix cut points.
    The stack holds the chain of segments of the current path; a segment that starts at or below the
    branch depth is not shared with the next path.
    Returns (lcp, len, start, first_pred, end_pos, cuts, T) as lists / ints.
    """
    P = len(skeys)
    lcp_l = [0] * P
    len_l = [len(k) >> 3 for k in skeys]
    start_l = [0] * P
    first_pred = [-1] * P
    end_pos = [0] * P
    cuts = []
    stack: list[int] = []
    pos = 0
    for i in range(P):
        n = len_l[i]
        l = _lcp(skeys[i - 1], skeys[i]) if i else 0
        lcp_l[i] = l
        start_l[i] = pos
        while stack and lcp_l[stack[-1]] >= l:
            stack.pop()
        if l > 0:
            o = stack[-1]
            first_pred[i] = start_l[o] + (l - 1 - lcp_l[o])
            if l < len_l[o]:
                cuts.append(start_l[o] + (l - lcp_l[o]))
        if n > l:
            end_pos[i] = pos + (n - l - 1)
            cuts.append(pos)
            stack.append(i)
            pos += n - l
        else:  # an exact duplicate of the previous path: ends where it ends
            end_pos[i] = end_pos[i - 1]
    T = pos
    return lcp_l, len_l, start_l, first_pred, end_pos, cuts, T


def _links(walk):
    """Path predecessors ``[T]`` (-1 at a root) and radix cut points ``[T]`` (bool) of a walk's DFS order."""
    lcp_l, len_l, start_l, first_pred, _, cuts, T = walk
    start = torch.tensor(start_l, dtype=torch.long)
    has_new = torch.tensor(len_l, dtype=torch.long) > torch.tensor(lcp_l, dtype=torch.long)
    pred = torch.arange(T, dtype=torch.long) - 1
    pred[start[has_new]] = torch.tensor(first_pred, dtype=torch.long)[has_new]
    is_cut = torch.zeros(T, dtype=torch.bool)
    is_cut[torch.tensor(cuts, dtype=torch.long)] = True
    return pred, is_cut


def _heavy_first_paths(order: list[int], walk) -> list[int]:
    """The paths (``order``: sorted, as the walk ``walk`` took them) in the order that serialises the same
    trie with every node's children (and the roots) visited largest subtree first, ties in ``order``'s order.

    In any DFS pre-order a path's tokens come before those of every path its last token is an ancestor of,
    and the paths through a node end inside its subtree's contiguous range; so sorting the paths by where
    their last tokens land in the heavy-first pre-order (duplicates stay adjacent) gives a path order in
    which each path shares with its predecessor its longest prefix with all earlier paths, which is what
    :func:`_walk_sorted` needs.
    """
    pred, is_cut = _links(walk)
    node_start, node_end, node_id, node_parent, _, node_subtree_end = _radix_nodes(is_cut, pred)
    new_start = heavy_first_starts(node_start, node_end, node_subtree_end, node_parent)
    ends = torch.tensor(walk[4], dtype=torch.long)
    nid = node_id[ends]
    where = new_start[nid] + ends - node_start[nid]
    return [order[i] for i in torch.sort(where, stable=True).indices.tolist()]


def heavy_first_starts(node_start: torch.Tensor, node_end: torch.Tensor, node_subtree_end: torch.Tensor,
                       node_parent: torch.Tensor) -> torch.Tensor:
    """Where each node of a DFS-ordered forest starts ``[N]`` (int64) when every node's children, and the roots,
    are visited largest subtree first, ties in the given order: the one rule behind ``Tree.from_paths(order=
    "heavy_first")`` and ``ops.tree_layout.heavy_first_order``.  Nodes in DFS order (a parent before its children),
    ``node_parent`` -1 at a root.  Host work: stable sorts plus one Python loop over the nodes."""
    N = node_start.numel()
    size = node_subtree_end - node_start
    # siblings grouped by parent, largest subtree first, ties in DFS order (stable sorts)
    by_size = torch.sort(-size, stable=True).indices
    sib = by_size[torch.sort(node_parent[by_size], stable=True).indices]
    s = size[sib]
    before = torch.cumsum(s, 0) - s  # sizes of the siblings sorted before, plus of the earlier groups
    group_start = torch.ones(N, dtype=torch.bool)
    group_start[1:] = node_parent[sib][1:] != node_parent[sib][:-1]
    first = torch.cummax(torch.where(group_start, torch.arange(N), 0), 0).values
    offset = torch.empty(N, dtype=torch.long)
    offset[sib] = before - before[first]
    new_start = offset.tolist()
    parent, length = node_parent.tolist(), (node_end - node_start).tolist()
    for n in range(N):  # a parent comes before its children in any DFS order
        p = parent[n]
        if p >= 0:
            new_start[n] += new_start[p] + length[p]
    return torch.tensor(new_start, dtype=torch.long)


def _radix_nodes(is_cut: torch.Tensor, pred: torch.Tensor):
    """Radix nodes from a cut mask ``[T]`` (True where a node starts; True at 0) and the path
    predecessors: start, end, per-token node id, parent, level, subtree end."""
    T = is_cut.numel()
    node_start = torch.nonzero(is_cut).flatten()
    Nn = node_start.numel()
    node_end = torch.empty(Nn, dtype=torch.long)
    node_end[:-1] = node_start[1:]
    node_end[-1] = T
    node_id = torch.cumsum(is_cut.long(), 0) - 1
    first_pred_node = pred[node_start]
    node_parent = torch.where(first_pred_node >= 0, node_id[first_pred_node.clamp(min=0)], -1)
    parent_l = node_parent.tolist()
    level = [0] * Nn
    sub_end = node_end.tolist()
    for n in range(Nn):
        p = parent_l[n]
        if p >= 0:
            level[n] = level[p] + 1
    for n in range(Nn - 1, -1, -1):
        p = parent_l[n]
        if p >= 0 and sub_end[n] > sub_end[p]:
            sub_end[p] = sub_end[n]
    node_subtree_end = torch.tensor(sub_end, dtype=torch.long)
    return node_start, node_end, node_id, node_parent, torch.tensor(level, dtype=torch.long), node_subtree_end


class Tree:
    """A prefix tree of token paths, stored in depth-first order.

    Build with :meth:`from_paths`.  Token-level tensors (length ``num_tokens``, DFS order):
    ``input_ids``, ``depth`` (index of the token within any path containing it), ``pred`` (DFS
    index of the previous token on the path, -1 at the root), ``node_id``, ``subtree_end``.
    ``order`` names the serialisation (``ORDERS``; module docstring).
    Node-level tensors (radix nodes, DFS order): ``node_start``, ``node_end``, ``node_parent``
    (-1 for roots), ``node_level`` (0 for roots), ``node_subtree_end``.  Path-level data, in the
    caller's path order: ``path_lengths``, ``path_offsets`` and ``path_index`` (DFS index of every
    path token), ``path_weights`` and the flat ``loss_mask``.
    """

    def __init__(self):  # use Tree.from_paths
        raise TypeError("use Tree.from_paths(paths, loss_masks=..., path_weights=...)")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_paths(
        cls,
        paths: Sequence[Sequence[int]],
        *,
        loss_masks: Sequence[Sequence[int]] | None = None,
        path_weights: Sequence[float] | None = None,
        order: str = DEFAULT_ORDER,
    ) -> "Tree":
        if isinstance(paths, (str, bytes)) or not hasattr(paths, "__len__"):
            raise ValueError("paths: expected a sequence of token-id sequences")
        if getattr(paths, "ndim", None) == 1:  # one tensor or array of ids: its items would be numbers, not paths
            raise ValueError(f"paths: got one 1-D {type(paths).__name__} of token ids; pass a sequence of paths "
                             "([ids] for one path)")
        P = len(paths)
        if P == 0:
            raise ValueError("paths: no paths given")
        arrays = [_as_int_array(p, i) for i, p in enumerate(paths)]
        lengths_list = [len(a) for a in arrays]
        keys = [a.tobytes() for a in arrays]
        del arrays
        if order not in ORDERS:
            raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
        kind = order
        order = sorted(range(P), key=keys.__getitem__)
        skeys = [keys[i] for i in order]
        walk = _walk_sorted(skeys)
        if kind == "heavy_first":
            # the paths again, in the order their last tokens take in the heavy-first pre-order: a DFS leaf
            # order of the same trie, so the same walk serialises it (module docstring)
            order = _heavy_first_paths(order, walk)
            skeys = [keys[i] for i in order]
            walk = _walk_sorted(skeys)
        del keys
        lcp_l, len_l, start_l, first_pred, end_pos, cuts, T = walk
        new_tokens = b"".join([k[l << 3:] for k, l in zip(skeys, lcp_l)])
        del skeys

        order_t = torch.tensor(order, dtype=torch.long)
        lengths = torch.tensor(lengths_list, dtype=torch.long)
        lcp = torch.tensor(lcp_l, dtype=torch.long)
        start = torch.tensor(start_l, dtype=torch.long)
        new_len = torch.tensor(len_l, dtype=torch.long) - lcp
        has_new = new_len > 0
        input_ids = torch.frombuffer(bytearray(new_tokens), dtype=torch.int64)
        depth = torch.arange(T, dtype=torch.long) - repeat_counts(start - lcp, new_len, T)
        pred, is_cut = _links(walk)
        if T and int(input_ids.min()) < 0:  # every path token is some unique token: check those
            t = int(torch.nonzero(input_ids < 0)[0])
            i = int(torch.searchsorted(start[has_new], t, right=True)) - 1
            raise ValueError(f"path {order[int(torch.nonzero(has_new)[i])]}: token ids must be "
                             f"non-negative integers (found {int(input_ids[t])} at position {int(depth[t])})")

        node_start, node_end, node_id, node_parent, node_level, node_subtree_end = _radix_nodes(is_cut, pred)

        rank = torch.empty(P, dtype=torch.long)
        rank[order_t] = torch.arange(P)
        path_offsets = torch.zeros(P + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=path_offsets[1:])

        self = object.__new__(cls)
        self.num_paths = P
        self.num_tokens = T
        self.num_path_tokens = int(path_offsets[-1])
        self.input_ids = input_ids
        self.depth = depth
        self.pred = pred
        self.node_id = node_id
        self.node_start = node_start
        self.node_end = node_end
        self.node_parent = node_parent
        self.node_level = node_level
        self.node_subtree_end = node_subtree_end
        self.subtree_end = node_subtree_end[node_id]
        self.path_lengths = lengths
        self.path_offsets = path_offsets
        self.path_end = torch.tensor(end_pos, dtype=torch.long)[rank]
        self.order = kind
        self._sorted = (lcp_l, len_l, start_l, order)
        self._path_index = None
        self._loss_mask = self._check_masks(loss_masks, lengths_list)
        self.path_weights = self._check_weights(path_weights, P)
        return self

    @classmethod
    def merge(cls, trees: Sequence["Tree"]) -> "Tree":
        """One tree holding every path of ``trees``, in order (their loss masks and path weights too).

        A batch of several trees: a forest, where prefixes that several trees share (a common
        system prompt) are stored once.  Per-path quantities are unchanged, so any per-path loss of
        the merged tree is the sum of those of the parts.  It is serialised in the parts' ``order`` when
        they agree, else in the default order (the order changes no result).
        """
        trees = list(trees)
        if not trees:
            raise ValueError("Tree.merge: no trees given")
        paths = [t.path(p) for t in trees for p in range(t.num_paths)]
        masks = None
        if not all(t.has_default_masks for t in trees):
            masks = [m for t in trees for m in t.loss_mask.split(t.path_lengths.tolist())]
        weights = torch.cat([t.path_weights for t in trees])
        orders = {t.order for t in trees}
        return cls.from_paths(paths, loss_masks=masks, path_weights=weights,
                              order=orders.pop() if len(orders) == 1 else DEFAULT_ORDER)

    @property
    def path_index(self) -> torch.Tensor:
        """DFS index of every path token, paths in the caller's order, flattened (cached).

        Built from the sorted order: a path's first ``lcp`` entries are its sorted neighbour's,
        the rest are its own new suffix; slices are copied with ``array`` (memcpy), not per token.
        """
        if self._path_index is None:
            lcp_l, len_l, start_l, order = self._sorted
            P = len(len_l)
            idx = array("q", bytes(8 * self.num_path_tokens))
            s_off = [0] * (P + 1)
            for i in range(P):
                o, l, n = s_off[i], lcp_l[i], len_l[i]
                s_off[i + 1] = o + n
                if l:  # shared with the previous sorted path
                    idx[o:o + l] = idx[s_off[i - 1]:s_off[i - 1] + l]
                if n > l:
                    idx[o + l:o + n] = array("q", range(start_l[i], start_l[i] + n - l))
            raw = idx.tobytes()
            rank = [0] * P
            for i, p in enumerate(order):
                rank[p] = i
            joined = b"".join([raw[8 * s_off[r]:8 * s_off[r + 1]] for r in rank])
            self._path_index = torch.frombuffer(bytearray(joined), dtype=torch.int64)
        return self._path_index

    @staticmethod
    def _check_masks(loss_masks, lengths_list) -> torch.Tensor | None:
        P = len(lengths_list)
        if loss_masks is None:
            return None
        if len(loss_masks) != P:
            raise ValueError(f"loss_masks: expected {P} masks (one per path), got {len(loss_masks)}")
        parts = []
        for i, (mk, n) in enumerate(zip(loss_masks, lengths_list)):
            if mk is None or isinstance(mk, (str, bytes)):
                raise ValueError(f"path {i}: loss mask must be a sequence of 0/1 or bools, got {type(mk).__name__}")
            try:
                t = torch.as_tensor(mk)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"path {i}: loss mask must be a sequence of 0/1 or bools ({e})") from None
            if t.dim() != 1:
                raise ValueError(f"path {i}: loss mask must be one flat sequence, got shape {tuple(t.shape)}")
            if t.numel() != n:
                raise ValueError(f"path {i}: loss mask has {t.numel()} entries, the path has {n} tokens")
            if t.dtype.is_floating_point or t.dtype.is_complex:
                raise ValueError(f"path {i}: loss mask must be 0/1 or bool, got dtype {t.dtype}")
            if t.dtype != torch.bool:
                if bool(((t != 0) & (t != 1)).any()):
                    raise ValueError(f"path {i}: loss mask must hold only 0 and 1")
                t = t != 0
            if bool(t[0]):
                raise ValueError(f"path {i}: loss mask trains token 0, which nothing predicts; set it to 0")
            parts.append(t)
        return torch.cat(parts)

    @staticmethod
    def _check_weights(path_weights, P) -> torch.Tensor:
        if path_weights is None:
            return torch.ones(P, dtype=torch.float64)
        if len(path_weights) != P:
            raise ValueError(f"path_weights: expected {P} weights (one per path), got {len(path_weights)}")
        for i, x in enumerate(path_weights):
            if _is_bool(x):
                raise ValueError(f"path {i}: path weight {x!r} is a bool, not a number")
        try:
            w = torch.as_tensor(path_weights, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ValueError(f"path_weights: expected finite numbers, one per path ({type(e).__name__}: {e})") from None
        if w.dim() > 1 and w.numel() != P:  # [P, k] (a list per path): not one number per path
            raise ValueError(f"path_weights: expected one number per path ({P}), got shape {tuple(w.shape)}")
        w = w.flatten()
        bad = torch.nonzero(~torch.isfinite(w)).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"path {i}: path weight is not finite ({w[i].item()})")
        return w

    def check_ids(self, vocab_size: int | None) -> None:
        """Raise ValueError naming the path and position of a token id outside ``[0, vocab_size)`` (None: none)."""
        t = None if vocab_size is None else _first_outside(self.input_ids, vocab_size)
        if t is not None:
            p, i = self.token_position(t)
            raise ValueError(f"path {p}, position {i}: token id {int(self.input_ids[t])} is outside the model's "
                             f"vocabulary [0, {vocab_size})")

    # ------------------------------------------------------------------ statistics
    @property
    def por(self) -> float:
        """Prefix overlap ratio: 1 - unique tokens / path tokens."""
        return 1.0 - self.num_tokens / self.num_path_tokens

    @property
    def num_nodes(self) -> int:
        return self.node_start.numel()

    def path(self, p: int) -> list[int]:
        """Token ids of path ``p`` (read back from the tree)."""
        s, e = int(self.path_offsets[p]), int(self.path_offsets[p + 1])
        return self.input_ids[self.path_index[s:e]].tolist()

    def token_position(self, t: int) -> tuple[int, int]:
        """DFS token ``t`` -> (path, position) of its first path (the one error messages name)."""
        return self.locate(int(torch.nonzero(self.path_index == t)[0]))

    def locate(self, j: int) -> tuple[int, int]:
        """Path token ``j`` (an index into the paths laid end to end, as ``path_index``) -> (path, position)."""
        p = int(torch.searchsorted(self.path_offsets, j, right=True)) - 1
        return p, j - int(self.path_offsets[p])

    def __repr__(self) -> str:
        return (f"Tree(num_paths={self.num_paths}, num_tokens={self.num_tokens}, "
                f"num_path_tokens={self.num_path_tokens}, num_nodes={self.num_nodes}, por={self.por:.3f})")

    # ------------------------------------------------------------------ weights
    @property
    def has_default_masks(self) -> bool:
        return self._loss_mask is None

    @property
    def loss_mask(self) -> torch.Tensor:
        """Flat bool mask over path tokens (caller's path order)."""
        if self._loss_mask is None:
            m = torch.ones(self.num_path_tokens, dtype=torch.bool)
            m[self.path_offsets[:-1]] = False
            return m
        return self._loss_mask

    def trained_counts(self) -> torch.Tensor:
        """Number of trained tokens of each path (float64)."""
        if self._loss_mask is None:
            return (self.path_lengths - 1).to(torch.float64)
        seg = repeat_counts(torch.arange(self.num_paths), self.path_lengths)
        return torch.zeros(self.num_paths, dtype=torch.float64).index_add_(
            0, seg, self._loss_mask.to(torch.float64))

    def path_coefficients(self, normalize: str) -> torch.Tensor:
        """Per-path factor that multiplies ``mask * log p`` in the loss of ``normalize`` (this tree
        alone; :func:`path_coefficients` is the formula)."""
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize: expected one of {NORMALIZATIONS}, got {normalize!r}")
        counts = None if normalize == "sum" else self.trained_counts()
        return path_coefficients(normalize, self.path_weights, num_paths=self.num_paths, trained_counts=counts,
                                 num_trained=None if counts is None else counts.sum())

    def aggregate(self, per_path: torch.Tensor, per_token: torch.Tensor | None = None) -> torch.Tensor:
        """sum over paths p through t of per_path[p] * per_token[p, t], for each unique token t.

        ``per_token`` is flat over path tokens (caller's order); None means the loss mask.
        With the default mask this needs no per-path-token work: a token's paths are the path
        ends inside its subtree, the DFS range ``[t, subtree_end[t])`` (depth-0 tokens, untrained
        by default, get 0).  Those range sums add only the token's own paths' values
        (:func:`_range_sums`); a difference of prefix sums would not: its rounding is relative to
        every path ending before the range, e.g. ``(1.5 + 3e-136) - 1.5 == 0`` dropped a path.
        """
        per_path = per_path.to(torch.float64)
        if per_token is None and self._loss_mask is None:
            # ranges over the distinct path ends only: token t sums ends[lo[t]:hi[t]]; runs of
            # tokens with the same (lo, hi) (at most nodes + paths of them) are summed once
            pos, which = torch.unique(self.path_end, return_inverse=True)
            ends = torch.zeros(pos.numel(), dtype=torch.float64).index_add_(0, which, per_path)
            lo = torch.searchsorted(pos, torch.arange(self.num_tokens))
            hi = torch.searchsorted(pos, self.subtree_end)
            new_run = torch.ones(self.num_tokens, dtype=torch.bool)
            new_run[1:] = (lo[1:] != lo[:-1]) | (hi[1:] != hi[:-1])
            first = torch.nonzero(new_run).flatten()
            w = _range_sums(ends, lo[first], hi[first])[torch.cumsum(new_run.long(), 0) - 1]
            return torch.where(self.depth > 0, w, torch.zeros_like(w))
        if per_token is None:
            per_token = self._loss_mask
        per = repeat_counts(per_path, self.path_lengths) * per_token.to(torch.float64)
        return torch.zeros(self.num_tokens, dtype=torch.float64).index_add_(0, self.path_index, per)

    def token_weights(self, normalize: str = "sum") -> torch.Tensor:
        """w(t) = sum over paths p through t of coef_p * mask[p, t], in DFS order (float64)."""
        return self.aggregate(self.path_coefficients(normalize))

    # ------------------------------------------------------------------ batch
    def to_batch(self, *, normalize: str = "sum", weights: torch.Tensor | None = None,
                 pad_to_multiple: int | None = None, device=None,
                 conv_kernel: int = DEFAULT_CONV_KERNEL) -> "TreeBatch":
        """DFS-serialised tensors for one forward/backward pass over the whole tree.

        ``weights``: the loss weight of every token ``[num_tokens]`` (float64, DFS order), e.g. a
        step's global normalization; None: :meth:`token_weights` of ``normalize``, which names them.
        """
        return TreeBatch.from_tokens(self, None, weights=weights, normalize=normalize,
                                     pad_to_multiple=pad_to_multiple, device=device, conv_kernel=conv_kernel)


def is_integer(x) -> bool:
    """An int of any kind (Python, numpy, a 0-d integer tensor), not a float that happens to be whole."""
    import numbers

    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.dtype.is_floating_point and not x.dtype.is_complex and x.dtype != torch.bool
    return isinstance(x, numbers.Integral)


def path_coefficients(normalize: str, path_weights: torch.Tensor, *, num_paths: int,
                      trained_counts: torch.Tensor | None = None, num_trained=None) -> torch.Tensor:
    """The per-path loss coefficient ``c_p`` (float64 ``[P]``): the one formula every caller uses.

    ``sum``: ``w_p / N``; ``path_mean``: ``w_p / (N * trained_p)`` (0 for a path with no trained
    token); ``token_mean``: ``w_p / num_trained`` (0 when nothing is trained).  ``num_paths`` (N)
    and ``num_trained`` count the paths / trained tokens of the whole loss (one tree, or a step of
    several); ``trained_counts [P]`` are these paths' own counts (needed for ``path_mean``).
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize: expected one of {NORMALIZATIONS}, got {normalize!r}")
    c = path_weights
    if normalize == "sum":
        return c / num_paths
    if normalize == "path_mean":
        return torch.where(trained_counts > 0, c / (num_paths * trained_counts.clamp(min=1)), torch.zeros_like(c))
    return c / num_trained if num_trained > 0 else torch.zeros_like(c)


def _range_sums(values: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``sum(values[s:e])`` for every pair of ``starts``/``ends`` (same shape), vectorised.

    A bottom-up segment tree over power-of-two aligned blocks (each block the pairwise sum of its
    halves): a range is the disjoint union of at most two blocks per level, so each result adds
    only values inside its own range, and its rounding error is relative to the sum of their
    magnitudes (``cumsum[e] - cumsum[s]`` is relative to everything before ``s`` as well).
    """
    out = torch.zeros(starts.shape, dtype=values.dtype)
    lo, hi = starts.clone(), ends.clone()  # half-open block ranges at the current level
    level = values
    while bool((lo < hi).any()):
        last = max(level.numel() - 1, 0)
        take = (lo < hi) & (lo % 2 == 1)  # a left edge that is a right child: add it, step right
        out += torch.where(take, level[lo.clamp(max=last)], 0.0)
        lo = lo + take.long()
        take = (lo < hi) & (hi % 2 == 1)  # a right edge that is a right child: step left, add it
        hi = hi - take.long()
        out += torch.where(take, level[hi.clamp(max=last)], 0.0)
        lo, hi = lo // 2, hi // 2
        if level.numel() % 2:
            level = torch.cat([level, level.new_zeros(1)])
        level = level[0::2] + level[1::2]
    return out


def ancestor_index(pred: torch.Tensor, n: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, n]``: column j is the (j+1)-th preceding token along the path (-1 where none).

    ``rows``: only those tokens' rows (``[len(rows), n]``, indices still into ``pred``).
    """
    cols = []
    c = pred if rows is None else pred[rows]
    for _ in range(n):
        cols.append(c)
        c = torch.where(c >= 0, pred[c.clamp(min=0)], c)
    if not cols:
        return pred.new_empty((c.numel(), 0))
    return torch.stack(cols, 1)


def _to_local(tokens: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Whole-tree DFS indices ``g`` (any shape, -1 allowed) -> positions in the ascending ``tokens``,
    -1 where ``g`` is not one of them."""
    n = tokens.numel()
    pos = torch.searchsorted(tokens, g.clamp(min=0))
    inside = (g >= 0) & (pos < n)
    inside &= tokens[pos.clamp(max=n - 1)] == g
    return torch.where(inside, pos, -1)


_TENSOR_FIELDS = ("input_ids", "position_ids", "pred_index", "loss_weight", "subtree_end", "node_id",
                  "node_start", "node_end", "node_parent", "node_level", "conv_index")


@dataclass
class TreeBatch:
    """One DFS-serialised tree (or partition), each token once; ``T`` = padded length.

    Token tensors ``[T]``: ``input_ids``, ``position_ids`` (depth on the path), ``pred_index`` (DFS
    index of the path predecessor, -1 at a root and at padding), ``loss_weight`` (float64; the loss
    is ``-(loss_weight * logprobs).sum()``), ``subtree_end`` (token q sees key k iff
    ``k <= q < subtree_end[k]``), ``node_id``; ``conv_index [T, K-1]`` (the K-1 preceding tokens along
    the path, nearest first, -1 where none).  Node tensors ``[num_nodes]``: ``node_start``,
    ``node_end``, ``node_parent`` (-1 for roots), ``node_level``.  Padding tokens carry zero weight,
    position 0, no predecessor, and see only themselves (together they form one extra root node).
    ``tree`` is the CPU :class:`Tree` that was serialised (path bookkeeping for ``path_logprobs``);
    None for a partition (a subset of a tree's tokens, :meth:`from_tokens`), whose ``extras["tokens"]``
    maps its tokens to the whole tree's DFS indices.  Built by :meth:`from_tokens` (``Tree.to_batch``
    and the partition planners call it).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pred_index: torch.Tensor
    loss_weight: torch.Tensor
    subtree_end: torch.Tensor
    node_id: torch.Tensor
    node_start: torch.Tensor
    node_end: torch.Tensor
    node_parent: torch.Tensor
    node_level: torch.Tensor
    conv_index: torch.Tensor
    tree: Tree | None  # the (CPU) tree this batch serialises (None: a partition); path bookkeeping
    num_tokens: int  # real (unpadded) tokens
    num_paths: int
    normalize: str
    extras: dict = field(default_factory=dict)

    @property
    def seq_len(self) -> int:
        return self.input_ids.numel()

    @property
    def num_nodes(self) -> int:
        return self.node_start.numel()

    @classmethod
    @single_threaded_for(lambda cls, tree, *a, **k: tree.num_tokens)  # per-step host work (host_values)
    def from_tokens(cls, tree: Tree, tokens: torch.Tensor | None, *, weights: torch.Tensor | None = None,
                    normalize: str = "sum", conv_kernel: int = DEFAULT_CONV_KERNEL,
                    pad_to_multiple: int | None = None, device=None, num_paths: int | None = None,
                    node_ends: torch.Tensor | None = None) -> "TreeBatch":
        """The one batch builder: ``tree`` restricted to ``tokens`` (whole-tree DFS indices, ascending;
        None: every token), serialised in the whole tree's DFS order.

        ``weights``: loss weight per batch token ``[len(tokens)]`` (float64); None: the tree's
        :meth:`Tree.token_weights` of ``normalize`` on those tokens.  ``normalize`` names what the
        weights are.  For a subset, links that leave it are cut: ``pred_index``/``conv_index`` are -1
        where the path predecessor lies outside (the caller feeds that context, e.g. a redundancy-free
        boundary); radix nodes are the subset's own (a node runs along a path while each token has
        exactly one child in the subset: a prefix-closed subset gets the nodes of the tree of its
        paths), and also end after every whole-tree token in ``node_ends`` (e.g. where a later
        partition starts from the recurrent state); ``tree`` is None (the batch is not a set of
        whole paths; ``extras["tokens"]`` maps back) and ``num_paths`` is the caller's count.
        Padding: :meth:`padded`.
        """
        if pad_to_multiple is not None and (isinstance(pad_to_multiple, bool) or not is_integer(pad_to_multiple)
                                            or int(pad_to_multiple) < 1):
            raise ValueError(f"pad_to_multiple: expected a positive integer, got {pad_to_multiple!r}")
        if isinstance(conv_kernel, bool) or not is_integer(conv_kernel) or int(conv_kernel) < 1:
            raise ValueError(f"conv_kernel: expected a positive integer (the causal conv's width), got "
                             f"{conv_kernel!r}")
        if tokens is not None and (tokens.dim() != 1 or tokens.numel() == 0 or tokens.dtype != torch.long
                                   or bool((tokens[1:] <= tokens[:-1]).any()) or int(tokens[0]) < 0
                                   or int(tokens[-1]) >= tree.num_tokens):
            raise ValueError("tokens: expected ascending, distinct whole-tree DFS indices (int64, at least one)")
        if weights is None:
            weights = tree.token_weights(normalize)
            if tokens is not None:
                weights = weights[tokens]
        elif normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize: expected one of {NORMALIZATIONS}, got {normalize!r}")
        n = tree.num_tokens if tokens is None else tokens.numel()
        weights = torch.as_tensor(weights, dtype=torch.float64)
        if weights.dim() != 1 or weights.numel() != n:
            raise ValueError(f"weights: expected shape [{n}] (one per batch token), got {tuple(weights.shape)}")
        if not bool(torch.isfinite(weights).all()):
            i = int(torch.nonzero(~torch.isfinite(weights))[0])
            raise ValueError(f"weights: batch token {i}: not finite ({weights[i].item()})")
        if tokens is None:
            batch = cls(input_ids=tree.input_ids, position_ids=tree.depth, pred_index=tree.pred, loss_weight=weights,
                        subtree_end=tree.subtree_end, node_id=tree.node_id, node_start=tree.node_start,
                        node_end=tree.node_end, node_parent=tree.node_parent, node_level=tree.node_level,
                        conv_index=ancestor_index(tree.pred, conv_kernel - 1), tree=tree, num_tokens=n,
                        num_paths=tree.num_paths if num_paths is None else num_paths, normalize=normalize)
        else:
            tok = tokens
            pred = _to_local(tok, tree.pred[tok])
            ar = torch.arange(n, dtype=torch.long)
            # radix nodes of the subset: token j continues j-1's node iff j-1 is its predecessor, has no
            # other child in the subset, and is not in node_ends
            children = torch.zeros(n + 1, dtype=torch.long).index_add_(0, pred + 1, torch.ones_like(pred))[1:]
            keep_end = torch.zeros(n, dtype=torch.bool)
            if node_ends is not None:
                e = _to_local(tok, torch.as_tensor(node_ends, dtype=torch.long).flatten())
                keep_end[e[e >= 0]] = True
            prev = (ar - 1).clamp(min=0)
            is_cut = (pred < 0) | (pred != ar - 1) | (children[prev] != 1) | keep_end[prev]
            node_start, node_end, node_id, node_parent, node_level, _ = _radix_nodes(is_cut, pred)
            batch = cls(input_ids=tree.input_ids[tok], position_ids=tree.depth[tok], pred_index=pred,
                        loss_weight=weights, subtree_end=torch.searchsorted(tok, tree.subtree_end[tok]),
                        node_id=node_id, node_start=node_start, node_end=node_end, node_parent=node_parent,
                        node_level=node_level,
                        conv_index=_to_local(tok, ancestor_index(tree.pred, conv_kernel - 1, rows=tok)),
                        tree=None, num_tokens=n, num_paths=0 if num_paths is None else num_paths,
                        normalize=normalize, extras={"tokens": tok})
        if pad_to_multiple is not None:
            batch = batch.padded(math.ceil(n / pad_to_multiple) * pad_to_multiple)
        return batch.to(device) if device is not None else batch

    @single_threaded_for(lambda self, length: length)
    def padded(self, length: int) -> "TreeBatch":
        """This batch with padding tokens appended up to ``length`` tokens.

        A padding token has id 0, position 0, zero weight, no predecessor or conv context, and
        ``subtree_end = t + 1``: in attention it sees only itself and nothing sees it.  All padding
        tokens form one extra root node (level 0), so that a varlen GDN call gets one segment for
        them, not one per token; no real token descends from it, so no state leaks into real tokens.
        """
        T = self.seq_len
        if length < T:
            raise ValueError(f"padded: length {length} is shorter than the batch ({T} tokens)")
        n = length - T
        if n == 0:
            return self
        dev = self.input_ids.device
        if dev.type != "cpu":
            # a batch moved by :meth:`to` pads its host values and moves them: the plans read the padded batch's
            # tree tensors on the host (host_values.host_copy), so they must have host values too
            host = [remembered_host(getattr(self, f)) for f in _TENSOR_FIELDS]
            if all(h is not None for h in host):
                return dataclasses.replace(self, **dict(zip(_TENSOR_FIELDS, host))).padded(length).to(dev)
        ar = torch.arange(T, length, dtype=torch.long, device=dev)
        zeros = torch.zeros(n, dtype=torch.long, device=dev)
        neg = torch.full((n,), -1, dtype=torch.long, device=dev)
        Nn = self.num_nodes
        return dataclasses.replace(
            self,
            input_ids=torch.cat([self.input_ids, zeros]),
            position_ids=torch.cat([self.position_ids, zeros]),
            pred_index=torch.cat([self.pred_index, neg]),
            loss_weight=torch.cat([self.loss_weight, self.loss_weight.new_zeros(n)]),
            subtree_end=torch.cat([self.subtree_end, ar + 1]),
            node_id=torch.cat([self.node_id, torch.full((n,), Nn, dtype=torch.long, device=dev)]),
            # new_full, not new_tensor: a list copied to a CUDA tensor is a blocking copy that waits for the GPU
            node_start=torch.cat([self.node_start, self.node_start.new_full((1,), T)]),
            node_end=torch.cat([self.node_end, self.node_end.new_full((1,), length)]),
            node_parent=torch.cat([self.node_parent, self.node_parent.new_full((1,), -1)]),
            node_level=torch.cat([self.node_level, self.node_level.new_full((1,), 0)]),
            conv_index=torch.cat([self.conv_index, self.conv_index.new_full((n, self.conv_index.shape[1]), -1)]),
        )

    def to(self, device) -> "TreeBatch":
        """This batch on ``device``.  From the host: copies that do not block the host, and the tree tensors'
        host values remembered (:func:`treecompile.host_values.to_device_with_host`), so that the plans
        built from them mid-step read no device tensor back (that would wait for the GPU's queue)."""
        kw = {f: to_device_with_host(getattr(self, f), device) for f in _TENSOR_FIELDS}
        # the extras too (a partition's boundary tables): a blocking copy would wait for the GPU's queue
        extras = {k: (to_device_with_host(v, device) if isinstance(v, torch.Tensor) else v)
                  for k, v in self.extras.items()}
        return TreeBatch(**kw, tree=self.tree, num_tokens=self.num_tokens, num_paths=self.num_paths,
                         normalize=self.normalize, extras=extras)

    @single_threaded_for(lambda self, vocab_size: self.seq_len)
    def check_ids(self, vocab_size: int | None) -> None:
        """Raise ValueError naming the path and position of a token id outside ``[0, vocab_size)``.

        Reads the CPU tree's ids when the batch has a tree, else :func:`~treecompile.host_values.host_copy` of its
        ids (a partition's batch moved by :meth:`to`: the remembered host values, no wait for the GPU's queue before
        each partition).  ``None`` checks nothing.
        """
        if vocab_size is None:
            return
        # the batch's own ids (an edited or replaced input_ids is what the graph reads), from the host values
        ids = host_copy(self.input_ids).reshape(-1)[: self.num_tokens]
        t = _first_outside(ids, vocab_size)
        if t is None:
            return
        what = f"token id {int(ids[t])} is outside the model's vocabulary [0, {vocab_size})"
        tree, part = self.tree, ""
        if tree is None or t >= tree.num_tokens:  # a partition: its token t is the whole tree's DFS token tokens[t]
            whole, tokens = self.extras.get("whole_tree"), self.extras.get("tokens")
            if whole is None or tokens is None or t >= len(tokens):
                raise ValueError(f"DFS token {t} of this partition batch: {what}")
            tree, part, t = whole, f" (token {t} of this partition)", int(tokens[t])
        p, i = tree.token_position(t)
        raise ValueError(f"path {p}, position {i}{part}: {what}")

    def path_logprobs(self, logprobs: torch.Tensor) -> list[torch.Tensor]:
        """Per-token DFS tensor ``[T]`` -> one tensor per path (path order); differentiable."""
        if self.tree is None:
            raise ValueError("path_logprobs: this batch is a partition (no tree of whole paths); map "
                             "extras['tokens'] into the whole tree's DFS order instead")
        if logprobs.dim() != 1 or logprobs.numel() != self.seq_len:
            raise ValueError(f"logprobs: expected shape [{self.seq_len}], got {tuple(logprobs.shape)}")
        idx = self.tree.path_index.to(logprobs.device)
        return list(logprobs[idx].split(self.tree.path_lengths.tolist()))
