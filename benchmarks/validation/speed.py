"""The machine's speed while a bench launch or a plan's measuring runs.

[Note: the machine's speed]
On the 2-core VM of stop 40 (AMD EPYC, KVM, torch 2.13), a fixed single-thread workload (the
reference below, 600 rounds) took 15.0 ms and, in bursts of a few seconds every 10-30 s, 18-24
ms (+20-60%), with nothing else running in the VM and no steal time in /proc/stat: whatever
slows the vCPUs is outside the VM and invisible to it (the host's other tenants on the same
cores or memory). Measured the same way, the bench's ours-z3 on tiny-llama with GAS 4 at one
rank took 31-34 ms a step in four launches back to back, and 33-44 ms in the launches of three
validation runs that afternoon; the planner predicted 27-36 ms. A launch's timed steps (0.1-4 s)
fall in a burst or not, and so do the planner's measurements, so on such a machine an error of
20% between a prediction and a step can be the machine's and not the model's.

`SpeedProbe` runs in the harness process (idle while its children run) and times the reference
every `period_s` in the thread's CPU time: a thread that waits for a core (the ranks have them)
accumulates none, so the figure is how fast the core runs, not how busy the machine is; about
0.5 ms of CPU each time (0.5% of a core at 0.1 s). `over(t0, t1)` is the median of the samples
taken in that window (`time.time()`); a launch reports its timed steps' window
(`deepcompile/tools/bench/worker.py`), plan_validate.py the plan's. The ratio of the two says
how much slower or faster the machine ran the steps than when the plan measured it.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch

ROUNDS = 20   # ~0.5 ms on the VM above


class SpeedProbe:
    """Samples the machine's speed from a thread: `samples` holds (time.time() at the sample's
    end, thread CPU seconds of the reference)."""

    def __init__(self, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        g = torch.Generator().manual_seed(0)
        self._a = torch.randn(64, 64, generator=g)
        self._b = torch.randn(64, 64, generator=g)

    def reference(self) -> float:
        """The reference's thread CPU seconds: small matmuls and pointwise ops, dispatched one
        by one as an FX graph's nodes are."""
        t = time.thread_time()
        x = self._a
        for _ in range(ROUNDS):
            x = torch.tanh(x @ self._b * 0.01 + self._a)
        return time.thread_time() - t

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.time(), self.reference()))

    def __enter__(self) -> SpeedProbe:
        for _ in range(3):   # warm the reference's kernels and allocations
            self.reference()
        self._thread = threading.Thread(target=self._loop, name="speed-probe", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def over(self, t0: float, t1: float, pad_s: float = 0.0) -> float | None:
        """The median reference time (CPU seconds) of the samples taken in [t0 - pad_s,
        t1 + pad_s]; None where there is none."""
        xs = [s for t, s in list(self.samples) if t0 - pad_s <= t <= t1 + pad_s]
        return statistics.median(xs) if xs else None
