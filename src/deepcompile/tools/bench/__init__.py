"""`deepcompile bench`: ours and the peers on the same work, side by side.

    systems.py    the systems as data (ours: a Config; peers: FSDP2, DDP, DeepSpeed,
                  torch.compile) and why one cannot run here
    trainers.py   how each system trains on one rank (peers are imported only there)
    measure.py    load-independent figures: collectives, memory
    worker.py     one launch: the ranks (tools/spawn.py) warm up, time, count
    run.py        the parent: interleaved launches, medians, summary
    output.py     JSON, markdown table, PNG chart

The work itself (model, data, optimizer, batch, accumulation, dtype) and the eager reference
every system's losses are compared with are in tools/workloads.py. Nothing here is imported by
the library proper; DeepSpeed and matplotlib are optional (the `bench` extra).
"""

from __future__ import annotations

from .run import BenchArgs, run

__all__ = ["BenchArgs", "run"]
