"""What the scheduling passes read from a profiled graph."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from torch import fx

from . import PassContext


@dataclasses.dataclass
class Step:
    """One profiled node: what a planner needs of it."""
    name: str
    kind: str          # "compute" or a communication kind
    time_s: float
    live_bytes: int


def steps_of(prof) -> list[Step]:
    return [Step(n.name, n.kind, n.time_s, n.live_bytes) for n in prof.nodes]


def profiled_graphs(ctx: PassContext, target) -> Iterator[tuple[str, list[Step], list[tuple[int, fx.Node]]]]:
    """(slot key, its profiled steps, (step index, node) of every call of `target`) for each
    profiled graph that calls `target`, in key order."""
    for key in sorted(ctx.slots):
        prof = ctx.profiles.get(key)
        if prof is None:
            continue
        by_name = {n.name: n for n in ctx.slots[key].gm.graph.nodes}
        calls = [(i, by_name[n.name]) for i, n in enumerate(prof.nodes)
                 if by_name[n.name].op == "call_function" and by_name[n.name].target is target]
        if calls:
            yield key, steps_of(prof), calls
