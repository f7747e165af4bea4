"""deepcompile's own schedule: insertion, then the passes (ours_passes.py), its plan's items
(ours_model.py) as simulator events.

ZeRO-1/2: the replicas are refreshed after the optimizer step, in collectives of at most 256 MiB
copied out of their buffer; with `overlap_refresh` ([Note: deferred refresh] in
runtime/replicas.py) the refresh of the step before is in flight when the step starts (the
steady state: it was launched as the previous step updated each chunk), in the groups the pass
plans (`overlap_refresh.plan_groups`, chunks of the flat layout's size), written straight into
the replicas, and each group is waited for before the forward's first read of any member.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...passes import offload_optimizer, passes_with
from ...runtime.kept import MAX_REFRESH_BYTES
from .ours_model import ON_DEVICE, Item, _grads_absent, _tier2_copies
from .ours_passes import plan
from .schedule import Counter, Schedule, Setting, framework_event, node_host, optimizer_events
from .simulate import Event

# the passes whose collectives are asynchronous: a host profile measures the framework's time
# with them apart (`Setting.framework_async_s`; benchmarks/validation/host_profile.py)
ASYNC_PASSES = passes_with(asynchronous=True)


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
    # [Note: offload in the simulation] the runtime (runtime/offload/): the chunks a backward brings back
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
    if s.layout == "hsdp_zero":
        # the secondary shards' refresh ([Note: secondary shards] in runtime/secondary.py):
        # each group's 1/G block of every parameter, gathered across the groups in collectives
        # of at most MAX_REFRESH_BYTES
        for nb in _fused([s.padded(p) // s.group * s.csize for p in s.model.params]):
            cid[0] += 1
            events.append(Event("start", "refresh secondary", s.cost.group_s(
                "inter", "all_gather", nb), s.cost.launch_s("all_gather"), cid[0], "comm",
                live + nb, label="all_gather"))
            events.append(Event("wait", "refresh secondary.wait", cid=cid[0], live=live + nb))
            counter.add("all_gather", nb, group="inter")
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


def _fused(sizes: list[int]) -> list[int]:
    """Bytes of each collective when consecutive `sizes` are fused up to MAX_REFRESH_BYTES (a
    larger one alone), as `regather.groups` fuses a refresh."""
    out: list[int] = []
    for nb in sizes:
        if out and out[-1] + nb <= MAX_REFRESH_BYTES:
            out[-1] += nb
        else:
            out.append(nb)
    return out


def _events_of(it: Item, ids: dict, cid: list, events: list[Event], counter: Counter,
               back: int) -> None:
    k = it.kind
    live, peak = it.live + back, it.peak + back
    if k == "compute" or k in ON_DEVICE:
        events.append(Event("compute", it.name, it.dur, it.host, live=live, peak=peak,
                            label=it.label))
    elif k in ("d2h_start", "h2d_start"):   # activation_budget's copies, on the copy lanes
        cid[0] += 1   # a copy back waits for its copy out (runtime/activations.py)
        out = ids.get(it.ref) if k == "h2d_start" else None
        ids[it.ref] = cid[0]
        events.append(Event("start", it.name, it.dur, it.host, cid[0], k[:3], live,
                            label="offload", after=out))
    elif k == "h2d_wait":
        events.append(Event("wait", it.name, host_s=it.host, cid=ids[it.ref], lane="h2d",
                            live=live))
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
        counter.add(it.across, it.all_reduce, group="inter")
