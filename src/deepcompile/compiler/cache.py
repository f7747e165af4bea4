"""The plan cache: agreed profiles and pass decisions, stored as JSON under `cache_dir`.

The key is a digest of everything that determines a plan: every partitioned graph's code (with
parameter ids replaced by parameter names, so it is stable across processes), world size,
parameter shapes and dtypes, the config, the device type, and the torch and deepcompile
versions. Files are written atomically (temp file + rename). Rank 0 reads and writes the cache
and broadcasts what it found (`PlanCache`), so every rank takes the same path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from torch import fx

from ..runtime import ops
from .phases import param_name
from .profiler import GraphProfile, NodeProfile
from .._files import write_json_atomic

log = logging.getLogger("deepcompile")

FORMAT = 2   # 2: pass entries say whether the pass was kept


def graph_signature(gm: fx.GraphModule, name_of: Callable[[int], str]) -> str:
    lines = []
    for node in gm.graph.nodes:
        args = node.args
        if node.op == "call_function" and node.target in ops.COMM_KINDS:
            pids = args[1]   # [Note: communication op kinds]: a pid or a list of pids
            names = [name_of(int(p)) for p in pids] if isinstance(pids, (list, tuple)) \
                else name_of(int(pids))
            args = (args[0], names, *args[2:])
        target = node.target if isinstance(node.target, str) else \
            getattr(node.target, "__name__", str(node.target))
        val = node.meta.get("val")
        meta = (tuple(val.shape), str(val.dtype)) if hasattr(val, "shape") else None
        lines.append(f"{node.name}={node.op}:{target}{args!r}{sorted(node.kwargs.items())!r}{meta}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def digest(parts: dict[str, Any]) -> str:
    blob = json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def path_for(cache_dir: str | os.PathLike, key: str) -> Path:
    return Path(cache_dir) / f"plan-{key}.json"


def load(cache_dir: str | os.PathLike, key: str) -> dict | None:
    path = path_for(cache_dir, key)
    try:
        with open(path) as f:
            plan = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeError(f"deepcompile: the cached plan {path} cannot be read ({e}); delete it "
                           "to profile again") from e
    return plan if plan.get("format") == FORMAT else None


def save(cache_dir: str | os.PathLike, key: str, plan: dict) -> Path:
    path = path_for(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_json_atomic(path, {"format": FORMAT, "key": key, **plan}, default=str)


def profile_from_dict(d: dict) -> GraphProfile:
    return GraphProfile(slot=d["slot"], version=d["version"], total_s=d["total_s"],
                        nodes=[NodeProfile(**n) for n in d["nodes"]], launched=d.get("launched"))


def plan_key(fingerprint: dict, planning: dict) -> tuple[str, dict]:
    """(digest, parts) of everything that determines a plan: the engine's fingerprint and the
    training graphs as compiled (`planning`: key -> slot; before any pass rewrote them)."""
    parts = {
        **fingerprint,
        "graphs": {k: graph_signature(s.original if s.original is not None else s.gm, param_name)
                   for k, s in sorted(planning.items())},
    }
    return digest(parts), parts


class PlanCache:
    """One engine's plan cache under `cache_dir` (None: off); `info` is what the report shows."""

    def __init__(self, cache_dir: str | os.PathLike | None, comm, fingerprint: dict) -> None:
        self.dir = cache_dir
        self.comm = comm
        self.fingerprint = fingerprint
        self.info: dict[str, Any] = {"enabled": cache_dir is not None, "hit": False}
        self._key: tuple[str, dict] | None = None

    def key_of(self, planning: dict) -> str:
        """The plan key of the graphs `planning` (`plan_key`)."""
        return plan_key(self.fingerprint, planning)[0]

    def lookup(self, planning: dict) -> dict | None:
        """The stored plan for the graphs `planning` as compiled (fixing the key the plan is
        later saved under), the same on every rank; None where there is none."""
        self._key = plan_key(self.fingerprint, planning)
        key = self.info["key"] = self._key[0]
        plan = load(self.dir, key) if self.comm.rank == 0 else None
        return self.comm.broadcast_object(plan)

    def applied(self, plan: dict) -> None:
        """`lookup`'s plan is in force."""
        self.info.update(hit=True, saved_s=plan.get("profiling_overhead_s", 0.0),
                         path=str(path_for(self.dir, self._key[0])))
        log.info("deepcompile: plan loaded from cache (%s); profiling skipped, saving about %.1f s",
                 self.info["path"], self.info["saved_s"])

    def store(self, plan: dict) -> None:
        """Save `plan` under the key `lookup` fixed (rank 0)."""
        key, parts = self._key
        if self.comm.rank != 0:
            return
        path = save(self.dir, key, {"key_parts": parts, **plan})
        self.info["path"] = str(path)
        log.info("deepcompile: plan saved to %s", path)
