"""Chrome-trace export (opens in Perfetto or chrome://tracing) of the latest profiled step.

One process per rank, with a compute lane and a communication lane; every collective is
labelled with the parameter it moves. Times are each rank's own measurements (the local
profile, not the cross-rank agreed one), laid out in execution order over the step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

COMPUTE_TID, COMM_TID = 0, 1


def _rank_events(engine) -> list[dict]:
    pipe = engine._pipeline
    rank = engine._comm.rank
    events = [
        {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": COMPUTE_TID, "args": {"name": "compute"}},
        {"ph": "M", "name": "thread_name", "pid": rank, "tid": COMM_TID, "args": {"name": "communication"}},
    ]
    t = 0.0
    order = pipe.order or list(pipe.slots)
    for key in order:
        prof = pipe.slots[key].local
        if prof is None:
            continue
        for n in prof.nodes:
            comm = n.kind != "compute"
            events.append({
                "ph": "X", "pid": rank, "tid": COMM_TID if comm else COMPUTE_TID,
                "name": f"{n.kind}[{n.param}]" if comm else n.op,
                "cat": "comm" if comm else "compute",
                "ts": (t + n.start_s) * 1e6, "dur": max(n.time_s * 1e6, 0.001),
                "args": {"graph": key, "node": n.name, "out_bytes": n.out_bytes,
                         "live_bytes": n.live_bytes, **({"param": n.param} if comm else {})},
            })
        t += prof.total_s
    return events


def export_trace(engine, path: str | os.PathLike) -> str:
    if not any(s.local for s in engine._pipeline.slots.values()):
        raise RuntimeError("deepcompile: export_trace needs a profiled step; none has run yet "
                           "(profiling starts after Config.warmup_steps optimizer steps)")
    per_rank = engine._comm.all_gather_object(_rank_events(engine))
    path = Path(path)
    if engine._comm.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"traceEvents": [e for events in per_rank for e in events],
                       "displayTimeUnit": "ms"}, f)
    return str(path)
