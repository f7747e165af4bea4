"""Pass `bucket_reduce`: asynchronous, bucketed gradient reduce-scatters, scheduled from the profile.

Every synchronous `reduce_grad` of a partitioned backward graph becomes part of a bucket: one
`reduce_start` (launched right after the bucket's last gradient is produced) and one
`reduce_wait` (which hands each parameter its shard gradient). Plan, per graph, in the order the
gradients are produced:

* bucket: a gradient joins the current bucket when the cost model says one collective of the
  summed bytes is cheaper than two (`cost(a + b) < cost(a) + cost(b)`), the bucket stays under
  `MAX_BUCKET_BYTES`, the compute between the bucket's first gradient and the newcomer is shorter
  than the newcomer's own predicted time (the first members are not held back longer than one
  collective would take), and holding the earlier members' gradients until then fits the budget;
* hide, within budget: the wait moves down from the start, node by node, until the profiled
  compute it passes covers the bucket's predicted time, and no further (the bucket's buffers are
  memory the step holds until the wait); it never passes a node where the simulated live memory
  (profiled live bytes + every bucket in flight + this one) would exceed the budget; the last
  possible place is the end of the graph, so every shard gradient is ready when the graph
  returns, before the optimizer can need it;
* a budget below the graph's insertion-only peak is unattainable: the plan says so and changes
  nothing.

Gradients `selective_unshard` accumulates locally (`accumulate_grad`: reduced once per
accumulation window, on its last micro-step) are bucketed the same way, in buckets of their own
(`accumulate_start` / `reduce_wait`): on the last micro-step a bucket is one reduce-scatter of
its accumulators instead of one per parameter (the host's launches per step do not grow with the
number of parameters), on the others it adds each gradient into its accumulator.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import fx

from ..runtime import ops
from ..runtime.registry import lookup
from .context import Facts, PassContext, register_pass
from ._common import ONE_RANK
from ._common import (Collective, launch_s, NodeIndex, Step, compute_times, first_kept,
                      fused_groups, group_summary, profiled_graphs, replace_with_parts,
                      unattainable, warn_unattainable)


MAX_BUCKET_BYTES = 64 << 20


@dataclasses.dataclass
class Reduce(Collective):
    """A gradient reduce-scatter; `nbytes` is the padded gradient in the reduce dtype."""
    grad_bytes: int = 0    # bytes of the gradient itself, held while its bucket fills
    shard_bytes: int = 0   # bytes of the reduced shard this rank keeps while in flight
    accumulated: bool = False   # an `accumulate_grad`: never in a bucket with a `reduce_grad`


def plan_graph(steps: list[Step], reduces: list[Reduce], cost, budget: float,
               max_bucket_bytes: int = MAX_BUCKET_BYTES, policy: str = "overlap") -> dict[str, Any]:
    """The bucket plan of one graph; pure (unit-tested on synthetic graphs)."""
    n = len(steps)
    live = [s.live_bytes for s in steps]
    if (over := unattainable(live, budget)) is not None:
        return {**over, "buckets": []}
    peak_before = max(live, default=0)
    compute = compute_times(steps)
    extra = [0] * n
    c = lambda nbytes: cost.collective_s("reduce_scatter", nbytes)  # noqa: E731
    host = launch_s(cost, "reduce_scatter")

    def fits(lo: int, hi: int, nbytes: int) -> bool:
        return all(live[j] + extra[j] + nbytes <= budget for j in range(lo, hi))

    def holds(members: list[Reduce], nxt: Reduce) -> bool:
        first = members[0]
        # the members' gradients stay alive from where each was produced to the newcomer
        held = [(m.index, m.grad_bytes) for m in members]
        return (nxt.accumulated == first.accumulated
                and all(live[j] + extra[j] + sum(b for i, b in held if i <= j) <= budget
                        for j in range(first.index, nxt.index)))

    buckets: list[dict[str, Any]] = []
    for members in fused_groups(reduces, compute, c, max_bucket_bytes, host, policy, holds):
        last = members[-1]
        for m in members[:-1]:
            for j in range(m.index, last.index):
                extra[j] += m.grad_bytes
        nbytes = sum(m.nbytes + m.shard_bytes for m in members)
        need = c(sum(m.nbytes for m in members))
        # The start runs right after the last member's node; the wait goes before node w.
        w, hidden = last.index + 1, 0.0
        while w < n and hidden < need and fits(w, w + 1, nbytes):
            hidden += compute[w]
            w += 1
        for j in range(last.index + 1, w):
            extra[j] += nbytes
        buckets.append({
            "members": [m.name for m in members], "pids": [m.pid for m in members],
            "accumulated": members[0].accumulated,
            "start_after": last.name, "wait_before": steps[w].name if w < n else None,
            "bytes": sum(m.nbytes for m in members), "predicted_s": need, "hidden_s": hidden,
            "overlaps": [steps[last.index + 1].name, steps[w - 1].name] if w > last.index + 1
            else [],
        })
    peak_after = max((live[j] + extra[j] for j in range(n)), default=0)
    return {"unattainable": False, "budget_bytes": budget, "buckets": buckets,
            "peak_before": peak_before, "peak_after": peak_after}


def _nbytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def plan(ctx: PassContext) -> dict[str, Any]:
    decisions: dict[str, Any] = {}
    if ctx.world_size == 1:   # a reduction is a cast of the local gradient: nothing to bucket
        return decisions
    for key, steps, calls in profiled_graphs(ctx, (ops.REDUCE_GRAD, ops.ACCUMULATE_GRAD)):
        reduces = []
        for i, node in calls:
            if _used_in_graph(node):   # its value is needed before any later wait: stays
                continue
            entry = lookup(int(node.args[1]))
            size = entry.reduce_dtype.itemsize
            reduces.append(Reduce(node.name, i, entry.padded_numel * size, entry.pid,
                                  str(entry.reduce_dtype),
                                  grad_bytes=_nbytes(node.args[0].meta.get("val")),
                                  shard_bytes=entry.shard.numel() * size,
                                  accumulated=node.target is ops.ACCUMULATE_GRAD))
        decision = plan_graph(steps, reduces, ctx.cost, ctx.memory_budget, policy=ctx.fusion)
        if decision["unattainable"]:
            warn_unattainable("bucket_reduce", key, decision, "reduce-scatters stay synchronous")
        for b in decision["buckets"]:
            b["params"] = [lookup(p).name for p in b["pids"]]
        decisions[key] = decision
    return decisions


def apply(ctx: PassContext, decisions: dict[str, Any]) -> list[str]:
    changed = []
    for key, decision in sorted(decisions.items()):
        buckets = decision["buckets"]
        if not buckets:
            continue
        graph = ctx.slots[key].gm.graph
        nx = NodeIndex.of(graph)
        # A wait goes before the first node of its planned place that is not itself a reduce
        # being replaced.
        bucketed = {name for b in buckets for name in b["members"]}
        anchors = [first_kept(nx.order, len(nx.order) if b["wait_before"] is None
                              else nx.index[b["wait_before"]], bucketed, nx.output)
                   for b in buckets]
        for b, anchor in zip(buckets, anchors):
            members = [nx.by_name[name] for name in b["members"]]
            used = [m.name for m in members if _used_in_graph(m)]
            if used:
                raise RuntimeError(f"deepcompile bucket_reduce: {key}: the plan buckets "
                                   f"{used}, whose values the graph uses before the end; the "
                                   "plan was made for another graph")
            # pids from the graph's own nodes (a cached plan's may be another process's)
            pids = [int(m.args[1]) for m in members]
            args = ([m.args[0] for m in members], pids)
            shards = [ops.reduce_grad_shard(m) for m in members]
            if any(sh is not None for sh in shards):   # ZeRO-1: the gradients' owners
                if any(sh is None for sh in shards):
                    raise RuntimeError(f"deepcompile bucket_reduce: {key}: a bucket mixes "
                                       "reductions with and without their shards")
                args += (shards,)
            accumulated = {m.target is ops.ACCUMULATE_GRAD for m in members}
            if len(accumulated) > 1:
                raise RuntimeError(f"deepcompile bucket_reduce: {key}: a bucket mixes gradients "
                                   "accumulated locally with gradients reduced every micro-step")
            marker = ops.ACCUMULATE_START if accumulated.pop() else ops.REDUCE_START
            with graph.inserting_after(nx.by_name[b["start_after"]]):
                start = graph.call_function(marker, args)
            start.meta["val"] = _fake_in_flight(members)
            with graph.inserting_before(anchor):
                wait = graph.call_function(ops.REDUCE_WAIT, (start, list(pids)))
            replace_with_parts(graph, wait, members)
        graph.lint()
        changed.append(key)
    return changed


def _used_in_graph(node: fx.Node) -> bool:
    """A node other than the output uses the reduction's value: the wait could not move past it
    (a follower, ops.FOLLOWERS, moves with it)."""
    return any(u.op != "output" and u.target not in ops.FOLLOWERS for u in node.users)


def _fake_in_flight(members: list[fx.Node]):
    """The static model's stand-in for what a bucket holds in flight: its padded input in the
    reduce dtype and this rank's reduced slice (runtime-owned until the wait)."""
    val = members[0].args[0].meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    entries = [lookup(int(m.args[1])) for m in members]
    numel = sum(e.padded_numel + e.shard.numel() for e in entries)
    return val.new_empty((numel,), dtype=entries[0].reduce_dtype)


def summary(decisions: dict[str, Any]) -> list[str]:
    lines = group_summary(decisions, "buckets", "reduce-scatters")
    acc = [b for d in decisions.values() if isinstance(d, dict) for b in d.get("buckets", [])
           if b.get("accumulated")]
    if acc and lines:
        n = sum(len(b["members"]) for b in acc)
        lines.insert(1, f"of which {len(acc)} buckets of {n} accumulated gradients: launched "
                        "once per optimizer step (the window's last micro-step), not per run")
    return lines


def auto(f: Facts) -> tuple[bool, str]:
    """`passes="auto"`: several ranks with gradient reductions in the graphs."""
    if f.world_size == 1:
        return False, ONE_RANK
    if not f.reduces:
        return False, "no gradient reductions in the graphs"
    return True, f"{f.reduces} gradient reductions: bucketed and asynchronous"


register_pass("bucket_reduce", plan, apply, __doc__.splitlines()[0], summary=summary,
              order=30, choose=auto, asynchronous=True)
