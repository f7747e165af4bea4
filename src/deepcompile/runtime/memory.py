"""Liveness of the buffers the runtime hands out (gathered parameters).

Off by default (no cost on the hot path but one `is None` test). When on, it tracks every
gathered buffer by weak reference: how many are alive now, the peak, and the peak bytes, so
tests (and, later, the CPU profiler) can measure that gathered parameters are freed after their
last use instead of assuming it.
"""

from __future__ import annotations

import contextlib
import weakref

import torch


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
