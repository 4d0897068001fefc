"""Executing a redundancy-free plan: every unique token computed once, exact whole-tree gradients.

``run_redundancy_free(tmodel, plan)`` runs the partitions of
:func:`treecompile.runtime.partition.partition_redundancy_free` through a model compiled with
``treecompile.compile(model, boundary=True)`` (pass ``expose_boundary``), in the plan's
:meth:`~treecompile.runtime.partition.RedundancyFreePlan.schedule`:

- **forward of partition i** (parents first): its boundary tensors are gathered from its ancestors'
  exports: per attention layer the K/V of its boundary (the tokens from the root to the token it
  hangs below, ``boundary_last``), per GDN layer the recurrent state after that last token, per conv
  the inputs of the boundary tokens inside the kernel's reach, and the last token's final hidden row
  (it predicts the partition's first token below it: that log-prob and its loss weight stay in the
  child; the hidden row is fed, the gradient goes back through it).  The
  graph returns the partition's loss and its own per-layer tensors; the executor keeps only the rows
  that later partitions read (``plan.boundary_rows(i)`` for K/V, the children's boundary-last tokens
  for states and hidden rows, boundary tails for conv inputs) together with their autograd graph, and hands
  descendants *detached leaves* of them (same storage, ``requires_grad``), so that a descendant's
  backward stops at the leaf and accumulates the boundary gradient in ``leaf.grad``;
- **backward of partition i** (after all partitions below it): ``torch.autograd.backward([loss_i,
  *exports_i], [1, *leaf.grad])`` runs i's graph once, with the gradients its descendants sent;
  parameter gradients accumulate in ``.grad`` as in any backward; then i's graph is freed.

Activations alive at any time: the graphs of one chain of partitions (the current one and its
ancestors): ``plan.peak_chain_tokens()``, at most C tokens under the planner's ``bound="chain"`` (the
default where every path fits C) and ``longest path + C`` under ``bound="partition"``,
plus the boundary rows kept for descendants.  The summed partition losses equal the whole-tree loss and the
gradients equal the whole tree's (checked in float64 in ``tests/test_redundancy_free.py``).

**Objectives.**  By default a partition's loss is the graph's own ``-(loss_weight * lp).sum()`` with
the plan's weights fixed before the forward (the objectives linear in the log-probs).  With
``loss_fn`` it is ``loss_fn(out, batch)`` on the partition's outputs instead (``out`` a
:class:`~treecompile.compile.TreeOutput`: ``out.logprobs``, and ``out.entropy`` for a model compiled
with ``entropy=True``): ``batch`` is the
partition's TreeBatch with ``extras`` ``whole_tree``/``tokens``/``owned`` (every token owned: each
lies in exactly one partition) plus ``data`` (per-path advantages, whole-tree DFS old/ref log-probs).
Any objective whose loss is a sum over tokens of a function of that token's log-prob (or entropy) and
whole-tree coefficients (PPO-clip, KL, SFT, policy gradient, entropy bonus) then sums over the
partitions to the whole-tree loss, and the backward of each partition (run after all partitions below
it) carries its gradient.  Path-level objectives (``SequenceClip``) need every token of a path in one
batch and are refused by the objective itself; ``train_step`` linearizes them at the log-probs of
:func:`prepass_redundancy_free` instead (:mod:`treecompile.runtime.path_level`).

**Router losses** (``compile(model, boundary=True, router_aux=...)``): a partition's router loss is
linear in its tokens given the step's routed counts (:mod:`treecompile.runtime.router_step`), which
:func:`prepass_redundancy_free` collects in a pre-pass over the same schedule (forwards without
gradient); ``run_redundancy_free(router=...)`` then adds each partition's share to its loss.

Each partition runs through the model's one runner, ``tmodel.program.run(batch, boundary_inputs)``;
on CUDA the lowering (``passes/lower_cuda.py``) compiles a boundary program per length bucket
(``TreeProgram.padded_call`` pads the boundary inputs too) and runs its boundary attention through
FlexAttention over ``[boundary ; local]`` keys (``ops/flex_tree_attention_boundary.py``); the GDN and
conv boundary ops run their reference implementations (no fla lowering of them yet).  The boundary
K/V a partition is fed are gathered (one copy of its B rows per layer, from the ancestors' kept rows)
and concatenated with its own K/V inside the attention (``[Bp + T]`` rows per layer, saved for the
backward in place of the gathered copy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from treecompile.host_values import single_threaded_for, to_device_async, to_device_with_host
from treecompile.passes.expose_boundary import BoundarySpec
from treecompile.router_aux import ROUTER_WEIGHTS
from treecompile.runtime.metrics import Reuse, reuse
from treecompile.runtime.partition import RedundancyFreePlan
from treecompile.traced_modules import check_unchanged

__all__ = ["run_redundancy_free", "RedundancyFreeResult", "prepass_redundancy_free", "PrePass"]


@dataclass
class RedundancyFreeResult:
    loss: torch.Tensor  # summed partition losses (detached) == whole-tree loss
    logprobs: torch.Tensor  # [T] whole-tree DFS order (detached)
    tokens_computed: int  # sum of partition sizes: every unique token once
    num_partitions: int
    peak_alive_tokens: int  # max tokens of partitions whose graphs were alive at once
    reuse: Reuse = field(repr=False, default=None)
    entropy: torch.Tensor | None = None  # [T] whole-tree DFS (detached); None unless compiled with entropy=True
    aux_loss: torch.Tensor | None = None  # summed router losses of the partitions (router=...), detached
    z_loss: torch.Tensor | None = None


@dataclass
class _Alive:
    """A partition whose forward ran and whose backward has not: its loss and the rows it keeps for descendants."""

    loss: torch.Tensor
    num_tokens: int
    exports: list  # graph-attached tensors, one per leaf
    leaves: list  # detached, requires_grad: what descendants read
    kv_tok: torch.Tensor  # whole-tree tokens (ascending) of the K/V rows kept for descendants
    last_tok: torch.Tensor  # children's boundary-last tokens (ascending): states and hidden rows
    conv_tok: torch.Tensor  # boundary-tail tokens (ascending) of the conv inputs kept
    kv: dict = field(default_factory=dict)  # attention layer -> (k leaf, v leaf) [1, Hkv, E, D]
    states: dict = field(default_factory=dict)  # GDN layer -> leaf [E, Hv, Dk, Dv]
    conv: dict = field(default_factory=dict)  # conv layer -> leaf [1, C, E]
    hidden: torch.Tensor | None = None  # leaf [E, D]


def _spec(tmodel) -> BoundarySpec:
    spec = tmodel.program.boundary
    if spec is None:
        raise ValueError("run_redundancy_free needs a model compiled with treecompile.compile(model, boundary=True)")
    return spec


def _conv_tails(plan: RedundancyFreePlan, width: int) -> list[torch.Tensor]:
    """Per partition: its tokens (ascending) among the last ``width`` tokens of any partition's
    boundary (the conv context a descendant reads)."""
    tree = plan.tree
    owner = plan.owner
    found: list[set[int]] = [set() for _ in range(len(plan))]
    for p in plan.partitions:
        t = p.boundary_last
        for _ in range(width):
            if t < 0:
                break
            found[int(owner[t])].add(t)
            t = int(tree.pred[t])
    return [torch.tensor(sorted(s), dtype=torch.long) for s in found]


@single_threaded_for(lambda tokens, *_: tokens.numel())  # host work of a partition (host_values)
def _local(tokens: torch.Tensor, wanted: torch.Tensor, what: str, i: int) -> torch.Tensor:
    """Positions of ``wanted`` in the ascending ``tokens``; ValueError if one is missing."""
    pos = torch.searchsorted(tokens, wanted)
    ok = pos < tokens.numel()
    ok &= tokens[pos.clamp(max=max(tokens.numel() - 1, 0))] == wanted if tokens.numel() else torch.zeros_like(ok)
    if not bool(ok.all()):
        t = int(wanted[~ok][0])
        raise ValueError(f"partition {i}: token {t} ({what}) is not among the tokens it should be found in; "
                         f"the plan's boundary links are inconsistent")
    return pos


class _Executor:
    def __init__(self, tmodel, plan: RedundancyFreePlan, normalize: str, loss_fn: Callable | None = None,
                 data: Mapping | None = None, router=None, counting: bool = False):
        self.tm = tmodel
        self.plan = plan
        self.normalize = normalize
        self.loss_fn = loss_fn
        self.data = dict(data or {})
        self.router = router  # a router_step.TreeRouterWeights
        # the pre-pass: forwards only (no gradient): log-probs, and each token's top-k counts of a router
        self.counting = counting
        self.counts = torch.zeros(plan.tree.num_tokens, tmodel.router_aux.num_experts, dtype=torch.float64) \
            if counting and getattr(tmodel, "router_aux", None) is not None else None
        self.spec = _spec(tmodel)
        self.width = self.spec.conv_width
        self.device = tmodel.device
        self.alive: dict[int, _Alive] = {}
        self.conv_tok = _conv_tails(plan, self.width) if self.width else None
        self.child_last = [torch.tensor(sorted({plan.partitions[c].boundary_last for c in p.children}),
                                        dtype=torch.long) for p in plan.partitions]
        T = plan.tree.num_tokens
        # the results accumulate on the model's device and are read back once, after the last partition
        # (:meth:`results`): a read-back per partition would wait for the GPU's queue before the next one's launches
        self._logprobs = torch.zeros(T, dtype=torch.float64, device=self.device)
        self._entropy = None
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self._aux = self._z = None
        self.computed = 0
        self.peak = 0

    # ------------------------------------------------------------------ gathering boundary rows
    @single_threaded_for(lambda self, i, tokens, *_: tokens.numel())  # host work of a partition (host_values)
    def _gather_index(self, i: int, tokens: torch.Tensor, tok_of, what: str):
        """Where the rows of ``tokens`` (whole-tree indices) live: the ancestors that own them (root
        first) and each token's row in the concatenation of those ancestors' exports."""
        part = self.plan.partitions[i]
        owner = self.plan.owner[tokens]
        used = [a for a in part.ancestors if bool((owner == a).any())]
        if len(used) != int(torch.unique(owner).numel()):
            bad = sorted(set(owner.tolist()) - set(used))
            raise ValueError(f"partition {i}: {what} tokens owned by partition(s) {bad}, which are not its "
                             f"ancestors {list(part.ancestors)}")
        idx = torch.empty_like(tokens)
        off = 0
        for a in used:
            sel = owner == a
            ta = tok_of(a)
            idx[sel] = off + _local(ta, tokens[sel], what, i)
            off += ta.numel()
        return used, to_device_async(idx, self.device)

    @staticmethod
    def _take(where, leaf_of, dim: int) -> torch.Tensor:
        """The gathered rows, differentiable into the ancestors' leaves."""
        used, idx = where
        src = torch.cat([leaf_of(a) for a in used], dim) if len(used) > 1 else leaf_of(used[0])
        return src.index_select(dim, idx)

    def _empty(self, k: int, n: int) -> torch.Tensor:
        shape, dtype = self.spec.input_shapes[k]
        dims = [n if d is None else d for d in shape]
        return torch.zeros(dims, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ forward
    def forward(self, i: int) -> None:
        plan, spec = self.plan, self.spec
        part = plan.partitions[i]
        kw = {"normalize": self.normalize}
        if self.width:
            kw["conv_kernel"] = self.width + 1
        batch = plan.batch(i, **kw)
        try:  # as TreeModel.forward does: a bad id is named here (its path and position in the whole tree)
            dataclasses.replace(batch, extras={**batch.extras, "whole_tree": plan.tree}).check_ids(self.tm.vocab_size)
        except ValueError as e:
            raise ValueError(f"redundancy-free partition {i}: {e}") from None
        ex = batch.extras
        tokens = ex["tokens"]
        T = batch.seq_len
        boundary = ex["boundary_index"]  # whole-tree tokens of the boundary, root first
        last = part.boundary_last
        last_depth = int(plan.tree.depth[last]) if last >= 0 else -1

        # predecessor rows: every boundary predecessor must be the boundary's last token
        pred_boundary = ex["pred_boundary"]
        has_pb = pred_boundary >= 0
        if bool(has_pb.any()) and bool((pred_boundary[has_pb] != last_depth).any()):
            q = int(torch.nonzero(has_pb & (pred_boundary != last_depth))[0])
            raise ValueError(f"partition {i}: token {int(tokens[q])} is predicted by boundary position "
                             f"{int(pred_boundary[q])}, not by the boundary's last token (depth {last_depth})")
        pred_index = torch.where(has_pb, T, batch.pred_index)
        conv_index = batch.conv_index
        conv_used = torch.empty(0, dtype=torch.long)
        if self.width:
            cpi = ex["conv_boundary_index"]
            conv_used = torch.unique(cpi[cpi >= 0])  # ascending boundary positions
            rank = torch.searchsorted(conv_used, cpi.clamp(min=0))
            conv_index = torch.where(cpi >= 0, T + rank, conv_index)
            # local root nodes start from the state after the boundary's last token
            roots = batch.node_parent[:batch.num_nodes] < 0
            nbp = ex["node_boundary_parent"][roots]
            if bool((nbp != last_depth).any()):
                raise ValueError(f"partition {i}: a local root node hangs below boundary position "
                                 f"{int(nbp[nbp != last_depth][0])}, not below the boundary's last token "
                                 f"(depth {last_depth})")
        b2 = dataclasses.replace(batch, pred_index=pred_index, conv_index=conv_index).to(self.device)

        # state_nodes: local nodes ending at the children's boundary-last tokens
        last_tok = self.child_last[i]
        hpos = _local(tokens, last_tok, "a child's boundary-last", i)
        state_nodes = batch.node_id[hpos]
        if bool((batch.node_end[state_nodes] != hpos + 1).any()):
            raise ValueError(f"partition {i}: a child's boundary-last token does not end a local node")
        kv_tok = plan.boundary_rows(i)
        conv_tok = self.conv_tok[i] if self.width else torch.empty(0, dtype=torch.long)

        # boundary inputs, in the graph's order
        alive = self.alive
        kv_at = self._gather_index(i, boundary, lambda a: alive[a].kv_tok, "K/V") if boundary.numel() else None
        last_at = self._gather_index(i, torch.tensor([last]), lambda a: alive[a].last_tok, "boundary-last") \
            if last >= 0 else None
        conv_at = self._gather_index(i, boundary[conv_used], lambda a: alive[a].conv_tok, "conv input") \
            if conv_used.numel() else None
        extra = []
        for k, (kind, layer) in enumerate(spec.inputs):
            if kind in ("boundary_k", "boundary_v"):
                j = 0 if kind == "boundary_k" else 1
                extra.append(self._take(kv_at, lambda a: alive[a].kv[layer][j], 2) if kv_at else self._empty(k, 0))
            elif kind == "boundary_visible":
                # its host values kept: the varlen boundary attention plans from them without a device copy
                extra.append(to_device_with_host(ex["boundary_visible"], self.device))
            elif kind == "initial_state":
                extra.append(self._take(last_at, lambda a: alive[a].states[layer], 0)[0] if last_at
                             else self._empty(k, 0))
            elif kind == "state_nodes":
                extra.append(to_device_async(state_nodes, self.device))
            elif kind == "boundary_x":
                extra.append(self._take(conv_at, lambda a: alive[a].conv[layer], 2) if conv_at else self._empty(k, 0))
            elif kind == "boundary_hidden":
                extra.append(self._take(last_at, lambda a: alive[a].hidden, 0) if last_at else self._empty(k, 0))
            else:
                raise ValueError(f"unknown boundary input {kind!r}")
        outs = self.tm.program.run(b2, extra)
        m = 2 + spec.kept  # (loss, logprobs[, entropy], *router_logits), then the boundary exports
        if self.counting:  # the pre-pass
            if self.counts is not None:
                self.counts[tokens] = self.tm.router_counts(outs[:m], batch.num_tokens)
            loss, lp, out = outs[0].detach(), outs[1], None
        else:
            extras = {**batch.extras, **self.data, "whole_tree": plan.tree,
                      "owned": torch.ones(batch.seq_len, dtype=torch.bool)}
            if self.router is not None:
                extras[ROUTER_WEIGHTS] = self.router.take(tokens, num_tokens=batch.num_tokens)
            obj_batch = dataclasses.replace(batch, extras=extras)
            out = self.tm.tree_output(outs[:m], obj_batch)
            loss, lp = out.loss, out.logprobs
            if self.loss_fn is not None:  # the objective on this partition's outputs (module docstring)
                loss = self.loss_fn(out, obj_batch)
                if out.aux_loss is not None:
                    loss = loss + self.tm.router_aux.weighted(out.aux_loss, out.z_loss).to(loss.dtype)

        # exports: the rows descendants read
        dev = self.device
        st = _Alive(loss=loss, num_tokens=batch.num_tokens, exports=[], leaves=[], kv_tok=kv_tok,
                    last_tok=last_tok, conv_tok=conv_tok)
        kv_pos = to_device_async(_local(tokens, kv_tok, "K/V kept for descendants", i), dev)
        conv_pos = to_device_async(_local(tokens, conv_tok, "conv input kept for descendants", i), dev)
        has_children = bool(part.children)
        for (kind, layer), t in zip(spec.outputs, outs[m:]):
            if not has_children:
                break
            if kind in ("k", "v"):
                e = t.index_select(2, kv_pos)
            elif kind == "states":
                e = t
            elif kind == "x":
                e = t.index_select(2, conv_pos)
            elif kind == "hidden":
                e = t.index_select(0, to_device_async(hpos, dev))
            else:
                raise ValueError(f"unknown boundary output {kind!r}")
            # a leaf for the partitions below, which carries their gradient back to ``e`` (none where ``e`` needs
            # none: everything it came from is frozen)
            leaf = e.detach().requires_grad_(e.requires_grad)
            st.exports.append(e)
            st.leaves.append(leaf)
            if kind == "k":
                st.kv[layer] = (leaf, None)
            elif kind == "v":
                st.kv[layer] = (st.kv[layer][0], leaf)
            elif kind == "states":
                st.states[layer] = leaf
            elif kind == "x":
                st.conv[layer] = leaf
            else:
                st.hidden = leaf
        del outs
        self.alive[i] = st
        self._loss += loss.detach().to(torch.float64)
        rows = to_device_async(tokens, dev)
        self._logprobs.index_copy_(0, rows, lp.detach()[:batch.num_tokens].to(torch.float64))
        if out is not None and out.entropy is not None:
            if self._entropy is None:
                self._entropy = torch.zeros_like(self._logprobs)
            self._entropy.index_copy_(0, rows, out.entropy.detach()[:batch.num_tokens].to(torch.float64))
        if out is not None and out.aux_loss is not None:
            self._aux = _add(self._aux, out.aux_loss)
            self._z = _add(self._z, out.z_loss)
        self.computed += batch.num_tokens
        self.peak = max(self.peak, sum(a.num_tokens for a in self.alive.values()))

    # ------------------------------------------------------------------ backward
    def backward(self, i: int) -> None:
        st = self.alive.pop(i)
        if self.counting:  # the pre-pass: nothing to differentiate
            return
        tensors = [st.loss]
        grads = [torch.ones_like(st.loss)]
        for e, leaf in zip(st.exports, st.leaves):
            if leaf.grad is not None:  # (none where ``e`` needs none: its leaf does not require grad)
                tensors.append(e)
                grads.append(leaf.grad)
        if st.loss.requires_grad or len(tensors) > 1:
            torch.autograd.backward(tensors, grads)

    # ------------------------------------------------------------------ results
    def results(self) -> dict:
        """The summed loss, whole-tree log-probs (and entropy, router losses) on the host, float64: read back
        once, after the last partition."""
        return {name: None if x is None else x.cpu() for name, x in (
            ("loss", self._loss), ("logprobs", self._logprobs), ("entropy", self._entropy), ("aux_loss", self._aux),
            ("z_loss", self._z))}


def _add(acc, x):
    """``acc + x`` in float64 on ``x``'s device, detached (``acc`` None: ``x``)."""
    return acc if x is None else (x.detach().to(torch.float64) if acc is None else acc + x.detach().to(torch.float64))


def _run(ex: _Executor) -> None:
    for event, i in ex.plan.schedule():
        if event == "forward":
            ex.forward(i)
        else:
            ex.backward(i)
    if ex.alive:
        raise RuntimeError(f"partitions {sorted(ex.alive)} ran forward but not backward: the schedule is incomplete")


@dataclass(frozen=True)
class PrePass:
    """What a forward of every partition without gradient gives, whole-tree DFS order (float64):
    ``logprobs [T]`` and, for a model compiled with ``router_aux``, the layer-summed top-k ``counts [T, E]``."""

    logprobs: torch.Tensor
    counts: torch.Tensor | None


def prepass_redundancy_free(tmodel, plan: RedundancyFreePlan) -> PrePass:
    """Every partition's forward without gradient, in the plan's schedule (each keeps only the boundary
    rows its descendants read, until its last descendant ran): the quantities a step needs before any
    backward (the router's counts, the log-probs of path-level objectives)."""
    ex = _Executor(tmodel, plan, "sum", counting=True)
    with torch.no_grad():
        _run(ex)
    return PrePass(ex.results()["logprobs"], ex.counts)


def run_redundancy_free(tmodel, plan: RedundancyFreePlan, *, normalize: str = "sum", loss_fn: Callable | None = None,
                        data: Mapping | None = None, router=None) -> RedundancyFreeResult:
    """Forward and backward of every partition of ``plan`` (see the module docstring).

    ``tmodel``: ``treecompile.compile(model, boundary=True)``.  Gradients accumulate in the model's
    parameters (call ``optimizer.zero_grad()`` before, as for any backward).  Returns the summed
    loss (== the whole-tree loss for ``normalize``), the whole-tree log-probs in DFS order and the
    token counts (``tokens_computed == tree.num_tokens``: ERR == POR).  ``loss_fn(out, batch)`` and
    ``data``: a partition's loss from an objective instead of the graph's (module docstring).
    ``router``: the tree's :class:`~treecompile.runtime.router_step.TreeRouterWeights` (required by a model
    compiled with ``router_aux``; ``train_step`` computes them); the partitions' router losses are in the
    returned loss and, summed, in ``aux_loss`` / ``z_loss``.
    """
    check_unchanged(tmodel)  # the program runs directly here: the TreeModel's own call-time check
    ex = _Executor(tmodel, plan, normalize, loss_fn, data, router=router)
    _run(ex)
    return RedundancyFreeResult(**ex.results(), tokens_computed=ex.computed, num_partitions=len(plan),
                                peak_alive_tokens=ex.peak, reuse=reuse(plan.tree, ex.computed))
