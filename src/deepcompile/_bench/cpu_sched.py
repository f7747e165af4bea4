"""The scheduling policy of the CPU ranks that the bench and the planner start.

[Note: gloo's spinning loop]
On a machine with no core to spare (the 2-core VM of stops 31-37: 2 ranks or more), a small
gloo collective took a scheduler tick (4 ms at HZ=250) or two longer in 4-18% of its calls,
where it otherwise takes ~0.2 ms (benchmarks/gloo_latency.py). Per-thread schedstat over each
call (stop 37) shows what happens in a slow one: gloo's device thread (`gloo_tcp_loop`) *runs*
for the whole stall while the worker thread that runs the collective (`pt_gloo_runloop`) waits
on the run queue for as long. The device thread takes a pair's lock with `try_lock` and, when
the worker holds it, returns to `epoll_wait`, whose level-triggered event is still pending: it
spins. Its wakeup (data arrived) preempted the worker while the worker held the lock, so the
worker can run again only when the spinner's time slice ends, at a tick.

A SCHED_BATCH thread does not preempt on wakeup (Linux: "batch and idle tasks do not preempt
non-idle tasks; their preemption is driven by the tick") and otherwise gets the CPU as a normal
thread of the same nice level does. With the rank's process SCHED_BATCH before gloo starts its
threads (they inherit it), the calls over 2 ms went from 10-18% to 0-1% at 2 ranks and from
72-76% to 1% at 4 (stop 37, benchmarks/results/2026-11-25-cpu2-gloo-spin/). This has nothing to do with NCCL, whose
progress does not go through such a thread; it is the CPU bench's distortion, removed for every
system alike (peers included) and for the planner's profiles of the same machine, so a
prediction and the step it predicts run under the same policy.

`DEEPCOMPILE_CPU_SCHED=normal` leaves the policy alone (to measure with the stalls).
"""

from __future__ import annotations

import os

_POLICIES = ("batch", "normal")


def apply() -> str:
    """Put this process (its calling thread and every thread it starts from now on) under
    SCHED_BATCH, unless DEEPCOMPILE_CPU_SCHED=normal. Returns the policy in effect: "batch",
    or "normal" where asked or where the platform has no SCHED_BATCH. Call it in a CPU rank
    before `init_process_group`, so that gloo's threads inherit it."""
    want = os.environ.get("DEEPCOMPILE_CPU_SCHED", "batch")
    if want not in _POLICIES:
        raise ValueError(f"deepcompile: DEEPCOMPILE_CPU_SCHED={want!r}; expected one of "
                         f"{', '.join(_POLICIES)}")
    if want == "normal" or not hasattr(os, "SCHED_BATCH"):
        return "normal"
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    return "batch"
