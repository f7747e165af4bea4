"""ZeRO-1/2: the replicated module parameters, refreshed from the shards after the optimizer step.

Each rank steps only its shards (the optimizer's parameters), so after `optimizer.step()` the
replicas — the module's own parameters, which the compiled graphs read as plain inputs — are
rebuilt from every rank's updated shards with fused all-gathers of at most `BUCKET_BYTES`
([Note: fused re-gather] in runtime/regather.py), copied straight into the parameters'
storage. The refresh ends inside `engine.step()`: user code that reads the module's parameters
after the step (logging, evaluation) sees the updated values. Overlapping it further, with the
next forward, would mean waiting inside the graphs for each parameter; not done.
"""

from __future__ import annotations

from .regather import regather
from .registry import ParamEntry

BUCKET_BYTES = 256 << 20


def refresh(entries: list[ParamEntry], bucket_bytes: int = BUCKET_BYTES) -> int:
    """Copy every rank's shards of `entries` into the replicated module parameters; returns the
    number of all-gathers launched."""
    return regather(entries, [e.param.data for e in entries], bucket_bytes,
                    label="deepcompile.refresh_replicas")
