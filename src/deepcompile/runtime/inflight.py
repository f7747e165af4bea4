"""Asynchronous, fused collectives: the run-time side of the `prefetch` and `bucket_reduce` passes.

`start(shards, pids, dtype)` launches ONE all-gather for a group of parameters into a flat
buffer that the runtime holds, and returns a small fresh token tensor; `wait(token, pids)` waits
for that collective and hands the gathered parameters over (ownership of their memory passes
to the graph). The token is the ordering: the wait consumes it (DESIGN §3), and it keys the
in-flight table by its data pointer, so no host sync is needed to find the collective.

Buffer layout: each rank contributes the concatenation of its shards of the group; the gathered
buffer is `[world, sum(shard_numel)]`, and parameter i is column block i of it. A group of one is
exactly a plain gather (its full tensor is a view of the buffer, no copy).

`reduce_start(grads, pids)` launches ONE reduce-scatter for a bucket of full gradients and
`reduce_wait(token, pids)` returns each parameter's averaged shard gradient (ZeRO-1 before the
last micro-step: nothing is launched, the gradients are kept locally, the shard gradients are
zeros; [Note: ZeRO-1 local accumulation] in registry.py). The bucket is the
mirror image of a fused gather: each padded gradient is viewed as `[world, shard_numel]` and the
bucket is their concatenation along dim 1, so rank r receives the concatenation of its shards.
"""

from __future__ import annotations

import dataclasses

import torch

from . import memory
from .registry import ParamEntry, lookup, lookup_shard


@dataclasses.dataclass
class _InFlight:
    work: object
    buffer: torch.Tensor              # gather: the output; reduce: the input bucket
    entries: list[ParamEntry]
    out: torch.Tensor | None = None   # reduce: this rank's reduced slice

    @property
    def nbytes(self) -> int:
        held = [self.buffer] if self.out is None else [self.buffer, self.out]
        return sum(t.numel() * t.element_size() for t in held)


_INFLIGHT: dict[int, _InFlight] = {}


def inflight_bytes() -> int:
    """Bytes the runtime holds for collectives in flight (counted by the CPU memory model)."""
    return sum(f.nbytes for f in _INFLIGHT.values()) + sum(f.nbytes for f in _AHEAD.values())


def _token(device: torch.device, record: _InFlight) -> torch.Tensor:
    token = torch.empty(1, dtype=torch.uint8, device=device)
    _INFLIGHT[token.data_ptr()] = record
    return token


def _pop(token: torch.Tensor, pids: list[int], what: str) -> _InFlight:
    record = _INFLIGHT.pop(token.data_ptr(), None)
    if record is None:
        raise RuntimeError(f"deepcompile: {what} on a token with no collective in flight "
                           "(waited twice, or the start was removed from the graph)")
    if record.work is not None:
        record.work.wait()
    if [e.pid for e in record.entries] != list(pids):
        raise RuntimeError(f"deepcompile: {what} for {list(pids)} got the collective of "
                           f"{[e.pid for e in record.entries]}")
    return record


def _launch_gather(shards: list[torch.Tensor], pids: list[int], dtype: torch.dtype) -> _InFlight:
    entries = [lookup(pid) for pid in pids]
    flat = [s.detach().reshape(-1) for s in shards]
    src = flat[0] if len(flat) == 1 else torch.cat(flat)
    if src.dtype != dtype:
        src = src.to(dtype)
    buffer, work = entries[0].comm.all_gather_async(src)
    if memory.TRACKER is not None:
        memory.TRACKER.track(buffer)
    return _InFlight(work, buffer, entries)


def start(shards: list[torch.Tensor], pids: list[int], dtype: torch.dtype) -> torch.Tensor:
    return _token(shards[0].device, _launch_gather(shards, pids, dtype))


def wait(token: torch.Tensor, pids: list[int]) -> list[torch.Tensor]:
    return _split(_pop(token, pids, "allgather_wait"))


def _split(record: _InFlight) -> list[torch.Tensor]:
    """The gathered parameters of a completed gather (their memory passes to the caller)."""
    entries, buffer = record.entries, record.buffer
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


# -- gathers started by one graph for the next one (cross-graph prefetch) --------------------
# [Note: cross-graph prefetch] A graph's inputs and outputs never change, so a gather started
# at the tail of graph A for graph B cannot pass a token: it is parked here under its pids.
# B's `from_prev` takes it if it was started for exactly B's shard tensors (Dynamo may reuse
# one graph for several layers), and otherwise gathers synchronously. Every rank runs the same
# graphs in the same order, so every rank takes the same path. Whatever was parked and not
# taken is dropped at the optimizer step (`drop_unused`), before the shards change.
_AHEAD: dict[tuple[int, ...], _InFlight] = {}
MISSES = {"missing": 0, "other_tensors": 0, "unused": 0}


def start_for_next(pids: list[int], dtype: torch.dtype) -> None:
    stale = _AHEAD.pop(tuple(pids), None)
    if stale is not None:   # started twice before a use: the older one was wasted
        stale.work.wait()
        MISSES["unused"] += 1
    _AHEAD[tuple(pids)] = _launch_gather([lookup(p).shard for p in pids], pids, dtype)


def wait_from_prev(shards: list[torch.Tensor], pids: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    record = _AHEAD.pop(tuple(pids), None)
    if record is not None:
        record.work.wait()
        if all(e.shard is s for e, s in zip(record.entries, shards)):
            return _split(record)
        MISSES["other_tensors"] += 1
    else:
        MISSES["missing"] += 1
    record = _launch_gather(shards, pids, dtype)
    record.work.wait()
    return _split(record)


def drop_unused() -> int:
    """Drop parked gathers nobody took (called at the optimizer step); how many there were."""
    n = len(_AHEAD)
    for record in _AHEAD.values():
        record.work.wait()
    _AHEAD.clear()
    MISSES["unused"] += n
    return n


def reduce_start(grads: list[torch.Tensor], pids: list[int],
                 shards: list[torch.Tensor] | None = None) -> torch.Tensor:
    entries = [lookup(pid) for pid in pids]
    comm, dtype = entries[0].comm, entries[0].reduce_dtype
    if any(e.reduce_dtype != dtype for e in entries):
        raise RuntimeError("deepcompile: a reduce bucket mixes reduce dtypes")
    # ZeRO-1: the parameters that own the gradients ([Note: ZeRO-1 local accumulation])
    owners = entries if shards is None else [lookup_shard(s) for s in shards]
    defer = {o.defers_reduce() for o in owners}
    if defer == {True}:   # before the last micro-step: kept local, nothing communicated
        for g, o in zip(grads, owners):
            o.accumulate_local(g)
        return _token(grads[0].device, _InFlight(None, grads[0].new_empty(0), entries))
    if len(defer) > 1:
        raise RuntimeError("deepcompile: a reduce bucket mixes deferred and immediate reductions")
    blocks = []
    for g, e, o in zip(grads, entries, owners):
        flat = o.take_local(g.detach()).reshape(-1).to(dtype)
        if e.padded_numel != e.numel:
            flat = torch.nn.functional.pad(flat, (0, e.padded_numel - e.numel))
        blocks.append(flat.view(comm.world, -1))
    bucket = blocks[0].reshape(-1) if len(blocks) == 1 else torch.cat(blocks, dim=1).reshape(-1)
    out, work = comm.reduce_scatter_async(bucket)
    return _token(bucket.device, _InFlight(work, bucket, entries, out))


def reduce_wait(token: torch.Tensor, pids: list[int]) -> list[torch.Tensor]:
    record = _pop(token, pids, "reduce_wait")
    if record.work is None:   # deferred (ZeRO-1): zero shard gradients
        return [e.shard.new_zeros(e.shard.shape) for e in record.entries]
    out = record.out.div_(record.entries[0].comm.world)
    if len(record.entries) == 1:
        e = record.entries[0]
        return [out.to(e.shard.dtype)]
    grads, offset = [], 0
    for e in record.entries:
        n = e.shard.numel()
        # one new tensor per parameter (outputs of an op may not share memory)
        grads.append(out[offset:offset + n].to(e.shard.dtype, copy=True))
        offset += n
    return grads
