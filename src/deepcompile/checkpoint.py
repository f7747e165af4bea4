"""Checkpoints: every rank's shards and optimizer state, and the step counters.

A checkpoint is a directory:

    meta.json        format, world size, optimizer steps, parameter names and shapes
    rank00000.pt     rank 0's shards (by parameter name, master dtype) and optimizer state_dict
    rank00001.pt     ...

Collective: every rank calls `save` / `load` with the same path (a filesystem every rank sees).
Each rank writes its own file atomically (temporary file in the same directory, fsync, rename);
rank 0 writes `meta.json` last, once every rank's file is in place, so a directory with a
`meta.json` is a complete checkpoint and an interrupted save never replaces one. The optimizer
state is read through `optimizer.state_dict()`, which sees offloaded state where it lives
([Note: optimizer state access] in runtime/offload.py). Loading needs the same world size and
parameters (no resharding); every rank checks, and all ranks raise the same error.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

FORMAT = 1
META = "meta.json"


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank{rank:05d}.pt"


def _atomic_write(target: Path, write: Callable[[Any], None], mode: str = "wb") -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _agree(comm, error: str | None) -> None:
    """All ranks raise if any rank failed (no rank is left waiting in a collective)."""
    errors = [e for e in comm.all_gather_object(error) if e is not None]
    if errors:
        raise ValueError(error or errors[0])


def _params(engine) -> list[list]:
    return [[e.name, list(e.shape)] for e in engine._registry]


def save(engine, path: str | os.PathLike) -> Path:
    path = Path(path)
    comm = engine._comm
    error = None
    if engine._micro_steps:
        error = (f"save_checkpoint: {engine._micro_steps} micro-steps are accumulated; save at an "
                 "optimizer-step boundary (after engine.step() returned True)")
    _agree(comm, error)
    path.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT, "rank": comm.rank, "world_size": comm.world,
        "shards": {e.name: e.shard.detach().to("cpu", copy=True) for e in engine._registry},
        "optimizer": engine.optimizer.state_dict(),
    }
    _atomic_write(_rank_file(path, comm.rank), lambda f: torch.save(payload, f))
    comm.all_gather_object(None)   # every rank's file is in place
    if comm.rank == 0:
        meta = {"format": FORMAT, "world_size": comm.world,
                "optimizer_steps": engine._optimizer_steps, "params": _params(engine)}
        _atomic_write(path / META, lambda f: json.dump(meta, f, indent=1), mode="w")
    comm.all_gather_object(None)
    return path


def load(engine, path: str | os.PathLike) -> None:
    path = Path(path)
    comm = engine._comm
    error, meta = None, None
    try:
        with open(path / META) as f:
            meta = json.load(f)
    except FileNotFoundError:
        error = (f"load_checkpoint: {path} is not a complete checkpoint (no {META}; an "
                 "interrupted save leaves none)")
    if meta is not None:
        if meta.get("format") != FORMAT:
            error = f"load_checkpoint: {path} has format {meta.get('format')!r}; expected {FORMAT}"
        elif meta["world_size"] != comm.world:
            error = (f"load_checkpoint: {path} was saved by {meta['world_size']} ranks; this "
                     f"engine runs on {comm.world} (resharding is not supported: load with the "
                     "same world size)")
        elif meta["params"] != _params(engine):
            saved, mine = meta["params"], _params(engine)
            diff = next(((a, b) for a, b in zip(saved, mine) if a != b),
                        (f"{len(saved)} parameters", f"{len(mine)}"))
            error = (f"load_checkpoint: {path} holds other parameters than this model "
                     f"(saved {diff[0]}, model {diff[1]})")
        elif engine._micro_steps:
            error = (f"load_checkpoint: {engine._micro_steps} micro-steps are accumulated; load "
                     "at an optimizer-step boundary")
    _agree(comm, error)
    payload = torch.load(_rank_file(path, comm.rank), map_location="cpu", weights_only=True)
    engine._drop_unused_prefetches()   # a parked gather read the shards about to be replaced
    with torch.no_grad():
        for e in engine._registry:
            e.shard.copy_(payload["shards"][e.name])
    engine._shards_changed(frozen_too=True)
    engine.optimizer.load_state_dict(payload["optimizer"])
    engine._optimizer_steps = meta["optimizer_steps"]
    engine._state.optimizer_steps = meta["optimizer_steps"]
    comm.all_gather_object(None)
