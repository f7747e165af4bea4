"""A graph slot: one partitioned graph (forward, backward or inference of one Dynamo graph).

AOTAutograd calls the slot in place of a compiled graph. `gm` is the planned graph (the
communication IR of runtime/ops.py): passes rewrite it (never its inputs or outputs) and call
`changed()`, which bumps `version`. What runs is its lowering (compiler/lower.py), made lazily
for the current version — two variants when the graph accumulates gradients locally — and run
by the slot runner (compiler/runner.py) as the phase schedule says: the profiling run, the FX code, or the
final compiled code.
"""

from __future__ import annotations

import collections
import weakref
from typing import TYPE_CHECKING, Any, Callable

from torch import fx

if TYPE_CHECKING:
    from .families import Structures
    from .coverage import Coverage
    from .lower import Lowered
    from .profiler import GraphProfile


class GraphSlot:
    _boxed_call = True  # AOTAutograd passes the arguments as one list

    def __init__(self, key: str, graph_index: int, kind: str, gm: fx.GraphModule,
                 runner: Callable[["GraphSlot", list], Any]) -> None:
        self.key = key
        self.graph_index = graph_index
        self.kind = kind                  # "fw", "bw" or "inference"
        self.gm = gm
        self.version = 0
        self.runner = runner
        self.training = True              # False: runs under no_grad / eval (never planned for)
        # [Note: shape families] in compiler/families.py: the representative runs the plan the
        # passes made; a member (another shape) runs it transplanted
        self.rep: "GraphSlot | None" = None       # a member's representative; None: one itself
        self.members: list["GraphSlot"] = []      # a representative's members
        self.original: fx.GraphModule | None = None   # the graph as compiled, before any pass
        # what every rewrite of it must keep ([Note: gradient coverage] in compiler/coverage.py)
        self.coverage: "Coverage | None" = None
        self.to_rep: dict[str, str] = {}          # a member's node -> its representative's node
        self.faces: dict[int, tuple] = {}         # a member's plan per representative version
        self.faces_made = 0                       # a member's versions so far (never reused)
        self.following: int | None = None         # the representative version it runs
        # [Note: graph structure] in compiler/families.py: the digest of its structure, the
        # structures of its code (one family each), and whether the ranks agree on the
        # structure at each of its calls (`SlotRunner._checks`)
        self.structure = 0
        self.structures: "Structures | None" = None
        self.checked = False
        self.history: list[tuple[str, "GraphProfile"]] = []   # (label, agreed profile)
        self.local: "GraphProfile | None" = None              # this rank's latest measured profile
        self.pending: list["GraphProfile"] = []               # runs of the current profile step
        # (variant, version) -> lowered graph (variant `last`: the window's last micro-step),
        # and (variant, version, final) -> compiled code; two versions live side by side while
        # a pass is measured against the graphs from before it (compiler/trial.py)
        self.lowered: dict[tuple[bool, int], "Lowered"] = {}
        self.compiled: dict[tuple[bool, int, bool], Callable] = {}
        self.variants: bool | None = None  # accumulates gradients locally (None: not known yet)
        self.epoch = 0                     # the runtime's epoch its lowered code was made in
        self.calls = 0
        # wall time of recent unprofiled runs (compiles excluded), to check profiles against
        self.run_s: collections.deque[float] = collections.deque(maxlen=64)

    @property
    def varies(self) -> bool:
        """Its code has several structures: which of them runs (and so which graphs run before
        and after it) depends on the data."""
        return self.structures is not None and len(self.structures.families) > 1

    @property
    def profile(self) -> "GraphProfile | None":
        return self.history[-1][1] if self.history else None

    def swap(self, gm: fx.GraphModule, version: int) -> None:
        """Run `gm` as version `version` from now on (an A/B measurement's other side)."""
        self.gm, self.version, self.variants = gm, version, None

    def prune(self) -> None:
        """Forget the code of other versions than the current one."""
        self.lowered = {k: v for k, v in self.lowered.items() if k[1] == self.version}
        self.compiled = {k: v for k, v in self.compiled.items() if k[1] == self.version}

    def changed(self) -> None:
        """A pass rewrote `gm`."""
        self.gm.graph.lint()
        self.gm.recompile()
        self.version += 1
        self.variants = None

    def __call__(self, args: list[Any]) -> Any:
        self.calls += 1
        return self.runner(self, args)


def alive(ref: weakref.ref):
    """The object behind `ref`, which compiled code of an engine holds weakly ([Note: what
    Dynamo holds] in compiler/backend.py); a released engine's code says so."""
    obj = ref()
    if obj is None:
        raise RuntimeError("deepcompile: this model's compiled code belongs to an engine that no "
                           "longer exists (it was released); call deepcompile.initialize again "
                           "on a freshly built model")
    return obj
