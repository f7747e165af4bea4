"""A checkpoint's on-disk format: its file names, how a path resolves to the complete version it
names, and the checks a version passes before anything reads it ([Note: checkpoint layout] and
[Note: atomic checkpoints] in checkpoint.py). checkpoint.py (save, load) and export.py
(consolidate, save_pretrained) both build on it, and neither imports the other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

FORMAT = 2
POINTER = "deepcompile-checkpoint.json"
STATE = "state.json"
CLIENT = "client_state.pt"
COMMIT = "commit.json"
HF_CONFIG = "hf_config.json"
HF_GENERATION = "hf_generation_config.json"
PLAN = "plan.json"
TMP_PREFIX = ".tmp-"


def rng_file(rank: int) -> str:
    """Rank `rank`'s random number generators ([Note: random state in a checkpoint])."""
    return f"rng-{rank:05d}.pt"


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or loaded; the same message on every rank."""


def persistent_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers saved with its weights (not the non-persistent ones), by name."""
    out = {}
    for prefix, m in module.named_modules():
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


def hf_config_dicts(module: Any) -> tuple[dict | None, dict | None]:
    """(config, generation config) of a Hugging Face model as plain dicts; (None, None) else."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None, None
    cfg = config.to_dict()
    cfg["architectures"] = [type(module).__name__]
    gen = getattr(module, "generation_config", None)
    gen = gen.to_dict() if gen is not None and hasattr(gen, "to_dict") else None
    return cfg, gen


def resolve(root: Path) -> Path:
    """The complete version directory a checkpoint path names (its pointer, or itself)."""
    pointer = root / POINTER
    if pointer.exists():
        try:
            data = json.loads(pointer.read_text())
            current = data["current"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"load_checkpoint: {root} is damaged: {POINTER} is unreadable "
                                  f"({type(e).__name__})") from None
        if data.get("format") != FORMAT:
            raise CheckpointError(f"load_checkpoint: {root} has format {data.get('format')!r}; "
                                  f"this deepcompile reads format {FORMAT}")
        version = root / current
        if not version.is_dir():
            raise CheckpointError(f"load_checkpoint: {root} is damaged: its pointer names "
                                  f"{current}, which is missing")
        return version
    if (root / COMMIT).exists():
        return root
    if (root / "meta.json").exists():
        raise CheckpointError(f"load_checkpoint: {root} is a checkpoint of the older format 1 "
                              "(one file per rank), which this deepcompile does not read; load it "
                              "with the deepcompile that wrote it and save again")
    if not root.exists():
        raise CheckpointError(f"load_checkpoint: no checkpoint at {root} (it does not exist)")
    raise CheckpointError(f"load_checkpoint: {root} holds no complete checkpoint (no {POINTER}: "
                          "a save interrupted before its first commit leaves none)")


def validate(version: Path) -> dict:
    """Every file of the version's commit marker, with its size; returns its state.json."""
    try:
        commit = json.loads((version / COMMIT).read_text())
        files = commit["files"]
    except FileNotFoundError:
        raise CheckpointError(f"load_checkpoint: {version} is not a complete checkpoint (no "
                              f"{COMMIT})") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"load_checkpoint: {version} is damaged: {COMMIT} is unreadable "
                              f"({type(e).__name__})") from None
    for name, size in sorted(files.items()):
        p = version / name
        if not p.is_file():
            raise CheckpointError(f"load_checkpoint: {version} is damaged: {name} is missing")
        actual = p.stat().st_size
        if actual != size:
            raise CheckpointError(f"load_checkpoint: {version} is damaged: {name} has {actual} "
                                  f"bytes, the save wrote {size} (truncated or overwritten)")
    try:
        state = json.loads((version / STATE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"load_checkpoint: {version} is damaged: {STATE} is unreadable "
                              f"({type(e).__name__})") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"load_checkpoint: {version} has format {state.get('format')!r}; "
                              f"expected {FORMAT}")
    return state
