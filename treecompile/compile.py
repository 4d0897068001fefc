"""``treecompile.compile(model)``: capture, rewrite, and wrap as a module that trains on TreeBatches.

``TreeModel`` shares the model's parameters: it adopts the model's child modules under the same
names, so ``tmodel.parameters()`` are ``model.parameters()`` and the state_dict keys are unchanged.
The rewritten graph is the *lifted* exported program: parameters are inputs, looked up on the model
at every call (so optimizers, ``load_state_dict`` and FSDP's parameter swaps are seen).

Execution is chosen explicitly by device: on CPU the graph runs eagerly (tests, float64
exactness); on CUDA ``tree_attention`` is lowered to FlexAttention with a BlockMask built from the
batch, and the graph runs under ``torch.compile`` with sequence lengths padded to buckets so that a
stream of tree sizes causes a bounded number of recompiles.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.export.graph_signature import InputKind

from treecompile.frontend import Captured, capture
from treecompile.passes import PassContext, run_passes
from treecompile.passes.base import TREE_INPUTS
from treecompile.passes.pipeline import BOUNDARY_PASSES
from treecompile.tree import TreeBatch, ancestor_index

__all__ = ["compile", "TreeModel", "TreeOutput", "bucket_length"]

# Gated DeltaNet kernel on CUDA: "fla" (flash-linear-attention, one varlen call per tree level),
# "reference" (the registered op's torch implementation), "auto" (fla if installed, else reference
# with a warning).  On CPU the reference always runs.
GDN_KERNELS = ("auto", "fla", "reference")


@dataclass
class TreeOutput:
    loss: torch.Tensor  # scalar: -(loss_weight * logprobs).sum()
    logprobs: torch.Tensor  # [T] log p(token | path prefix) in DFS order; 0 at roots and padding


# A pytree node, so that wrappers that look for output tensors with pytree find them: FSDP2 (torch
# 2.11) registers its pre-backward hook -- which queues the root's reduce-scatter -- on the tensors
# ``tree_flatten`` finds in the output; an opaque dataclass left gradients unreduced on the root.
torch.utils._pytree.register_pytree_node(
    TreeOutput, lambda o: ([o.loss, o.logprobs], None), lambda xs, _: TreeOutput(*xs),
    serialized_type_name="treecompile.TreeOutput")


def bucket_length(T: int, *, min_bucket: int = 256, steps_per_octave: int = 8) -> int:
    """Round ``T`` up to a bucket: multiples of 2^(floor(log2 T)) / steps_per_octave (>= min_bucket).

    Padding is below 1/steps_per_octave of T, and lengths up to L fall in about
    steps_per_octave * log2(L / min_bucket) buckets, one compiled graph each.
    """
    if T <= min_bucket:
        return min_bucket
    step = max(min_bucket, (1 << (T.bit_length() - 1)) // steps_per_octave)
    return math.ceil(T / step) * step


class TreeModel(nn.Module):
    """A causal LM rewritten for tree batches: ``out = tmodel(batch)`` -> ``TreeOutput``."""

    def __init__(self, model: nn.Module, *, disable: tuple[str, ...] = (), debug: bool = False,
                 logits_chunk: int | None = None, compile_cuda: bool = True, swaps: list | None = None,
                 bucket: bool = True, boundary: bool = False, gdn_kernel: str = "auto",
                 allow_dropout: bool = False):
        super().__init__()
        captured: Captured = capture(model, swaps=swaps)
        ep = captured.program
        if ep.graph_signature.buffers_to_mutate:
            raise ValueError(f"{type(model).__name__} mutates buffers in forward "
                             f"({sorted(ep.graph_signature.buffers_to_mutate.values())}); not supported")
        gm = ep.graph_module
        ctx = PassContext(gm, captured.input_name, {"logits_chunk": logits_chunk, "allow_dropout": allow_dropout})
        results = run_passes(gm, ctx, disable=disable, debug=debug,
                             passes=BOUNDARY_PASSES if boundary else None)
        tree_inputs = [n.name[len("tree_"):] for n in gm.graph.nodes
                       if n.op == "placeholder" and n.name.startswith("tree_") and n.name[5:] in TREE_INPUTS]
        user_inputs = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        self._bind(model, ep, input_name=captured.input_name, user_inputs=user_inputs, tree_inputs=tree_inputs,
                   conv_width=ctx.conv_width, pass_results=results, compile_cuda=compile_cuda, bucket=bucket,
                   gdn_kernel=gdn_kernel)

    @classmethod
    def from_program(cls, model: nn.Module, program, *, input_name: str, user_inputs: list[str],
                     tree_inputs: list[str], conv_width: int | None, pass_results: dict,
                     compile_cuda: bool = True, bucket: bool = True, gdn_kernel: str = "auto") -> "TreeModel":
        """A TreeModel around an already rewritten, lifted ``program`` (no capture, no passes).

        Used by ``treecompile.load``: ``model`` holds the tensors the program's lifted placeholders
        name (by FQN); the program's inputs are the lifted ones, then ``user_inputs``, then
        ``tree_<field>`` for each of ``tree_inputs``.
        """
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._bind(model, program, input_name=input_name, user_inputs=user_inputs, tree_inputs=tree_inputs,
                   conv_width=conv_width, pass_results=pass_results, compile_cuda=compile_cuda, bucket=bucket,
                   gdn_kernel=gdn_kernel)
        return self

    def _bind(self, model, program, *, input_name, user_inputs, tree_inputs, conv_width, pass_results,
              compile_cuda, bucket, gdn_kernel):
        """Adopt ``model``'s children (shared parameters, unchanged state_dict keys) and hold the program."""
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b)
        object.__setattr__(self, "model", model)  # the user's module, not registered twice
        object.__setattr__(self, "graph_module", program.graph_module)
        object.__setattr__(self, "exported_program", program)
        self.pass_results = dict(pass_results)
        self.boundary = self.pass_results["expose_boundary"].info if "expose_boundary" in self.pass_results else None
        self._lifted = [(s.kind, s.target) for s in program.graph_signature.input_specs
                        if s.kind != InputKind.USER_INPUT]
        self._user_inputs, self._input_name = list(user_inputs), input_name
        self._tree_inputs, self._conv_width = list(tree_inputs), conv_width
        if gdn_kernel not in GDN_KERNELS:
            raise ValueError(f"gdn_kernel: expected one of {GDN_KERNELS}, got {gdn_kernel!r}")
        self._compile_cuda, self._bucket, self._gdn_kernel = compile_cuda, bucket, gdn_kernel
        self._lifted_by_name = {s.arg.name: (s.kind, s.target) for s in program.graph_signature.input_specs
                                if s.kind != InputKind.USER_INPUT}
        self._split_owners: list[str] = []
        self.vocab_size = input_vocab_size(program.graph_module, input_name, self.pass_results)

    def split_at(self, modules) -> "TreeModel":
        """Run each of ``modules``' part of the graph through that module's own ``__call__``.

        ``modules``: submodules of the model (e.g. ``model.model.layers``), disjoint.  The graph is
        cut into consecutive segments (``passes.split_modules``); a module's segment runs as that
        module's forward, so hooks registered on it fire around its part of the step: FSDP2's
        per-layer all-gather/reshard/reduce-scatter (``runtime.distributed.fully_shard_tree_model``
        calls this), forward/backward hooks.  Each segment reads the module's parameters only inside
        the call.  On CUDA every segment is compiled on its own (as torchtitan compiles per block).
        ``split_at(())`` undoes the split.  Returns ``self``.
        """
        names = {id(m): n for n, m in self.model.named_modules()}
        owners = []
        for i, m in enumerate(modules):
            if id(m) not in names or names[id(m)] == "":
                raise ValueError(f"modules[{i}] ({type(m).__name__}) is not a submodule of the compiled model")
            owners.append(names[id(m)])
        self._split_owners = owners
        self.__dict__.pop("_cuda_state", None)
        # built now: a graph that cannot be split fails here, not at the first step
        self.__dict__["_cpu_split"] = self.split_graph(self.graph_module) if owners else None
        return self

    def split_graph(self, graph_module, wrap=lambda gm: gm) -> "SplitGraph":
        """``graph_module`` (the rewritten graph or its CUDA lowering) cut at the ``split_at``
        modules, each segment passed through ``wrap`` (e.g. ``torch.compile``) once."""
        from treecompile.passes.split_modules import split_by_modules

        lifted_fqn = {name: target for name, (_kind, target) in self._lifted_by_name.items()}
        segments = split_by_modules(graph_module, self._split_owners, lifted_fqn, self._aliases())
        nodes = list(graph_module.graph.nodes)
        (result,) = [n.args[0] for n in nodes if n.op == "output"]
        return SplitGraph(segments=[(seg, wrap(seg.graph_module)) for seg in segments],
                          batch_names=[n.name for n in nodes if n.op == "placeholder"
                                       and n.name not in self._lifted_by_name],
                          result=[a.name for a in result])

    def _aliases(self) -> dict[str, list[str]]:
        """FQN -> the other names of the same tensor in the model (tied weights)."""
        names: dict[int, list[str]] = {}
        for n, t in [*self.model.named_parameters(remove_duplicate=False),
                     *self.model.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(t), []).append(n)
        return {n: [m for m in group if m != n] for group in names.values() if len(group) > 1 for n in group}

    # ------------------------------------------------------------------ running
    def _lifted_value(self, kind, target):
        if kind == InputKind.PARAMETER:
            return self.model.get_parameter(target)
        if kind == InputKind.BUFFER:
            return self.model.get_buffer(target)
        return self.exported_program.constants[target]

    def _lifted_values(self):
        return [self._lifted_value(kind, target) for kind, target in self._lifted]

    def graph_inputs(self, batch: TreeBatch) -> list:
        """The flat inputs of the rewritten graph for ``batch`` (parameters first)."""
        return self._lifted_values() + self.batch_inputs(batch)

    def batch_inputs(self, batch: TreeBatch) -> list:
        """The graph inputs that come from ``batch`` (after the lifted parameters, in order)."""
        args = []
        for name in self._user_inputs:
            args.append(batch.input_ids[None] if name == self._input_name else None)
        for name in self._tree_inputs:
            if name == "conv_index" and batch.conv_index.shape[1] != self._conv_width:
                args.append(ancestor_index(batch.pred_index, self._conv_width))
            else:
                args.append(getattr(batch, name))
        return args

    @property
    def device(self) -> torch.device:
        p = next(self.model.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    def forward(self, batch: TreeBatch) -> TreeOutput:
        if not isinstance(batch, TreeBatch):
            raise TypeError(f"TreeModel expects a treecompile.TreeBatch, got {type(batch).__name__}")
        if self.boundary is not None:
            raise TypeError("this TreeModel was compiled with boundary=True (partition graph); run it through "
                            "treecompile.runtime.redundancy_free.run_redundancy_free")
        batch.check_ids(self.vocab_size)  # an id >= vocab is named here, not as an IndexError in the graph
        dev = self.device
        if batch.input_ids.device != dev:
            batch = batch.to(dev)
        if dev.type == "cuda":
            return self._forward_cuda(batch)
        if self._split_owners:
            loss, lp = run_segments(self, self.__dict__["_cpu_split"], self.batch_inputs(batch))
        else:
            loss, lp = self.graph_module(*self.graph_inputs(batch))
        return TreeOutput(loss=loss, logprobs=lp)

    def _forward_cuda(self, batch: TreeBatch) -> TreeOutput:
        from treecompile.cuda import run_cuda  # lazily: imports flex / inductor machinery

        return run_cuda(self, batch)

    def extra_repr(self) -> str:
        done = ", ".join(f"{k}={v.count}" for k, v in self.pass_results.items())
        return f"passes: {done}"


@dataclass
class SplitGraph:
    """A graph cut by :meth:`TreeModel.split_graph`, with what running it needs precomputed."""

    segments: list  # [(passes.split_modules.Segment, callable)], in graph order
    batch_names: list[str]  # the graph's non-lifted placeholders, in order (fed from the batch)
    result: list[str]  # names of the graph's outputs


def run_segments(tmodel: TreeModel, split: SplitGraph, batch_args: list):
    """Run a split graph: a module's segment through ``module.__call__``, with its lifted values
    looked up inside the call (after the module's pre-forward hooks, e.g. FSDP2's all-gather)."""
    if len(split.batch_names) != len(batch_args):
        raise RuntimeError(f"graph takes {len(split.batch_names)} batch inputs, got {len(batch_args)}")
    env = dict(zip(split.batch_names, batch_args))

    def lifted(seg):
        return [tmodel._lifted_value(*tmodel._lifted_by_name[name]) for name in seg.lifted]

    for seg, fn in split.segments:
        ins = [env[name] for name in seg.inputs]
        if seg.owner is None:
            out = fn(*lifted(seg), *ins)
        else:
            module = tmodel.model.get_submodule(seg.owner)

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


def input_vocab_size(gm, input_name: str, pass_results: dict) -> int | None:
    """The ids the graph accepts: rows of the embedding that reads ``input_name``, and the logits' width
    (the ids are also the loss's targets); None where the graph shows neither."""
    sizes = [n.args[0].meta["val"].shape[0] for n in gm.graph.nodes
             if n.op == "call_function" and n.target == torch.ops.aten.embedding.default
             and getattr(n.args[1], "name", None) == input_name and "val" in n.args[0].meta]
    loss = pass_results.get("rewrite_loss")
    if loss is not None and isinstance(loss.info.get("vocab"), int):
        sizes.append(loss.info["vocab"])
    return min(int(v) for v in sizes) if sizes else None


def compile(model=None, *, disable: tuple[str, ...] = (), debug: bool = False,  # noqa: A001 (mirrors torch.compile)
            logits_chunk: int | None = None, compile_cuda: bool = True, bucket: bool = True,
            boundary: bool = False, gdn_kernel: str = "auto", swaps: list | None = None,
            allow_dropout: bool = False):
    """Rewrite ``model`` for tree batches and return a :class:`TreeModel`.

    Usable as ``treecompile.compile(model, ...)``, or as a decorator (bare or with options) on an
    ``nn.Module`` subclass (instances come out compiled) or on a function that returns a module.

    Args:
        disable: pass names to skip (see ``treecompile.passes.pipeline``).
        debug: log each pass's time and what it changed.
        logits_chunk: rows of logits per chunk in the fused loss (default: ~256 MiB of float32).
        compile_cuda: on CUDA, run the graph under ``torch.compile`` (else eagerly, flex compiled).
        bucket: on CUDA, pad sequence lengths to buckets (bounded recompiles).
        boundary: build the partition graph that takes and returns a partition's boundary tensors,
            for ``treecompile.runtime.redundancy_free``.
        gdn_kernel: ``"auto"``, ``"fla"`` or ``"reference"``: the Gated DeltaNet kernel on CUDA.
        swaps: context managers entered during capture (default: ``frontend.kernel_swaps(model)``).
        allow_dropout: accept active dropout (one mask per shared token, so gradients equal the
            per-path ones only in expectation); by default it is refused.

    Capture bakes the model's train/eval mode into the graph: compile in the mode you train in.
    """
    options = dict(disable=disable, debug=debug, logits_chunk=logits_chunk, compile_cuda=compile_cuda,
                   bucket=bucket, boundary=boundary, gdn_kernel=gdn_kernel, swaps=swaps, allow_dropout=allow_dropout)
    if model is None:
        return functools.partial(compile, **options)
    if isinstance(model, nn.Module):
        return TreeModel(model, **options)
    if inspect.isclass(model) and issubclass(model, nn.Module):
        cls = model

        @functools.wraps(cls, updated=())
        def build(*args, **kwargs):
            return TreeModel(cls(*args, **kwargs), **options)

        return build
    if callable(model):
        fn = model

        @functools.wraps(fn)
        def build_fn(*args, **kwargs):
            m = fn(*args, **kwargs)
            if not isinstance(m, nn.Module):
                raise TypeError(f"@treecompile.compile: {fn.__name__} returned {type(m).__name__}, not an nn.Module")
            return TreeModel(m, **options)

        return build_fn
    raise TypeError(f"treecompile.compile expects an nn.Module, a Module class or a factory; got {type(model).__name__}")
