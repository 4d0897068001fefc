"""Benchmark harness: training-step time of treecompile against per-path and packed baselines.

Run from a source checkout: ``python -m benchmarks.harness ARGS`` (or ``python benchmarks/harness.py``);
``pip install -e ".[bench]"`` adds matplotlib for the plot.  Not part of the installed ``treecompile``
command: the harness, its baselines and tree generators are checkout tools, not library code.
Every contender times one training step = forward + backward over all paths of one tree (gradients
accumulated in ``.grad``; **optimizer step excluded**), median of ``--iters`` after one warm-up step
(whose time, compile included, is reported as ``first_s``); each step between two synchronizes, or with
``--loop N`` the median of 3 rounds of N steps run back to back (the host runs ahead, as in a training loop
that does not wait for the GPU each step).  Contenders:

- ``eager_per_path``: the unmodified model run on each path alone (what per-branch trainers do);
- ``compiled_per_path``: the same under ``torch.compile(dynamic=True)`` (one graph for all path
  lengths), causal SDPA with cuDNN first in the backend priority;
- ``compiled_per_path_fa4`` / ``packed_fa4_varlen``: the same per-path and packed steps with attention
  through FlashAttention-4 (causal; varlen causal over ``cu_seqlens``), see :mod:`benchmarks.fa4_baselines`
  (CUDA with flash-attn-4 only; a skipped row elsewhere); ``packed_fa4_varlen_cudagraphs`` (on request): the
  packed step captured whole as CUDA graphs (``tree_cudagraphs``' counterpart);
- ``compiled_per_path_fla`` / ``packed_fla_varlen``: the hybrid (GDN) baselines, see
  :mod:`benchmarks.hybrid_baselines`: per path compiled with fla's GDN kernel; packed with fla varlen
  GDN (state reset per sequence), the short conv reset per sequence and FA4 varlen (or flex document
  mask) attention (hybrid models only; fla rows need CUDA, ``packed_fla_varlen`` runs the reference GDN
  per sequence on CPU); ``packed_fla_varlen_conv``: the same with the short conv through fla's varlen
  ``causal_conv1d`` (CUDA only; the harness takes the faster of the two as the packed baseline);
- ``packed_flex``: paths concatenated into packs of at most ``--capacity`` tokens (first-fit
  decreasing, whole paths, each pack padded to its own length: ``pack_plan``; all paths in one pack when
  they fit), the
  model compiled with its SDPA call replaced by compiled FlexAttention under a document-causal
  BlockMask (RoPE is relative, so global positions give the per-path scores); dense models only (a GDN
  layer would carry state across documents);
- ``tree``: ``treecompile.compile(model)`` on the whole tree (CUDA: compiled, flex tree attention,
  length buckets);
- ``tree_packed``: the tree split by ``runtime.partition.pack`` under ``--capacity`` (partitions
  repeat their shared prefixes), one step = every partition's fwd+bwd;
- ``tree_rf``: redundancy-free partitions (``runtime.redundancy_free``).  On CUDA its graph is
  compiled per length bucket with the flex boundary attention (``ops/flex_tree_attention_boundary.py``);
  one compile per (T bucket, B bucket) makes its first step long, so on CUDA it is reported as not
  timed unless ``--rf-on-cuda`` is given (``benchmarks/redundancy_free_cuda.py`` measures it alone).

Models (``--model``, :func:`model_specs`): ours (kind ``"dense"`` / ``"hybrid"``, ``treecompile.models``) and
Hugging Face transformers models (kind ``"hf"``, :mod:`benchmarks.hf_models`: built by
``AutoModelForCausalLM.from_config`` on the device, seeded, N(0, 0.02); transformers imported only then):
``qwen3-30b-a3b-4l`` (HF ``Qwen3MoeForCausalLM`` at the Qwen3-30B-A3B layer shape, 4 layers, the shape of
``gpu_checks --moe``), ``hf-qwen3-0.6b`` (HF ``Qwen3ForCausalLM`` at ``qwen3-0.6b``'s shape) and
``hf-qwen3-moe-tiny`` (CPU).  HF models run every contender above that applies to them: the baselines
call the model under :func:`hf_models.causal_attention` (HF's SDPA path with ``is_causal=True`` and no mask
built, GQA through ``enable_gqa``: stock HF under ``torch.compile`` with torch < 2.14 builds an explicit
causal mask instead), experts through HF's ``grouped_mm`` on CUDA and its own loop on CPU; the packed
baselines' SDPA replacements refuse any call other than plain causal (a mask is never dropped); the tree
contenders compile the stock model (``treecompile.compile`` swaps the experts for its own op); the
hybrid (fla) baselines are skipped rows.

Per run: step time, path tokens/s, speedup over each baseline and over the fastest baseline, the work
bound (baseline FLOPs / contender FLOPs, :mod:`benchmarks.flops`) and the fraction of it achieved,
peak memory, loss deviation and gradient cosine against the eager per-path baseline.  Out-of-memory and
failures are rows.  ``--recompile-stream N`` runs N differently sized trees through the tree contender
and counts dynamo compiles against the number of length buckets.

Processes: with ``--isolate`` (the default on CUDA) the harness times every (model, tree, contender) in a
fresh child process (``python -m benchmarks.harness`` restricted to that one case and contender, see
:mod:`benchmarks.child_process`), so that no contender pays for the allocator state, compile caches or
fragmentation another left behind (one such run measured a packed baseline at 0.752 s after the tree step
and 0.516 s alone).  The ``eager_per_path`` child saves its loss and fp32 flat gradient; later children of
the same tree compare against them.  A child that fails, is killed or runs past ``--child-timeout-s`` is an
error row naming its exit; the parent applies ``--budget-s``, computes the speedups and writes the reports;
the recompile stream runs in a child of its own.  ``--no-isolate`` (the default on CPU) runs all
contenders and trees of one model in one process, one after another.

Outputs (``--out DIR``): ``results.jsonl`` (one line per row, written when all contenders of its tree are
done: the speedups need them all; each row is also printed to stdout as a JSON line when it finishes, so a run
cut short keeps its finished rows in its log), ``results.csv``,
``tables.md`` (tabulate github tables with their conditions), ``speedup_vs_por.png`` (needs matplotlib:
the ``bench`` extra; without it the run says so and skips the plot; ``--plot-from results.csv`` redraws
it elsewhere).
"""

from __future__ import annotations

import argparse
import collections
import csv
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

if __package__:
    from benchmarks import hf_models
    from benchmarks.child_process import run_child
    from benchmarks.flops import FlopModel, path_attention_entries, tree_attention_entries
    from benchmarks.gpu_clocks import GpuClocks, device_id
    from benchmarks.trees import agentic_paths, agentic_specs, group_paths, max_por, synthetic_paths
else:  # run as a script: benchmarks/ is on sys.path
    import hf_models
    from child_process import run_child
    from flops import FlopModel, path_attention_entries, tree_attention_entries
    from gpu_clocks import GpuClocks, device_id
    from trees import agentic_paths, agentic_specs, group_paths, max_por, synthetic_paths

BASELINES = ("eager_per_path", "compiled_per_path", "packed_flex", "compiled_per_path_fa4", "packed_fa4_varlen",
             "packed_fa4_varlen_cudagraphs", "compiled_per_path_fla", "packed_fla_varlen", "packed_fla_varlen_conv")
TREE_CONTENDERS = ("tree", "tree_heavy_first", "tree_fa4_varlen", "tree_fa4_flex", "tree_conv_fla",
                   "tree_conv_shifts_inductor", "tree_head_chunked", "tree_head_kept", "tree_keys_gathered",
                   "tree_fa4_interface", "tree_fa4_bwd_interface", "tree_cpp_wrapper", "tree_cudagraphs",
                   "tree_driver_reads", "tree_deterministic", "tree_block_sparse_heavy_first", "tree_lex",
                   "tree_kv_expanded", "tree_kv_grouped", "tree_unkept_block_sparse", "tree_unkept_segments",
                   "tree_keys_gathered_block_sparse_forward", "tree_keys_gathered_segments_forward", "tree_packed",
                   "tree_rf")
CONTENDERS = BASELINES + TREE_CONTENDERS
# run when named only: the C++ wrapper's first step compiles for minutes (417 s on the 0.6B, session 43), the CUDA
# graphs' contender was measured slower (session 45; its packed counterpart is not yet measured), and the
# driver-reads, deterministic, block-sparse-order, backward-interface, expanded/grouped-K/V and block-sparse-forward
# trees and the lexicographic serialisation are A/Bs of one setting against ``tree``
ON_REQUEST = ("tree_cpp_wrapper", "tree_cudagraphs", "packed_fa4_varlen_cudagraphs", "tree_driver_reads",
              "tree_deterministic", "tree_block_sparse_heavy_first", "tree_lex", "tree_fa4_bwd_interface",
              "tree_kv_expanded", "tree_kv_grouped", "tree_unkept_block_sparse", "tree_unkept_segments",
              "tree_keys_gathered_block_sparse_forward", "tree_keys_gathered_segments_forward")
DEFAULT_CONTENDERS = tuple(c for c in CONTENDERS if c not in ON_REQUEST)


# ---------------------------------------------------------------------------------------------- configs
@dataclass(frozen=True)
class ModelSpec:
    name: str
    kind: str  # "dense" | "hybrid" | "hf"
    config: object  # DenseConfig | HybridConfig | hf_models.HFConfig

    def build(self, device, dtype):
        if self.kind == "hf":  # built on the device, seeded, N(0, 0.02) (benchmarks/hf_models.py)
            return hf_models.build_hf(self.config, device, dtype)
        from treecompile.models import DenseForCausalLM, HybridForCausalLM

        cls = DenseForCausalLM if self.kind == "dense" else HybridForCausalLM
        torch.manual_seed(0)  # the same weights in every run (session-5 runs before this were unseeded)
        model = cls(self.config)
        with torch.no_grad():  # HF-style init: matrices and embeddings ~ N(0, 0.02), norms as built
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.02)
        return model.to(device=device, dtype=dtype)

    def logits(self, model, ids):
        """``ids [1, T]`` -> logits ``[1, T, V]`` (HF models return an output object; no KV cache built)."""
        if self.kind == "hf":
            return model(ids, use_cache=False).logits
        return model(ids)

    def baseline_context(self, model):
        """What the baselines run ``model`` under: for HF models, causal SDPA without a mask
        (:func:`hf_models.causal_attention`); for ours (they call causal SDPA themselves) RoPE's tables
        computed once per step (:func:`materialized_rope`), as the tree's CUDA lowering does."""
        return hf_models.causal_attention(model) if self.kind == "hf" else materialized_rope(model)

    def packing_refusal(self, model, *, windows: bool = False) -> str | None:
        """Why a packed baseline (document mask over global positions) cannot run this model, or None:
        GDN layers carry state across documents; HF layers other than causal attention are refused, and
        sliding-window layers unless the baseline applies each layer's window within its documents
        (``windows``: FA4 varlen does, through ``cu_seqlens``; the flex document mask does not)."""
        if self.kind == "hybrid":
            return "dense models only (a GDN layer would carry its state across documents)"
        if self.kind == "hf":
            windowed = hf_models.model_windows(model)  # refuses layer types other than full / sliding / linear
            if any(w is not None for w in windowed) and not windows:
                return "sliding-window layers: this packed baseline's document mask has no window"
            if "linear_attention" in (getattr(model.config, "layer_types", None) or ()):
                return "GDN layers carry their state across documents"
        return None


_ROPE_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def materialized_rope(model):
    """Within: ``model.rope`` (our models' cos/sin tables, angles in float64) returns its tables through
    ``treecompile::materialize``, so that inductor computes them once per step.  Otherwise it inlines
    ``pow``/``sin``/``cos`` into every layer's rotary in forward and backward: ~260 ms of an 866 ms packed
    FA4 step of Qwen3-0.6B at 65k path tokens on an H100 (``benchmarks/prof_step.py``, session 13).  The
    tree's lowering does the same (``lower_cuda.materialize_position_values``); the values are unchanged.
    One wrapper per model, so that a compiled baseline sees the same function every step (no recompile)."""
    from treecompile.ops.materialize import materialize

    cls_rope = getattr(type(model), "rope", None)
    if cls_rope is None:
        yield
        return
    wrapped = _ROPE_TABLES.get(model)
    if wrapped is None:
        def wrapped(T, device, dtype, _model=weakref.ref(model)):
            cos, sin = cls_rope(_model(), T, device, dtype)
            return materialize(cos), materialize(sin)
        _ROPE_TABLES[model] = wrapped
    model.rope = wrapped
    try:
        yield
    finally:
        del model.rope


def model_specs() -> dict[str, ModelSpec]:
    from treecompile.models import DenseConfig, HybridConfig

    return {
        "qwen3-0.6b": ModelSpec("qwen3-0.6b", "dense", DenseConfig.qwen3_0_6b()),
        "qwen3-1.7b": ModelSpec("qwen3-1.7b", "dense", DenseConfig.qwen3_1_7b()),
        "qwen3-4b": ModelSpec("qwen3-4b", "dense", DenseConfig.qwen3_4b()),
        # Qwen3.5-shaped hybrid, small variant (as benchmarks/gpu_checks.py): 12 layers, 9 GDN + 3 attention
        "qwen3.5-hybrid-small": ModelSpec("qwen3.5-hybrid-small", "hybrid", HybridConfig(
            hidden_size=1024, intermediate_size=3584, num_hidden_layers=12, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
            linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320)),
        # Qwen3.5-shaped hybrid with as many layers as one H100 trains at 16k tokens (1.0B parameters, 0.5B outside the untied embeddings):
        # 24 layers, 18 GDN (16 key / 16 value heads of 128) + 6 gated attention (8 q / 2 kv heads of 256)
        "qwen3.5-hybrid-0.8b": ModelSpec("qwen3.5-hybrid-0.8b", "hybrid", HybridConfig(
            hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
            linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320)),
        # Qwen3-Next / Qwen3.5-MoE-shaped hybrid, small: 12 layers (9 GDN + 3 attention), 8 routed experts
        # (top 2) + a shared expert per layer.  The model's MoE is the dense reference (every expert on every
        # token): for the equivalence checks on GPU, not for MoE speed
        "qwen3-next-moe-small": ModelSpec("qwen3-next-moe-small", "hybrid", HybridConfig(
            model_type="qwen3_next", hidden_size=1024, intermediate_size=3584, num_hidden_layers=12,
            num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
            linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=151936,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512)),
        # HF transformers models (kind "hf", benchmarks/hf_models.py): the Qwen3-30B-A3B layer shape with 4
        # layers (HF Qwen3MoeForCausalLM, 128 experts top 8; 3.0B parameters, 0.6B of them embeddings), and
        # HF Qwen3 at the 0.6B shape (to compare HF's dense model with ours)
        "qwen3-30b-a3b-4l": ModelSpec("qwen3-30b-a3b-4l", "hf", hf_models.qwen3_30b_a3b_config(4)),
        # HF Qwen3.5-MoE (Qwen3_5MoeForCausalLM) at the Qwen3.5-35B-A3B layer shape with 8 layers (6 GDN: 16 key /
        # 32 value heads of 128; 2 gated attention: 16 q / 2 kv heads of 256; 256 experts top 8 + a shared expert;
        # 7.7B parameters, 1.0B of them embeddings): the MoE hybrid of issue 17; at 16k tree tokens the tree peaks
        # at 33.4 GiB and the packed baseline (capacity 8,192) at 49.7 GiB on an H100 (session 24); 4 layers: 4.3B
        "qwen3.5-35b-a3b-8l": ModelSpec("qwen3.5-35b-a3b-8l", "hf", hf_models.qwen3_5_35b_a3b_config(8)),
        "qwen3.5-35b-a3b-4l": ModelSpec("qwen3.5-35b-a3b-4l", "hf", hf_models.qwen3_5_35b_a3b_config(4)),
        "hf-qwen3-0.6b": ModelSpec("hf-qwen3-0.6b", "hf", hf_models.HFConfig.of("Qwen3Config", **hf_models.QWEN3_0_6B)),
        # HF Mistral at qwen3-0.6b's shape (no q/k norms), every layer sliding with a window of 512 (the
        # windowed rows of issue 16: FA4 varlen's local window is the packed baseline)
        "hf-mistral-0.6b-w512": ModelSpec("hf-mistral-0.6b-w512", "hf", hf_models.HFConfig.of(
            "MistralConfig", sliding_window=512, **hf_models.MISTRAL_0_6B)),
        # HF Qwen3 at the 0.6B shape with Gemma 3's layer mix: five sliding layers (window 512) to one full
        "hf-qwen3-0.6b-swa": ModelSpec("hf-qwen3-0.6b-swa", "hf", hf_models.HFConfig.of(
            "Qwen3Config", use_sliding_window=True, sliding_window=512, layer_types=tuple(
                "full_attention" if i % 6 == 5 else "sliding_attention" for i in range(28)),
            **hf_models.QWEN3_0_6B)),
        # HF Mistral, tiny (CPU tests): 2 layers, window 5
        "hf-mistral-tiny-w5": ModelSpec("hf-mistral-tiny-w5", "hf", hf_models.HFConfig.of(
            "MistralConfig", vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5)),
        "dense-tiny": ModelSpec("dense-tiny", "dense", DenseConfig.tiny(vocab_size=512)),
        # flex attention needs head_dim >= 16 (the recompile stream on CUDA)
        "dense-tiny16": ModelSpec("dense-tiny16", "dense", DenseConfig.tiny(vocab_size=512, hidden_size=64,
                                                                            head_dim=16)),
        "hybrid-tiny": ModelSpec("hybrid-tiny", "hybrid", HybridConfig.tiny(vocab_size=512)),
        # Qwen3-Next / Qwen3.5-MoE shape (GDN + attention, routed experts + shared expert), tiny
        "hybrid-moe-tiny": ModelSpec("hybrid-moe-tiny", "hybrid", HybridConfig.tiny(vocab_size=512, num_experts=4)),
        # HF Qwen3.5-MoE, tiny (CPU tests): 4 layers (3 GDN + 1 attention), 4 experts top 2 + a shared expert
        "hf-qwen3.5-moe-tiny": ModelSpec("hf-qwen3.5-moe-tiny", "hf", hf_models.HFConfig.of(
            "Qwen3_5MoeTextConfig", vocab_size=512, hidden_size=32, num_hidden_layers=4, full_attention_interval=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            tie_word_embeddings=False)),
        # HF Qwen3-MoE, tiny (CPU tests): 1 layer, 4 experts top 2
        "hf-qwen3-moe-tiny": ModelSpec("hf-qwen3-moe-tiny", "hf", hf_models.HFConfig.of(
            "Qwen3MoeConfig", vocab_size=512, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0)),
    }


@dataclass(frozen=True)
class TreeCase:
    name: str
    source: str  # "synthetic" | "agentic"
    target_por: float | None
    paths: tuple[tuple[int, ...], ...] = field(repr=False, compare=False)


@dataclass(frozen=True)
class BenchConfig:
    device: str
    dtype: str
    iters: int
    capacity: int
    normalize: str = "sum"
    compile_baselines: bool = True  # False on CPU: the "compiled" baselines then run eagerly (said in the row)
    rf_on_cuda: bool = False
    budget_s: float = float("inf")
    loop: int = 0  # > 0: steps timed back to back in rounds of this many (time_steps)


@dataclass
class Result:
    model: str
    tree: str
    source: str
    paths: int
    path_tokens: int
    tree_tokens: int
    por: float
    contender: str
    status: str  # "ok", "OOM", "skipped: ...", "error: ..."
    step_s: float | None = None
    first_s: float | None = None  # first step, compile included
    tokens_per_s: float | None = None  # path tokens trained per second
    computed_tokens: int | None = None
    flops: float | None = None
    tflops: float | None = None  # model FLOPs of this contender per second
    bound: float | None = None  # baseline FLOPs / contender FLOPs
    x_eager: float | None = None
    x_compiled: float | None = None
    x_packed: float | None = None
    x_best: float | None = None  # speedup over the fastest baseline of this run
    best_baseline: str | None = None
    frac_bound: float | None = None  # x_best / bound
    peak_gib: float | None = None
    loss: float | None = None
    loss_rel_dev: float | None = None  # vs eager_per_path
    grad_cos: float | None = None  # vs eager_per_path
    note: str | None = None  # what a contender chose at run time (e.g. its attention kernel)
    pid: int | None = None  # the process that ran it (with --isolate: one per contender)
    step_times_s: list | None = None  # every timed step (step_s is their median): noisy hosts show here
    clocks: dict | None = None  # CUDA: the SM clock, power and clock caps over the timed steps (gpu_clocks)


# ---------------------------------------------------------------------------------------------- trees
def synthetic_cases(pors, num_paths, path_len, vocab) -> list[TreeCase]:
    out = []
    for por in pors:
        por = min(por, max_por(num_paths, path_len))
        paths = synthetic_paths(num_paths, path_len, por, vocab=vocab, seed=int(por * 1000))
        out.append(TreeCase(f"syn POR={por:.2f}", "synthetic", por, tuple(map(tuple, paths))))
    return out


def group_cases(group, vocab) -> list[TreeCase]:
    """``group`` = (prompt, samples, lo, hi): one GRPO group (:func:`benchmarks.trees.group_paths`)."""
    prompt, samples, lo, hi = group
    paths = group_paths(prompt, samples, lo, hi, vocab=vocab)
    return [TreeCase(f"group {prompt} + {samples} x {lo}-{hi}", "group", None, tuple(map(tuple, paths)))]


def agentic_cases(scale, vocab, names=None) -> list[TreeCase]:
    out = []
    for spec in agentic_specs(scale, names or None):
        spec = dataclasses.replace(spec, vocab=vocab)
        out.append(TreeCase(f"agentic {spec.name}", "agentic", None, tuple(map(tuple, agentic_paths(spec)))))
    return out


# ---------------------------------------------------------------------------------------------- steps
PACK_SHAPES = 4  # the most distinct pack lengths (compiled graphs) a packed baseline pads to


def pack_plan(lens: Sequence[int], capacity: int, *, multiple: int = 128,
              max_shapes: int = PACK_SHAPES) -> list[tuple[list[int], int]]:
    """The packed baselines' packs: paths packed whole, first-fit decreasing, under max(``capacity``, longest
    path) tokens; ``[(members in order, padded length)]``, ordered by first member.  The packs are padded to
    at most ``max_shapes`` lengths (each length is one compiled graph; dynamo falls back past its recompile
    limit), chosen to waste the fewest tokens: the packs' sizes rounded up to ``multiple``, sorted,
    cut into at most ``max_shapes`` runs, each padded to its run's largest (an exact dynamic program; the
    padding is a sequence of its own).  Padding every pack to the longest, as before session 23, ran the
    agentic parallel-tools tree (8 paths of 3.9-6.6k tokens) as 1.15x its tokens at capacity 16,384 and
    1.26x at 8,192: work the FLOP bound does not count, which flattered the tree."""
    from treecompile.runtime.partition import first_fit_decreasing

    if not lens or min(lens) < 1:
        raise ValueError(f"pack_plan: expected non-empty paths, got lengths {list(lens)[:8]}")
    if max_shapes < 1:
        raise ValueError(f"pack_plan: max_shapes must be >= 1, got {max_shapes}")
    groups = sorted(sorted(g) for g in first_fit_decreasing(list(lens), max(capacity, max(lens))))
    rounded = [-(-sum(lens[i] for i in g) // multiple) * multiple for g in groups]
    n_packs = collections.Counter(rounded)
    r = sorted(n_packs)  # candidate lengths; a run of r[i..j] is padded to r[j]
    count = [n_packs[x] for x in r]
    m, k = len(r), min(max_shapes, len(r))
    inf = float("inf")
    n_le, tok_le = [0], [0]  # prefix sums: packs, and their rounded tokens, of r[0..j-1]
    for x, c_ in zip(r, count):
        n_le.append(n_le[-1] + c_)
        tok_le.append(tok_le[-1] + c_ * x)

    def waste(i, j):  # tokens added padding the packs of r[i..j] up to r[j]
        return r[j] * (n_le[j + 1] - n_le[i]) - (tok_le[j + 1] - tok_le[i])

    # best[c][j]: least waste covering r[0..j] with c runs, the last ending at j; back[c][j]: where it starts
    best = [[inf] * m for _ in range(k + 1)]
    back = [[0] * m for _ in range(k + 1)]
    for j in range(m):
        best[1][j] = waste(0, j)
    for c in range(2, k + 1):
        for j in range(m):
            for i in range(1, j + 1):
                w = best[c - 1][i - 1] + waste(i, j)
                if w < best[c][j]:
                    best[c][j], back[c][j] = w, i
    c = min(range(1, k + 1), key=lambda c_: (best[c_][m - 1], c_))
    length, j = {}, m - 1
    while c >= 1:
        i = back[c][j] if c > 1 else 0
        for t in range(i, j + 1):
            length[r[t]] = r[j]
        j, c = i - 1, c - 1
    return [(g, length[n]) for g, n in zip(groups, rounded)]


@dataclass(frozen=True)
class PackTensors:
    """A pack of the packed baselines (``Steps.pack_tensors``): ``ids [n]``, ``targets [n]`` (``ids`` shifted by
    one), ``same [n]`` (the loss weight of predicting ``targets[t]``: its path's coefficient where t + 1 is in
    the same sequence, else 0), ``cu [S + 1]`` int64 sequence bounds (the padding is the last sequence) and
    ``doc [n]`` (each token's sequence)."""

    ids: torch.Tensor
    targets: torch.Tensor
    same: torch.Tensor
    cu: torch.Tensor
    doc: torch.Tensor


def document_mask(doc: torch.Tensor, n: int, device):
    """The document-causal mask of a pack whose tokens lie in sequences ``doc [n]``: a flex BlockMask on CUDA, a
    dense ``[n, n]`` bool mask elsewhere (what :func:`document_sdpa` applies)."""
    if torch.device(device).type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask

        def doc_causal(b, h, q, k):
            return (doc[q] == doc[k]) & (k <= q)

        return create_block_mask(doc_causal, None, None, n, n, device=device)
    q = torch.arange(n, device=device)
    return (doc[:, None] == doc[None, :]) & (q[None, :] <= q[:, None])


class _Packed:
    """The block mask (CUDA) / dense mask (CPU) the replaced SDPA reads during the packed baseline."""

    mask = None
    kernel_options = None


def document_sdpa(holder):
    """An SDPA replacement for a causal call (``is_causal=True``, no ``attn_mask``, no dropout; anything else
    is refused, never ignored) that applies ``holder.mask`` instead (the current pack's document-causal
    mask: a BlockMask for flex on CUDA with ``holder.kernel_options``, a dense bool mask on CPU).  Used by
    the packed baselines here and in ``hybrid_baselines``."""
    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p or not is_causal:
            raise NotImplementedError(f"the packed baseline replaces causal SDPA without mask or dropout only (got "
                                      f"attn_mask={'None' if attn_mask is None else tuple(attn_mask.shape)}, "
                                      f"is_causal={is_causal}, dropout_p={dropout_p})")
        if q.device.type == "cuda":
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, block_mask=holder.mask, scale=scale, enable_gqa=enable_gqa,
                                  kernel_options=holder.kernel_options)
        return _ORIG_SDPA(q, k, v, attn_mask=holder.mask, scale=scale, enable_gqa=enable_gqa)
    return sdpa


_document_sdpa = document_sdpa(_Packed)


_ORIG_SDPA = F.scaled_dot_product_attention


class _patched_sdpa:
    def __enter__(self):
        torch.nn.functional.scaled_dot_product_attention = _document_sdpa

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = _ORIG_SDPA


def _sdpa_priority():
    """cuDNN first among SDPA backends (falls back to flash / efficient / math where cuDNN refuses)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # older torch: no priority, cuDNN simply enabled
        return sdpa_kernel(order)


def _upcast(x):
    """Half-precision logits go to float32 for the loss (as the tree's fused loss does); float64 stays."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def _path_loss(logits, ids, coef):
    return F.cross_entropy(_upcast(logits[0, :-1]), ids[1:], reduction="sum") * coef


def batches_step(tm, batches, zero, make: Callable[[], list] | None = None) -> Callable:
    """One step of a tree model over ``batches`` (a whole tree: one batch; packed partitions: several):
    ``zero()``, then fwd+bwd of each batch; returns the summed loss (detached).

    ``make``: builds the same batches again (``batches`` is its first result).  Steps then alternate between two
    sets of batch tensors (:func:`distinct_batches`), so that every step does the per-batch host work again (the
    padding, the ops' plans), as a training step on a new batch does: the model keeps the last batch's, keyed on
    its tensors' identity, and a benchmark that feeds the same tensors again would time work cached from the step
    before.  After each backward the next batch is prepared (``TreeModel.prepare``), while the GPU runs the
    backward, as a training loop that uses it does; the packed baselines build their packs once, before timing."""

    record = torch.profiler.record_function  # named host ranges for prof_step's idle gaps
    sets = [batches] if make is None else [batches, distinct_batches(make)]
    order = itertools.cycle([b for s in sets for b in s])
    nxt = [next(order)]  # the batch run next (prepared after the backward before it)

    def step():
        with record("harness::zero_grad"):
            zero()
        total = 0.0
        for _ in batches:
            with record("harness::forward"):
                out = tm(nxt[0])
            with record("harness::backward"):
                out.loss.backward()
            total += out.loss.detach()
            nxt[0] = next(order)
            with record("harness::prepare"):
                tm.prepare(nxt[0])
        return total
    return step


def _with_setting(step: Callable, module, name: str, value) -> Callable:
    """``step`` with ``module.name`` set to ``value`` while it runs (put back after, also when it raises)."""
    from unittest import mock

    def patched_step():
        with mock.patch.object(module, name, value):
            return step()
    return patched_step


def _with_block_sparse_layout(step: Callable, layout: str) -> Callable:
    """``step`` with the varlen op's block-sparse plan in ``layout``'s order while it runs (plans are kept per
    setting, so a model shared with ``tree`` builds its own)."""
    from treecompile.ops import varlen_tree_attention

    return _with_setting(step, varlen_tree_attention, "BLOCK_SPARSE_LAYOUT", layout)


def _with_kv_heads(step: Callable, kv_heads: str) -> Callable:
    """``step`` with the varlen op's segments reading K/V as ``kv_heads`` (one of
    ``varlen_tree_attention.KV_HEADS_CHOICES``) while it runs; refused at once if not one of those."""
    from treecompile.ops import varlen_tree_attention

    if kv_heads not in varlen_tree_attention.KV_HEADS_CHOICES:
        raise ValueError(f"kv_heads: expected one of {varlen_tree_attention.KV_HEADS_CHOICES}, got {kv_heads!r}")
    return _with_setting(step, varlen_tree_attention, "KV_HEADS", kv_heads)


def _with_unkept_forward(step: Callable, forward: str) -> Callable:
    """``step`` with the varlen op's forwards that keep no rows run as ``forward`` (one of
    ``varlen_tree_attention.UNKEPT_FORWARD_CHOICES``) while it runs; refused at once if not one of those."""
    from treecompile.ops import varlen_tree_attention

    if forward not in varlen_tree_attention.UNKEPT_FORWARD_CHOICES:
        raise ValueError(f"unkept_forward: expected one of {varlen_tree_attention.UNKEPT_FORWARD_CHOICES}, "
                         f"got {forward!r}")
    return _with_setting(step, varlen_tree_attention, "UNKEPT_FORWARD", forward)


def _without_fa4_replay(step: Callable, setting: str = "ENABLED") -> Callable:
    """``step`` with ``ops.fa4_replay`` off while it runs: ``setting`` "ENABLED" (FA4's interfaces on every layer,
    forward and backward) or "BACKWARD" (the backward's only)."""
    from treecompile.ops import fa4_replay

    return _with_setting(step, fa4_replay, setting, False)


def _with_driver_reads(step: Callable) -> Callable:
    """``step`` with the memory "fit" decisions reading the driver's free memory every time
    (``ops.logprobs_kept.DRIVER_READ_S = 0``, as before session 43) while it runs."""
    from treecompile.ops import logprobs_kept

    return _with_setting(step, logprobs_kept, "DRIVER_READ_S", 0.0)


def _with_deterministic(step: Callable) -> Callable:
    """``step`` under ``torch.use_deterministic_algorithms(True)`` (and cuBLAS's ``CUBLAS_WORKSPACE_CONFIG``, which
    that mode asks for), both put back after, also when it raises: the cost of bitwise-repeatable steps.  With
    ``TREE_DETERMINISTIC_FILL=0`` in the environment, without the mode's NaN fill of every new tensor
    (``torch.utils.deterministic.fill_uninitialized_memory``: session 44 measured it as most of the mode's cost)."""
    from unittest import mock

    fill = os.environ.get("TREE_DETERMINISTIC_FILL", "1") != "0"

    def deterministic_step():
        before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        was_fill = torch.utils.deterministic.fill_uninitialized_memory  # a property: not mock.patch's to restore
        with mock.patch.dict(os.environ, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}):
            torch.use_deterministic_algorithms(True)
            torch.utils.deterministic.fill_uninitialized_memory = fill
            try:
                return step()
            finally:
                torch.use_deterministic_algorithms(before[0], warn_only=before[1])
                torch.utils.deterministic.fill_uninitialized_memory = was_fill
    return deterministic_step


def _with_cpp_wrapper(step: Callable) -> Callable:
    """``step`` under inductor's ``cpp_wrapper=True`` (read when a graph compiles: its TreeModel's first step and a
    new length bucket's)."""

    import torch._inductor.config as inductor_config

    def cpp_step():
        with inductor_config.patch(cpp_wrapper=True):
            return step()
    return cpp_step


def treecompile_ops() -> list[str]:
    """Every registered ``treecompile::`` op (``namespace::name``), the lowering's modules imported first."""
    import treecompile.passes.lower_cuda  # noqa: F401  (imports the ops it lowers to, registering them)

    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("treecompile::"))


def _with_cudagraphs(step: Callable) -> Callable:
    """``step`` with inductor's graphs compiled into CUDA graphs between treecompile's ops (read when a graph
    compiles: its TreeModel's first step and a new length bucket's).  Inductor partitions each graph at every
    ``treecompile::`` op (``custom_should_partition_ops``): those ops do host work per call (plans, FA4's launches,
    memory decisions), which a captured graph would replay stale; inductor itself partitions at ops with
    data-dependent sizes, CPU tensors and syncs.  What lies between (projections, norms, rotary, MLPs, their
    backward) is captured once per length bucket and replayed, its inputs copied into the graph's own buffers where
    they are not static.  Each step starts a new CUDA-graph generation (``cudagraph_mark_step_begin``)."""
    from unittest import mock

    import torch._inductor.config as inductor_config
    from torch._inductor.scheduler import Scheduler

    ops = treecompile_ops()
    should_partition = _partition_outputs_with_their_op(Scheduler.should_partition, ops)

    def cudagraph_step():
        torch.compiler.cudagraph_mark_step_begin()
        with inductor_config.patch({"triton.cudagraphs": True, "graph_partition": True,
                                    "custom_should_partition_ops": ops}), \
                mock.patch.object(Scheduler, "should_partition", should_partition):
            return step()
    return cudagraph_step


def _partition_outputs_with_their_op(should_partition: Callable, ops: list[str]) -> Callable:
    """Inductor's ``Scheduler.should_partition``, which also keeps out of the CUDA graphs the ``MultiOutput`` nodes
    that take the outputs out of the tuple of an op in ``ops``.  Torch 2.11's inductor puts those in the next
    CUDA-graph partition and hands it the op's whole tuple as an input; CUDA-graph trees take only tensors and ints
    as inputs (session 45, ``h200_s45/cgdiag.txt``: the warm-up found the op's output tensors neither in its pool
    nor among its inputs, and with that check off the recording refused the tuple; session 27 had met the same and
    patched it the same way in ``h100_s27/cg.py``).  Kept with their op, the tuple
    stays in the eager region between partitions and each output enters the next partition as a tensor."""
    from torch._inductor import ir
    from torch._inductor.utils import get_op_names

    def patched(self, node):
        reason = should_partition(self, node)
        producer = node.node if reason is None and isinstance(node.node, ir.MultiOutput) else None
        while isinstance(producer, ir.MultiOutput):  # a list inside the tuple: unpacked in two steps
            producer = producer.inputs[0]
        if isinstance(producer, ir.FallbackKernel) and isinstance(producer.op_overload, torch._ops.OpOverload) \
                and any(name in ops for name in get_op_names(producer.op_overload)):
            return f"an output of {producer.op_overload}"
        return reason
    return patched


def distinct_batches(make: Callable[[], list]) -> list:
    """``make()``'s batches, none of whose tensors is a tensor of another call's (CUDA batches are copied to the
    device anew by each call; CPU ones may share the tree's own tensors, so those are cloned)."""
    from treecompile.tree import _TENSOR_FIELDS

    return [b if b.input_ids.device.type != "cpu" else
            dataclasses.replace(b, **{f: getattr(b, f).clone() for f in _TENSOR_FIELDS}) for b in make()]


class Steps:
    """Builds the step closure of each contender for one (model, tree)."""

    def __init__(self, model, spec: ModelSpec, case: TreeCase, cfg: BenchConfig, tmodels: dict):
        from treecompile import Tree

        self.model, self.spec, self.case, self.cfg, self.tmodels = model, spec, case, cfg, tmodels
        self.params = list(model.parameters())
        self.dev = torch.device(cfg.device)
        self.tree = Tree.from_paths([list(p) for p in case.paths])
        self.coef = self.tree.path_coefficients(cfg.normalize).tolist()
        self.path_ids = [torch.tensor(p, device=self.dev) for p in case.paths]
        self.note: str | None = None  # set by a contender that chooses a kernel at run time

    def zero(self):
        """Every contender's step starts here: the gradients set to None over a parameter list, as
        ``optimizer.zero_grad()`` does.  ``nn.Module.zero_grad``, used until session 40, walks the modules first:
        0.57 ms against 0.09 for the 0.6B's 310 parameters on this repository's CPU (meta tensors: the walk alone);
        on the H200 host it took 1.8-3.4 ms a step with the frees, a harness cost every contender paid."""
        for p in self.params:
            p.grad = None

    def logits(self, ids):
        """``ids [T]`` -> logits ``[1, T, V]`` of the model on that one sequence (``ModelSpec.logits``)."""
        return self.spec.logits(self.model, ids[None])

    def eager_per_path(self):
        def step():
            self.zero()
            total = 0.0
            with self.spec.baseline_context(self.model):
                for ids, c in zip(self.path_ids, self.coef):
                    loss = _path_loss(self.logits(ids), ids, c)
                    loss.backward()
                    total += loss.detach()
            return total
        return step

    def compiled_per_path(self):
        return self.per_path_step("per_path_fn", compile=self.cfg.compile_baselines)

    def per_path_step(self, key: str, *, swaps=lambda: (), cudnn_first: bool = True, compile: bool = True):
        """The per-path baselines' step (``compiled_per_path`` and the FA4 / fla variants): each path
        alone, its summed cross-entropy compiled once per ``key`` (dynamic shapes), times its coefficient,
        backward.  ``swaps()``: the context managers that put a baseline's kernels in (entered around
        each step, inside the model's ``ModelSpec.baseline_context``); ``cudnn_first``: SDPA prefers cuDNN."""
        spec, model = self.spec, self.model  # (not self: a cached compiled graph outlives this case)

        def path_ce(ids):  # the coefficient is applied outside: a Python float would specialise the graph
            return _path_loss(spec.logits(model, ids[None]), ids, 1.0)

        fn = path_ce
        if compile:
            if key not in self.tmodels:
                self.tmodels[key] = torch.compile(path_ce, dynamic=True)
            fn = self.tmodels[key]

        def step():
            self.zero()
            total = 0.0
            with contextlib.ExitStack() as stack:
                stack.enter_context(self.spec.baseline_context(self.model))
                for cm in (*swaps(), *([_sdpa_priority()] if cudnn_first else [])):
                    stack.enter_context(cm)
                for ids, c in zip(self.path_ids, self.coef):
                    loss = fn(ids) * c
                    loss.backward()
                    total += loss.detach()
            return total
        return step

    def packed_flex(self):
        """Paths packed whole into packs of <= max(--capacity, longest path) tokens (:func:`pack_plan`: each
        padded to its own length, at most ``PACK_SHAPES`` compiled shapes); one step = every pack's fwd+bwd
        (all paths in one pack when they fit)."""
        refusal = self.spec.packing_refusal(self.model)
        if refusal:
            raise _Skip(refusal)
        wdtype = _upcast(next(self.model.parameters())).dtype
        packs = [self._pack(g, n, wdtype) for g, n in pack_plan([len(p) for p in self.case.paths], self.cfg.capacity)]
        if self.dev.type == "cuda":
            try:
                from treecompile.ops.flex_tree_attention import kernel_options_for

                cfg = self.spec.config
                probe = torch.empty(1, cfg.num_attention_heads, 1, cfg.head_dim, device=self.dev,
                                    dtype=next(self.model.parameters()).dtype)
                _Packed.kernel_options = kernel_options_for(probe)
            except ImportError:
                _Packed.kernel_options = None
        spec, model = self.spec, self.model

        def loss_fn(ids, targets, same):
            logits = _upcast(spec.logits(model, ids[None])[0])
            return (F.cross_entropy(logits, targets, reduction="none") * same).sum()

        fn = loss_fn
        if self.cfg.compile_baselines:  # its own code object: never shares a cache entry with per-path graphs
            fn = torch.compile(loss_fn, dynamic=False)

        def step():
            self.zero()
            total = 0.0
            with self.spec.baseline_context(self.model), _patched_sdpa():
                for ids, targets, same, mask in packs:
                    _Packed.mask = mask
                    loss = fn(ids, targets, same)
                    loss.backward()
                    total += loss.detach()
            return total
        return step

    def compiled_per_path_fla(self):
        return self._hybrid_baseline("compiled_per_path_fla")

    def packed_fla_varlen(self):
        return self._hybrid_baseline("packed_fla_varlen")

    def packed_fla_varlen_conv(self):
        return self._hybrid_baseline("packed_fla_varlen_conv")

    def _hybrid_baseline(self, name):
        """The hybrid baselines (benchmarks/hybrid_baselines.py); a skipped row for dense models, or where
        fla cannot run (``compiled_per_path_fla`` needs CUDA; ``packed_fla_varlen`` runs the reference
        GDN per sequence on CPU)."""
        if __package__:
            from benchmarks import hybrid_baselines
        else:
            import hybrid_baselines
        if not hybrid_baselines.gdn_hook_owners(self.model):
            raise _Skip("hybrid models only (no Gated DeltaNet kernel hooks; dense models: compiled_per_path / "
                        "packed_*)")
        if self.dev.type == "cuda" or name == "compiled_per_path_fla":
            from treecompile.ops.fla_gdn import fla_unusable_reason

            reason = fla_unusable_reason() if self.dev.type == "cuda" else "fla runs on CUDA only"
            if reason:
                raise _Skip(reason)
        if name == "packed_fla_varlen":
            return hybrid_baselines.packed_fla_varlen(self, self.cfg.capacity)
        if name == "packed_fla_varlen_conv":
            if self.dev.type != "cuda":
                raise _Skip("fla's conv runs on CUDA only")
            return hybrid_baselines.packed_fla_varlen(self, self.cfg.capacity, conv="fla")
        return hybrid_baselines.compiled_per_path_fla(self)

    def compiled_per_path_fa4(self):
        return self._fa4_baseline("compiled_per_path_fa4")

    def packed_fa4_varlen(self):
        return self._fa4_baseline("packed_fa4_varlen")

    def packed_fa4_varlen_cudagraphs(self):
        """``packed_fa4_varlen`` with each pack's compiled forward and backward captured whole as CUDA graphs
        (``fa4_baselines.packed_fa4_varlen(cudagraphs=True)``): the packed baseline without the GPU's gaps between
        launches, to time against ``tree_cudagraphs`` in back-to-back steps (``--loop``).  On request; CUDA with
        flash-attn-4."""
        return self._fa4_baseline("packed_fa4_varlen_cudagraphs")

    def _fa4_baseline(self, name):
        """The FA4 baselines (benchmarks/fa4_baselines.py); a skipped row where FA4 cannot run."""
        if __package__:
            from benchmarks import fa4_baselines
        else:
            import fa4_baselines
        from treecompile.ops.fa4_tree_attention import fa4_unusable_reason

        packed = name.startswith("packed_fa4_varlen")
        refusal = self.spec.packing_refusal(self.model, windows=True) if packed else None
        if refusal:
            raise _Skip(refusal)
        reason = fa4_unusable_reason() if self.dev.type == "cuda" else "FA4 runs on CUDA only"
        if reason:
            raise _Skip(reason)
        if packed:
            return fa4_baselines.packed_fa4_varlen(self, self.cfg.capacity,
                                                   cudagraphs=name == "packed_fa4_varlen_cudagraphs")
        return fa4_baselines.compiled_per_path_fa4(self)

    def pack_tensors(self, members: list[int], n: int, wdtype) -> "PackTensors":
        """One pack of the given paths (in order), padded to ``n`` tokens by a sequence of its own (none if they
        fill it): the packed baselines' inputs (:class:`PackTensors`)."""
        lens = [len(self.case.paths[i]) for i in members]
        pad = n - sum(lens)
        seqs = lens + ([pad] if pad else [])
        ids = torch.cat([self.path_ids[i] for i in members] + [torch.zeros(pad, dtype=torch.long, device=self.dev)])
        sizes = torch.tensor(seqs, device=self.dev)
        doc = torch.repeat_interleave(torch.arange(len(seqs), device=self.dev), sizes)
        # target of position t is ids[t+1] within the same document, weighted by its path's coefficient
        w = torch.repeat_interleave(torch.tensor([self.coef[i] for i in members] + ([0.0] if pad else []),
                                                 device=self.dev, dtype=wdtype), sizes)
        same = torch.zeros_like(w)
        same[:-1] = (doc[1:] == doc[:-1]).to(wdtype) * w[:-1]
        targets = torch.cat([ids[1:], ids[:1]])
        cu = torch.tensor([0] + seqs, device=self.dev).cumsum(0)
        return PackTensors(ids, targets, same, cu, doc)

    def _pack(self, members: list[int], n: int, wdtype):
        """One pack of the given paths, padded to ``n`` tokens: (ids, targets, weights, mask)."""
        p = self.pack_tensors(members, n, wdtype)
        return p.ids, p.targets, p.same, document_mask(p.doc, n, self.dev)

    def _tree_model(self, boundary=False, layout="dfs", kernel="auto", conv="auto", head="auto", keys="auto",
                    cpp_wrapper=False, cudagraphs=False):
        import treecompile

        # cpp_wrapper, cudagraphs: a model of its own (its graphs compile under that inductor setting)
        key = ("rf" if boundary else "tree", layout, kernel, conv, head, keys, cpp_wrapper, cudagraphs)
        if key not in self.tmodels:
            self.tmodels[key] = treecompile.compile(self.model, boundary=boundary, attention_layout=layout,
                                                    attention_kernel=kernel, conv_kernel=conv, head_logits=head,
                                                    attention_keys=keys)
        return self.tmodels[key]

    def tree_heavy_first(self):
        """``tree`` with ``attention_layout="heavy_first"`` (tree attention in heavy-child-first order; CUDA)."""
        return self._cuda_tree_step("attention_layout", layout="heavy_first")

    def tree_fa4_varlen(self):
        """``tree`` with ``attention_kernel="fa4_varlen"`` (FA4 varlen over the tree's segments; CUDA)."""
        return self._cuda_tree_step("attention_kernel='fa4_varlen'", kernel="fa4_varlen")

    def tree_fa4_flex(self):
        """``tree`` with ``attention_kernel="fa4"`` (FA4 through flex's FLASH backend under the tree's BlockMask: what
        ``"auto"`` took on Hopper before session 16; CUDA)."""
        return self._cuda_tree_step("attention_kernel='fa4'", kernel="fa4")

    def tree_conv_fla(self):
        """``tree`` with ``conv_kernel="fla"`` (the GDN layers' short conv through fla's varlen conv: what a compiled
        graph ran before session 18; CUDA, models with GDN layers)."""
        return self._cuda_tree_step("conv_kernel", conv="fla")

    def tree_conv_shifts_inductor(self):
        """``tree`` with ``conv_kernel="shifts_inductor"`` (the short conv's backward as inductor's shifted products,
        not the Triton kernels: what a compiled graph ran in session 18; CUDA, models with GDN layers)."""
        return self._cuda_tree_step("conv_kernel", conv="shifts_inductor")

    def tree_head_chunked(self):
        """``tree`` with ``head_logits="chunked"`` (the fused head recomputes its logits chunk by chunk in the
        backward: what every step ran before session 25; CUDA)."""
        return self._cuda_tree_step("head_logits", head="chunked")

    def tree_head_kept(self):
        """``tree`` with ``head_logits="kept"`` (the fused head keeps the logits of every row for its backward, whatever
        they take: "auto" keeps the rows that fit in the memory left when the head runs, and before session 37 chunked
        every call whose logits exceeded 1/8 of the GPU's memory, e.g. Qwen3-0.6B at 64k tree tokens on an H200;
        CUDA)."""
        return self._cuda_tree_step("head_logits", head="kept")

    def tree_keys_gathered(self):
        """``tree`` with ``attention_keys="gathered"`` (the varlen attention's backward gathers each segment's K/V
        again, as every step did before session 41; "auto" keeps the forward's gathered rows where memory allows;
        since session 58 a forward that keeps none runs FA4's block-sparse kernels, ``UNKEPT_FORWARD``; CUDA)."""
        return self._cuda_tree_step("attention_keys", keys="gathered")

    def tree_fa4_interface(self):
        """``tree`` with FA4's varlen forward and backward called through their Python interfaces on every layer
        (``ops.fa4_replay`` off: what every step ran before session 42; the tree's first call per plan is recorded
        and the later layers replay its launches; CUDA)."""
        return self._cuda_tree_step("FA4's replay", replay=False)

    def tree_fa4_bwd_interface(self):
        """``tree`` with FA4's varlen backward called through its Python interface on every layer, the forward
        replayed (``ops.fa4_replay.BACKWARD`` off: sessions 42-48; CUDA)."""
        return self._cuda_tree_step("FA4's backward replay", replay="forward")

    def tree_cpp_wrapper(self):
        """``tree`` compiled with inductor's C++ wrapper (``cpp_wrapper=True``: the lowered graph launches its kernels
        and allocates its buffers from C++, not from Python; a TreeModel of its own, whose compiles run under the
        setting): how much of a host-bound step is the Python wrapper's per-launch work.  Its first step compiles
        the wrapper with the host's C++ compiler (longer).  Not a TreeModel option: session 43 timed it on the 0.6B
        agentic tree (H200): the forward's host 82 -> 33 ms, the step 132.3 -> 132.2 ms, the first step 88 -> 417 s
        (benchmarks/results/h200_s43; CUDA)."""
        return self._cuda_tree_step("inductor's cpp_wrapper", cpp_wrapper=True)

    def tree_cudagraphs(self):
        """``tree`` with inductor's graphs captured as CUDA graphs between treecompile's ops (:func:`_with_cudagraphs`):
        whether replaying the projections, norms and MLPs of each layer removes the GPU's idle time of a host-bound
        step (the agentic tree idled 7.6 ms of 129 ms in session 44).  A TreeModel of its own.  Session 45, H200: it
        does not pay, 133.0 against ``tree``'s 129.9 ms on the agentic tree (the partitions' input copies and a
        slower forward host outweigh the backward's saved launches; ``results/h200_s45/``) (CUDA)."""
        return self._cuda_tree_step("inductor's CUDA graphs", cudagraphs=True)

    def tree_driver_reads(self):
        """``tree`` with every memory "fit" decision reading the driver's free memory (``cudaMemGetInfo``; its
        reuse for ``ops.logprobs_kept.DRIVER_READ_S`` seconds off: what every step ran before session 43, whose
        profiles showed the GPU idle 0.44-0.70 ms inside that call; CUDA)."""
        return self._cuda_tree_step("the driver's free-memory reads", driver_reads=True)

    def tree_deterministic(self):
        """``tree`` under ``torch.use_deterministic_algorithms(True)``: FA4's deterministic backward (semaphores order
        its dQ and GQA dK/dV sums), the segments even where the block-sparse plan would run, inductor's fallbacks for
        atomic scatters; its graphs compile on its first step (CUDA)."""
        return self._cuda_tree_step("deterministic mode", deterministic=True)

    def tree_block_sparse_heavy_first(self):
        """``tree`` with the varlen op's block-sparse plan in the heaviest-child-first order
        (``varlen_tree_attention.BLOCK_SPARSE_LAYOUT = "heavy_first"``: fewer partial tiles on deep trees, q/k/v
        and the output permuted inside the op).  Only trees past ``VARLEN_GATHER_LIMIT`` (deep agentic trees,
        POR 0.9) run that plan; the same TreeModel as ``tree`` (the plan is kept per setting) (CUDA)."""
        return self._cuda_tree_step("the block-sparse plan's order", block_sparse_layout="heavy_first")

    def tree_kv_expanded(self):
        """``tree`` with the varlen op's segments reading grouped-query K/V expanded to the query heads whatever the
        group size (``varlen_tree_attention.KV_HEADS = "expanded"``; the default "auto" expands groups of at most
        ``EXPAND_MAX_GROUP``): FA4's backward writes per-head dK/dV instead of accumulating each group's in
        zero-filled float32 buffers over the gathered rows and converting them; the gather and the copy sums move
        group-size times the bytes (``results/h200_s52/probe_gqa52.txt``: per layer of the 0.6B on parallel-tools,
        FA4's backward 1.303 -> 1.082 ms).  The same TreeModel as ``tree`` (CUDA)."""
        return self._cuda_tree_step("the varlen op's K/V heads", kv_heads="expanded")

    def tree_unkept_block_sparse(self):
        """``tree`` with the varlen op's forwards that keep no rows for the backward on FA4's block-sparse kernels
        (``varlen_tree_attention.UNKEPT_FORWARD = "block_sparse"``, the default since session 58, so the same as
        ``tree`` unless the setting was changed: no gather in the forward; the backward gathers and runs the
        segments, as for any forward that kept none).  Layers whose rows "auto" keeps gather them in the forward
        anyway; the first layer of a forward never keeps (CUDA)."""
        return self._cuda_tree_step("the varlen op's forward", unkept_forward="block_sparse")

    def tree_unkept_segments(self):
        """``tree`` with the varlen op's forwards that keep no rows on the segments, gathering the rows as the
        backward does (``UNKEPT_FORWARD = "segments"``, the default before session 58): the A/B of that default
        (CUDA)."""
        return self._cuda_tree_step("the varlen op's forward", unkept_forward="segments")

    def tree_keys_gathered_block_sparse_forward(self):
        """``tree_keys_gathered`` (no rows kept) with every forward on FA4's block-sparse kernels, as
        ``tree_unkept_block_sparse`` runs them (the default since session 58): against ``tree``, what keeping the rows
        is worth when the forward need not gather them (CUDA)."""
        return self._cuda_tree_step("the varlen op's forward", keys="gathered", unkept_forward="block_sparse")

    def tree_keys_gathered_segments_forward(self):
        """``tree_keys_gathered`` with every forward on the segments, gathering the rows it does not keep
        (``UNKEPT_FORWARD = "segments"``): ``tree_keys_gathered`` before session 58 (CUDA)."""
        return self._cuda_tree_step("the varlen op's forward", keys="gathered", unkept_forward="segments")

    def tree_kv_grouped(self):
        """``tree`` with the varlen op's segments handing FA4 the model's kv heads whatever the group size
        (``varlen_tree_attention.KV_HEADS = "grouped"``, the default before session 53): the A/B of "auto"'s
        expansion of small groups.  The same TreeModel as ``tree`` (CUDA)."""
        return self._cuda_tree_step("the varlen op's K/V heads", kv_heads="grouped")

    def tree_lex(self):
        """``tree`` on the same paths serialised in lexicographic order (``Tree.from_paths(order="lex")``, the
        default until session 46) instead of heaviest child first; the same TreeModel as ``tree``."""
        return self.tree_step(order="lex")

    def _cuda_tree_step(self, option: str, **kw):
        """``tree_step(**kw)`` on CUDA; elsewhere a skip naming ``option`` (a CUDA lowering option)."""
        if self.dev.type != "cuda":
            raise _Skip(f"{option} is a CUDA lowering option")
        return self.tree_step(**kw)

    def tree_step(self, layout="dfs", kernel="auto", conv="auto", head="auto", keys="auto", replay=True,
                  cpp_wrapper=False, driver_reads=False, deterministic=False, cudagraphs=False,
                  block_sparse_layout=None, order=None, kv_heads=None, unkept_forward=None):
        from treecompile import Tree

        if replay not in (True, False, "forward"):
            raise ValueError(f"tree_step: replay must be True, False or 'forward' (the forward's only), got {replay!r}")
        tree = self.tree if order is None else Tree.from_paths([list(p) for p in self.case.paths], order=order)
        tm = self._tree_model(layout=layout, kernel=kernel, conv=conv, head=head, keys=keys, cpp_wrapper=cpp_wrapper,
                              cudagraphs=cudagraphs)

        def make():
            return [tree.to_batch(normalize=self.cfg.normalize, device=self.dev)]

        (batch,) = batches = make()
        step = batches_step(tm, batches, self.zero, make)
        if replay is False:
            step = _without_fa4_replay(step)
        elif replay == "forward":
            step = _without_fa4_replay(step, "BACKWARD")
        if cpp_wrapper:
            step = _with_cpp_wrapper(step)
        if cudagraphs:
            step = _with_cudagraphs(step)
        if driver_reads:
            step = _with_driver_reads(step)
        if deterministic:
            step = _with_deterministic(step)
        if block_sparse_layout is not None:
            step = _with_block_sparse_layout(step, block_sparse_layout)
        if kv_heads is not None:
            step = _with_kv_heads(step, kv_heads)
        if unkept_forward is not None:
            step = _with_unkept_forward(step, unkept_forward)
        return step, tree.num_tokens, _tree_entries([batch.position_ids[:tree.num_tokens]])

    def tree_packed(self):
        from treecompile.runtime.partition import pack

        tm = self._tree_model()
        plan = pack(self.tree, self.cfg.capacity)

        def make():
            return plan.batches(normalize=self.cfg.normalize, device=self.dev)

        batches = make()
        tokens = sum(p.num_tokens for p in plan.partitions)
        entries = _tree_entries([b.position_ids[:p.num_tokens] for p, b in zip(plan.partitions, batches)])
        return batches_step(tm, batches, self.zero, make), tokens, entries

    def tree_rf(self):
        if self.dev.type == "cuda" and not self.cfg.rf_on_cuda:
            raise _Skip("not timed on CUDA without --rf-on-cuda (one compile per partition shape bucket)")
        from treecompile.runtime.partition import partition_redundancy_free
        from treecompile.runtime.redundancy_free import run_redundancy_free

        bm = self._tree_model(boundary=True)
        plan = partition_redundancy_free(self.tree, self.cfg.capacity)

        def step():
            self.zero()
            return run_redundancy_free(bm, plan, normalize=self.cfg.normalize).loss
        batch = self.tree.to_batch(normalize=self.cfg.normalize)
        return step, self.tree.num_tokens, _tree_entries([batch.position_ids[:self.tree.num_tokens]])


def _tree_entries(depths: list[torch.Tensor]):
    """``entries(window)`` of batches whose tokens (padding cut) sit at ``depths`` (``FlopModel.train``)."""
    return lambda window: sum(tree_attention_entries(d, window) for d in depths)


def cuda_steps(model_name: str, *, agentic: str | None = None, agentic_scale: float = 1.0, por: float = 0.5,
               paths: int = 16, path_len: int = 2048, capacity: int = 16384, iters: int = 3) -> "Steps":
    """The :class:`Steps` of one model (built in bf16 on CUDA) on one tree: the agentic tree ``agentic`` at
    ``agentic_scale``, else the synthetic ``paths`` x ``path_len`` tree at ``por`` (the profiling scripts' setup)."""
    spec = model_specs()[model_name]
    model = spec.build(torch.device("cuda"), torch.bfloat16)
    cfg = BenchConfig(device="cuda", dtype="bfloat16", iters=iters, capacity=capacity)
    case = (agentic_cases(agentic_scale, spec.config.vocab_size, [agentic])[0] if agentic
            else synthetic_cases([por], paths, path_len, spec.config.vocab_size)[0])
    return Steps(model, spec, case, cfg, {})


class _Skip(Exception):
    pass


# ---------------------------------------------------------------------------------------------- timing
def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_step(step: Callable, dev, iters: int):
    """(first step seconds, median step seconds, peak GiB, loss of the first step)."""
    first, ts, peak, loss = time_steps(step, dev, iters)
    return first, statistics.median(ts), peak, loss


def join_notes(*notes: str | None) -> str | None:
    """A row's note parts, the empty ones left out, joined by "; " (None when all are empty)."""
    return "; ".join(n for n in notes if n) or None


def _with_head_fit(note: str | None) -> str | None:
    """``note`` and, where a fused head ran under ``head_logits="auto"`` in this process, how many rows of its last
    call kept their logits (``ops.logprobs_kept.pop_last_fit``: then forgotten, for the next contender).  The last
    call only: a step of several partitions (``tree_packed``) says its last partition's."""
    from treecompile.ops.logprobs_kept import pop_last_fit

    fit = pop_last_fit()
    if not fit:
        return note
    return join_notes(note, f"last head call kept {fit['kept']:,}/{fit['rows']:,} rows")


def _with_keys_fit(note: str | None) -> str | None:
    """``note`` and, where a varlen tree attention ran under ``attention_keys="auto"`` on CUDA in this process, its
    last forward's decision (``ops.varlen_tree_attention.pop_last_keys_fit``: then forgotten): K/V kept or
    gathered again, with the rows' size over its layers against the headroom."""
    from treecompile.ops.varlen_tree_attention import pop_last_keys_fit

    fit = pop_last_keys_fit()
    if fit is None:
        return note
    gib = 1 << 30
    return join_notes(note, f"attention K/V {'kept' if fit.keep else 'gathered again'} "
                            f"({(fit.layers - 1) * fit.keys / gib:.1f} GiB over {fit.layers - 1} layers; headroom "
                            f"{fit.headroom / gib:.1f} GiB)")


def _with_fa4_replay(note: str | None) -> str | None:
    """``note`` and, where FA4's varlen calls ran in this process since the last call, how they went per kind
    (``ops.fa4_replay.pop_counts``): calls replayed, recorded (one per plan), run through the interface after a
    refused record.  Calls with replay off are not counted."""
    from treecompile.ops.fa4_replay import pop_counts

    for kind, n in pop_counts().items():
        if any(n.values()):
            note = join_notes(note, f"FA4 {kind}: {n['replayed']} calls replayed, {n['recorded']} recorded, "
                                    f"{n['refused']} through the interface")
    return note


def _with_run_notes(note: str | None) -> str | None:
    """``note`` and what the runs in this process since the last call decided and counted: the head's "fit", the
    attention K/V's "fit" and FA4's forward calls, each then forgotten (``_with_run_notes(None)`` before a
    contender drops what an earlier one left, a failed one say)."""
    return _with_fa4_replay(_with_keys_fit(_with_head_fit(note)))


def _with_attention_setup(note: str | None, dev) -> str | None:
    """``note`` and, on CUDA where FA4 cannot run (flash-attn-4 missing, a device before sm_90), why: a tree row then
    ran its attention on flex's Triton kernel, which its figures must say (a call on a machine without the FA4 wheels
    once gave a 0.83 s 0.6B 64k row that read like any other)."""
    if dev.type != "cuda":
        return note
    from treecompile.ops.fa4_tree_attention import fa4_unusable_reason

    reason = fa4_unusable_reason()
    if reason is None:
        return note
    return join_notes(note, f"attention without FA4 ({reason})")


LOOP_ROUNDS = 3  # --loop N: rounds of N back-to-back steps, each round one timed figure


def steps_seconds(step: Callable, dev, n: int = 1) -> float:
    """Seconds a step over ``n`` steps run back to back between two synchronizes (``n`` 1: one synchronized step).
    Back to back, the host's work for step i+1 overlaps the GPU's for step i, as in a training loop that does not
    wait for the GPU each step (no ``loss.item()`` per step); a step with a wait of its own (a copy to the host, a
    read of a device value) does not overlap so."""
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    _sync(dev)
    return (time.perf_counter() - t0) / n


def time_steps(step: Callable, dev, iters: int, loop: int = 0, clocks=None):
    """(first step seconds, every timed step's seconds, peak GiB, loss of the first step).  ``loop`` 0: ``iters``
    steps, each between two synchronizes.  ``loop`` N: :data:`LOOP_ROUNDS` rounds of N steps back to back with one
    synchronize before and after, each round's seconds per step (a training loop that does not wait for the GPU
    each step: the host's work for step i+1 overlaps the GPU's for step i).  ``clocks``: a context manager (a
    :class:`benchmarks.gpu_clocks.GpuClocks`) entered around the timed steps only, not the first."""
    _sync(dev)
    t0 = time.perf_counter()
    loss = float(step())
    _sync(dev)
    first = time.perf_counter() - t0
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with clocks if clocks is not None else contextlib.nullcontext():
        ts = [steps_seconds(step, dev, max(loop, 1)) for _ in range(LOOP_ROUNDS if loop else iters)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    return first, ts, peak, loss


def flat_grads(model) -> torch.Tensor:
    """All parameter gradients as one float32 vector on the host (zeros where a parameter has none), copied one
    parameter at a time: a float32 copy of every gradient on the GPU (plus ``torch.cat``'s second one) is 4x the
    bf16 model, which made the 8-layer MoE hybrid's rows OOM after their timed steps (session 24)."""
    params = list(model.parameters())
    out = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32)
    o = 0
    for p in params:
        if p.grad is not None:
            out[o:o + p.numel()].copy_(p.grad.detach().reshape(-1))
        o += p.numel()
    return out


def grad_cosine(a: torch.Tensor, b: torch.Tensor, *, chunk: int = 1 << 24) -> float:
    """Cosine of two flat gradients (``[N]``, any float dtype), accumulated in float64 chunk by chunk: a
    float32 cosine of two equal vectors is off 1 by ~1e-6, this one by ~1e-16."""
    dot = na = nb = 0.0
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].double(), b[i:i + chunk].double()
        dot, na, nb = dot + float(x @ y), na + float(x @ x), nb + float(y @ y)
    den = (na * nb) ** 0.5
    return dot / den if den else 0.0


def case_row(spec: ModelSpec, case: TreeCase, tree, cfg: BenchConfig, name: str) -> Result:
    """The row of ``name`` on ``case`` before it runs: the tree's statistics, status "ok"."""
    shown = name if cfg.compile_baselines or name != "compiled_per_path" else "compiled_per_path(eager: CPU)"
    return Result(spec.name, case.name, case.source, tree.num_paths, tree.num_path_tokens, tree.num_tokens,
                  round(tree.por, 4), shown, "ok")


def run_contenders(model, spec: ModelSpec, case: TreeCase, cfg: BenchConfig, contenders, tmodels, t_start, *,
                   ref: dict | None = None) -> tuple[list[Result], dict | None]:
    """Time ``contenders`` on ``case`` one after another in this process; returns their rows (speedups not
    yet set: :func:`finish_case`) and the reference ``{"loss": float, "grad": fp32 CPU flat gradient}``:
    ``eager_per_path``'s when it ran here, else the given ``ref``.  Rows after the reference carry
    ``loss_rel_dev`` and ``grad_cos`` against it."""
    steps = Steps(model, spec, case, cfg, tmodels)
    tree = steps.tree
    fm = FlopModel.of(model)
    lens = [len(p) for p in case.paths]
    base_flops = fm.train(sum(lens), lambda w: path_attention_entries(lens, w))
    dev = steps.dev
    rows: list[Result] = []
    for name in contenders:
        r = case_row(spec, case, tree, cfg, name)
        if time.perf_counter() - t_start > cfg.budget_s:
            r.status = "skipped: time budget"
            rows.append(r)
            continue
        r.pid = os.getpid()
        _with_run_notes(None)  # drop what an earlier contender of this process left (one that failed, say)
        stage = "building the step"
        try:
            if name in BASELINES:
                step = getattr(steps, name)()
                tokens, flops = sum(lens), base_flops
            elif name == "tree":
                step, tokens, entries = steps.tree_step()
                flops = fm.train(tokens, entries)
            else:
                step, tokens, entries = getattr(steps, name)()
                flops = fm.train(tokens, entries)
            r.note, steps.note = steps.note, None
            stage = "steps"
            clocks = GpuClocks(device_id(dev.index)) if dev.type == "cuda" else None
            first, times, peak, loss = time_steps(step, dev, cfg.iters, cfg.loop, clocks=clocks)
            med = statistics.median(times)
            r.step_times_s = [round(t, 5) for t in times]
            r.clocks = clocks.summary() if clocks is not None else None
            stage = "gradient copy"
            g = flat_grads(model)  # the reference waits on the host, not in the next contender's memory
            if name == "eager_per_path":
                ref = {"loss": loss, "grad": g}
            r.step_s, r.first_s, r.peak_gib, r.loss = med, first, peak, loss
            r.note = _with_run_notes(r.note)
            if name not in BASELINES:
                r.note = _with_attention_setup(r.note, dev)
            r.tokens_per_s = tree.num_path_tokens / med
            r.computed_tokens, r.flops = tokens, flops
            r.tflops = flops / med / 1e12
            r.bound = base_flops / flops
            if ref:
                r.loss_rel_dev = abs(loss - ref["loss"]) / abs(ref["loss"])
                r.grad_cos = grad_cosine(g, ref["grad"])
            del g
        except _Skip as e:
            r.status = f"skipped: {e}"
        except torch.OutOfMemoryError as e:
            r.status = "OOM"
            r.note = _with_run_notes(oom_note(stage, e, r.note))
        except Exception as e:  # a failed contender is a row, not a crash
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:160]
            r.status = f"error: {msg}"
            traceback.print_exc()
        finally:
            model.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(r)
        print_row(r)
    return rows, ref


def oom_note(stage: str, e: BaseException, note: str | None = None) -> str:
    """Where a contender ran out of memory and what the allocator said (its first sentence: the size asked for
    and what was free), kept in the row so an OOM can be told from a harness artefact."""
    msg = " ".join(str(e).split())
    msg = msg[:msg.find(". Of the allocated")] if ". Of the allocated" in msg else msg[:200]
    return join_notes(note, f"OOM in {stage}: {msg}")


def print_row(r: Result) -> None:
    print(json.dumps({k: v for k, v in dataclasses.asdict(r).items() if v is not None}), flush=True)


def finish_case(rows: list[Result], emit) -> list[Result]:
    """Speedups of one (model, tree)'s rows, however they were timed: ``x_*`` over each baseline, over the
    fastest baseline that ran (``best_baseline``, ``x_best``) and ``frac_bound`` = x_best / bound; then
    ``emit`` each row."""
    base = {r.contender.split("(")[0]: r.step_s for r in rows if r.contender.split("(")[0] in BASELINES and r.step_s}
    best = min(base, key=base.get) if base else None
    for r in rows:
        if r.step_s:
            r.x_eager = base.get("eager_per_path") and base["eager_per_path"] / r.step_s
            r.x_compiled = base.get("compiled_per_path") and base["compiled_per_path"] / r.step_s
            r.x_packed = base.get("packed_flex") and base["packed_flex"] / r.step_s
            if best:
                r.best_baseline, r.x_best = best, base[best] / r.step_s
                r.frac_bound = r.x_best / r.bound
        emit(r)
    return rows


def run_case(model, spec: ModelSpec, case: TreeCase, cfg: BenchConfig, contenders, tmodels, emit,
             t_start) -> list[Result]:
    """All ``contenders`` on ``case`` in this process (``--no-isolate``), speedups set, rows emitted."""
    rows, _ = run_contenders(model, spec, case, cfg, contenders, tmodels, t_start)
    return finish_case(rows, emit)


# ---------------------------------------------------------------------------------------------- isolation
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_ref(path: str, ref: dict) -> None:
    """The eager reference (loss, fp32 flat gradient) as safetensors, written to a temporary name then renamed."""
    from safetensors.torch import save_file

    tmp = path + ".tmp"
    save_file({"loss": torch.tensor([ref["loss"]], dtype=torch.float64), "grad": ref["grad"].contiguous()}, tmp)
    os.replace(tmp, path)


def load_ref(path: str) -> dict:
    from safetensors.torch import load_file

    t = load_file(path)
    return {"loss": float(t["loss"]), "grad": t["grad"]}


def suites_of(args) -> list[str]:
    """The suites a run times: ``--suite`` as given, or sweep and agentic."""
    return args.suite or ["sweep", "agentic"]


def child_command(args, *, model: str, case_index: int, contender: str, out: str, ref_args=()) -> list[str]:
    """The command that times one contender on one case in a fresh process, with the parent's (resolved)
    options; its row goes to ``out``/results.jsonl."""
    cmd = [sys.executable, "-m", "benchmarks.harness", "--no-isolate", "--device", args.device, "--dtype", args.dtype,
           "--model", model, "--contenders", contender, "--case-index", str(case_index), "--out", out,
           "--iters", str(args.iters), "--loop", str(args.loop), "--capacity", str(args.capacity),
           "--paths", str(args.paths),
           "--path-len", str(args.path_len), "--agentic-scale", repr(args.agentic_scale), "--por", *map(repr, args.por),
           "--group", *map(str, args.group)]
    for suite in suites_of(args):
        cmd += ["--suite", suite]
    if args.agentic:
        cmd += ["--agentic", *args.agentic]
    if args.rf_on_cuda:
        cmd.append("--rf-on-cuda")
    return cmd + list(ref_args)


def _child_env() -> dict:
    """The parent's environment with this checkout first on the path (``-m benchmarks.harness`` from anywhere)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_REPO, os.environ.get("PYTHONPATH")])))


def _read_jsonl(path: str) -> list[dict]:
    """Complete lines of a child's results.jsonl (a line cut short by a crash is dropped)."""
    out = []
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def run_isolated(args, specs: dict, cfg: BenchConfig, contenders, env: dict, emit, t_start, tmp: str) -> list[Result]:
    """``--isolate``: every (model, case, contender) timed by :func:`child_command` in a fresh process under
    ``--child-timeout-s``; ``--budget-s`` applies here.  The eager_per_path child saves the reference to
    ``tmp`` (the caller's temporary folder), later children of the case compare against it.  A child that
    wrote no row becomes an error row naming how it ended; one that wrote its row and then failed keeps
    the row, its note saying so.  ``env`` takes the first child's GPU fields (this process never touches
    CUDA)."""
    from treecompile import Tree

    child_env = _child_env()
    rows: list[Result] = []
    for m in args.model:
        spec = specs[m]
        for ci, case in enumerate(bench_cases(args, spec.config.vocab_size)):
            tree = Tree.from_paths([list(p) for p in case.paths])
            ref_path = os.path.join(tmp, f"ref-{m}-{ci}.safetensors")
            case_rows: list[Result] = []
            for name in contenders:
                if time.perf_counter() - t_start > cfg.budget_s:
                    r = case_row(spec, case, tree, cfg, name)
                    r.status = "skipped: time budget"
                    case_rows.append(r)
                    continue
                out = tempfile.mkdtemp(prefix="child-", dir=tmp)
                ref_args = (["--ref-save", ref_path] if name == "eager_per_path"
                            else ["--ref-load", ref_path] if os.path.exists(ref_path) else [])
                cmd = child_command(args, model=m, case_index=ci, contender=name, out=out, ref_args=ref_args)
                how = run_child(cmd, timeout_s=args.child_timeout_s, prefix=f"[{m} | {case.name} | {name}] ",
                                env=child_env)
                got = [Result(**d) for d in _read_jsonl(os.path.join(out, "results.jsonl"))]
                for r in got:
                    if not how.ok:
                        r.note = join_notes(r.note, f"{how.describe()} after writing its row")
                if not got:
                    r = case_row(spec, case, tree, cfg, name)
                    r.status = f"error: {how.describe() if not how.ok else 'child exited 0 without writing its row'}"
                    r.pid = how.pid
                    got = [r]
                with contextlib.suppress(OSError, ValueError), open(os.path.join(out, "env.json")) as f:
                    for k, v in json.load(f).items():
                        env.setdefault(k, v)
                for r in got:
                    print_row(r)
                case_rows += got
            if os.path.exists(ref_path):
                os.remove(ref_path)
            rows += finish_case(case_rows, emit)
    return rows


def recompiles_in_child(args, tmp: str) -> dict:
    """``--recompile-stream`` in a process of its own (``--isolate``): its dynamo counters start from zero."""
    out = tempfile.mkdtemp(prefix="recompiles-", dir=tmp)
    cmd = [sys.executable, "-m", "benchmarks.harness", "--no-isolate", "--recompiles-only", "--device", args.device,
           "--dtype", args.dtype, "--recompile-stream", str(args.recompile_stream), "--recompile-range",
           *map(str, args.recompile_range), "--out", out]
    if args.recompile_model:
        cmd += ["--recompile-model", args.recompile_model]
    how = run_child(cmd, timeout_s=args.child_timeout_s, prefix="[recompile stream] ", env=_child_env())
    try:
        with open(os.path.join(out, "extra.json")) as f:
            return json.load(f)["recompiles"]
    except (OSError, ValueError, KeyError):
        return {"error": how.describe() if not how.ok else "the child wrote no extra.json"}


def child_main(args, spec: ModelSpec, cfg: BenchConfig, contenders, emit) -> int:
    """``--case-index N`` (what :func:`child_command` runs): ``contenders`` on case N of one model in this
    process; rows to ``--out``/results.jsonl without speedups (the parent sets them over all its children's
    rows); ``--ref-save`` writes the eager reference there, ``--ref-load`` reads it."""
    cases = bench_cases(args, spec.config.vocab_size)
    if not 0 <= args.case_index < len(cases):
        raise SystemExit(f"--case-index {args.case_index}: {len(cases)} cases")
    case = cases[args.case_index]
    t_start = time.perf_counter()
    try:
        model = spec.build(torch.device(cfg.device), getattr(torch, cfg.dtype))
    except torch.OutOfMemoryError:
        from treecompile import Tree

        tree = Tree.from_paths([list(p) for p in case.paths])
        rows = [dataclasses.replace(case_row(spec, case, tree, cfg, n), status="OOM (model)", pid=os.getpid())
                for n in contenders]
    else:
        ref = load_ref(args.ref_load) if args.ref_load else None
        rows, ref = run_contenders(model, spec, case, cfg, contenders, {}, t_start, ref=ref)
        if args.ref_save and ref is not None:
            save_ref(args.ref_save, ref)
    for r in rows:
        emit(r)
    return 0


# ---------------------------------------------------------------------------------------------- recompiles
def recompile_stream(spec: ModelSpec, cfg: BenchConfig, n: int, lo: int, hi: int, seed: int = 0) -> dict:
    """``n`` trees of distinct sizes in [lo, hi] tokens through ``treecompile.compile``; dynamo compiles vs buckets."""
    import treecompile
    from treecompile import Tree
    from treecompile.compile import bucket_length

    dev = torch.device(cfg.device)
    model = spec.build(dev, getattr(torch, cfg.dtype))
    tm = treecompile.compile(model)
    rng = random.Random(seed)
    sizes = rng.sample(range(lo, hi + 1), n) if hi - lo + 1 >= n else [rng.randint(lo, hi) for _ in range(n)]
    torch._dynamo.utils.counters.clear()
    t0 = time.perf_counter()
    buckets = set()
    for i, size in enumerate(sizes):
        npaths = rng.randint(2, 8)
        L = max(2, size // npaths)
        por = rng.uniform(0.0, min(0.8, max_por(npaths, L)))
        tree = Tree.from_paths(synthetic_paths(npaths, L, por, vocab=spec.config.vocab_size, seed=i))
        b = tree.to_batch(device=dev)
        buckets.add(bucket_length(b.seq_len))
        model.zero_grad(set_to_none=True)
        tm(b).loss.backward()
    _sync(dev)
    c = torch._dynamo.utils.counters
    graphs = int(c["stats"].get("unique_graphs", 0))
    return {"model": spec.name, "device": cfg.device, "trees": n, "token_range": f"{lo}-{hi}",
            "distinct_T": len(set(sizes)), "buckets": len(buckets), "unique_graphs": graphs,
            "frames_ok": int(c["frames"].get("ok", 0)), "wall_s": round(time.perf_counter() - t0, 1),
            "target_met": graphs <= len(buckets) if dev.type == "cuda" else None}


# ---------------------------------------------------------------------------------------------- reports
def environment(device, *, query_gpu: bool = True) -> dict:
    """Versions and device; ``query_gpu=False`` leaves out the GPU fields (asking for them starts a CUDA
    context, which an ``--isolate`` parent must not hold while its children run)."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device}
    if device == "cuda" and query_gpu:
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            pass
    return env


TABLE_COLS = ["model", "tree", "paths", "path_tokens", "tree_tokens", "por", "contender", "status", "step_s",
              "first_s", "tokens_per_s", "tflops", "x_eager", "x_compiled", "x_packed", "x_best", "bound",
              "frac_bound", "peak_gib", "loss_rel_dev", "grad_cos", "note"]


def _fmt(v):
    if isinstance(v, float):
        if v != v:
            return ""
        return f"{v:.3g}" if abs(v) < 1e-2 else (f"{v:,.0f}" if abs(v) >= 1e4 else f"{v:.3f}")
    return "" if v is None else v


def tables(rows: list[Result], env: dict, conditions: str) -> str:
    from tabulate import tabulate

    out = [f"Conditions: {json.dumps(env)}; {conditions}", ""]
    for model in dict.fromkeys(r.model for r in rows):
        sub = [r for r in rows if r.model == model]
        out.append(f"### {model}\n")
        out.append(tabulate([[_fmt(getattr(r, c)) for c in TABLE_COLS] for r in sub], headers=TABLE_COLS,
                            tablefmt="github"))
        out.append("")
    return "\n".join(out)


def write_csv(rows: list[Result], path: str) -> None:
    names = [f.name for f in dataclasses.fields(Result)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for r in rows:
            w.writerow(dataclasses.asdict(r))


def plot(csv_path: str, png_path: str) -> str | None:
    """Speedup over the fastest baseline against POR, one series per (model, contender); the work bound
    dashed.  Returns None when drawn, else why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["x_best"] not in ("", "None")]
    if not rows:
        return f"{csv_path} has no row with a speedup"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in rows:
        if r["contender"] in TREE_CONTENDERS:
            series.setdefault((r["model"], r["contender"], r["source"]), []).append(
                (float(r["por"]), float(r["x_best"]), float(r["bound"])))
    for (model, cont, source), pts in sorted(series.items()):
        pts.sort()
        marker = "o" if source == "synthetic" else "s"
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"{model} {cont} ({source})")
        if cont == "tree":
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=line.get_color(), alpha=0.5)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("POR (prefix overlap ratio)")
    ax.set_ylabel("speedup over the fastest baseline")
    ax.set_title("training step (fwd+bwd), dashed: work bound")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    return None


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="repeatable; default qwen3-0.6b (tiny: dense-tiny, hybrid-tiny; "
                    "HF transformers models: qwen3-30b-a3b-4l, qwen3.5-35b-a3b-8l, hf-qwen3-0.6b, hf-qwen3-moe-tiny, "
                    "hf-qwen3.5-moe-tiny; sliding windows: hf-mistral-0.6b-w512, hf-qwen3-0.6b-swa, "
                    "hf-mistral-tiny-w5)")
    ap.add_argument("--suite", action="append", choices=["sweep", "agentic", "group"],
                    help="repeatable; default sweep and agentic (group: one prompt and its samples, --group)")
    ap.add_argument("--group", type=int, nargs=4, default=[2048, 16, 512, 1536], metavar=("PROMPT", "SAMPLES", "LO", "HI"),
                    help="the group suite's tree: prompt tokens, completions, their shortest and longest")
    ap.add_argument("--por", type=float, nargs="+", default=[0.2, 0.5, 0.7, 0.85, 0.92])
    ap.add_argument("--paths", type=int, default=16, help="paths per synthetic tree")
    ap.add_argument("--path-len", type=int, default=2048, help="tokens per synthetic path")
    ap.add_argument("--agentic-scale", type=float, default=1.0)
    ap.add_argument("--agentic", nargs="+", help="names of agentic specs to run (default all)")
    ap.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(DEFAULT_CONTENDERS),
                    help=f"default: all but {', '.join(ON_REQUEST)} (run when named)")
    ap.add_argument("--capacity", type=int, default=16384, help="token budget of partitioned contenders and of each packed_flex pack")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--loop", type=int, default=0, metavar="N",
                    help="time steps back to back: 3 rounds of N steps with one synchronize before and after each "
                    "(a training loop that does not wait for the GPU each step), the median round's time a step; "
                    "default: --iters steps, each between two synchronizes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny models and trees (a CPU smoke run)")
    ap.add_argument("--rf-on-cuda", action="store_true", help="time redundancy-free on CUDA (compiled per partition shape bucket)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="skip contenders started after this")
    ap.add_argument("--recompile-stream", type=int, default=0, metavar="N")
    ap.add_argument("--recompile-model", default=None)
    ap.add_argument("--recompiles-only", action="store_true", help="run only the recompile stream")
    ap.add_argument("--recompile-range", type=int, nargs=2, default=[1000, 2000], metavar=("LO", "HI"))
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="time every (model, tree, contender) in a fresh process (default: on CUDA yes, on CPU no)")
    ap.add_argument("--child-timeout-s", type=float, default=900.0, help="with --isolate: a child running longer "
                    "is killed and becomes an error row")
    # internal, what --isolate runs in each child: one case of one model, the eager reference saved or read
    ap.add_argument("--case-index", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ref-save", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ref-load", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="output folder")
    ap.add_argument("--plot-from", default=None, metavar="CSV", help="only redraw the plot from a results.csv")
    return ap


def bench_cases(args, vocab: int) -> list[TreeCase]:
    """The trees of one model, in order (parent and children build the same list: ``--case-index``)."""
    suites = suites_of(args)
    cases = []
    if "sweep" in suites:
        cases += synthetic_cases(args.por, args.paths, args.path_len, vocab)
    if "agentic" in suites:
        cases += agentic_cases(args.agentic_scale, vocab, args.agentic)
    if "group" in suites:
        cases += group_cases(args.group, vocab)
    return cases


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot_from:
        png = os.path.join(os.path.dirname(args.plot_from) or ".", "speedup_vs_por.png")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            png = os.path.join(args.out, "speedup_vs_por.png")
        why = plot(args.plot_from, png)
        print(png if why is None else f"no plot: {why}")
        return 0
    specs = model_specs()
    if args.tiny:
        args.model = args.model or ["dense-tiny", "hybrid-tiny"]
        args.paths, args.path_len, args.agentic_scale = min(args.paths, 16), min(args.path_len, 48), 0.03
        args.capacity = min(args.capacity, 256)
        args.iters = min(args.iters, 1)
        args.recompile_range = [min(args.recompile_range[0], 60), min(args.recompile_range[1], 300)]
    args.model = args.model or ["qwen3-0.6b"]
    for m in args.model:
        if m not in specs:
            raise SystemExit(f"--model: unknown {m!r}; choose from {sorted(specs)}")
    if args.agentic:
        try:
            agentic_specs(names=args.agentic)
        except ValueError as e:
            raise SystemExit(f"--agentic: {e}") from None
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    child = args.case_index is not None
    if child and len(args.model) != 1:
        raise SystemExit("--case-index runs one model")
    isolate = not child and (args.isolate if args.isolate is not None else args.device == "cuda")
    # eager_per_path first: the others' loss and gradient are compared with it
    contenders = sorted(dict.fromkeys(args.contenders), key=lambda c: c != "eager_per_path")
    if args.loop < 0:
        raise SystemExit(f"--loop: expected a number of steps >= 0, got {args.loop}")
    cfg = BenchConfig(device=args.device, dtype=args.dtype, iters=args.iters, capacity=args.capacity,
                      compile_baselines=args.device == "cuda", rf_on_cuda=args.rf_on_cuda, budget_s=args.budget_s,
                      loop=args.loop)
    env = environment(args.device, query_gpu=not isolate)
    env["timing"] = f"loop {args.loop}" if args.loop else "synchronized"  # how step_s was timed (time_steps)
    print(json.dumps(env), flush=True)
    if args.device == "cuda":
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
    out = args.out
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "env.json"), "w") as f:
            json.dump(env, f)
    jsonl = open(os.path.join(out, "results.jsonl"), "a") if out else None

    def emit(r: Result):
        if jsonl:
            jsonl.write(json.dumps(dataclasses.asdict(r)) + "\n")
            jsonl.flush()

    if child:
        try:
            return child_main(args, specs[args.model[0]], cfg, contenders, emit)
        finally:
            if jsonl:
                jsonl.close()
    t_start = time.perf_counter()
    rows: list[Result] = []
    extra = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="harness-isolate-")) if isolate else None
        if args.recompile_stream:
            if isolate:
                extra["recompiles"] = recompiles_in_child(args, tmp)
            else:
                rspec = specs[args.recompile_model or "dense-tiny16"]
                lo, hi = args.recompile_range
                try:
                    extra["recompiles"] = recompile_stream(rspec, cfg, args.recompile_stream, lo, hi)
                except Exception as e:
                    extra["recompiles"] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:200]}
                torch._dynamo.reset()
            print(json.dumps(extra["recompiles"]), flush=True)
        if not args.recompiles_only:
            rows = (run_isolated(args, specs, cfg, contenders, env, emit, t_start, tmp) if isolate
                    else run_in_process(args, specs, cfg, contenders, emit, t_start))
    where = ("each contender in its own process (--isolate: a fresh process per model, tree and contender; "
             "loss_rel_dev and grad_cos against the eager_per_path child's saved loss and fp32 gradient)" if isolate
             else "all contenders and trees of one model in one process, one after another (--no-isolate)")
    suites = suites_of(args)
    trees_ran = "; ".join(filter(None, [  # only the suites that ran (an agentic run named the synthetic trees' shape)
        f"synthetic: {args.paths} paths x {args.path_len} tokens, POR {', '.join(map(str, args.por))}"
        if "sweep" in suites else "",
        f"agentic: {', '.join(args.agentic) if args.agentic else 'every spec'} @{args.agentic_scale}"
        if "agentic" in suites else "",
        f"group: {' '.join(map(str, args.group))}" if "group" in suites else ""]))
    conditions = (f"dtype={args.dtype}; step = fwd+bwd over all paths of one tree, optimizer excluded; median of "
                  f"{args.iters} after 1 warm-up (first_s, compile included); normalize={cfg.normalize}; "
                  f"capacity={cfg.capacity}; {trees_ran}; "
                  f"x_* = baseline step / contender step; bound = baseline FLOPs / contender FLOPs "
                  f"(benchmarks/flops.py); frac_bound = x_best / bound; loss_rel_dev and grad_cos vs eager_per_path "
                  f"in the same dtype; random HF-style init (std 0.02); {where}")
    text = tables(rows, env, conditions)
    if "recompiles" in extra:
        from tabulate import tabulate
        rc = extra["recompiles"]
        text += "\n### Recompiles over a stream of trees\n\n" + tabulate([list(rc.values())], headers=list(rc),
                                                                         tablefmt="github") + "\n"
    print(text)
    if out:
        jsonl.close()
        with open(os.path.join(out, "env.json"), "w") as f:  # with --isolate the GPU fields came from a child
            json.dump(env, f)
        write_csv(rows, os.path.join(out, "results.csv"))
        with open(os.path.join(out, "tables.md"), "w") as f:
            f.write(text)
        with open(os.path.join(out, "extra.json"), "w") as f:
            json.dump(extra, f)
        why = plot(os.path.join(out, "results.csv"), os.path.join(out, "speedup_vs_por.png"))
        if why is not None:
            print(f"speedup_vs_por.png skipped: {why}", file=sys.stderr)
    return 0


def run_in_process(args, specs: dict, cfg: BenchConfig, contenders, emit, t_start) -> list[Result]:
    """``--no-isolate``: each model built once, its cases and contenders timed one after another here."""
    rows: list[Result] = []
    for m in args.model:
        spec = specs[m]
        try:
            model = spec.build(torch.device(cfg.device), getattr(torch, cfg.dtype))
        except torch.OutOfMemoryError:
            rows.append(Result(m, "-", "-", 0, 0, 0, 0.0, "-", "OOM (model)", pid=os.getpid()))
            emit(rows[-1])
            continue
        tmodels: dict = {}
        for case in bench_cases(args, spec.config.vocab_size):
            rows += run_case(model, spec, case, cfg, contenders, tmodels, emit, t_start)
        del model, tmodels
        torch._dynamo.reset()
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    sys.exit(main())
