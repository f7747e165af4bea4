"""Chrome-trace export (opens in Perfetto or chrome://tracing).

One process per rank. With a traced step (`engine.trace_next_step()`): its real timestamps
(report/steptrace.py), one thread per lane — graph calls, collective launches labelled with
their modules, exposed waits, the transport's work — and a memory counter track: each graph
call's profiled live-memory curve laid over the call's real span (node i at its profiled
offset, scaled to the call's duration). Without one: the latest profiled step laid out from
this rank's own profile (node by node: a compute and a communication lane, every collective
labelled with its parameters and module), with its measured memory as the counter track.
Compute nodes are summarized per module (one event per run of consecutive nodes of the same
module), so a step is a few events per layer, not every aten op.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .steptrace import module_path

LANES = ("graphs", "launch", "exposed", "transport", "device")


def _meta(rank: int, names: list[str]) -> list[dict]:
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}]
    out += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": i, "args": {"name": n}}
            for i, n in enumerate(names)]
    return out


def _counter(rank: int, ts_us: float, live_bytes: int) -> dict:
    return {"ph": "C", "pid": rank, "name": "memory", "ts": ts_us,
            "args": {"live MiB": round(live_bytes / 2**20, 4)}}


def _traced_events(engine) -> list[dict]:
    rank = engine._comm.rank
    tr = engine._tracer.result
    events = _meta(rank, [f"{lane}" for lane in LANES])
    for e in tr["events"]:
        events.append({"ph": "X", "pid": rank, "tid": LANES.index(e["lane"]), "name": e["name"],
                       "cat": e["lane"], "ts": e["ts_s"] * 1e6, "dur": max(e["dur_s"] * 1e6, 0.01),
                       "args": {k: v for k, v in e.items() if k in ("graph",)}})
    slots = engine._pipeline.slots
    for e in tr["events"]:
        if e["lane"] != "graphs" or e.get("graph") not in slots:
            continue
        prof = slots[e["graph"]].local
        if prof is None or not prof.nodes or prof.total_s <= 0:
            continue
        scale = e["dur_s"] / prof.total_s
        for n in prof.nodes:
            events.append(_counter(rank, (e["ts_s"] + (n.start_s + n.time_s) * scale) * 1e6,
                                   n.live_bytes))
    return events


def _profiled_events(engine) -> list[dict]:
    pipe = engine._pipeline
    rank = engine._comm.rank
    events = _meta(rank, ["compute", "communication"])
    t = 0.0
    for key in pipe.order or sorted(pipe.slots):
        slot = pipe.slots[key]
        prof = slot.local
        if prof is None:
            continue
        module = {n.name: module_path(n.meta) for n in slot.gm.graph.nodes}
        run = None   # consecutive compute nodes of one module: one event
        for n in prof.nodes:
            ts = (t + n.start_s) * 1e6
            events.append(_counter(rank, (t + n.start_s + n.time_s) * 1e6, n.live_bytes))
            if n.kind != "compute":
                run = None
                events.append({"ph": "X", "pid": rank, "tid": 1, "cat": "comm",
                               "name": f"{n.kind} {n.param}", "ts": ts,
                               "dur": max(n.time_s * 1e6, 0.001),
                               "args": {"graph": key, "node": n.name, "param": n.param,
                                        "live_bytes": n.live_bytes}})
                continue
            mod = module.get(n.name) or key
            if run is not None and run["name"] == mod:
                run["dur"] = ts + max(n.time_s * 1e6, 0.001) - run["ts"]
                run["args"]["nodes"] += 1
            else:
                run = {"ph": "X", "pid": rank, "tid": 0, "cat": "compute", "name": mod, "ts": ts,
                       "dur": max(n.time_s * 1e6, 0.001), "args": {"graph": key, "nodes": 1}}
                events.append(run)
        t += prof.total_s
    return events


def export_trace(engine, path: str | os.PathLike) -> str:
    traced = engine._tracer.result is not None
    if not traced and not any(s.local for s in engine._pipeline.slots.values()):
        raise RuntimeError("deepcompile: export_trace needs a traced step (engine."
                           "trace_next_step()) or a profiled step; none has run yet "
                           "(profiling starts after Config.warmup_steps optimizer steps)")
    mine = _traced_events(engine) if traced else _profiled_events(engine)
    per_rank = engine._comm.all_gather_object(mine)
    path = Path(path)
    if engine._comm.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"traceEvents": [e for events in per_rank for e in events],
                       "displayTimeUnit": "ms",
                       "otherData": {"source": "traced steady step" if traced else
                                     "profiled step (node-by-node)"}}, f)
    return str(path)
