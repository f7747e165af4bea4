"""A graph slot: one partitioned graph (forward, backward or inference of one Dynamo graph).

AOTAutograd calls the slot in place of a compiled graph. The slot runs whatever the phase
schedule says: the profiling run, the FX graph as generated Python, or the final compiled code.
Passes rewrite `slot.gm` (never its inputs or outputs) and bump `slot.version`; the compiled
code is rebuilt lazily on the next call.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable

from torch import fx

if TYPE_CHECKING:
    from .pipeline import Pipeline
    from .profiler import GraphProfile


class GraphSlot:
    _boxed_call = True  # AOTAutograd passes the arguments as one list

    def __init__(self, key: str, graph_index: int, kind: str, gm: fx.GraphModule,
                 pipeline: "Pipeline") -> None:
        self.key = key
        self.graph_index = graph_index
        self.kind = kind                  # "fw", "bw" or "inference"
        self.gm = gm
        self.version = 0
        self.pipeline = pipeline
        self.history: list[tuple[str, "GraphProfile"]] = []   # (label, agreed profile)
        self.local: "GraphProfile | None" = None              # this rank's latest measured profile
        self.pending: list["GraphProfile"] = []               # runs of the current profile step
        self.compiled: Callable | None = None
        self.compiled_for: tuple[int, bool] | None = None  # (version, final) of `compiled`
        self.calls = 0
        # wall time of recent unprofiled runs (compiles excluded), to check profiles against
        self.run_s: collections.deque[float] = collections.deque(maxlen=64)

    @property
    def profile(self) -> "GraphProfile | None":
        return self.history[-1][1] if self.history else None

    def changed(self) -> None:
        """A pass rewrote `gm`."""
        self.gm.graph.lint()
        self.gm.recompile()
        self.version += 1

    def __call__(self, args: list[Any]) -> Any:
        self.calls += 1
        return self.pipeline.run(self, args)
