"""ZeRO-1/2: the replicated module parameters, refreshed from the shards after the optimizer step.

Each rank steps only its shards (the optimizer's parameters), so after `optimizer.step()` the
replicas — the module's own parameters, which the compiled graphs read as plain inputs — are
rebuilt from every rank's updated shards with fused all-gathers of at most `BUCKET_BYTES`
([Note: fused re-gather] in runtime/regather.py), copied straight into the parameters' padded
storage (`registry.ParamRegistry._add`). The refresh ends inside `engine.step()`: user code
that reads the module's parameters after the step (logging, evaluation) sees the updated
values. Overlapping it further, with the next forward, would mean waiting inside the graphs
for each parameter; not done.
"""

from __future__ import annotations

from .regather import RegatherPlan
from .registry import ParamEntry, padded_view

BUCKET_BYTES = 256 << 20


class Replicas:
    def __init__(self, entries: list[ParamEntry], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.entries = entries
        self.bucket_bytes = bucket_bytes
        self._plans: dict[bool, RegatherPlan] = {}

    def _plan(self, frozen_too: bool) -> RegatherPlan:
        plan = self._plans.get(frozen_too)
        if plan is None:
            entries = [e for e in self.entries if frozen_too or e.shard.requires_grad]
            plan = self._plans[frozen_too] = RegatherPlan(
                entries, [padded_view(e.param.data, e.comm.world) for e in entries],
                self.bucket_bytes, label="deepcompile.refresh_replicas")
        return plan

    @property
    def plan(self) -> RegatherPlan:
        """How the refresh after every optimizer step gathers the trainable replicas."""
        return self._plan(False)

    def refresh(self, frozen_too: bool = False) -> int:
        """Copy every rank's shards into the replicated module parameters (the frozen ones too
        when they changed: a checkpoint load); returns the number of all-gathers."""
        return self._plan(frozen_too).run()
