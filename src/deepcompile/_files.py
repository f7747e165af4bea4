"""Atomic JSON files: the one writer of the library's JSON (checkpoint metadata, exported
configs, the plan cache)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable


def write_json_atomic(path: str | os.PathLike, obj: Any, *, indent: int = 1,
                      sort_keys: bool = False, default: Callable[[Any], Any] | None = None) -> Path:
    """`obj` as JSON at `path`, whole or not at all: written to a temporary file in the same
    directory, fsynced, and renamed over `path` (a reader never sees half a file, and two
    processes writing the same path leave one complete version)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=indent, sort_keys=sort_keys, default=default)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
