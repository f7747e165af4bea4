"""One training step on a host lane, a compute lane and communication lanes, memory tracked.

[Note: the simulator] A schedule is a list of events in program order (the order the host
issues them). The host spends `host_s` on each; then

* `compute`: runs on the compute lane for `dur` once the host has issued it and the lane is
  free (a GPU stream: the host runs ahead of the device until it waits on something);
* `start`: a collective (or a host<->device copy) on its lane (`lane`: "comm", "h2d", "d2h"): it
  begins when the host has issued it, its lane is free (collectives of one lane run in issue
  order, as on one NCCL stream), the compute issued before it has run (its input is ready)
  and the start `after` names has ended; it ends `dur` later;
* `wait`: the compute lane does not run past this point before collective `cid` ends (a
  stream wait: the host goes on); with `host_blocks` the host waits too;
* `mark`: nothing runs; it records the memory at that point.

`host_is_compute` (a CPU rank) puts the host and the compute lane on one thread: compute runs
when the host issues it, and a wait blocks the host.

Memory: every event carries the bytes live after it (`live`) and the most live while it runs
(`peak`, default `live`); the memory curve is those figures at the compute lane's time.
Exposed communication is the time the compute lane spends waiting for collectives while they
run (or queue behind others on their lane); time it waits because the host launched the
collective late counts as host-bound, like compute waiting for the host to issue it.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Event:
    kind: str                  # "compute", "start", "wait", "mark"
    name: str
    dur: float = 0.0           # lane time (compute or start)
    host_s: float = 0.0        # host time to issue it
    cid: int | None = None     # the collective a start launches / a wait waits for
    lane: str = "comm"         # start: "comm", or a copy's direction: "h2d", "d2h"
    live: int = 0              # bytes live after the event
    peak: int | None = None    # most bytes live while it runs (default: live)
    label: str = ""            # what the picture names it (block, pass)
    host_blocks: bool = False  # wait: the host waits too (a synchronizing call)
    after: int | None = None   # start: it begins no earlier than this one ends (a copy back
                               # after its own copy out: a stream waits for an event)


@dataclasses.dataclass
class Segment:
    lane: str                  # "host", "compute", "comm", "h2d", "d2h"
    name: str
    t0: float
    t1: float
    label: str = ""


@dataclasses.dataclass
class Result:
    step_s: float
    compute_s: float           # busy time of the compute lane
    comm_s: float              # busy time of the communication lane
    exposed_comm_s: float      # compute lane idle, waiting for a collective
    host_s: float              # host busy time
    host_bound_s: float        # compute lane idle, waiting for the host to issue work (or to
                               # launch a collective it waits for)
    peak_bytes: int
    segments: list[Segment]
    memory: list[tuple[float, int]]   # (time, bytes live)

    def to_dict(self, segments: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("segments", "memory")}
        if segments:
            d["segments"] = [dataclasses.asdict(s) for s in self.segments]
            d["memory"] = self.memory
        return d


def simulate(events: list[Event], *, host_is_compute: bool = False,
             keep_segments: bool = True) -> Result:
    t_host = 0.0
    t_comp = 0.0
    lanes: dict[str, float] = {}
    busy: dict[str, float] = {}
    done: dict[int, float] = {}
    late: dict[int, float] = {}
    exposed = host_bound = host_busy = 0.0
    peak = 0
    segments: list[Segment] = []
    memory: list[tuple[float, int]] = []

    def seg(lane, name, t0, t1, label):
        if keep_segments and t1 > t0:
            segments.append(Segment(lane, name, t0, t1, label))

    for ev in events:
        if ev.host_s:
            seg("host", ev.name, t_host, t_host + ev.host_s, ev.label)
            t_host += ev.host_s
            host_busy += ev.host_s
        if host_is_compute:
            t_comp = max(t_comp, t_host)
        if ev.kind == "compute":
            if t_host > t_comp:
                host_bound += t_host - t_comp
            t0 = max(t_comp, t_host)
            t_comp = t0 + ev.dur
            busy["compute"] = busy.get("compute", 0.0) + ev.dur
            seg("compute", ev.name, t0, t_comp, ev.label)
            if host_is_compute:
                t_host = t_comp
        elif ev.kind == "start":
            ready = max(t_comp, lanes.get(ev.lane, 0.0), done.get(ev.after, 0.0))
            t0 = max(t_host, ready)
            t1 = t0 + ev.dur
            lanes[ev.lane] = t1
            busy[ev.lane] = busy.get(ev.lane, 0.0) + ev.dur
            if ev.cid is not None:
                done[ev.cid] = t1
                late[ev.cid] = t0 - ready     # launched late by the host
            seg(ev.lane, ev.name, t0, t1, ev.label)
        elif ev.kind == "wait":
            end = done.get(ev.cid, 0.0)
            if end > t_comp:
                stall = end - t_comp
                by_host = min(stall, late.get(ev.cid, 0.0))
                host_bound += by_host
                if ev.lane == "comm":
                    exposed += stall - by_host
                seg("compute", ev.name, t_comp, end, "wait")
                t_comp = end
            if host_is_compute or ev.host_blocks:
                t_host = max(t_host, t_comp)
        elif ev.kind != "mark":
            raise ValueError(f"unknown event kind {ev.kind!r}")
        top = ev.live if ev.peak is None else max(ev.peak, ev.live)
        peak = max(peak, top)
        memory.append((t_comp, top))
    end = max([t_comp, t_host] + list(lanes.values()))
    return Result(step_s=end, compute_s=busy.get("compute", 0.0), comm_s=busy.get("comm", 0.0),
                  exposed_comm_s=exposed, host_s=host_busy, host_bound_s=host_bound,
                  peak_bytes=peak, segments=segments, memory=memory)
