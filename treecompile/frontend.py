"""Capture: ``torch.export`` (non-strict) of an unmodified causal LM with a dynamic sequence length.

The model's forward must take ``input_ids [1, T]`` and return logits ``[1, T, V]`` or an object with
``.logits`` (Hugging Face ``CausalLMOutput``).  Hugging Face models are captured with
``use_cache=False`` and, for the duration of the capture only, with ``config._attn_implementation =
"sdpa"`` so that attention arrives as one SDPA node.  Kernels that cannot be traced as one piece
(Gated DeltaNet, causal conv, HF MoE experts) are swapped for registered ops during capture by
:func:`kernel_swaps` (the drop-ins live in ``treecompile.hf_adapters``).  The model object is unchanged
afterwards: its training flag, config and attributes are restored.  Regions the forward runs under
``torch.no_grad()`` are inlined on detached inputs (:func:`inline_no_grad`), so that the passes see them.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from dataclasses import dataclass

import torch
from torch.export import Dim, ExportedProgram

from treecompile.capture_errors import explain_capture_error, record_guards
from treecompile.tracing import export_settings

__all__ = ["Captured", "capture", "CaptureError", "gdn_hook_owners", "kernel_swaps"]

# Kernel hooks that are swapped, during capture only, for registered tree ops (so that each Gated
# DeltaNet layer is one node and the length stays dynamic).  HF transformers (Qwen3.5, Qwen3-Next)
# call module globals; treecompile.models' hybrid model holds them as instance attributes.
GDN_HOOKS = ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")
CONV_HOOKS = ("causal_conv1d_fn",)


@contextlib.contextmanager
def _patched(obj, name, value):
    had = name in vars(obj) if not isinstance(obj, type(contextlib)) else hasattr(obj, name)
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


def gdn_hook_owners(model: torch.nn.Module) -> list[tuple[object, tuple[str, ...], tuple[str, ...]]]:
    """``(owner, GDN hook names, conv hook names)`` for every object that holds a Gated DeltaNet layer's
    kernel hooks: a module of ``model`` (or the Python module its class is defined in) exposing one of
    ``GDN_HOOKS`` and one of ``CONV_HOOKS`` as callables, each owner once, in module order.  What
    :func:`kernel_swaps` swaps during capture, and what the benchmark baselines swap their kernels into."""
    import sys

    owners, done = [], set()
    for m in model.modules():
        for owner in (m, sys.modules.get(type(m).__module__)):
            if owner is None or id(owner) in done:
                continue
            space = vars(owner)
            gdn = tuple(n for n in GDN_HOOKS if callable(space.get(n)))
            conv = tuple(n for n in CONV_HOOKS if callable(space.get(n)))
            if gdn and conv:
                done.add(id(owner))
                owners.append((owner, gdn, conv))
    return owners


def kernel_swaps(model: torch.nn.Module) -> list:
    """Context managers that swap Gated DeltaNet / causal-conv hooks for tree ops during capture.

    A module is taken for a GDN layer when it (or the module its class is defined in) exposes one of
    ``GDN_HOOKS`` and one of ``CONV_HOOKS`` as callables (:func:`gdn_hook_owners`).  HF experts modules
    (classes decorated with ``use_experts_implementation``: their eager loop is data-dependent,
    ``grouped_mm`` refuses float64) get their instance ``forward`` swapped for ``treecompile::moe_experts``
    when :func:`treecompile.hf_adapters.hf_experts_supported` says it computes them exactly, else for
    ``treecompile::experts_module`` (the module's own eager forward as one opaque call, ``ops.experts_module``).
    Returns [] for models without such layers.
    """
    import types

    from treecompile.hf_adapters import hf_causal_conv1d_fn, hf_chunk_gated_delta_rule
    from treecompile.hf_adapters import hf_experts_forward, hf_experts_module_forward, hf_experts_supported

    swaps = [_patched(m, "forward", types.MethodType(
        hf_experts_forward if hf_experts_supported(m) is None else hf_experts_module_forward, m))
        for m in model.modules() if _is_hf_experts(m)]
    for owner, gdn, conv in gdn_hook_owners(model):
        swaps += [_patched(owner, n, hf_chunk_gated_delta_rule) for n in gdn]
        swaps += [_patched(owner, n, hf_causal_conv1d_fn) for n in conv]
    return swaps


def _is_hf_experts(m: torch.nn.Module) -> bool:
    """An instance of a class decorated with HF's ``use_experts_implementation`` (its ``__init__`` sets these)."""
    return all(hasattr(m, a) for a in ("is_concatenated", "has_gate", "has_bias", "is_transposed")) \
        and hasattr(type(m).forward, "__wrapped__")


class CaptureError(RuntimeError):
    """torch.export could not capture the model; the message says what to change."""


@dataclass
class Captured:
    program: ExportedProgram
    input_name: str  # the user input placeholder (input_ids)


def _is_hf(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return cfg is not None and hasattr(cfg, "use_cache") and hasattr(cfg, "_attn_implementation")


@contextlib.contextmanager
def _hf_capture_settings(model):
    cfg = model.config
    saved, saved_cache = cfg._attn_implementation, cfg.use_cache
    try:
        # SDPA only where the model has an SDPA path; forced onto one without it (BLOOM), HF adds
        # the mask as an additive score that is no longer recognisable as causal.  Such models stay
        # on their own attention, which rewrite_causal_attention turns into tree attention.
        if saved != "sdpa" and getattr(type(model), "_supports_sdpa", True):
            cfg._attn_implementation = "sdpa"
        # no KV cache, also for a forward that takes use_cache only through **kwargs (:func:`_hf_inputs`)
        cfg.use_cache = False
        yield
    finally:
        if cfg._attn_implementation != saved:
            cfg._attn_implementation = saved
        cfg.use_cache = saved_cache


def capture(model: torch.nn.Module, *, example_len: int = 16, max_len: int = 1 << 20,
            swaps: list | None = None) -> Captured:
    """Export ``model`` for tree rewriting.  ``swaps``: context managers entered during capture."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"treecompile.compile expects an nn.Module, got {type(model).__name__}")
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    vocab = _vocab_size(model)
    ids = torch.randint(0, vocab, (1, example_len), device=device)
    is_hf = _is_hf(model)
    seq = Dim("seq", min=2, max=max_len)
    was_training = model.training
    if swaps is None:
        swaps = kernel_swaps(model)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_user_frames(model))
        if is_hf:
            stack.enter_context(_hf_capture_settings(model))
        for s in swaps:
            stack.enter_context(s)
        guards = stack.enter_context(record_guards())  # the model's source line, should torch.export refuse it
        try:
            try:
                ep = _export(model, ids, seq, is_hf, deferred=False)
            except Exception as e:
                # A length guard torch's solver could not prove over the range (e.g. ``Ne(Min(16*s, 32*s),
                # 64*s)`` from SDPA's stride ordering of float32 CUDA q/k/v): export again with the guards
                # as runtime asserts, and keep that program only when every assert holds at every length.
                first = len(guards)
                ep = _export_with_proven_asserts(model, ids, seq, is_hf) if _constraint_violation(e) else None
                if ep is None:
                    del guards[first:]  # the refusal is explained by the first export's guards
                    raise
        except Exception as e:
            own = _eager_failure(model, ids, seq, is_hf)
            if own is not None:  # not torch.export's refusal: the model cannot run this input at all
                msg = str(own).splitlines()[0] if str(own) else ""
                impl = getattr(getattr(model, "config", None), "_attn_implementation", None) if is_hf else None
                how = f"; {impl!r} attention, as the capture runs it" if impl else ""
                raise CaptureError(f"{type(model).__name__} fails on its own: run eagerly (no torch.export{how}) on a "
                                   f"{ids.shape[1]}-token example, it raises {type(own).__name__}: {msg}; fix the "
                                   "model or its configuration") from own
            raw = CaptureError(f"torch.export could not capture {type(model).__name__} with a dynamic "
                               f"sequence length: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            raw.__cause__ = e
            raise CaptureError(explain_capture_error(raw, guards)) from e
        finally:
            model.train(was_training)
    inline_no_grad(ep.graph_module)
    sig = ep.graph_signature
    user = [s.arg.name for s in sig.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT
            and s.arg.name == "input_ids"] or sig.user_inputs[:1]
    return Captured(program=ep, input_name=user[0])


def inline_no_grad(gm: torch.fx.GraphModule) -> int:
    """Regions the model runs under ``torch.no_grad()`` become ordinary ops on detached inputs; returns how many.

    torch.export keeps such a region as ``wrap_with_set_grad_enabled(False, body, *operands)`` with the region in a
    submodule ``body``; the passes rewrite the top graph only, so an attention inside it (HRM's inner cycles, any
    truncated backprop through a recurrence) stayed a dense attention and the verifier refused the model.  The body
    computes the same values from detached operands, and nothing it returns then carries a gradient, as under
    ``no_grad``: so its nodes are copied into the graph after an ``aten.detach`` of every tensor operand, where the
    passes see them, and the verifier judges them as the model's own ops (they carry no pass mark).  Regions that
    turn gradients on, autocast regions, and bodies holding attributes other than submodules stay as they are."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    count = 0
    while hop is not None:
        done = 0
        for n in list(gm.graph.nodes):
            if not (n.op == "call_function" and n.target is hop and n.args and n.args[0] is False
                    and isinstance(n.args[1], torch.fx.Node) and n.args[1].op == "get_attr"):
                continue
            body = getattr(gm, n.args[1].target)
            places = [b for b in body.graph.nodes if b.op == "placeholder"]
            operands = list(n.args[2:])
            if (len(places) != len(operands) or any(u.target is not operator.getitem for u in n.users)
                    or any(b.op == "get_attr" and not isinstance(getattr(body, b.target), torch.nn.Module)
                           for b in body.graph.nodes)):
                continue
            env: dict = {}
            with gm.graph.inserting_before(n):
                for ph, a in zip(places, operands):
                    if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                        d = gm.graph.call_function(torch.ops.aten.detach.default, (a,))
                        d.meta.update({k: v for k, v in a.meta.items() if k in ("val", "tensor_meta")})
                        for k in ("stack_trace", "nn_module_stack"):
                            if k in n.meta:
                                d.meta[k] = n.meta[k]
                        env[ph] = d
                    else:
                        env[ph] = a
                out = None
                for b in body.graph.nodes:
                    if b.op == "placeholder":
                        continue
                    if b.op == "output":
                        out = b.args[0]
                        break
                    if b.op == "get_attr":  # a nested region's body: moved onto gm under a new name
                        name = f"{n.args[1].target}_{b.target}"
                        gm.add_submodule(name, getattr(body, b.target))
                        env[b] = gm.graph.get_attr(name)
                        env[b].meta.update(b.meta)
                        continue
                    env[b] = gm.graph.node_copy(b, lambda x: env[x])
            outs = torch.fx.node.map_arg(out, lambda x: env[x])
            for u in list(n.users):
                u.replace_all_uses_with(outs[u.args[1]])
                gm.graph.erase_node(u)
            attr = n.args[1]
            gm.graph.erase_node(n)
            if not attr.users:
                gm.graph.erase_node(attr)
                delattr(gm, attr.target)
            done += 1
        if not done:
            break
        count += done
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


@contextlib.contextmanager
def _user_frames(model: torch.nn.Module):
    """Stack traces that reach into the model's own helpers.  torch.export keeps only ``forward`` frames in a
    node's stack trace (torch 2.13's ``_record_forward_stack_traces_only``), so an op in a helper method or
    function was reported at the ``forward`` line that called it.  The functions and methods of the Python modules
    the model's classes come from (HF's ``modeling_*.py``: ``apply_rotary_pos_emb``, ``eager_attention_forward``)
    are registered as anchors for the capture only, and every refusal names the innermost of them.  A torch
    without ``torch.fx.proxy._STACK_TRACE_ANCHORS`` records what it records."""
    import sys
    import torch.fx.proxy as proxy

    anchors = getattr(proxy, "_STACK_TRACE_ANCHORS", None)
    if not isinstance(anchors, set):
        yield
        return
    names = {c.__module__ for m in model.modules() for c in type(m).__mro__}
    added = set()
    for name in names:
        mod = sys.modules.get(name)
        if mod is None or name.split(".", 1)[0] in ("torch", "builtins", "treecompile"):
            continue
        for fn in _own_functions(mod):
            key = (fn.__code__.co_filename, fn.__code__.co_name)
            if key not in anchors:
                anchors.add(key)
                added.add(key)
    try:
        yield
    finally:
        anchors.difference_update(added)


def _own_functions(mod):
    """Functions defined in module ``mod``, and the methods of the classes defined there; for a decorated one
    (``functools.wraps``: transformers' ``deprecate_kwarg``) the function it wraps, not the wrapper.  The wrapper's
    code is shared by every function it decorates (transformers' ``wrapped_func``): as an anchor it kept the frame
    of any decorated helper in any module (``masking_utils``' mask builders), and a refusal named that generic
    ``return func(*args, **kwargs)`` line instead of the model's."""
    def with_wrapped(fn):
        try:
            inner = inspect.unwrap(fn)
        except ValueError:  # a cycle of __wrapped__
            inner = fn
        yield inner if inspect.isfunction(inner) else fn

    for obj in list(vars(mod).values()):
        if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
            yield from with_wrapped(obj)
        elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
            for attr in list(vars(obj).values()):
                fn = getattr(attr, "__func__", attr)
                if inspect.isfunction(fn):
                    yield from with_wrapped(fn)


def _eager_failure(model, ids, seq, is_hf: bool) -> Exception | None:
    """What the model raises when it runs the capture's example eagerly (no export; gradients off), or None: a
    refused capture of a model that fails on its own is the model's failure (a bad configuration, say), not
    torch.export's."""
    try:
        with torch.no_grad():
            if is_hf:
                model(**_hf_inputs(model, ids, seq)[0])
            else:
                model(ids)
    except Exception as e:  # noqa: BLE001 -- any failure of the model's own code is the answer
        return e
    return None


def _export(model, ids, seq, is_hf: bool, *, deferred: bool) -> ExportedProgram:
    """torch.export.export of ``model`` on ``ids``; what it prints on stderr passes through, except the partial
    graph it dumps there when it fails (the refusal names the model's line in one line of its own)."""
    import io
    import sys

    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            return _export_quiet(model, ids, seq, is_hf, deferred=deferred)
    except Exception:
        text = buffer.getvalue()  # torch prints the partial graph (``def forward(self, ...``) last, then raises
        cut = text.find("def forward(self")
        buffer = io.StringIO(text[:cut].rstrip("\n") if cut >= 0 else text)
        raise
    finally:
        if buffer.getvalue():
            sys.stderr.write(buffer.getvalue())


def _export_quiet(model, ids, seq, is_hf: bool, *, deferred: bool) -> ExportedProgram:
    with export_settings():  # the graph is the same, the capture faster (treecompile/tracing.py)
        if is_hf:
            kwargs, shapes = _hf_inputs(model, ids, seq)
            return torch.export.export(model, (), kwargs, dynamic_shapes=shapes, strict=False,
                                       prefer_deferred_runtime_asserts_over_guards=deferred)
        return torch.export.export(model, (ids,), dynamic_shapes=({1: seq},), strict=False,
                                   prefer_deferred_runtime_asserts_over_guards=deferred)


def _hf_inputs(model, ids, seq) -> tuple[dict, dict]:
    """(kwargs, dynamic_shapes) of ``model(input_ids=..., use_cache=False)``.  torch.export keys
    ``dynamic_shapes`` by the forward's parameter names and cannot nest a spec under ``**kwargs``: a forward that
    takes ``use_cache`` only through ``**kwargs`` (GraniteMoeForCausalLM's ``forward(input_ids, **kwargs)``) gets
    ``input_ids`` alone; ``config.use_cache`` is False for the capture (:func:`_hf_capture_settings`)."""
    if "use_cache" in inspect.signature(model.forward).parameters:
        return {"input_ids": ids, "use_cache": False}, {"input_ids": {1: seq}, "use_cache": None}
    return {"input_ids": ids}, {"input_ids": {1: seq}}


def _constraint_violation(e: BaseException) -> bool:
    return "Constraints violated" in str(e)


def _export_with_proven_asserts(model, ids, seq, is_hf: bool) -> ExportedProgram | None:
    """The program exported with length guards as runtime asserts, those asserts removed, when each one
    is proven for every length ``>= seq.min``; None (the caller raises the first refusal) otherwise."""
    try:
        ep = _export(model, ids, seq, is_hf, deferred=True)
    except Exception:
        return None
    asserts = [n for n in ep.graph.nodes
               if n.op == "call_function" and n.target is torch.ops.aten._assert_scalar.default]
    for n in asserts:
        cond = n.args[0]
        val = cond.meta.get("val") if isinstance(cond, torch.fx.Node) else cond
        expr = val.node.expr if isinstance(val, torch.SymBool) else val
        if not holds_for_every_length(expr, seq.min):
            return None
    for n in asserts:
        _erase_with_unused_inputs(ep.graph, n)
    ep.graph_module.recompile()
    return ep


def holds_for_every_length(cond, lo: int) -> bool:
    """Whether ``cond`` (a sympy boolean, or a bool) over at most one size symbol ``s`` is true for every
    integer ``s >= lo``.  Proof only: sympy with ``s = lo + t``, ``t`` a non-negative integer, then torch's
    value-range analysis; anything neither proves is not taken."""
    import sympy
    from torch.utils._sympy import functions as torch_sympy
    from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

    if isinstance(cond, bool):
        return cond
    if not isinstance(cond, sympy.Basic):
        return False
    if cond.free_symbols == set():
        return cond == sympy.true
    if len(cond.free_symbols) != 1:
        return False
    (s,) = cond.free_symbols
    t = sympy.Symbol("t_len", integer=True, nonnegative=True)
    try:  # torch's Min/Max do not simplify on sign facts as sympy's do
        plain = cond.replace(torch_sympy.Min, sympy.Min).replace(torch_sympy.Max, sympy.Max)
        if plain.xreplace({s: t + lo}) == sympy.true:
            return True
    except Exception:  # a torch sympy function sympy cannot evaluate on t: try the value ranges
        pass
    try:
        vr = bound_sympy(cond, {s: ValueRanges(lo, sympy.oo)})
        return vr.lower == sympy.true and vr.upper == sympy.true
    except Exception:
        return False


def _erase_with_unused_inputs(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and then, transitively, the symbolic-size nodes that only fed it."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or n.op != "call_function":
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        todo += [a for a in inputs if a.op == "call_function" and not isinstance(a.meta.get("val"), torch.Tensor)]


def _vocab_size(model) -> int:
    cfg = getattr(model, "config", None)
    v = getattr(cfg, "vocab_size", None)
    if isinstance(v, int) and v > 0:
        return v
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None:
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if emb is None:
        raise CaptureError(f"{type(model).__name__}: cannot find the vocabulary size (no config.vocab_size "
                           f"and no nn.Embedding)")
    return emb.num_embeddings
