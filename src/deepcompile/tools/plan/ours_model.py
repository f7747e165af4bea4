"""deepcompile's plan of one step at scale (`Plan`: what the passes decided) and its items: each
graph's compute, collectives and copies in order, with their times and live bytes, on which the
passes plan (ours_passes.py) and which the simulation runs (ours.py).

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
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from ...passes._common import Step
from ...passes.activation_budget import HOST_OP_S
from .compose import Graph, Model
from .schedule import GRAD_SHARD_BYTES, MASTER_BYTES, Setting, node_host
from .schedule import async_launch_s as _launch
from .schedule import async_s, wait_s


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


# items the device runs as compute (a profile's compute steps; the compute lane's events)
ON_DEVICE = ("copy", "accumulate", "recompute")


@dataclasses.dataclass
class ActMove:
    """A saved activation `activation_budget` recomputes or offloads ([Note: activations at
    scale] in ours_activations.py). Positions are node indices of the composed graphs."""
    name: str
    action: str            # "recompute" | "offload"
    nbytes: int
    fw_free: int           # the forward node after which it leaves the device
    first: int             # its first backward reader
    last: int              # its last backward reader
    reload: int | None     # offload: the backward node after which its copy back starts
                           # (-1: at the top of the backward)
    time_s: float          # recompute: its nodes' time; offload: one copy's
    extra: int = 0         # recompute: what its intermediates hold beyond the value

    @property
    def back(self) -> int:
        """The first index of the backward's live-bytes array (after node `back - 1`) that
        holds it again."""
        return self.first + 1 if self.action == "recompute" else self.reload + 1


@dataclasses.dataclass
class Item:
    kind: str              # compute | all_gather | all_gather_start | all_gather_wait |
                           # reduce_scatter | reduce_scatter_start | reduce_scatter_wait |
                           # copy (device copy) | accumulate | recompute |
                           # d2h_start | h2d_start | h2d_wait (activation copies)
    name: str
    dur: float
    host: float
    live: int
    peak: int
    ref: Any = None        # collective key (start/wait pairs), node index for compute
    label: str = ""
    nbytes: int = 0        # a collective's bytes
    group: str = "world"   # the group it runs in ([Note: layouts in the plan] in network.py)
    all_reduce: int = 0    # hsdp: bytes of the all-reduce across the groups after it (hsdp_zero:
                           # of the reduce-scatter, `across`)
    across: str = "all_reduce"


@dataclasses.dataclass
class GradOff:
    """A tier-2 chunk ([Note: gradients on the host] in runtime/offload/grads.py): each of its shard
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


class _Held(dict):
    """Bytes held, by what holds them, and their sum as they change (read at every node)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __setitem__(self, key: Any, nbytes: int) -> None:
        self.total += nbytes - self.get(key, 0)
        super().__setitem__(key, nbytes)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self.total -= self[key]
        return super().pop(key, *default)


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
    # tier 3 ([Note: masters on the host] in runtime/offload/masters.py): chunk -> master bytes; the
    # device keeps their copies in the compute dtype, and the step streams them
    masters_saved: int = 0                   # the masters' bytes less their copies'
    # ZeRO-1/2 with overlap_refresh: per refresh group (bytes, the forward node before which
    # the first micro-step waits for it, None: after the forward)
    refresh_waits: list[tuple[int, int | None]] = dataclasses.field(default_factory=list)
    # tier 4 ([Note: the host step]): chunk -> (elements, copy bytes) of chunks stepping on the
    # host; their masters are in `masters_saved`, not in `masters_off` (nothing is streamed)
    hosted: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
    acts: list[ActMove] = dataclasses.field(default_factory=list)   # activation_budget's
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

        held = _Held()
        if key == "bw":   # groups the forward started for this graph are in flight
            for k, grp in enumerate(self.groups["bw"]):
                if grp.prev_start is not None:
                    held[("grp", k)] = grp.nbytes
        base = self.persistent()
        act = [0] * (n + 1)
        act[0] = 0 if key == "fw" else s.model.fw.nodes[-1].live
        for i, node in enumerate(g.nodes):
            act[i + 1] = node.live
        moved = _moved_activations(self.acts, key, act)
        out: list[Item] = []
        lab = _labels(s.model, g)

        def live(i):   # bytes live now, with activations as after node i - 1
            return base + act[i] + held.total

        def emit(kind, name, dur, host, ref, i, label, peak=None, nbytes=0, figure=""):
            lv = live(i)
            extra = {}
            if figure:   # a collective: where it runs (hsdp's reductions: and across groups)
                extra["group"] = s.label_of(figure)
                if figure == "reduce_scatter" and s.layout in ("hsdp", "hsdp_zero"):
                    extra["all_reduce"] = nbytes // s.group
                    extra["across"] = s.cost.across
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

        def act_item(where, i, label):   # activation_budget's recomputes and copies
            for a in moved.get((where, i), ()):
                if where == "after":        # a copy out (forward) or back (backward) starts
                    emit("d2h_start" if key == "fw" else "h2d_start",
                         f"{'offload' if key == 'fw' else 'reload'}.{a.name}", a.time_s,
                         HOST_OP_S, ("act", a.name), i + 1, label, nbytes=a.nbytes)
                elif a.action == "offload":   # the first reader waits for the copy back
                    emit("h2d_wait", f"reload.{a.name}.wait", 0.0, HOST_OP_S, ("act", a.name),
                         i, label)
                else:   # the recompute, its intermediates held while it runs
                    held[("act", a.name)] = a.nbytes
                    emit("recompute", f"recompute.{a.name}", a.time_s, node_host(s, 1, False),
                         None, i, label, peak=live(i) + a.extra)
                    held.pop(("act", a.name))

        act_item("after", -1, lab[0] if n else "")
        for i, node in enumerate(g.nodes):
            for entry in sorted(before.get(i, []), key=_order):
                comm_item(entry, i)
            act_item("before", i, lab[i])
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
            act_item("after", i, lab[i])
        for entry in sorted(before.get(n, []), key=_order):
            comm_item(entry, n)
        return out

    def profile(self, key: str) -> tuple[list[Step], list[Item], dict[str, int]]:
        """What a profile of this graph under the plan shows the passes: one Step per item
        (compute time on compute nodes and copies; live bytes after each); the items; and,
        per step name, the node before which something placed at that step runs."""
        items = self.items(key)
        steps = [Step(it.name, "compute" if it.kind in ON_DEVICE else it.kind,
                      it.dur if it.kind == "compute" or it.kind in ON_DEVICE else 0.0, it.live)
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


def _moved_activations(acts: list[ActMove], key: str,
                       act: list[int]) -> dict[tuple[str, int], list[ActMove]]:
    """[Note: activations at scale] in ours_activations.py, on graph `key`'s live activation
    bytes `act` (index i: after node i - 1), in place: a moved value leaves after its last
    forward reader and is held again in the backward from `ActMove.back` to its last reader,
    as compose's model holds a value. Returns where each one's items go: ("before", node) and
    ("after", node; -1: the top of the graph)."""
    out: dict[tuple[str, int], list[ActMove]] = {}
    for a in acts:
        if key == "fw":
            for k in range(a.fw_free + 1, len(act)):
                act[k] -= a.nbytes
            if a.action == "offload":
                out.setdefault(("after", a.fw_free), []).append(a)
            continue
        for k in range(min(a.back, a.last + 1)):
            act[k] -= a.nbytes
        out.setdefault(("before", a.first), []).append(a)
        if a.action == "offload":
            out.setdefault(("after", a.reload), []).append(a)
    return out


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

