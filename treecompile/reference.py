"""The per-path oracle: the unmodified model run on each path alone.

Everything treecompile computes on a tree is checked against this.  It is deliberately plain: one
forward per path (``input_ids [1, |p|]``), log-softmax, read each token's log-probability at the
position before it, and the three normalizations written out as their formulas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

import torch

from treecompile.tree import NORMALIZATIONS

__all__ = ["ReferenceResult", "logits_of", "path_logprobs", "run"]


def logits_of(out, length: int | None = None, vocab: int | None = None) -> torch.Tensor:
    """A model's output -> logits, chosen as the compiler chooses them (``passes.rewrite_loss``): a tensor as is;
    an object's ``.logits`` (HF ``CausalLMOutput``) or a mapping's ``"logits"``; else, among a tuple's, list's or
    mapping's tensors, the one ``[1, length, V]``, or among several the one whose width is ``vocab`` (the input
    embedding's rows).  ValueError naming the outputs' shapes when none or several are left."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    if isinstance(out, Mapping) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    items = list(out.values()) if isinstance(out, Mapping) else list(out) if isinstance(out, (tuple, list)) else []
    tensors = [x for x in items if isinstance(x, torch.Tensor)]
    cands = [x for x in tensors if x.dim() == 3 and x.shape[0] == 1 and length in (None, x.shape[1])]
    if len(cands) > 1 and vocab is not None:
        wide = [x for x in cands if x.shape[2] == vocab]
        cands = wide if len(wide) == 1 else cands
    if len(cands) != 1:
        raise ValueError(f"reference: expected exactly one [1, T, V] logits output, found {len(cands)} among the "
                         f"model's outputs ({type(out).__name__}: {[tuple(x.shape) for x in tensors]}"
                         + (f"; the input embedding has {vocab} rows" if vocab is not None else "") + ")")
    return cands[0]


def _input_vocab(model: torch.nn.Module) -> int | None:
    """The vocabulary size capture reads (``frontend._vocab_size``), or None where it finds none."""
    from treecompile.frontend import CaptureError, _vocab_size

    try:
        return _vocab_size(model)
    except CaptureError:
        return None


def path_logprobs(model: torch.nn.Module, path: Sequence[int], device=None, *,
                  log_softmax=torch.log_softmax) -> torch.Tensor:
    """log p(token i | tokens < i) of one path, shape [|p|]; entry 0 is 0 (nothing predicts it).  ``device``: where
    the ids go; None: the model's (its first parameter's or buffer's device, else the CPU).  ``log_softmax``:
    ``(logits, dim) -> log-probs`` over half-precision logits upcast to float32 (another equal formula rounds
    otherwise: the tests' estimate of the reference's own rounding)."""
    if device is None:
        device = next((t.device for t in (*model.parameters(), *model.buffers())), None)
    ids = torch.as_tensor(list(path), dtype=torch.long, device=device)[None]
    logits = logits_of(model(ids), ids.shape[1], _input_vocab(model))[0]
    lp = log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1)
    tok = lp[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([tok.new_zeros(1), tok])


@dataclass
class ReferenceResult:
    loss: torch.Tensor  # scalar, differentiable
    logprobs: list[torch.Tensor]  # one [|p|] tensor per path


def run(model: torch.nn.Module, paths: Sequence[Sequence[int]], *, loss_masks=None, path_weights=None,
        normalize: str = "sum", device=None) -> ReferenceResult:
    """Per-path loss under ``normalize`` (m = mask, c = path weight, N = paths, l = -log p):

    - ``sum``:        (1/N) * sum_p sum_i m[p,i] c[p] l[p,i]
    - ``path_mean``:  (1/N) * sum_p c[p] * (sum_i m[p,i] l[p,i]) / (sum_i m[p,i])   (0 if no m)
    - ``token_mean``: sum_p sum_i m[p,i] c[p] l[p,i] / sum_p sum_i m[p,i]
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize: expected one of {NORMALIZATIONS}, got {normalize!r}")
    N = len(paths)
    lps = [path_logprobs(model, p, device) for p in paths]
    masks = []
    for i, p in enumerate(paths):
        if loss_masks is None:
            m = torch.ones(len(p), dtype=torch.float64)
            m[0] = 0
        else:
            m = torch.as_tensor(loss_masks[i], dtype=torch.float64)
        masks.append(m.to(lps[i].device))
    weights = [1.0 if path_weights is None else float(path_weights[i]) for i in range(N)]
    sums = [-(m * lp.to(torch.float64)).sum() for m, lp in zip(masks, lps)]
    if normalize == "sum":
        loss = sum(c * s for c, s in zip(weights, sums)) / N
    elif normalize == "path_mean":
        loss = sum(c * s / m.sum() if m.sum() > 0 else 0.0 * s for c, s, m in zip(weights, sums, masks)) / N
    else:
        total = sum(m.sum() for m in masks)
        loss = sum(c * s for c, s in zip(weights, sums)) / total if total > 0 else 0.0 * sums[0]
    return ReferenceResult(loss=loss, logprobs=lps)
