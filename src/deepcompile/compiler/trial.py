"""A pass's timed trial: interleaved steps of the graphs after the pass and the graphs before it.

[Note: interleaved measurement] At most 2 x `measure_steps` steps alternate between the graphs
after the pass and the graphs from before it (`GraphSlot.swap`), so that a change in the
machine's load between two windows of time falls on both sides alike (on a shared machine,
consecutive windows of steps differ by 30% and more). Both sides are lowered and compiled when
the trial starts (`_prepare_sides`), outside the timed steps: every timed step runs code made
before it. Each step's time is the engine's own work in it ([Note: the engine's step time] in
engine.py), the slowest rank's (agreed with MAX at each step). The trial stops as soon as its
decision is certain (`autoplan.time_settled`: some step after the pass is no slower than some
step before it), which a pass that clearly helps reaches after one step of each side. Steps of
the side before a pass that kept parameters gathered skip their refresh (`KeptParams.suspend`),
and the refresh is redone, outside the timed steps, before the other side runs again; steps of
the side before `overlap_refresh` refresh the replicas synchronously (`Replicas.suspend`).

The trial ends with the graphs on the side after the pass and both sides' step times in the
pass's log entry (`measured_s`), from which `autoplan.verdict` keeps or reverts it ([Note:
keeping a pass] in compiler/autoplan.py).
"""

from __future__ import annotations

from typing import Any

from torch import fx

from . import autoplan
from .agree import agree_max
from .pass_manager import Snapshot, copy_graph
from .runner import SlotRunner


class Trial:
    def __init__(self, entry: dict[str, Any], snap: Snapshot, *, runner: SlotRunner,
                 measure_steps: int, changed: list[str] | None = None) -> None:
        """`snap`: the graphs before; `changed`: the graphs that differ from it (the entry's)."""
        self.entry = entry
        self.runner = runner
        self.runtime = runner.runtime
        self.measure_steps = measure_steps
        slots = runner.slots
        self.faces: dict[str, dict[str, tuple[fx.GraphModule, int]]] = {}
        for key in entry["changed"] if changed is None else changed:
            slot = slots[key]
            before = fx.GraphModule(slot.gm, copy_graph(snap.graphs[key]))
            self.faces[key] = {"after": (slot.gm, slot.version),
                               "before": (before, -slot.version - 1)}
        kept_now = [e.pid for e in self.runtime.kept.entries]
        self.side = "after"
        self.samples: dict[str, list[float]] = {"after": [], "before": []}
        # the pass started keeping parameters: the side before it skips the refresh
        self.suspend = bool(kept_now) and not snap.runtime["kept"]
        # the pass left the replicas' refresh in flight: the side before it (whose graphs do
        # not wait for it) refreshes synchronously
        self.sync_refresh = (self.runtime.replicas is not None
                             and self.runtime.replicas.groups is not None
                             and snap.runtime.get("refresh") is None)
        self._prepare_sides()
        # the ranks start the timed steps together: the time one rank took longer to prepare
        # would be in the others' first timed step, spent waiting at its first collective
        agree_max(runner.comm, [0.0], runner.device)

    def _prepare_sides(self) -> None:
        """Both sides' code lowered and compiled now, outside the timed steps ([Note:
        interleaved measurement]), for the graphs the pass changed and the members that run
        their plans; the graphs are left on the side after the pass."""
        runner = self.runner
        for side in ("before", "after"):
            for key, face in self.faces.items():
                slot = runner.slots[key]
                slot.swap(*face[side])
                runner.ready(slot)
                for member in slot.members:
                    runner.follow(member)
                    runner.ready(member)

    def record(self, seconds: float) -> bool:
        """One timed step of the current side took `seconds` on this rank; returns whether the
        trial is over (then the graphs are on the side after the pass, and the entry holds
        both sides' agreed step times), else the next step runs the other side."""
        self.samples[self.side].append(agree_max(self.runner.comm, [seconds],
                                                 self.runner.device)[0])
        after, before = self.samples["after"], self.samples["before"]
        if autoplan.time_settled(before, after) or len(before) >= self.measure_steps:
            self._set_side("after")
            self.entry["after"]["measured_s"] = after    # agreed at each step
            self.entry["before"]["measured_s"] = before
            return True
        self._set_side("before" if self.side == "after" else "after")
        return False

    def _set_side(self, side: str) -> None:
        self.side = side
        for key, face in self.faces.items():
            self.runner.slots[key].swap(*face[side])
        if self.suspend:
            if side == "before":
                self.runtime.kept.suspend()
            else:
                self.runtime.kept.resume()
        if self.sync_refresh:
            if side == "before":
                self.runtime.replicas.suspend()
            else:
                self.runtime.replicas.resume()
