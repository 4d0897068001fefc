"""Hybrid (Gated DeltaNet + attention) baselines of the benchmark harness (issue 17 item 2).

- ``compiled_per_path_fla``: the unmodified hybrid model on each path alone under
  ``torch.compile(dynamic=True)``, its GDN kernel hook served by fla's ``chunk_gated_delta_rule``
  (opaque to dynamo: one graph break per GDN layer, as in the tree's fla lowering), its own depthwise
  conv and causal SDPA (cuDNN first) compiled;
- ``packed_fla_varlen``: paths packed whole under ``--capacity`` (``harness.pack_plan``: first-fit
  decreasing, every pack one sequence padded to one of at most ``PACK_SHAPES`` lengths chosen to waste the
  fewest tokens; the padding is a sequence of its own); GDN through
  fla varlen (``cu_seqlens``: the state resets at every sequence start); the short conv reset at
  sequence starts (sum of shifted copies masked by the position within the sequence, fused by
  inductor; ``packed_fla_varlen_conv``: through fla's varlen ``causal_conv1d`` instead); attention by
  FA4 varlen causal where flash-attn-4 runs the model's head dim (a probe call decides), else compiled
  FlexAttention under a document-causal BlockMask.  RoPE is relative, so the pack's global positions give
  every path's scores.

Both install their kernels on the model's hook attributes (``GatedDeltaNet.chunk_gated_delta_rule``,
``causal_conv1d_fn``) and ``F.scaled_dot_product_attention`` for the duration of a step only, so the
model object the tree contender captures stays unmodified.  On CPU (tests) ``packed_fla_varlen`` runs
with the model's own reference GDN once per sequence and a dense document mask, and its loss and
gradients equal the per-path run (``tests/test_hybrid_baselines.py``): on GPU only the kernels differ.
MoE hybrids (Qwen3-Next / Qwen3.5-MoE shape) run unchanged: packing is per token outside the mixers.
Imports fla and flash_attn lazily (the module imports on CPU).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.nn.functional as F
from torch import Tensor

from treecompile.frontend import gdn_hook_owners

__all__ = ["compiled_per_path_fla", "fla_gdn_kernel", "hook_values", "hooks", "layer_kernels", "packed_fla_varlen",
           "varlen_conv_fla"]


def fla_gdn_kernel():
    """fla's ``chunk_gated_delta_rule``, or raise with why it cannot run here.  The hooks that call it are
    behind ``torch._dynamo.disable``: fla's autograd Functions stay out of the graph (one graph break per
    GDN layer, as the tree's fla lowering) and the pack's ``cu_seqlens`` is read at run time."""
    from treecompile.ops.fla_gdn import fla_unusable_reason

    reason = fla_unusable_reason() if torch.cuda.is_available() else "fla runs on CUDA only"
    if reason:
        raise RuntimeError(reason)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def layer_kernels(model, make) -> dict:
    """``{hook owner: make(the owner's own GDN kernel)}``, built once per baseline: the hook functions must be
    the same objects every step (dynamo guards on them; a fresh closure per step would recompile each step).
    The owners are where the tree's capture finds the hooks (``treecompile.frontend.gdn_hook_owners``): our
    hybrid's layers hold their kernels as instance attributes, HF's Qwen3.5 / Qwen3-Next layers call their
    modeling module's globals."""
    return {owner: make(getattr(owner, gdn[0])) for owner, gdn, _ in gdn_hook_owners(model)}


def hook_values(model, owners=None) -> list:
    """Every GDN / conv hook's current value (what :func:`hooks` must leave as it found); ``owners``: those of
    ``gdn_hook_owners(model)`` when already at hand."""
    owners = gdn_hook_owners(model) if owners is None else owners
    return [(owner, n, getattr(owner, n)) for owner, gdn, conv in owners for n in gdn + conv]


@contextlib.contextmanager
def hooks(model, *, gdn: dict | None = None, conv=None, sdpa=None):
    """Install kernels (``gdn`` from :func:`layer_kernels`) on the GDN layers' hooks, and SDPA, for the
    block; restore them after."""
    owners = gdn_hook_owners(model)
    saved = hook_values(model, owners)
    orig_sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        for owner, gdn_names, conv_names in owners:
            for n in gdn_names if gdn is not None else ():
                setattr(owner, n, gdn[owner])
            for n in conv_names if conv is not None else ():
                setattr(owner, n, conv)
        if sdpa is not None:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        yield
    finally:
        for owner, n, value in saved:
            setattr(owner, n, value)
        torch.nn.functional.scaled_dot_product_attention = orig_sdpa


def _upcast(x):
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _require_hybrid(steps):
    if not gdn_hook_owners(steps.model):
        raise RuntimeError("hybrid models only (no GDN layer with kernel hooks)")


# ---------------------------------------------------------------------------------------------- per path
def compiled_per_path_fla(steps):
    """Per-path step, compiled, GDN through fla (CUDA only)."""
    _require_hybrid(steps)
    fla = fla_gdn_kernel()
    model = steps.model

    @torch._dynamo.disable
    def per_path_gdn(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **kw):
        return fla(q, k, v, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    gdn = layer_kernels(model, lambda _own: per_path_gdn)

    return steps.per_path_step("per_path_fla_fn", swaps=lambda: [hooks(model, gdn=gdn)])


# ---------------------------------------------------------------------------------------------- packed
class Pack:
    """The pack being run (read by the hooks): sequence bounds and each token's position in its sequence."""

    cu_seqlens: Tensor | None = None  # [S + 1] int64
    cu_list: tuple[int, ...] = ()
    cu_cpu: Tensor | None = None  # cu_seqlens on the host
    pos_in_seq: Tensor | None = None  # [n] int64
    mask = None  # BlockMask (CUDA flex) or dense [n, n] bool (CPU)
    kernel_options: dict | None = None  # flex kernel options (the tree's, treecompile.ops.flex_tree_attention)


def reset_conv1d(hidden_states, weight, bias=None, activation=None, **kwargs):
    """Depthwise causal conv1d (HF's signature: ``[B, C, n]``, weight ``[C, K]``) whose left context
    stops at each sequence start of :class:`Pack` (zeros before it, as a fresh sequence's padding)."""
    x = hidden_states.to(weight.dtype)
    n, K = x.shape[-1], weight.shape[1]
    pos = Pack.pos_in_seq
    out = x * weight[:, K - 1, None]
    for j in range(1, K):
        shifted = F.pad(x, (j, 0))[..., :n] * (pos >= j).to(x.dtype)
        out = out + shifted * weight[:, K - 1 - j, None]
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = F.silu(out)
    return out.to(hidden_states.dtype)


def varlen_conv_fla(causal_conv1d):
    """The short conv hook (HF's ``causal_conv1d_fn`` signature, ``[B, C, n]``) through fla's varlen
    ``causal_conv1d`` over the pack's sequences (zero context at each start, as :func:`reset_conv1d`)."""
    @torch._dynamo.disable
    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        x = hidden_states.transpose(1, 2).to(weight.dtype)
        y, _ = causal_conv1d(x, weight, bias, activation=activation, cu_seqlens=Pack.cu_seqlens,
                             cu_seqlens_cpu=Pack.cu_cpu)
        return y.to(hidden_states.dtype).transpose(1, 2)
    return conv


def _varlen_gdn_fla(fla):
    """``make`` for :func:`layer_kernels`: fla varlen over the pack's sequences (the layer's own kernel unused)."""
    @torch._dynamo.disable
    def call(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kw):
        return fla(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=Pack.cu_seqlens,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return lambda _own: call


def _varlen_gdn_reference(orig):
    """The model's own GDN kernel once per sequence of the pack (CPU, eager)."""
    def call(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kw):
        cu = Pack.cu_list
        outs = [orig(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], chunk_size=chunk_size,
                     initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
                for s, e in itertools.pairwise(cu)]
        return torch.cat(outs, 1), None
    return call


def _fa4_probe(model, dev) -> str | None:
    """None if FA4 varlen causal runs fwd+bwd with the model's attention head shape here, else why not."""
    from treecompile.ops.fa4_tree_attention import fa4_unusable_reason

    if dev.type != "cuda":
        return "FA4 runs on CUDA only"
    reason = fa4_unusable_reason()
    if reason:
        return reason
    cfg = model.config
    try:
        from benchmarks.fa4_baselines import fa4_ops
    except ImportError:
        from fa4_baselines import fa4_ops
    try:
        fwd, _ = fa4_ops()
        dt = next(model.parameters()).dtype
        mk = lambda h: torch.randn(256, h, cfg.head_dim, device=dev, dtype=dt, requires_grad=True)
        q, k, v = mk(cfg.num_attention_heads), mk(cfg.num_key_value_heads), mk(cfg.num_key_value_heads)
        cu = torch.tensor([0, 100, 256], device=dev, dtype=torch.int32)
        out, _ = fwd(q, k, v, cu, 156, cfg.head_dim ** -0.5, 0)
        out.float().sum().backward()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (any failure means: use flex)
        return f"FA4 varlen probe failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return None


def packed_fla_varlen(steps, capacity: int, conv: str = "reset", causal_conv1d=None):
    """Packed step: GDN through fla varlen, conv reset per sequence, FA4 varlen (or flex document mask).
    On CPU the model's reference GDN per sequence and a dense document mask (exact, eager).
    ``conv``: ``"reset"`` (:func:`reset_conv1d`, compiled with the rest) or ``"fla"`` (fla's varlen
    ``causal_conv1d``, :func:`varlen_conv_fla`; ``causal_conv1d`` replaces fla's function, for tests)."""
    try:
        from benchmarks.harness import document_mask, pack_plan
    except ImportError:
        from harness import document_mask, pack_plan

    _require_hybrid(steps)
    dev, model = steps.dev, steps.model
    if dev.type == "cuda":
        gdn = layer_kernels(model, _varlen_gdn_fla(fla_gdn_kernel()))
        why_not_fa4 = _fa4_probe(model, dev)
    else:
        gdn, why_not_fa4 = layer_kernels(model, _varlen_gdn_reference), "CPU"
    steps.note = "attention: FA4 varlen" if why_not_fa4 is None else f"attention: flex/dense document mask ({why_not_fa4})"
    if conv == "fla":
        if causal_conv1d is None:
            from fla.modules.causal_conv1d import causal_conv1d
        conv_fn = varlen_conv_fla(causal_conv1d)
        steps.note += "; conv: fla varlen"
    elif conv == "reset":
        conv_fn = reset_conv1d
    else:
        raise ValueError(f"conv: expected 'reset' or 'fla', got {conv!r}")
    lens = [len(p) for p in steps.case.paths]
    plan = pack_plan(lens, capacity)
    wdtype = _upcast(next(model.parameters())).dtype
    packs = []
    for g, n in plan:
        p = steps.pack_tensors(g, n, wdtype)
        ids, targets, same, cu = p.ids, p.targets, p.same, p.cu
        pos = torch.arange(n, device=dev) - cu[p.doc]
        mask = None if why_not_fa4 is None else document_mask(p.doc, n, dev)
        packs.append((ids, targets, same, cu, cu.tolist(), cu.to(torch.int32), pos, mask, cu.cpu()))
    if dev.type == "cuda" and why_not_fa4 is not None:
        from treecompile.ops.flex_tree_attention import kernel_options_for

        cfg = model.config
        Pack.kernel_options = kernel_options_for(torch.empty(1, cfg.num_attention_heads, 1, cfg.head_dim, device=dev,
                                                             dtype=next(model.parameters()).dtype))
    mx = max(lens + [n for _, n in plan])  # one max_seqlen for every pack (a Python int dynamo would specialise on)

    if why_not_fa4 is None:
        try:
            from benchmarks.fa4_baselines import Varlen, fa4_varlen_sdpa
        except ImportError:
            from fa4_baselines import Varlen, fa4_varlen_sdpa
        sdpa = fa4_varlen_sdpa
    else:
        try:
            from benchmarks.harness import document_sdpa
        except ImportError:
            from harness import document_sdpa
        Varlen, sdpa = None, document_sdpa(Pack)

    spec = steps.spec

    def loss_fn_packed(ids, targets, same):
        logits = _upcast(spec.logits(model, ids[None])[0])  # [1, n, V] for ours and HF models alike
        return (F.cross_entropy(logits, targets, reduction="none") * same).sum()

    fn = loss_fn_packed
    if steps.cfg.compile_baselines:
        fn = torch.compile(loss_fn_packed, dynamic=False)

    def step():
        steps.zero()
        total = 0.0
        with spec.baseline_context(model), hooks(model, gdn=gdn, conv=conv_fn, sdpa=sdpa):
            for ids, targets, same, cu, cu_list, cu32, pos, mask, cu_cpu in packs:
                Pack.cu_seqlens, Pack.cu_list, Pack.pos_in_seq, Pack.mask, Pack.cu_cpu = cu, cu_list, pos, mask, cu_cpu
                if Varlen is not None:
                    Varlen.cu_seqlens, Varlen.max_seqlen = cu32, mx
                loss = fn(ids, targets, same)
                loss.backward()
                total += loss.detach()
        return total
    return step
