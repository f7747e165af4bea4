"""Parameters kept gathered across graphs and micro-steps: the run-time side of `selective_unshard`.

`KeptParams` holds, for each kept parameter, the full parameter in compute dtype at the head of
a padded buffer, re-gathered after every optimizer step (`refresh`, in fused collectives of at
most `MAX_REFRESH_BYTES`: [Note: fused re-gather]) from the updated shards, or under hsdp_zero
from the updated secondary shards within the group. The lowered graphs
take the kept tensors as inputs where they would have gathered ([Note: runtime inputs] in
compiler/lower.py): no collective, no copy. A graph input is never written by Inductor, so
handing the runtime's own tensor to the graph is safe (an op output would not be: Inductor
reuses the memory of a dead buffer in place, [Note: kept parameters are graph inputs]).

[Note: kept parameters are graph inputs] Were the kept tensor returned from a custom op,
Inductor would treat it as a buffer of its own and, at its last use, might hand its memory to
the next buffer of the same size (`buf2 = buf1; del buf1  # reuse` then
`cpp_fused_tanh_0(buf2)` computing in place), overwriting the kept parameter. As a graph
input it is never reused (tests/distributed/test_selective_unshard.py has that graph).

The table is keyed by the shard's data pointer, so a graph that Dynamo reuses for other
parameters of the same layout ([Note: graph reuse] in compiler/backend.py) takes the kept
tensor of the parameter it was actually called with; a parameter that is not kept is gathered
then (synchronously, counted in `misses`).
"""

from __future__ import annotations

import torch

from .regather import RegatherPlan, groups
from .registry import ParamEntry, padded_view

MAX_REFRESH_BYTES = 64 << 20   # one refresh collective at most this many bytes (temporary buffer)


def kept_bytes(entry: ParamEntry) -> int:
    """Bytes the runtime holds to keep `entry` gathered (the padded full parameter)."""
    return entry.padded_numel * entry.compute_dtype.itemsize


def refresh_groups(entries: list[ParamEntry], max_bytes: int = MAX_REFRESH_BYTES) -> list[list[ParamEntry]]:
    """How the refresh fuses the kept parameters ([Note: fused re-gather] in regather.py)."""
    return groups(entries, max_bytes)


class _Table(dict):
    """shard data pointer -> kept full parameter; a miss gathers (a reused graph called with a
    parameter that is not kept)."""

    def __init__(self, owner: "KeptParams") -> None:
        super().__init__()
        self.owner = owner

    def __missing__(self, ptr: int) -> torch.Tensor:
        return self.owner.gather_missing(ptr)


class KeptParams:
    """The kept parameters of one engine."""

    def __init__(self, entries_by_ptr: dict[int, ParamEntry]) -> None:
        self._by_ptr = entries_by_ptr             # every shard's data pointer -> entry
        self.entries: list[ParamEntry] = []
        self.full: dict[int, torch.Tensor] = {}   # pid -> kept full parameter
        self.table = _Table(self)
        self._plan: RegatherPlan | None = None
        self.misses = 0
        self._suspended = False
        # hsdp_zero's secondary shards (runtime/secondary.py), which the refresh gathers from
        self.secondary = None

    def configure(self, entries: list[ParamEntry]) -> None:
        """Keep `entries` gathered from now on (filled here, from the current shards)."""
        self.entries = list(entries)
        self.full = {}
        self.table.clear()   # the same table object: lowered graphs hold its lookup
        if not self.entries:
            self._plan = None
            return
        # hsdp_zero: from the secondary shards (refreshed first: EngineRuntime.shards_changed),
        # within the group; else from the shards over the ranks they span
        sec = self.secondary
        comm = self.entries[0].layout.secondary if sec is not None else self.entries[0].comm
        dests = []
        for e in self.entries:
            buf = torch.empty(e.padded_numel, dtype=e.compute_dtype, device=e.shard.device)
            self.full[e.pid] = buf[: e.numel].view(e.shape)
            self.table[e.shard.data_ptr()] = self.full[e.pid]
            dests.append(padded_view(self.full[e.pid], comm.world))
        self._plan = RegatherPlan(self.entries, dests, MAX_REFRESH_BYTES,
                                  label="deepcompile.refresh_kept", comm=comm,
                                  sources=None if sec is None else
                                  [sec.of(e) for e in self.entries])
        self.refresh()

    @property
    def plan(self) -> RegatherPlan | None:
        """How the refresh gathers the kept parameters (None: nothing kept)."""
        return self._plan

    def held_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.full.values())

    def refresh(self) -> int:
        """Re-gather every kept parameter from its (updated) shard; returns the collectives."""
        if self._suspended:
            return 0
        return self._plan.run() if self._plan is not None else 0

    def suspend(self) -> None:
        """No refresh until `resume` (steps that run graphs from before the kept parameters
        existed: a pass measured against the graphs before it, compiler/trial.py)."""
        self._suspended = True

    def resume(self) -> None:
        """Refresh again, starting now (the shards changed while suspended)."""
        if self._suspended:
            self._suspended = False
            self.refresh()

    def gather_missing(self, ptr: int) -> torch.Tensor:
        entry = self._by_ptr.get(ptr)
        if entry is None:
            raise RuntimeError("deepcompile: a graph asked for the kept copy of a tensor that is "
                               "not a registered parameter shard")
        self.misses += 1
        return entry.gather()

    @torch.no_grad()
    def stale(self) -> list[str]:
        """Names of kept parameters whose copy differs from a fresh gather of their shard
        (uncounted collectives, one per kept parameter, in the same order on every rank)."""
        out = []
        for e in self.entries:
            full = e.comm.all_gather(e.shard.detach().to(e.compute_dtype), count=False)
            if not torch.equal(full[: e.numel].view(e.shape), self.full[e.pid]):
                out.append(e.name)
        return out
