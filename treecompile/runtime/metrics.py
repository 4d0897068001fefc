"""Redundancy metrics of a tree and of a partitioning of it.

- POR (prefix overlap ratio) = 1 - unique tokens / path tokens: the share of path tokens a tree run
  never computes; 1 / (1 - POR) bounds the speedup over running every path alone.
- ERR (effective reuse ratio) = 1 - tokens computed / path tokens: the same share for a given
  execution.  The whole tree in one batch, or a redundancy-free partitioning, computes every unique
  token once (ERR == POR); packed partitioning repeats shared prefixes (ERR < POR).

Per dataset, both ratios are taken over the summed token counts (a token-weighted mean), not as a
mean of per-tree ratios.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from treecompile.tree import Tree

__all__ = ["Reuse", "reuse", "dataset_reuse"]


@dataclass(frozen=True)
class Reuse:
    path_tokens: int  # sum of path lengths (what per-path training computes)
    unique_tokens: int  # tokens of the prefix tree
    computed_tokens: int  # tokens a given execution computes (>= unique_tokens)

    @property
    def por(self) -> float:
        return 1.0 - self.unique_tokens / self.path_tokens

    @property
    def err(self) -> float:
        return 1.0 - self.computed_tokens / self.path_tokens

    @property
    def redundant_tokens(self) -> int:
        return self.computed_tokens - self.unique_tokens


def reuse(tree: Tree, computed_tokens: int | None = None) -> Reuse:
    """POR / ERR of one tree; ``computed_tokens`` defaults to the unique tokens (one whole-tree run)."""
    computed = tree.num_tokens if computed_tokens is None else int(computed_tokens)
    if computed < tree.num_tokens:
        raise ValueError(f"computed_tokens={computed} is below the tree's {tree.num_tokens} unique tokens: "
                         f"some token would never be computed")
    return Reuse(tree.num_path_tokens, tree.num_tokens, computed)


def dataset_reuse(items: Iterable[Reuse]) -> Reuse:
    """Token-summed POR / ERR over many trees."""
    items = list(items)
    if not items:
        raise ValueError("dataset_reuse: no trees given")
    return Reuse(sum(r.path_tokens for r in items), sum(r.unique_tokens for r in items),
                 sum(r.computed_tokens for r in items))
