"""Gated DeltaNet (gated delta rule) — the CPU reference, float64-capable, first-class.

Conventions follow flash-linear-attention (``fla.ops.gated_delta_rule``):

- ``q, k``: ``[B, T, Hk, Dk]``; ``v``: ``[B, T, Hv, Dv]`` with ``Hv`` a multiple of ``Hk`` (each q/k
  head serves ``Hv // Hk`` consecutive value heads, as in Qwen3.5 / Qwen3-Next);
- ``g`` (log decay, ``<= 0``) and ``beta``: ``[B, T, Hv]``;
- states ``[N, Hv, Dk, Dv]``; with ``cu_seqlens`` (``[N + 1]``, int64, starts at 0, ends at T) the
  batch must be 1 and holds N packed segments, each with its own initial and final state.

Per head, with ``q`` scaled by ``scale`` (default ``Dk ** -0.5``) and, if ``use_qk_l2norm_in_kernel``,
q and k L2-normalised first (``x * rsqrt(sum x^2 + 1e-6)``, as HF and FLA do)::

    S_t = exp(g_t) * S_{t-1}
    u_t = beta_t * (v_t - S_t^T k_t)
    S_t = S_t + k_t u_t^T
    o_t = S_t^T q_t

Three entry points: :func:`recurrent_gated_delta_rule` (token by token), :func:`chunk_gated_delta_rule`
(the WY/UT-transform chunked form, ``chunk_size`` tokens per matmul block), both differentiable by torch
autograd, and the explicit reverse-mode pair :func:`core_forward_chunked` /
:func:`core_backward` on padded segment batches, which the registered tree op uses (a custom op's
implementation runs below autograd, so its backward is written out).

Everything computes in the input dtype (float32 for half inputs); nothing is silently upcast or
downcast, so float64 inputs give float64 results.
"""

from __future__ import annotations

import torch

__all__ = [
    "l2norm", "prepare_qk", "chunk_gated_delta_rule", "recurrent_gated_delta_rule",
    "core_forward_chunked", "core_forward_recurrent", "core_backward", "pad_segments",
]

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` (HF's and FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def l2norm_backward(x: torch.Tensor, dy: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """VJP of :func:`l2norm`: ``r * dy - x * r^3 * <x, dy>`` with ``r = rsqrt(|x|^2 + eps)``."""
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    return r * dy - x * (r ** 3) * (x * dy).sum(-1, keepdim=True)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def prepare_qk(q, k, num_v_heads: int, *, scale: float | None, use_qk_l2norm_in_kernel: bool):
    """Normalise (optionally), repeat q/k heads to the value heads, scale q. Returns (q, k)."""
    Hk, Dk = q.shape[-2], q.shape[-1]
    if num_v_heads % Hk:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of q/k heads ({Hk})")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if num_v_heads != Hk:
        q = q.repeat_interleave(num_v_heads // Hk, dim=-2)
        k = k.repeat_interleave(num_v_heads // Hk, dim=-2)
    s = Dk ** -0.5 if scale is None else scale
    return q * s, k


def _check(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q, k: expected equal shapes [B, T, Hk, Dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    B, T = q.shape[:2]
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v: expected [B={B}, T={T}, Hv, Dv], got {tuple(v.shape)}")
    Hv = v.shape[2]
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (B, T, Hv):
            raise ValueError(f"{name}: expected [B, T, Hv] = {(B, T, Hv)}, got {tuple(t.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens: the batch must be 1 with packed segments, got B={B}")
        cu = cu_seqlens.tolist()
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={T}, got {cu}")
        N = len(cu) - 1
    else:
        N = B
    if initial_state is not None and initial_state.shape != (N, Hv, q.shape[-1], v.shape[-1]):
        raise ValueError(f"initial_state: expected [N, Hv, Dk, Dv] = {(N, Hv, q.shape[-1], v.shape[-1])}, "
                         f"got {tuple(initial_state.shape)}")
    return N


def pad_segments(lengths: torch.Tensor, starts: torch.Tensor, multiple: int = 1):
    """Gather map for packing N segments into ``[N, L]`` (L = longest, rounded up to ``multiple``).

    Returns ``(index [N, L], valid [N, L])``: token index of each slot (0 where invalid).
    """
    N = lengths.numel()
    Lmax = int(lengths.max()) if N else 0
    L = max(multiple, -(-Lmax // multiple) * multiple) if multiple > 1 else max(Lmax, 1)
    ar = torch.arange(L, device=lengths.device)
    valid = ar[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + ar[None, :], torch.zeros_like(ar)[None, :])
    return index, valid


def _to_segments(x: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[T, ...] -> [N, L, ...] with zeros in invalid slots."""
    out = x[index]
    mask = valid.reshape(valid.shape + (1,) * (x.dim() - 1))
    return torch.where(mask, out, torch.zeros((), dtype=x.dtype, device=x.device))


# ----------------------------------------------------------------------------- core on [N, L, H, D]
def core_forward_recurrent(q, k, v, g, beta, h0):
    """Token-by-token recurrence. q, k [N, L, H, Dk], v [N, L, H, Dv], g, beta [N, L, H],
    h0 [N, H, Dk, Dv]. q already scaled. Returns (o [N, L, H, Dv], final state [N, H, Dk, Dv])."""
    S = h0
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        kv = torch.einsum("nhk,nhkv->nhv", k[:, t], S)
        u = beta[:, t, :, None] * (v[:, t] - kv)
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], S))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o, S


def core_forward_chunked(q, k, v, g, beta, h0, chunk_size: int = 64, *, return_chunk_states: bool = False):
    """Chunked (UT transform) form of :func:`core_forward_recurrent`; same shapes and result.

    L need not be a multiple of ``chunk_size``: the tail is padded with identity steps (k = v = 0,
    g = beta = 0), which leave the state unchanged.  With ``return_chunk_states`` also returns the
    state entering every chunk, ``[N, num_chunks, H, Dk, Dv]``.
    """
    N, L, H, Dk = k.shape
    Dv = v.shape[-1]
    C = int(chunk_size)
    if C < 1:
        raise ValueError(f"chunk_size: expected a positive integer, got {chunk_size}")
    pad = (-L) % C
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    nc = (L + pad) // C
    # -> [N, H, nc, C, D]
    q, k, v = (x.transpose(1, 2).reshape(N, H, nc, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(N, H, nc, C) for x in (g, beta))
    cum = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0
    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    A = ((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    unit = A + eye
    new_v = torch.linalg.solve_triangular(unit, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(unit, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    last = cum[..., -1].exp()[..., None, None]
    S = h0
    outs, states = [], []
    for i in range(nc):
        states.append(S)
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ S
        outs.append(q_dec[:, :, i] @ S + attn[:, :, i] @ v_new)
        S = S * last[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(N, H, nc * C, Dv)[:, :, :L].transpose(1, 2)
    if return_chunk_states:
        return o, S, torch.stack(states, 1)
    return o, S


def core_backward(q, k, v, g, beta, h0, do, dhT, chunk_size: int = 64):
    """Reverse-mode of the recurrence on ``[N, L, ...]`` segment batches.

    ``do`` [N, L, H, Dv] and ``dhT`` [N, H, Dk, Dv] (gradient of the final state, may be None) ->
    ``(dq, dk, dv, dg, dbeta, dh0)``.  States are recomputed chunk by chunk from the chunk-entry
    states of :func:`core_forward_chunked` (memory ``N * chunk_size`` states, not ``N * L``).
    Per step, with ``Sd = exp(g) S_{t-1}``, ``r = v - Sd^T k``, ``u = beta r``, ``S_t = Sd + k u^T``::

        dS += q do^T;  dq = S_t do;  du = dS^T k;  dk = dS u;  dbeta = <du, r>;  dv = beta du
        dSd = dS - k (beta du)^T;  dk -= Sd (beta du);  dg = <dSd, Sd>;  dS_{t-1} = exp(g) dSd
    """
    N, L, H, Dk = k.shape
    C = int(chunk_size)
    _, _, entry = core_forward_chunked(q, k, v, g, beta, h0, C, return_chunk_states=True)
    dS = torch.zeros_like(h0) if dhT is None else dhT.clone()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dg, dbeta = torch.zeros_like(g), torch.zeros_like(beta)
    nc = entry.shape[1]
    for c in range(nc - 1, -1, -1):
        lo, hi = c * C, min(L, (c + 1) * C)
        if lo >= hi:
            continue
        # recompute the states inside the chunk: prev[t] = S_{t-1}
        S = entry[:, c]
        prev = []
        for t in range(lo, hi):
            prev.append(S)
            Sd = S * g[:, t].exp()[..., None, None]
            u = beta[:, t, :, None] * (v[:, t] - torch.einsum("nhk,nhkv->nhv", k[:, t], Sd))
            S = Sd + k[:, t, :, :, None] * u[:, :, None, :]
        for t in range(hi - 1, lo - 1, -1):
            Sp = prev[t - lo]
            e = g[:, t].exp()[..., None, None]
            Sd = Sp * e
            kt, qt, bt = k[:, t], q[:, t], beta[:, t, :, None]
            r = v[:, t] - torch.einsum("nhk,nhkv->nhv", kt, Sd)
            u = bt * r
            St = Sd + kt[..., :, None] * u[..., None, :]
            dot = do[:, t]
            dS = dS + qt[..., :, None] * dot[..., None, :]
            dq[:, t] = torch.einsum("nhkv,nhv->nhk", St, dot)
            du = torch.einsum("nhkv,nhk->nhv", dS, kt)
            dk_t = torch.einsum("nhkv,nhv->nhk", dS, u)
            dbeta[:, t] = (du * r).sum(-1)
            dr = bt * du
            dv[:, t] = dr
            dk_t = dk_t - torch.einsum("nhkv,nhv->nhk", Sd, dr)
            dSd = dS - kt[..., :, None] * dr[..., None, :]
            dg[:, t] = (dSd * Sd).sum((-1, -2))
            dk[:, t] = dk_t
            dS = dSd * e
    return dq, dk, dv, dg, dbeta, dS


# ----------------------------------------------------------------------------- public entry points
def _run(core, q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
         use_qk_l2norm_in_kernel, **kw):
    N = _check(q, k, v, g, beta, initial_state, cu_seqlens)
    out_dtype = v.dtype
    ct = _compute_dtype(v.dtype)
    B, T, Hv, Dv = v.shape
    qs, ks = prepare_qk(q.to(ct), k.to(ct), Hv, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    vs, gs, bs = v.to(ct), g.to(ct), beta.to(ct)
    h0 = (torch.zeros(N, Hv, qs.shape[-1], Dv, dtype=ct, device=v.device) if initial_state is None
          else initial_state.to(ct))
    if cu_seqlens is None:
        o, hT = core(qs, ks, vs, gs, bs, h0, **kw)
    else:
        cu = cu_seqlens.to(device=v.device, dtype=torch.long)
        lengths, starts = cu[1:] - cu[:-1], cu[:-1]
        index, valid = pad_segments(lengths, starts)
        segs = [_to_segments(x[0], index, valid) for x in (qs, ks, vs, gs, bs)]
        o_seg, hT = core(*segs, h0, **kw)
        o = o_seg.new_zeros((T,) + o_seg.shape[2:]).index_put_((index[valid],), o_seg[valid])[None]
    return o.to(out_dtype), (hT if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                           output_final_state: bool = False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64):
    """Chunked gated delta rule (see module docstring for shapes). Returns ``(o [B, T, Hv, Dv],
    final_state [N, Hv, Dk, Dv] or None)``. Differentiable by torch autograd."""
    return _run(core_forward_chunked, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale: float | None = None, initial_state=None,
                               output_final_state: bool = False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel: bool = False):
    """Token-by-token gated delta rule; same contract as :func:`chunk_gated_delta_rule`."""
    return _run(core_forward_recurrent, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
