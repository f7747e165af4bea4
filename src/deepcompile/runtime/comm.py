"""Collectives over one process group, with exact counters.

Counts and bytes are kept per group and kind; bytes are the size of the full (unsharded,
padded) tensor of each collective, so they do not depend on the world size's split. The
engine's `Comm` spans every rank ("world"); a hierarchical layout's groups (runtime/mesh.py)
are `sub` comms ("intra": the ranks of one group, "inter": one rank of each group) that count
into the same table, so `stats()` sums every group and `stats(by_group=True)` tells them apart.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat


class Comm:
    def __init__(self, group: dist.ProcessGroup | None = None, *, label: str = "world",
                 stats: dict | None = None) -> None:
        # the group the engine was given (None: the default group); `group` is where its
        # collectives run (on gloo a serial copy of it)
        self.user_group = group if group is not None else dist.group.WORLD
        self.backend = str(dist.get_backend(group))
        if self.backend == "gloo" and dist.get_world_size(group) > 1:
            # gloo runs two collectives at once on two threads, and two concurrent functional
            # all-gathers corrupt its heap: the engine's run one at a time (_compat)
            group = _compat.serial_gloo_group(group)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # the name functional collectives (and Inductor's generated code) resolve the group by
        self.group_name = _compat.group_name(group)
        # the group's name in the counters ("world", "intra", "inter"); (label, kind) ->
        # [count, bytes], shared by the sub comms of one engine
        self.label = label
        self._stats: dict[tuple[str, str], list[int]] = \
            stats if stats is not None else collections.defaultdict(lambda: [0, 0])

    def sub(self, group: dist.ProcessGroup, label: str) -> "Comm":
        """A comm over `group` (a sub-group of this one's ranks) counting into the same table."""
        return Comm(group, label=label, stats=self._stats)

    def _count(self, kind: str, nbytes: int) -> None:
        entry = self._stats[self.label, kind]
        entry[0] += 1
        entry[1] += nbytes

    def add_counts(self, counts: tuple[tuple[str, str, int, int], ...]) -> None:
        """Count the collectives a compiled graph launched in one run ((group label, kind,
        count, bytes), known when the graph was lowered): graphs count per run, not per
        collective."""
        for label, kind, n, nbytes in counts:
            entry = self._stats[label, kind]
            entry[0] += n
            entry[1] += nbytes

    def stats(self, by_group: bool = False) -> dict[str, dict[str, Any]]:
        """{kind: {"count", "bytes"}} summed over the groups: every kind ever used, and always
        the three training kinds (zero when unused). `by_group`: {group label: the same}, for
        every group counted in."""
        def table(keys) -> dict[str, dict[str, int]]:
            out = {k: {"count": 0, "bytes": 0}
                   for k in ("all_gather", "reduce_scatter", "all_reduce")}
            for key in keys:
                n, nbytes = self._stats[key]
                entry = out.setdefault(key[1], {"count": 0, "bytes": 0})
                entry["count"] += n
                entry["bytes"] += nbytes
            return dict(sorted(out.items()))
        if not by_group:
            return table(list(self._stats))
        labels = sorted({label for label, _ in self._stats} | {self.label})
        return {label: table([k for k in self._stats if k[0] == label]) for label in labels}

    def reset_stats(self) -> None:
        self._stats.clear()

    def all_gather(self, shard: torch.Tensor, count: bool = True) -> torch.Tensor:
        """Concatenate every rank's flat shard: returns a new flat tensor of world*numel."""
        if self.world == 1:
            return shard.clone()
        out = shard.new_empty(shard.numel() * self.world)
        if count:
            self._count("all_gather", out.numel() * out.element_size())
        _compat.all_gather_flat(out, shard.contiguous(), self.group)
        return out

    def all_gather_async(self, shard: torch.Tensor):
        """Launch an all-gather of flat shards; returns (output buffer, work handle)."""
        out = shard.new_empty(shard.numel() * self.world)
        self._count("all_gather", out.numel() * out.element_size())
        work = _compat.all_gather_flat(out, shard.contiguous(), self.group, async_op=True)
        return out, work

    def all_gather_coalesced_async(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                   nbytes: int):
        """Launch one all-gather of flat `inputs[i]` into `outputs[i]` (`world` times its size,
        rank-major), coalesced into one collective; returns the work handle. Counted as one
        all-gather of `nbytes` (the outputs' bytes)."""
        self._count("all_gather", nbytes)
        return _compat.all_gather_into_coalesced(outputs, inputs, self.group)

    def reduce_scatter_avg(self, full: torch.Tensor, count: bool = True) -> torch.Tensor:
        """Average of `full` (flat, world*k elements) over ranks, this rank's k-slice.

        gloo has no AVG / PREMUL_SUM reduce-scatter: SUM, then divide."""
        return self.reduce_scatter_sum(full, count).div_(self.world)

    def reduce_scatter_sum(self, full: torch.Tensor, count: bool = True) -> torch.Tensor:
        """Sum of `full` (flat, world*k elements) over ranks, this rank's k-slice (new memory;
        at world size 1 a copy, nothing communicated)."""
        if self.world == 1:
            return full.clone()
        out = full.new_empty(full.numel() // self.world)
        if count:
            self._count("reduce_scatter", full.numel() * full.element_size())
        _compat.reduce_scatter_flat(out, full.contiguous(), dist.ReduceOp.SUM, self.group)
        return out

    def reduce_scatter_async(self, full: torch.Tensor):
        """Launch a SUM reduce-scatter of flat `full`; returns (this rank's slice, work handle).
        The caller divides by `world` after the wait (gloo has no AVG)."""
        out = full.new_empty(full.numel() // self.world)
        self._count("reduce_scatter", full.numel() * full.element_size())
        work = _compat.reduce_scatter_flat(out, full.contiguous(), dist.ReduceOp.SUM, self.group,
                                           async_op=True)
        return out, work

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, count: bool = True) -> torch.Tensor:
        """`count=False` for deepcompile's own bookkeeping (calibration, agreeing profiles):
        comm_stats() reports training traffic. At world size 1 nothing runs (nor is counted):
        the result is `tensor`, and NCCL would still launch a kernel for it."""
        if self.world == 1:
            return tensor
        if count:
            self._count("all_reduce", tensor.numel() * tensor.element_size())
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src)
                                   if self.group else src, group=self.group)
        return box[0]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        self._count("broadcast", tensor.numel() * tensor.element_size())
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src) if self.group else src,
                       group=self.group)
        return tensor


class Pieces:
    """[Note: pieces in reduction order] Under "hsdp_zero" (runtime/mesh.py) each rank holds one
    of W pieces of every parameter, and which one is set by how a gradient is reduced: summed
    within the group first (the rank at position l of group j keeps block l of G: the cheap,
    node-local step first), then across the groups (it keeps part j of R of that block). So the
    rank holds piece l*R + j, not piece `rank`. Gathering the pieces runs the other way: across
    the groups (block l of G, what the group's gathers read), then within the group (the padded
    parameter, in order). This is what the registry and the runtime read of the ranks a shard
    spans (`rank`: the piece, `world`, `all_gather`), over the layout's two groups, which count
    what runs on them."""

    def __init__(self, intra: Comm, inter: Comm) -> None:
        self.intra, self.inter = intra, inter
        self.world = intra.world * inter.world
        self.rank = intra.rank * inter.world + inter.rank

    def all_gather(self, shard: torch.Tensor, count: bool = True) -> torch.Tensor:
        """Every piece in order (new memory, `world` times `shard`'s elements)."""
        return self.intra.all_gather(self.inter.all_gather(shard, count), count)
