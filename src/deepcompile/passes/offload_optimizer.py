"""Pass `offload_optimizer`: keep only the optimizer state that fits on the device, from the profile.

The step's memory curve is the profiled graphs in their recorded execution order (every
micro-step of the accumulation window), each node's live bytes with all optimizer state on the
device, then the optimizer step itself (shards, gradients and all state: `step_bytes`). When
the curve exceeds the memory budget, the plan

* picks the fragments to offload (one optimizer state tensor of one parameter shard: Adam's
  `exp_avg`, `exp_avg_sq`): few bytes over what is needed (the largest fragments that together
  stay under the excess, then the smallest one that covers the rest), so that the curve minus
  the offloaded bytes fits the budget at every node;
* places their copies back in the backward graphs of the last micro-step (the state is needed
  only at the optimizer step), in registry order, each as late as the cost model's copy time
  allows for the copy stream to finish before the step, and never earlier than the memory
  allows: the bytes back on the device after node j, plus the curve at j minus everything
  offloaded, stay within the budget at every later node (`plan_step`). A copy that cannot be
  placed in a graph is left to the engine's step (exposed);
* a budget below `step_bytes` (the step needs all state on the device) or an excess larger than
  all movable state is unattainable: the plan says so with the figures and changes nothing.

The fragments leave after each optimizer step and come back by `reload_state` ops; the run-time
side is `runtime/offload.py`. fp32 master shards are not moved: the graphs' gathers read them
throughout the step, so offloading them needs a compute-dtype shard on the device for the
gathers (left for later).

Profiles and order with other passes: until this pass has planned, every movable fragment is
offloaded after each step ([Note: provisional offload] in runtime/offload.py), so the warm-up
and profiled steps fit even where the state does not; the plan adds those bytes back to the
measured curve. The pipeline's before/after line for this pass therefore compares "everything
offloaded" with the plan. Each pass plans from the profile the one before left, under the same
budget: passes before this one (`prefetch`, ...) see the curve with the state off the device
and may spend that memory, and this plan then keeps on the device only the state that still
fits (everything offloaded always fits when the step does); passes after it see the plan's
curve, reloads included, and spend only what the plan left.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import fx

from ..runtime import offload, ops
from . import PassContext, register_pass

log = logging.getLogger("deepcompile")


@dataclasses.dataclass
class Point:
    """One profiled node of the step, as the planner sees it."""
    slot: str
    name: str
    live_bytes: int        # with all optimizer state on the device
    time_s: float
    placeable: bool        # a reload may start right after this node


@dataclasses.dataclass
class Frag:
    pid: int
    key: str
    nbytes: int
    param: str = ""


def select(frags: list[Frag], need: int) -> list[Frag] | None:
    """Fragments whose bytes add up to at least `need`, with little more: the largest ones
    that stay within `need`, then the smallest one left that covers the rest (every fragment
    skipped on the way is larger than the rest), then, largest first, any taken one that is no
    longer needed is given back. At most `need` + the largest fragment; None if all of them are
    not enough. Deterministic (ties by position): the same on every rank."""
    if need <= 0:
        return []
    rank = {id(f): i for i, f in enumerate(frags)}
    taken, skipped, total = [], [], 0
    for f in sorted(frags, key=lambda f: (-f.nbytes, rank[id(f)])):
        if total < need and total + f.nbytes <= need:
            taken.append(f)
            total += f.nbytes
        else:
            skipped.append(f)
    if total < need:
        if not skipped:
            return None
        cover = min(skipped, key=lambda f: (f.nbytes, rank[id(f)]))
        taken.append(cover)
        total += cover.nbytes
        for f in sorted(taken, key=lambda f: (-f.nbytes, rank[id(f)])):
            if total - f.nbytes >= need:
                taken.remove(f)
                total -= f.nbytes
    return sorted(taken, key=lambda f: rank[id(f)])


def plan_step(points: list[Point], frags: list[Frag], step_bytes: int,
              copy_s: Callable[[int], float], budget: float) -> dict[str, Any]:
    """The offload plan of one optimizer step; pure (unit-tested on synthetic curves)."""
    n = len(points)
    live = [p.live_bytes for p in points]
    graph_peak = max(live, default=0)
    peak_before = max(graph_peak, step_bytes)
    out: dict[str, Any] = {
        "unattainable": False, "reason": None,
        "budget_bytes": None if budget == float("inf") else budget,
        "state_bytes": sum(f.nbytes for f in frags), "step_bytes": step_bytes,
        "need_bytes": max(graph_peak - budget, 0) if budget != float("inf") else 0,
        "offloaded_bytes": 0, "fragments": [], "reloads": [],
        "predicted_copy_s": 0.0, "predicted_hidden_s": 0.0, "predicted_exposed_s": 0.0,
        "offload_copy_s": 0.0, "peak_before": peak_before, "peak_after": peak_before,
        "curve": live}
    if peak_before <= budget:
        return out
    if step_bytes > budget:
        return {**out, "unattainable": True,
                "reason": "the optimizer step needs all state on the device "
                          f"({step_bytes} bytes with shards and gradients)"}
    chosen = select(frags, out["need_bytes"])
    if chosen is None:
        return {**out, "unattainable": True,
                "reason": f"offloading all movable state ({out['state_bytes']} bytes) is not "
                          f"enough: the curve exceeds the budget by {out['need_bytes']} bytes"}
    total = sum(f.nbytes for f in chosen)
    # R(j), the bytes back on the device at node j, may not exceed the room left at j or at
    # any later node (R only grows): suffix minimum of budget - live + total.
    room = [0.0] * n
    acc = float("inf")
    for j in range(n - 1, -1, -1):
        acc = min(acc, budget - live[j] + total)
        room[j] = acc
    ends, t = [], 0.0
    for p in points:
        t += p.time_s
        ends.append(t)
    t_end = ends[-1] if ends else 0.0
    placeable = [j for j in range(n) if points[j].placeable]
    copies = [copy_s(f.nbytes) for f in chosen]
    positions: list[int] = []     # node index after which each copy starts; n: at the step
    back, earliest, hide, pick = 0, 0, -1, 0
    remaining = sum(copies)
    for f, c in zip(chosen, copies):
        back += f.nbytes
        while earliest < n and back > room[earliest]:   # room is nondecreasing, back grows
            earliest += 1
        latest_start = t_end - remaining      # the copy stream runs the copies one by one
        remaining -= c
        while hide + 1 < len(placeable) and ends[placeable[hide + 1]] <= latest_start:
            hide += 1
        lo = max(earliest, placeable[hide] if hide >= 0 else 0, positions[-1] if positions else 0)
        while pick < len(placeable) and placeable[pick] < lo:
            pick += 1
        positions.append(placeable[pick] if pick < len(placeable) else n)
    delta = [0] * (n + 1)
    for f, p in zip(chosen, positions):
        delta[p] += f.nbytes
    curve, back = [], 0
    for j in range(n):
        back += delta[j]
        curve.append(live[j] - total + back)
    if max(curve, default=0) > budget:   # cannot happen: positions respect `room`
        raise RuntimeError("deepcompile offload_optimizer: planned curve exceeds the budget")
    finish = 0.0
    for c, p in zip(copies, positions):
        finish = max(ends[p] if p < n else t_end, finish) + c
    exposed = max(finish - t_end, 0.0)
    reloads: dict[int, dict[str, Any]] = {}
    for f, p, c in zip(chosen, positions, copies):
        r = reloads.setdefault(p, {"slot": points[p].slot if p < n else None,
                                   "after": points[p].name if p < n else None,
                                   "pids": [], "params": [], "fragments": [], "bytes": 0,
                                   "predicted_s": 0.0})
        if f.pid not in r["pids"]:
            r["pids"].append(f.pid)
            r["params"].append(f.param)
        r["fragments"].append([f.param, f.key])
        r["bytes"] += f.nbytes
        r["predicted_s"] += c
    return {**out, "offloaded_bytes": total,
            "fragments": [{"param": f.param, "pid": f.pid, "key": f.key, "bytes": f.nbytes}
                          for f in chosen],
            "reloads": [reloads[p] for p in sorted(reloads)],
            "predicted_copy_s": sum(copies), "predicted_exposed_s": exposed,
            "predicted_hidden_s": sum(copies) - exposed, "offload_copy_s": sum(copies),
            "peak_after": max(max(curve, default=0), step_bytes), "curve": curve}


def timeline(ctx: PassContext, offset: int = 0) -> list[Point]:
    """The profiled nodes of one optimizer step in execution order, `offset` bytes added to
    each (state the profiled steps kept off the device). Reloads may start in the first run,
    within the last micro-step, of each backward graph (the op acts only in the last
    micro-step, and the first of its runs there brings the state back)."""
    gas = ctx.runtime.step.gradient_accumulation_steps
    order = [k for k in ctx.order if k in ctx.profiles]
    last_from = len(order) - len(order) // gas if len(order) % gas == 0 else len(order)
    points, seen = [], set()
    for i, key in enumerate(order):
        in_last = i >= last_from
        placeable = in_last and key not in seen and ctx.slots[key].kind == "bw"
        if in_last:
            seen.add(key)
        points += [Point(key, n.name, n.live_bytes + offset, n.time_s, placeable)
                   for n in ctx.profiles[key].nodes]
    return points


def plan(ctx: PassContext) -> dict[str, Any]:
    store = ctx.runtime.offload
    names = {e.pid: e.name for e in ctx.registry}
    frags = [Frag(pid, key, nbytes, names[pid]) for pid, key, nbytes in store.movable()]
    # the profiles were measured with every movable fragment off the device ([Note:
    # provisional offload] in runtime/offload.py): add them back
    offset = store.provisional_bytes()
    decision = plan_step(timeline(ctx, offset), frags, store.step_bytes(), ctx.cost.copy_s,
                         ctx.memory_budget)
    decision["profiled_offloaded_bytes"] = offset
    if decision["unattainable"]:
        log.warning("deepcompile offload_optimizer: memory budget %.2f MiB is unattainable: %s",
                    ctx.memory_budget / 2**20, decision["reason"])
    else:
        log.info("deepcompile offload_optimizer: %s", summary(decision)[0])
    return decision


def apply(ctx: PassContext, decisions: dict[str, Any]) -> list[str]:
    pid_of = ctx.registry.pid_by_name()   # by name: pids differ between processes
    store = ctx.runtime.offload
    store.set_plan([(pid_of[f["param"]], f["key"]) for f in decisions["fragments"]])
    if not decisions["fragments"]:
        return []
    for r in decisions["reloads"]:
        if r["after"] is None:
            continue   # the engine reloads these before the step
        graph = ctx.slots[r["slot"]].gm.graph
        node = next(n for n in graph.nodes if n.name == r["after"])
        group = store.add_reload_group([(pid_of[p], k) for p, k in r["fragments"]])
        with graph.inserting_after(node):
            op = graph.call_function(offload.RELOAD_STATE,
                                     (_order_input(graph, node), [pid_of[p] for p in r["params"]],
                                      group))
        op.meta["val"] = None
        graph.lint()
    # every graph's memory curve changes (the state is off the device): all are re-profiled
    return sorted(k for k in set(ctx.order) if k in ctx.slots)


def _order_input(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """The op's first input: `node` itself when it is a tensor (the op runs after it), else a
    graph input (alive to the end anyway: using it changes no value's lifetime)."""
    if isinstance(node.meta.get("val"), torch.Tensor) and node.target not in ops.MARKERS:
        return node
    return next(n for n in graph.nodes if n.op == "placeholder"
                and isinstance(n.meta.get("val"), torch.Tensor))


def _mib(n) -> str:
    return "unbounded" if n is None else f"{n / 2**20:.2f} MiB"


def summary(d: dict[str, Any]) -> list[str]:
    if d["unattainable"]:
        return [f"unattainable (budget {_mib(d['budget_bytes'])}): {d['reason']}"]
    if not d["fragments"]:
        return [f"nothing offloaded: the step fits the budget ({_mib(d['peak_before'])} <= "
                f"{_mib(d['budget_bytes'])}); movable state {_mib(d['state_bytes'])}"]
    in_graph = [r for r in d["reloads"] if r["after"] is not None]
    at_step = [r for r in d["reloads"] if r["after"] is None]
    shown = ", ".join(f"{f['param']}.{f['key']}" for f in d["fragments"][:4])
    more = len(d["fragments"]) - 4
    return [
        f"offloaded {len(d['fragments'])} state fragments, {_mib(d['offloaded_bytes'])} of "
        f"{_mib(d['state_bytes'])} movable (excess over budget {_mib(d['need_bytes'])}): "
        f"{shown}{f' and {more} more' if more > 0 else ''}",
        f"moved per step: {_mib(d['offloaded_bytes'])} to host after the step, the same back; "
        f"reloads start at {len(in_graph)} points in backward graphs"
        + (f" ({in_graph[0]['slot']} after {in_graph[0]['after']}"
           f"{' ...' if len(in_graph) > 1 else ''})" if in_graph else "")
        + (f", {sum(len(r['fragments']) for r in at_step)} fragments at the step"
           if at_step else ""),
        f"predicted copy back {d['predicted_copy_s'] * 1e3:.3f} ms: hidden "
        f"{d['predicted_hidden_s'] * 1e3:.3f} ms, exposed {d['predicted_exposed_s'] * 1e3:.3f} ms",
        f"peak {_mib(d['peak_before'])} -> {_mib(d['peak_after'])} (budget "
        f"{_mib(d['budget_bytes'])}; optimizer step {_mib(d['step_bytes'])})",
    ]


register_pass("offload_optimizer", plan, apply, __doc__.splitlines()[0], summary=summary)
