"""Trajectory JSONL -> trees, streamed, one tree at a time: the one reader of the format
(training and ``treecompile stats`` both use it).

One JSON object per line (blank lines are skipped; everything else is a trajectory = one path):

=================  ========================  ================================================
key                type                      meaning
=================  ========================  ================================================
``tree_id``        string or integer         required; lines with the same id form one tree
``input_ids``      list of ints >= 0         required, non-empty; the whole path, prompt included
``loss_mask``      list of 0/1 (or bools)    optional, one per token; entry 0 must be 0 (nothing
                                             predicts a path's first token); default: all but 0
``advantage``      finite number             optional per-path advantage (RL objectives)
``reward``         finite number             optional per-path reward (see ``grpo_advantages``)
``weight``         finite number             optional per-path weight ``c_p``; default 1
``old_logprobs``   list of numbers / null    optional, one per token: log p_old(token i | prefix)
``ref_logprobs``   list of numbers / null    optional, one per token: log p_ref(token i | prefix)
``meta``           any JSON                  optional, kept verbatim, never interpreted
=================  ========================  ================================================

Rules (each violation is a ValueError ``"<file>:<line>: <what>"``; nothing is dropped or truncated):

- Any other key is an error (a typo such as ``loss_masks`` would otherwise train every token).
  ``group_id`` is not an alias of ``tree_id`` (one name for one thing); its error says to rename it.
  A key given twice in one object is an error (JSON parsers keep the last one silently).  ``null`` is an
  error for every key but entries of ``old_logprobs``/``ref_logprobs`` (omit a key to take its default).
- ``NaN``/``Infinity`` literals and numbers that overflow to infinity are errors; so are bools
  where numbers or ids are expected, and floats in ``input_ids``.
- Per-token lists must have exactly ``len(input_ids)`` entries.  ``old_logprobs`` and
  ``ref_logprobs`` are *read only at trained tokens* (loss mask 1); an entry may be ``null`` where
  the mask is 0 (prompt tokens, entry 0), and values there are checked for finiteness but unused.
- Within one tree, ``advantage``, ``reward``, ``old_logprobs`` and ``ref_logprobs`` are each given
  on every line or on none (there is no silent default for them).  ``loss_mask`` and ``weight``
  may be mixed (the defaults above apply per line).
- Lines of one tree must be contiguous: trees are emitted as soon as the id changes, so the file is
  never held in memory.  A ``tree_id`` that reappears after another tree started is an error naming
  both places (sort the file by id, e.g. ``jq -s -c 'sort_by(.tree_id)[]'``, to fix it).
- A file with no trajectory line is an error.
- A token shared by several paths (same prefix) must get the same ``old_logprobs`` /
  ``ref_logprobs`` value from every path that trains it, within ``logprob_atol`` (default 1e-6;
  values copied from one rollout agree exactly); otherwise :meth:`TrajectoryTree.to_batch` raises
  naming both lines.  With a larger ``logprob_atol`` the first such path (file order) gives the value.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from treecompile.runtime.progress import Progress
from treecompile.tree import DEFAULT_CONV_KERNEL, Tree, TreeBatch

__all__ = ["Trajectory", "TrajectoryTree", "parse_line", "read_trajectories", "scatter_to_dfs",
           "DEFAULT_LOGPROB_ATOL"]

KEYS = ("tree_id", "input_ids", "loss_mask", "advantage", "reward", "weight", "old_logprobs",
        "ref_logprobs", "meta")
PER_PATH = ("advantage", "reward")  # all-or-none within a tree
PER_TOKEN = ("old_logprobs", "ref_logprobs")  # all-or-none within a tree
DEFAULT_LOGPROB_ATOL = 1e-6
_INT64_MAX = 2**63 - 1


class _NonFinite(ValueError):
    pass


def _reject_constant(name: str):
    raise _NonFinite(name)


@dataclass
class Trajectory:
    """One parsed line (a path).  ``old_logprobs``/``ref_logprobs``: float64 ``[len(input_ids)]``,
    NaN where the line has ``null``."""

    tree_id: str | int
    input_ids: list[int]
    line: int
    loss_mask: list[int] | None = None
    advantage: float | None = None
    reward: float | None = None
    weight: float | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    meta: Any = None


def _to_float(x) -> tuple[float, bool]:
    """(float(x), finite?) for a JSON number; an int too large for a float is not finite."""
    try:
        f = float(x)
    except OverflowError:
        return math.inf, False
    return f, math.isfinite(f)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list) -> dict:
    """``json.loads``'s object hook: a dict, refusing a key that appears twice (meta's objects included)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_line(text: str, *, source: str, line: int, vocab_size: int | None = None) -> Trajectory:
    """Parse and validate one JSONL line; errors read ``"<source>:<line>: <what>"``."""

    def fail(msg: str):
        raise ValueError(f"{source}:{line}: {msg}")

    try:
        obj = json.loads(text.strip(), parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        fail(f"key {e.args[0]!r} appears twice in one object (JSON keeps the last silently; which one is meant "
             f"is not known)")
    except _NonFinite as e:
        fail(f"non-finite number {e.args[0]} (JSON has no NaN/Infinity; every number must be finite)")
    except json.JSONDecodeError as e:
        fail(f"bad JSON ({e.msg} at column {e.colno})")
    except (ValueError, RecursionError) as e:  # e.g. an integer literal over Python's 4300-digit limit
        fail(f"bad JSON ({e})")
    if not isinstance(obj, dict):
        fail(f"expected a JSON object, got {type(obj).__name__}")
    unknown = [k for k in obj if k not in KEYS]
    if "group_id" in unknown:  # one name for one thing: no alias (other formats call it group_id)
        fail("'group_id' is not a key of this format: rename it to 'tree_id'")
    if unknown:
        fail(f"unknown key(s) {unknown}; allowed keys are {list(KEYS)} (put free-form data under 'meta')")

    if "tree_id" not in obj:
        fail("missing 'tree_id' (the id of the tree/group this trajectory belongs to)")
    tid = obj["tree_id"]
    if not (isinstance(tid, str) or (isinstance(tid, int) and not isinstance(tid, bool))):
        fail(f"'tree_id' must be a string or an integer, got {json.dumps(tid)}")

    if "input_ids" not in obj:
        fail("missing 'input_ids'")
    ids = obj["input_ids"]
    if not isinstance(ids, list):
        fail(f"'input_ids' must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        fail("'input_ids' is empty")
    hi = _INT64_MAX if vocab_size is None else min(_INT64_MAX, vocab_size - 1)
    if not (set(map(type, ids)) <= {int} and min(ids) >= 0 and max(ids) <= hi):  # fast check; then find it
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                fail(f"input_ids[{i}] = {json.dumps(t)} is not an integer token id")
            if t < 0 or t > _INT64_MAX:
                fail(f"input_ids[{i}] = {t} is out of range (token ids are non-negative int64)")
            if vocab_size is not None and t >= vocab_size:
                fail(f"input_ids[{i}] = {t} is not below vocab_size {vocab_size}")
    n = len(ids)

    mask = obj.get("loss_mask")
    if mask is None and "loss_mask" in obj:
        fail("'loss_mask' is null; omit the key to train every token but the first, or give the 0/1 list")
    if mask is not None:
        if not isinstance(mask, list):
            fail(f"'loss_mask' must be a list of 0/1, got {type(mask).__name__}")
        if len(mask) != n:
            fail(f"'loss_mask' has {len(mask)} entries, 'input_ids' has {n}")
        if not (set(map(type, mask)) <= {int, bool} and set(mask) <= {0, 1}):  # floats 0.0/1.0 are not
            for i, m in enumerate(mask):
                if not (isinstance(m, int) and m in (0, 1)):
                    fail(f"loss_mask[{i}] = {json.dumps(m)} is not 0 or 1")
        mask = list(map(int, mask))
        if mask[0]:
            fail("loss_mask[0] is 1, but nothing predicts a path's first token; set it to 0")

    scalars = {}
    for key in ("advantage", "reward", "weight"):
        v = obj.get(key)
        if v is None:
            if key in obj:
                fail(f"'{key}' is null; omit the key instead")
            continue
        if not _is_number(v):
            fail(f"'{key}' must be a number, got {json.dumps(v)}")
        x, finite = _to_float(v)
        if not finite:
            fail(f"'{key}' is not finite ({x if isinstance(v, float) else f'an integer of {len(str(abs(v)))} digits'})")
        scalars[key] = x

    traj = Trajectory(tree_id=tid, input_ids=ids, line=line, loss_mask=mask, meta=obj.get("meta"), **scalars)
    for key in PER_TOKEN:
        v = obj.get(key)
        if v is None:
            if key in obj:
                fail(f"'{key}' is null; omit the key instead")
            continue
        if not isinstance(v, list):
            fail(f"'{key}' must be a list of numbers (or null), got {type(v).__name__}")
        if len(v) != n:
            fail(f"'{key}' has {len(v)} entries, 'input_ids' has {n}")
        if not set(map(type, v)) <= {int, float, type(None)}:
            i = next(i for i, x in enumerate(v) if not (x is None or _is_number(x)))
            fail(f"{key}[{i}] = {json.dumps(v[i])} is not a number")
        try:
            t = torch.tensor([math.nan if x is None else x for x in v], dtype=torch.float64)
        except (OverflowError, RuntimeError):  # an integer too large for a float
            i = next(i for i, x in enumerate(v) if x is not None and not _to_float(x)[1])
            fail(f"{key}[{i}] is not finite (an integer of {len(str(abs(v[i])))} digits)")
        inf = torch.nonzero(torch.isinf(t)).flatten()
        if inf.numel():
            fail(f"{key}[{int(inf[0])}] is not finite ({t[int(inf[0])].item()})")
        trained = torch.tensor(mask, dtype=torch.bool) if mask is not None else torch.arange(n) > 0
        null_trained = torch.nonzero(torch.isnan(t) & trained).flatten()
        if null_trained.numel():
            i = int(null_trained[0])
            fail(f"{key}[{i}] is null, but token {i} is trained (loss mask 1) and needs a value")
        setattr(traj, key, t)
    return traj


def scatter_to_dfs(tree: Tree, values: torch.Tensor, *, given: torch.Tensor | None = None,
                   atol: float = DEFAULT_LOGPROB_ATOL, name: str = "values",
                   path_labels: Sequence[str] | None = None) -> torch.Tensor:
    """Per-path-token values -> one value per unique token, DFS order ``[tree.num_tokens]``.

    ``values``: flat over path tokens in the caller's path order (like ``tree.loss_mask``);
    ``given``: bool of the same shape, which entries count (None: all).  Every unique token takes
    the value of the first path (caller's order) that gives one; tokens no path gives get 0.
    All given values of one token must agree within ``atol`` (absolute), else a ValueError names
    the two paths (``path_labels[p]`` or ``path p``), the token's depth and both values.
    """
    values = torch.as_tensor(values, dtype=torch.float64).flatten()
    Np = tree.num_path_tokens
    if values.numel() != Np:
        raise ValueError(f"{name}: expected {Np} values (one per path token), got {values.numel()}")
    given = torch.ones(Np, dtype=torch.bool) if given is None else torch.as_tensor(given, dtype=torch.bool).flatten()
    if given.numel() != Np:
        raise ValueError(f"{name}: 'given' has {given.numel()} entries, expected {Np}")
    if not (atol >= 0):
        raise ValueError(f"atol: expected a non-negative number, got {atol}")
    label = (lambda p: path_labels[p]) if path_labels is not None else (lambda p: f"path {p}")

    bad = torch.nonzero(given & ~torch.isfinite(values)).flatten()
    if bad.numel():
        p, i = tree.locate(int(bad[0]))
        raise ValueError(f"{name}: {label(p)}: entry {i} is not finite ({values[int(bad[0])].item()})")

    T = tree.num_tokens
    idx = tree.path_index
    gidx, gval = idx[given], values[given]
    gpos = torch.nonzero(given).flatten()
    first = torch.full((T,), Np, dtype=torch.long).scatter_reduce_(0, gidx, gpos, "amin")
    has = first < Np
    out = torch.zeros(T, dtype=torch.float64)
    out[has] = values[first[has]]
    vmin = torch.full((T,), math.inf, dtype=torch.float64).scatter_reduce_(0, gidx, gval, "amin")
    vmax = torch.full((T,), -math.inf, dtype=torch.float64).scatter_reduce_(0, gidx, gval, "amax")
    spread = torch.where(has, vmax - vmin, torch.zeros_like(vmax))
    off = torch.nonzero(spread > atol).flatten()
    if off.numel():
        t = int(off[0])
        at = gpos[gidx == t]
        ja = int(at[torch.argmin(values[at])])
        jb = int(at[torch.argmax(values[at])])
        (pa, ia), (pb, _) = tree.locate(ja), tree.locate(jb)
        raise ValueError(
            f"{name}: the token at depth {ia} (id {int(tree.input_ids[t])}) is shared by {label(pa)} and "
            f"{label(pb)}, which give {values[ja].item()!r} and {values[jb].item()!r} (differ by "
            f"{spread[t].item():.3g} > atol {atol}); a shared token has one value on every path: fix the "
            f"data, or pass a larger atol to take the first path's value")
    return out


@dataclass
class TrajectoryTree:
    """The trajectories of one ``tree_id``: the :class:`Tree` plus per-path extras (path order =
    file order).  ``old_logprobs``/``ref_logprobs`` are flat over path tokens (like
    ``tree.loss_mask``), NaN where the file has ``null``."""

    tree_id: str | int
    tree: Tree
    source: str
    lines: list[int]
    advantages: torch.Tensor | None = None  # [P] float64
    rewards: torch.Tensor | None = None  # [P] float64
    old_logprobs: torch.Tensor | None = None  # [num_path_tokens] float64
    ref_logprobs: torch.Tensor | None = None
    meta: list = field(default_factory=list)

    @property
    def path_labels(self) -> list[str]:
        return [f"{self.source}:{n}" for n in self.lines]

    def dfs(self, key: str, *, atol: float = DEFAULT_LOGPROB_ATOL) -> torch.Tensor:
        """``old_logprobs`` or ``ref_logprobs`` in DFS order ``[num_tokens]`` (0 at untrained tokens)."""
        v = getattr(self, key)
        if key not in PER_TOKEN or v is None:
            raise ValueError(f"tree {self.tree_id!r} ({self.source}): has no per-token '{key}'")
        v = torch.as_tensor(v, dtype=torch.float64).flatten()
        mask = torch.as_tensor(self.tree.loss_mask, dtype=torch.bool).flatten()
        if v.numel() == mask.numel():
            # NaN means "not given", which only an untrained token may be: read as 0 it trained PPO against
            # old log-probs of 0 (a TrajectoryTree built in code; the JSONL reader refuses null there itself)
            missing = torch.nonzero(mask & torch.isnan(v)).flatten()
            if missing.numel():
                p, i = self.tree.locate(int(missing[0]))
                label = self.path_labels[p] if self.path_labels is not None else f"path {p}"
                raise ValueError(f"tree {self.tree_id!r} ({self.source}): '{key}': {label}: token {i} is trained "
                                 f"(loss mask 1) but has no value (NaN); {missing.numel()} such token(s)")
        given = mask & ~torch.isnan(v) if v.numel() == mask.numel() else None
        return scatter_to_dfs(self.tree, torch.nan_to_num(v, nan=0.0), given=given, atol=atol, name=key,
                              path_labels=self.path_labels)

    def to_batch(self, *, normalize: str = "sum", pad_to_multiple: int | None = None, device=None,
                 conv_kernel: int = DEFAULT_CONV_KERNEL, logprob_atol: float = DEFAULT_LOGPROB_ATOL) -> TreeBatch:
        """``tree.to_batch`` with the extras in ``batch.extras``: ``advantages``/``rewards`` ``[P]``,
        ``old_logprobs``/``ref_logprobs`` in DFS order padded to ``batch.seq_len`` (0 at padding)."""
        batch = self.tree.to_batch(normalize=normalize, pad_to_multiple=pad_to_multiple, conv_kernel=conv_kernel)
        for key in ("advantages", "rewards"):
            if getattr(self, key) is not None:
                batch.extras[key] = getattr(self, key)
        for key in PER_TOKEN:
            if getattr(self, key) is not None:
                v = self.dfs(key, atol=logprob_atol)
                batch.extras[key] = torch.cat([v, v.new_zeros(batch.seq_len - v.numel())])
        return batch.to(device) if device is not None else batch


def _build(group: list[Trajectory], source: str) -> TrajectoryTree:
    tid = group[0].tree_id
    for key in PER_PATH + PER_TOKEN:
        have = [t for t in group if getattr(t, key) is not None]
        if have and len(have) != len(group):
            lack = next(t for t in group if getattr(t, key) is None)
            raise ValueError(f"{source}:{lack.line}: tree {tid!r} gives '{key}' on other lines (e.g. line "
                             f"{have[0].line}) but not on this one; give it on every line of the tree or on none")
    paths = [t.input_ids for t in group]
    masks = None
    if any(t.loss_mask is not None for t in group):
        masks = [t.loss_mask if t.loss_mask is not None else [0] + [1] * (len(t.input_ids) - 1) for t in group]
    weights = None
    if any(t.weight is not None for t in group):
        weights = [t.weight if t.weight is not None else 1.0 for t in group]
    try:
        tree = Tree.from_paths(paths, loss_masks=masks, path_weights=weights)
    except ValueError as e:  # validated above; kept so that a Tree-level error still names the file
        raise ValueError(f"{source}: tree {tid!r} (lines {group[0].line}-{group[-1].line}): {e}") from None

    def per_path(key):
        if getattr(group[0], key) is None:
            return None
        return torch.tensor([getattr(t, key) for t in group], dtype=torch.float64)

    def per_token(key):
        if getattr(group[0], key) is None:
            return None
        return torch.cat([getattr(t, key) for t in group])

    return TrajectoryTree(tree_id=tid, tree=tree, source=source, lines=[t.line for t in group],
                          advantages=per_path("advantage"), rewards=per_path("reward"),
                          old_logprobs=per_token("old_logprobs"), ref_logprobs=per_token("ref_logprobs"),
                          meta=[t.meta for t in group])


def read_trajectories(path: str | os.PathLike, *, vocab_size: int | None = None,
                      progress: bool = False) -> Iterator[TrajectoryTree]:
    """Stream a trajectory JSONL file, yielding one :class:`TrajectoryTree` per (contiguous) tree id.

    The file is read line by line; a tree is built and yielded as soon as the next id starts, so
    memory holds one tree.  Errors (see the module docstring) name ``<file>:<line>``; an error in a
    later line is raised when the reader gets there, after the earlier trees have been yielded.
    ``vocab_size``: ids must be below it.  ``progress``: a bar of bytes read on stderr, drawn when
    stderr is a terminal and the file is over 8 MiB.  This is the one reader of the format:
    training and ``treecompile stats`` both use it.
    """
    source = os.fspath(path)
    if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                                   or vocab_size < 1):
        raise ValueError(f"vocab_size: expected a positive integer, got {vocab_size!r}")
    with open(source, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        bar = Progress(size, f"reading {os.path.basename(source)}", unit="bytes",
                       enabled=progress and size > (8 << 20) and sys.stderr.isatty())
        try:
            yield from _groups(f, source, vocab_size, bar)
        finally:
            bar.close()


def _groups(f, source: str, vocab_size: int | None, bar: Progress) -> Iterator[TrajectoryTree]:
    seen: dict[Any, tuple[int, int]] = {}  # tree id -> (first line, last line)
    group: list[Trajectory] = []
    current = None
    blank = 0
    for n, raw in enumerate(f, 1):
        bar.update(advance=len(raw))
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{source}:{n}: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
        if not text.strip():
            blank += 1
            continue
        traj = parse_line(text, source=source, line=n, vocab_size=vocab_size)
        key = (type(traj.tree_id).__name__, traj.tree_id)  # 1 and "1" are different ids
        if group and key == current:
            group.append(traj)
            seen[key] = (seen[key][0], n)
            continue
        if key in seen:
            a, b = seen[key]
            raise ValueError(f"{source}:{n}: tree_id {traj.tree_id!r} reappears; its lines {a}-{b} were "
                             f"followed by another tree, and the lines of one tree must be contiguous "
                             f"(sort the file by tree_id)")
        if group:
            yield _build(group, source)
        seen[key] = (n, n)
        current = key
        group = [traj]
    if group:
        yield _build(group, source)
    else:
        raise ValueError(f"{source}: empty file: no trajectory lines"
                         + (f" ({blank} blank lines)" if blank else ""))
