"""Asynchronous (and fused) parameter gathers: the run-time side of the prefetch pass.

`start(shards, pids, dtype)` launches ONE all-gather for a group of parameters into a flat
buffer that the runtime holds, and returns a small fresh token tensor; `wait(token, pids)` waits
for that collective and hands the gathered parameters over (ownership of their memory passes
to the graph). The token is the ordering: the wait consumes it (DESIGN §3), and it keys the
in-flight table by its data pointer, so no host sync is needed to find the collective.

Buffer layout: each rank contributes the concatenation of its shards of the group; the gathered
buffer is `[world, sum(shard_numel)]`, and parameter i is column block i of it. A group of one is
exactly a plain gather (its full tensor is a view of the buffer, no copy).
"""

from __future__ import annotations

import dataclasses

import torch

from . import memory
from .registry import ParamEntry, lookup


@dataclasses.dataclass
class _InFlight:
    work: object
    buffer: torch.Tensor
    entries: list[ParamEntry]


_INFLIGHT: dict[int, _InFlight] = {}


def inflight_bytes() -> int:
    return sum(f.buffer.numel() * f.buffer.element_size() for f in _INFLIGHT.values())


def start(shards: list[torch.Tensor], pids: list[int], dtype: torch.dtype) -> torch.Tensor:
    entries = [lookup(pid) for pid in pids]
    comm = entries[0].comm
    flat = [s.detach().reshape(-1) for s in shards]
    src = flat[0] if len(flat) == 1 else torch.cat(flat)
    if src.dtype != dtype:
        src = src.to(dtype)
    buffer, work = comm.all_gather_async(src)
    if memory.TRACKER is not None:
        memory.TRACKER.track(buffer)
    token = torch.empty(1, dtype=torch.uint8, device=src.device)
    _INFLIGHT[token.data_ptr()] = _InFlight(work, buffer, entries)
    return token


def wait(token: torch.Tensor, pids: list[int]) -> list[torch.Tensor]:
    inflight = _INFLIGHT.pop(token.data_ptr(), None)
    if inflight is None:
        raise RuntimeError("deepcompile: allgather_wait on a token with no collective in flight "
                           "(waited twice, or the start was removed from the graph)")
    inflight.work.wait()
    entries, buffer = inflight.entries, inflight.buffer
    if [e.pid for e in entries] != list(pids):
        raise RuntimeError(f"deepcompile: allgather_wait for {pids} got the collective of "
                           f"{[e.pid for e in entries]}")
    if len(entries) == 1:
        e = entries[0]
        return [buffer[: e.numel].view(e.shape)]
    world = entries[0].comm.world
    rows = buffer.view(world, -1)
    out, offset = [], 0
    for e in entries:
        n = e.shard.numel()
        # a copy out of the strided column block (a view when world == 1): new memory per param
        out.append(rows[:, offset:offset + n].reshape(-1)[: e.numel].view(e.shape))
        offset += n
    return out
