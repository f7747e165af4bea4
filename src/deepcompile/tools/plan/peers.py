"""The peers' schedules on the same composed graphs: FSDP2 and DeepSpeed ZeRO-3 eager; DDP and
DeepSpeed ZeRO-1 beside deepcompile's ZeRO-1/2.

[Note: FSDP2's schedule] (`fully_shard` on each decoder layer, then on the root: the bench's
setup, torch's defaults.) A unit (a layer; the root: embedding, final norm, head) is gathered in
one all-gather into a flat buffer and copied out to its parameters (a device copy of the unit's
bytes after the wait). Forward: the root is gathered first and, as FSDP2 does for the root,
not resharded after the forward; each layer's all-gather is issued when the layer before it
starts (one unit ahead), waited for before its first use, and the unit is resharded after its
last use. Backward: one unit ahead again (explicit backward prefetch), each layer's gradients
reduce-scattered in one collective after its backward (their copy into the flat input is
on the same lane), that reduce-scatter waited for when the next one is issued; the root's
after the whole backward. Per collective the host pays `fsdp_hook_s` (hooks, copy-in/out
launches). Compute: eager (every op a kernel, `eager_op_host_s` each) for "fsdp2", compiled
per layer for "fsdp2-compile" (torchtitan's recipe).

[Note: DeepSpeed ZeRO-3's schedule] (DeepSpeed's defaults: `stage3_prefetch_bucket_size` 5e7
elements, `stage3_param_persistence_threshold` 1e5 elements, `reduce_bucket_size` 5e8
elements, `overlap_comm` on at stage 3.) Parameters of up to 1e5 elements stay gathered on
every rank (norms, MoE routers). The others are gathered per module (one coalesced all-gather
of the module's parameters) at the module's first use and released after its last use in the
graph (a module used by the recomputed forward and by the backward of a checkpointed layer is
fetched once: its reuse distance is below `stage3_max_reuse_distance`, 1e9 elements); when a
module is fetched, the modules after it in the recorded order are prefetched while less than
5e7 elements are being prefetched. Gradients are copied into a reduce bucket (two buffers of
5e8 elements, held for the whole step) as they complete; a full bucket is reduce-scattered
asynchronously, and waited for before its buffer is filled again (two buckets later) or at
the end of the backward. Every module fetch costs the host `ds_hook_s` (Python hooks,
coordinator bookkeeping); compute is eager.

[Note: DDP's schedule] (torch's defaults: `bucket_cap_mb` 25, the first bucket 1 MiB; the
bench's setup: fp32 parameters, bf16 compute under autocast.) Every rank holds the whole model
and its optimizer state (16 bytes a parameter: fp32 parameter, gradient, Adam's two moments).
Gradients are copied into their bucket as they complete, in the order the backward completes
them; a full bucket is all-reduced (fp32) asynchronously and every bucket is waited for at the
end of the backward. The optimizer step updates every parameter on every rank. Compute: eager
for "ddp", compiled for "ddp-compile" (`torch.compile(DDP(model))`: Dynamo splits the graph at
the buckets, so the same overlap).

[Note: DeepSpeed ZeRO-1's schedule] (DeepSpeed's defaults at stage 1: `reduce_bucket_size` and
`allgather_bucket_size` 5e8 elements, `overlap_comm` off.) Parameters and their gradients are
replicated in the compute dtype, the fp32 masters and Adam's moments partitioned (1/N each),
beside one reduce bucket. Gradients are copied
into a reduce bucket as they complete (a hook per parameter); a full bucket, and the last one
at the end of the backward, is reduced to its owners (a reduce-scatter's bytes) on the compute
stream: exposed. After each rank steps its partition, the updated partitions are all-gathered
into the replicas (5e8 elements per collective) inside the step: exposed too. Compute is eager.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .compose import Graph, Model
from .ours import _events_of
from .ours_model import Item, _labels
from .schedule import async_launch_s as _launch
from .schedule import async_s
from .schedule import GRAD_SHARD_BYTES, Counter, Schedule, Setting, node_host, optimizer_events
from .simulate import Event

DS_PREFETCH_BUCKET = 50_000_000
DS_PERSISTENCE = 100_000
DS_REDUCE_BUCKET = 500_000_000
DS_ALLGATHER_BUCKET = 500_000_000
DDP_BUCKET_BYTES = 25 << 20
DDP_FIRST_BUCKET_BYTES = 1 << 20
DDP_GRAD_BYTES = 4   # fp32 parameters (autocast computes in bf16): fp32 gradients


@dataclasses.dataclass
class PeerCosts:
    """Host costs of the peers' Python runtimes (see plan.py for where the defaults come from)."""
    fsdp_hook_s: float = 150e-6
    ds_hook_s: float = 900e-6


@dataclasses.dataclass
class _Unit:
    name: str
    pids: list[int]
    nbytes: int              # gathered bytes
    first: int
    last: int


def _units(s: Setting, g: Graph, groups: dict[str, list[int]]) -> list[_Unit]:
    """`groups` (unit name -> pids) restricted to the parameters `g` reads, in first-use order."""
    use = {u.pid: u for u in g.uses}
    out = []
    for name, pids in groups.items():
        used = [p for p in pids if p in use]
        if used:
            out.append(_Unit(name, used, sum(s.gather_bytes(s.model.params[p]) for p in used),
                             min(use[p].first for p in used), max(use[p].last for p in used)))
    return sorted(out, key=lambda u: (u.first, u.name))


def _walk(s: Setting, key: str, units: list[_Unit], issue: dict[str, int],
          release: dict[str, int | None], held_at_start: dict[str, int], copy_out: bool,
          hook_s: float, eager: bool, reduces: list[tuple[int, list[int], int]],
          rs_wait: dict[int, int], grads_copied: bool, persistent: int,
          grads_absent: bool = False, reduce_kind: str = "reduce_scatter",
          blocking: bool = False) -> list[Item]:
    """Items of one graph: unit all-gathers issued before node `issue[u]` (waited before the
    unit's first use, released after node `release[u]`, or never), reduce-scatters
    (after node, pids, wire bytes) waited before node `rs_wait[k]` (n: the end).
    `grads_copied` (DeepSpeed): gradients go into reduce buckets that are part of the
    persistent bytes; else a reduce-scatter holds its input and output until its wait.
    `grads_absent` (FSDP2's first micro-step): the gradient shards `persistent` counts do not
    exist yet; each reduce-scatter's appear at its wait ([Note: gradient lifetime] in
    ours_model.py: zero_grad sets them to None after the step). `reduce_kind`: the gradients'
    collective ("all_reduce": DDP's buckets); `blocking`: each one runs on the compute stream,
    waited for at once (DeepSpeed's `overlap_comm` off)."""
    g = s.model.fw if key == "fw" else s.model.bw
    n = len(g.nodes)
    cost = s.cost
    lab = _labels(s.model, g)
    held: dict[Any, int] = {("unit", u): b for u, b in held_at_start.items()}
    shard_grad = {p.pid: GRAD_SHARD_BYTES * s.shard_numel(p) for p in s.model.params}
    absent = [sum(shard_grad.values()) if grads_absent else 0]
    base = persistent
    act = [0 if key == "fw" else s.model.fw.nodes[-1].live] + [x.live for x in g.nodes]
    out: list[Item] = []
    by_issue: dict[int, list[_Unit]] = {}
    by_first: dict[int, list[_Unit]] = {}
    by_release: dict[int, list[_Unit]] = {}
    for u in units:
        if u.name in issue:
            by_issue.setdefault(issue[u.name], []).append(u)
        by_first.setdefault(u.first, []).append(u)
        r = release.get(u.name)
        if r is not None:
            by_release.setdefault(r, []).append(u)
    grads_at: dict[int, list] = {}
    for gr in g.grads:
        grads_at.setdefault(gr.at, []).append(gr)
    rs_after: dict[int, list[int]] = {}
    for k, (after, _, _) in enumerate(reduces):
        rs_after.setdefault(after, []).append(k)
    rs_before: dict[int, list[int]] = {}
    for k, w in rs_wait.items():
        rs_before.setdefault(w, []).append(k)
    grad_of = {gr.pid: gr for gr in g.grads}

    def live(i):
        return base - absent[0] + act[i] + sum(held.values())

    def emit(kind, name, dur, host, ref, i, label, peak=None, nbytes=0):
        lv = live(i)
        out.append(Item(kind, name, dur, host, lv, lv if peak is None else max(peak, lv),
                        ref, label, nbytes))

    def before(i):
        label = lab[min(i, n - 1)]
        for k in rs_before.get(i, ()):
            held.pop(("rs", k), None)
            if grads_absent:
                absent[0] -= sum(shard_grad[p] for p in reduces[k][1])
            emit(f"{reduce_kind}_wait", f"rs{k}.wait", 0.0, 0.0, (key, "rs", k), i, label)
        for u in by_issue.get(i, ()):
            held[("unit", u.name)] = u.nbytes
            emit("all_gather_start", f"ag.{u.name}", async_s(cost, "all_gather", u.nbytes),
                 _launch(cost, "all_gather", u.nbytes), (key, "unit", u.name), i, label,
                 nbytes=u.nbytes)
        for u in by_first.get(i, ()):   # the unit's pre-hook (fetch, prefetch, bookkeeping)
            if u.name in issue:
                emit("all_gather_wait", f"ag.{u.name}.wait", 0.0, hook_s, (key, "unit", u.name),
                     i, label)
                if copy_out:
                    emit("copy", f"ag.{u.name}.copy_out", s.copy_on_device_s(u.nbytes),
                         node_host(s, 1, eager), None, i, label)

    for i, node in enumerate(g.nodes):
        before(i)
        during = live(i + 1)
        for u in by_release.get(i, ()):
            held.pop(("unit", u.name), None)
        for gr in grads_at.get(i, ()):
            held[("grad", gr.pid)] = gr.nbytes
        emit("compute", node.name, node.time_s, node_host(s, node.kernels, eager), i, i + 1,
             lab[i], peak=during)
        if grads_copied:   # DeepSpeed: each gradient copied into the reduce bucket at once
            for gr in grads_at.get(i, ()):
                held.pop(("grad", gr.pid), None)
                emit("copy", f"grad.{gr.pid}.to_bucket", s.copy_on_device_s(gr.nbytes),
                     node_host(s, 1, eager), None, i + 1, lab[i])
        for k in rs_after.get(i, ()):
            _, pids, wire = reduces[k]
            for p in pids:
                held.pop(("grad", p), None)
            copy = 0.0 if grads_copied else s.copy_on_device_s(
                sum(grad_of[p].nbytes for p in pids if p in grad_of))
            if not grads_copied:
                held[("rs", k)] = wire + wire // s.world
            if blocking:
                emit(reduce_kind, f"rs{k}", cost.collective_s(reduce_kind, wire) + copy,
                     cost.launch_s(reduce_kind) + hook_s, None, i + 1, lab[i], nbytes=wire)
                continue
            emit(f"{reduce_kind}_start", f"rs{k}", async_s(cost, reduce_kind, wire) + copy,
                 _launch(cost, reduce_kind, wire) + hook_s, (key, "rs", k), i + 1, lab[i],
                 nbytes=wire)
    before(n)
    return out


def _to_schedule(s: Setting, name: str, description: str, items: list[list[Item]],
                 persistent: int, decisions: dict[str, Any], step_share: float = 1.0,
                 after_step: list[Item] = ()) -> Schedule:
    """`step_share`: the optimizer step's elements over one rank's shard (DDP: N, it steps
    every parameter); `after_step`: what runs after it (DeepSpeed ZeRO-1's all-gathers)."""
    events: list[Event] = []
    counter = Counter()
    cid = [0]
    for graph_items in items:
        ids: dict[Any, int] = {}
        for it in graph_items:
            _events_of(it, ids, cid, events, counter, 0)
    events += optimizer_events(s, persistent, share=step_share)
    for it in after_step:
        _events_of(it, {}, cid, events, counter, 0)
    return Schedule(name, description, events, counter.counts, decisions)


def _rs_bytes(s: Setting, pids: list[int]) -> int:
    return sum(s.padded(s.model.params[p]) * s.csize for p in pids)


# ------------------------------------------------------------------------------- FSDP2
def fsdp2(s: Setting, costs: PeerCosts, *, compiled: bool, name: str, description: str) -> Schedule:
    m: Model = s.model
    L = m.layers
    groups: dict[str, list[int]] = {"root": []}
    for p in m.params:
        if 1 <= p.block <= L:
            groups.setdefault(f"L{p.block - 1}", []).append(p.pid)
        else:
            groups["root"].append(p.pid)
    eager = not compiled
    persistent = s.persistent_bytes() + m.base_bytes
    fw_units = _units(s, m.fw, groups)
    bw_units = _units(s, m.bw, groups)
    root_bytes = sum(s.gather_bytes(m.params[p]) for p in groups["root"])
    # forward: root first, each layer issued when the previous unit starts
    issue_fw: dict[str, int] = {}
    release_fw: dict[str, int | None] = {}
    prev_first = 0
    for u in fw_units:
        issue_fw[u.name] = 0 if u.name == "root" else prev_first
        release_fw[u.name] = None if u.name == "root" else u.last
        prev_first = u.first
    # backward: the root is still gathered; one layer ahead
    issue_bw: dict[str, int] = {}
    release_bw: dict[str, int | None] = {}
    prev_first = 0
    for u in bw_units:
        if u.name != "root":
            issue_bw[u.name] = prev_first
        release_bw[u.name] = u.last
        prev_first = u.first
    # one reduce-scatter per layer after its backward; the root's at the end
    end_of = {}
    for i, node in enumerate(m.bw.nodes):
        end_of[node.block] = i
    reduces, waits = [], {}
    layer_units = sorted((u for u in bw_units if u.name != "root"), key=lambda u: u.last)
    for u in layer_units:
        block = int(u.name[1:]) + 1
        reduces.append((end_of[block], u.pids, _rs_bytes(s, u.pids)))
    root_grads = [gr.pid for gr in m.bw.grads if gr.pid in set(groups["root"])]
    reduces.append((len(m.bw.nodes) - 1, root_grads, _rs_bytes(s, root_grads)))
    for k in range(len(reduces)):   # each waited for when the next one is issued
        waits[k] = reduces[k + 1][0] + 1 if k + 1 < len(reduces) else len(m.bw.nodes)
    items = []
    for mstep in range(s.gas):   # reduced every micro-step (FSDP2's default)
        items.append(_walk(s, "fw", fw_units, issue_fw, release_fw, {}, True, costs.fsdp_hook_s,
                           eager, [], {}, False, persistent, grads_absent=mstep == 0))
        items.append(_walk(s, "bw", bw_units, issue_bw, release_bw, {"root": root_bytes}, True,
                           costs.fsdp_hook_s, eager, reduces, waits, False, persistent,
                           grads_absent=mstep == 0))
    return _to_schedule(s, name, description, items, persistent,
                        {"units": len(groups), "unit_bytes_max": max(u.nbytes for u in fw_units),
                         "root_bytes": root_bytes})


# --------------------------------------------------------------------- DeepSpeed ZeRO-3
def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def deepspeed(s: Setting, costs: PeerCosts, *, name: str, description: str) -> Schedule:
    m: Model = s.model
    persist = {p.pid for p in m.params if p.numel <= DS_PERSISTENCE}
    groups: dict[str, list[int]] = {}
    for p in m.params:
        if p.pid not in persist:
            groups.setdefault(_module_of(p.name), []).append(p.pid)
    # its gradient partitions are one flat buffer allocated up front (ZeRO-3's
    # grad_partitions_flat_buffer, on the device without offloading): persistent, unlike
    # FSDP2's and ours ([Note: gradient lifetime] in ours_model.py)
    persistent = s.persistent_bytes() + m.base_bytes + sum(
        s.full_bytes(m.params[p]) for p in persist) + 2 * DS_REDUCE_BUCKET * s.csize
    plans = {}
    for key, g in (("fw", m.fw), ("bw", m.bw)):
        units = _units(s, g, groups)
        issue: dict[str, int] = {}
        numel = {u.name: sum(m.params[p].numel for p in u.pids) for u in units}
        nxt = 0
        for j, u in enumerate(units):
            if u.name not in issue:
                issue[u.name] = u.first
            nxt = max(nxt, j + 1)
            ahead = sum(numel[v.name] for v in units[j + 1:nxt])
            while nxt < len(units) and ahead < DS_PREFETCH_BUCKET:
                issue.setdefault(units[nxt].name, u.first)
                ahead += numel[units[nxt].name]
                nxt += 1
        release = {u.name: u.last for u in units}
        plans[key] = (units, issue, release)
    reduces, bucket, size = [], [], 0
    for gr in m.bw.grads:
        bucket.append(gr.pid)
        size += m.params[gr.pid].numel
        if size >= DS_REDUCE_BUCKET:
            reduces.append((gr.at, bucket, _rs_bytes(s, bucket)))
            bucket, size = [], 0
    if bucket:
        reduces.append((len(m.bw.nodes) - 1, bucket, _rs_bytes(s, bucket)))
    # two bucket buffers: bucket k's buffer is needed again by bucket k + 2
    waits = {k: reduces[k + 2][0] + 1 if k + 2 < len(reduces) else len(m.bw.nodes)
             for k in range(len(reduces))}
    items = []
    for _ in range(s.gas):
        units, issue, release = plans["fw"]
        items.append(_walk(s, "fw", units, issue, release, {}, False, costs.ds_hook_s, True,
                           [], {}, True, persistent))
        units, issue, release = plans["bw"]
        items.append(_walk(s, "bw", units, issue, release, {}, False, costs.ds_hook_s, True,
                           reduces, waits, True, persistent))
    return _to_schedule(s, name, description, items, persistent,
                        {"persistent_params": len(persist), "modules": len(groups),
                         "reduce_buckets": len(reduces)})


# ------------------------------------------------------------------------------- DDP
def ddp(s: Setting, costs: PeerCosts, *, compiled: bool, name: str, description: str) -> Schedule:
    """[Note: DDP's schedule]"""
    m: Model = s.model
    numel = sum(p.numel for p in m.params)
    state = 16 * numel   # fp32 parameter, gradient (its bucket), Adam's two moments
    persistent = state + m.base_bytes
    reduces, bucket, size = [], [], 0
    cap = DDP_FIRST_BUCKET_BYTES
    for gr in m.bw.grads:
        bucket.append(gr.pid)
        size += m.params[gr.pid].numel * DDP_GRAD_BYTES
        if size >= cap:
            reduces.append((gr.at, bucket, size))
            bucket, size, cap = [], 0, DDP_BUCKET_BYTES
    if bucket:
        reduces.append((len(m.bw.nodes) - 1, bucket, size))
    waits = {k: len(m.bw.nodes) for k in range(len(reduces))}   # all at the backward's end
    items = []
    for mstep in range(s.gas):
        last = mstep == s.gas - 1   # no_sync() before the last micro-step
        items.append(_walk(s, "fw", [], {}, {}, {}, False, 0.0, not compiled, [], {}, True,
                           persistent))
        items.append(_walk(s, "bw", [], {}, {}, {}, False, 0.0, not compiled,
                           reduces if last else [], waits if last else {}, True, persistent,
                           reduce_kind="all_reduce"))
    return _to_schedule(s, name, description, items, persistent,
                        {"buckets": len(reduces), "state_bytes_per_rank": state},
                        step_share=numel / max(s.shard_elems(), 1))


# ------------------------------------------------------------------------- DeepSpeed ZeRO-1
def deepspeed_z1(s: Setting, costs: PeerCosts, *, name: str, description: str) -> Schedule:
    """[Note: DeepSpeed ZeRO-1's schedule]"""
    m: Model = s.model
    # stage 1 keeps every gradient whole (compute dtype) until the boundary's reduction
    persistent = s.persistent_bytes() + m.base_bytes + DS_REDUCE_BUCKET * s.csize + \
        sum(s.full_bytes(p) for p in m.params)
    reduces, bucket, size = [], [], 0
    for gr in m.bw.grads:
        bucket.append(gr.pid)
        size += m.params[gr.pid].numel
        if size >= DS_REDUCE_BUCKET:
            reduces.append((gr.at, bucket, _rs_bytes(s, bucket)))
            bucket, size = [], 0
    if bucket:
        reduces.append((len(m.bw.nodes) - 1, bucket, _rs_bytes(s, bucket)))
    items = []
    for mstep in range(s.gas):
        last = mstep == s.gas - 1   # reduced at the accumulation boundary only
        items.append(_walk(s, "fw", [], {}, {}, {}, False, 0.0, True, [], {}, True, persistent))
        items.append(_walk(s, "bw", [], {}, {}, {}, False, 0.0, True, reduces if last else [],
                           {}, True, persistent, blocking=True))
    gathers, size = [], 0
    numel = sum(p.numel for p in m.params)
    while size < numel:
        n = min(DS_ALLGATHER_BUCKET, numel - size)
        nb = n * s.csize
        gathers.append(Item("all_gather", f"allgather {len(gathers)}",
                            s.cost.collective_s("all_gather", nb), s.cost.launch_s("all_gather"),
                            persistent, persistent, None, "refresh", nb))
        size += n
    return _to_schedule(s, name, description, items, persistent,
                        {"reduce_buckets": len(reduces), "allgathers": len(gathers),
                         "state_bytes_per_rank": (16 * s.shard_elems())},
                        after_step=gathers)
