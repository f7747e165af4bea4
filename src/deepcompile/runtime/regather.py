"""Full parameters gathered again from the updated shards into tensors the runtime owns, after
the optimizer step: ZeRO-1/2's replicated module parameters (runtime/replicas.py) and the
parameters `selective_unshard` keeps gathered (runtime/unshard.py).

[Note: fused re-gather] Consecutive parameters of one compute dtype are gathered together, at
most `max_bytes` of gathered buffer per collective (a larger parameter goes alone); the grouping
is deterministic, the same on every rank. Each rank contributes the concatenation of its shards
of a group, cast to the compute dtype: the gathered buffer is `[world, sum(shard_numel)]` (the
layout of a fused gather, runtime/inflight.py), and parameter i is column block i, whose first
`numel` elements in row-major order are the parameter. Each block is copied straight into its
destination (no intermediate tensor). At most two collectives are in flight: the next group's
transfer overlaps the copies out of the current one, and the temporary buffers stay within
2 x max_bytes.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

from .registry import ParamEntry


def groups(entries: list[ParamEntry], max_bytes: int) -> list[list[ParamEntry]]:
    """How `regather` fuses `entries`: consecutive entries of one compute dtype, at most
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


@torch.no_grad()
def regather(entries: list[ParamEntry], dests: list[torch.Tensor], max_bytes: int,
             label: str | None = None) -> int:
    """Copy every rank's shards of `entries` into `dests` (one contiguous full tensor each, in
    the compute dtype); returns the number of collectives."""
    for e, d in zip(entries, dests):
        if not d.is_contiguous() or d.numel() != e.numel or d.dtype != e.compute_dtype:
            raise RuntimeError(f"deepcompile: cannot re-gather {e.name!r} into a "
                               f"{'non-contiguous ' if not d.is_contiguous() else ''}"
                               f"{d.dtype} tensor of {d.numel()} elements")
    dest = {e.pid: d for e, d in zip(entries, dests)}
    plan = groups(entries, max_bytes)

    def launch(group: list[ParamEntry]):
        src = torch.cat([e.shard.detach().reshape(-1) for e in group]).to(group[0].compute_dtype)
        return group[0].comm.all_gather_async(src)

    scope = record_function(label) if label else contextlib.nullcontext()
    with scope:
        pending = launch(plan[0]) if plan else None
        for i, group in enumerate(plan):
            buffer, work = pending
            pending = launch(plan[i + 1]) if i + 1 < len(plan) else None
            work.wait()
            rows = buffer.view(group[0].comm.world, -1)
            offset = 0
            for e in group:
                n = e.shard.numel()
                _copy_block(dest[e.pid].view(-1), e.numel, rows[:, offset:offset + n])
                offset += n
    return len(plan)


def _copy_block(flat: torch.Tensor, numel: int, block: torch.Tensor) -> None:
    """`block` is [world, shard_numel]: the padded flat parameter, row-major; its first `numel`
    elements go to `flat`."""
    n = block.shape[1]
    full_rows, rest = divmod(numel, n)
    if full_rows:
        flat[: full_rows * n].view(full_rows, n).copy_(block[:full_rows])
    if rest:
        flat[full_rows * n:].copy_(block[full_rows, :rest])
