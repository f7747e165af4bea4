"""The offloader's copies between device and host: two copy streams on CUDA, their imitation on
the CPU.

[Note: offload streams] On CUDA the copies run on two copy streams (`_CudaCopier`), one per
direction (PCIe is full duplex), ordered by events, never by luck:
  * device -> host: the d2h stream waits for the compute stream (the step wrote the state),
    copies into pinned host buffers and records an event (`ChunkBuffers.saved`); the device
    tensors are marked as used by the d2h stream (`record_stream`) before their storage is
    released, so the caching allocator does not hand the memory out before the copy read it;
  * host -> device: the storage is re-allocated on the compute stream; the h2d stream waits for
    the compute stream (the block may have been freed by compute work still queued) and for the
    host buffer's last `saved` event, copies, and records `ChunkBuffers.loaded`, which the
    compute stream waits for before it uses the tensors;
  * the host reads a host buffer (a state dict, a checkpoint) only after the d2h stream is
    synchronized (`host_sync`).
On the CPU `_SimCopier` imitates this: a copy to the device is *deferred* until someone waits
for its event, so a step that forgot to wait reads garbage and the parity tests fail. Copies to
the host queue in order, as on the d2h stream, and run when an event in the queue (or one after
it) is waited for, or at `host_sync`. Where the source is released right after (the state, a
master) the queued copy reads a snapshot taken now (CUDA's `record_stream`); where the caller
keeps the source (a gradient, `late=True`) it reads the source itself, so a source overwritten
before the copy ran shows up on the CPU too, as does a host reader that did not wait. Which
chunks, which events, which storage is released: the same code on both.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from ... import _compat


class _SimCopier:
    """CPU imitation of the CUDA copier (see [Note: offload streams])."""

    cuda = False

    def __init__(self) -> None:
        self.seconds = {"d2h": 0.0, "h2d": 0.0, "stall": 0.0}
        self.deferred = 0          # copies that ran only when waited for (both ways)
        self._d2h: list[_Pending] = []   # deferred copies to the host, in order (one stream)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], late: bool = False):
        """Queued: it runs when waited for ([Note: offload streams]). Not `late`: the source is
        released right after, so the copy reads a snapshot of it (CUDA's `record_stream`)."""
        if not late:
            pairs = [(host, dev.clone()) for host, dev in pairs]
        copy = _Pending(self, pairs, d2h=True)
        self._d2h.append(copy)
        return copy

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after=None):
        return _Pending(self, pairs, after=after)

    def run_d2h(self, through: "_Pending | None" = None) -> None:
        """Run the deferred copies to the host, in order, up to `through` (all: None)."""
        while self._d2h:
            copy = self._d2h.pop(0)
            copy.copy()
            if copy is through:
                return

    def wait(self, events: Iterable) -> None:
        for ev in events:
            if ev is not None:
                ev.run()

    def host_sync(self) -> None:
        self.run_d2h()

    def host_wait(self, events: Iterable) -> None:
        """The host waits for `events` (it is about to read or write their host buffers)."""
        self.wait(events)

    def collect(self, block: bool = False) -> None:
        pass


class _Pending:
    """A deferred copy (the CPU's stand-in for a copy on a stream and its event): to the
    device, (dev, host) pairs, after the copy to the host `after`; to the host (`d2h`),
    (host, dev) pairs, in its copier's queue."""

    __slots__ = ("copier", "pairs", "after", "d2h")

    def __init__(self, copier: _SimCopier, pairs, after=None, d2h: bool = False) -> None:
        self.copier, self.pairs, self.after, self.d2h = copier, pairs, after, d2h

    def run(self) -> None:
        """Waited for: it (and, to the host, every copy queued before it) has run."""
        if self.pairs is None:
            return
        if self.d2h:
            self.copier.run_d2h(through=self)
            return
        if self.after is not None:
            self.after.run()
        self.copy()

    def copy(self) -> None:
        if self.pairs is None:
            return
        t0 = time.perf_counter()
        for dst, src in self.pairs:
            dst.copy_(src)
        self.copier.seconds["d2h" if self.d2h else "h2d"] += time.perf_counter() - t0
        self.copier.deferred += 1
        self.pairs = None


class _CudaCopier:
    """The copies and events of the offloader on CUDA: the only code that touches streams."""

    cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._timed: list[tuple[str, object, object]] = []
        self.seconds = {"d2h": 0.0, "h2d": 0.0, "stall": 0.0}
        self.deferred = 0

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return _compat.pinned_empty(like.shape, like.dtype)

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], late: bool = False):
        """Copy device tensors into host buffers (`(host, device)` pairs); returns the event of
        completion. (`late`: the caller keeps the sources, `_SimCopier`'s business; on CUDA
        every copy is late.)"""
        end = self._copy("d2h", self.d2h, pairs)    # after the step wrote them
        for _, dev in pairs:
            dev.record_stream(self.d2h)             # not reused before the copy read it
        return end

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after=None):
        """Copy host buffers into freshly allocated device tensors (`(device, host)` pairs),
        after the event `after` (the host buffer is complete); returns the event."""
        return self._copy("h2d", self.h2d, pairs, after)   # the blocks are free by now

    def _copy(self, kind: str, stream, pairs, after=None):
        """`dst.copy_(src)` for every `(dst, src)` on `stream`, once the compute stream's work
        so far (and `after`) is done; timed as `kind`; returns the event of completion."""
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        start, end = self._events()
        with torch.cuda.stream(stream):
            start.record()
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            end.record()
        self._timed.append((kind, start, end))
        return end

    def wait(self, events: Iterable) -> None:
        """The compute stream waits for `events`; the wait is timed (exposed copy time)."""
        events = [e for e in events if e is not None]
        if not events:
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = self._events()
        start.record(stream)
        for ev in events:
            stream.wait_event(ev)
        end.record(stream)
        self._timed.append(("stall", start, end))

    def host_sync(self) -> None:
        self.d2h.synchronize()

    def host_wait(self, events: Iterable) -> None:
        """The host waits for `events` (it is about to read or write their host buffers)."""
        for ev in events:
            if ev is not None:
                ev.synchronize()

    def collect(self, block: bool = False) -> None:
        left = []
        for what, start, end in self._timed:
            if block:
                end.synchronize()
            elif not end.query():
                left.append((what, start, end))
                continue
            self.seconds[what] += start.elapsed_time(end) / 1e3
        self._timed = left

    @staticmethod
    def _events():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def make_copier(device: torch.device):
    """The copier for `device`: its copy streams on CUDA, their imitation elsewhere."""
    return _CudaCopier(device) if device.type == "cuda" else _SimCopier()
