"""The passes of one engine: which run (`autoplan.choose` or the configured list), one at a time,
and what each one did — kept or reverted — as the pass log the report shows.

A pass applies in three moves ([Note: keeping a pass] in compiler/autoplan.py):

  `start(name)`   snapshot every graph and the runtime state passes configure, plan from the
                  latest agreed profiles, apply; returns the log entry (`changed`: the graphs
                  it rewrote, each then re-profiled and measured by the pipeline);
  `judge(entry)`  with the re-profile (`entry["after"]`) and the measured steps, keep it, or
                  revert it: the graphs go back to their snapshot (a new version of each, so
                  their code is lowered and compiled afresh) with their profiles from before,
                  and the runtime state back to what it was (kept parameters, accumulators,
                  the offload plan);
  `log(entry)`    one concise line per pass, and the entry in `entries`.

Decisions of a reverted pass are not handed to later passes, and a cached plan re-applies only
the passes that were kept.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from torch import fx

from ..passes import PassContext, get_pass
from . import autoplan
from .profiler import GraphProfile

log = logging.getLogger("deepcompile")


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph` with the same node names and (shallow-copied) metadata."""
    new = fx.Graph()
    out = new.graph_copy(graph, {}, return_output_node=True)
    if out is not None:
        value, old = out
        node = new.output(value)
        node.meta = dict(old.meta)
    return new


@dataclasses.dataclass
class Snapshot:
    graphs: dict[str, fx.Graph]
    profiles: dict[str, tuple[tuple[str, GraphProfile], GraphProfile | None] | None]
    runtime: dict[str, Any]


class Planner:
    def __init__(self, *, slots: dict, runtime, context: Callable[[], PassContext],
                 summarize: Callable[[dict], dict]) -> None:
        self.slots = slots
        self.runtime = runtime
        self._context = context        # () -> PassContext over the latest agreed profiles
        self._summarize = summarize    # profiles -> step summary (pipeline.summarize)
        self.queue: list[str] = []
        self.entries: list[dict[str, Any]] = []   # the pass log
        self.chosen: list[dict[str, str]] | None = None    # auto: passes chosen, and why
        self.left_out: list[dict[str, str]] | None = None  # auto: passes not run, and why
        self._snapshots: dict[int, Snapshot] = {}

    # -- which passes -----------------------------------------------------------------------
    def configure(self, passes: tuple[str, ...]) -> None:
        self.queue = list(passes)

    def choose(self, *, zero_stage: int, warmup_steps: int) -> None:
        """`passes="auto"`: the queue from the first agreed profile ([Note: choosing passes])."""
        chosen, out = autoplan.choose(self._context(), zero_stage=zero_stage,
                                      warmup_steps=warmup_steps)
        self.queue = [c.name for c in chosen]
        self.chosen = [c.to_dict() for c in chosen]
        self.left_out = [c.to_dict() for c in out]
        log.info("deepcompile auto: passes %s%s", " -> ".join(self.queue) or "none",
                 "".join(f"; {c.name}: {c.reason}" for c in chosen))

    def late_offload(self, warmup_steps: int) -> bool:
        """`passes="auto"`, after the chosen passes ran: queue offload_optimizer if it was left
        out and the latest profiles no longer fit the budget ([Note: choosing passes])."""
        if self.chosen is None or any(e["pass"] == "offload_optimizer" for e in self.entries):
            return False
        yes, why = autoplan.offload_choice(self._context(), warmup_steps, late=True)
        if yes:
            self.queue.append("offload_optimizer")
            self.chosen.append(autoplan.Choice("offload_optimizer", why).to_dict())
            self.left_out = [c for c in self.left_out or [] if c["pass"] != "offload_optimizer"]
            log.warning("deepcompile auto: offload_optimizer added: %s", why)
        return yes

    def decisions(self) -> dict[str, Any]:
        """Decisions of the passes kept so far (what later passes read)."""
        return {e["pass"]: e["decisions"] for e in self.entries if e.get("kept", True)}

    # -- one pass ---------------------------------------------------------------------------
    def start(self, name: str, decisions: dict | None = None) -> dict[str, Any]:
        p = get_pass(name)
        ctx = self._context()
        snap = Snapshot(graphs={k: copy_graph(s.gm.graph) for k, s in self.slots.items()},
                        profiles={k: (s.history[-1], s.local) if s.history else None
                                  for k, s in self.slots.items()},
                        runtime=self.runtime.plan_state())
        before = self._summarize(ctx.profiles)
        if decisions is None:
            decisions = p.plan(ctx)
        changed = list(p.apply(ctx, decisions) or [])
        for key in changed:
            self.slots[key].changed()
        entry = {"pass": name, "decisions": decisions, "changed": changed, "before": before,
                 "after": None, "kept": True, "verdict": None}
        if changed:
            self._snapshots[id(entry)] = snap
        return entry

    def withdraw(self, names: list[str]) -> list[str]:
        """Before `names` plan again (a re-plan): each removes what its plan inserted where it
        can (`Pass.withdraw`), so that the re-profile measures the graphs without it; the keys
        of the graphs changed."""
        changed: set[str] = set()
        for name in names:
            p = get_pass(name)
            if p.withdraw is not None:
                changed.update(p.withdraw(self._context()) or [])
        for key in sorted(changed):
            self.slots[key].changed()
        return sorted(changed)

    def snapshot(self, entry: dict[str, Any]) -> Snapshot:
        """What was there before `entry`'s pass applied."""
        return self._snapshots[id(entry)]

    def unchanged(self, entry: dict[str, Any]) -> None:
        entry["after"] = entry["before"]
        entry["verdict"] = "changed no graph"
        self.log(entry)

    def judge(self, entry: dict[str, Any], budget: float) -> bool:
        """Keep or revert `entry`'s pass (its `before`/`after` filled in); returns kept."""
        keep, why = autoplan.verdict(entry["before"], entry["after"], budget)
        entry["kept"], entry["verdict"] = keep, why
        if not keep:
            self.revert(entry)
        self._snapshots.pop(id(entry), None)
        self.log(entry)
        return keep

    def revert(self, entry: dict[str, Any]) -> None:
        snap = self._snapshots[id(entry)]
        for key in entry["changed"]:
            slot = self.slots[key]
            slot.gm.graph = snap.graphs[key]
            slot.changed()
            old = snap.profiles.get(key)
            if old is not None:   # the graph is what it was: so is its profile
                (label, prof), local = old
                slot.history.append((f"{label} (restored: {entry['pass']} reverted)",
                                     dataclasses.replace(prof, version=slot.version)))
                slot.local = local
        self.runtime.restore_plan_state(snap.runtime)
        log.warning("deepcompile pass %s reverted: %s", entry["pass"], entry["verdict"])

    def log(self, entry: dict[str, Any]) -> None:
        b, a = entry["before"], entry["after"] or entry["before"]
        budget = "unbounded" if b["budget_bytes"] is None else f"{b['budget_bytes'] / 2**20:.1f} MiB"
        log.info("deepcompile pass %s %s: collectives/step %d -> %d; exposed comm %.2f -> %.2f ms; "
                 "peak %.2f -> %.2f MiB (budget %s); %s", entry["pass"],
                 "kept" if entry["kept"] else "REVERTED", b["collectives"], a["collectives"],
                 b["exposed_comm_s"] * 1e3, a["exposed_comm_s"] * 1e3, b["peak_bytes"] / 2**20,
                 a["peak_bytes"] / 2**20, budget, entry["verdict"])
        self.entries.append(entry)

    # -- a cached plan ----------------------------------------------------------------------
    def replay(self, stored: list[dict[str, Any]]) -> None:
        """Re-apply a cached plan's kept passes with their stored decisions."""
        for e in stored:
            if not e.get("kept", True):
                self.entries.append({**e, "changed": []})
                continue
            applied = self.start(e["pass"], decisions=e["decisions"])
            self._snapshots.pop(id(applied), None)
            self.entries.append({**e, "changed": applied["changed"]})
        self.queue = []
