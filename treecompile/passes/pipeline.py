"""The pass pipeline: orders the passes, runs them, names the failing one.

Passes, in order (one module each in this package):
- ``check_dropout`` (check_dropout.py): refuses active dropout (changes nothing).
- ``rewrite_attention`` (rewrite_attention.py): causal SDPA -> ``treecompile::tree_attention``; under a
  sliding window -> ``treecompile::tree_attention_windowed`` (the window along each token's path).
- ``route_gdn_states`` (route_gdn_states.py): Gated DeltaNet node states and conv context from the
  parent node (the captured tree ops are re-pointed at the batch's node tensors / conv_index).
- ``rewrite_positions`` (rewrite_positions.py): sequence ``arange`` -> the tree's depth positions.
- ``rewrite_scans`` (rewrite_scans.py): ``cumsum``/``cumprod``/``logcumsumexp`` along the sequence ->
  ``treecompile::tree_scan`` (prefix along each token's path).
- ``rewrite_causal_convs`` (rewrite_causal_convs.py): depthwise causal ``conv1d`` ->
  ``treecompile::tree_causal_conv1d`` over ``treecompile::tree_ancestors``.
- ``rewrite_token_shifts`` (rewrite_token_shifts.py): a shift by k tokens toward the past (pad+slice,
  cat, roll+mask, found by evaluating it) -> ``treecompile::tree_shift`` (the k-th path ancestor).
- ``rewrite_causal_attention`` (rewrite_causal_attention.py): hand-written causal attention (matmul,
  optional soft-capping, causal or sliding-window mask, optional position bias such as ALiBi, softmax with
  optional sinks, matmul) -> ``treecompile::tree_attention_biased``;
  runs after the position and scan rewrites, so that the bias is computed from depth positions.
- ``rewrite_router_loss`` (rewrite_router_loss.py): a MoE model's own router aux loss is refused or
  dropped, its router logits kept as outputs (compile option ``router_aux``).
- ``rewrite_loss`` (rewrite_loss.py): logits -> per-token log-probs at the path predecessor and the
  weighted loss; outputs become ``(loss, logprobs)``.
- ``verify_token_locality`` (verify_token_locality.py): last; proves that every op treats tokens
  independently (or is a tree op) and refuses the graph otherwise, naming each token-mixing site.
  Disabling it warns (:class:`UnverifiedGraphWarning`): the graph may then read other branches.
``BOUNDARY_PASSES`` (``treecompile.compile(model, boundary=True)``) appends
- ``expose_boundary`` (expose_boundary.py): the graph takes and returns the per-layer boundary
  tensors of a redundancy-free partition (K/V, GDN states, conv inputs, predecessor hidden rows),
  before the verifier; its result carries the typed contract the runtime reads (``BoundarySpec``).
Nodes a pass inserts are marked ``meta["treecompile_pass"] = <pass name>`` (the verifier's contract:
they are tree-aware by construction).
Not in this pipeline: ``lower_cuda`` (lower_cuda.py), the CUDA lowering of the rewritten graph that
``treecompile.program.TreeProgram`` makes at its first CUDA call (typed ``CudaOptions``).
Set ``debug=True`` (or the ``treecompile.passes`` logger to DEBUG) to log each
pass's time and what it changed.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Callable

from torch import fx

from treecompile.passes.base import PassContext, PassResult, check_absorbed, length_values, remove_dead_code
from treecompile.passes.expose_boundary import expose_boundary
from treecompile.passes.check_dropout import check_dropout
from treecompile.passes.rewrite_attention import rewrite_attention
from treecompile.passes.rewrite_causal_attention import rewrite_causal_attention
from treecompile.passes.rewrite_causal_convs import rewrite_causal_convs
from treecompile.passes.rewrite_loss import rewrite_loss, tag_output_names
from treecompile.passes.rewrite_positions import rewrite_positions
from treecompile.passes.rewrite_scans import rewrite_scans
from treecompile.passes.rewrite_token_shifts import rewrite_token_shifts
from treecompile.passes.rewrite_router_loss import rewrite_router_loss
from treecompile.passes.route_gdn_states import route_gdn_states
from treecompile.passes.verify_token_locality import PASS_KEY, verify_token_locality

log = logging.getLogger("treecompile.passes")

PassFn = Callable[[fx.GraphModule, PassContext], PassResult]

PASSES: list[tuple[str, PassFn]] = [
    ("check_dropout", check_dropout),
    ("rewrite_attention", rewrite_attention),
    ("route_gdn_states", route_gdn_states),
    ("rewrite_positions", rewrite_positions),
    ("rewrite_scans", rewrite_scans),
    ("rewrite_causal_convs", rewrite_causal_convs),
    ("rewrite_token_shifts", rewrite_token_shifts),
    ("rewrite_causal_attention", rewrite_causal_attention),
    ("rewrite_router_loss", rewrite_router_loss),
    ("rewrite_loss", rewrite_loss),
    ("verify_token_locality", verify_token_locality),
]
BOUNDARY_PASSES: list[tuple[str, PassFn]] = PASSES[:-1] + [("expose_boundary", expose_boundary), PASSES[-1]]
# the rewrites that replace a region they checked by evaluating it at sample lengths (masks, shift and conv
# operands, scan inputs): nothing they erase may compute a value from the sequence length (base.check_absorbed)
ABSORBING = frozenset({"rewrite_attention", "rewrite_positions", "rewrite_scans", "rewrite_causal_convs",
                       "rewrite_token_shifts", "rewrite_causal_attention"})
VERIFIER = "verify_token_locality"


class PassError(RuntimeError):
    """A pass failed; the message names it and the passes that ran before it."""


class UnverifiedGraphWarning(UserWarning):
    """The token-locality verifier was disabled: nothing shows that the graph reads only its path."""


def check_disable(disable: tuple[str, ...], passes: list[tuple[str, PassFn]] | None = None) -> None:
    """ValueError naming the entries of ``disable`` that are not passes of ``passes`` (default: PASSES)."""
    passes = PASSES if passes is None else passes
    if isinstance(disable, str):  # one name would be read as its letters
        raise TypeError(f"disable: expected a sequence of pass names, got the string {disable!r} (write "
                        f"disable=({disable!r},))")
    unknown = set(disable) - {name for name, _ in passes}
    if unknown:
        raise ValueError(f"disable: unknown pass name(s) {sorted(unknown)}; passes are "
                         f"{[name for name, _ in passes]}")


def run_passes(gm: fx.GraphModule, ctx: PassContext, *, disable: tuple[str, ...] = (),
               debug: bool = False, passes: list[tuple[str, PassFn]] | None = None) -> dict[str, PassResult]:
    passes = PASSES if passes is None else passes
    check_disable(disable, passes)
    if VERIFIER in disable:
        warnings.warn(f"disable={tuple(disable)!r} turns off {VERIFIER}: the rewritten graph is UNVERIFIED; an op "
                      f"that mixes tokens along the sequence would read other branches of the tree and train "
                      f"silently wrong", UnverifiedGraphWarning, stacklevel=3)
    tag_output_names(gm, ctx.options.output_names)  # what a pass drops is named by what the user returned
    results: dict[str, PassResult] = {}
    ran: list[str] = []
    for name, fn in passes:
        if name in disable:
            continue
        t0 = time.perf_counter()
        lengths = {}
        if name in ABSORBING:  # the live nodes that make a value of the length, before the rewrite
            remove_dead_code(gm)
            lengths = length_values(gm.graph.nodes, ctx.seq_len)
        existing = set(gm.graph.nodes)
        try:
            res = fn(gm, ctx)
            if lengths and res.count:
                remove_dead_code(gm)  # what the rewrite left dead is what it absorbed
                check_absorbed(lengths, gm, name)
        except Exception as e:
            before = ", ".join(ran) or "none"
            raise PassError(f"pass {name} failed (passes run before it: {before}): {e}") from e
        if res.count:
            gm.graph.lint()
            gm.recompile()
        for n in gm.graph.nodes:
            if n not in existing:
                n.meta.setdefault(PASS_KEY, name)
        ran.append(name)
        results[name] = res
        level = logging.WARNING if debug else logging.DEBUG
        info = {k: v for k, v in res.info.items() if k != "sites"}
        log.log(level, "pass %s: %d change(s) %s in %.1f ms", name, res.count, info or "",
                1e3 * (time.perf_counter() - t0))
        for site in res.info.get("sites", ()):
            log.log(level, "  token-mixing site %s", site)
    return results
