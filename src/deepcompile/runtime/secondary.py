"""Secondary shards: block l of G of each parameter, in the compute dtype, that gathers within
the group read: hpz's (what the forward keeps for the backward) and hsdp_zero's (refreshed after
each optimizer step, read by every gather).

[Note: secondary shards] Under the "hpz" layout ([Note: layouts] in runtime/mesh.py) a
parameter's primary shard spans every rank; the forward gathers it over every rank and, from
the gathered buffer (the padded parameter, `padded_numel` elements in the compute dtype), copies
block l of G (l: this rank's position in its group, `padded_numel / G` elements) into a buffer
the runtime holds. The backward's re-gathers all-gather these blocks within the group, in group
order: blocks 0 .. G-1 are the padded parameter again, in the layout a primary gather produces,
so what follows a gather is the same either way (compiler/lower.py).

The buffers are made once per parameter (when a graph that gathers it is lowered) and written
by every forward that gathers it: the parameter does not change between a forward and its
backward, and every backward re-gather follows a forward gather of the same parameter in the
same optimizer step (the backward re-gathers what its forward gathered; a kept parameter
gathers in neither). They are graph inputs, like the kept parameters ([Note: kept parameters
are graph inputs] in runtime/kept.py), found by the shard's data pointer (a graph Dynamo reuses
for other parameters writes and reads the buffers of the parameters it is called with).

Under "hsdp_zero" the rank's pieces of block l are held by the ranks at position l of every
group ([Note: pieces in reduction order] in runtime/comm.py): the buffers are made for every
parameter when the runtime is made and filled by an all-gather across the groups (`refresh`), at
once and whenever the shards change (after each optimizer step, after a checkpoint load:
`EngineRuntime.shards_changed`), before anything reads them; no graph writes them.
"""

from __future__ import annotations

from typing import Any

import torch

from .kept import MAX_REFRESH_BYTES
from .regather import RegatherPlan

# entries are registry.ParamEntry (not imported: the registry's back-pointer to the runtime
# would close a circle through it)
ParamEntry = Any


def secondary_numel(entry: ParamEntry) -> int:
    return entry.padded_numel // entry.layout.secondary.world


class _Table(dict):
    """shard data pointer -> secondary buffer, made on first use."""

    def __init__(self, owner: "SecondaryShards") -> None:
        super().__init__()
        self.owner = owner

    def __missing__(self, ptr: int) -> torch.Tensor:
        entry = self.owner.entry_by_ptr.get(ptr)
        if entry is None:
            raise RuntimeError("deepcompile: a graph asked for the secondary shard of a tensor "
                               "that is not a registered parameter shard")
        return self.owner.of(entry)


class SecondaryShards:
    def __init__(self, entry_by_ptr: dict[int, ParamEntry], refreshed: bool = False) -> None:
        self.entry_by_ptr = entry_by_ptr
        self.by_pid: dict[int, torch.Tensor] = {}
        self.table = _Table(self)
        # hsdp_zero: how `refresh` gathers the trainable parameters' blocks and the frozen ones'
        self._plans: tuple[RegatherPlan, ...] = ()
        if refreshed:   # every parameter's, filled now
            entries = list(entry_by_ptr.values())
            across = entries[0].layout.replicate

            def plan(members: list[ParamEntry]) -> RegatherPlan:
                return RegatherPlan(members, [self.of(e).view(across.world, -1) for e in members],
                                    MAX_REFRESH_BYTES, label="deepcompile.refresh_secondary",
                                    comm=across)
            self._plans = (plan([e for e in entries if e.shard.requires_grad]),
                           plan([e for e in entries if not e.shard.requires_grad]))
            self.refresh(frozen_too=True)

    def refresh(self, frozen_too: bool = False) -> int:
        """hsdp_zero: gather the blocks of the trainable parameters (and of the frozen ones:
        their shards changed too, a checkpoint load) from the updated pieces, across the
        groups; returns the collectives. hpz: nothing (its forwards write the blocks)."""
        return sum(p.run() for p in self._plans[:2 if frozen_too else 1])

    @property
    def plan(self) -> RegatherPlan | None:
        """How `refresh` gathers the trainable parameters (None: hpz, nothing to refresh)."""
        return self._plans[0] if self._plans else None

    def of(self, entry: ParamEntry) -> torch.Tensor:
        buf = self.by_pid.get(entry.pid)
        if buf is None:
            buf = torch.zeros(secondary_numel(entry), dtype=entry.compute_dtype,
                              device=entry.shard.device)
            self.by_pid[entry.pid] = buf
            self.table[entry.shard.data_ptr()] = buf
        return buf

    def gather(self, entries: list[ParamEntry], dtype: torch.dtype) -> torch.Tensor:
        """A backward gather of `entries` from their secondary shards, done now (the fused
        layout: [G, sum(secondary numel)])."""
        bufs = [self.of(e).to(dtype) for e in entries]
        src = bufs[0] if len(bufs) == 1 else torch.cat(bufs)
        return entries[0].layout.secondary.all_gather(src)

    def held_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.by_pid.values())
