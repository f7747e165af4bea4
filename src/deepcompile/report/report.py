"""What the compiler did, as data (`to_dict`, JSON) and as readable tables (`str`).

[Note: where collectives run] Every collective of an optimizer step is counted where it runs:
in each graph (its lowered code's collectives times the graph's runs per step: with gradient
accumulation a graph runs once per micro-step), and after the optimizer step, outside the
graphs (ZeRO-1/2's replica refresh, the kept parameters' refresh of `selective_unshard`). The
same step is also counted by `engine.comm_stats()` (the `measured` column: the last optimizer
step's counters), so the two can be compared. The step's scalar reductions (the gradient norm
with the inf/NaN flags: [Note: the step's gradient norm] in engine.py) are bookkeeping, in
neither.

[Note: asynchronous time] A graph's profile splits its wall time into compute, time blocked on
communication (synchronous collectives and waits: the exposed part) and the host time of
launching asynchronous collectives. An asynchronous collective runs while the graph computes:
its predicted duration (cost model) is shown apart ("in flight") and is not part of the graph's
time. Node times are agreed as the mean over ranks, scaled so that they sum to the slowest
rank's sum of node times ([Note: agreed node times] in compiler/agree.py); the graph's time is
the slowest rank's whole run, which also holds the host time between nodes.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from typing import Any

from ..compiler.pipeline import summarize
from ..compiler.profiler import collectives_launched
from ..runtime import ops
from ._table import table

ASYNC_NOTE = ("time: the graph's profiled run (slowest rank); blocked: synchronous collectives "
              "and waits (exposed); launch: host time starting asynchronous collectives; in "
              "flight: their predicted duration, overlapped with compute and not part of the "
              "time; node figures are means over ranks scaled to the slowest rank's sum")


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _async_predicted_s(slot, cost: dict | None) -> float | None:
    """Predicted seconds of the asynchronous collectives a graph starts (cost model; the
    bytes of each from its parameters)."""
    if not cost:
        return None
    from ..compiler.cost import LinearCostModel
    from ..runtime.registry import lookup

    model = LinearCostModel.from_dict(cost)
    total = 0.0
    for node in slot.gm.graph.nodes:
        kind = ops.COMM_KINDS.get(node.target) if node.op == "call_function" else None
        if kind is None or kind in ops.BLOCKING or kind not in ops.LAUNCHES:
            continue
        launched = ops.LAUNCHES[kind]
        pids = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        try:
            entries = [lookup(int(p)) for p in pids]
        except (RuntimeError, KeyError):
            continue
        nbytes = sum(e.padded_numel * (e.compute_dtype if launched == "all_gather"
                                       else e.reduce_dtype).itemsize for e in entries)
        total += model.collective_s(launched, nbytes)
    return total


def _graph_row(slot, cost: dict | None) -> dict[str, Any]:
    p = slot.profile
    launched = collectives_launched(slot.gm)
    row: dict[str, Any] = {
        "slot": slot.key, "kind": slot.kind, "version": slot.version,
        "training": getattr(slot, "training", True),
        "nodes": len(slot.gm.graph.nodes), "all_gathers": launched["all_gather"],
        "reduce_scatters": launched["reduce_scatter"], "calls": slot.calls,
        "profile": None,
        "profiles": [{"label": label, **q.to_dict(), "comm_s": q.comm_s(),
                      "compute_s": q.compute_s(), "peak_bytes": q.peak_bytes}
                     for label, q in slot.history],
    }
    if p is not None:
        blocked = sum(n.time_s for n in p.nodes if n.kind in ops.BLOCKING)
        launch = sum(n.time_s for n in p.nodes if n.kind != "compute" and n.kind not in ops.BLOCKING)
        async_n = sum(1 for n in p.nodes if n.kind != "compute" and n.kind not in ops.BLOCKING
                      and n.kind in ops.LAUNCHES)
        row["profile"] = {"label": slot.history[-1][0], "time_s": p.total_s,
                          "compute_s": p.compute_s(), "blocked_s": blocked, "launch_s": launch,
                          "async_collectives": async_n,
                          "in_flight_s": _async_predicted_s(slot, cost),
                          "peak_bytes": p.peak_bytes,
                          "local_time_s": slot.local.total_s if slot.local is not None else None}
    return row


def step_collectives(engine, profiles: dict, order: list[str]) -> list[dict[str, Any]]:
    """[Note: where collectives run]: one row per place (graph or after the step)."""
    pipe = engine._pipeline
    rows = []
    for key in sorted(set(order) | set(profiles), key=lambda k: (k not in order, k)):
        slot = pipe.slots.get(key)
        if slot is None:
            continue
        runs = max(order.count(key), 1)
        prof = profiles.get(key)
        if prof is not None and prof.launched is not None:   # what the profiled runs launched
            per_kind = {k: (round(n * runs), round(b * runs)) for k, (n, b) in prof.launched.items()}
        else:
            per_kind = {k: (n * runs, None) for k, n in collectives_launched(slot.gm).items()}
        for kind, (n, nbytes) in per_kind.items():
            if n:
                rows.append({"where": key, "what": "in the graph" + (f", x{runs} runs" if runs > 1 else ""),
                             "kind": kind, "count": n, "bytes": nbytes})
    rows += engine._runtime.after_step_collectives()
    return rows


@dataclasses.dataclass
class Report:
    """A JSON-serializable record of what deepcompile did; `str()` is readable tables."""

    world_size: int
    config: dict[str, Any]
    phase: str
    parameters: dict[str, int]
    memory_budget_bytes: float | None
    cost_model: dict | None
    graphs: list[dict[str, Any]]
    passes: list[dict[str, Any]]
    step_summary: dict[str, Any] | None
    cache: dict[str, Any]
    timings: dict[str, Any]
    comm: dict[str, dict[str, int]]
    eager_fallback_gathers: int
    graph_reuse: list[list[str]]
    offload: dict[str, Any] | None = None   # optimizer state offloaded: what, bytes, copy time
    auto: dict[str, Any] | None = None      # passes="auto": what was chosen, and why
    step_collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    last_step: dict[str, Any] | None = None   # the last optimizer step, measured
    step_log: list[list] = dataclasses.field(default_factory=list)   # (phase, s) per step
    ranks: list[dict[str, Any]] | None = None  # per-rank data for the plots (save_report)
    layout: dict[str, Any] | None = None       # the data-parallel layout, and why (mesh.py)
    comm_by_group: dict[str, Any] | None = None   # `comm` per group: world / intra / inter

    @classmethod
    def build(cls, engine) -> "Report":
        reg, pipe = engine._registry, engine._pipeline
        cost = pipe.cost.to_dict() if hasattr(pipe.cost, "to_dict") else None
        graphs = []
        for rec in engine._backend.records:
            graphs.append({"index": rec.index, "dynamo_nodes": rec.dynamo_nodes,
                           "params": rec.params,
                           "slots": [_graph_row(pipe.slots[k], cost) for k in rec.slots]})
        budget = pipe.memory_budget
        profiles = pipe.latest_profiles()
        names = {e.pid: e.name for e in reg}
        passes = []
        for e in pipe.pass_log:
            entry = {k: e.get(k) for k in ("pass", "decisions", "changed", "before", "after",
                                           "kept", "verdict")}
            entry["summary"] = _pass_summary(e["pass"], e["decisions"])
            passes.append(entry)
        auto = None
        if engine.config.auto_passes:
            auto = {"chosen": pipe.passes.chosen, "left_out": pipe.passes.left_out}
        auto = {**(auto or {}), "fusion": pipe.fusion, "fusion_reason": pipe.fusion_reason}
        return cls(
            world_size=engine._comm.world,
            config=engine.config.to_dict(),
            phase=pipe.phase.value,
            parameters={"tensors": len(reg), "numel": sum(e.numel for e in reg),
                        "shard_numel": sum(e.shard.numel() for e in reg),
                        "replicated": reg.zero_stage < 3},
            memory_budget_bytes=None if budget == float("inf") else budget,
            cost_model=cost,
            graphs=graphs,
            passes=passes,
            step_summary=pipe.step_summary(),
            cache=dict(pipe.cache.info),
            timings={**pipe.timings, "profiling_overhead_s": pipe.profiling_overhead_s()},
            comm=engine.comm_stats(),
            eager_fallback_gathers=engine._fallback.materializations,
            graph_reuse=sorted([names.get(a, str(a)), names.get(b, str(b))] for a, b in reg.reuses),
            offload=engine._offload.summary() if engine._offload.active else None,
            auto=auto,
            step_collectives=step_collectives(engine, profiles, pipe.order),
            last_step=engine._metrics.last_step_record(),
            step_log=[list(x) for x in pipe.step_log],
            layout=engine._layout.describe(),
            comm_by_group=engine.comm_stats(by_group=True),
        )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Report":
        """A report read back from `to_dict()`'s JSON (`deepcompile report FILE`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def save(self, path) -> str:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        return str(path)

    # -- text ---------------------------------------------------------------------------------
    def __str__(self) -> str:
        c = self.config
        passes = c["passes"] if isinstance(c["passes"], str) else \
            (", ".join(c["passes"]) or "insertion only")
        out = [
            f"deepcompile: ZeRO-{c['zero_stage']} over {self.world_size} ranks, compiler={c['compiler']}, "
            f"passes={passes}, phase={self.phase}",
            f"parameters: {self.parameters['tensors']} tensors, {self.parameters['numel']:,} elements; "
            f"this rank's shards: {self.parameters['shard_numel']:,} elements"
            + ("; module parameters replicated (refreshed after each optimizer step)"
               if self.parameters.get("replicated") else "") + "; memory budget: "
            + ("unbounded" if self.memory_budget_bytes is None else f"{_mib(self.memory_budget_bytes)} MiB"),
        ]
        out += self._layout_lines() + self._auto_lines() + [""] + self._graph_lines()
        if self.passes:
            out += [""] + self._pass_lines()
        out += [""] + self._collective_lines()
        if self.step_summary:
            s = self.step_summary
            out += ["", f"profiled step: {s['collectives']} collectives ({s['collectives_in_graphs']} "
                        f"in graphs, {s['collectives_after_step']} after the step); node times: "
                        f"compute {_ms(s['compute_s'])} ms, blocked on comm (exposed) "
                        f"{_ms(s['exposed_comm_s'])} ms; outside the graphs (optimizer step, "
                        f"refreshes, Python) {_ms(s.get('outside_graphs_s'))} ms"
                        + (f" ({s['outside_graphs_from']})" if s.get("outside_graphs_from") else "")
                        + "; "
                        f"peak {_mib(s['peak_bytes'])} MiB"]
        out += self._tail_lines()
        return "\n".join(out)

    def _auto_lines(self) -> list[str]:
        a = self.auto or {}
        out = []
        if a.get("chosen") is not None:
            out.append("passes chosen (auto): " + (" -> ".join(x["pass"] for x in a["chosen"])
                                                    or "none"))
            out += [f"  + {x['pass']}: {x['reason']}" for x in a["chosen"]]
            out += [f"  - {x['pass']}: {x['reason']}" for x in a.get("left_out") or []]
        if a.get("fusion"):
            out.append(f"fusion policy {a['fusion']}: {a['fusion_reason']}")
        return out

    def _graph_lines(self) -> list[str]:
        if not self.graphs:
            if not self.step_log:
                return ["graphs: none yet (no optimizer step)"]
            return ["graphs: none compiled: the model ran uncompiled, through the eager fallback "
                    "(correct, slow; the engine's warning says why)"]
        rows = []
        for g in self.graphs:
            for s in g["slots"]:
                p = s["profile"]
                rows.append([s["slot"], s["version"], s["calls"], s["all_gathers"], s["reduce_scatters"],
                             p["label"] if p else "(not profiled)",
                             _ms(p["time_s"]) if p else None, _ms(p["compute_s"]) if p else None,
                             _ms(p["blocked_s"]) if p else None, _ms(p["launch_s"]) if p else None,
                             _ms(p["in_flight_s"]) if p else None,
                             _mib(p["peak_bytes"]) if p else None])
        return table(["graph", "ver", "calls", "gathers", "reduces", "latest profile", "time ms",
                      "compute", "blocked", "launch", "in flight", "peak MiB"], rows,
                     title="graphs (latest agreed profile; " + ASYNC_NOTE + ")",
                     right=[1, 2, 3, 4, 6, 7, 8, 9, 10, 11])

    def _pass_lines(self) -> list[str]:
        rows = []
        for e in self.passes:
            b, a = e["before"], e["after"] or e["before"]
            mb, ma = b.get("measured_s"), a.get("measured_s")
            rows.append([e["pass"], "kept" if e.get("kept", True) else "REVERTED",
                         len(e["changed"] or []),
                         f"{b['collectives']} -> {a['collectives']}",
                         f"{_ms(b['exposed_comm_s'])} -> {_ms(a['exposed_comm_s'])}",
                         f"{_mib(b['peak_bytes'])} -> {_mib(a['peak_bytes'])}",
                         f"{_ms(statistics.median(mb))} -> {_ms(statistics.median(ma))}"
                         if mb and ma else "-"])
        out = table(["pass", "result", "graphs", "collectives/step", "exposed ms", "peak MiB",
                     "measured step ms"], rows, title="passes, in the order they ran "
                    "(before -> after; measured: median of the timed steps, slowest rank)",
                    right=[2, 3, 4, 5, 6])
        for e in self.passes:
            lines = list(e.get("summary") or [])
            if e.get("verdict"):
                lines.insert(0, ("kept: " if e.get("kept", True) else "REVERTED: ") + e["verdict"])
            if lines:
                out += [f"{e['pass']}:"] + [f"  {line}" for line in lines]
        return out

    def _collective_lines(self) -> list[str]:
        rows = [[r["where"], r["what"], r["kind"], r["count"],
                 "-" if r.get("bytes") is None else _mib(r["bytes"])] for r in self.step_collectives]
        total = sum(r["count"] for r in self.step_collectives)
        measured = (self.last_step or {}).get("collectives")
        title = (f"collectives per optimizer step, where they run: {total}"
                 + (f" (measured in the last step: {sum(v['count'] for v in measured.values())})"
                    if measured else ""))
        return table(["where", "what", "kind", "count", "MiB"], rows, title=title, right=[3, 4])

    def _tail_lines(self) -> list[str]:
        out = []
        if self.cache.get("enabled"):
            out.append("plan cache: " + (f"hit ({self.cache.get('path')}), profiling skipped, "
                                         f"saved ~{self.cache.get('saved_s', 0):.1f} s"
                                         if self.cache.get("hit") else
                                         f"miss, key {self.cache.get('key', '?')}"))
        if self.eager_fallback_gathers:
            out.append(f"eager fallback: {self.eager_fallback_gathers} parameter gathers outside "
                       "compiled graphs")
        if self.offload:
            o, last = self.offload, self.offload["last_step"]
            out.append(f"offloaded: {len(o['chunks'])} chunks, "
                       f"{_mib(o['offloaded_bytes'])} MiB; last step moved "
                       f"{_mib(last.get('d2h_bytes', 0))} MiB to host and "
                       f"{_mib(last.get('h2d_bytes', 0))} MiB back ({last.get('reloaded_in_graph', 0)} "
                       f"reloaded in graphs, {last.get('streamed_at_step', 0)} streamed at the step); measured "
                       f"copies {o['measured_copy_s'] * 1e3:.2f} ms, hidden "
                       f"{o['measured_hidden_s'] * 1e3:.2f} ms, exposed {o['measured_exposed_s'] * 1e3:.2f} ms")
            if o.get("offloaded_grad_bytes"):
                out.append(f"gradients on the host: {_mib(o['offloaded_grad_bytes'])} MiB of "
                           f"{sum(1 for c in o['chunks'] if c.get('grad_bytes'))} chunks; last "
                           f"step sent {_mib(last.get('grad_d2h_bytes', 0))} MiB, brought "
                           f"{_mib(last.get('grad_h2d_bytes', 0))} MiB back")
            if o.get("offloaded_master_bytes"):
                out.append(f"masters on the host: {sum(1 for c in o['chunks'] if c.get('master_bytes'))} "
                           f"chunks, saving {_mib(o['offloaded_master_bytes'])} MiB (the gathers "
                           "read copies in the compute dtype); last step moved "
                           f"{_mib(last.get('master_d2h_bytes', 0))} MiB to host and "
                           f"{_mib(last.get('master_h2d_bytes', 0))} MiB back")
            if last.get("stepped_on_host"):
                out.append(f"stepped on the host: {last['stepped_on_host']} chunks last step, "
                           f"their copies {_mib(last.get('lowp_h2d_bytes', 0))} MiB up; host "
                           f"steps {o.get('measured_host_step_s', 0) * 1e3:.2f} ms over "
                           f"{o['totals'].get('steps', 0)} steps")
        if self.graph_reuse:
            out.append(f"graph reuse: {len(self.graph_reuse)} parameter pairs share compiled graphs")
        t = self.timings
        out.append(f"one-time: calibration {t.get('calibration_s', 0):.2f} s, planning "
                   f"{t.get('passes_s', 0):.2f} s, profiling overhead "
                   f"{t.get('profiling_overhead_s', 0):.2f} s; steps: "
                   + ", ".join(f"{ph} {n}" for ph, n in _phase_counts(self.step_log)))
        out.append("collectives since initialize: " + (", ".join(
            f"{k} {v['count']} ({_mib(v['bytes'])} MiB)" for k, v in self.comm.items()) or "none"))
        if self.comm_by_group and len(self.comm_by_group) > 1:
            out.append("  by group: " + "; ".join(
                f"{g}: " + (", ".join(f"{k} {v['count']} ({_mib(v['bytes'])} MiB)"
                                      for k, v in kinds.items() if v["count"]) or "none")
                for g, kinds in self.comm_by_group.items()))
        return out

    def _layout_lines(self) -> list[str]:
        lay = self.layout
        if not lay or (lay["layout"] == "shard" and lay["groups"] == 1):
            return []
        out = [f"layout: {lay['layout']}, {lay['groups']} groups of {lay['group_size']} ranks; "
               f"shards span {lay['shard_ranks']} ranks ({lay['reason']})"]
        for name, f in (lay.get("alternatives") or {}).items():
            spent = f.get("spare_used_bytes", 0)
            out.append(f"  {name}: predicted communication {f['comm_s'] * 1e3:.2f} ms per "
                       f"optimizer step"
                       + (f" ({f['comm_before_s'] * 1e3:.2f} ms before the passes use "
                          f"{_mib(spent)} MiB it leaves)" if spent else "")
                       + f", {_mib(f['crossing_bytes'])} MiB across groups; model "
                       f"state {_mib(f['state_bytes'])} MiB per rank"
                       + ("" if f.get("fits", True) else " (does not fit)"))
        return out


def _phase_counts(step_log: list) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for phase, _ in step_log:
        out[phase] = out.get(phase, 0) + 1
    return list(out.items())


def _pass_summary(name: str, decisions: dict) -> list[str]:
    from ..passes import get_pass, known_passes

    if name not in known_passes() or get_pass(name).summary is None:
        return []
    try:
        return list(get_pass(name).summary(decisions))
    except (KeyError, TypeError, ValueError) as e:   # a user pass's summary
        return [f"(summary failed: {e!r})"]
