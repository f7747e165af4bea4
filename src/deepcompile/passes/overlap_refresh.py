"""Pass `overlap_refresh` (ZeRO-1/2): the replicas' refresh after the optimizer step runs under the next forward.

At ZeRO-1/2 each rank steps 1/N of every parameter (its shards), and the replicas the graphs
read are all-gathered from the updated shards after the step: DDP's all-reduce, split into a
reduce-scatter in the backward and an all-gather after the step. Synchronous, that all-gather is
exposed inside `engine.step()`. This pass makes the step boundary an edge of the schedule
([Note: deferred refresh] in runtime/replicas.py):

* launch: the trainable replicas are gathered in groups of consecutive parameters of one flat
  chunk, each launched as soon as its chunk's optimizer update is done. A parameter joins the
  group when the cost model says one collective is cheaper than two and the fusion policy
  allows it (`fuses`: under "overlap" the forward compute between the group's first read and
  the newcomer's must not be clearly longer than the newcomer's own gather), up to
  `MAX_GROUP_BYTES`. Where collectives overlap compute for free (the "overlap" policy: NCCL's
  own stream) the step of the resident chunks is split into up to `MAX_SEGMENTS` calls, so the
  gathers of the chunks stepped first run while the next ones step; on the CPU (gloo's thread
  shares the cores) it stays one call;
* wait: every forward graph waits for each replica right before its first use
  (`replica_wait`); nothing waits in the step;
* memory: the replicas themselves are the gathers' outputs, so no buffer is added, except the
  inputs' cast to the compute dtype (a `param_dtype` narrower than the masters), held until the
  wait, and, on gloo, the collective's own buffers for one group at a time. Where that does not
  fit beside the forward's profiled peak under the budget, the refresh stays synchronous.

The plan predicts the refresh's time with the cost model and what of it the forward hides: the
groups complete one after the other from the end of the step, and each is waited for at the
profiled forward compute before the first read of any of its members. The pass changes the
forward graphs (the waits) and the runtime (the refresh), reverted together. Not planned at
ZeRO-3 (nothing is replicated) or at world size 1 (the refresh is a local copy).

The optimizer step itself still starts when every gradient is reduced: the inf/NaN check
(`Config.on_nonfinite`, on by default), loss scaling and `max_grad_norm` read every gradient
before any chunk may step (a skipped or clipped step is decided on the global figures), and the
reduce-scatters before the last bucket already ran under the backward.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import fx

from ..runtime import ops
from .context import Facts, PassContext, register_pass
from ._common import ONE_RANK, Collective, fuses, launch_s, mib, module_of, size

log = logging.getLogger("deepcompile")

MAX_GROUP_BYTES = 256 << 20   # gathered bytes per launch (the synchronous refresh's bucket)
MAX_SEGMENTS = 8              # optimizer-step calls at most (Python per call, per chunk inside)


def _forward_keys(ctx: PassContext) -> list[str]:
    """The training forward graphs, in execution order (then any the step did not record)."""
    fw = [k for k, s in ctx.slots.items() if s.kind == "fw"]
    ordered = list(dict.fromkeys(k for k in ctx.order if k in fw))
    return ordered + sorted(k for k in fw if k not in ordered)


def _replica_reads(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(placeholder, first user) of every trainable replica the graph reads (not only returns:
    a replica saved for the backward is read there after this graph waited for it)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node.meta.get("dc_replica") is None:
            continue
        users = [u for u in node.users if u.op != "output" and u.target is not ops.REPLICA_WAIT]
        if users:
            out.append((node, min(users, key=index.__getitem__)))
    return out


@dataclasses.dataclass
class Member:
    """A trainable replica the refresh gathers, as `plan_groups` sees it."""
    name: str
    pid: int
    nbytes: int                # gathered bytes (the padded parameter, compute dtype)
    dtype: str
    chunk: int                 # the flat chunk whose step updates it
    read_at: float | None      # forward compute before its first read (None: never read)
    first_read: str | None = None   # where (for the report)


def plan_groups(members: list[Member], cost, policy: str, forward_s: float,
                max_bytes: int = MAX_GROUP_BYTES) -> list[dict[str, Any]]:
    """The refresh's launches: consecutive members of one chunk, fused while `fuses` says so
    (the compute between the group's first read and the newcomer's is what its own gather
    could hide behind); pure (the planner at scale runs it too: tools/plan/ours_passes.py)."""
    c = lambda nbytes: cost.collective_s("all_gather", nbytes)  # noqa: E731
    host = launch_s(cost, "all_gather")
    at = lambda m: m.read_at if m.read_at is not None else forward_s  # noqa: E731
    groups: list[list[Member]] = []
    for m in members:
        last = groups[-1] if groups else None
        if last is not None and last[0].chunk == m.chunk:
            nxt = Collective(m.name, 0, m.nbytes, m.pid, m.dtype)
            head = [Collective(x.name, 0, x.nbytes, x.pid, x.dtype) for x in last]
            if fuses(c, head, nxt, max(0.0, at(m) - at(last[0])), max_bytes, host, policy):
                last.append(m)
                continue
        groups.append([m])
    out = []
    for g in groups:
        nbytes = sum(m.nbytes for m in g)
        first = min((m for m in g if m.read_at is not None), key=lambda m: m.read_at,
                    default=None)
        out.append({"chunk": g[0].chunk, "params": [m.name for m in g], "bytes": nbytes,
                    "predicted_s": c(nbytes), "read_at_s": first and first.read_at,
                    "first_read": first and first.first_read})
    return out


def exposed(groups: list[dict[str, Any]], forward_s: float) -> float:
    """Predicted wait in the next forward: the groups complete one after the other from the
    end of the step (one queue), each is waited for at its first read (a group no graph reads:
    after the forward), and a wait delays what comes after it."""
    done, t = [], 0.0
    for g in groups:
        t += g["predicted_s"]
        done.append(t)
    stall = 0.0
    for d, g in sorted(zip(done, groups), key=lambda x: x[1]["read_at_s"]
                       if x[1]["read_at_s"] is not None else forward_s):
        at = (g["read_at_s"] if g["read_at_s"] is not None else forward_s) + stall
        stall += max(0.0, d - at)
    return stall


def plan(ctx: PassContext) -> dict[str, Any]:
    runtime = ctx.runtime
    replicas = getattr(runtime, "replicas", None)
    if ctx.registry.zero_stage == 3 or replicas is None:
        return {"skipped": "ZeRO-3: no replicated parameters"}
    if ctx.world_size == 1:
        return {"skipped": "world size 1: the refresh is a local copy"}
    flat = getattr(getattr(runtime, "offload", None), "flat", None)
    if flat is None or not flat.chunks:
        return {"skipped": "no trainable parameters"}
    # where each parameter is first read in the step's forwards: profiled compute before it
    waits: dict[str, list[list[str]]] = {}
    read_at: dict[int, float] = {}
    first_read: dict[int, str] = {}
    clock, peak = 0.0, 0
    name = {e.pid: e.name for e in ctx.registry}
    for key in _forward_keys(ctx):
        slot, prof = ctx.slots[key], ctx.profiles.get(key)
        reads = _replica_reads(slot.gm)
        if not reads:
            continue
        waits[key] = [[ph.name, name.get(int(ph.meta["dc_replica"]), "?")] for ph, _ in reads]
        before: dict[str, float] = {}
        t = 0.0
        for n in prof.nodes if prof is not None else ():
            before[n.name] = t
            t += n.time_s if n.kind == "compute" else 0.0
        if prof is not None:
            peak = max(peak, prof.peak_bytes)
        for ph, user in reads:
            pid = int(ph.meta["dc_replica"])
            if pid not in read_at:
                read_at[pid] = clock + before.get(user.name, 0.0)
                first_read[pid] = f"{key}:{user.name}"
        clock += t
    if not waits:
        return {"skipped": "no forward graph reads a trainable replica"}
    members = [Member(e.name, e.pid, e.padded_numel * e.compute_dtype.itemsize,
                      str(e.compute_dtype), chunk.index, read_at.get(e.pid),
                      first_read.get(e.pid))
               for chunk in flat.chunks for e in chunk.entries if e.shard.requires_grad]
    groups = plan_groups(members, ctx.cost, ctx.fusion, clock)
    # memory: the cast inputs of every group until the forward waits; gloo's own buffers of one
    # group (its inputs' copy and its output) at a time
    by_name = {e.name: e for e in ctx.registry}
    cast = 0
    for g in groups:   # (a group casts all its members into one buffer, or none)
        entries = [by_name[p] for p in g["params"]]
        if any(e.shard.dtype != e.compute_dtype for e in entries):
            cast += sum(e.shard.numel() for e in entries) * entries[0].compute_dtype.itemsize
    gloo = max((g["bytes"] + g["bytes"] // ctx.world_size for g in groups), default=0) \
        if getattr(getattr(runtime, "comm", None), "backend", "") == "gloo" else 0
    extra = cast + gloo
    budget = ctx.memory_budget
    if peak + extra > budget:
        return {"skipped": f"the forward's peak {size(peak)} and the refresh's {size(extra)} in "
                           f"flight exceed the budget {size(budget)}: the refresh stays in the "
                           "step"}
    wait = exposed(groups, clock)
    refresh = sum(g["predicted_s"] for g in groups)
    segments = min(MAX_SEGMENTS, len(flat.chunks)) if ctx.fusion == "overlap" else 1
    decision = {"groups": groups, "waits": waits, "segments": segments,
                "refresh_s": refresh, "exposed_s": wait, "forward_s": clock,
                "extra_bytes": extra,
                "budget_bytes": None if budget == float("inf") else budget}
    log.info("deepcompile overlap_refresh: the replicas' refresh, %d all-gathers (%s) after the "
             "optimizer step -> launched as their chunks step, waited for where the next "
             "forward first reads them: exposed %.2f -> %.2f ms predicted (forward %.2f ms)",
             len(groups), size(sum(g["bytes"] for g in groups)), refresh * 1e3, wait * 1e3,
             clock * 1e3)
    return decision


def apply(ctx: PassContext, decisions: dict[str, Any]) -> list[str]:
    if not decisions.get("groups"):
        if getattr(ctx.runtime, "replicas", None) is not None:
            ctx.runtime.replicas.defer(None)   # (a re-plan that no longer defers)
        return []
    changed = []
    for key, reads in sorted(decisions["waits"].items()):
        graph = ctx.slots[key].gm.graph
        wanted = {ph for ph, _param in reads}
        todo = [(ph, user) for ph, user in _replica_reads(ctx.slots[key].gm) if ph.name in wanted]
        for ph, user in todo:
            # the pid the graph's own placeholder carries (a cached plan's may be another
            # process's numbering)
            with graph.inserting_before(user):
                wait = graph.call_function(ops.REPLICA_WAIT, (ph, int(ph.meta["dc_replica"])))
            wait.meta["val"] = ph.meta.get("val")
            for u in [u for u in ph.users if u is not wait and u.op != "output"]:
                u.replace_input_with(ph, wait)
        if todo:
            graph.lint()
            changed.append(key)
    by_name = {n: e for e in ctx.registry for n in e.names}
    ctx.runtime.replicas.defer((decisions["segments"],
                                [(g["chunk"], [by_name[p] for p in g["params"]])
                                 for g in decisions["groups"]]))
    return changed


def summary(decisions: dict[str, Any]) -> list[str]:
    if "skipped" in decisions:
        return [f"refresh stays in the optimizer step: {decisions['skipped']}"]
    groups = decisions.get("groups", [])
    if not groups:
        return []
    lines = [f"replica refresh: {len(groups)} all-gathers "
             f"({size(sum(g['bytes'] for g in groups))}) launched as their chunks step "
             f"({decisions['segments']} step call(s)), waited for in the next forward; "
             f"predicted {decisions['refresh_s'] * 1e3:.2f} ms, exposed "
             f"{decisions['exposed_s'] * 1e3:.2f} ms behind a {decisions['forward_s'] * 1e3:.2f} "
             f"ms forward; {size(decisions['extra_bytes'])} in flight"]
    waits = decisions.get("waits", {})
    lines.append("waits: " + ", ".join(f"{k}: {len(v)}" for k, v in sorted(waits.items())))
    for g in sorted(groups, key=lambda g: -g["bytes"])[:3]:
        lines.append(f"  largest: chunk {g['chunk']} {module_of(g['params'])}: "
                     f"{len(g['params'])} members, {size(g['bytes'])}, first read "
                     f"{g['first_read'] or 'by no graph'}")
    return lines


def auto(f: Facts) -> tuple[bool, str]:
    """`passes="auto"`: ZeRO-1/2 over several ranks with trainable replicas, after
    `bucket_reduce`."""
    if f.world_size == 1:
        return False, ONE_RANK
    if f.zero_stage == 3:
        return False, "ZeRO-3: no replicated parameters to refresh"
    if not f.replica_bytes:
        return False, "no trainable parameters"
    return True, (f"ZeRO-{f.zero_stage}: the replicas' refresh ({mib(f.replica_bytes)} "
                  "all-gathered after every optimizer step) overlaps the next forward")


register_pass("overlap_refresh", plan, apply, __doc__.splitlines()[0], summary=summary,
              order=40, choose=auto, asynchronous=True, defers_refresh=True)
