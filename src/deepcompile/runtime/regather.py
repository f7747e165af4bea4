"""Full parameters gathered again from the updated shards into tensors the runtime owns, after
the optimizer step: ZeRO-1/2's replicated module parameters (runtime/replicas.py) and the
parameters `selective_unshard` keeps gathered (runtime/kept.py).

[Note: fused re-gather] Consecutive parameters of one compute dtype are gathered together, at
most `max_bytes` of gathered buffer per collective (a larger parameter goes alone); the grouping
is deterministic, the same on every rank. Each rank contributes the concatenation of its shards
of a group, cast to the compute dtype: the gathered buffer is `[world, sum(shard_numel)]` (the
layout of a fused gather, compiler/lower.py), and parameter i is column block i. Every
destination is the head of a padded buffer of `padded_numel` elements, viewed as
`[world, shard_numel]`, so the copy out of a group is one `split_with_sizes_copy` into all of
them: a handful of calls per group, whatever the number of parameters (host cost per step does
not grow with the model's depth). At most two collectives are in flight: the next group's
transfer overlaps the copy out of the current one, and the temporary buffers stay within
2 x max_bytes. At world size 1 there is nothing to gather: every shard is cast (or copied) into
its destination in one `_foreach_copy_`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

from .registry import ParamEntry


def groups(entries: list[ParamEntry], max_bytes: int) -> list[list[ParamEntry]]:
    """How `RegatherPlan` fuses `entries`: consecutive entries of one compute dtype, at most
    `max_bytes` of gathered (padded, compute dtype) buffer per group."""
    out: list[list[ParamEntry]] = []
    size = 0
    for e in entries:
        nbytes = e.padded_numel * e.compute_dtype.itemsize
        if out and out[-1][0].compute_dtype == e.compute_dtype and size + nbytes <= max_bytes:
            out[-1].append(e)
            size += nbytes
        else:
            out.append([e])
            size = nbytes
    return out


class _Group:
    __slots__ = ("shards", "dtype", "sizes", "outs", "comm")

    def __init__(self, entries: list[ParamEntry], dests: list[torch.Tensor], comm,
                 sources: list[torch.Tensor]) -> None:
        self.shards = sources   # the live leaves (or buffers): their values change in place
        self.dtype = entries[0].compute_dtype
        self.sizes = [s.numel() for s in sources]
        self.outs = dests
        self.comm = comm

    def launch(self):
        src = self.shards[0].detach() if len(self.shards) == 1 else torch.cat(self.shards)
        if src.dtype != self.dtype:
            src = src.to(self.dtype)
        return self.comm.all_gather_async(src)

    def copy_out(self, buffer: torch.Tensor) -> None:
        rows = buffer.view(self.comm.world, -1)
        if len(self.outs) == 1:
            self.outs[0].copy_(rows)
        else:
            torch.split_with_sizes_copy(rows, self.sizes, dim=1, out=self.outs)


class RegatherPlan:
    """Gather `entries` from their shards into `dests`, each the [world, shard_numel] view of a
    padded full buffer in the compute dtype (`registry.padded_view`); prepared once, run after
    every optimizer step. `comm`: the ranks to gather over, where not the ones the shards span,
    and `sources`: what each rank contributes, where not the shards (hsdp_zero: its secondary
    shards gathered across the groups from the shards, `dests` [R, shard_numel]; a kept
    parameter gathered within the group from the secondary shards, `dests` [G, R shard_numel])."""

    def __init__(self, entries: list[ParamEntry], dests: list[torch.Tensor], max_bytes: int,
                 label: str | None = None, comm=None,
                 sources: list[torch.Tensor] | None = None) -> None:
        comm = comm if comm is not None else (entries[0].comm if entries else None)
        sources = sources if sources is not None else [e.shard for e in entries]
        src = {e.pid: s for e, s in zip(entries, sources)}
        for e, d in zip(entries, dests):
            want = (comm.world, src[e.pid].numel())
            if tuple(d.shape) != want or d.dtype != e.compute_dtype or not d.is_contiguous():
                raise RuntimeError(f"deepcompile: cannot re-gather {e.name!r} into a {d.dtype} "
                                   f"tensor of shape {tuple(d.shape)} (expected {want})")
        dest = {e.pid: d for e, d in zip(entries, dests)}
        self.groups = [_Group(g, [dest[e.pid] for e in g], comm, [src[e.pid] for e in g])
                       for g in groups(entries, max_bytes)]
        self.label = label
        # world size 1: (destinations, shards), made once (the shards are the live leaves)
        self._local = None
        if entries and comm.world == 1:
            self._local = ([d[0] for d in dests], list(sources))

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def communicates(self) -> bool:
        """Whether a run gathers over more than one rank."""
        return self._local is None

    def nbytes(self) -> int:
        """Bytes of the gathered buffers of one run (the full, padded tensors)."""
        return sum(sum(g.sizes) * g.comm.world * g.dtype.itemsize for g in self.groups)

    @torch.no_grad()
    def run(self) -> int:
        """Re-gather every group; returns the number of collectives."""
        plan = self.groups
        scope = record_function(self.label) if self.label else contextlib.nullcontext()
        if self._local is not None:   # world size 1: no collective, each shard cast straight
            with scope:               # into its destination, one fused pass
                torch._foreach_copy_(*self._local)
            return 0
        with scope:
            pending = plan[0].launch() if plan else None
            for i, group in enumerate(plan):
                buffer, work = pending
                pending = plan[i + 1].launch() if i + 1 < len(plan) else None
                work.wait()
                group.copy_out(buffer)
        return len(plan)
