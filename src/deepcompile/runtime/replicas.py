"""ZeRO-1/2: the replicated module parameters, refreshed from the shards after the optimizer step.

Each rank steps only its shards (the optimizer's parameters), so after `optimizer.step()` the
replicas — the module's own parameters, which the compiled graphs read as plain inputs — are
rebuilt from every rank's updated shards: one all-gather per bucket of parameters into a flat
buffer, then a copy of each parameter's part into its storage.

[Note: replica refresh] Layout: as a fused gather (runtime/inflight.py), each rank contributes
the concatenation of its shards of a bucket, cast to the compute dtype; the gathered buffer is
`[world, sum(shard_numel)]` and parameter i is column block i, whose first `numel` elements in
row-major order are the parameter. The copy goes straight from the strided block into the
parameter's storage (no intermediate tensor). Buckets hold one compute dtype each and are cut at
`BUCKET_BYTES` of gathered buffer (a model-size temporary buffer is what the cap avoids); all
buckets are launched before the first is waited for, so copying one bucket overlaps the
transfer of the next. The refresh ends inside `engine.step()`: user code that reads the module's
parameters after the step (logging, evaluation) sees the updated values. Overlapping it further,
with the next forward, would mean waiting inside the graphs for each parameter; not done.
"""

from __future__ import annotations

import torch

from .registry import ParamEntry

BUCKET_BYTES = 256 << 20


def buckets(entries: list[ParamEntry], bucket_bytes: int = BUCKET_BYTES) -> list[list[ParamEntry]]:
    """Consecutive entries of one compute dtype, each bucket's gathered buffer <= bucket_bytes
    (a single larger parameter is a bucket of its own). Deterministic: the same on every rank."""
    out: list[list[ParamEntry]] = []
    size = 0
    for e in entries:
        nbytes = e.padded_numel * e.compute_dtype.itemsize
        if out and out[-1][0].compute_dtype == e.compute_dtype and size + nbytes <= bucket_bytes:
            out[-1].append(e)
            size += nbytes
        else:
            out.append([e])
            size = nbytes
    return out


@torch.no_grad()
def refresh(entries: list[ParamEntry], bucket_bytes: int = BUCKET_BYTES) -> int:
    """Copy every rank's shards of `entries` into the replicated module parameters; returns the
    number of all-gathers launched."""
    launched = []
    for bucket in buckets(entries, bucket_bytes):
        dtype = bucket[0].compute_dtype
        flat = [e.shard.detach().to(dtype) for e in bucket]
        src = flat[0] if len(flat) == 1 else torch.cat(flat)
        buffer, work = bucket[0].comm.all_gather_async(src)
        launched.append((bucket, buffer, work))
    for bucket, buffer, work in launched:
        work.wait()
        rows = buffer.view(bucket[0].comm.world, -1)
        offset = 0
        for e in bucket:
            n = e.shard.numel()
            _copy_block(e, rows[:, offset:offset + n])
            offset += n
    return len(launched)


def _copy_block(entry: ParamEntry, block: torch.Tensor) -> None:
    """`block` is [world, shard_numel]: the padded flat parameter, row-major."""
    flat = entry.param.data.view(-1)
    n = block.shape[1]
    full_rows, rest = divmod(entry.numel, n)
    if full_rows:
        flat[: full_rows * n].view(full_rows, n).copy_(block[:full_rows])
    if rest:
        flat[full_rows * n:].copy_(block[full_rows, :rest])
