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


class PassManager:
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
        self._initial: dict[str, Any] | None = None   # the runtime plan state before any pass
        self._since = 0       # entries[_since:]: the passes of the plan in force (`current`)
        self._requested: list[str] = []   # what the re-plan under way was asked for (`retry`)
        self._waited: set[str] = set()    # passes asked `waits` in the plan under way
        self._sellers: dict[str, str] = {}   # a pass that frees memory -> the pass waiting for it
        self._moved: dict[str, str] = {}     # a pass that waited -> the pass it waited for

    # -- which passes -----------------------------------------------------------------------
    def configure(self, passes: tuple[str, ...]) -> None:
        self.queue = list(passes)

    def choose(self, *, zero_stage: int, warmup_steps: int) -> None:
        """`passes="auto"`: the queue from the first agreed profile ([Note: choosing passes])."""
        chosen, out = autoplan.choose(autoplan.facts(self._context(), zero_stage=zero_stage,
                                                     warmup_steps=warmup_steps))
        self.queue = [c.name for c in chosen]
        self.chosen = [c.to_dict() for c in chosen]
        self.left_out = [c.to_dict() for c in out]
        log.info("deepcompile auto: passes %s%s", " -> ".join(self.queue) or "none",
                 "".join(f"; {c.name}: {c.reason}" for c in chosen))

    def choose_late(self, *, zero_stage: int, warmup_steps: int) -> bool:
        """`passes="auto"`, after the chosen passes ran: queue the passes asked again then
        (`Pass.choose_late`) that were left out and that the latest profiles now call for
        ([Note: choosing passes]); returns whether it queued any."""
        if self.chosen is None:
            return False
        late = autoplan.choose_late(
            autoplan.facts(self._context(), zero_stage=zero_stage, warmup_steps=warmup_steps,
                           late=True), ran={e["pass"] for e in self.entries})
        for c in late:
            self.queue.append(c.name)
            self.chosen.append(c.to_dict())
            self.left_out = [o for o in self.left_out or [] if o["pass"] != c.name]
            log.warning("deepcompile auto: %s added: %s", c.name, c.reason)
        return bool(late)

    def current(self) -> list[dict[str, Any]]:
        """The log entries of the plan in force: since the last re-plan started over
        (`restart`), or all of them."""
        return self.entries[self._since:]

    def kept(self) -> list[str]:
        """The passes kept so far in the plan in force, in order."""
        return [e["pass"] for e in self.current() if e.get("kept", True)]

    def decisions(self) -> dict[str, Any]:
        """Decisions of the passes kept so far in the plan in force (what later passes read)."""
        return {e["pass"]: e["decisions"] for e in self.current() if e.get("kept", True)}

    # -- one pass ---------------------------------------------------------------------------
    def waits(self, name: str) -> bool:
        """Whether `name`, about to plan, plans right after a queued pass that frees memory
        instead (`Pass.waits_for_memory`, [Note: a memory trade] in passes/activation_budget.py):
        then it is queued there. Asked once per pass in a plan; the same on every rank (the
        agreed profiles)."""
        p = get_pass(name)
        seller = next((n for n in self.queue if get_pass(n).frees_memory), None)
        if p.waits_for_memory is None or seller is None or name in self._waited:
            return False
        self._waited.add(name)
        if not p.waits_for_memory(dataclasses.replace(self._context(), queued=tuple(self.queue))):
            return False
        self.queue.insert(self.queue.index(seller) + 1, name)
        self._sellers[seller] = name
        self._moved[name] = seller
        log.info("deepcompile: %s plans after %s, which may free memory for it", name, seller)
        return True

    def start(self, name: str, decisions: dict | None = None) -> dict[str, Any]:
        p = get_pass(name)
        ctx = dataclasses.replace(self._context(), queued=tuple(self.queue))
        snap = Snapshot(graphs={k: copy_graph(s.gm.graph) for k, s in self.slots.items()},
                        profiles={k: (s.history[-1], s.local) if s.history else None
                                  for k, s in self.slots.items()},
                        runtime=self.runtime.plan_state())
        if self._initial is None:
            self._initial = snap.runtime
        before = self._summarize(ctx.profiles)
        if decisions is None:
            decisions = p.plan(ctx)
        changed = list(p.apply(ctx, decisions) or [])
        for key in changed:
            slot = self.slots[key]
            slot.changed()
            if slot.coverage is not None:   # [Note: gradient coverage] in compiler/coverage.py
                slot.coverage.check(slot.gm, f"the pass {name!r}", key)
        entry = {"pass": name, "decisions": decisions, "changed": changed, "before": before,
                 "after": None, "kept": True, "verdict": None}
        if changed:
            self._snapshots[id(entry)] = snap
        return entry

    def restart(self, requested: list[str]) -> list[str]:
        """[Note: a re-plan starts over] The step drifted (a longer sequence) and `requested`
        must plan again. Every pass of the plan in force planned within what the passes before
        it left of the budget, at the old sizes; re-planning only `requested` on graphs that
        keep the others' rewrites lets those spend memory the new sizes need (measured with
        ragged lengths: `offload_optimizer` re-planned under `prefetch`'s earlier gathers found
        the budget out of reach, was reverted, and the engine ran over it). So a re-plan starts
        over: every graph a kept pass changed goes back to the graph as compiled, the runtime
        state the passes configure (kept parameters, accumulators) back to what it was before
        the first pass, and the kept passes run again in their order, a requested pass that is
        not among them first (where `passes="auto"` places `offload_optimizer`). The offload
        placement stays as the engine left it (every chunk's state off the device,
        `Offloader.go_provisional`) until `offload_optimizer` plans again. Returns the queue;
        at an optimizer-step boundary, on every rank alike."""
        current = [e for e in self.current() if e.get("kept", True)]
        # each pass once, where it was queued: a pass that planned twice (a seller's second
        # turn, `unchanged`) or waited for a seller (`waits`) is back in its place, to do so again
        ran = list(dict.fromkeys(e["pass"] for e in current))
        for name, seller in self._moved.items():
            if name in ran and seller in ran:
                ran.remove(name)
                ran.insert(ran.index(seller), name)
        chain = [n for n in requested if n not in ran] + ran
        for key in sorted({k for e in current for k in e["changed"]}):
            slot = self.slots[key]
            slot.gm.graph = copy_graph(slot.original.graph)
            slot.changed()
        if self._initial is not None:
            self.runtime.restore_plan_state({**self.runtime.plan_state(), "offload": None,
                                             "kept": self._initial["kept"],
                                             "accum": self._initial["accum"]})
        self._since = len(self.entries)
        self._requested = list(requested)
        self._waited, self._sellers, self._moved = set(), {}, {}
        log.info("deepcompile: re-planning from the graphs as compiled: %s", " -> ".join(chain))
        return chain

    def retry(self) -> bool:
        """At the end of a re-plan's queue: a requested pass that was reverted plans once more,
        last, on the latest profiles. (Its re-profile met sizes beyond those it planned from —
        the step is still growing — and the passes after it re-profiled at those sizes: their
        profiles, within the budget, no longer let the steady state see the drift, and the
        requested pass would stay unplanned: `offload_optimizer` in its provisional placement,
        every chunk's state streamed.) Returns whether it queued one; once per re-plan."""
        again = [n for n in self._requested
                 if not any(e["pass"] == n and e.get("kept", True) for e in self.current())]
        self._requested = []
        if again:
            log.warning("deepcompile: re-planning %s again, on the latest profiles (reverted "
                        "earlier in this re-plan)", ", ".join(again))
        self.queue.extend(again)
        return bool(again)

    def snapshot(self, entry: dict[str, Any]) -> Snapshot:
        """What was there before `entry`'s pass applied."""
        return self._snapshots[id(entry)]

    def unchanged(self, entry: dict[str, Any]) -> None:
        entry["after"] = entry["before"]
        entry["verdict"] = "changed no graph"
        self.log(entry)
        # a pass that frees memory and traded nothing for the pass waiting for it (`waits`)
        # plans once more right after that one: the memory it may free for the passes after
        # them is traded as if that pass had not waited
        buyer = self._sellers.pop(entry["pass"], None)
        if buyer is not None and buyer in self.queue:
            self.queue.insert(self.queue.index(buyer) + 1, entry["pass"])

    def judge(self, entry: dict[str, Any], budget: float, trade: dict[str, Any] | None = None
              ) -> bool:
        """Keep or revert `entry`'s pass (its `before`/`after` filled in); returns kept. With
        `trade`, the pass that freed memory for it, the two together ([Note: a memory trade] in
        passes/activation_budget.py; `entry["before"]` is then the step before the trade)."""
        keep, why = autoplan.verdict(entry["before"], entry["after"], budget)
        entry["kept"], entry["verdict"] = keep, why
        if not keep:
            self.revert(entry)
        if trade is not None:
            trade["verdict"] = f"{'kept' if keep else 'reverted'} with {entry['pass']}: {why}"
            self.close(trade, keep)
        self.close(entry, True)
        return keep

    def close(self, entry: dict[str, Any], keep: bool) -> None:
        """`entry`'s pass decided: reverted unless `keep`, its snapshot dropped, logged."""
        entry["kept"] = entry["kept"] and keep
        if not keep:
            self.revert(entry)
        self._snapshots.pop(id(entry), None)
        self.log(entry)

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
