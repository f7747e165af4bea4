"""The passes at scale: each configured pass planned by its own planner on the plan so far.

[Note: the passes at scale] The composed graphs (compose.py) get deepcompile's insertion: a
synchronous gather before the first use of each parameter in each graph, a synchronous reduce
right after each gradient is complete. Then each configured pass plans, in the order given,
with its real planner (`prefetch.plan_graph` / `plan_across`, `bucket_reduce.plan_graph`,
`selective_unshard.options_of` / `choose`, `offload_optimizer.plan_step`,
`activation_budget.analyse` / `plan_pair`: ours_activations.py) on `Step` lists built
here from the current plan, with the memory budget and the cost model the runtime would give
them (`Setting.planner_cost`: the network model on a GPU cluster; on this machine the
runtime's own calibration): what the passes see in a run, where the profile after each pass
is measured, is here the memory model of the plan so far (`Plan.items`), so each pass plans
on the effect of the ones before. The simulation then times the plan with the measured or
modelled costs, host costs included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...passes import (activation_budget, bucket_reduce, offload_optimizer, overlap_refresh,
                       prefetch, selective_unshard)
from ...passes._common import Step
from ...runtime import flat, offload, regather
from ...runtime import kept as _kept
from .ours_activations import plan_activations
from .ours_model import Bucket, GradOff, Group, Plan, _grad_bytes, reduced_at
from .schedule import ADAM_BYTES, GRAD_SHARD_BYTES, MASTER_BYTES, Setting

PASSES = ("prefetch", "bucket_reduce", "selective_unshard", "offload_optimizer",
          "overlap_refresh", "activation_budget")
COLLECTIVE_FREE = ("offload_optimizer", "activation_budget")   # plan at world size 1 too
AUTO = "auto"   # passes="auto": the runtime's choice (auto_choice), its verdicts (plan.py)
REPLICA_REFRESH_BYTES = 256 << 20   # ZeRO-1/2 replica refresh: one collective per 256 MiB


# ------------------------------------------------------------------------------- passes
def _prefetch_plans(plan: Plan, held: float = float("inf"), short: list[int] | None = None
                    ) -> tuple[dict[str, Any], dict[str, dict[str, int]],
                               dict[tuple[str, int], list[int]]]:
    """prefetch's decisions on the plan so far, with the live bytes held at `held` at most
    (`prefetch.offers`); (decisions, per graph the node of each step, each pre-fused gather's
    members)."""
    s = plan.s
    decisions: dict[str, Any] = {}
    steps: dict[str, list[Step]] = {}
    where: dict[str, dict[str, int]] = {}
    forced = (s.replay or {}).get("prefetch")
    members: dict[tuple[str, int], list[int]] = {}
    for key in ("bw", "fw"):     # the pipeline plans graphs in key order: g0.bw, g0.fw
        st, items, where[key] = plan.profile(key)
        st = steps[key] = prefetch.held_steps(st, held)
        gathers = [prefetch.Gather(it.name, i, it.nbytes, it.ref[2], str(s.model.dtype))
                   for i, it in enumerate(items) if it.kind == "all_gather"]
        figure = "all_gather_bw" if key == "bw" else "all_gather"
        if forced is None:
            decisions[key] = prefetch.plan_graph(st, gathers, s.planner_cost, s.budget,
                                                 policy=s.fusion, figure=figure, short=short)
            continue
        # replay: each of the run's groups as one gather at its first member's place, placed
        # by the planner, fused with nothing else
        fused = _prefuse(gathers, forced.get(key, []), s, first=True)
        decisions[key] = prefetch.plan_graph(st, fused, s.planner_cost, s.budget,
                                             max_fused_bytes=0, policy=s.fusion, figure=figure,
                                             short=short)
        for g in fused:
            members[key, g.pid] = _MEMBERS[id(g)]
    if s.layout != "hpz":   # hpz: the backward gathers otherwise (as the runtime's pass)
        prefetch.plan_across("fw", "bw", steps["fw"], steps["bw"], decisions, s.budget, short)
    return decisions, where, members


def _prefetch(plan: Plan) -> dict[str, Any]:
    s = plan.s
    decisions, where, members = _prefetch_plans(plan)
    forced = (s.replay or {}).get("prefetch")
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


def _unshard_options(plan: Plan) -> tuple[list, list[dict[str, Any]], int, float]:
    """(selective_unshard's collectives, its options per parameter, the peak, the room the
    budget leaves), on the plan so far."""
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
    return colls, opts, peak, s.budget - peak


def _selective_unshard(plan: Plan) -> dict[str, Any]:
    s = plan.s
    params = s.model.params
    colls, opts, peak, capacity = _unshard_options(plan)
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
    """[Note: provisional offload] in runtime/offload/__init__.py: until this pass plans, every movable
    fragment is off the device, so the passes before it planned on that curve; this plan
    puts them back and keeps on the device what fits: optimizer state first, then (tier 2)
    the gradients of the chunks the backward completes first."""
    plan.offloaded = 0     # the curve with all state and gradients on the device
    plan.reloads, plan.streamed, plan.grads_off = [], {}, []
    plan.masters_off, plan.masters_saved, plan.hosted = {}, 0, {}
    points, plan_at, chunks, grads, masters = _offload_planner(plan)
    return _offload_tail(plan, plan_at(points), chunks, grads, masters)


def _offload_planner(plan: Plan):
    """(the curve with all state and gradients on the device, the runtime plan of a curve,
    the chunks, their gradients and masters): `plan.offloaded` is 0 while the curve is read."""
    s = plan.s
    offloaded, plan.offloaded = plan.offloaded, 0
    points: list[offload_optimizer.Point] = []
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
    plan.offloaded = offloaded
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

    def plan_at(curve: list[offload_optimizer.Point]) -> dict[str, Any]:
        return offload_optimizer.plan_step(curve, states, step_base, s.planner_cost.copy_s,
                                           s.budget, grads=grads, masters=masters, host=host)
    return points, plan_at, chunks, grads, masters


def _offload_offers(plan: Plan) -> tuple[list[tuple[int, float]], int]:
    """The runtime pass's `memory_value` on the plan so far (the provisional curve, every
    movable fragment off the device), with the peak now."""
    points, plan_at, *_ = _offload_planner(plan)
    return offload_optimizer.offers(points, plan_at, plan_at(points)), plan.peak()


def _offload_tail(plan: Plan, d: dict[str, Any], chunks, grads, masters) -> dict[str, Any]:
    """The plan `d` applied to `plan` (what it offloads, reloads, streams), and its figures."""
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
                              "offloaded_grad_bytes", "grad_sent_bytes", "predicted_grad_copy_s",
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
        "overlap_refresh": _overlap_refresh, "activation_budget": plan_activations}


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
        passes = tuple(p for p in passes
                       if p in ("bucket_reduce", "overlap_refresh", "activation_budget"))
    if s.world == 1:
        # nothing is communicated: the passes that schedule collectives plan nothing (theirs
        # return empty decisions at world size 1); ZeRO-1 does not defer a reduction
        for name in passes:
            if name not in COLLECTIVE_FREE:
                pl.decisions[name] = {"skipped": "world size 1: nothing is communicated"}
        passes = tuple(p for p in passes if p in COLLECTIVE_FREE)
        pl.accumulated = set()
    if "offload_optimizer" in passes:
        pl.offloaded = _movable_bytes(s)   # provisional (see _offload)
    # the runtime's queue ([Note: a memory trade] in passes/activation_budget.py): the offload
    # plan waits for activation_budget where a lower peak would keep its state on the device
    # (`PassManager.waits`), and activation_budget, declined for it, plans once more after it
    # (`PassManager.unchanged`; the decisions are its second plan's, `declined_first` the first)
    queue, waited, declined = list(passes), False, None
    while queue:
        name = queue.pop(0)
        if name == "offload_optimizer" and not waited and "activation_budget" in queue:
            waited = True
            if _offload_offers(pl)[0]:
                queue.insert(queue.index("activation_budget") + 1, name)
                continue
        buyer = queue[0] if queue else None
        d = (_activations_traded(pl, buyer) if name == "activation_budget" and buyer in _OFFERS
             else _RUN[name](pl))
        if name == "activation_budget" and buyer == "offload_optimizer" and "trade" not in d \
                and waited:
            declined = d.get("declined")
            queue.insert(1, name)
        elif name == "activation_budget" and declined is not None:
            d["declined_first"] = declined
        pl.decisions[name] = d
    return pl


def _unshard_offers(plan: Plan) -> tuple[list[tuple[int, float]], int]:
    _, opts, level, capacity = _unshard_options(plan)
    return selective_unshard.offers(opts, capacity), level


def _prefetch_offers(plan: Plan) -> tuple[list[tuple[int, float]], int]:
    level = plan.peak()
    return prefetch.offers(lambda held, short: _prefetch_plans(plan, held, short)[0],
                           {"fw": plan.s.gas, "bw": plan.s.gas}, level, plan.s.budget), level


# the passes whose `memory_value` the planner models: (offers, the peak now) on the plan so far
_OFFERS = {"selective_unshard": _unshard_offers, "prefetch": _prefetch_offers,
           "offload_optimizer": _offload_offers}


def _unmoved(plan: Plan) -> dict[str, Any]:
    """The activation pass's figures with nothing moved (`plan.acts` emptied)."""
    d = plan_activations(plan, float("inf"))
    return d if "skipped" in d else {**d, "budget_bytes": plan.s.budget}


def _activations_traded(plan: Plan, buyer: str) -> dict[str, Any]:
    """`activation_budget` before `buyer` (`_OFFERS`): within the budget (over it too for
    `offload_optimizer`, which meets the budget itself), the activations it frees for what
    `buyer` makes of more memory where that saves twice what they cost, by the rule the
    runtime's pass applies ([Note: a memory trade] in passes/activation_budget.py)."""
    # a buyer that waits for the memory (`Pass.waits_for_memory`: the offload plan, with offers)
    waiting = False
    if buyer == "offload_optimizer" and plan.s.budget != float("inf"):
        offers, level = _offload_offers(plan)
        waiting = bool(offers)
    d = _unmoved(plan) if waiting else plan_activations(plan)
    if "skipped" in d or (d["peak_before"] > d["budget_bytes"] and not waiting):
        return d
    if not waiting:
        offers, level = _OFFERS[buyer](plan)

    def plan_at(target: float) -> tuple[float, float, dict[str, Any]]:
        planned = plan_activations(plan, target)
        return plan.peak(), planned["added_s"] * plan.s.gas, planned

    tried: list[tuple[int, float, float]] = []
    best = activation_budget.choose_trade(offers, level, plan_at, tried) if offers else None
    if best is None:
        # the plan to the budget (nothing moved within it), or none for a waiting buyer
        d = _unmoved(plan) if waiting else plan_activations(plan)
        if offers:
            d["declined"] = activation_budget.declined_record(buyer, level, offers, tried)
        return d
    traded, freed, value, cost = best
    traded = plan_activations(plan, traded["budget_bytes"])   # its moves, in `plan.acts`
    traded["trade"] = activation_budget.trade_record(buyer, freed, level, cost, value, offers)
    return traded


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
                  if s.stage < 3 and s.world > 1 else 0,
                  keep_all_bytes=sum(s.full_bytes(p) + (s.padded(p) * MASTER_BYTES
                                                        if s.gas > 1 else 0)
                                     for p in s.model.params) if s.stage == 3 else 0)
    chosen, out = autoplan.choose(facts)
    left = {c.name: c.reason for c in out}
    left.update({c.name: f"chosen ({c.reason}), but not modelled by this planner"
                 for c in chosen if c.name not in _RUN})
    return [c.name for c in chosen if c.name in _RUN], left
