"""The scheduling policy of the CPU ranks that the bench and the planner start.

[Note: gloo's spinning loop]
On a machine with no core to spare (as many ranks as cores, or more), a small gloo collective
sometimes takes a scheduler tick (4 ms at HZ=250) or two longer than it otherwise does
(benchmarks/validation/gloo_latency.py measures it). Per-thread schedstat over a slow call
shows why: gloo's device thread (`gloo_tcp_loop`) *runs*
for the whole stall while the worker thread that runs the collective (`pt_gloo_runloop`) waits
on the run queue for as long. The device thread takes a pair's lock with `try_lock` and, when
the worker holds it, returns to `epoll_wait`, whose level-triggered event is still pending: it
spins. Its wakeup (data arrived) preempted the worker while the worker held the lock, so the
worker can run again only when the spinner's time slice ends, at a tick.

A SCHED_BATCH thread does not preempt on wakeup (Linux: "batch and idle tasks do not preempt
non-idle tasks; their preemption is driven by the tick") and otherwise gets the CPU as a normal
thread of the same nice level does. With the rank's process SCHED_BATCH before gloo starts its
threads (they inherit it), the slow calls all but vanish
(benchmarks/results/2026-11-25-cpu2-gloo-spin/). This has nothing to do with NCCL, whose
progress does not go through such a thread; it is the CPU bench's distortion, removed for every
system alike (peers included) and for the planner's profiles of the same machine, so a
prediction and the step it predicts run under the same policy.

`DEEPCOMPILE_CPU_SCHED=normal` leaves the policy alone (to measure with the stalls).

[Note: where a step's core time goes]
With more ranks than cores a step's wall time is not any one thread's: it is the ranks' CPU work
shared out over the cores, plus what the cores sit idle (ranks that wait for each other at a
collective with no other thread to run) or lose to the hypervisor (steal: a virtual CPU not
running; counted as the thread's CPU time by `time.thread_time`). `threads()` reads every thread
of this process from /proc schedstat (ns run on a CPU, ns waited on a run queue), and
`machine()` the machine's CPU time from /proc/stat (busy, idle and steal, in clock ticks of
10 ms), `process()` the process's user and system time and its minor page faults, so that a launch can say over its timed steps how much core time its ranks used, how
long their threads waited for a core, and how much core time was idle and how much stolen
(each rank reads both around its timed steps in `bench/worker.py`; `bench/run.py`'s
`_core_time` sums the ranks per step; benchmarks/validation/plan_validate.py tables it per
cell).
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


def policy() -> str:
    """The policy this thread runs under: "batch" (`apply`'s) or "normal"."""
    if hasattr(os, "SCHED_BATCH") and os.sched_getscheduler(0) == os.SCHED_BATCH:
        return "batch"
    return "normal"


def threads() -> dict[str, tuple[str, int, int]]:
    """This process's threads: tid -> (name, ns run on a CPU, ns waited on a run queue);
    {} where /proc has no schedstat ([Note: where a step's core time goes])."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[tid] = (f.read().strip(), int(run), int(wait))
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass
    return out


def threads_between(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    """Seconds run and seconds waited on a run queue per thread name between two `threads()`
    readings (threads of one name summed; a thread started in between counts from its start)."""
    out: dict[str, list[float]] = {}
    for tid, (name, run, wait) in after.items():
        _, run0, wait0 = before.get(tid, (name, 0, 0))
        acc = out.setdefault(name, [0.0, 0.0])
        acc[0] += (run - run0) / 1e9
        acc[1] += (wait - wait0) / 1e9
    return {k: (v[0], v[1]) for k, v in out.items()}


def machine() -> dict[str, float] | None:
    """The machine's CPU time over all its cores since boot, in seconds: busy (user, nice,
    system, irq, softirq), idle (idle, iowait) and steal, from /proc/stat; None without it."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
    user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
    tick = os.sysconf("SC_CLK_TCK")
    return {"busy": (user + nice + system + irq + softirq) / tick,
            "idle": (idle + iowait) / tick, "steal": steal / tick}


def process() -> dict[str, float] | None:
    """This process's user and system CPU seconds (every thread, 10 ms ticks) and its minor
    page faults since it started, from /proc/self/stat; None without it. A step that maps
    fresh memory each time (an allocator that gave it back) pays system time and faults."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
    tick = os.sysconf("SC_CLK_TCK")
    # fields from the state (3rd of proc(5)'s list): minflt is the 10th, utime and stime 14-15
    return {"user": int(fields[11]) / tick, "sys": int(fields[12]) / tick,
            "minor_faults": int(fields[7])}


def between(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """`machine()`'s or `process()`'s figures between two readings; None without them."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in before}
