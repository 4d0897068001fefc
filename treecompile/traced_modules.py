"""What a TreeModel's graph was traced through, and the changes to it that the graph would not follow.

The compiled graph is the model's forward as it was at capture: every module's computation, inlined.  It reads the
model's parameters and buffers by name on every call, so new values (an optimizer's step, ``load_state_dict``, a
replaced ``nn.Parameter`` of the same shape and dtype) are what it computes with.  What it cannot follow is a change
of the computation itself, which after compile would leave the TreeModel computing the old model without a word:

- a submodule replaced or removed (``m.model.norm = nn.LayerNorm(...)``, a LoRA or checkpoint wrapper put in place
  of a layer), or a module added to a container (``layers.append(...)``; a new attribute of another module, which
  its traced forward does not read, is not a change);
- a parameter or buffer that was None set to a tensor, or one deleted (a Linear's bias);
- tensors that were one tensor at capture (tied embeddings and head) made separate: torch.export reads such a
  tensor once, through one of its names, so the graph would read one of them for both;
- a ``forward`` replaced on a module or on its class (a monkeypatched kernel);
- a module's class swapped for one with another forward (FSDP2's swap keeps it);
- a plain value a forward may read changed or deleted: a module's public numbers, strings, bools and short tuples
  (``eps``, ``scaling``, ``is_causal``, ``padding_idx``, a dropout probability) and the floats of the
  configuration objects modules hold (``config.rope_theta``), all traced into the graph as constants;
- the train / eval mode switched where the model has dropout: capture traced the mode's dropout into the graph
  (without dropout the mode does not matter, and ``model.train()`` after a compile in eval mode is common).

:class:`TracedModules` records these at compile time and :meth:`TracedModules.change` names the first one made
since, which the TreeModel refuses at its next call.  The check is a few C-level passes over flat lists (about
2,800 entries for a 28-layer model: 86 us a call on this repository's CPU); a module's class swapped by a wrapper
that keeps its ``forward`` (FSDP2's ``fully_shard``) and new values in the same places are not changes.  Not seen:
a module-level function the forwards call, patched after compile.  Hooks are not recorded here: the graph does
not run module calls, so hooks added after compile run only where ``TreeModel.split_at`` puts a module's call back
(FSDP2's per-layer hooks); hooks present at compile were traced into the graph (``split_at`` refuses to run those
modules' calls again).
"""

from __future__ import annotations

import inspect
import operator
from itertools import repeat

from torch import nn

__all__ = ["TracedModules"]


class TracedModules:
    """The module tree of ``model`` as traced (module docstring)."""

    def __init__(self, model: nn.Module):
        modules = list(model.named_modules(remove_duplicate=False))
        # submodule slots: (the parent's _modules dict, name, the child then), named by the child's path
        self._edge_dicts, self._edge_names, self._edges, self._edge_paths = [], [], [], []
        # parameter / buffer slots: (the owner's dict, name, whether it held None), and the slots of tensors that
        # were one tensor under several names
        self._slot_dicts, self._slot_names, self._slot_nones, self._slot_paths = [], [], [], []
        shared: dict[int, list[int]] = {}
        for prefix, m in modules:
            for name, child in m._modules.items():
                self._edge_dicts.append(m._modules)
                self._edge_names.append(name)
                self._edges.append(child)
                self._edge_paths.append(_join(prefix, name))
            for kind in ("_parameters", "_buffers"):
                d = getattr(m, kind)
                for name, t in d.items():
                    if t is not None:
                        shared.setdefault(id(t), []).append(len(self._slot_dicts))
                    self._slot_dicts.append(d)
                    self._slot_names.append(name)
                    self._slot_nones.append(t is None)
                    self._slot_paths.append(_join(prefix, name))
        self._tied = [slots for slots in shared.values() if len(slots) > 1]
        # how many submodules each container holds (a layer added: ``layers.append``), named by its path; a new
        # attribute of another module is not read by its traced forward (a value head set on the model, say)
        containers = [(prefix or "the model", m) for prefix, m in modules
                      if isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential))]
        self._container_paths = [p for p, _ in containers]
        self._module_dicts = [m._modules for _, m in containers]
        self._module_counts = list(map(len, self._module_dicts))
        # forwards: each module's own (instance attribute, almost always none) and each class's
        self._instance_dicts = [m.__dict__ for _, m in modules]
        self._instance_forwards = [m.__dict__.get("forward") for _, m in modules]
        self._module_paths = [prefix or "the model" for prefix, _ in modules]
        classes = {type(m): prefix for prefix, m in reversed(modules)}
        self._classes = [(cls, cls.forward, prefix or "the model") for cls, prefix in classes.items()]
        # each module's class, and the forward it resolved to (a class swapped to one with another forward)
        self._all_modules = [m for _, m in modules]
        self._types = list(map(type, self._all_modules))
        self._type_forwards = [_unwrap(t.forward) for t in self._types]
        # plain values the forwards may read (``eps``, ``scaling``, ``is_causal``, ``padding_idx``; a config's
        # ``rope_theta``): traced into the graph as constants
        self._value_dicts, self._value_keys, self._values, self._value_paths = [], [], [], []
        seen = set()
        # the configuration objects modules hold, by identity (a config replaced by another object: its floats are
        # compared then)
        self._config_dicts, self._config_names, self._configs, self._config_floats, self._config_paths = \
            [], [], [], [], []
        for prefix, m in modules:
            self._add_values(vars(m), prefix, seen, _is_plain)
            for name, value in vars(m).items():
                if not _is_config(value):
                    continue
                self._config_dicts.append(vars(m))
                self._config_names.append(name)
                self._configs.append(value)
                self._config_floats.append(_floats(value))
                self._config_paths.append(_join(prefix, name))
                # a configuration's floats only (``rope_theta``, ``rms_norm_eps``): its flags and counts are mostly
                # read by other code (``use_cache``, ``output_hidden_states``, token ids); once per configuration
                self._add_values(vars(value), _join(prefix, name), seen, _is_float)
        # train / eval mode, where the model has dropout: capture traced the mode's dropout (on, or off) into the graph
        self._dropout = _dropout_sites(modules)
        self._training = list(map(_training, self._all_modules))
        # forward hooks present at compile (traced into the graph), per module, and the global ones
        self._hooks = {id(m): (m, set(m._forward_pre_hooks), set(m._forward_hooks)) for _, m in modules
                       if m._forward_pre_hooks or m._forward_hooks}
        self._global_hooks = (set(nn.modules.module._global_forward_pre_hooks),
                              set(nn.modules.module._global_forward_hooks))

    def _add_values(self, d: dict, prefix: str, seen: set, kind) -> None:
        if id(d) in seen:
            return
        seen.add(id(d))
        for name, value in d.items():
            if not name.startswith("_") and name not in _NOT_TRACED and kind(value):
                self._value_dicts.append(d)
                self._value_keys.append(name)
                self._values.append(value)
                self._value_paths.append(_join(prefix, name))

    def change(self) -> str | None:
        """The first change since compile that the graph would not follow, in words; None when there is none."""
        edges = list(map(dict.get, self._edge_dicts, self._edge_names))
        if not all(map(operator.is_, edges, self._edges)):
            i = next(i for i, (a, b) in enumerate(zip(edges, self._edges)) if a is not b)
            was = "none" if self._edges[i] is None else f"a {type(self._edges[i]).__name__}"
            if edges[i] is None:
                now = "removed"
            else:
                same = self._edges[i] is not None and type(edges[i]) is type(self._edges[i])
                now = f"replaced by {'another' if same else 'a'} {type(edges[i]).__name__}"
            return f"module {self._edge_paths[i]!r} ({was} at compile) was {now}"
        counts = list(map(len, self._module_dicts))
        if counts != self._module_counts:
            i = next(i for i, (a, b) in enumerate(zip(counts, self._module_counts)) if a != b)
            added = sorted(set(self._module_dicts[i]) - {n for d, n in zip(self._edge_dicts, self._edge_names)
                                                         if d is self._module_dicts[i]})
            return (f"{self._container_paths[i]} holds {counts[i]} modules, {self._module_counts[i]} at compile"
                    + (f" (added: {', '.join(map(repr, added[:3]))})" if added else ""))
        slots = list(map(dict.get, self._slot_dicts, self._slot_names))
        nones = list(map(operator.is_, slots, repeat(None)))
        if nones != self._slot_nones:
            i = next(i for i, (a, b) in enumerate(zip(nones, self._slot_nones)) if a != b)
            return (f"{self._slot_paths[i]!r} was None at compile and is now a tensor" if self._slot_nones[i]
                    else f"{self._slot_paths[i]!r} was deleted or set to None")
        for group in self._tied:
            first = slots[group[0]]
            for j in group[1:]:
                if slots[j] is not first:
                    return (f"{self._slot_paths[group[0]]!r} and {self._slot_paths[j]!r}, one tensor at compile "
                            "(tied: the graph reads it once, under one name), became two (tie them again, e.g. "
                            "an HF model's tie_weights(), or compile the untied model)")
        forwards = list(map(dict.get, self._instance_dicts, repeat("forward")))
        if not all(map(operator.is_, forwards, self._instance_forwards)):
            i = next(i for i, (a, b) in enumerate(zip(forwards, self._instance_forwards)) if a is not b)
            return f"the forward of {self._module_paths[i]} was replaced"
        for cls, forward, where in self._classes:
            if cls.forward is not forward:
                return f"{cls.__name__}.forward (the class of {where}) was replaced"
        types = list(map(type, self._all_modules))
        if types != self._types:  # a class swapped (FSDP2's keeps the forward)
            for i, (t, m) in enumerate(zip(types, self._all_modules)):
                if t is not self._types[i] and _unwrap(t.forward) is not self._type_forwards[i]:
                    return (f"the class of {self._module_paths[i]} was changed from {self._types[i].__name__} to "
                            f"{t.__name__}, whose forward is another")
        configs = list(map(dict.get, self._config_dicts, self._config_names))
        if not all(map(operator.is_, configs, self._configs)):
            for i, (c, was) in enumerate(zip(configs, self._config_floats)):
                if c is not self._configs[i] and _floats(c) != was:
                    return (f"{self._config_paths[i]} was replaced by a configuration with other values (its floats, "
                            "which the graph holds as traced)")
        values = list(map(dict.get, self._value_dicts, self._value_keys, repeat(_MISSING)))
        if values != self._values:  # (a NaN value differs from itself here: _same_value decides)
            i = next((i for i, (a, b) in enumerate(zip(values, self._values)) if not _same_value(a, b)), None)
            if i is not None:
                now = "deleted" if values[i] is _MISSING else f"set to {values[i]!r}"
                return (f"{self._value_paths[i]} was {self._values[i]!r} at compile and was {now}: the graph holds "
                        "the value it was traced with")
        if self._dropout:
            training = list(map(_training, self._all_modules))
            if training != self._training:
                i = next(i for i, (a, b) in enumerate(zip(training, self._training)) if a != b)
                mode = ("eval", "train")
                return (f"{self._module_paths[i]} was in {mode[self._training[i]]} mode at compile and is now in "
                        f"{mode[training[i]]} mode, and the model has dropout ({self._dropout[0]}): capture traced "
                        f"its dropout {'on' if self._training[i] else 'off'} into the graph (compile in the mode "
                        "you train in; active dropout needs allow_dropout=True)")
        return None

    def traced_hooks(self, module: nn.Module) -> int:
        """How many of the forward hooks and pre-hooks that ran when the graph was traced would run again in a call of
        ``module`` now (its own still registered, and the global ones)."""
        _, pre, post = self._hooks.get(id(module), (None, set(), set()))
        glob_pre, glob_post = self._global_hooks
        return (len(pre & set(module._forward_pre_hooks)) + len(post & set(module._forward_hooks))
                + len(glob_pre & set(nn.modules.module._global_forward_pre_hooks))
                + len(glob_post & set(nn.modules.module._global_forward_hooks)))


def check_unchanged(tmodel) -> None:
    """The TreeModel's call-time refusal of a model changed after compile (``TreeModel._check_bound``, over
    :class:`TracedModules`), for the runners that call its program directly (redundancy-free partitions, the
    router's counting pass); nothing for an object without that check."""
    check = getattr(tmodel, "_check_bound", None)
    if check is not None:
        check()


_training = operator.attrgetter("training")
_MISSING = object()
# module flags that say how a module is called, not what it computes: the mode (checked where the model has dropout)
# and HF's activation checkpointing switch (``gradient_checkpointing_enable()``; the graph does not call modules)
_NOT_TRACED = frozenset({"training", "gradient_checkpointing"})
_PLAIN = (bool, int, float, str, type(None))


def _is_plain(value) -> bool:
    return type(value) in _PLAIN or (type(value) is tuple and len(value) <= 8 and all(type(v) in _PLAIN for v in value))


def _is_float(value) -> bool:
    return type(value) is float


def _floats(config) -> dict:
    return {k: v for k, v in vars(config).items() if not k.startswith("_") and type(v) is float} \
        if hasattr(config, "__dict__") else {}


def _unwrap(fn):
    """``fn`` without its ``functools.wraps`` wrappers: a subclass of an HF layer gets its inherited forward wrapped
    again (``GradientCheckpointingLayer.__init_subclass__``), as FSDP2's class swap makes one."""
    return inspect.unwrap(fn) if callable(fn) else fn


def _same_value(a, b) -> bool:
    return a is b or (type(a) is type(b) and (a == b or (a != a and b != b)))  # NaN == NaN here


def _is_config(value) -> bool:
    """A configuration object a module keeps (HF's ``PretrainedConfig``, a dataclass config): forwards read its
    values (``config.rope_theta``)."""
    if isinstance(value, (type, nn.Module)) or not hasattr(value, "__dict__"):
        return False
    name = type(value).__name__
    return name.endswith("Config") or hasattr(type(value), "__dataclass_fields__")


def _dropout_sites(modules) -> list[str]:
    """Where the model has dropout with a probability above 0: dropout modules, and float attributes named for
    dropout (HF attention modules keep ``attention_dropout`` and apply it only in train mode)."""
    sites = []
    for prefix, m in modules:
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            sites.append(f"{prefix or 'the model'} p={m.p}")
        for name, value in vars(m).items():
            if (("dropout" in name or "pdrop" in name) and isinstance(value, float) and value > 0):
                sites.append(f"{_join(prefix, name)}={value}")
    return sites


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
