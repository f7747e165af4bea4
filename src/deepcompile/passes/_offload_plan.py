"""The offload plan of one optimizer step: pure, over synthetic curves in the unit tests
(passes/offload_optimizer.py reads its inputs from the profiles and applies it).

The plan:
* picks the chunks whose state leaves the device: few bytes over the excess of the curve
  (the largest that stay within it, then the smallest that covers the rest), more if the step
  needs it;
* places their copies back in the backward graphs of the last micro-step, each as late as the
  cost model's copy time allows for the copy to finish before the step and never earlier than
  memory allows (the bytes back on the device after node j, plus the curve at j minus
  everything offloaded, stay within the budget at every later node and at the step). A chunk
  that cannot come back in a graph is streamed through the device during the step;
* when all state off the device is not enough (the graphs' curve, or the step, stays over the
  budget), the gradients of chunks go too (tier 2, [Note: gradients on the host] in
  offload/grads.py): every chunk's state is streamed through the step, and chunks are taken in
  the order their gradients are complete in the backward (the earliest are off the device for
  longest) until the curve — less each taken gradient once its copy out ends (the copies
  queued one after another from the node that makes each: `_all_state_off`) — and the step
  fit. A `grad_to_host` op goes right after each of their gradients;
* when that is not enough either, the masters of chunks go too (tier 3, [Note: masters on the
  host] in offload/masters.py), of chunks whose gradients go, in chunk order, each only where it
  lowers the peak (streamed through the step, a master adds to its staging), until the curve
  and the step fit: each saves its master's bytes less the copy in the compute dtype the device
  keeps for the gathers (only with a narrower compute dtype, at ZeRO-3, and not for a chunk with
  a parameter kept gathered, accumulated locally, or in a reused graph); the step streams the
  master in with the chunk's state and gradient. Per byte crossing PCIe each step gradients
  free more (a tier-2 gradient frees 4 bytes per parameter for 4 out and 4 in; a master under
  bf16 frees 2 for 4 out and 4 in), so they go first;
* chunks whose masters go may step on the host instead (tier 4, [Note: the host step] in
  offload/host_step.py): then the step streams nothing of them (no staging), and only their copy
  in the compute dtype goes up. The plan takes it where it is predicted faster — per chunk, its
  copies in and out (the two directions at once) plus the device's step, against the host's
  step at the rate measured at start-up (`PassContext.host_step_rate`, agreed over the ranks)
  plus the copy's way up — or where only it fits the budget; `Config.host_step` (auto, always,
  never) overrides the comparison. The decision's `host_step` says what was compared;
* a budget that even all state, gradients and masters off the device does not meet is
  unattainable: the plan says so with the figures and changes nothing. So is a plan that
  would keep more on the host than the host has for this rank (`host_bytes` against
  `PassContext.host_capacity`: what the node has available, shared by its local ranks): pinned
  buffers past it would take the host down, not the device.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
from typing import Any, Callable

import numpy as np

from ..runtime import offload


@dataclasses.dataclass
class Point:
    """One profiled node of the step, as the planner sees it."""
    slot: str
    name: str
    live_bytes: int        # with all optimizer state on the device
    time_s: float
    placeable: bool        # a reload may start right after this node


@dataclasses.dataclass
class Item:
    """Something the plan can keep off the device: one chunk's optimizer state."""
    chunk: int
    nbytes: int            # as the device counts it
    label: str = ""        # its first parameter, for reports


@dataclasses.dataclass
class GradItem:
    """One chunk's shard gradients, which tier 2 keeps off the device."""
    chunk: int
    nbytes: int            # the shard gradients as the device counts them
    flat_bytes: int        # the chunk's flat gradient (the step streams it in)
    at: int                # the point after which all of them exist (len(points): never in a graph)
    label: str = ""
    # (point after which it exists, bytes) per shard gradient: its `grad_to_host` op copies it
    # out from there (`_all_state_off`: it leaves once the copy ends); None: all of them at `at`
    parts: list[tuple[int, int]] | None = None
    # (point, bytes) per later gradient of a shard in the window (the next micro-step, a
    # parameter used in two graphs): its op brings the host's back to add to, and the sum is
    # on the device until its copy out ends
    again: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class MasterItem:
    """One chunk's master shards, which tier 3 keeps on the host."""
    chunk: int
    nbytes: int            # what the device saves: the master less its compute-dtype copy
    master_bytes: int      # the master as the device counts it (the step streams it in)
    label: str = ""
    # per point, where the saving differs from point to point (the CPU model: `master_items`);
    # None: `nbytes` at every point
    per_point: list[int] | None = None
    numel: int = 0         # the chunk's elements (the host step's work)
    copy_bytes: int = 0    # its copy in the compute dtype (what a host step sends up)


def select(items: list[Item], need: int) -> list[Item] | None:
    """Items whose bytes add up to at least `need`, with little more: the largest ones that
    stay within `need`, then the smallest one left that covers the rest, then, largest first,
    any taken one that is no longer needed is given back. At most `need` + the largest item;
    None if all of them are not enough. Deterministic (ties by position): the same on every
    rank."""
    if need <= 0:
        return []
    rank = {id(f): i for i, f in enumerate(items)}
    taken, skipped, total = [], [], 0
    for f in sorted(items, key=lambda f: (-f.nbytes, rank[id(f)])):
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


def staging_bytes(streamed: list[Item]) -> int:
    """Device bytes the step needs for the chunks it streams (at most LOOKAHEAD + 1 at once)."""
    sizes = sorted((i.nbytes for i in streamed), reverse=True)
    return sum(sizes[:offload.LOOKAHEAD + 1])


def plan_step(points: list[Point], items: list[Item], step_base: int,
              copy_s: Callable[[int], float], budget: float,
              grads: list[GradItem] | None = None,
              masters: list[MasterItem] | None = None,
              host: "HostStep | None" = None,
              host_capacity: float = float("inf")) -> dict[str, Any]:
    """The offload plan of one optimizer step; pure (unit-tested on synthetic curves).

    `points`: the graphs' curve with every item on the device; `step_base`: the device's bytes
    during the step with no item on it (masters, gradients, the fold's flat gradient, what is
    not this engine's); `grads`: the chunks whose gradients may go to the host if the state
    alone is not enough (tier 2); `masters`: the chunks whose masters may go too, if that is not
    enough either (tier 3); `host`: whether and how fast such chunks may step on the host
    instead of streaming through the device (tier 4; None: never); `host_capacity`: the host
    bytes the plan may keep (`host_bytes`: a plan that needs more is unattainable)."""
    d = _plan_step(points, items, step_base, copy_s, budget, grads, masters, host)
    d["host_bytes"] = host_bytes(d["chunks"], grads or [], masters or [])
    d["host_capacity_bytes"] = None if host_capacity == float("inf") else host_capacity
    if d["unattainable"] or d["host_bytes"] <= host_capacity:
        return d
    return {**d, "unattainable": True, "chunks": [], "reloads": [], "offloaded_bytes": 0,
            "offloaded_grad_bytes": 0, "grad_sent_bytes": 0, "offloaded_master_bytes": 0,
            "peak_after": d["peak_before"], "curve": [p.live_bytes for p in points],
            "reason": f"the plan keeps {d['host_bytes']} bytes on the host (optimizer state, "
                      f"gradients, masters: pinned) and the host has {int(host_capacity)} for "
                      "this rank"}


def host_bytes(chunks: list[dict], grads: list[GradItem],
               masters: list[MasterItem]) -> int:
    """Host bytes a plan keeps (runtime/offload's host buffers): each offloaded chunk's
    state; at tier 2 its flat gradient; at tier 3 its master; at tier 4 its copy's staging."""
    flat = {g.chunk: g.flat_bytes for g in grads}
    master = {m.chunk: m for m in masters}
    total = 0
    for c in chunks:
        total += c["bytes"]
        if c["tier"] >= offload.GRADS:
            total += flat.get(c["chunk"], 0)
        if c["tier"] >= offload.MASTERS:
            total += master[c["chunk"]].master_bytes
        if c["tier"] >= offload.HOST:
            total += master[c["chunk"]].copy_bytes
    return total


def _plan_step(points: list[Point], items: list[Item], step_base: int,
               copy_s: Callable[[int], float], budget: float,
               grads: list[GradItem] | None, masters: list[MasterItem] | None,
               host: "HostStep | None") -> dict[str, Any]:
    n = len(points)
    live = [p.live_bytes for p in points]
    state = sum(i.nbytes for i in items)
    graph_peak = max(live, default=0)
    step_all = step_base + state
    peak_before = max(graph_peak, step_all)
    out: dict[str, Any] = {
        "unattainable": False, "reason": None,
        "budget_bytes": None if budget == float("inf") else budget,
        "state_bytes": state, "step_base_bytes": step_base, "step_bytes": step_all,
        "graph_peak_bytes": graph_peak,
        "need_bytes": max(peak_before - budget, 0) if budget != float("inf") else 0,
        "offloaded_bytes": 0, "chunks": [], "reloads": [],
        "predicted_copy_s": 0.0, "predicted_hidden_s": 0.0, "predicted_exposed_s": 0.0,
        "predicted_streamed_s": 0.0, "peak_before": peak_before, "peak_after": peak_before,
        "curve": live, "offloaded_grad_bytes": 0, "grad_sent_bytes": 0,
        "predicted_grad_copy_s": 0.0,
        "offloaded_master_bytes": 0}
    ends = list(itertools.accumulate(p.time_s for p in points))
    queue = (ends, copy_s)   # [Note: gradients on the host]'s copies out, one after another
    # the lowest peaks this pass can reach: all state off; all state and all gradients off;
    # and the masters that may go too (the lowest of all)
    grads = grads or []
    with_grads = {g.chunk for g in grads}
    masters = [m for m in masters or [] if m.chunk in with_grads]
    for key, chosen in (("lowest_state_peak_bytes", []), ("lowest_grads_peak_bytes", grads)):
        curve, step = _all_state_off(live, items, chosen, step_base, queue)
        out[key] = max(curve + [step])
    out["lowest_peak_bytes"] = min(
        max(_take_masters(live, items, grads, step_base, queue, masters, float("-inf"),
                          hosted)[1])
        for hosted in ([False, True] if host is not None and host.mode != "never" else [False]))
    if peak_before <= budget:
        return out
    # the step with nothing resident needs room for the streamed chunks
    if step_base + staging_bytes(items) > budget:
        if grads:
            return _with_grads(out, live, items, grads, step_base, queue, budget, masters, host)
        return {**out, "unattainable": True,
                "reason": f"the optimizer step needs {step_base} bytes with no optimizer state "
                          f"on the device, plus {staging_bytes(items)} to stream the state "
                          f"through it: over the budget"}
    need = max(graph_peak - budget, 0)
    chosen = select(items, need)
    while chosen is not None:   # the step must fit too (streaming needs room of its own)
        step_need = step_base + state - sum(i.nbytes for i in chosen) + staging_bytes(chosen) - budget
        if step_need <= 0:
            break
        chosen = select(items, sum(i.nbytes for i in chosen) + step_need)
    if chosen is None:
        if grads:
            return _with_grads(out, live, items, grads, step_base, queue, budget, masters, host)
        return {**out, "unattainable": True,
                "reason": f"offloading all optimizer state ({state} bytes) is not enough: the "
                          f"curve exceeds the budget by {need} bytes"}
    total = sum(i.nbytes for i in chosen)
    # R(j), the bytes back on the device after node j, may not exceed the room left at j or at
    # any later node, the step included (R only grows): suffix minimum of budget - live + total
    step_room = budget - (step_base + state - total) - staging_bytes(chosen)
    room = [0.0] * n
    acc = step_room
    for j in range(n - 1, -1, -1):
        acc = min(acc, budget - live[j] + total)
        room[j] = acc
    ends, t = [], 0.0
    for p in points:
        t += p.time_s
        ends.append(t)
    t_end = ends[-1] if ends else 0.0
    placeable = [j for j in range(n) if points[j].placeable]
    copies = [copy_s(i.nbytes) for i in chosen]
    positions: list[int] = []     # node index after which each copy starts; n: at the step
    back, earliest, hide, pick = 0, 0, -1, 0
    remaining = sum(copies)
    for it, c in zip(chosen, copies):
        back += it.nbytes
        while earliest < n and back > room[earliest]:   # room is nondecreasing, back grows
            earliest += 1
        if back > step_room:
            earliest = n                                 # only streaming at the step fits
        latest_start = t_end - remaining      # the copy stream runs the copies one by one
        remaining -= c
        while hide + 1 < len(placeable) and ends[placeable[hide + 1]] <= latest_start:
            hide += 1
        lo = max(earliest, placeable[hide] if hide >= 0 else 0, positions[-1] if positions else 0)
        while pick < len(placeable) and placeable[pick] < lo:
            pick += 1
        positions.append(placeable[pick] if pick < len(placeable) and lo < n else n)
        if positions[-1] == n:
            back -= it.nbytes   # streamed: never back before the step
    delta = [0] * (n + 1)
    for it, p in zip(chosen, positions):
        delta[p] += it.nbytes
    curve, back = [], 0
    for j in range(n):
        back += delta[j]
        curve.append(live[j] - total + back)
    streamed = [it for it, p in zip(chosen, positions) if p == n]
    step_peak = step_base + state - total + sum(delta[:n]) + staging_bytes(streamed)
    if max(curve + [step_peak]) > budget:   # cannot happen: positions respect `room`
        raise RuntimeError("deepcompile offload_optimizer: planned curve exceeds the budget")
    finish = 0.0
    for c, p in zip(copies, positions):
        if p < n:
            finish = max(ends[p], finish) + c
    exposed = max(finish - t_end, 0.0)
    streamed_s = sum(2 * c for c, p in zip(copies, positions) if p == n)   # in and out
    reloads: dict[int, dict[str, Any]] = {}
    for it, p, c in zip(chosen, positions, copies):
        if p == n:
            continue
        r = reloads.setdefault(p, {"slot": points[p].slot, "after": points[p].name,
                                   "chunks": [], "bytes": 0, "predicted_s": 0.0})
        r["chunks"].append(it.chunk)
        r["bytes"] += it.nbytes
        r["predicted_s"] += c
    in_graph = sum(c for c, p in zip(copies, positions) if p < n)
    return {**out, "offloaded_bytes": total,
            "chunks": [{"chunk": it.chunk, "tier": offload.STATE, "bytes": it.nbytes,
                        "label": it.label, "streamed": p == n}
                       for it, p in zip(chosen, positions)],
            "reloads": [reloads[p] for p in sorted(reloads)],
            "predicted_copy_s": in_graph, "predicted_exposed_s": exposed,
            "predicted_hidden_s": in_graph - exposed, "predicted_streamed_s": streamed_s,
            "peak_after": max(max(curve, default=0), step_peak), "curve": curve}


def added_s(d: dict[str, Any]) -> float:
    """The seconds a plan adds to an optimizer step, as it predicts them: copies back that
    end past the backward, chunks streamed through the step (in and out), every gradient sent
    to the host (whole: on a GPU they overlap the backward on the copy stream, so this errs
    high), and the host's step where chunks step there."""
    h = d.get("host_step") or {}
    return (d["predicted_exposed_s"] + d["predicted_streamed_s"] + d["predicted_grad_copy_s"]
            + (h.get("predicted_host_s", 0.0) if h.get("chosen") else 0.0))


OFFER_POINTS = 12   # at most this many offers (re-plans) in `offers`


def offers(points: list[Point], plan_at: Callable[[list[Point]], dict[str, Any]],
           planned: dict[str, Any]) -> list[tuple[int, float]]:
    """What memory beyond the budget would save the plan `planned` (made by `plan_at` on
    `points`), as [Note: a memory trade] reads a pass's offers: (bytes, predicted seconds saved
    per optimizer step) each, whose running sums are the graphs' peak lowered by that many
    bytes against the seconds `added_s` no longer adds. Each point plans again on the curve
    lowered by the bytes of the planned chunks, smallest first, in at most `OFFER_POINTS`
    equal counts; the offers end where a lower curve saves nothing more (the optimizer step,
    which freed graph memory does not lower, binds, or nothing is left off the device).

    Lowering the whole curve by a constant is the estimate: memory freed from activations
    lowers the peaks, which set how many chunks go, but not every node by as much, which moves
    where their copies back may start; the pass plans again on the curve measured after the
    memory is freed."""
    sizes = sorted(c["bytes"] for c in planned["chunks"])
    if planned["unattainable"] or not sizes:
        return []
    n = len(sizes)
    marks = sorted({max(1, round(n * i / OFFER_POINTS)) for i in range(1, OFFER_POINTS + 1)})
    cum = list(itertools.accumulate(sizes))
    out, before_b, before_s = [], 0, added_s(planned)
    for k in marks:
        lowered = [dataclasses.replace(p, live_bytes=p.live_bytes - cum[k - 1]) for p in points]
        d = plan_at(lowered)
        t = before_s if d["unattainable"] else added_s(d)
        out.append((cum[k - 1] - before_b, max(before_s - t, 0.0)))
        before_b, before_s = cum[k - 1], min(t, before_s)
        if not d["chunks"]:
            break
    while out and out[-1][1] <= 0:
        out.pop()
    return out


@dataclasses.dataclass
class HostStep:
    """What the plan knows of the host step ([Note: the host step] in offload/host_step.py)."""
    seconds_per_element: float   # the host's step, measured (`PassContext.host_step_rate`)
    # the device's own step, per element: the same as the host's on the CPU (the same memory
    # and kernels); 0 on a GPU, whose step reads HBM at ~100x PCIe's bandwidth
    device_seconds_per_element: float = 0.0
    mode: str = "auto"           # "auto" (the faster, or the one that fits), "always", "never"


def _with_grads(out: dict[str, Any], live: list[int], items: list[Item], grads: list[GradItem],
                step_base: int, queue: tuple[list[float], Callable[[int], float]],
                budget: float, masters: list[MasterItem] = (),
                host: HostStep | None = None) -> dict[str, Any]:
    """Tier 2: every chunk's state streamed through the step, and the gradients of as many
    chunks as the curve and the step need, earliest complete first; tier 3: with all of them
    off, the masters of as many of those chunks as still needed, in chunk order; tier 4: those
    chunks step on the host, where that is faster or where only that fits (`_host_or_stream`)."""
    state = sum(i.nbytes for i in items)
    state_of = {i.chunk: i.nbytes for i in items}
    copy_s = queue[1]

    chosen: list[GradItem] = []
    curve, step = _all_state_off(live, items, chosen, step_base, queue)
    for g in sorted(grads, key=lambda g: (g.at, g.chunk)):
        if max(curve + [step]) <= budget:
            break
        chosen.append(g)
        curve, step = _all_state_off(live, items, chosen, step_base, queue)
    gone: list[MasterItem] = []
    hosted, host_out = False, None
    if max(curve + [step]) > budget:
        gone, peaks, hosted, host_out = _host_or_stream(live, items, chosen, step_base, queue,
                                                        masters, budget, host)
        curve, step = peaks[:-1], peaks[-1]
    if max(curve + [step]) > budget:
        return {**out, "unattainable": True, "host_step": host_out,
                "reason": f"offloading all optimizer state ({state} bytes), all gradients "
                          f"({sum(g.nbytes for g in grads)} bytes) and the masters that may go "
                          f"(saving {sum(m.nbytes for m in masters)} bytes) is not enough: the "
                          f"peak stays at {max(curve + [step])} bytes"}
    tier = {g.chunk: g for g in chosen}
    master = {m.chunk: m for m in gone}
    top = offload.HOST if hosted else offload.MASTERS
    chunks = [{"chunk": c, "tier": top if c in master else
               offload.GRADS if c in tier else offload.STATE,
               "bytes": state_of.get(c, 0), "grad_bytes": tier[c].nbytes if c in tier else 0,
               "master_bytes": master[c].nbytes if c in master else 0,
               "label": tier[c].label if c in tier else next(
                   (i.label for i in items if i.chunk == c), ""),
               "streamed": not (hosted and c in master)}
              for c in sorted(set(state_of) | set(tier))]
    on_host = set(master) if hosted else set()
    sends = [nb for g in chosen for _, nb in (g.parts or [(g.at, g.nbytes)]) + g.again]
    return {**out, "offloaded_bytes": state, "chunks": chunks, "reloads": [],
            "offloaded_grad_bytes": sum(g.nbytes for g in chosen),
            # every gradient a backward makes of them goes out: one per micro-step, and one
            # per graph where two graphs use a parameter
            "grad_sent_bytes": sum(sends),
            "offloaded_master_bytes": sum(m.nbytes for m in gone),
            "predicted_streamed_s": sum(2 * copy_s(i.nbytes) for i in items
                                        if i.chunk not in on_host)
            + sum(copy_s(g.flat_bytes) for g in chosen if g.chunk not in on_host)
            + sum(2 * copy_s(m.master_bytes) for m in gone if m.chunk not in on_host),
            "predicted_grad_copy_s": sum(copy_s(nb) for nb in sends),
            "host_step": host_out,
            "peak_after": max(curve + [step]), "curve": curve}


def _host_or_stream(live: list[int], items: list[Item], chosen: list[GradItem], step_base: int,
                    queue: tuple[list[float], Callable[[int], float]],
                    masters: list[MasterItem], budget: float, host: HostStep | None
                    ) -> tuple[list[MasterItem], list[int], bool, dict | None]:
    """The masters that go (`_take_masters`), streamed through the device's step or stepped on
    the host: on the host where that is predicted faster (mode "auto") or always ("always"),
    and either way where only it fits the budget. A chunk streamed costs the step its copies in
    (state, flat gradient, master) and out (state, master), the two directions at once, plus
    the device's step; stepped on the host, the host's step plus its copy's way up (which
    overlaps the next chunk's host step but the last). Returns the masters, the curve with the
    step last, whether they step on the host, and the comparison for the report."""
    streamed = _take_masters(live, items, chosen, step_base, queue, masters, budget)
    if host is None or host.mode == "never" or not masters:
        why = "never (mode)" if host is not None and host.mode == "never" else "no master may go"
        return (*streamed, False, None if host is None else {"mode": host.mode, "chosen": False,
                                                             "why": why})
    on_host = _take_masters(live, items, chosen, step_base, queue, masters, budget, hosted=True)
    copy_s = queue[1]
    state_of = {i.chunk: i.nbytes for i in items}
    flat = {g.chunk: g.flat_bytes for g in chosen}
    gone = on_host[0]
    stream_s = sum(max(copy_s(state_of.get(m.chunk, 0) + flat.get(m.chunk, 0) + m.master_bytes),
                       copy_s(state_of.get(m.chunk, 0) + m.master_bytes))
                   + m.numel * host.device_seconds_per_element for m in gone)
    host_s = (sum(m.numel for m in gone) * host.seconds_per_element
              + max((copy_s(m.copy_bytes) for m in gone), default=0.0))
    fits_s = max(streamed[1]) <= budget
    fits_h = max(on_host[1]) <= budget
    if host.mode == "always":
        use, why = fits_h or not fits_s, "always (mode)"
    elif fits_s and fits_h:
        use = host_s <= stream_s
        why = "faster" if use else "slower"
    else:
        use = fits_h
        why = "only the host step fits" if fits_h else "only streaming fits" if fits_s else \
            "neither fits"
    report = {"mode": host.mode, "chosen": use, "why": why, "chunks": len(gone),
              "predicted_host_s": host_s, "predicted_streamed_s": stream_s,
              "host_seconds_per_element": host.seconds_per_element}
    return (*(on_host if use else streamed), use, report)


def _take_masters(live: list[int], items: list[Item], chosen: list[GradItem], step_base: int,
                  queue: tuple[list[float], Callable[[int], float]], masters: list[MasterItem],
                  budget: float, hosted: bool = False) -> tuple[list[MasterItem], list[int]]:
    """Tier 3 on top of `chosen`'s gradients: masters in chunk order, each taken only if it
    lowers the peak (a master streamed through the step adds its bytes to the step's staging,
    which can cost the step more than it saves; `hosted`: the chunk steps on the host and
    needs no staging), until the peak is within `budget`. Returns the masters taken and the
    curve with the step's peak last: `_all_state_off` with them, each candidate's curve and
    step computed from the last by its own bytes (a model's thousands of chunks times its
    thousands of points)."""
    gone: list[MasterItem] = []
    curve, step = _all_state_off(live, items, chosen, step_base, queue)
    cur = np.asarray(curve, dtype=np.int64)
    state_of = {i.chunk: i.nbytes for i in items}
    flat = {g.chunk: g.flat_bytes for g in chosen}
    staging = {c: state_of.get(c, 0) + flat.get(c, 0) for c in set(state_of) | set(flat)}
    fixed = step_base - sum(g.nbytes for g in chosen)   # the step but its masters and staging
    away = 0

    def peak(c: np.ndarray, s: int) -> int:
        return max(int(c.max()), s) if c.size else s

    for m in sorted(masters, key=lambda m: m.chunk):
        now = peak(cur, step)
        if now <= budget:
            break
        c2 = cur - (m.nbytes if m.per_point is None else np.asarray(m.per_point, dtype=np.int64))
        st2 = dict(staging)
        if m.chunk in st2:
            if hosted:
                del st2[m.chunk]
            else:
                st2[m.chunk] += m.master_bytes
        s2 = fixed - away - m.nbytes + sum(heapq.nlargest(offload.LOOKAHEAD + 1, st2.values()))
        if peak(c2, s2) < now:
            gone.append(m)
            cur, step, staging, away = c2, s2, st2, away + m.nbytes
    return gone, cur.tolist() + [step]


def _all_state_off(live: list[int], items: list[Item], chosen: list[GradItem],
                   step_base: int, queue: tuple[list[float], Callable[[int], float]],
                   masters: list[MasterItem] = (), hosted: bool = False
                   ) -> tuple[list[int], int]:
    """The curve and the step peak with every chunk's state streamed through the step and the
    gradients of `chosen` on the host. A gradient's copy out starts when the node that makes it
    ends, or when the copy before it is done (one copy stream, in the order they are made), and
    its memory leaves after the node during which that copy ends (`queue`: the points' end
    times and the cost model's copy time): on a GPU the backward can make gradients faster
    than PCIe takes them away. A later gradient of the same shard (`GradItem.again`) is a round
    trip: from its node on the device holds the sum (the profile, the accumulated gradient:
    no saving) until its copy out ends. The masters of `masters` are off the device for the
    whole step but while the step streams them (their copies stay); `hosted`: those chunks
    step on the host, and the step streams nothing of them."""
    n = len(live)
    ends, copy_s = queue
    drop = [0] * (n + 1)
    free = 0.0
    copies = sorted([(at, nb, False) for g in chosen for at, nb in g.parts or [(g.at, g.nbytes)]]
                    + [(at, nb, True) for g in chosen for at, nb in g.again])
    for at, nbytes, again in copies:
        if at >= n:
            continue   # never made inside a graph: off the device at the step only
        free = max(ends[at], free) + copy_s(nbytes)
        k = bisect.bisect_left(ends, free, lo=at)   # the node during which the copy ends
        if again:
            drop[at + 1] -= nbytes
        drop[min(k + 1, n)] += nbytes
    state = sum(i.nbytes for i in items)
    away = sum(m.nbytes for m in masters)   # at the step
    each = [m.per_point for m in masters if m.per_point is not None]
    flat_away = sum(m.nbytes for m in masters if m.per_point is None)
    curve_ = (np.asarray(live, dtype=np.int64) - state - flat_away
              - np.cumsum(np.asarray(drop[:n], dtype=np.int64)))
    if each:
        curve_ -= np.asarray(each, dtype=np.int64).sum(axis=0)
    curve = curve_.tolist()
    state_of = {i.chunk: i.nbytes for i in items}
    flat = {g.chunk: g.flat_bytes for g in chosen}
    master = {m.chunk: m.master_bytes for m in masters}
    staging = sorted((state_of.get(c, 0) + flat.get(c, 0) + master.get(c, 0)
                      for c in set(state_of) | set(flat)
                      if not (hosted and c in master)), reverse=True)
    # the masters leave and their copies stay: the device saves `nbytes` of each
    step = step_base - sum(g.nbytes for g in chosen) - away + sum(staging[:offload.LOOKAHEAD + 1])
    return curve, step
