"""Tree Gated DeltaNet on CUDA through flash-linear-attention (optional extra ``treecompile[gpu]``).

Same contract as ``treecompile::tree_gated_delta_rule`` (``ops/tree_gdn.py``): every radix node's
segment starts from its parent node's final state (roots: zero or ``initial_state``).  All nodes of
one tree level run in ONE varlen call of fla's ``chunk_gated_delta_rule`` (``cu_seqlens``, one
``initial_state`` per segment, ``output_final_state=True``): kernel launches per layer = one fla call
per level forward and one per level backward.  The parents' final states are gathered with
``index_select`` from the previous level's output, so autograd (fla's own backward, which returns
gradients for initial states and takes them for final states) carries gradients to every ancestor.

This is a plain differentiable function, not a registered op: fla's kernels are autograd Functions,
which a registered op's implementation cannot call with autograd.  ``passes.lower_cuda`` calls it in
place of the registered op when the GDN kernel is ``"fla"``.  fla is imported lazily, never at import.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fla_available", "fla_unusable_reason", "tree_gated_delta_rule_fla"]


def fla_unusable_reason(device: torch.device | None = None) -> str | None:
    """Why fla cannot serve the tree GDN on ``device`` (None when it can).

    flash-linear-attention 0.6 refuses Triton >= 3.4, < 3.7.1 on Hopper (sm_90) for the gated
    backward (wrong results, fla issue #640) unless tilelang is installed; say so up front instead
    of failing in the first backward.
    """
    try:
        import fla.ops.gated_delta_rule  # noqa: F401  (availability probe)
    except ImportError:
        return "flash-linear-attention is not installed (pip install 'treecompile[gpu]')"
    if torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9:
        import importlib.util

        import triton

        version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
        if (3, 4, 0) <= version < (3, 7, 1) and importlib.util.find_spec("tilelang") is None:
            return (f"flash-linear-attention refuses Triton {triton.__version__} on Hopper for the gated "
                    f"backward (fla #640): upgrade Triton to >= 3.7.1 or install tilelang")
    return None


def fla_available(device: torch.device | None = None) -> bool:
    return fla_unusable_reason(device) is None


def _schedule(node_start: Tensor, node_end: Tensor, node_parent: Tensor, node_level: Tensor):
    """Per level: (token index [n], cu_seqlens [k+1], parent row in the previous level [k] or None)."""
    ns, ne, par, lv = (t.tolist() for t in (node_start, node_end, node_parent, node_level))
    by_level: dict[int, list[int]] = {}
    for n, l in enumerate(lv):
        by_level.setdefault(l, []).append(n)
    if sorted(by_level) != list(range(len(by_level))):
        raise ValueError(f"node_level: levels {sorted(by_level)} are not 0..L-1")
    row: dict[int, int] = {}
    out = []
    dev = node_start.device
    for l in range(len(by_level)):
        nodes = by_level[l]
        idx, cu = [], [0]
        for r, n in enumerate(nodes):
            row[n] = r
            idx.extend(range(ns[n], ne[n]))
            cu.append(len(idx))
        if l == 0:
            if any(par[n] >= 0 for n in nodes):
                raise ValueError("node_level: a level-0 node has a parent")
            prow = None
        else:
            bad = [n for n in nodes if par[n] < 0 or lv[par[n]] != l - 1]
            if bad:
                raise ValueError(f"node {bad[0]}: its parent is not one level up")
            prow = torch.tensor([row[par[n]] for n in nodes], dtype=torch.long, device=dev)
        out.append((torch.tensor(idx, dtype=torch.long, device=dev), torch.tensor(cu, dtype=torch.long, device=dev),
                    prow))
    return out


_LAST: tuple = ()  # (node tensors, their versions, schedule) of the last batch


def _cached_schedule(node_start, node_end, node_parent, node_level):
    """The level schedule (one host sync) once per batch, not once per GDN layer: every layer of a
    forward gets the same node tensors, so the last schedule is reused while they are unchanged."""
    global _LAST
    tensors = (node_start, node_end, node_parent, node_level)
    versions = tuple(t._version for t in tensors)
    if _LAST and all(a is b for a, b in zip(_LAST[0], tensors)) and _LAST[1] == versions:
        return _LAST[2]
    sched = _schedule(*tensors)
    _LAST = (tensors, versions, sched)
    return sched


def tree_gated_delta_rule_fla(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, node_start: Tensor,
                              node_end: Tensor, node_parent: Tensor, node_level: Tensor,
                              initial_state: Tensor | None = None, *, scale: float | None = None,
                              use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64) -> Tensor:
    """q, k ``[1, T, H, Dk]``, v ``[1, T, Hv, Dv]``, g (log decay) / beta ``[1, T, Hv]``; node tensors
    ``[N]`` as in a TreeBatch; ``initial_state [Hv, Dk, Dv]`` for root nodes.  Returns ``[1, T, Hv, Dv]``."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise ImportError("the 'fla' GDN kernel needs flash-linear-attention (pip install 'treecompile[gpu]')") from e
    Hv, Dk, Dv = v.shape[2], q.shape[3], v.shape[3]
    o = v.new_zeros(v.shape)
    states = None
    for idx, cu, prow in _cached_schedule(node_start, node_end, node_parent, node_level):
        n = cu.numel() - 1
        if prow is None:
            init = (initial_state.to(torch.float32).expand(n, Hv, Dk, Dv).contiguous() if initial_state is not None
                    else q.new_zeros(n, Hv, Dk, Dv, dtype=torch.float32))
        else:
            init = states.index_select(0, prow)
        oi, states = chunk_gated_delta_rule(
            q.index_select(1, idx), k.index_select(1, idx), v.index_select(1, idx), g.index_select(1, idx),
            beta.index_select(1, idx), scale=scale, initial_state=init, output_final_state=True,
            cu_seqlens=cu, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)
        o = o.index_copy(1, idx, oi.to(o.dtype))
    return o
