"""``treecompile.compile(model)``: capture, rewrite, and wrap as a module that trains on TreeBatches.

``TreeModel`` shares the model's parameters: it adopts the model's child modules under the same
names, so ``tmodel.parameters()`` are ``model.parameters()`` and the state_dict keys are unchanged.
The rewritten graph is the *lifted* exported program: parameters are inputs, looked up on the model
at every call (so optimizers, ``load_state_dict`` and FSDP's parameter swaps are seen).

The program and the one way to run it live in ``treecompile/program.py`` (``TreeProgram.run``);
execution is chosen there by device: on CPU the graph runs eagerly (tests, float64 exactness); on
CUDA its lowering (``passes/lower_cuda.py``, chosen by typed ``CudaOptions``) runs.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from treecompile.frontend import Captured, capture
from treecompile.passes import PassContext, run_passes
from treecompile.passes.base import TREE_INPUTS, CompileOptions
from treecompile.passes.lower_cuda import CudaOptions
from treecompile.passes.pipeline import BOUNDARY_PASSES, check_disable
from treecompile.program import TreeProgram, bucket_length
from treecompile.traced_modules import TracedModules
from treecompile.tree import TreeBatch

__all__ = ["compile", "TreeModel", "TreeOutput", "bucket_length"]  # bucket_length: from treecompile.program


@dataclass
class TreeOutput:
    loss: torch.Tensor  # scalar: -(loss_weight * logprobs).sum()
    logprobs: torch.Tensor  # [T] log p(token | path prefix) in DFS order; 0 at roots and padding
    # [T] entropy of the distribution that predicts each token (read where logprobs is), 0 where
    # logprobs is 0; None unless compiled with entropy=True
    entropy: torch.Tensor | None = None
    # the MoE router auxiliary loss on the tree (compile(router_aux="batch"|"path")), already added
    # to loss times the model's coefficient; None otherwise
    aux_loss: torch.Tensor | None = None
    # the router z-loss (a model config's router_z_loss_coef > 0), likewise added times its coefficient
    z_loss: torch.Tensor | None = None


# A pytree node, so that wrappers that look for output tensors with pytree find them: FSDP2 (torch
# 2.11) registers its pre-backward hook -- which queues the root's reduce-scatter -- on the tensors
# ``tree_flatten`` finds in the output; an opaque dataclass left gradients unreduced on the root.
def _flatten_output(o: TreeOutput):
    optional = (o.entropy, o.aux_loss, o.z_loss)
    return [o.loss, o.logprobs, *(x for x in optional if x is not None)], tuple(x is not None for x in optional)


def _unflatten_output(xs, present) -> TreeOutput:
    rest = iter(xs[2:])
    return TreeOutput(xs[0], xs[1], *(next(rest) if p else None for p in present))


torch.utils._pytree.register_pytree_node(
    TreeOutput, _flatten_output, _unflatten_output,
    serialized_type_name="treecompile.TreeOutput")


class TreeModel(nn.Module):
    """A causal LM rewritten for tree batches: ``out = tmodel(batch)`` -> ``TreeOutput``.

    ``tmodel.program`` (a :class:`~treecompile.program.TreeProgram`) holds the rewritten graph and
    runs it; ``program.boundary`` is set for a partition graph (``boundary=True``), which runs only
    through ``treecompile.runtime.redundancy_free``.
    """

    def __init__(self, model: nn.Module, *, disable: tuple[str, ...] = (), debug: bool = False,
                 logits_chunk: int | None = None, compile_cuda: bool = True, swaps: list | None = None,
                 bucket: bool = True, boundary: bool = False, gdn_kernel: str = "auto",
                 allow_dropout: bool = False, entropy: bool = False, router_aux: str | None = None,
                 attention_kernel: str = "auto", attention_layout: str = "dfs", conv_kernel: str = "auto",
                 head_logits: str = "auto", attention_keys: str = "auto"):
        super().__init__()
        options = CudaOptions(compile_cuda=compile_cuda, bucket=bucket, gdn_kernel=gdn_kernel,
                              attention_kernel=attention_kernel, attention_layout=attention_layout,
                              conv_kernel=conv_kernel, head_logits=head_logits, attention_keys=attention_keys)
        check_disable(disable, BOUNDARY_PASSES if boundary else None)  # a misspelt pass name: before the capture
        if logits_chunk is not None and (isinstance(logits_chunk, bool) or not isinstance(logits_chunk, int)
                                         or logits_chunk < 1):
            raise ValueError(f"logits_chunk must be a positive number of rows or None (the head picks), "
                             f"got {logits_chunk!r}")
        captured: Captured = capture(model, swaps=swaps)
        ep = captured.program
        if ep.graph_signature.buffers_to_mutate:
            raise ValueError(f"{type(model).__name__} mutates buffers in forward "
                             f"({sorted(ep.graph_signature.buffers_to_mutate.values())}); not supported")
        gm = ep.graph_module
        ctx = PassContext(gm, captured.input_name,
                          CompileOptions(logits_chunk=logits_chunk, allow_dropout=allow_dropout, entropy=entropy,
                                         router_aux=router_aux, output_names=_output_names(ep)))
        results = run_passes(gm, ctx, disable=disable, debug=debug,
                             passes=BOUNDARY_PASSES if boundary else None)
        tree_inputs = [n.name[len("tree_"):] for n in gm.graph.nodes
                       if n.op == "placeholder" and n.name.startswith("tree_") and n.name[5:] in TREE_INPUTS]
        user_inputs = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        spec = results["expose_boundary"].spec if "expose_boundary" in results else None
        program = TreeProgram(model, ep, input_name=captured.input_name, user_inputs=user_inputs,
                              tree_inputs=tree_inputs, conv_width=ctx.conv_width, boundary=spec, options=options)
        self._bind(model, program, results)
        rr = results.get("rewrite_router_loss")
        if rr is not None and rr.info.get("router_logits"):
            from treecompile.router_aux import RouterAux

            self.router_aux = RouterAux.from_model(model, router_aux)

    @classmethod
    def from_program(cls, model: nn.Module, program: ExportedProgram, *, input_name: str, user_inputs: list[str],
                     tree_inputs: list[str], conv_width: int | None, pass_results: dict,
                     options: CudaOptions = CudaOptions()) -> "TreeModel":
        """A TreeModel around an already rewritten, lifted ``program`` (no capture, no passes).

        Used by ``treecompile.load``: ``model`` holds the tensors the program's lifted placeholders
        name (by FQN); the program's inputs are the lifted ones, then ``user_inputs``, then
        ``tree_<field>`` for each of ``tree_inputs``.
        """
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._bind(model, TreeProgram(model, program, input_name=input_name, user_inputs=user_inputs,
                                      tree_inputs=tree_inputs, conv_width=conv_width, options=options),
                   pass_results)
        return self

    def _bind(self, model: nn.Module, program: TreeProgram, pass_results: dict) -> None:
        """Adopt ``model``'s children (shared parameters, unchanged state_dict keys) and hold the program."""
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for name, b in model.named_buffers(recurse=False):
            self.register_buffer(name, b)
        object.__setattr__(self, "model", model)  # the user's module, not registered twice
        # the modules the graph was traced through, as they were then (_check_bound), and the root tensors' names
        object.__setattr__(self, "_bound_children", dict(model.named_children()))
        object.__setattr__(self, "_root_tensors", frozenset(self._parameters) | frozenset(self._buffers))
        object.__setattr__(self, "_traced", TracedModules(model))  # what the graph computes (_check_bound)
        object.__setattr__(self, "program", program)
        self.pass_results = dict(pass_results)
        self.router_aux = None  # a router_aux.RouterAux when the graph returns router logits
        self.vocab_size = input_vocab_size(program.graph_module, program.input_name, self.pass_results)

    @property
    def graph_module(self):
        """The rewritten graph (``program.graph_module``)."""
        return self.program.graph_module

    @property
    def exported_program(self) -> ExportedProgram:
        return self.program.exported_program

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
            hooks = self._traced.traced_hooks(m)
            if hooks:
                raise ValueError(f"split_at: {names[id(m)]!r} has {hooks} forward hook(s) or pre-hook(s) registered "
                                 "before treecompile.compile: the graph holds what they did, and running the module's "
                                 "call for its part of the graph would run them again; remove them (the graph keeps "
                                 "their effect), or register them before compile on a module that is not split")
            owners.append(names[id(m)])
        self.program.split_at(owners, self._aliases())
        return self

    def _aliases(self) -> dict[str, list[str]]:
        """FQN -> the other names of the same tensor in the model (tied weights)."""
        names: dict[int, list[str]] = {}
        for n, t in [*self.model.named_parameters(remove_duplicate=False),
                     *self.model.named_buffers(remove_duplicate=False)]:
            names.setdefault(id(t), []).append(n)
        return {n: [m for m in group if m != n] for group in names.values() if len(group) > 1 for n in group}

    @property
    def device(self) -> torch.device:
        return self.program.device

    def prepare(self, batch: TreeBatch) -> TreeBatch:
        """Do the host work of ``batch``'s step now: the id check, the move to the model's device, the padding to
        its length bucket, the block masks, and the plans of the varlen attention, fla GDN and fla conv ops
        (:meth:`TreeProgram.prepare`).  Returns
        the batch on the device (``batch`` itself off CUDA).  A later call of the model on either batch, this one
        or the returned one, finds that work done while their tensors are unchanged (a batch changed in place is
        prepared again by the call; results never depend on whether it was prepared).

        The use: while the GPU runs one step, prepare the next batch, so that its host work is off the step's
        critical path (a loop that synchronises every step, e.g. on ``loss.item()``, otherwise leaves the GPU
        idle for it)::

            tmodel.prepare(batches[0])
            for i, batch in enumerate(batches):
                loss = tmodel(batch).loss
                loss.backward()
                if i + 1 < len(batches):
                    tmodel.prepare(batches[i + 1])  # the host is ahead of the GPU here
                optimizer.step()
                optimizer.zero_grad()
                print(loss.item())  # a sync: the next step's host work is done already

        One batch is kept, the last one prepared or run: prepare the next batch after the current one's backward
        (before it, the backward's plans are built again).  ``train_step`` does this for the batches of a step."""
        self._check_batch(batch)
        with torch.profiler.record_function("treecompile::prepare"):
            batch.check_ids(self.vocab_size)
            return self.program.prepare(batch)

    def __setattr__(self, name, value):
        """A root parameter or buffer the TreeModel adopted, set on it (``tm.scale = ...``, ``load_state_dict(...,
        assign=True)``), is set on the model too: the graph reads the model's."""
        super().__setattr__(name, value)
        if name in self.__dict__.get("_root_tensors", ()):
            setattr(self.model, name, value)

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.double()``, ...: the children are the model's own; a root buffer the conversion replaced
        on the TreeModel is put on the model too."""
        out = super()._apply(fn, *args, **kwargs)
        for name in self.__dict__.get("_root_tensors", ()):
            for kind in ("_parameters", "_buffers"):
                if name in getattr(self, kind):
                    getattr(self.model, kind)[name] = getattr(self, kind)[name]
        return out

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint's hook for names its walk cannot follow by attribute: ``get_model_state_dict``
        / ``set_model_state_dict`` resolve a state-dict key ``a.b.c`` by ``getattr`` one part at a time, and
        ``tm.model`` is the user's module, not the adopted child called ``model`` (every HF CausalLM's), so
        ``model.layers.0...`` failed.  For each adopted child that an attribute of the TreeModel hides, DCP is sent
        through :attr:`_adopted_children` first, where the child is found by its name (the keys stay as they are)."""
        hidden = {}
        for name, child in self._modules.items():
            try:
                attr = object.__getattribute__(self, name)
            except AttributeError:  # reached through nn.Module's lookup: the child itself
                continue
            if attr is not child:
                hidden[name] = "_adopted_children"
        return hidden

    @property
    def _adopted_children(self) -> "_Children":
        """The adopted children by name, as attributes (:meth:`_fqn_modifiers`)."""
        return _Children(self._modules)

    def get_submodule(self, target: str) -> nn.Module:
        """The submodule ``target`` names, as ``named_modules()`` / ``state_dict()`` name it.  ``tm.model`` is the
        user's module, so an adopted child called ``model`` (every HF CausalLM's) is reached through
        ``_modules`` here: nn.Module's lookup would take ``tm.model`` and miss ``model.layers.0``."""
        if not target:
            return self
        head, _, rest = target.partition(".")
        child = self._modules.get(head)
        if child is None:
            return super().get_submodule(target)
        return child.get_submodule(rest) if rest else child

    def _check_bound(self) -> None:
        """The modules and root tensors this TreeModel adopted are still the model's: the graph reads the model's
        tensors by name and was traced through its modules, so a module replaced after compile (``m.lm_head =
        nn.Linear(...)``), or a root tensor replaced on the model alone (``m.scale = ...``), would leave the graph's
        computation or the optimizer's parameters behind without a word; below the root, the changes that
        :class:`~treecompile.traced_modules.TracedModules` lists (a nested module replaced, a bias set, tied weights
        untied, a forward patched) likewise."""
        model = self.model
        for name, child in self.__dict__.get("_bound_children", {}).items():
            if model._modules.get(name) is not child or self._modules.get(name) is not child:
                raise RuntimeError(f"the model's module {name!r} was replaced after treecompile.compile: the compiled "
                                   "graph computes the old one; compile the model again")
        for name, kind in (*((n, "_parameters") for n in self._parameters), *((n, "_buffers") for n in self._buffers)):
            if getattr(model, kind).get(name) is not getattr(self, kind).get(name):
                raise RuntimeError(f"the model's root {kind[1:-1]} {name!r} was replaced on the model after "
                                   "treecompile.compile: the graph reads the model's, the TreeModel's parameters() "
                                   "list the old one; assign it on the TreeModel (which sets both), or compile again")
        traced = self.__dict__.get("_traced")
        change = traced.change() if traced is not None else None
        if change is not None:  # below the root: what the graph would not follow (traced_modules)
            raise RuntimeError(f"{change} after treecompile.compile: the compiled graph computes the model as it was "
                               "traced; compile the model again")

    def _check_batch(self, batch) -> None:
        self._check_bound()
        if not isinstance(batch, TreeBatch):
            raise TypeError(f"TreeModel expects a treecompile.TreeBatch, got {type(batch).__name__}")
        if self.program.boundary is not None:
            raise TypeError("this TreeModel was compiled with boundary=True (partition graph); run it through "
                            "treecompile.runtime.redundancy_free.run_redundancy_free")
        boundary = batch.extras.get("boundary_index")
        if boundary is not None and len(boundary):
            raise ValueError("this batch is a redundancy-free partition whose tokens read context from the partitions "
                             f"above it ({len(boundary)} boundary tokens): a whole-tree program would run it without "
                             "that context; run the plan through treecompile.runtime.redundancy_free."
                             "run_redundancy_free (or train_step(..., mode='redundancy_free'))")

    def forward(self, batch: TreeBatch) -> TreeOutput:
        self._check_batch(batch)
        with torch.profiler.record_function("treecompile::check_ids"):
            batch.check_ids(self.vocab_size)  # an id >= vocab is named here, not as an IndexError in the graph
        res = self.program.run(batch)
        with torch.profiler.record_function("treecompile::tree_output"):
            return self.tree_output(res, batch)

    def tree_output(self, res: tuple, batch: TreeBatch) -> TreeOutput:
        """The graph's outputs ``(loss, logprobs[, entropy][, *router_logits])`` -> TreeOutput, with the
        router aux loss computed on the tree and added to the loss."""
        k = self._num_token_outputs()
        out = TreeOutput(*res[:k])
        if len(res) > k and self.router_aux is None:
            raise RuntimeError(f"the graph returns {len(res) - k} router-logits outputs but this TreeModel has no "
                               f"router_aux spec (a loaded program?): the router loss would be dropped")
        if self.router_aux is not None:
            out.aux_loss, out.z_loss = self.router_aux.loss(res[k:], batch)
            out.loss = out.loss + self.router_aux.weighted(out.aux_loss, out.z_loss).to(out.loss.dtype)
        return out

    def _num_token_outputs(self) -> int:
        """Outputs before the router logits: ``(loss, logprobs[, entropy])``."""
        info = self.pass_results["rewrite_loss"].info if "rewrite_loss" in self.pass_results else {}
        return 3 if info.get("entropy") else 2

    def router_counts(self, res: tuple, num_tokens: int) -> torch.Tensor:
        """Layer-summed top-k expert counts ``[num_tokens, E]`` (float64, CPU) of the graph's outputs
        ``res`` (``(loss, logprobs[, entropy], *router_logits)``), as the router loss counts them."""
        if self.router_aux is None:
            raise ValueError("router_counts: this model was not compiled with router_aux='batch' or 'path'")
        return self.router_aux.counts(res[self._num_token_outputs():], num_tokens)

    def extra_repr(self) -> str:
        done = ", ".join(f"{k}={v.count}" for k, v in self.pass_results.items())
        return f"passes: {done}"


def _output_names(ep) -> tuple[str, ...]:
    """Names of the captured program's flat outputs (``logits``, ``aux_loss``, ``router_logits.0``...)."""
    pytree = torch.utils._pytree
    spec = ep.call_spec.out_spec
    try:  # rebuild the output structure around the leaf indices, then read each leaf's key path
        flat, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(range(spec.num_leaves)), spec))
    except Exception:  # an output type that cannot be rebuilt from placeholders: no names
        return ("",) * spec.num_leaves
    names = [""] * spec.num_leaves
    for path, i in flat:
        names[i] = ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
    return tuple(names)


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
            allow_dropout: bool = False, entropy: bool = False, router_aux: str | None = None,
            attention_kernel: str = "auto", attention_layout: str = "dfs", conv_kernel: str = "auto",
            head_logits: str = "auto", attention_keys: str = "auto"):
    """Rewrite ``model`` for tree batches and return a :class:`TreeModel`.

    Usable as ``treecompile.compile(model, ...)``, or as a decorator (bare or with options) on an
    ``nn.Module`` subclass (instances come out compiled) or on a function that returns a module.

    Args:
        disable: pass names to skip (see ``treecompile.passes.pipeline``).
        debug: log each pass's time and what it changed.
        logits_chunk: rows of logits per chunk in the fused loss (default: the head op picks at run time,
            ``ops.logprobs.default_chunk``: ~256 MiB of float32 logits in the torch head, ~1 GiB of
            float32-equivalent (512 MiB of bf16 logits) in the CUDA Triton head).
        compile_cuda: on CUDA, run the graph under ``torch.compile`` (else eagerly, flex compiled).
        bucket: on CUDA, pad sequence lengths to buckets (bounded recompiles).
        boundary: build the partition graph that takes and returns a partition's boundary tensors,
            for ``treecompile.runtime.redundancy_free``.
        gdn_kernel: ``"auto"``, ``"fla"`` or ``"reference"``: the Gated DeltaNet kernel on CUDA.
        conv_kernel: ``"auto"``, ``"shifts"``, ``"shifts_inductor"``, ``"fla"`` or ``"reference"``: the tree's
            short convolution (GDN layers) on CUDA.  ``"shifts"``: a forward of shifted products that inductor
            fuses, the backward as Triton kernels (``ops.tree_conv_shifts``, ``ops.tree_conv_triton``);
            ``"shifts_inductor"``: the same forward, the backward as shifted products inductor fuses, the few
            non-shift context entries through one ``index_add``; ``"fla"``: fla's varlen conv over
            the tree's chains (float32/half inputs); ``"auto"``: ``"shifts"`` in a compiled graph, else ``"fla"``
            where the GDN kernel is fla, else the reference op.
        attention_kernel: ``"auto"``, ``"fa4"``, ``"flex"`` or ``"fa4_varlen"``: the tree attention kernel on
            CUDA (FlashAttention-4 needs ``treecompile[hopper]`` and sm_90+).  ``"fa4_varlen"``: FA4's varlen
            kernel over the tree's segments, or per batch its block-sparse kernels where the segments would
            gather more than 3x the tokens (``ops.varlen_tree_attention``); ``"fa4"``: FA4 through flex's FLASH
            backend under a BlockMask, raising naming the reason where it cannot run; ``"flex"``: flex's
            Triton kernel.  ``"auto"`` takes ``"fa4_varlen"`` where FA4 runs (bf16/fp16,
            ``attention_layout="dfs"``) at head dim 64/128 (both plans) or 256 (segments; a batch they cannot
            take runs a flex lowering, with one warning), else ``"fa4"`` where it runs, else flex with a warning.
        attention_layout: ``"dfs"`` or ``"heavy_first"``: the token order tree attention runs in on CUDA
            (``"heavy_first"``: the batch's tree with children visited largest subtree first, gathered in
            and out inside each attention call; exact, fewer partial tiles on deep agentic trees).
        head_logits: ``"auto"``, ``"kept"`` or ``"chunked"``: what the fused head keeps for its backward on CUDA.
            ``"chunked"``: at most ``logits_chunk`` rows of logits at a time, forward and backward (the backward
            recomputes them); ``"kept"``: the ``[tokens, vocab]`` logits in the model's dtype from the forward to
            the head's backward, which runs the head's GEMMs over all rows (``ops.logprobs_kept``: one head GEMM
            per token less); ``"auto"``: when ``logits_chunk`` is not set, the logits of the leading rows that fit
            in the GPU memory left when the head's forward runs are kept, the other rows run chunked in the same
            op (``ops.logprobs_kept.fit_rows``, decided at run time: one compiled graph for every count); else
            ``"chunked"``.  A partition graph (``boundary=True``) runs chunked under "auto" (its graph stays alive
            while the partitions below it run, so kept logits would add up along a chain).  Calls without
            gradients always run chunked.
        attention_keys: ``"auto"``, ``"kept"`` or ``"gathered"``: what the varlen tree attention (FA4 over the tree's
            segments) keeps for its backward on CUDA.  ``"gathered"``: nothing more, the backward gathers each
            segment's path prefix of keys and values again; ``"kept"``: the forward's gathered rows
            (``G x kv heads x (Dk + Dv)`` elements per layer, ``G`` ~ the paths' tokens on wide trees) until the
            layer's backward; ``"auto"``: kept where the GPU memory covers the rest of the forward with them and the
            head's kept logits (measured at run time once per forward:
            ``ops.varlen_tree_attention.keeps_keys``), and sliding-window layers gather again.  Calls without
            gradients keep nothing.
        swaps: context managers entered during capture (default: ``frontend.kernel_swaps(model)``).
        allow_dropout: accept active dropout (one mask per shared token, so gradients equal the
            per-path ones only in expectation); by default it is refused.
        entropy: also return ``out.entropy [T]`` (the entropy of each token's predicting
            distribution, from the fused head's chunks, differentiable).  Off by default: it is one
            more ``[T]`` output, and the torch head computes it with two more passes over each
            logits chunk (the Triton head in the same pass).
        router_aux: a MoE model that computes a router load-balancing loss (HF
            ``output_router_logits=True``) is refused unless this says which loss to compute on the tree:
            ``"batch"`` (statistics over all path tokens, each shared token counted once per path: what
            packing the paths computes), ``"path"`` (each path's own loss, averaged over paths: what
            per-path training computes) or ``"none"`` (drop it).  The loss comes back as
            ``out.aux_loss`` and is added to ``out.loss`` times the model's ``router_aux_loss_coef`` (a
            config's ``router_z_loss_coef > 0`` adds the z-loss likewise, ``out.z_loss``).  Batches
            that hold part of a step's statistics (partitions, several trees) get their coefficients
            from ``runtime.train.train_step``'s counting pre-pass (``runtime/router_step.py``).
            ``entropy`` and ``router_aux`` combine with ``boundary=True`` (the partition graph returns
            the entropy and router logits of its tokens).

    Capture bakes the model's train/eval mode into the graph: compile in the mode you train in.
    """
    options = dict(disable=disable, debug=debug, logits_chunk=logits_chunk, compile_cuda=compile_cuda,
                   bucket=bucket, boundary=boundary, gdn_kernel=gdn_kernel, swaps=swaps, allow_dropout=allow_dropout,
                   entropy=entropy, router_aux=router_aux, attention_kernel=attention_kernel,
                   attention_layout=attention_layout, conv_kernel=conv_kernel, head_logits=head_logits,
                   attention_keys=attention_keys)
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


class _Children:
    """Attribute access to a TreeModel's adopted children, by the names ``named_children()`` gives (some of which
    the TreeModel's own attributes hide: ``tm.model``)."""

    __slots__ = ("_modules",)

    def __init__(self, modules: dict):
        self._modules = modules

    def __getattr__(self, name: str) -> nn.Module:
        try:
            return self._modules[name]
        except KeyError:
            raise AttributeError(f"the TreeModel has no adopted child {name!r}") from None
