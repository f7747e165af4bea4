"""Pass `prefetch`: asynchronous, fused parameter gathers, scheduled from the profile.

Every synchronous `allgather_param` of a partitioned graph becomes `allgather_start` (launch) and
`allgather_wait` (where the parameter is first needed). Plan, per graph, in gather order:

* fuse: a gather joins the previous group when the cost model says one collective of the
  summed bytes is cheaper than two (`cost(a + b) < cost(a) + cost(b)`: the per-collective
  latency dominates), the group stays under `MAX_FUSED_BYTES`, and the compute between the two
  uses is shorter than the newcomer's own predicted time (it would be in flight with the group
  anyway); a group is waited for where its first member is used;
* hide, within budget: the group's start moves up, node by node, until the profiled compute it
  passes covers the group's predicted collective time, and no further; it never passes a node
  where the simulated live memory (profiled live bytes + every earlier group's buffers in flight
  or gathered early + this one) would exceed the memory budget, and starts keep the order of
  their waits (collectives complete in issue order);
* a budget below the graph's insertion-only peak is unattainable: the plan says so with the
  figures and changes nothing;
* across graphs: when graph B always runs right after graph A in the recorded execution order
  (and only after A; neither is a graph whose code has several structures, of which another
  may run in another step), and B's first group could not be hidden inside B (its start is at B's
  top), that group is started at A's tail instead, moved up just far enough to cover what B
  could not hide, within the budget on A's planned memory curve (`plan_across`). B then takes
  the gathered parameters with `allgather_from_prev` ([Note: cross-graph prefetch]).

What more memory is worth to the pass (`memory_value`: activation_budget may free it, [Note: a
memory trade] in passes/activation_budget.py): the plan made again with every graph's profiled
live bytes held at lower levels, at each level where the budget stops one move fewer, and the
predicted gather time each plan leaves exposed (`offers`).

The simulation is the memory model of the profiler: the plan's predicted curve is what the
re-profile measures (up to padding of the gathered buffers). The reduce side is the pass
`bucket_reduce`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable

import torch
from torch import fx

from ..runtime import ops
from ..runtime.registry import lookup
from .context import Facts, PassContext, register_pass
from ._common import ONE_RANK
from ._common import (Collective, launch_s, NodeIndex, Step, compute_times, first_kept,
                      fused_groups, group_summary, profiled_graphs, replace_with_parts, steps_of,
                      unattainable, warn_unattainable)


MAX_FUSED_BYTES = 64 << 20
OFFER_POINTS = 16   # plans `memory_value` makes at most, one per level where the plan changes
INF = float("inf")


Gather = Collective   # a parameter gather, as the planner sees it


def plan_graph(steps: list[Step], gathers: list[Gather], cost, budget: float,
               max_fused_bytes: int = MAX_FUSED_BYTES, policy: str = "overlap",
               figure: str = "all_gather", short: list[int] | None = None) -> dict[str, Any]:
    """The prefetch plan of one graph; pure (unit-tested on synthetic graphs). `figure`: the
    cost model's figure for its gathers ([Note: a figure per group] in compiler/cost.py).
    `short`, where given, collects for each move the budget stops (a start placed one node
    earlier, a gather fused) the bytes the plan holds above the profiled live bytes where it
    stops it (the most where several nodes do): with live bytes `budget` less that at those
    nodes, the move is made (`offers`)."""
    live = [s.live_bytes for s in steps]
    if (over := unattainable(live, budget)) is not None:
        return {**over, "groups": []}
    peak_before = max(live, default=0)
    compute = compute_times(steps)
    extra = [0] * len(steps)   # bytes in flight / gathered early, per node, over the plan so far
    # Every gather not planned yet must still fit where it would run unmoved (after the node
    # before it): earlier groups may not spend that memory.
    reserve = [0] * len(steps)
    for g in gathers:
        reserve[max(g.index - 1, 0)] = max(reserve[max(g.index - 1, 0)], g.nbytes)
    c = lambda nbytes: cost.collective_s(figure, nbytes)  # noqa: E731
    host = launch_s(cost, "all_gather")

    def above(k: int, nbytes: int) -> tuple[int, int]:
        """(node, bytes the plan holds there above its live bytes) with `nbytes` more."""
        k = max(k, 0)
        return k, extra[k] + reserve[k] + nbytes

    def stops(checks) -> bool:
        """Whether the budget fails at one of `checks` ((node, bytes above its live bytes))."""
        if short is None:
            return any(live[k] + over > budget for k, over in checks)
        failing = [over for k, over in checks if live[k] + over > budget]
        if failing:
            short.append(max(failing))
        return bool(failing)

    def holds(members: list[Gather], nxt: Gather) -> bool:
        first = members[0]
        total = sum(m.nbytes for m in members)
        at = max(first.index - 1, 0)
        # the newcomer is held from the group's wait to its use, on top of the members fused
        # before it (each held from the wait to its own use); where the group's start runs if
        # it cannot move up, the whole group at once
        return not stops(itertools.chain(
            (above(j, nxt.nbytes + sum(m.nbytes for m in members[1:] if j < m.index))
             for j in range(first.index, nxt.index)),
            [(at, extra[at] + total + nxt.nbytes)]))

    groups: list[dict[str, Any]] = []
    last_start = 0
    # fuse the following gathers while the cost model favours it and memory allows
    for members in fused_groups(gathers, compute, c, max_fused_bytes, host, policy, holds):
        first = members[0]
        for m in members:   # planned now: their own checks below replace the reserve
            reserve[max(m.index - 1, 0)] = 0
        nbytes = sum(m.nbytes for m in members)
        need = c(nbytes)
        for m in members[1:]:   # fused members are gathered early: alive from the group's wait
            for j in range(first.index, m.index):
                extra[j] += m.nbytes
        # The start placed before node s adds its buffer after node s-1 (the point where the
        # start itself runs) and after every node up to the wait.
        s, hidden = first.index, 0.0
        while s > last_start and hidden < need:
            j = s - 1
            if stops([above(j, nbytes), above(j - 1, nbytes)]):
                break
            s, hidden = j, hidden + compute[j]
        for j in range(s, first.index):
            extra[j] += nbytes
        last_start = s
        groups.append({
            "members": [m.name for m in members], "pids": [m.pid for m in members],
            "start_before": steps[s].name, "wait_at": first.name, "bytes": nbytes,
            "predicted_s": need, "hidden_s": hidden, "moved_nodes": first.index - s,
            "overlaps": [steps[s].name, steps[first.index - 1].name] if s < first.index else [],
        })
    peak_after = max([live[j] + extra[j] for j in range(len(steps))] +
                     _start_points(groups, steps, live, extra), default=0)
    return {"unattainable": False, "budget_bytes": budget, "groups": groups,
            "peak_before": peak_before, "peak_after": peak_after,
            "curve": [live[j] + extra[j] for j in range(len(steps))]}


def _start_points(groups, steps, live, extra) -> list[int]:
    """Live bytes right after each start (placed between node s-1 and node s)."""
    index = {st.name: i for i, st in enumerate(steps)}
    out = []
    for g in groups:
        s = index[g["start_before"]]
        # at the very top the graph holds its inputs only: node 0's figure bounds it, and
        # extra[0] already counts this buffer
        out.append(live[0] + extra[0] if s == 0 else live[s - 1] + extra[s - 1] + g["bytes"])
    return out


def plan(ctx: PassContext) -> dict[str, Any]:
    return _plan(ctx)


def _plan(ctx: PassContext, level: float = INF, short: list[int] | None = None
          ) -> dict[str, Any]:
    """The plan, with every graph's profiled live bytes held at `level` at most (`offers`);
    `short` as `plan_graph`'s."""
    decisions: dict[str, Any] = {}
    if ctx.world_size == 1:   # a gather is a view or a cast of the local shard: nothing to hide
        return decisions
    for key, steps, calls in profiled_graphs(ctx, ops.ALLGATHER):
        steps = held_steps(steps, level)
        gathers = []
        for i, node in calls:
            entry = lookup(int(node.args[1]))
            gathers.append(Gather(node.name, i, entry.padded_numel * entry.compute_dtype.itemsize,
                                  entry.pid, str(entry.compute_dtype)))
        backward = ctx.slots[key].kind == "bw"
        decision = plan_graph(steps, gathers, ctx.cost, ctx.memory_budget, policy=ctx.fusion,
                              figure="all_gather_bw" if backward else "all_gather", short=short)
        if decision["unattainable"] and level == INF:
            warn_unattainable("prefetch", key, decision, "no prefetching")
        for g in decision["groups"]:
            g["params"] = [lookup(p).name for p in g["pids"]]
        decisions[key] = decision
    steps = {k: held_steps(steps_of(p), level) for k, p in ctx.profiles.items()}
    # a gather started for the next graph is gathered as that graph gathers; under hpz a
    # forward's and a backward's gathers differ ([Note: secondary shards] in
    # runtime/secondary.py): no start across that boundary (hsdp_zero's are alike)
    split = ctx.layout is not None and ctx.layout.secondary is not None \
        and not ctx.layout.refreshed_secondary
    for a, b in successions(ctx.order):
        if split and ctx.slots[a].kind != ctx.slots[b].kind:
            continue
        # (a graph whose code has several structures may be followed, or preceded, by another
        # graph in another step: [Note: graph structure] in compiler/families.py)
        if a in steps and b in decisions and not (ctx.slots[a].varies or ctx.slots[b].varies):
            plan_across(a, b, steps[a], steps[b], decisions, ctx.memory_budget, short)
    return decisions


def held_steps(steps: list[Step], level: float) -> list[Step]:
    """`steps` with their live bytes `level` at most."""
    if level == INF:
        return steps
    return [dataclasses.replace(s, live_bytes=min(s.live_bytes, level)) for s in steps]


def exposed_s(decisions: dict[str, Any], runs: dict[str, int]) -> float:
    """The gather time a plan leaves exposed per optimizer step, predicted: each group's time
    not hidden behind compute (a group started at the previous graph's tail: what neither graph
    hides), times its graph's runs in the step (`runs`: slot key -> runs)."""
    total = 0.0
    for key, d in decisions.items():
        exposed = sum(max(g["predicted_s"] - g["hidden_s"], 0.0) for g in d.get("groups", [])
                      if not g.get("from_prev"))
        exposed += sum(max(a["exposed_in_next_s"] - a["hidden_s"], 0.0)
                       for a in d.get("for_next", []))
        total += runs.get(key, 0) * exposed
    return total


def offers(plan_at: Callable[[float, list[int]], dict[str, Any]], runs: dict[str, int],
           level: float, budget: float) -> list[tuple[int, float]]:
    """What memory beyond the room the budget leaves is worth to the planner ([Note: a memory
    trade] in passes/activation_budget.py): `plan_at(held, short)` plans with every graph's live
    bytes held at `held` at most (a trade brings every graph's peak to the level it frees
    memory to; below it the curves may stay as they are), `level` the peak now. From the plan
    at `level` on, the next plan is made where the first move the budget stops is made (`short`
    of `plan_graph`: the plan changes nowhere between), up to `OFFER_POINTS` plans; each saves
    the exposed gather time it hides beyond the plan at `level` (`exposed_s`). Returned: the
    steps between the rooms at which these savings are the most per byte (the upper concave
    hull from no room and no saving), as (bytes, predicted seconds saved per optimizer step),
    most saved per byte first and in the order of the room they need: each run of the first
    offers sums to a room the planner was run at. Nothing over the budget or without one."""
    if budget == INF or level > budget:
        return []
    short: list[int] = []
    base = exposed_s(plan_at(level, short), runs)
    points, held = [], level
    for _ in range(OFFER_POINTS):
        held = max((budget - over for over in short if 0 <= budget - over < held), default=None)
        if held is None:
            break
        short = []
        room, saved = math.ceil(level - held), base - exposed_s(plan_at(held, short), runs)
        if points and points[-1][0] == room:   # two levels within a byte (a fractional
            points.pop()                           # budget): the plan with more room stands
        points.append((room, saved))
    hull = [(0, 0.0)]
    for room, saved in points:
        while len(hull) > 1 and ((hull[-1][1] - hull[-2][1]) * (room - hull[-1][0])
                                 <= (saved - hull[-1][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append((room, saved))
    while len(hull) > 1 and hull[-1][1] <= hull[-2][1]:
        hull.pop()
    return [(b - a, s - r) for (a, r), (b, s) in zip(hull, hull[1:])]


def memory_value(ctx: PassContext) -> list[tuple[int, float]]:
    """The gathers it would start earlier with memory beyond what the budget leaves it, from
    the agreed profiles, the recorded order and the cost model (`offers`)."""
    if ctx.memory_budget == INF or ctx.cost is None or ctx.world_size == 1:
        return []
    level = max((p.peak_bytes for p in ctx.profiles.values()), default=0)
    return offers(lambda held, short: _plan(ctx, held, short),
                  {k: ctx.order.count(k) for k in ctx.profiles}, level, ctx.memory_budget)


def successions(order: list[str]) -> list[tuple[str, str]]:
    """(A, B) pairs where, in one step's execution order, every run of A is directly followed
    by B and every run of B directly preceded by A (so a gather A starts for B is always
    taken, within the same optimizer step)."""
    pairs = []
    for b in dict.fromkeys(order):
        before = {order[i - 1] if i else None for i, k in enumerate(order) if k == b}
        if len(before) != 1 or None in before:
            continue
        (a,) = before
        after = {order[i + 1] if i + 1 < len(order) else None for i, k in enumerate(order) if k == a}
        if after == {b} and a != b:
            pairs.append((a, b))
    return pairs


def plan_across(a: str, b: str, steps_a: list[Step], steps_b: list[Step],
                decisions: dict[str, Any], budget: float, short: list[int] | None = None) -> None:
    """Move B's first group to A's tail when B could not hide it (see the module docstring);
    records the decision in both graphs' plans (`for_next` in A's, `from_prev` in B's group).
    `short` as `plan_graph`'s."""
    dec_b = decisions[b]
    if dec_b["unattainable"] or not dec_b["groups"]:
        return
    first = dec_b["groups"][0]
    need = first["predicted_s"] - first["hidden_s"]   # what B cannot hide itself
    if need <= 0 or first["start_before"] != steps_b[0].name:
        return
    live_a = [st.live_bytes for st in steps_a]   # A has no gathers of its own: its plan is empty
    dec_a = decisions.setdefault(a, unattainable(live_a, budget) or {
        "unattainable": False, "budget_bytes": budget, "groups": [],
        "peak_before": max(live_a, default=0), "peak_after": max(live_a, default=0),
        "curve": live_a})
    curve, nbytes = dec_a.get("curve"), first["bytes"]

    def stops(ks: list[int]) -> bool:
        failing = [curve[k] - live_a[k] + nbytes for k in ks if curve[k] + nbytes > budget]
        if failing and short is not None:
            short.append(max(failing))
        return bool(failing)

    if dec_a["unattainable"] or not curve or stops([len(curve) - 1]):
        return
    # The start placed before node s runs after node s-1; its buffer is alive from there on,
    # through the gap between the graphs, to its use in B (where B's plan already counts it).
    compute_a = compute_times(steps_a)
    s, hidden = len(steps_a), 0.0
    while s > 0 and hidden < need:
        j = s - 1
        if stops([j, j - 1] if j > 0 else [j]):
            break
        s, hidden = j, hidden + compute_a[j]
    first["from_prev"] = a
    dec_a.setdefault("for_next", []).append({
        "for": b, "pids": first["pids"], "params": first.get("params"), "bytes": nbytes,
        "start_before": steps_a[s].name if s < len(steps_a) else None,
        "moved_nodes": len(steps_a) - s, "hidden_s": hidden, "exposed_in_next_s": need})
    for j in range(max(s - 1, 0), len(curve)):
        curve[j] += nbytes
    dec_a["peak_after"] = max(dec_a["peak_after"], max(curve))


def apply(ctx: PassContext, decisions: dict[str, Any]) -> list[str]:
    changed = []
    for key, decision in sorted(decisions.items()):
        groups, ahead = decision["groups"], decision.get("for_next", [])
        if not groups and not ahead:
            continue
        graph = ctx.slots[key].gm.graph
        nx = NodeIndex.of(graph)
        by_name, order, index = nx.by_name, nx.order, nx.index
        # A start goes before the first non-gather node of its planned range, or right before
        # its own wait.
        gathered = {name for g in groups for name in g["members"]}
        anchors = [first_kept(order[:index[g["wait_at"]]], index[g["start_before"]], gathered,
                              by_name[g["wait_at"]]) for g in groups]
        ahead_anchors = [nx.output if a["start_before"] is None else
                         first_kept(order, index[a["start_before"]], gathered, nx.output)
                         for a in ahead]
        for g, anchor in zip(groups, anchors):
            members = [by_name[name] for name in g["members"]]
            # pids from the graph's own nodes, never from the decisions: a plan from the cache
            # was made in a process that may have numbered the parameters differently
            pids = [int(m.args[1]) for m in members]
            dtype = members[0].args[3]
            shards = [m.args[0] for m in members]
            if g.get("from_prev"):   # started by the previous graph
                with graph.inserting_before(members[0]):
                    wait = graph.call_function(ops.ALLGATHER_FROM_PREV, (shards, pids, dtype))
            else:
                with graph.inserting_before(anchor):
                    start = graph.call_function(ops.ALLGATHER_START, (shards, pids, dtype))
                start.meta["val"] = _fake_buffer(members[0], g["bytes"], dtype)
                with graph.inserting_before(members[0]):
                    wait = graph.call_function(ops.ALLGATHER_WAIT, (start, list(pids)))
            replace_with_parts(graph, wait, members)
        pid_of = ctx.registry.pid_by_name() if ahead else {}
        for a, anchor in zip(ahead, ahead_anchors):
            after = _tensor_before(graph, anchor)
            pids = [pid_of[name] for name in a["params"]]   # by name, as above
            dtype = lookup(pids[0]).compute_dtype
            with graph.inserting_before(anchor):
                node = graph.call_function(ops.ALLGATHER_FOR_NEXT, (after, pids, dtype))
            node.meta["val"] = None
        _check_order(graph)
        changed.append(key)
    return changed


def _tensor_before(graph: fx.Graph, anchor: fx.Node) -> fx.Node:
    """The last tensor-valued node before `anchor` that is not communication: the input that
    orders a start there. Never a collective or a part of one: a later pass may replace it by a
    node further down (bucket_reduce waits a reduction at the end of the graph), and the start
    would use a value defined after it."""
    node = anchor.prev
    while node.op != "root":
        if isinstance(node.meta.get("val"), torch.Tensor) and not ops.communicates(node):
            return node
        node = node.prev
    raise RuntimeError("deepcompile prefetch: no tensor value to order a cross-graph start after")


def _fake_buffer(like: fx.Node, nbytes: int, dtype: torch.dtype):
    """The static model's stand-in for the in-flight buffer a start holds (runtime-owned)."""
    val = like.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return val.new_empty((nbytes // dtype.itemsize,), dtype=dtype)


def _check_order(graph: fx.Graph) -> None:
    """Starts precede their waits, and waits come in the order of their starts."""
    starts = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.ALLGATHER_START]
    waits = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.ALLGATHER_WAIT]
    if [w.args[0] for w in waits] != starts:
        raise RuntimeError("deepcompile prefetch: waits are not in the order of their starts")
    graph.lint()


def summary(decisions: dict[str, Any]) -> list[str]:
    return group_summary(decisions, "groups", "gathers")


def auto(f: Facts) -> tuple[bool, str]:
    """`passes="auto"`: ZeRO-3 over several ranks with gathers in the graphs."""
    if f.world_size == 1:
        return False, ONE_RANK
    if f.zero_stage < 3:
        return False, f"ZeRO-{f.zero_stage}: parameters are replicated, nothing to gather"
    if not f.gathers:
        return False, "no parameter gathers in the graphs"
    return True, (f"{f.gathers} gathers in the graphs: the ones not kept become asynchronous "
                  "and fused")


register_pass("prefetch", plan, apply, __doc__.splitlines()[0], summary=summary,
              order=20, choose=auto, asynchronous=True, memory_value=memory_value,
              memory_buys="gathers started earlier")
