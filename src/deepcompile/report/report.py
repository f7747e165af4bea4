from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..compiler.pipeline import summarize
from ..compiler.profiler import collectives_launched


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


@dataclasses.dataclass
class Report:
    """A JSON-serializable record of what deepcompile did; `str()` is a readable table."""

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

    @classmethod
    def build(cls, engine) -> "Report":
        reg, pipe = engine._registry, engine._pipeline
        graphs = []
        for rec in engine._backend.records:
            slots = []
            for key in rec.slots:
                slot = pipe.slots[key]
                launched = collectives_launched(slot.gm)
                slots.append({
                    "slot": key, "kind": slot.kind, "version": slot.version,
                    "nodes": len(slot.gm.graph.nodes),
                    "all_gathers": launched["all_gather"],
                    "reduce_scatters": launched["reduce_scatter"],
                    "calls": slot.calls,
                    "profiles": [{"label": label, **p.to_dict(), "comm_s": p.comm_s(),
                                  "compute_s": p.compute_s(), "peak_bytes": p.peak_bytes}
                                 for label, p in slot.history],
                })
            graphs.append({"index": rec.index, "dynamo_nodes": rec.dynamo_nodes,
                           "params": rec.params, "slots": slots})
        budget = pipe.memory_budget
        profiles = pipe.latest_profiles()
        names = {e.pid: e.name for e in reg}
        return cls(
            world_size=engine._comm.world,
            config=engine.config.to_dict(),
            phase=pipe.phase.value,
            parameters={"tensors": len(reg), "numel": sum(e.numel for e in reg),
                        "shard_numel": sum(e.shard.numel() for e in reg),
                        "replicated": reg.zero_stage < 3},
            memory_budget_bytes=None if budget == float("inf") else budget,
            cost_model=pipe.cost.to_dict() if hasattr(pipe.cost, "to_dict") else None,
            graphs=graphs,
            passes=[{k: e.get(k) for k in ("pass", "decisions", "changed", "before", "after")}
                    for e in pipe.pass_log],
            step_summary=summarize(profiles, pipe.order, budget) if profiles else None,
            cache=dict(pipe.cache_info),
            timings={**pipe.timings, "profiling_overhead_s": pipe.profiling_overhead_s()},
            comm=engine.comm_stats(),
            eager_fallback_gathers=engine._fallback.materializations,
            graph_reuse=sorted([names.get(a, str(a)), names.get(b, str(b))] for a, b in reg.reuses),
            offload=engine._offload.summary() if engine._offload.active else None,
        )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self), default=str))

    def __str__(self) -> str:
        c = self.config
        out = [
            f"deepcompile: ZeRO-{c['zero_stage']} over {self.world_size} ranks, compiler={c['compiler']}, "
            f"passes={', '.join(c['passes']) or 'insertion only'}, phase={self.phase}",
            f"parameters: {self.parameters['tensors']} tensors, {self.parameters['numel']:,} elements; "
            f"this rank's shards: {self.parameters['shard_numel']:,} elements"
            + ("; module parameters replicated (refreshed after each optimizer step)"
               if self.parameters.get("replicated") else "") + "; memory budget: "
            + ("unbounded" if self.memory_budget_bytes is None else f"{_mib(self.memory_budget_bytes)} MiB"),
            "",
            f"{'slot':<10} {'ver':>3} {'nodes':>5} {'gathers':>7} {'reduces':>7} {'calls':>5} "
            f"{'profile':<16} {'time ms':>8} {'comm ms':>8} {'peak MiB':>9}",
        ]
        for g in self.graphs:
            for s in g["slots"]:
                p = s["profiles"][-1] if s["profiles"] else None
                out.append(
                    f"{s['slot']:<10} {s['version']:>3} {s['nodes']:>5} {s['all_gathers']:>7} "
                    f"{s['reduce_scatters']:>7} {s['calls']:>5} "
                    + (f"{p['label'][:16]:<16} {p['total_s'] * 1e3:>8.2f} {p['comm_s'] * 1e3:>8.2f} "
                       f"{_mib(p['peak_bytes']):>9}" if p else f"{'(not profiled)':<16}"))
        if self.passes:
            out += ["", f"{'pass':<20} {'graphs changed':<16} {'collectives':>13} "
                        f"{'exposed comm ms':>17} {'peak MiB':>15}"]
            for e in self.passes:
                b, a = e["before"], e["after"] or e["before"]
                out.append(f"{e['pass']:<20} {len(e['changed'] or []):<16} "
                           f"{b['collectives']:>6} -> {a['collectives']:<4} "
                           f"{b['exposed_comm_s'] * 1e3:>7.2f} -> {a['exposed_comm_s'] * 1e3:<7.2f} "
                           f"{_mib(b['peak_bytes']):>6} -> {_mib(a['peak_bytes']):<6}")
            for e in self.passes:
                lines = _pass_summary(e["pass"], e["decisions"])
                if lines:
                    out += ["", f"{e['pass']}:"] + [f"  {line}" for line in lines]
        if self.step_summary:
            s = self.step_summary
            out += ["", f"profiled step: {s['collectives']} collectives, comm {s['comm_s'] * 1e3:.2f} ms "
                        f"(exposed {s['exposed_comm_s'] * 1e3:.2f} ms), compute {s['compute_s'] * 1e3:.2f} ms, "
                        f"peak {_mib(s['peak_bytes'])} MiB"]
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
        if self.graph_reuse:
            out.append(f"graph reuse: {len(self.graph_reuse)} parameter pairs share compiled graphs")
        out.append("collectives since initialize: " + (", ".join(
            f"{k} {v['count']} ({_mib(v['bytes'])} MiB)" for k, v in self.comm.items()) or "none"))
        return "\n".join(out)


def _pass_summary(name: str, decisions: dict) -> list[str]:
    from ..passes import get_pass, known_passes

    if name not in known_passes() or get_pass(name).summary is None:
        return []
    return list(get_pass(name).summary(decisions))
