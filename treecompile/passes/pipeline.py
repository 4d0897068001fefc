"""The pass pipeline: orders the passes, runs them, names the failing one.

Passes, in order (one module each in this package):
- ``check_dropout`` (check_dropout.py): refuses active dropout (changes nothing).
- ``rewrite_attention`` (rewrite_attention.py): causal SDPA -> ``treecompile::tree_attention``.
- ``route_gdn_states`` (route_gdn_states.py): Gated DeltaNet node states and conv context from the
  parent node (the captured tree ops are re-pointed at the batch's node tensors / conv_index).
- ``rewrite_positions`` (rewrite_positions.py): sequence ``arange`` -> the tree's depth positions.
- ``rewrite_loss`` (rewrite_loss.py): logits -> per-token log-probs at the path predecessor and the
  weighted loss; outputs become ``(loss, logprobs)``.
``BOUNDARY_PASSES`` (``treecompile.compile(model, boundary=True)``) appends
- ``expose_boundary`` (expose_boundary.py): the graph takes and returns the per-layer boundary
  tensors of a redundancy-free partition (K/V, GDN states, conv inputs, predecessor hidden rows);
  its result carries the typed contract the runtime reads (``BoundarySpec``).
Not in this pipeline: ``lower_cuda`` (lower_cuda.py), the CUDA lowering of the rewritten graph that
``treecompile.program.TreeProgram`` makes at its first CUDA call (typed ``CudaOptions``).
Set ``debug=True`` (or the ``treecompile.passes`` logger to DEBUG) to log each
pass's time and what it changed.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from torch import fx

from treecompile.passes.base import PassContext, PassResult
from treecompile.passes.expose_boundary import expose_boundary
from treecompile.passes.check_dropout import check_dropout
from treecompile.passes.rewrite_attention import rewrite_attention
from treecompile.passes.rewrite_loss import rewrite_loss
from treecompile.passes.rewrite_positions import rewrite_positions
from treecompile.passes.route_gdn_states import route_gdn_states

log = logging.getLogger("treecompile.passes")

PassFn = Callable[[fx.GraphModule, PassContext], PassResult]

PASSES: list[tuple[str, PassFn]] = [
    ("check_dropout", check_dropout),
    ("rewrite_attention", rewrite_attention),
    ("route_gdn_states", route_gdn_states),
    ("rewrite_positions", rewrite_positions),
    ("rewrite_loss", rewrite_loss),
]
BOUNDARY_PASSES: list[tuple[str, PassFn]] = PASSES + [("expose_boundary", expose_boundary)]


class PassError(RuntimeError):
    """A pass failed; the message names it and the passes that ran before it."""


def run_passes(gm: fx.GraphModule, ctx: PassContext, *, disable: tuple[str, ...] = (),
               debug: bool = False, passes: list[tuple[str, PassFn]] | None = None) -> dict[str, PassResult]:
    passes = PASSES if passes is None else passes
    unknown = set(disable) - {name for name, _ in passes}
    if unknown:
        raise ValueError(f"disable: unknown pass name(s) {sorted(unknown)}; passes are "
                         f"{[name for name, _ in passes]}")
    results: dict[str, PassResult] = {}
    ran: list[str] = []
    for name, fn in passes:
        if name in disable:
            continue
        t0 = time.perf_counter()
        try:
            res = fn(gm, ctx)
        except Exception as e:
            before = ", ".join(ran) or "none"
            raise PassError(f"pass {name} failed (passes run before it: {before}): {e}") from e
        if res.count:
            gm.graph.lint()
            gm.recompile()
        ran.append(name)
        results[name] = res
        msg = "pass %s: %d change(s) %s in %.1f ms"
        args = (name, res.count, res.info or "", 1e3 * (time.perf_counter() - t0))
        if debug:
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)
    return results
