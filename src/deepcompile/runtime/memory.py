"""Liveness of gathered parameters, for tests: are gathered buffers freed after their last use?

Off by default (one `is None` test per graph call). `track_live_buffers()` tracks, for the
duration of a block, every buffer a gather produced — the functional all-gathers the lowered
graphs run (seen by a dispatch mode the pipeline enters inside each graph call, `watch()`: one
around a compiled call would make Dynamo run it eagerly; unwaited gathers handed to the next
graph are not counted) and the reference gathers of the eager fallback (`ParamEntry.gather`) — by weak
reference: how many are alive now, the peak, and the peak bytes. A view of a buffer keeps the
buffer alive (its tensor is preserved while any view refers to it), so a buffer counts as alive
exactly while its memory is.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBuffers:
    def __init__(self) -> None:
        self._refs: dict[int, tuple[weakref.ref, int]] = {}
        self.peak_count = 0
        self.peak_bytes = 0
        self.total = 0

    def track(self, buffer: torch.Tensor) -> None:
        key = id(buffer)
        nbytes = buffer.numel() * buffer.element_size()
        self._refs[key] = (weakref.ref(buffer, lambda _r, k=key: self._refs.pop(k, None)), nbytes)
        self.total += 1
        self.peak_count = max(self.peak_count, len(self._refs))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def live_count(self) -> int:
        return len(self._refs)

    def live_bytes(self) -> int:
        return sum(n for _, n in self._refs.values())


class _GatherWatch(TorchDispatchMode):
    """Tracks what each waited all-gather hands to the graph. The graph gets a copy of the
    gathered buffer, referenced by nobody else: the transport (gloo's worker thread) may hold the
    collective's own output a moment after the wait returned, and the test measures the graph's
    liveness, not the transport's."""

    def __init__(self, tracker: LiveBuffers) -> None:
        super().__init__()
        self.tracker = tracker
        self.gather = torch.ops._c10d_functional.all_gather_into_tensor.default
        self.wait = torch.ops._c10d_functional.wait_tensor.default
        self.started: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is self.gather:
            self.started.add(id(out))
        elif func is self.wait and id(out) in self.started:
            self.started.discard(id(out))
            out = out.clone()
            self.tracker.track(out)
        return out


TRACKER: LiveBuffers | None = None


@contextlib.contextmanager
def track_live_buffers():
    """Track gathered buffers for the duration of the block; yields the tracker."""
    global TRACKER
    previous, TRACKER = TRACKER, LiveBuffers()
    try:
        yield TRACKER
    finally:
        TRACKER = previous


def watch() -> _GatherWatch:
    """The dispatch mode that tracks a graph run's gathers (only while TRACKER is set)."""
    return _GatherWatch(TRACKER)
