"""fla 0.6's chunk kernels launched directly: the same kernels, configs and arguments with less host work per launch.

A levelled tree GDN layer (:mod:`treecompile.ops.fla_gdn_levels`) launches ~24 of fla's Triton kernels forward and
backward, and on the small hybrid steps the host, not the GPU, sets the pace.  Profiled on H100 (session 21,
``benchmarks/results/h100_s21``), most of a launch's host time is not Triton's own launch but what sits above it:
fla's backend dispatch (a ``torch.compiler.disable`` wrapper and a loop over backends per function call), fla's
``CachedAutotuner.run`` (which builds an autotune key from every argument even with ``FLA_CACHE_MODE`` unset),
then Triton's ``Autotuner.run`` (which builds the key again) and ``Heuristics.run``.  This module keeps the kernel
and its config and drops the rest:

- :class:`Launcher` runs a kernel's heuristics itself and looks its autotuned config up once per key: the first
  launch of a key goes through the autotuner (which benchmarks, or takes fla's cached config), later ones call
  the ``@triton.jit`` function with that config, which is what ``Autotuner.run`` does for a key it has seen.
- The functions below (:func:`l2norm_fwd`, :func:`chunk_local_cumsum` ...) are fla's wrappers of the same name
  (``fla/modules/norm/l2norm.py``, ``fla/ops/utils/cumsum.py``, ``fla/ops/gated_delta_rule/chunk_fwd.py`` and
  ``wy_fast.py``, ``fla/ops/common/chunk_o.py``), restricted to what the levelled path passes (varlen rows of
  batch 1, gated, no ``g_gamma``): same output allocation, same grid, same kernel arguments.
- :func:`functions` returns them only for the functions that no backend of fla's dispatch that is available and
  enabled here implements (fla 0.6: tilelang's ``chunk_bwd_dqkwg`` on Hopper, an opt-in ``fwd_h``, NPU ones);
  every other function stays fla's own, through its dispatch.

Equal to fla's own functions bit for bit: ``benchmarks/fla_interpret_check.py`` (fla's kernels under Triton's CPU
interpreter) and ``tests/test_fla_gdn.py`` (on Hopper) compare the levelled layer, launched directly and through
fla's functions, with whole fla calls.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["Launcher", "functions", "claimed"]


class Launcher:
    """``kernel[grid](**kwargs)`` for one of fla's ``@triton.heuristics`` / ``@triton.autotune`` / ``@triton.jit``
    stacks, with the heuristics run here and the autotuned config looked up once per key.

    The key is the values of the autotuner's key arguments and the dtypes of the tensor arguments: everything
    Triton's own key is made of, so one key here never maps to two of Triton's.  Keyword arguments only."""

    def __init__(self, kernel):
        from triton.runtime.autotuner import Autotuner, Heuristics

        self.heuristics = []
        while isinstance(kernel, Heuristics):  # outermost first: each sees the values of the ones above it
            self.heuristics.append(kernel.values)
            kernel = kernel.fn
        self.tuner = kernel if isinstance(kernel, Autotuner) else None
        self.fn = kernel.fn if self.tuner is not None else kernel
        if not hasattr(self.fn, "run"):
            raise TypeError(f"not a Triton kernel: {type(self.fn).__name__}")
        self._configs: dict = {}

    def __call__(self, grid, **kwargs):
        for values in self.heuristics:
            for name, heuristic in values.items():
                kwargs[name] = heuristic(kwargs)
        if self.tuner is None:
            return self.fn.run(grid=grid, warmup=False, **kwargs)
        key = (tuple(kwargs.get(n) for n in self.tuner.keys),
               tuple(v.dtype for v in kwargs.values() if isinstance(v, Tensor)))
        config = self._configs.get(key)
        if config is None:
            out = self.tuner.run(grid=grid, warmup=False, **kwargs)  # tunes (or takes fla's cached config) once
            if self.tuner.best_config.pre_hook is None:
                self._configs[key] = self.tuner.best_config
            return out
        return self.fn.run(grid=grid, warmup=False, **kwargs, **config.all_kwargs())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _launcher(module: str, name: str) -> Launcher:
    import importlib

    return Launcher(getattr(importlib.import_module(module), name))


@functools.cache
def _hopper_tiling(device_index: int | None) -> bool:
    from fla.utils import check_shared_mem

    return check_shared_mem("hopper", device_index or 0)


@functools.cache
def _const_tiling(device_index: int | None) -> int:
    from fla.utils import check_shared_mem

    return 64 if check_shared_mem("none", device_index or 0) else 32


# --- fla/modules/norm/l2norm.py ------------------------------------------------------------------------------

def _l2norm_block(x: Tensor) -> tuple[int, int, int]:
    T, D = x.shape
    BD = min(65536 // x.element_size(), _pow2(D))
    if D > BD:
        raise RuntimeError(f"fla's l2norm takes feature dims under 64 KB, got {D}")
    return T, D, BD


def l2norm_fwd(x: Tensor, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    shape = x.shape
    x = x.view(-1, shape[-1])
    y = torch.empty_like(x)
    T, D, BD = _l2norm_block(x)
    rstd = torch.empty((T,), dtype=torch.float32, device=x.device)
    if D <= 512:
        _launcher("fla.modules.norm.l2norm", "l2norm_fwd_kernel")(
            lambda meta: (_cdiv(T, meta["BT"]),), x=x, y=y, rstd=rstd, eps=eps, T=T, D=D, BD=BD,
            NB=_cdiv(T, 2048 * 32))
    else:
        _launcher("fla.modules.norm.l2norm", "l2norm_fwd_kernel_row")((T,), x=x, y=y, rstd=rstd, eps=eps, D=D, BD=BD)
    return y.view(shape), rstd.view(shape[:-1])


def l2norm_bwd(y: Tensor, rstd: Tensor, dy: Tensor, eps: float = 1e-6) -> Tensor:
    shape = y.shape
    y, dy = y.view(-1, dy.shape[-1]), dy.view(-1, dy.shape[-1])
    dx = torch.empty_like(y)
    T, D, BD = _l2norm_block(y)
    if D <= 512:
        _launcher("fla.modules.norm.l2norm", "l2norm_bwd_kernel")(
            lambda meta: (_cdiv(T, meta["BT"]),), y=y, rstd=rstd, dy=dy, dx=dx, eps=eps, T=T, D=D, BD=BD,
            NB=_cdiv(T, 2048 * 32))
    else:
        _launcher("fla.modules.norm.l2norm", "l2norm_bwd_kernel_row")(
            (T,), y=y, rstd=rstd, dy=dy, dx=dx, eps=eps, D=D, BD=BD)
    return dx.view(shape)


# --- fla/ops/utils/cumsum.py (scalar gates [B, T, H]) ------------------------------------------------------------

def chunk_local_cumsum(g: Tensor, chunk_size: int, reverse: bool = False, scale: float | None = None,
                       cu_seqlens: Tensor | None = None, chunk_indices: Tensor | None = None) -> Tensor:
    B, T, H = g.shape
    o = torch.empty_like(g, dtype=torch.float)
    _launcher("fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel")(
        (len(chunk_indices) * B * H,), s=g, o=o, scale=scale, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        T=T, B=B, H=H, BT=chunk_size, REVERSE=reverse, USE_GRAPH=False)
    return o


# --- fla/ops/gated_delta_rule/chunk_fwd.py, wy_fast.py -------------------------------------------------------------

def recompute_w_u_fwd(k: Tensor, v: Tensor, beta: Tensor, A: Tensor, g: Tensor, cu_seqlens: Tensor,
                      chunk_indices: Tensor) -> tuple[Tensor, Tensor]:
    B, T, H, K, V, HV = *k.shape, v.shape[-1], v.shape[2]
    w, u = k.new_empty(B, T, HV, K), torch.empty_like(v)
    _launcher("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel")(
        (len(chunk_indices), B * HV), k=k, v=v, beta=beta, w=w, u=u, A=A, g=g, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, V=V, BT=A.shape[-1], BK=64, BV=64)
    return w, u


def chunk_gated_delta_rule_fwd_intra(k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                                     chunk_size: int, chunk_indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """fla's fused kkt + solve_tril path (``chunk_size == 64`` on NVIDIA), then :func:`recompute_w_u_fwd`; other
    chunk sizes go to fla's own function (its unfused path)."""
    if chunk_size != 64:
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra as fla_fwd_intra

        return fla_fwd_intra(k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                             chunk_indices=chunk_indices)
    B, T, H, K, HV = *k.shape, beta.shape[2]
    A = torch.zeros(B, T, HV, chunk_size, device=k.device, dtype=k.dtype)
    _launcher("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel")(
        (len(chunk_indices), B * HV), k=k, g=g, beta=beta, A=A, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
        T=T, H=H, HV=HV, K=K, BT=chunk_size, BC=16)
    w, u = recompute_w_u_fwd(k=k, v=v, beta=beta, A=A, g=g, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
    return w, u, A


def prepare_wy_repr_bwd(k: Tensor, v: Tensor, beta: Tensor, A: Tensor, dw: Tensor, du: Tensor, g: Tensor,
                        cu_seqlens: Tensor, chunk_indices: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, T, H, K, V, HV = *k.shape, v.shape[-1], v.shape[2]
    tiling = _const_tiling(k.device.index)
    dk, dv, dg, db = k.new_empty(B, T, HV, K), torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta)
    _launcher("fla.ops.gated_delta_rule.wy_fast", "prepare_wy_repr_bwd_kernel")(
        (len(chunk_indices), B * HV), k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=du, dk=dk, dv=dv, db=db, dg=dg,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, T=T, H=H, HV=HV, K=K, V=V, BT=A.shape[-1],
        BK=min(max(_pow2(K), 16), tiling), BV=min(max(_pow2(V), 16), tiling))
    if H != HV:
        dk = dk.view(B, T, H, HV // H, K).sum(3)
    return dk, dv, db, dg


# --- fla/ops/common/chunk_o.py -------------------------------------------------------------------------------------

def chunk_fwd_o(q: Tensor, k: Tensor, v: Tensor, h: Tensor, g: Tensor, scale: float, cu_seqlens: Tensor,
                chunk_size: int, chunk_indices: Tensor) -> Tensor:
    B, T, H, K, V, HV = *q.shape, v.shape[-1], v.shape[2]
    NT, o = len(chunk_indices), torch.empty_like(v)
    _launcher("fla.ops.common.chunk_o", "chunk_fwd_kernel_o")(
        lambda meta: (_cdiv(V, meta["BV"]) * NT, B * HV), q=q, k=k, v=v, h=h, g=g, g_gamma=None, o=o,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size,
        STATE_V_FIRST=False)
    return o


def chunk_bwd_dv_local(q: Tensor, k: Tensor, g: Tensor, do: Tensor, scale: float, cu_seqlens: Tensor,
                       chunk_size: int, chunk_indices: Tensor) -> Tensor:
    from fla.utils import check_shared_mem

    B, T, H, K, V, HV = *k.shape, do.shape[-1], do.shape[2]
    if _hopper_tiling(k.device.index):
        tiling = 128
    elif check_shared_mem("ampere", k.device.index):
        tiling = 128 if all(x.element_size() == 2 for x in (q, k, do)) else 64
    elif check_shared_mem("ada", k.device.index):
        tiling = 64
    else:
        tiling = 32
    dv = torch.empty_like(do)
    _launcher("fla.ops.common.chunk_o", "chunk_bwd_kernel_dv_local")(
        (len(chunk_indices), B * HV), q=q, k=k, g=g, g_gamma=None, A=None, do=do, dv=dv, cu_seqlens=cu_seqlens,
        chunk_indices=chunk_indices, scale=scale, T=T, H=H, HV=HV, K=K, V=V, BT=chunk_size,
        BK=min(max(_pow2(K), 16), tiling), BV=min(max(_pow2(V), 16), tiling))
    return dv


# --- which of fla's functions these replace -------------------------------------------------------------------------

# our key -> (fla module, fla function, direct function)
_REPLACES = {
    "l2norm_fwd": ("fla.modules.norm.l2norm", "l2norm_fwd", l2norm_fwd),
    "l2norm_bwd": ("fla.modules.norm.l2norm", "l2norm_bwd", l2norm_bwd),
    "cumsum": ("fla.ops.utils.cumsum", "chunk_local_cumsum", chunk_local_cumsum),
    "fwd_intra": ("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_intra",
                  chunk_gated_delta_rule_fwd_intra),
    "recompute_w_u": ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd", recompute_w_u_fwd),
    "wy_bwd": ("fla.ops.gated_delta_rule.wy_fast", "prepare_wy_repr_bwd", prepare_wy_repr_bwd),
    "fwd_o": ("fla.ops.common.chunk_o", "chunk_fwd_o", chunk_fwd_o),
    "bwd_dv_local": ("fla.ops.common.chunk_o", "chunk_bwd_dv_local", chunk_bwd_dv_local),
}
# a direct function also stands for the dispatched functions it calls in fla (fwd_intra: recompute_w_u_fwd)
_ALSO = {"fwd_intra": [("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd")]}


def claimed(module: str, name: str) -> bool:
    """A backend of fla's dispatch that is available and enabled here implements ``module.name``: then it must be
    called as it is (the backend, not the Triton kernel, serves it).  Any operation's backend that implements
    ``name`` counts (conservative: fla does not say which operation a function was dispatched under)."""
    import importlib

    import fla.backends as fb

    fn = getattr(importlib.import_module(module), name)
    registries = [fb._function_registries.get(fb.unwrap(fn)), *fb._operation_registries.values()]
    return any(backend.is_available() and backend.is_enabled() and backend.get_implementation(name) is not None
               for reg in registries if reg is not None for backend in reg._backends.values())


@functools.cache
def functions() -> dict:
    """Our key -> the direct function, for every function of :data:`_REPLACES` that no enabled backend claims
    (:func:`claimed`); fwd_intra also needs chunk size 64 on an NVIDIA device (fla's fused path)."""
    from fla.utils import IS_INTEL

    out = {}
    for key, (module, name, direct) in _REPLACES.items():
        if claimed(module, name) or any(claimed(m, n) for m, n in _ALSO.get(key, ())):
            continue
        if key == "fwd_intra" and IS_INTEL:
            continue
        out[key] = direct
    return out
