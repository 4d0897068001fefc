"""Hugging Face-format checkpoints: config.json + model.safetensors, written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def save_checkpoint(model: torch.nn.Module, config_dict: dict, directory: str | os.PathLike) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (temp name, then rename)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if config_dict.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # HF checkpoints store the tied matrix once
    for name, writer in (("model.safetensors", lambda p: save_file(state, p, metadata={"format": "pt"})),
                         ("config.json", lambda p: Path(p).write_text(json.dumps(config_dict, indent=2)))):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=d)
        os.close(fd)
        try:
            writer(tmp)
            os.replace(tmp, d / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def read_config(directory: str | os.PathLike) -> dict:
    p = Path(directory) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no config.json")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: invalid JSON ({e})") from None


def load_state(model: torch.nn.Module, directory: str | os.PathLike, *, tied: bool) -> None:
    """Load every ``*.safetensors`` in ``directory`` into ``model`` (strict: names must match)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weights")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{f}: cannot read safetensors ({e})") from None
    if tied:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{directory}: weights do not match the model (missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")
