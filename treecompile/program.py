"""``TreeProgram``: the rewritten graph and the one way to run it.

Every caller runs the rewritten graph through :meth:`TreeProgram.run`: ``TreeModel.forward``, the
redundancy-free executor (``runtime.redundancy_free``, with boundary inputs), split segments
(``TreeModel.split_at``) and the re-export in ``treecompile.save``.  It holds

- the rewritten *lifted* graph (parameters, buffers and constants are its first inputs, looked up
  on the model at every call by FQN, so optimizers, ``load_state_dict`` and FSDP's parameter swaps
  are seen; :attr:`lifted` lists them);
- the batch inputs that follow: :attr:`user_inputs` (the model's own, fed ``input_ids [1, T]`` or
  None) and :attr:`tree_inputs` (``TreeBatch`` field names, fed as ``tree_<field>``), then the
  boundary inputs of a boundary program (:attr:`boundary`, a ``passes.expose_boundary.BoundarySpec``);
- how it runs on CUDA (:attr:`options`, ``passes.lower_cuda.CudaOptions``): on CPU the graph runs
  eagerly (tests, float64 exactness); on CUDA its lowering (``passes.lower_cuda.lower_cuda``, made at
  the first CUDA call and kept) runs, compiled per length bucket or eagerly as the lowering decides.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from treecompile.host_values import remember_host, remembered_host, single_threaded
from treecompile.passes.expose_boundary import BoundarySpec
from treecompile.ops.varlen_boundary_attention import boundary_segments_fit
from treecompile.ops.varlen_tree_attention import segments_fit
from treecompile.ops import tree_conv_shifts
from treecompile.ops.last_batch import LastBatch, device_stream
from treecompile.passes.lower_cuda import (CudaLowering, CudaOptions, attention_inputs, lower_cuda, prepare_plans,
                                           warn_once)
from treecompile.passes.split_modules import Segment, split_by_modules
from treecompile.tree import _TENSOR_FIELDS, TreeBatch, ancestor_index

__all__ = ["TreeProgram", "LiftedInput", "SplitGraph", "bucket_length", "module_tensor"]


def bucket_length(T: int, *, min_bucket: int = 256, steps_per_octave: int = 8) -> int:
    """Round ``T`` up to a bucket: multiples of 2^(floor(log2 T)) / steps_per_octave (>= min_bucket).

    The step is at least ``min_bucket``: padding is below 1/steps_per_octave of T from ``steps_per_octave *
    min_bucket`` tokens on (2,048 by default), and below ``min_bucket`` tokens under it (257 -> 512).  Lengths up to
    L fall in about steps_per_octave * log2(L / min_bucket) buckets, one compiled graph each.
    """
    if T <= min_bucket:
        return min_bucket
    step = max(min_bucket, (1 << (T.bit_length() - 1)) // steps_per_octave)
    return math.ceil(T / step) * step


def module_tensor(root: nn.Module, fqn: str, *, parameter: bool) -> torch.Tensor:
    """``root.get_parameter(fqn)`` (or ``get_buffer``), read through the modules' own ``_modules`` /
    ``_parameters`` / ``_buffers`` dicts: the names ``named_parameters`` gave, looked up now (FSDP2's and the
    user's swapped tensors are seen), without ``get_submodule``'s attribute walk.  Every step looks up every
    lifted tensor (311 for Qwen3-0.6B): through ``get_parameter`` that was 9 ms of a 155 ms step's host time
    under cProfile on an H100 host (benchmarks/results/h100_s26/host_python_wrapper.txt).  A name the dicts do
    not hold falls back to the ``nn.Module`` method and its error."""
    *path, leaf = fqn.split(".")
    mod = root
    try:
        for name in path:
            mod = mod._modules[name]
        t = (mod._parameters if parameter else mod._buffers)[leaf]
    except (KeyError, AttributeError):  # not in the dicts (or a submodule set to None): nn.Module's lookup
        t = None
    if t is None:
        return root.get_parameter(fqn) if parameter else root.get_buffer(fqn)
    return t


def _lifted_walk(lifted) -> tuple[list, list]:
    """``(modules, tensors)`` for :meth:`TreeProgram.lifted_values`: each submodule on the lifted FQNs' paths once, as
    ``(index of its parent in the walk, name)`` (index 0: the model), in an order where parents come first; each
    lifted input as ``(index of its owner, leaf name, is a parameter)``, or ``(None, key, None)`` for a constant."""
    index: dict[tuple, int] = {(): 0}
    modules, tensors = [], []
    for x in lifted:
        if x.kind not in (InputKind.PARAMETER, InputKind.BUFFER):
            tensors.append((None, x.target, None))
            continue
        *path, leaf = x.target.split(".")
        for i in range(1, len(path) + 1):
            if tuple(path[:i]) not in index:
                index[tuple(path[:i])] = len(modules) + 1
                modules.append((index[tuple(path[:i - 1])], path[i - 1]))
        tensors.append((index[tuple(path)], leaf, x.kind == InputKind.PARAMETER))
    return modules, tensors


def _batch_tensors(batch: TreeBatch) -> tuple:
    """The batch's tensors that the graph's inputs come from (what the kept per-batch values are keyed on)."""
    return tuple(getattr(batch, f) for f in _TENSOR_FIELDS)


@dataclass(frozen=True)
class LiftedInput:
    """A lifted placeholder of the rewritten graph: a parameter, buffer or constant of the model."""

    name: str  # placeholder name
    kind: InputKind  # PARAMETER, BUFFER or CONSTANT_TENSOR
    target: str  # FQN in the model (key in ``exported_program.constants`` for constants)


@dataclass
class SplitGraph:
    """A graph cut by :meth:`TreeProgram.split_graph`, with what running it needs precomputed."""

    segments: list[tuple[Segment, object]]  # (segment, callable running its graph), in graph order
    batch_names: list[str]  # the graph's non-lifted placeholders, in order (batch, boundary, mask)
    result: list[str]  # names of the graph's outputs


@dataclass
class _CudaState:
    lowering: CudaLowering
    run: object  # the (compiled) lowered graph module, or a SplitGraph of it


def dynamo_config(options: CudaOptions) -> dict:
    """dynamo's settings while a lowered graph runs (patched around each call; the global ones are left as they are):

    - ``recompile_limit``: compiled flex kernels (the graph's, or the separately compiled one of an eager graph)
      compile once per shape, so room for one per length bucket (never lower than the global limit);
    - ``capture_dynamic_output_shape_ops``: the ops whose row counts are decided at run time (the head's kept logits
      under "fit", the varlen attention's kept K/V rows) stay in the one graph.  Without it dynamo breaks the graph
      at each of them: Qwen3-0.6B at 16k tree tokens with the K/V kept ran as 30 graphs and recompiled the layer
      wrapper per layer (first step 175 s, step 178.7 ms against 164.3 ms before; H200, session 41), and the
      head's "fit" has always cut the graph in two (``torch._dynamo.explain`` of the tiny model's lowering).  Any
      other op with a data-dependent output shape in a lowered graph came through ``torch.export``, which traces
      such ops with unbacked sizes already, so dynamo captures what export did.
    """
    return dict(recompile_limit=max(torch._dynamo.config.recompile_limit, options.recompile_limit),
                capture_dynamic_output_shape_ops=True)


def compile_lowered(lowering: CudaLowering, fn, **kwargs):
    """``fn`` (the lowered graph or a segment of it) as ``lowering`` runs it: itself when it runs eagerly, else under
    ``torch.compile`` with static shapes (one compile per length bucket), or with dynamo's automatic dynamic shapes
    where ``lowering.dynamic`` says so (a boundary program with no block mask).  ``kwargs`` go to ``torch.compile``
    (a test's ``backend``)."""
    if not lowering.compiled:
        return fn
    return torch.compile(fn, dynamic=None if lowering.dynamic else False, **kwargs)


class TreeProgram:
    """The rewritten graph of one model and the one way to run it (module docstring)."""

    def __init__(self, model: nn.Module, exported_program: ExportedProgram, *, input_name: str,
                 user_inputs: Sequence[str], tree_inputs: Sequence[str], conv_width: int | None,
                 boundary: BoundarySpec | None = None, options: CudaOptions = CudaOptions()):
        self.model = model  # holds the tensors the lifted placeholders name
        self.exported_program = exported_program
        self.graph_module: fx.GraphModule = exported_program.graph_module
        self.lifted = [LiftedInput(s.arg.name, s.kind, s.target) for s in exported_program.graph_signature.input_specs
                       if s.kind != InputKind.USER_INPUT]
        self.input_name = input_name
        self.user_inputs = list(user_inputs)
        self.tree_inputs = list(tree_inputs)
        self.conv_width = conv_width  # K-1 of the model's causal convs (None: no conv)
        self.boundary = boundary  # not None: a partition graph of a redundancy-free plan
        self.options = options
        self.split_owners: list[str] = []
        self._lifted_by_name = {x.name: x for x in self.lifted}
        self._aliases: dict[str, list[str]] = {}
        self._cpu_split: SplitGraph | None = None
        self._cuda: _CudaState | None = None
        self._cuda_flex: _CudaState | None = None  # "auto"'s flex lowering, for batches the varlen segments refuse
        self._inputs = LastBatch()  # the last batch's graph inputs (_graph_inputs: kept for prepare and the call)
        self._moved = LastBatch()  # the last batch moved to the model's device (_moved_batch)
        self._walk = _lifted_walk(self.lifted)  # lifted_values' walk of the module dicts
        # the dtype each lifted placeholder was captured with (casts, rotary tables and kernels were traced for it)
        vals = {n.name: n.meta.get("val") for n in self.graph_module.graph.nodes if n.op == "placeholder"}
        self._lifted_dtypes = [getattr(vals.get(x.name), "dtype", None) for x in self.lifted]
        self._tree_names = [f"tree_{n}" for n in self.tree_inputs]  # the tree inputs' placeholders

    # ------------------------------------------------------------------ inputs
    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def lifted_values(self) -> list[torch.Tensor]:
        """``[lifted_value(x) for x in self.lifted]`` on the model, in one walk of its module dicts: each submodule
        on the way is read once (from its parent's ``_modules``, now), then each tensor from its owner's
        ``_parameters`` / ``_buffers``; a name those dicts do not hold takes :meth:`lifted_value`'s lookup.  Every
        step reads every lifted tensor (311 for Qwen3-0.6B): 305 us one by one on this repository's CPU."""
        modules, tensors = self._walk
        mods = [self.model]
        try:
            for parent, name in modules:
                mods.append(mods[parent]._modules[name])
            out = [self.exported_program.constants[leaf] if owner is None else
                   (mods[owner]._parameters if param else mods[owner]._buffers)[leaf]
                   for owner, leaf, param in tensors]
            if all(t is not None for t in out):
                return self._same_dtypes(out)
        except (KeyError, AttributeError):  # not in the dicts (a submodule set to None)
            pass
        return self._same_dtypes([self.lifted_value(x) for x in self.lifted])  # one by one, nn.Module's lookup

    def _same_dtypes(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """``values``, when each has the dtype its placeholder was captured with; else ValueError naming the first
        that does not: a model converted after compile (``.double()``, ``.to(torch.bfloat16)``) would run a graph
        traced for the old dtype (its casts and float32 rotary tables kept: 4.5e-8 off per path in float64, or a
        dtype error deep inside)."""
        if [getattr(t, "dtype", None) for t in values] == self._lifted_dtypes:
            return values
        for x, t, want in zip(self.lifted, values, self._lifted_dtypes):
            if want is not None and getattr(t, "dtype", want) != want:
                raise ValueError(f"{x.target} is {str(t.dtype).removeprefix('torch.')} but the model was compiled "
                                 f"with it in {str(want).removeprefix('torch.')}: convert the model before "
                                 "treecompile.compile (the graph is traced for the dtypes it had then)")
        return values

    def lifted_value(self, x: LiftedInput, tensors: nn.Module | None = None) -> torch.Tensor:
        """The tensor ``x`` names, looked up now on ``tensors`` (default: the model)."""
        src = self.model if tensors is None else tensors
        if x.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            return module_tensor(src, x.target, parameter=x.kind == InputKind.PARAMETER)
        return self.exported_program.constants[x.target]

    def constant_inputs(self) -> list[str]:
        """Names of the lifted placeholders that hold no trained value (buffers, lifted tensor constants)."""
        return [x.name for x in self.lifted if x.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR)]

    def batch_args(self, batch: TreeBatch | Mapping[str, torch.Tensor]) -> list:
        """The graph inputs that come from ``batch`` (after the lifted ones, before the boundary's).

        ``batch``: a TreeBatch, or a mapping from ``input_ids`` (``[1, T]``) and tree field names to
        tensors taken as they are (the re-export in ``treecompile.save``).
        """
        if isinstance(batch, Mapping):
            ids = batch["input_ids"]
            args = [ids if name == self.input_name else None for name in self.user_inputs]
            return args + [batch[name] for name in self.tree_inputs]
        args = [batch.input_ids[None] if name == self.input_name else None for name in self.user_inputs]
        for name in self.tree_inputs:
            if name == "conv_index" and batch.conv_index.shape[1] != self.conv_width:
                args.append(ancestor_index(batch.pred_index, self.conv_width))
            else:
                args.append(getattr(batch, name))
        return args

    def inputs(self, batch: TreeBatch | Mapping[str, torch.Tensor], tensors: nn.Module | None = None) -> list:
        """All inputs of the rewritten graph for ``batch``: the lifted values, then :meth:`batch_args`."""
        return [self.lifted_value(x, tensors) for x in self.lifted] + self.batch_args(batch)

    # ------------------------------------------------------------------ split
    def split_at(self, owners: Sequence[str], aliases: dict[str, list[str]] | None = None) -> None:
        """Run each FQN in ``owners``' part of the graph through that module's ``__call__`` (see
        ``TreeModel.split_at``); ``aliases``: FQN -> other names of the same tensor (tied weights)."""
        self.split_owners = list(owners)
        self._aliases = dict(aliases or {})
        self._cuda = self._cuda_flex = None
        # built now: a graph that cannot be split fails here, not at the first step
        self._cpu_split = self.split_graph(self.graph_module) if self.split_owners else None

    def split_graph(self, graph_module: fx.GraphModule, wrap=lambda gm: gm) -> SplitGraph:
        """``graph_module`` (the rewritten graph or its CUDA lowering) cut at the ``split_at``
        modules, each segment passed through ``wrap`` (e.g. ``torch.compile``) once."""
        lifted_fqn = {x.name: x.target for x in self.lifted}
        segments = split_by_modules(graph_module, self.split_owners, lifted_fqn, self._aliases)
        nodes = list(graph_module.graph.nodes)
        (result,) = [n.args[0] for n in nodes if n.op == "output"]
        return SplitGraph(segments=[(seg, wrap(seg.graph_module)) for seg in segments],
                          batch_names=[n.name for n in nodes if n.op == "placeholder"
                                       and n.name not in self._lifted_by_name],
                          result=[a.name for a in result])

    def _run_segments(self, split: SplitGraph, batch_args: list) -> tuple:
        """A module's segment through ``module.__call__``, with its lifted values looked up inside
        the call (after the module's pre-forward hooks, e.g. FSDP2's all-gather)."""
        if len(split.batch_names) != len(batch_args):
            raise RuntimeError(f"graph takes {len(split.batch_names)} batch inputs, got {len(batch_args)}")
        env = dict(zip(split.batch_names, batch_args))

        def lifted(seg):
            return [self.lifted_value(self._lifted_by_name[name]) for name in seg.lifted]

        for seg, fn in split.segments:
            ins = [env[name] for name in seg.inputs]
            if seg.owner is None:
                out = fn(*lifted(seg), *ins)
            else:
                module = self.model.get_submodule(seg.owner)

                def forward(*args, _seg=seg, _fn=fn):
                    return _fn(*lifted(_seg), *args)

                had = "forward" in module.__dict__
                saved = module.__dict__.get("forward")
                module.forward = forward
                try:
                    out = module(*ins)
                finally:
                    if had:
                        module.forward = saved
                    else:
                        del module.forward
            env.update(zip(seg.outputs, out))
        return tuple(env[name] for name in split.result)

    # ------------------------------------------------------------------ running
    def run(self, batch: TreeBatch | Mapping[str, torch.Tensor], boundary_inputs: Sequence = (), *,
            tensors: nn.Module | None = None, lower: bool = True) -> tuple:
        """Run the program on ``batch``; returns the graph's outputs as a tuple.

        Outputs: ``(loss [], logprobs [T])``, then for a boundary program the tensors
        ``boundary.outputs`` lists.  ``boundary_inputs``: one tensor per ``boundary.inputs`` entry
        (boundary programs only).  A TreeBatch is moved to the model's device.  ``tensors``: look the
        lifted values up on this module instead of the model (by FQN).  ``lower=False``: run the
        rewritten graph as it is on any device (what ``treecompile.save`` re-exports), never its
        CUDA lowering.
        """
        boundary_inputs = list(boundary_inputs)
        want = 0 if self.boundary is None else len(self.boundary.inputs)
        if len(boundary_inputs) != want:
            raise TypeError(f"this program takes {want} boundary inputs, got {len(boundary_inputs)}"
                            + ("" if want else " (compile with treecompile.compile(model, boundary=True))"))
        if isinstance(batch, TreeBatch) and tensors is None:
            batch = self._on_device(batch)
        if lower and self.device.type == "cuda":
            return self._run_cuda(batch, boundary_inputs)
        args = self.batch_args(batch) + boundary_inputs
        if self._cpu_split is not None and tensors is None:
            return self._run_segments(self._cpu_split, args)
        lifted = self.lifted_values() if tensors is None else [self.lifted_value(x, tensors) for x in self.lifted]
        return tuple(self.graph_module(*lifted, *args))

    def _cuda_state(self, varlen: bool = True) -> _CudaState:
        """The CUDA lowering and its runner, made on first use.  ``varlen=False``: the lowering with every tree
        attention on flex, for batches the varlen op's segments cannot take (:meth:`_run_cuda`)."""
        state = self._cuda if varlen else self._cuda_flex
        if state is None:
            lowering = lower_cuda(self.graph_module, self.options, boundary=self.boundary is not None,
                                  constants=self.constant_inputs(), varlen=varlen)

            wrap = functools.partial(compile_lowered, lowering)
            run = self.split_graph(lowering.graph_module, wrap=wrap) if self.split_owners \
                else wrap(lowering.graph_module)
            state = _CudaState(lowering, run)
            if varlen:
                self._cuda = state
            else:
                self._cuda_flex = state
        return state

    def _run_cuda(self, batch, boundary_inputs: list) -> tuple:
        state = self._cuda_state()
        T = batch.seq_len
        # the host work before the graph: one intra-op thread (host_values.single_threaded), restored before the
        # compiled region's entry, whose guards hold the thread count
        with single_threaded(bucket_length(T)):
            state, args = self._graph_inputs(state, batch, boundary_inputs)
        with torch._dynamo.config.patch(**dynamo_config(self.options)), \
                torch.profiler.record_function("treecompile::graph"):
            if isinstance(state.run, SplitGraph):
                out = self._run_segments(state.run, args)
            else:
                out = tuple(state.run(*self.lifted_values(), *args))
        return self.unpadded_outputs(out, T) if state.lowering.bucket else out

    def prepare(self, batch: TreeBatch) -> TreeBatch:
        """Do now the host work of a later :meth:`run` of ``batch``: its move to the model's device, the padding to
        its bucket, the block masks and host tables, and the ops' host plans (varlen attention, fla GDN and conv:
        ``lower_cuda.prepare_plans``).  Returns the batch on the device.  A run of the same batch (this one or the returned one)
        with its tensors unchanged finds that work done; a run of another batch, or of this one changed in place,
        does its own as without this call.  What is kept is one batch's worth (the last one prepared or run), so
        the pattern is: prepare the next batch after this one's backward, while the GPU runs it
        (``TreeModel.prepare``).  Nothing to do off CUDA (``batch`` is returned).  A boundary program's inputs are
        not kept (TypeError)."""
        if self.boundary is not None:
            raise TypeError("prepare: a boundary program (compile(model, boundary=True)) runs through "
                            "treecompile.runtime.redundancy_free, which prepares nothing")
        if self.device.type != "cuda":
            return batch
        batch = self._on_device(batch)
        self._prepare_cuda(batch)
        return batch

    def _on_device(self, batch: TreeBatch) -> TreeBatch:
        """``batch`` on the model's device: itself when it is there, else :meth:`_moved_batch`."""
        return batch if batch.input_ids.device == self.device else self._moved_batch(batch)

    def _moved_batch(self, batch: TreeBatch) -> TreeBatch:
        """``batch.to(self.device)``, kept for the last batch moved while its tensors and their copies are unchanged:
        a batch prepared ahead is not moved again by its run.  (Keyed on the tensors the graph's inputs come from;
        the moved batch's ``extras`` are those of the first batch object moved, which nothing here reads.)"""

        def move():
            moved = batch.to(self.device)
            return moved, [t._version for t in _batch_tensors(moved)]

        # the current stream: the copies are made on it (LastBatch keys CUDA tensors so; these are the host's)
        key = (self.device, device_stream(self.device))
        moved, versions = self._moved.get(_batch_tensors(batch), key, move)
        if [t._version for t in _batch_tensors(moved)] != versions:  # the copy was changed in place
            self._moved.clear()
            moved, _ = self._moved.get(_batch_tensors(batch), key, move)
        return moved

    def _prepare_cuda(self, batch: TreeBatch) -> None:
        with single_threaded(bucket_length(batch.seq_len)):
            state, args = self._graph_inputs(self._cuda_state(), batch, [])
            prepare_plans(state.lowering, dict(zip(self._tree_names, args[len(self.user_inputs):])))

    def _graph_inputs(self, state: _CudaState, batch, boundary_inputs: list) -> tuple[_CudaState, list]:
        """:meth:`_cuda_inputs`, kept for the last batch (its TreeBatch tensors, unchanged, and the lowering), so that
        :meth:`prepare` and the run of the same batch build them once (a boundary program's call, with boundary
        inputs, is not kept); then the shifted convs' table of the batch's ``conv_index``."""
        if boundary_inputs or not isinstance(batch, TreeBatch):
            state, args = self._cuda_inputs(state, batch, boundary_inputs)
        else:
            state, args = self._inputs.get(_batch_tensors(batch), id(state),
                                           lambda: self._cuda_inputs(state, batch, boundary_inputs))
        if state.lowering.conv_shifts and "conv_index" in self.tree_inputs:
            # its host-side table, before the graph, on every call (kept per tensor: found when another program
            # did not build its own since): else the first conv backward makes it, after a host sync
            tree_conv_shifts.prepare(args[len(self.user_inputs) + self.tree_inputs.index("conv_index")])
        return state, args

    def _cuda_inputs(self, state: _CudaState, batch, boundary_inputs: list) -> tuple[_CudaState, list]:
        """(the lowering that runs ``batch``, the graph's inputs after the lifted values): the batch padded to its
        bucket, then its block masks and host tables."""
        T = batch.seq_len
        if state.lowering.bucket:
            # named host ranges (here, the graph call below, the attention plan) let a profile name the GPU's idle
            # gaps by what the host did then (benchmarks/prof_step.py); next to nothing when no profiler runs
            with torch.profiler.record_function("treecompile::pad_batch"):
                batch, boundary_inputs = self.padded_call(batch, boundary_inputs, bucket_length(T))
        if state.lowering.attention_segments_only and not segments_fit(batch.subtree_end):
            # "auto" put a head dim without block-sparse FA4 tiles on the varlen op's segments, and this batch's
            # tree would gather past their bound (a long spine with many short branches): the flex lowering
            warn_once("attention_kernel='auto': a batch whose varlen segments would gather past the op's bound "
                      "(varlen_tree_attention.MAX_GATHER_FACTOR) runs tree attention through flex's Triton kernel "
                      "(a second compiled graph; at head dims FA4's block-sparse tiles do not take)")
            state = self._cuda_state(varlen=False)
        mask_args = self._boundary_mask_args(boundary_inputs)
        if state.lowering.boundary_varlen and not boundary_segments_fit(
                batch.subtree_end, mask_args["boundary_visible"], mask_args["num_boundary"]):
            # a partition whose segments would each read the boundary again past the bound (many short segments
            # below a long boundary): the flex lowering
            warn_once("attention_kernel='auto'/'fa4_varlen': a redundancy-free partition whose varlen segments "
                      "would gather past varlen_tree_attention.VARLEN_GATHER_LIMIT x its rows runs its boundary "
                      "attention through flex's Triton kernel (a second graph)")
            state = self._cuda_state(varlen=False)
        args = self.batch_args(batch) + boundary_inputs
        args += attention_inputs(batch.subtree_end, state.lowering, position_ids=batch.position_ids, **mask_args)
        return state, args

    # ------------------------------------------------------------------ padding (CUDA buckets)
    def padded_call(self, batch: TreeBatch, boundary_inputs: Sequence, length: int) -> tuple[TreeBatch, list]:
        """``(batch, boundary_inputs)`` padded to ``length`` tokens; the outputs on the real tokens stay the same.

        The batch gets :meth:`TreeBatch.padded`'s padding tokens.  For a boundary program also: the
        ``pred_index``/``conv_index`` entries that read fed rows (``T + r``) move to ``length + r``,
        ``boundary_visible`` is padded with 0 (padding tokens see no boundary; its host values too), and the boundary
        K/V ``[1, Hkv, B, D]`` get zero rows up to ``bucket_length(B)`` (B > 0), never visible since
        ``boundary_visible <= B``; their gradients are the first B rows'.
        """
        T = batch.seq_len
        padded = batch.padded(length)
        if self.boundary is None:
            return padded, list(boundary_inputs)
        shift = length - T

        def moved(idx):  # the host values follow (host_values): the conv tables then read no device tensor
            host = remembered_host(idx)
            out = torch.where(idx >= T, idx + shift, idx)
            return out if host is None else remember_host(out, torch.where(host >= T, host + shift, host))

        padded = dataclasses.replace(padded, pred_index=moved(padded.pred_index), conv_index=moved(padded.conv_index))
        out = []
        for (kind, _), x in zip(self.boundary.inputs, boundary_inputs):
            if kind == "boundary_visible":  # its host values follow, as the indices' do
                host = remembered_host(x)
                x = F.pad(x, (0, shift))
                x = x if host is None else remember_host(x, F.pad(host, (0, shift)))
            elif kind in ("boundary_k", "boundary_v") and x.shape[2]:
                x = F.pad(x, (0, 0, 0, bucket_length(x.shape[2]) - x.shape[2]))
            out.append(x)
        return padded, out

    def unpadded_outputs(self, out: Sequence, num_tokens: int) -> tuple:
        """The outputs of a :meth:`padded_call` cut back to ``num_tokens``: every output after the loss that is
        per token (log-probs, entropy, router logits); a boundary program's exports keep their padded
        length (the runtime reads their rows by local position)."""
        per_token = len(out) if self.boundary is None else 2 + self.boundary.kept
        return (out[0], *(x[:num_tokens] for x in out[1:per_token]), *out[per_token:])

    def _boundary_mask_args(self, boundary_inputs: Sequence) -> dict:
        """What a boundary program's block mask is built from: ``boundary_visible`` and the K/V rows fed."""
        if self.boundary is None or ("boundary_visible", -1) not in self.boundary.inputs:
            return {}
        kinds = self.boundary.inputs
        return {"boundary_visible": boundary_inputs[kinds.index(("boundary_visible", -1))],
                "num_boundary": int(boundary_inputs[kinds.index(("boundary_k", 0))].shape[2])}
