"""Gradients accumulated locally over the micro-steps of an accumulation window, reduced once.

[Note: local gradient accumulation] One mechanism serves ZeRO-1 (every trainable parameter,
when gradient accumulation is on: its gradient is reduce-scattered once per optimizer step) and
`selective_unshard` (the kept parameters it chooses to accumulate). Each accumulated parameter
has a persistent full-size accumulator (flat, `numel` elements, master dtype), zero between
windows. The lowered backward graphs take the accumulators as inputs ([Note: runtime inputs] in
compiler/lower.py) and come in two variants: on the earlier micro-steps the gradient is added
into the accumulator in place and the shard gradient is zeros (nothing is communicated); on the
last micro-step the sum `accumulator + gradient` is reduce-scattered (alone or in its bucket)
and the accumulator is zeroed in the same graph.

A reused graph (Dynamo's [Note: graph reuse]) names its parameter only through the shard it is
called with: ZeRO-1's reductions carry the shard, and the accumulator is found by the shard's
data pointer (`table`), so the gradient goes to the parameter that produced it.

A parameter whose gradient was accumulated but whose graph did not run on the last micro-step
(a branch not taken) still holds that window's gradient: the graphs record which accumulators
they touched (`dirty`) and which they reduced (`consumed`); `flush` reduces what is left into
the shard gradients before the optimizer step, in registry order (the same on every rank: every
rank ran the same graphs).
"""

from __future__ import annotations

import torch

from .registry import ParamEntry
from .state import StepState


def accumulator_bytes(entry: ParamEntry) -> int:
    """Bytes of `entry`'s gradient accumulator (full size, master dtype)."""
    return entry.numel * entry.shard.dtype.itemsize


class _Table(dict):
    """shard data pointer -> accumulator; made on first use (a reused graph called with a
    parameter whose own graph never ran yet)."""

    def __init__(self, owner: "GradAccumulators") -> None:
        super().__init__()
        self.owner = owner

    def __missing__(self, ptr: int) -> torch.Tensor:
        entry = self.owner.entry_by_ptr.get(ptr)
        if entry is None:
            raise RuntimeError("deepcompile: a gradient to accumulate belongs to a tensor that is "
                               "not a registered parameter shard")
        self.owner.enable([entry])
        return self[ptr]


class GradAccumulators:
    def __init__(self, entries: list[ParamEntry], step: StepState,
                 entry_by_ptr: dict[int, ParamEntry]) -> None:
        self._entries = entries
        self._step = step
        self.entry_by_ptr = entry_by_ptr
        self.table = _Table(self)                    # shard data pointer -> accumulator
        self.by_pid: dict[int, torch.Tensor] = {}
        self.dirty: set[torch.Tensor] = set()        # added to in this window
        self.consumed: set[torch.Tensor] = set()     # reduced on the last micro-step
        self.flushed = 0                             # accumulators reduced by `flush`, in all

    def enable(self, entries: list[ParamEntry]) -> None:
        """Give `entries` an accumulator (kept from then on)."""
        for e in entries:
            if e.pid not in self.by_pid:
                acc = torch.zeros(e.numel, dtype=e.shard.dtype, device=e.shard.device)
                self.by_pid[e.pid] = acc
                self.table[e.shard.data_ptr()] = acc

    def disable(self, pids) -> None:
        """Drop the accumulators of `pids` (zero: at an optimizer-step boundary, after `flush`);
        a reverted pass's, for instance. A graph lowered later enables what it needs again."""
        for pid in pids:
            acc = self.by_pid.pop(pid)
            for ptr, t in list(self.table.items()):
                if t is acc:
                    del self.table[ptr]

    def of(self, entry: ParamEntry) -> torch.Tensor:
        return self.by_pid[entry.pid]

    def held_bytes(self) -> int:
        return sum(a.untyped_storage().nbytes() for a in self.by_pid.values())

    def mark(self, last: bool, accs) -> None:
        """A graph run added to (`last` False) or reduced (`last` True) these accumulators."""
        (self.consumed if last else self.dirty).update(accs)

    def accumulates(self, entry: ParamEntry) -> bool:
        return entry.pid in self.by_pid

    @property
    def last_micro_step(self) -> bool:
        return self._step.last_micro_step

    @torch.no_grad()
    def flush(self) -> int:
        """Before the optimizer step: reduce what the last micro-step did not into the shard
        gradients; returns how many accumulators that was."""
        left = self.dirty - self.consumed
        self.dirty, self.consumed = set(), set()
        if not left:
            return 0
        n = 0
        for e in self._entries:
            acc = self.by_pid.get(e.pid)
            if acc is None or acc not in left:
                continue
            shard_grad = e.reduce_grad(acc)
            acc.zero_()
            if e.shard.grad is None:
                e.shard.grad = shard_grad
            else:
                e.shard.grad.add_(shard_grad)
            n += 1
        self.flushed += n
        return n
