"""FlashAttention-4 baselines of the benchmark harness (issue 16 item 3): the honest dense references.

- ``compiled_per_path_fa4``: the unmodified model on each path alone under ``torch.compile(dynamic=True)``
  with its causal SDPA call served by FA4's causal kernel;
- ``packed_fa4_varlen``: paths packed whole (first-fit decreasing under ``--capacity``, as
  ``packed_flex``) and each pack run as ONE sequence whose attention is FA4's varlen causal kernel over
  ``cu_seqlens`` (the Megatron-style packing baseline; RoPE is relative, so global positions give
  the per-path scores; the pack's padding is a sequence of its own).

FA4's Python entry points are autograd Functions that dynamo cannot trace, so the kernels are wrapped
here as torch custom ops (``tcbench::fa4_fwd`` / ``tcbench::fa4_bwd`` with a registered autograd
formula and fake implementations): the compiled graphs keep one piece per step, with FA4 opaque
inside, and no graph breaks.  Imports flash_attn lazily (the module itself imports on CPU).
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_OPS = None


def fa4_ops():
    """Register (once) and return the FA4 custom ops: (fwd, bwd)."""
    global _OPS
    if _OPS is not None:
        return _OPS

    @torch.library.custom_op("tcbench::fa4_fwd", mutates_args=())
    def fa4_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: int,
                scale: float, window: int) -> tuple[Tensor, Tensor]:
        from flash_attn.cute.interface import _flash_attn_fwd

        kw = {} if cu_seqlens is None else dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                                 max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
        out, lse = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True,
                                   **_window_kw(window), **kw)[:2]
        # the fakes promise contiguous outputs (inductor asserts strides); FA4 may hand back other layouts
        return out.contiguous(), lse.contiguous()

    @fa4_fwd.register_fake
    def _(q, k, v, cu_seqlens, max_seqlen, scale, window):
        if cu_seqlens is None:  # q [B, T, H, D] -> lse [B, H, T]
            return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
        return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)  # [H, total]

    @torch.library.custom_op("tcbench::fa4_bwd", mutates_args=())
    def fa4_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor, cu_seqlens: Optional[Tensor],
                max_seqlen: int, scale: float, window: int) -> tuple[Tensor, Tensor, Tensor]:
        from flash_attn.cute.interface import _flash_attn_bwd

        kw = {} if cu_seqlens is None else dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                                 max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
        dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout.contiguous(), lse, scale, True, **_window_kw(window),
                                     **kw)[:3]
        # contiguous as the fake says: on an H100 the hybrid baseline (head_dim 256, 2 KV heads) failed
        # inductor's stride assertion on a [8192, 2, 256] tensor with strides (256, 8192*256, 1), i.e. a
        # KV-head-shaped output (dk/dv) in head-major storage (not re-run on a GPU since this change)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @fa4_bwd.register_fake
    def _(q, k, v, out, dout, lse, cu_seqlens, max_seqlen, scale, window):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup(ctx, inputs, output):
        q, k, v, cu, max_seqlen, scale, window = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_seqlen, ctx.scale, ctx.window = max_seqlen, scale, window

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = fa4_bwd(q, k, v, out, dout, lse, cu, ctx.max_seqlen, ctx.scale, ctx.window)
        return dq, dk, dv, None, None, None, None

    fa4_fwd.register_autograd(backward, setup_context=setup)
    _OPS = (fa4_fwd, fa4_bwd)
    return _OPS


def _window_kw(window: int) -> dict:
    """FA4's arguments for causal attention within ``window`` (query ``q`` sees key ``k`` iff ``0 <= q - k <
    window``: ``window_size_left = window - 1``, right 0 from ``causal``); ``window`` 0: plain causal."""
    if window < 0:
        raise ValueError(f"window: expected >= 0 (0: none), got {window}")
    return dict(window_size_left=window - 1) if window else {}


class Varlen:
    """The pack being run: ``cu_seqlens`` (int32, on the device) and its longest sequence."""

    cu_seqlens: Optional[Tensor] = None
    max_seqlen: int = 0


def fa4_causal_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                    window=None):
    """SDPA replacement (causal, [B, H, T, D]) through FA4 (GQA native); ``window``: causal within that many
    keys (``hf_models.windowed_sdpa`` passes it: ``takes_window``)."""
    if attn_mask is not None or dropout_p or not is_causal:
        raise NotImplementedError("the FA4 baseline serves causal SDPA without mask or dropout only")
    fwd, _ = fa4_ops()
    s = q.shape[-1] ** -0.5 if scale is None else scale
    out, _lse = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, 0, s, window or 0)
    return out.transpose(1, 2)


def fa4_varlen_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                    window=None):
    """SDPA replacement for one packed sequence ([1, H, n, D]) of a causal call (no mask or dropout: anything
    else is refused, never ignored): FA4 varlen causal over ``Varlen.cu_seqlens``, within ``window`` keys of the
    same sequence where given."""
    if attn_mask is not None or dropout_p or not is_causal:
        raise NotImplementedError("the FA4 varlen baseline replaces causal SDPA without mask or dropout only")
    if q.shape[0] != 1:
        raise NotImplementedError("a pack is one sequence (batch 1)")
    fwd, _ = fa4_ops()
    s = q.shape[-1] ** -0.5 if scale is None else scale
    out, _lse = fwd(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), Varlen.cu_seqlens,
                    Varlen.max_seqlen, s, window or 0)
    return out.transpose(0, 1)[None]


fa4_causal_sdpa.takes_window = fa4_varlen_sdpa.takes_window = True


class patched_sdpa:
    """Context manager: ``F.scaled_dot_product_attention`` replaced by ``fn`` (the models call it by attribute)."""

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        self.orig = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = self.fn

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self.orig


def _upcast(x):
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def compiled_per_path_fa4(steps):
    """Per-path step: each path alone, compiled (dynamic shapes), causal attention through FA4."""
    if steps.dev.type != "cuda":
        raise RuntimeError("FA4 runs on CUDA only")
    fa4_ops()
    return steps.per_path_step("per_path_fa4_fn", swaps=lambda: [patched_sdpa(fa4_causal_sdpa)], cudnn_first=False)


def zeroed_grads(params) -> list[Tensor]:
    """Give each parameter a zero ``.grad`` that is a view of one new zeroed buffer per dtype, for backward passes
    to add into in place; returns the buffers (a later step zeroes them: one fill per dtype, not one per parameter)."""
    by_dtype: dict = {}
    for p in params:
        by_dtype.setdefault((p.dtype, p.device), []).append(p)
    flats = []
    for (dtype, device), ps in by_dtype.items():
        flats.append(torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device))
        offset = 0
        for p in ps:
            p.grad = flats[-1][offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    return flats


def packed_fa4_varlen(steps, capacity: int, *, cudagraphs: bool = False):
    """Packed step: paths packed whole under ``capacity`` (``harness.pack_plan``: first-fit decreasing, each
    pack one sequence padded to one of at most ``PACK_SHAPES`` lengths chosen to waste the fewest tokens)
    with FA4 varlen causal attention over its documents.  ``cudagraphs``: the compiled forward and backward of
    each pack shape captured whole as CUDA graphs (inductor's ``mode="reduce-overhead"``; FA4's calls are
    captured with the rest, their inputs, ``cu_seqlens`` among them, copied into the graphs' buffers on each
    replay), one CUDA-graph step per pack (``cudagraph_mark_step_begin``).  Its gradients then accumulate into
    buffers of its own, made once and zeroed at each step's start (:func:`zeroed_grads`: one fill per dtype, as
    ``optimizer.zero_grad(set_to_none=False)`` would): a graph's gradient outputs live in its pool, and the next
    pack's replay overwrites them, so autograd must not keep them as ``.grad`` to add the next pack's into (torch
    raises on that)."""
    try:
        from benchmarks.harness import pack_plan
    except ImportError:
        from harness import pack_plan

    refusal = steps.spec.packing_refusal(steps.model, windows=True)
    if refusal:
        raise RuntimeError(refusal)
    if steps.dev.type != "cuda":
        raise RuntimeError("FA4 runs on CUDA only")
    fa4_ops()
    lens = [len(p) for p in steps.case.paths]
    plan = pack_plan(lens, capacity)
    wdtype = _upcast(next(steps.model.parameters())).dtype
    packs = []
    for g, n in plan:
        p = steps.pack_tensors(g, n, wdtype)
        packs.append((p.ids, p.targets, p.same, p.cu.to(torch.int32)))
    # one max_seqlen for every pack (an upper bound only sizes the grid): a per-pack value is a Python
    # int that dynamo specialises on, one compile per distinct value (292 s first step on the H100)
    mx = max(lens + [n - sum(lens[i] for i in g) for g, n in plan])
    spec, model = steps.spec, steps.model

    def loss_fn(ids, targets, same):
        logits = _upcast(spec.logits(model, ids[None])[0])  # [1, n, V] for ours and HF models alike
        return (F.cross_entropy(logits, targets, reduction="none") * same).sum()

    fn = torch.compile(loss_fn, dynamic=False, mode="reduce-overhead" if cudagraphs else None)

    params = [p for p in model.parameters() if p.requires_grad] if cudagraphs else []
    flats = zeroed_grads(params)
    views = [p.grad for p in params]

    def step():
        if not cudagraphs:
            steps.zero()
        else:
            for flat in flats:
                flat.zero_()
            if not all(p.grad is g for p, g in zip(params, views)):  # set to None between steps (the harness does)
                for p, g in zip(params, views):
                    p.grad = g
        total = 0.0
        with steps.spec.baseline_context(steps.model), patched_sdpa(fa4_varlen_sdpa):
            for ids, targets, same, cu in packs:
                Varlen.cu_seqlens, Varlen.max_seqlen = cu, mx
                if cudagraphs:  # the last pack's graph outputs are used up (its loss summed, its backward run)
                    torch.compiler.cudagraph_mark_step_begin()
                loss = fn(ids, targets, same)
                loss.backward()
                total += loss.detach()
        return total
    return step
