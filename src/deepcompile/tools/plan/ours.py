"""deepcompile's own schedule: insertion, then the passes, planned by the passes' own planners.

[Note: the passes at scale] The composed graphs (compose.py) get deepcompile's insertion: a
synchronous gather before the first use of each parameter in each graph, a synchronous reduce
right after each gradient is complete. Then each configured pass plans, in the order given,
with its real planner (`prefetch.plan_graph` / `plan_across`, `bucket_reduce.plan_graph`,
`selective_unshard.options_of` / `choose`, `offload_optimizer.plan_step`) on `Step` lists built
here from the current plan, with the memory budget and the cost model the runtime would give
them (`Setting.planner_cost`: the network model on a GPU cluster; on this machine the
runtime's own calibration): what the passes see in a run, where the profile after each pass
is measured, is here the memory model of the plan so far (`Plan.items`), so each pass plans
on the effect of the ones before. The simulation then times the plan with the measured or
modelled costs, host costs included.

Memory model of a plan (the profiler's: live bytes after each node): the persistent state
(shards, Adam state, kept parameters, accumulators), the gradient shards from where each is
complete until the step ([Note: gradient lifetime] in `Plan.grad_life`; at tier 2 only
where it is made), the step's activations
(`Node.live`), each gathered parameter from its gather (or its group's wait, where the runtime
hands it over) to its last use in the graph, a group's flat buffer from its start to its wait,
a gradient from where it is complete to its reduce (or its bucket's start), a bucket's padded
gradients and reduced shards from its start to its wait.

Time model, the lowered runtime's (compiler/lower.py: functional collectives and aten ops, no
Python op per collective): a synchronous collective is a launch and an immediate wait; a fused
group copies its members out of the `[world, sum(shard)]` buffer after the wait (a device copy;
a group of one is a view), a bucket copies its gradients in at its start (the `cat`); a kept
parameter is a graph input (the runtime's kept tensor: no copy, no bytes beyond the persistent
kept buffer); an accumulated gradient is added to its accumulator on the micro-steps that do not
reduce. Each launch costs the host `cost.launch_s(kind)` (the functional collective's C++ call).
At world size 1 nothing is communicated: a gather is the shard itself (a view) or its cast to the
compute dtype, a reduction the gradient (or its cast to the master dtype), and the passes that
schedule collectives plan nothing (`prefetch`, `bucket_reduce` and `selective_unshard` return
empty decisions there, as the runtime's do). `prefetch` and `bucket_reduce` group with the
runtime's fusion policy (`Setting.fusion`: "overlap" on a GPU, "cap" on the CPU; [Note: fusion
policy] in compiler/autoplan.py).

ZeRO-1/2: the replicas are refreshed after the optimizer step, in collectives of at most 256 MiB
copied out of their buffer; with `overlap_refresh` ([Note: deferred refresh] in
runtime/replicas.py) the refresh of the step before is in flight when the step starts (the
steady state: it was launched as the previous step updated each chunk), in the groups the pass
plans (`overlap_refresh.plan_groups`, chunks of the flat layout's size), written straight into
the replicas, and each group is waited for before the forward's first read of any member.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from ...passes import (bucket_reduce, offload_optimizer, overlap_refresh, passes_with, prefetch,
                       selective_unshard)
from ...passes._common import Step
from ...runtime import kept as _kept
from ...runtime import regather
from .compose import Graph, Model
from ...runtime import flat, offload
from .schedule import (ADAM_BYTES, GRAD_SHARD_BYTES, MASTER_BYTES, Counter, Schedule, Setting,
                       framework_event, node_host, optimizer_events)
from .schedule import async_launch_s as _launch
from .schedule import async_s, wait_s
from .simulate import Event

PASSES = ("prefetch", "bucket_reduce", "selective_unshard", "offload_optimizer",
          "overlap_refresh")
AUTO = "auto"   # passes="auto": the runtime's choice (auto_choice), its verdicts (plan.py)
# the passes whose collectives are asynchronous: a host profile measures the framework's time
# with them apart (`Setting.framework_async_s`; benchmarks/validation/host_profile.py)
ASYNC_PASSES = passes_with(asynchronous=True)
REPLICA_REFRESH_BYTES = 256 << 20   # ZeRO-1/2 replica refresh: one collective per 256 MiB


@dataclasses.dataclass
class Group:
    pids: list[int]
    start: int | None      # before node `start`; None: started by the previous graph
    wait: int              # before node `wait`
    nbytes: int
    prev_start: int | None = None   # started in the previous graph before this node (n: its end)


@dataclasses.dataclass
class Bucket:
    pids: list[int]
    start_after: int
    wait_before: int       # n: at the end of the graph
    nbytes: int            # wire bytes
    inflight: int          # wire bytes + reduced shards, held from start to wait
    accumulated: bool = False   # gradients accumulated locally: launched on the last micro-step


@dataclasses.dataclass
class Item:
    kind: str              # compute | all_gather | all_gather_start | all_gather_wait |
                           # reduce_scatter | reduce_scatter_start | reduce_scatter_wait |
                           # copy (device copy) | accumulate
    name: str
    dur: float
    host: float
    live: int
    peak: int
    ref: Any = None        # collective key (start/wait pairs), node index for compute
    label: str = ""
    nbytes: int = 0        # a collective's bytes
    group: str = "world"   # the group it runs in ([Note: layouts in the plan] in network.py)
    all_reduce: int = 0    # hsdp: bytes of the all-reduce across the groups after it


@dataclasses.dataclass
class GradOff:
    """A tier-2 chunk ([Note: gradients on the host] in runtime/offload.py): each of its shard
    gradients leaves the device right after it is complete (reduced); later micro-steps bring
    each back to add to it. Where that is follows the plan (a later pass may bucket or
    accumulate the reductions), as the runtime's `grad_to_host` op follows the node that makes
    its gradient."""
    chunk: int
    pids: list[int]
    nbytes: int            # the shard gradients
    flat_bytes: int        # the chunk's flat gradient, which the step streams in
    label: str = ""


@dataclasses.dataclass
class GradLife:
    first: dict[int, int]                    # parameter -> micro-step completing its gradient
    tier2: list[tuple[GradOff, int]]         # tier-2 chunk -> micro-step it leaves in
    # (micro-step, graph key) -> item index -> bytes of tier-2 gradients that come onto the
    # device (+) or leave it (-) from that item on (`Plan._tier2_moves`)
    moves: dict[tuple[int, str], dict[int, int]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Plan:
    s: Setting
    groups: dict[str, list[Group]] = dataclasses.field(default_factory=lambda: {"fw": [], "bw": []})
    buckets: list[Bucket] = dataclasses.field(default_factory=list)
    kept: set[int] = dataclasses.field(default_factory=set)
    accumulated: set[int] = dataclasses.field(default_factory=set)
    offloaded: int = 0                       # bytes of optimizer state off the device
    reloads: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
    # (bw node index after which, bytes, copy s) in the last micro-step
    streamed: dict[int, int] = dataclasses.field(default_factory=dict)
    # chunk -> bytes of each offloaded chunk's state that no graph brings back: streamed
    # through the step
    grads_off: list[GradOff] = dataclasses.field(default_factory=list)
    # tier 2: chunks whose shard gradients go to the host once the backward completes them
    masters_off: dict[int, int] = dataclasses.field(default_factory=dict)
    # tier 3 ([Note: masters on the host] in runtime/offload.py): chunk -> master bytes; the
    # device keeps their copies in the compute dtype, and the step streams them
    masters_saved: int = 0                   # the masters' bytes less their copies'
    # ZeRO-1/2 with overlap_refresh: per refresh group (bytes, the forward node before which
    # the first micro-step waits for it, None: after the forward)
    refresh_waits: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)
    # tier 4 ([Note: the host step]): chunk -> (elements, copy bytes) of chunks stepping on the
    # host; their masters are in `masters_saved`, not in `masters_off` (nothing is streamed)
    hosted: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    decisions: dict[str, Any] = dataclasses.field(default_factory=dict)

    # -- sizes ------------------------------------------------------------------------
    @property
    def model(self) -> Model:
        return self.s.model

    def graph(self, key: str) -> Graph:
        return self.model.fw if key == "fw" else self.model.bw

    def persistent(self) -> int:
        s = self.s
        extra = sum(s.full_bytes(s.model.params[p]) for p in self.kept)
        extra += sum(s.padded(s.model.params[p]) * MASTER_BYTES for p in self.accumulated)
        return s.persistent_bytes() + extra + s.model.base_bytes - self.offloaded \
            - self.masters_saved

    # -- the graph's items under this plan ---------------------------------------------
    def items(self, key: str, last: bool = True, m: int | None = None,
              life: GradLife | None = None) -> list[Item]:
        """The graph's items in micro-step `m` (default: the last one if `last`, else the
        first), live bytes as the profiler measures them (`life`: `grad_life()`, for callers
        that walk every micro-step)."""
        out = self._items(key, last)
        _grad_curve(self, out, key, (self.s.gas - 1 if last else 0) if m is None else m,
                    life or self.grad_life())
        return out

    def grad_life(self) -> GradLife:
        """[Note: gradient lifetime] A shard gradient exists from where it is complete (its
        reduce-scatter, its bucket's wait; at world size 1 its node or cast) in the first
        micro-step that completes it until the optimizer step (the engine's zero_grad sets
        them to None after it); a tier-2 chunk's each leave the device right after it is made.
        Per parameter and per tier-2 chunk (its last): that micro-step (`gas`: none does)."""
        gas = self.s.gas
        done = [set(reduced_at(self, self._items("bw", False), "bw")) if gas > 1 else set(),
                set(reduced_at(self, self._items("bw", True), "bw"))]
        first = {p.pid: 0 if p.pid in done[0] else gas - 1 if p.pid in done[1] else gas
                 for p in self.model.params}
        life = GradLife(first, [(g, max(first[p] for p in g.pids)) for g in self.grads_off])
        if self.grads_off:
            life.moves = self._tier2_moves()
        return life

    def _tier2_moves(self) -> dict[tuple[int, str], dict[int, int]]:
        """[Note: gradients on the host] as `offload_optimizer._all_state_off` plans them: each
        tier-2 gradient is on the device from the item that completes it (in a later micro-step:
        the sum, the host's brought back) until its copy out ends; the copies run one after
        another on the copy stream, in the order the gradients are made, and one still under
        way when its graph ends holds its memory into the next graph (the step waits for all).
        Times are the items' compute durations, as the plan's points."""
        s = self.s
        host = {p: _grad_bytes(s, p) for g in self.grads_off for p in g.pids}
        moves: dict[tuple[int, str], dict[int, int]] = {}
        t = free = 0.0
        pending: list[tuple[float, int]] = []    # (copy end, bytes) past the last graph's end
        for m in range(s.gas):
            for key in ("fw", "bw"):
                items = self._items(key, m == s.gas - 1)
                n = len(items)
                ends = []
                for it in items:
                    t += it.dur if it.kind == "compute" else 0.0
                    ends.append(t)
                d = moves.setdefault((m, key), {})
                made = sorted((j, p) for p, j in reduced_at(self, items, key).items()
                              if p in host)
                copies = [(0, end, b, False) for end, b in pending] + [
                    (j, None, host[p], True) for j, p in made]
                pending = []
                for j, end, b, new in copies:
                    if new:
                        free = max(ends[j], free) + s.cost.copy_s(b)
                        end = free
                    d[j] = d.get(j, 0) + b
                    k = bisect.bisect_left(ends, end, lo=j) + 1   # out after the node it ends in
                    if k < n:
                        d[k] = d.get(k, 0) - b
                    else:
                        pending.append((end, b))
        return moves

    def _items(self, key: str, last: bool) -> list[Item]:
        s, g = self.s, self.graph(key)
        params = s.model.params
        n = len(g.nodes)
        cost = s.cost
        grouped = {p for grp in self.groups[key] for p in grp.pids}
        # ZeRO-1 launches nothing before the last micro-step: its buckets accumulate locally;
        # so do ZeRO-3's buckets of accumulated gradients (their members accumulate alone)
        buckets = [b for b in self.buckets if key == "bw" and
                   (last or (s.stage != 1 and not b.accumulated))]
        bucketed = {p for b in buckets for p in b.pids}
        before: dict[int, list] = {}
        after: dict[int, list] = {}
        for k, grp in enumerate(self.groups[key]):
            if grp.start is not None:
                before.setdefault(grp.start, []).append(("start", k, grp))
            before.setdefault(grp.wait, []).append(("wait", k, grp))
        if key == "fw":
            for k, grp in enumerate(self.groups["bw"]):
                if grp.prev_start is not None:
                    before.setdefault(grp.prev_start, []).append(("ahead", k, grp))
        uses = g.uses if s.stage == 3 else []   # ZeRO-1/2: parameters are replicated
        for u in uses:
            if u.pid in self.kept:
                before.setdefault(u.first, []).append(("kept", u.pid, None))
            elif u.pid not in grouped:
                before.setdefault(u.first, []).append(("gather", u.pid, None))
        frees: dict[int, list[int]] = {}
        for u in uses:
            frees.setdefault(u.last, []).append(u.pid)
        use_of = {u.pid: u for u in g.uses}
        for gr in g.grads:
            if gr.pid in bucketed:
                continue
            if gr.pid in self.accumulated:
                after.setdefault(gr.at, []).append(("reduce" if last else "accumulate", gr.pid, gr))
            else:
                after.setdefault(gr.at, []).append(("reduce", gr.pid, gr))
        bucket_grads: dict[int, list] = {}
        for gr in g.grads:
            if gr.pid in bucketed:
                bucket_grads.setdefault(gr.at, []).append(gr)
        for k, b in enumerate(buckets):
            after.setdefault(b.start_after, []).append(("bstart", k, b))
            before.setdefault(b.wait_before, []).append(("bwait", k, b))

        held: dict[Any, int] = {}
        if key == "bw":   # groups the forward started for this graph are in flight
            for k, grp in enumerate(self.groups["bw"]):
                if grp.prev_start is not None:
                    held[("grp", k)] = grp.nbytes
        base = self.persistent()
        act = [0] * (n + 1)
        act[0] = 0 if key == "fw" else s.model.fw.nodes[-1].live
        for i, node in enumerate(g.nodes):
            act[i + 1] = node.live
        out: list[Item] = []
        lab = _labels(s.model, g)

        def live(i):   # bytes live now, with activations as after node i - 1
            return base + act[i] + sum(held.values())

        def emit(kind, name, dur, host, ref, i, label, peak=None, nbytes=0, figure=""):
            lv = live(i)
            extra = {}
            if figure:   # a collective: where it runs (hsdp's reductions: and across groups)
                extra["group"] = s.label_of(figure)
                if figure == "reduce_scatter" and s.layout == "hsdp":
                    extra["all_reduce"] = nbytes // s.group
            out.append(Item(kind, name, dur, host, lv, lv if peak is None else max(peak, lv),
                            ref, label, nbytes, **extra))

        ag = "all_gather_bw" if key == "bw" else "all_gather"   # the cost model's figure

        def comm_item(entry, i):
            what, k, obj = entry
            if what == "start":
                held[("grp", k)] = obj.nbytes
                emit("all_gather_start", f"ag{key}{k}", async_s(cost, ag, obj.nbytes),
                     _launch(cost, "all_gather", obj.nbytes), (key, "grp", k), i,
                     lab[min(i, n - 1)],
                     nbytes=obj.nbytes, figure=ag)
            elif what == "ahead":
                held[("ahead", k)] = obj.nbytes
                emit("all_gather_start", f"agbw{k}", async_s(cost, "all_gather_bw", obj.nbytes),
                     _launch(cost, "all_gather", obj.nbytes), ("bw", "grp", k), i,
                     lab[min(i, n - 1)],
                     nbytes=obj.nbytes, figure="all_gather_bw")
            elif what == "wait":
                held.pop(("grp", k), None)
                for p in obj.pids:
                    if p in use_of:
                        held[("param", p)] = s.gather_bytes(params[p])
                emit("all_gather_wait", f"ag{key}{k}.wait", 0.0, wait_s(cost, "all_gather"),
                     (key, "grp", k), i, lab[min(i, n - 1)])
                if len(obj.pids) > 1:
                    emit("copy", f"ag{key}{k}.copy_out", s.copy_on_device_s(obj.nbytes),
                         node_host(s, 1, False), None, i, lab[min(i, n - 1)])
            elif what == "gather" and s.world == 1:   # the shard itself, or its cast
                cast = s.csize != MASTER_BYTES
                held[("param", k)] = s.full_bytes(params[k]) if cast else 0
                if cast:
                    emit("copy", f"cast.{params[k].name}", s.cast_s(params[k].numel),
                         node_host(s, 1, False), None, i, lab[min(i, n - 1)])
            elif what == "gather":
                nb = s.gather_bytes(params[k])
                held[("param", k)] = nb
                emit("all_gather", f"ag.{params[k].name}", cost.collective_s(ag, nb),
                     cost.launch_s("all_gather"), (key, "sync", k), i, lab[min(i, n - 1)],
                     nbytes=nb, figure=ag)
            elif what == "kept":
                pass   # a graph input: the runtime's kept tensor (counted in persistent())
            elif what == "bwait":
                held.pop(("bucket", k), None)
                emit("reduce_scatter_wait", f"rs{k}.wait", 0.0, wait_s(cost, "reduce_scatter"),
                     ("bw", "bucket", k), i, lab[min(i, n - 1)])
                if len(obj.pids) > 1:   # one slice copy per member out of the reduced buffer
                    emit("copy", f"rs{k}.copy_out", s.copy_on_device_s(obj.inflight - obj.nbytes),
                         node_host(s, len(obj.pids), False), None, i, lab[min(i, n - 1)])

        for i, node in enumerate(g.nodes):
            for entry in sorted(before.get(i, []), key=_order):
                comm_item(entry, i)
            during = live(i + 1)
            for p in frees.get(i, ()):
                held.pop(("param", p), None)
            for what, k, obj in after.get(i, []):
                if what in ("reduce", "accumulate"):
                    held[("grad", k)] = obj.nbytes
            for gr in bucket_grads.get(i, ()):
                held[("grad", gr.pid)] = gr.nbytes
            emit("compute", node.name, node.time_s, node_host(s, node.kernels, False), i, i + 1,
                 lab[i], peak=during)
            for what, k, obj in after.get(i, []):
                if what == "reduce" and s.world == 1:   # the gradient, or its cast
                    held.pop(("grad", k), None)
                    if s.csize != MASTER_BYTES:
                        emit("copy", f"cast.grad.{params[k].name}", s.cast_s(params[k].numel),
                             node_host(s, 1, False), None, i + 1, lab[i])
                elif what == "reduce":
                    p = params[k]
                    nb = s.padded(p) * s.csize
                    held.pop(("grad", k), None)
                    emit("reduce_scatter", f"rs.{p.name}", cost.collective_s("reduce_scatter", nb),
                         cost.launch_s("reduce_scatter"), (key, "sync", ("rs", k)), i + 1, lab[i],
                         nbytes=nb, figure="reduce_scatter")
                elif what == "accumulate":
                    held.pop(("grad", k), None)
                    emit("accumulate", f"acc.{params[k].name}",
                         1.5 * s.copy_on_device_s(obj.nbytes),
                         node_host(s, 1, False), None, i + 1, lab[i])
                elif what == "bstart":
                    for p in obj.pids:
                        held.pop(("grad", p), None)
                    held[("bucket", k)] = obj.inflight
                    copy = s.copy_on_device_s(obj.nbytes) if len(obj.pids) > 1 else 0.0
                    emit("reduce_scatter_start", f"rs{k}",
                         async_s(cost, "reduce_scatter", obj.nbytes) + copy,
                         _launch(cost, "reduce_scatter", obj.nbytes), ("bw", "bucket", k), i + 1,
                         lab[i],
                         nbytes=obj.nbytes, figure="reduce_scatter")
        for entry in sorted(before.get(n, []), key=_order):
            comm_item(entry, n)
        return out

    def profile(self, key: str) -> tuple[list[Step], list[Item], dict[str, int]]:
        """What a profile of this graph under the plan shows the passes: one Step per item
        (compute time on compute nodes and copies; live bytes after each); the items; and,
        per step name, the node before which something placed at that step runs."""
        items = self.items(key)
        steps = [Step(it.name, "compute" if it.kind in ("copy", "accumulate") else it.kind,
                      it.dur if it.kind in ("compute", "copy", "accumulate") else 0.0, it.live)
                 for it in items]
        where: dict[str, int] = {}
        pending: list[str] = []
        for it in items:
            if it.kind == "compute":
                for name in pending:
                    where[name] = it.ref
                pending = []
                where[it.name] = it.ref
            else:
                pending.append(it.name)
        for name in pending:
            where[name] = len(self.graph(key).nodes)
        return steps, items, where

    def peak(self) -> int:
        return max((it.peak for key in ("fw", "bw") for it in self.items(key)), default=0)


def _grad_bytes(s: Setting, pid: int) -> int:
    return GRAD_SHARD_BYTES * s.shard_numel(s.model.params[pid])


def _grads_absent(plan: Plan, m: int, life: GradLife) -> int:
    """Bytes of gradient shards `persistent()` counts that are not on the device when
    micro-step `m` starts (`gas`: at the optimizer step): not yet complete, or at tier 2."""
    s = plan.s
    host = {p for g, _ in life.tier2 for p in g.pids}
    return (sum(_grad_bytes(s, p) for p, f in life.first.items()
                if p not in host and f >= m and m < s.gas)
            + sum(_grad_bytes(s, p) for p in host))


def _grad_curve(plan: Plan, items: list[Item], key: str, m: int, life: GradLife) -> None:
    """[Note: gradient lifetime] on the profiler's curve: each item's live bytes less the
    gradient shards not on the device after it. A tier-2 chunk's gradients are on the device
    from the item that makes each (a later micro-step's: the sum) until its copy out ends, as
    `offload_optimizer._all_state_off` plans it (`GradLife.moves`)."""
    delta = dict(life.moves.get((m, key), {}))   # item index -> bytes that appear (+) / leave
    if key == "bw":
        host = {p for g, _ in life.tier2 for p in g.pids}
        for p, j in reduced_at(plan, items, key).items():
            if p not in host and life.first[p] == m:
                delta[j] = delta.get(j, 0) + _grad_bytes(plan.s, p)
    adjust = -_grads_absent(plan, m, life)
    for j, it in enumerate(items):
        adjust += delta.get(j, 0)
        it.live += adjust
        it.peak += adjust


def _tier2_copies(plan: Plan, items: list[Item], key: str, m: int,
                  life: GradLife) -> dict[int, list]:
    """Item index -> the tier-2 chunks whose gradients are copied out after it in this graph,
    each with whether it is a round trip (a later micro-step's gradient added to the host's)."""
    out: dict[int, list] = {}
    if not life.tier2 or key != "bw":
        return out
    at = reduced_at(plan, items, key)
    for g, first in life.tier2:
        js = [at[p] for p in g.pids if p in at]
        if first <= m and js:
            out.setdefault(max(js), []).append((g, first < m))
    return out


def reduced_at(plan: Plan, items: list[Item], key: str) -> dict[int, int]:
    """Per parameter: the index of the item after which its gradient is complete in this
    graph (its reduce-scatter, its bucket's wait; at world size 1 the node that computes it,
    or its cast); ZeRO-1's and accumulated gradients only where they are reduced."""
    out: dict[int, int] = {}
    if key != "bw":
        return out
    g = plan.graph(key)
    by_node: dict[int, list[int]] = {}
    for gr in g.grads:
        by_node.setdefault(gr.at, []).append(gr.pid)
    names = {f"cast.grad.{p.name}": p.pid for p in plan.model.params}
    for j, it in enumerate(items):
        if it.kind == "reduce_scatter":
            out[it.ref[2][1]] = j
        elif it.kind == "reduce_scatter_wait":
            for pid in plan.buckets[it.ref[2]].pids:
                out[pid] = j
        elif plan.s.world == 1 and it.kind == "compute":
            for pid in by_node.get(it.ref, ()):
                if pid not in plan.accumulated:
                    out[pid] = j
        elif plan.s.world == 1 and it.kind == "copy" and it.name in names:
            out[names[it.name]] = j
    return out


def _order(entry) -> int:
    return {"bwait": 0, "start": 1, "ahead": 1, "wait": 2, "gather": 3, "kept": 3}[entry[0]]


def _labels(model: Model, g: Graph) -> list[str]:
    names = {0: "embed", model.layers + 1: "head"}
    tag = g.key
    return [f"{names.get(n.block, f'L{n.block - 1}')} {tag}" for n in g.nodes]


# ------------------------------------------------------------------------------- passes
def _prefetch(plan: Plan) -> dict[str, Any]:
    s = plan.s
    decisions: dict[str, Any] = {}
    steps: dict[str, list[Step]] = {}
    where: dict[str, dict[str, int]] = {}
    forced = (s.replay or {}).get("prefetch")
    members: dict[tuple[str, int], list[int]] = {}
    for key in ("bw", "fw"):     # the pipeline plans graphs in key order: g0.bw, g0.fw
        st, items, where[key] = plan.profile(key)
        steps[key] = st
        gathers = [prefetch.Gather(it.name, i, it.nbytes, it.ref[2], str(s.model.dtype))
                   for i, it in enumerate(items) if it.kind == "all_gather"]
        figure = "all_gather_bw" if key == "bw" else "all_gather"
        if forced is None:
            decisions[key] = prefetch.plan_graph(st, gathers, s.planner_cost, s.budget,
                                                 policy=s.fusion, figure=figure)
            continue
        # replay: each of the run's groups as one gather at its first member's place, placed
        # by the planner, fused with nothing else
        fused = _prefuse(gathers, forced.get(key, []), s, first=True)
        decisions[key] = prefetch.plan_graph(st, fused, s.planner_cost, s.budget,
                                             max_fused_bytes=0, policy=s.fusion, figure=figure)
        for g in fused:
            members[key, g.pid] = _MEMBERS[id(g)]
    if s.layout != "hpz":   # hpz: the backward gathers otherwise (as the runtime's pass)
        prefetch.plan_across("fw", "bw", steps["fw"], steps["bw"], decisions, s.budget)
    ahead = (decisions["fw"].get("for_next") or [None])[0]
    n_fw = len(plan.model.fw.nodes)
    for key in ("fw", "bw"):
        use = {u.pid: u for u in plan.graph(key).uses}
        for g in decisions[key].get("groups", []):
            pids = list(g["pids"])
            if forced is not None:
                pids = members[key, pids[0]]
            wait = min(use[p].first for p in pids)
            if g.get("from_prev"):
                prev = n_fw if ahead is None or ahead["start_before"] is None \
                    else where["fw"][ahead["start_before"]]
                plan.groups[key].append(Group(pids, None, wait, g["bytes"], prev_start=prev))
            else:
                plan.groups[key].append(Group(pids, where[key][g["start_before"]], wait,
                                              g["bytes"]))
    return _summary_prefetch(decisions)


def _summary_prefetch(decisions: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, d in decisions.items():
        groups = d.get("groups", [])
        out[key] = {"unattainable": d.get("unattainable", False),
                    "gathers": sum(len(g["members"]) for g in groups),
                    "groups": len(groups),
                    "hidden_s": _hidden(groups),
                    "predicted_s": sum(g["predicted_s"] for g in groups),
                    "peak_before": d.get("peak_before"), "peak_after": d.get("peak_after"),
                    "for_next": [{k: a[k] for k in ("bytes", "moved_nodes", "hidden_s")}
                                 for a in d.get("for_next", [])]}
    return out


def _hidden(groups: list[dict[str, Any]]) -> float:
    """The collectives' time hidden behind compute: each group's up to its own time (a pass
    moves a start over whole nodes, so the compute it records behind a group can exceed the
    collective's time; the runtime's summary counts it the same way, passes/_common.py)."""
    return sum(min(g["hidden_s"], g["predicted_s"]) for g in groups)


def _bucket_reduce(plan: Plan) -> dict[str, Any]:
    s = plan.s
    st, items, where = plan.profile("bw")
    reduces = []
    for i, it in enumerate(items):
        # gradients accumulated locally (selective_unshard before it: `accumulate_grad` nodes)
        # go into buckets of their own, as the runtime's pass puts them
        if it.kind == "reduce_scatter":
            p = s.model.params[it.ref[2][1]]
            reduces.append(bucket_reduce.Reduce(
                it.name, i, it.nbytes, p.pid, str(s.model.dtype),
                grad_bytes=s.full_bytes(p), shard_bytes=s.shard_numel(p) * s.csize,
                accumulated=s.stage == 3 and p.pid in plan.accumulated))
    forced = (s.replay or {}).get("bucket_reduce")
    if forced is None:
        d = bucket_reduce.plan_graph(st, reduces, s.planner_cost, s.budget, policy=s.fusion)
    else:   # replay: each of the run's buckets as one reduce at its last member's place
        fused = _prefuse(reduces, forced, s, first=False)
        d = bucket_reduce.plan_graph(st, fused, s.planner_cost, s.budget, max_bucket_bytes=0,
                                  policy=s.fusion)
        for b in d["buckets"]:
            b["pids"] = _MEMBERS[id(next(r for r in fused if r.pid == b["pids"][0]))]
    n = len(plan.model.bw.nodes)
    grad_at = {g.pid: g.at for g in plan.model.bw.grads}
    for b in d["buckets"]:
        pids = list(b["pids"])
        shards = sum(s.shard_numel(s.model.params[p]) * s.csize for p in pids)
        wait = n if b["wait_before"] is None else where[b["wait_before"]]
        plan.buckets.append(Bucket(pids, max(grad_at[p] for p in pids), wait, b["bytes"],
                                   b["bytes"] + shards, b["accumulated"]))
    return {"unattainable": d["unattainable"], "reduces": len(reduces),
            "buckets": len(d["buckets"]), "hidden_s": _hidden(d["buckets"]),
            "predicted_s": sum(b["predicted_s"] for b in d["buckets"]),
            "peak_before": d.get("peak_before"), "peak_after": d.get("peak_after")}


_MEMBERS: dict[int, list[int]] = {}   # id(pre-fused collective) -> its members' pids (replay)


def _prefuse(colls: list, groups: list[list[str]], s: Setting, first: bool) -> list:
    """A run's groups (by parameter names) as one collective each, at the first member's
    place (gathers) or the last one's (reduces); members the run did not group stay alone."""
    by_name = {s.model.params[c.pid].name: c for c in colls}
    out, taken = [], set()
    for names in groups:
        cs = sorted((by_name[n] for n in names if n in by_name), key=lambda c: c.index)
        if not cs:
            continue
        at = cs[0] if first else cs[-1]
        extra = {}
        if hasattr(at, "grad_bytes"):
            extra = {"grad_bytes": sum(c.grad_bytes for c in cs),
                     "shard_bytes": sum(c.shard_bytes for c in cs)}
        fused = dataclasses.replace(at, nbytes=sum(c.nbytes for c in cs), **extra)
        _MEMBERS[id(fused)] = [c.pid for c in cs]
        out.append(fused)
        taken |= {c.pid for c in cs}
    for c in colls:
        if c.pid not in taken:
            _MEMBERS[id(c)] = [c.pid]
            out.append(c)
    return sorted(out, key=lambda c: c.index)


@dataclasses.dataclass
class _Entry:   # what `kept.refresh_groups` reads of a registry entry
    padded_numel: int
    compute_dtype: Any


def _selective_unshard(plan: Plan) -> dict[str, Any]:
    s = plan.s
    params = s.model.params
    colls: list[selective_unshard.Collective] = []
    for key in ("fw", "bw"):
        g = plan.graph(key)
        grouped = {p for grp in plan.groups[key] for p in grp.pids}
        figure = "all_gather_bw" if key == "bw" else ""
        for grp in plan.groups[key]:
            colls.append(selective_unshard.Collective(
                "all_gather", s.gas, [(p, s.gather_bytes(params[p])) for p in grp.pids],
                figure))
        for u in g.uses:
            if u.pid not in grouped and u.pid not in plan.kept:
                colls.append(selective_unshard.Collective(
                    "all_gather", s.gas, [(u.pid, s.gather_bytes(params[u.pid]))], figure))
    bucketed = {p for b in plan.buckets for p in b.pids}
    for b in plan.buckets:
        colls.append(selective_unshard.Collective(
            "reduce_scatter", s.gas, [(p, s.padded(params[p]) * s.csize) for p in b.pids]))
    for gr in plan.model.bw.grads:
        if gr.pid not in bucketed:
            colls.append(selective_unshard.Collective(
                "reduce_scatter", s.gas, [(gr.pid, s.padded(params[gr.pid]) * s.csize)]))
    used = {p for c in colls for p, _ in c.members}
    cands = [selective_unshard.Candidate(p.pid, p.name, s.full_bytes(p),
                                         s.padded(p) * MASTER_BYTES, s.gather_bytes(p))
             for p in params if p.pid in used and s.stage == 3]
    opts = selective_unshard.options_of(cands, colls, s.planner_cost, s.gas, set())
    peak = plan.peak()
    capacity = s.budget - peak
    forced = (s.replay or {}).get("selective_unshard")
    if forced is None:
        choice = selective_unshard.choose(
            [[o["keep"]] + ([o["keep_accumulate"]] if o["keep_accumulate"] else [])
             for o in opts], capacity)
    else:   # replay the run's choice
        choice = [(1 if o["name"] in forced["accumulate"] else 0)
                  if o["name"] in forced["keep"] else None for o in opts]
    chosen = [(o, k) for o, k in zip(opts, choice) if k is not None]
    plan.kept = {o["pid"] for o, _ in chosen}
    plan.accumulated = {o["pid"] for o, k in chosen if k == 1}
    for key in ("fw", "bw"):     # kept parameters leave the fused groups (`_pull`)
        kept_groups = []
        for grp in plan.groups[key]:
            left = [p for p in grp.pids if p not in plan.kept]
            if left:
                kept_groups.append(dataclasses.replace(
                    grp, pids=left, nbytes=sum(s.gather_bytes(params[p]) for p in left)))
        plan.groups[key] = kept_groups
    kept_buckets = []
    grad_at = {g.pid: g.at for g in plan.model.bw.grads}
    for b in plan.buckets:
        # as the runtime's rewrite: the accumulated members together (two or more) in a bucket
        # of their own, one alone reduced by itself, the others left in the bucket
        together = selective_unshard.accumulated_together(b.pids, plan.accumulated) \
            if s.stage == 3 else []
        left = [p for p in b.pids if p not in plan.accumulated]
        for pids, accumulated in ((together, True), (left, b.accumulated)):
            if not pids:
                continue
            wire = sum(s.padded(params[p]) * s.csize for p in pids)
            shards = sum(s.shard_numel(params[p]) * s.csize for p in pids)
            kept_buckets.append(dataclasses.replace(
                b, pids=pids, nbytes=wire, inflight=wire + shards, accumulated=accumulated,
                start_after=max(grad_at[p] for p in pids)))
    plan.buckets = kept_buckets
    entries = [_Entry(s.padded(params[p]), s.model.dtype) for p in sorted(plan.kept)]
    refresh = [sum(e.padded_numel * _itemsize(e.compute_dtype) for e in grp)
               for grp in _kept.refresh_groups(entries)]
    plan.decisions["refresh"] = refresh
    counts = selective_unshard.predict_counts(colls, plan.kept, plan.accumulated, s.gas, refresh)
    return {"kept": len(plan.kept), "kept_bytes": sum(s.full_bytes(params[p]) for p in plan.kept),
            "accumulated": len(plan.accumulated),
            "accumulator_bytes": sum(s.padded(params[p]) * MASTER_BYTES for p in plan.accumulated),
            "capacity_bytes": capacity, "peak_before": peak,
            "saved_s": sum((o["keep_accumulate"] if k == 1 else o["keep"])[1] for o, k in chosen),
            "per_step": counts}


def _itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _movable_bytes(s: Setting) -> int:
    return ADAM_BYTES * s.shard_elems()


def _chunks(s: Setting) -> list[tuple[list[int], int, str]]:
    """The runtime's layout (runtime/flat.py): shards in flat chunks of at least CHUNK_BYTES
    master bytes, in order. Per chunk: its parameters, master bytes, first parameter's name."""
    out, pids, master = [], [], 0
    params = s.model.params
    for p in params:
        pids.append(p.pid)
        master += s.shard_numel(p) * MASTER_BYTES
        if master >= flat.CHUNK_BYTES or p is params[-1]:
            out.append((pids, master, params[pids[0]].name))
            pids, master = [], 0
    return out


def _offload(plan: Plan) -> dict[str, Any]:
    """[Note: provisional offload] in runtime/offload.py: until this pass plans, every movable
    fragment is off the device, so the passes before it planned on that curve; this plan
    puts them back and keeps on the device what fits: optimizer state first, then (tier 2)
    the gradients of the chunks the backward completes first."""
    s = plan.s
    plan.offloaded = 0     # the curve with all state and gradients on the device
    plan.reloads, plan.streamed, plan.grads_off = [], {}, []
    plan.masters_off, plan.masters_saved, plan.hosted = {}, 0, {}
    points = []
    done: dict[int, list[int]] = {}   # parameter -> the points after which its gradient is
    # complete, first (its first micro-step) and again (a later micro-step's, added to it)
    life = plan.grad_life()
    for m in range(s.gas):
        last = m == s.gas - 1
        for key in ("fw", "bw"):
            items = plan.items(key, last, m, life)   # every node of the profile, comm ops too
            for pid, j in reduced_at(plan, items, key).items():
                done.setdefault(pid, []).append(len(points) + j)
            for j, it in enumerate(items):
                compute = it.kind == "compute"
                points.append(offload_optimizer.Point(
                    f"{m}.{key}", str(it.ref) if compute else it.name, it.live,
                    it.dur if compute else 0.0, compute and last and key == "bw"))
    chunks = _chunks(s)
    states = [offload_optimizer.Item(c, master * ADAM_BYTES // MASTER_BYTES, label)
              for c, (_, master, label) in enumerate(chunks)]
    n = len(points)
    grads = [offload_optimizer.GradItem(
        c, master * GRAD_SHARD_BYTES // MASTER_BYTES, master * GRAD_SHARD_BYTES // MASTER_BYTES,
        max((done.get(pid, [n])[0] for pid in pids), default=n), label,
        [(done.get(pid, [n])[0], _grad_bytes(s, pid)) for pid in pids],
        sorted((j, _grad_bytes(s, pid)) for pid in pids for j in done.get(pid, [])[1:]))
        for c, (pids, master, label) in enumerate(chunks)]
    step_base = (MASTER_BYTES + GRAD_SHARD_BYTES) * s.shard_elems()
    # tier 3: at ZeRO-3 under a compute dtype narrower than the masters' (the runtime's
    # `Offloader.master_saving`); on a GPU the saving holds at every point
    masters = [offload_optimizer.MasterItem(c, master - master * s.csize // MASTER_BYTES, master,
                                            label, numel=master // MASTER_BYTES,
                                            copy_bytes=master // MASTER_BYTES * s.csize)
               for c, (_, master, label) in enumerate(chunks)] \
        if s.stage == 3 and s.csize < MASTER_BYTES else []
    # tier 4: the host's step at the assumed rate; a GPU's own step is not counted against it
    # (HBM is ~100x PCIe); no host step on a CPU network (one memory: nothing to plan)
    ns = getattr(s.cost, "host_step_ns", 0.0)
    host = offload_optimizer.HostStep(ns * 1e-9) if ns > 0 and masters else None
    d = offload_optimizer.plan_step(points, states, step_base, s.planner_cost.copy_s, s.budget,
                                    grads=grads, masters=masters, host=host)
    if not d["unattainable"] and d["chunks"]:
        plan.offloaded = d["offloaded_bytes"]
        plan.reloads = [(int(r["after"]), r["bytes"], r["predicted_s"]) for r in d["reloads"]]
        plan.streamed = {c["chunk"]: c["bytes"] for c in d["chunks"] if c["streamed"]}
        for c in d["chunks"]:
            g = grads[c["chunk"]]
            if c["tier"] >= offload.GRADS:
                plan.grads_off.append(GradOff(g.chunk, chunks[g.chunk][0], g.nbytes,
                                              g.flat_bytes, g.label))
            if c["tier"] == offload.MASTERS:
                plan.masters_off[c["chunk"]] = chunks[c["chunk"]][1]
            if c["tier"] == offload.HOST:
                m = masters[c["chunk"]]
                plan.hosted[c["chunk"]] = (m.numel, m.copy_bytes)
            if c["tier"] >= offload.MASTERS:
                plan.masters_saved += c["master_bytes"]
    return {k: d[k] for k in ("unattainable", "reason", "offloaded_bytes", "state_bytes",
                              "need_bytes", "predicted_copy_s", "predicted_exposed_s",
                              "predicted_streamed_s", "peak_before", "peak_after",
                              "offloaded_grad_bytes", "predicted_grad_copy_s",
                              "offloaded_master_bytes", "lowest_state_peak_bytes",
                              "lowest_grads_peak_bytes", "lowest_peak_bytes", "host_bytes")} | {
        "host_step": d.get("host_step"), "stepped_on_host": len(plan.hosted)}


def _overlap_refresh(plan: Plan) -> dict[str, Any]:
    """The refresh's groups (the runtime pass's `plan_groups`) and where the first forward
    waits for each: (bytes, first-read node or None) in `plan.refresh_waits`."""
    s = plan.s
    if s.stage == 3:
        return {"skipped": "ZeRO-3: no replicated parameters"}
    fw = s.model.fw
    before, t = [], 0.0
    for node in fw.nodes:
        before.append(t)
        t += node.time_s
    first = {u.pid: u.first for u in fw.uses}
    chunk_bytes = flat.chunk_bytes_for(MASTER_BYTES * s.shard_elems())
    members, size, chunk = [], 0, 0
    for p in s.model.params:   # the flat layout's chunks: runs of shards in parameter order
        nb = MASTER_BYTES * s.shard_numel(p)
        if size and size + nb > chunk_bytes:
            chunk, size = chunk + 1, 0
        size += nb
        at = first.get(p.pid)
        members.append(overlap_refresh.Member(p.name, p.pid, s.gather_bytes(p), str(s.model.dtype),
                                              chunk, None if at is None else before[at]))
    groups = overlap_refresh.plan_groups(members, s.planner_cost, s.fusion, t)
    by_name = {m.name: m for m in members}
    plan.refresh_waits = [
        (g["bytes"], min((first[by_name[n].pid] for n in g["params"] if by_name[n].pid in first),
                         default=None)) for g in groups]
    plan.decisions.pop("refresh", None)
    return {"groups": len(groups), "bytes": sum(g["bytes"] for g in groups),
            "refresh_s": sum(g["predicted_s"] for g in groups),
            "exposed_s": overlap_refresh.exposed(groups, t), "forward_s": t}


_RUN = {"prefetch": _prefetch, "bucket_reduce": _bucket_reduce,
        "selective_unshard": _selective_unshard, "offload_optimizer": _offload,
        "overlap_refresh": _overlap_refresh}


def plan(s: Setting, passes: tuple[str, ...]) -> Plan:
    unknown = [p for p in passes if p not in _RUN]
    if unknown:
        raise ValueError(f"deepcompile plan: unknown pass(es) {', '.join(unknown)}; "
                         f"known: {', '.join(PASSES)}")
    _MEMBERS.clear()
    pl = Plan(s)
    if s.stage < 3:
        # ZeRO-1 keeps gradients locally until the last micro-step; after the optimizer step
        # the updated shards are gathered into the replicas, 256 MiB per collective
        if s.stage == 1 and s.gas > 1:
            pl.accumulated = {p.pid for p in s.model.params}
        entries = [_Entry(s.padded(p), s.model.dtype) for p in s.model.params]
        pl.decisions["refresh"] = [sum(e.padded_numel * _itemsize(e.compute_dtype) for e in grp)
                                   for grp in regather.groups(entries, REPLICA_REFRESH_BYTES)]
        passes = tuple(p for p in passes if p in ("bucket_reduce", "overlap_refresh"))
    if s.world == 1:
        # nothing is communicated: the passes that schedule collectives plan nothing (theirs
        # return empty decisions at world size 1); ZeRO-1 does not defer a reduction
        for name in passes:
            if name != "offload_optimizer":
                pl.decisions[name] = {"skipped": "world size 1: nothing is communicated"}
        passes = tuple(p for p in passes if p == "offload_optimizer")
        pl.accumulated = set()
    if "offload_optimizer" in passes:
        pl.offloaded = _movable_bytes(s)   # provisional (see _offload)
    for name in passes:
        pl.decisions[name] = _RUN[name](pl)
    return pl


def auto_choice(s: Setting) -> tuple[list[str], dict[str, str]]:
    """The passes `passes="auto"` runs, in order, asked by the runtime's own rule
    (`compiler.autoplan.choose`) with the facts the planner has: the world size, the ZeRO
    stage, the peak of the insertion-only plan (its first profile), every parameter gathered
    (ZeRO-3) and reduced once, casts where the compute dtype is narrower than the masters', and
    the optimizer step's bytes with all state on the device (`OffloadStore.step_bytes`: shards,
    gradient shards, Adam's moments, and one state tensor per parameter of foreach temporaries
    on a GPU, the largest one on the CPU). Returns (chosen, left out with the reason)."""
    from ...compiler import autoplan
    from ...passes import Facts

    peak = plan(s, ()).peak()
    elems = s.shard_elems()
    largest = max((s.shard_numel(p) for p in s.model.params), default=0) * 4
    work = 4 * elems if s.fusion == "overlap" else largest   # GPU foreach / CPU loop
    n = len(s.model.params)
    facts = Facts(world_size=s.world, zero_stage=s.stage, memory_budget=s.budget,
                  peak_bytes=peak, gathers=n if s.stage == 3 else 0, reduces=n,
                  casts=n if s.world == 1 and s.stage == 3 and s.csize < MASTER_BYTES else 0,
                  step_bytes=(MASTER_BYTES + GRAD_SHARD_BYTES + ADAM_BYTES) * elems + work,
                  replica_bytes=sum(s.gather_bytes(p) for p in s.model.params)
                  if s.stage < 3 and s.world > 1 else 0)
    chosen, out = autoplan.choose(facts)
    left = {c.name: c.reason for c in out}
    left.update({c.name: f"chosen ({c.reason}), but not modelled by this planner"
                 for c in chosen if c.name not in _RUN})
    return [c.name for c in chosen if c.name in _RUN], left


# ------------------------------------------------------------------------------ events
def schedule(s: Setting, passes: tuple[str, ...], name: str, description: str) -> Schedule:
    """One optimizer step of deepcompile with `passes`, as simulator events."""
    if s.framework_async_s is not None and s.world > 1 and set(ASYNC_PASSES) & set(passes):
        # the framework's time with async collectives, measured apart (host.py)
        s = dataclasses.replace(s, framework_s=s.framework_async_s)
    pl = plan(s, passes)
    events: list[Event] = []
    counter = Counter()
    cid = [0]
    # [Note: offload in the simulation] runtime/offload.py: the chunks a backward brings back
    # leave the device after the optimizer step, overlapping the next forward (steady state:
    # at the start of this one, on the "d2h" lane); the streamed ones never stay on the device:
    # the step copies them in (the next one's copy running while one steps), steps and copies
    # them out, holding at most two of them (`staging_bytes`). Modelled as one copy
    # in of all their bytes that the optimizer step waits for (PCIe is full duplex: the copies
    # out run beside it), the step's memory as what is resident, what came back, and the staging.
    # Copies to the host and to the device have a lane each ("d2h", "h2d": the runtime's two
    # copy streams), so the copy out at the start of a step does not hold up the reloads.
    reloaded = sum(r[1] for r in pl.reloads)
    if reloaded:
        cid[0] += 1
        events.append(Event("start", "offload state", s.cost.copy_s(reloaded), 0.0, cid[0],
                            "d2h", pl.persistent(), label="offload"))
    # Tier 2 ([Note: gradients on the host]): a chunk's gradients go out on the "d2h" lane
    # once the backward completes them, one `grad_to_host` op per parameter (an eager op's
    # host time each); a later micro-step's gradient comes back, is added to, and goes out
    # again, the compute waiting for the copy back; the step waits for every copy out.
    reload_ids: list[int] = []
    back = 0
    life = pl.grad_life()
    # overlap_refresh: the refresh the previous step launched is in flight as this one starts,
    # each group waited for before the first forward's first read of any of its members
    refresh_at: dict[int, list[int]] = {}
    for k, (nb, at) in enumerate(pl.refresh_waits):
        cid[0] += 1
        events.append(Event("start", f"refresh {k}", s.cost.collective_s("all_gather", nb),
                            s.cost.launch_s("all_gather"), cid[0], "comm", pl.persistent(),
                            label="all_gather"))
        counter.add("all_gather", nb)
        refresh_at.setdefault(len(s.model.fw.nodes) if at is None else at, []).append(cid[0])
    for m in range(s.gas):
        last = m == s.gas - 1
        ids: dict[Any, int] = {}           # one micro-step: a forward may start a backward group
        if s.framework_s:
            events.append(framework_event(s, pl.persistent() - _grads_absent(pl, m, life)))
        for key in ("fw", "bw"):
            reload_at = {r[0]: r for r in pl.reloads} if (last and key == "bw") else {}
            items = pl.items(key, last, m, life)
            grads_at = _tier2_copies(pl, items, key, m, life)
            waits = refresh_at if m == 0 and key == "fw" else {}
            for j, it in enumerate(items):
                if waits and it.kind == "compute":
                    for c in waits.pop(it.ref, ()):
                        events.append(Event("wait", "refresh.wait", cid=c, live=it.live))
                _events_of(it, ids, cid, events, counter, back)
                if waits and j == len(items) - 1:   # groups no node reads: after the forward
                    for c in [c for cs in waits.values() for c in cs]:
                        events.append(Event("wait", "refresh.wait", cid=c, live=it.live))
                    waits.clear()
                if it.kind == "compute" and it.ref in reload_at:
                    _, nb, c = reload_at[it.ref]
                    back += nb
                    cid[0] += 1
                    reload_ids.append(cid[0])
                    events.append(Event("start", "reload state", c, 0.0, cid[0], "h2d",
                                        it.live + back, label="offload"))
                for g, again in grads_at.get(j, ()):
                    host = node_host(s, len(g.pids), True)
                    if again:
                        cid[0] += 1
                        events.append(Event("start", f"grads back {g.label}",
                                            s.cost.copy_s(g.nbytes), host, cid[0], "h2d",
                                            it.live + back, label="offload"))
                        events.append(Event("wait", f"grads back {g.label}.wait", cid=cid[0],
                                            live=it.live + back))
                        host = 0.0
                    cid[0] += 1
                    reload_ids.append(cid[0])
                    events.append(Event("start", f"grads to host {g.label}",
                                        s.cost.copy_s(g.nbytes), host, cid[0], "d2h",
                                        it.live + back, label="offload"))
    # a streamed chunk brings its state, at tier 2 its flat gradient, at tier 3 its master,
    # onto the device
    staged = dict(pl.streamed)
    for g in pl.grads_off:
        if g.chunk not in pl.hosted:   # tier 4 streams nothing
            staged[g.chunk] = staged.get(g.chunk, 0) + g.flat_bytes
    for c, nb in pl.masters_off.items():
        staged[c] = staged.get(c, 0) + nb
    staging = offload_optimizer.staging_bytes(
        [offload_optimizer.Item(c, b) for c, b in staged.items()])
    live = pl.persistent() - _grads_absent(pl, s.gas, life) + back + staging
    if staged:
        cid[0] += 1
        reload_ids.append(cid[0])
        events.append(Event("start", "stream state", s.cost.copy_s(sum(staged.values())), 0.0,
                            cid[0], "h2d", live, label="offload"))
    for c in reload_ids:
        events.append(Event("wait", "reload wait", cid=c, lane="h2d", live=live))
    hosted = sum(n for n, _ in pl.hosted.values())
    events += optimizer_events(s, live, share=1.0 - hosted / max(s.shard_elems(), 1))
    if pl.hosted:
        # [Note: the host step]: the host steps the tier-4 chunks one by one after queuing the
        # device's step, each chunk's copy going up while the next steps: the last one's copy
        # is what the next forward waits for beyond the host's time
        cid[0] += 1
        events.append(Event("start", "host step", s.cost.copy_s(max(
            b for _, b in pl.hosted.values())), hosted * s.cost.host_step_ns * 1e-9, cid[0],
            "h2d", live, label="offload"))
        events.append(Event("wait", "host step.wait", cid=cid[0], lane="h2d", live=live))
    for nb in pl.decisions.get("refresh", []):
        if s.world == 1:   # the shards cast and copied into the replicas: no collective
            events.append(Event("compute", "refresh copy-out", s.copy_on_device_s(nb), 0.0,
                                live=live, label="refresh"))
            continue
        cid[0] += 1
        events.append(Event("start", "refresh kept", s.cost.collective_s("all_gather", nb),
                            s.cost.launch_s("all_gather"), cid[0], "comm", live + nb,
                            label="all_gather"))
        events.append(Event("wait", "refresh kept.wait", cid=cid[0], live=live + nb))
        events.append(Event("compute", "refresh copy-out", s.copy_on_device_s(nb), 0.0,
                            live=live, label="refresh"))
        counter.add("all_gather", nb, group=s.label_of("all_gather"))
    decisions = {k: v for k, v in pl.decisions.items() if k != "refresh"}
    return Schedule(name, description, events, counter.counts, decisions,
                    group_bytes=counter.groups)


def _events_of(it: Item, ids: dict, cid: list, events: list[Event], counter: Counter,
               back: int) -> None:
    k = it.kind
    live, peak = it.live + back, it.peak + back
    if k in ("compute", "copy", "accumulate"):
        events.append(Event("compute", it.name, it.dur, it.host, live=live, peak=peak,
                            label=it.label))
    elif k in ("all_gather", "reduce_scatter"):
        cid[0] += 1
        events.append(Event("start", it.name, it.dur, it.host, cid[0], "comm", live, label=k))
        events.append(Event("wait", it.name + ".wait", cid=cid[0], live=live))
        counter.add(k, it.nbytes, group=it.group)
    elif k.endswith("_start"):
        cid[0] += 1
        ids[it.ref] = cid[0]
        kind = k.removesuffix("_start")
        events.append(Event("start", it.name, it.dur, it.host, cid[0], "comm", live, label=kind))
        counter.add(kind, it.nbytes, group=it.group)
    elif k.endswith("_wait"):
        events.append(Event("wait", it.name, host_s=it.host, cid=ids[it.ref], live=live))
    else:
        raise ValueError(f"unknown item kind {k!r}")
    if it.all_reduce:
        counter.add("all_reduce", it.all_reduce, group="inter")
