"""Steady-state drift: what tells the pipeline that the plan no longer describes the step.

The passes plan from profiles of the graphs as they ran. In the steady state the step may
change under the plan:
  * Dynamo compiles a new graph (a new input shape): it runs with insertion only, and the
    memory the plan left free was measured without it (`SlotRunner.add_slot`);
  * a graph with symbolic sizes (Dynamo's automatic dynamic shapes, e.g. the sequence length)
    is called with sizes larger than any it was profiled with (`SizeWatch`);
  * on CUDA, the offloader's reloads find the device fuller than planned (runtime/offload/).
The pipeline hands each to its `on_drift` listeners (the engine re-plans the passes that hold
memory under the budget: `offload_optimizer`); a size check is a C-level comparison per graph
call, and only for graphs with symbolic sizes.

[Note: agreed re-planning] Drift is seen by one rank: with ragged data a rank compiles a graph
for a length only it has met, or calls a graph with sizes larger than its own profiles, and the
other ranks do not. Its listeners act at once where only this rank is concerned (the engine puts
all optimizer state off the device before the larger graph runs) and `request_replan`; the
re-plan itself needs every rank (profiles and plans are agreed). So the request waits for the
step boundary, where the ranks agree it first thing in `engine.step()`, one integer (MAX) more
in the divergence check's reduction (runtime/divergence.py; with `divergence_check_every` k,
at the next check; with no checks, by a reduction of its own on the check's group, each steady
step where something listens to drift). Where some rank asked, every rank that did not tells its
listeners now, before the optimizer step (the engine puts all state off the device there too:
the re-profile measures every rank without it), and every rank enters PROFILE at the step's end.
"""

from __future__ import annotations

import operator

import torch
from torch import fx


class SizeWatch:
    """The largest symbolic sizes (SymInt inputs) a graph was profiled with: with the profiles
    the plan stands on (a re-profile dropped with a reverted pass takes its sizes back:
    `SlotRunner.forget_profile`)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.positions = tuple(i for i, n in enumerate(phs)
                               if isinstance(n.meta.get("val"), torch.SymInt))
        i = self.positions[0] if self.positions else 0
        self._pick = operator.itemgetter(*self.positions) if len(self.positions) > 1 else \
            operator.itemgetter(slice(i, i + 1))
        self.limit: tuple[int, ...] | None = None

    def record(self, args: list) -> None:
        sizes = tuple(int(s) for s in self._pick(args))
        self.limit = sizes if self.limit is None else tuple(map(max, self.limit, sizes))

    def exceeded(self, args: list) -> bool:
        return self.limit is not None and any(map(operator.gt, self._pick(args), self.limit))
