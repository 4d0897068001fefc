"""Split a rewritten graph at module boundaries, so each given module's part can run through that
module's own ``__call__``.

The rewritten program is one flat graph: running it calls no submodule's ``forward``, so hooks on
those modules never fire.  FSDP2 applied per decoder layer lives on exactly those hooks (all-gather
before the layer's forward, reshard after, all-gather again before its backward, reduce-scatter
after).  ``split_by_modules`` cuts the graph into consecutive *segments*: one per given module
(every node whose ``nn_module_stack`` lies inside it, plus every node that reads one of its
parameters or buffers) and root segments between them.  The runner (``program.TreeProgram``) calls a
module's segment as that module's forward and resolves the segment's lifted parameters only there,
after the module's pre-forward hooks ran.

Nodes the passes inserted carry no module stack; such a node joins a module's segment only when the
nodes before and after it belong to that module, else the root.  A module whose nodes are not one
contiguous run of the graph cannot be split (the error names the node in between).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import fx

from treecompile.passes.base import where

__all__ = ["Segment", "SplitError", "split_by_modules"]

ROOT = None


class SplitError(ValueError):
    """The graph cannot be cut so that each given module's part is one contiguous segment."""


@dataclass
class Segment:
    owner: str | None  # FQN of the module whose __call__ runs the segment; None: run directly
    graph_module: fx.GraphModule  # placeholders: the lifted values (``lifted``), then ``inputs``
    lifted: list[str]  # original placeholder names of the parameters/buffers/constants it reads
    inputs: list[str]  # original names of the other values it reads (graph inputs, earlier outputs)
    outputs: list[str]  # original names of the values it returns (as a tuple), read later


def _inside(path: str, owner: str) -> bool:
    return path == owner or path.startswith(owner + ".")


def _holder(fqn: str, owners: Sequence[str], aliases: dict[str, list[str]]) -> str | None:
    """The given module that holds a lifted value under any of its names (tied weights), else root."""
    names = [fqn, *aliases.get(fqn, ())]
    return next((o for o in owners if any(_inside(n, o) for n in names)), ROOT)


def _owner_of(node: fx.Node, owners: Sequence[str], lifted_fqn: dict[str, str],
              aliases: dict[str, list[str]]) -> tuple[str | None, bool]:
    """(owner, known): the module a node belongs to by its module stack or the parameters it reads."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple) and isinstance(v[0], str)]
    by_stack = {o for o in owners if any(_inside(p, o) for p in paths)}
    by_param = {}
    for a in node.all_input_nodes:
        fqn = lifted_fqn.get(a.name) if a.op == "placeholder" else None
        holder = _holder(fqn, owners, aliases) if fqn is not None else ROOT
        if holder is not ROOT:
            by_param[holder] = fqn
    if paths:  # the model's own code: a node reading another module's tensor cannot be split off
        inner = max(paths, key=len)
        for holder, fqn in by_param.items():
            if holder not in by_stack:
                raise SplitError(f"{where(node)} (in {inner or 'the root'!r}) reads {fqn!r}, which belongs to "
                                 f"module {holder!r} (tied or shared weights): it cannot run in that module's "
                                 "segment; split at modules that hold all of their tensors alone")
    found = by_stack | set(by_param)
    if len(found) > 1:
        raise SplitError(f"{where(node)} belongs to several of the given modules ({sorted(found)}); "
                         "they cannot run as separate segments")
    if found:
        return found.pop(), True
    return ROOT, bool(paths)  # a node from the model's own code outside every given module is root's


def split_by_modules(gm: fx.GraphModule, owners: Sequence[str], lifted_fqn: dict[str, str],
                     aliases: dict[str, list[str]] | None = None) -> list[Segment]:
    """Cut ``gm`` into segments: one per FQN in ``owners`` and root segments between them.

    ``lifted_fqn`` maps the graph's lifted placeholders (parameters, buffers, constants) to the FQN
    they stand for; each is resolved by the runner inside the segment that reads it.  A lifted value
    of a given module read outside that module's segment is an error (the root's own values may be
    read by any segment), as is a module whose nodes are interleaved with another's.  ``aliases``
    maps an FQN to the other names of the same tensor (tied weights): a value is a module's when any
    of its names lies inside the module.
    """
    aliases = aliases or {}
    owners = list(owners)
    if len(set(owners)) != len(owners):
        raise SplitError(f"modules given more than once: {owners}")
    for a in owners:
        for b in owners:
            if a != b and _inside(b, a):
                raise SplitError(f"module {b!r} lies inside {a!r}; give disjoint modules")
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    tagged = [_owner_of(n, owners, lifted_fqn, aliases) for n in body]

    # untagged nodes (inserted by passes): a module's only when sandwiched between that module's nodes
    assign: list[str | None] = [o for o, _ in tagged]
    prev_known = {}
    j = -1
    for i in range(len(body)):
        if tagged[i][1]:
            j = i
        prev_known[i] = j
    nxt = -1
    for i in reversed(range(len(body))):
        if tagged[i][1]:
            nxt = i
            continue
        p = prev_known[i]
        before = assign[p] if p >= 0 else ROOT
        after = assign[nxt] if nxt >= 0 else ROOT
        assign[i] = before if before == after else ROOT

    # consecutive runs; each given module must be exactly one run
    runs: list[tuple[str | None, list[fx.Node]]] = []
    for n, o in zip(body, assign):
        if runs and runs[-1][0] == o:
            runs[-1][1].append(n)
        else:
            runs.append((o, [n]))
    seen: dict[str, fx.Node] = {}
    for o, nodes in runs:
        if o is ROOT:
            continue
        if o in seen:
            raise SplitError(f"the nodes of module {o!r} are not contiguous: {where(seen[o])} and "
                             f"{where(nodes[0])} are separated by nodes of another module")
        seen[o] = nodes[-1]
    missing = [o for o in owners if o not in seen]
    if missing:
        raise SplitError(f"no graph node belongs to module(s) {missing} (is the FQN right? is the module used?)")

    segments = []
    for owner, nodes in runs:
        members = set(nodes)
        external: list[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in members and a not in external:
                    external.append(a)
        lifted = [a for a in external if a.op == "placeholder" and a.name in lifted_fqn]
        for a in lifted:
            fqn = lifted_fqn[a.name]
            holder = _holder(fqn, owners, aliases)
            if holder is not ROOT and holder != owner:  # the root's own tensors may be read anywhere
                user = next(n for n in nodes if a in n.all_input_nodes)
                raise SplitError(f"{where(user)} reads {fqn!r} of module {holder!r} outside that module's "
                                 "segment; it cannot be sharded with the module")
        inputs = [a for a in external if a not in lifted]
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in lifted + inputs:
            env[a] = g.placeholder(a.name)
            env[a].meta = dict(a.meta)
        for n in nodes:
            env[n] = g.node_copy(n, lambda x: env[x])
        g.output(tuple(env[n] for n in outputs))
        segments.append(Segment(owner=owner, graph_module=fx.GraphModule(gm, g),
                                lifted=[a.name for a in lifted], inputs=[a.name for a in inputs],
                                outputs=[n.name for n in outputs]))
    return segments
