"""Rank agreement: every figure a decision reads is the same on every rank.

Pure functions over `Comm`: profiles ([Note: agreed node times]), the memory budget (MIN over ranks), measured step times (MAX over
ranks: a step takes as long as its slowest rank), the passes' decisions. Ranks that profiled
different graphs, or ran them in a different order, or planned differently, fail loudly here:
their decisions would diverge and hang collectives.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import ops
from ..runtime.divergence import digest
from ..runtime.errors import DivergenceError
from .profiler import GraphProfile, NodeProfile


def agree_max(comm, values: list[float], device: torch.device) -> list[float]:
    """Element-wise MAX over ranks (bookkeeping: not counted as training traffic)."""
    return _reduce(comm, values, dist.ReduceOp.MAX, device)


def _reduce(comm, values: list[float], op, device: torch.device) -> list[float]:
    if not values:
        return []
    vec = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(vec, op=op, count=False)
    return vec.tolist()


# [Note: agreed node times] Each rank's node time is the median over its runs of the step.
# Compute nodes: the mean over ranks, scaled so that the graph's compute sums to the slowest
# rank's (a step takes as long as its slowest rank). Nodes that block on communication
# (synchronous collectives, waits): the MIN over ranks. A rank that reaches a collective early
# waits there for the others; the rank that arrives last waits only for the transfer, which is
# the collective's cost. Any more is skew, counted already as the late rank's own compute, or,
# in a profiled run, the other ranks' profiler bookkeeping between nodes: with the mean (or the
# MAX, before that) the profiled step summed to 0.7-2.4x the measured step on 2 CPU ranks from
# one launch to the next, the skew landing on whichever collective came first.


def agree_profiles(comm, slots: dict, order: list[str], device: torch.device) -> dict[str, GraphProfile]:
    """The agreed profile of every slot profiled this phase (median over this step's runs, then
    [Note: agreed node times]; identical on every rank). Sets each slot's `local` profile (this rank's own
    medians, start offsets from the last run: the trace and the per-rank plots read it) and
    clears its pending runs."""
    local: dict[str, GraphProfile] = {}
    for key in sorted(slots):
        slot = slots[key]
        if not slot.pending:
            continue
        runs = slot.pending
        last = runs[-1]
        nodes = [NodeProfile(**{**vars(n),
                                "time_s": statistics.median(r.nodes[i].time_s for r in runs),
                                "live_bytes": max(r.nodes[i].live_bytes for r in runs)})
                 for i, n in enumerate(last.nodes)]
        total = statistics.median(r.total_s for r in runs)
        launched = _mean_launched(runs)
        slot.local = GraphProfile(slot=key, version=slot.version, nodes=nodes, total_s=total,
                                  launched=launched)
        local[key] = GraphProfile(slot=key, version=slot.version, total_s=total, launched=launched,
                                  nodes=[NodeProfile(**{**vars(n), "start_s": 0.0})
                                         for n in nodes])
        slot.pending = []
    shape = [(k, p.version, len(p.nodes)) for k, p in local.items()]
    mine = (shape, order)
    for rank, other in enumerate(comm.all_gather_object(mine)):
        if other != mine:
            raise RuntimeError(
                "deepcompile: ranks profiled different graphs or ran them in a different "
                f"order (rank {comm.rank}: {mine}; rank {rank}: {other}); their "
                "decisions would diverge and hang collectives")
    profiles = list(local.values())
    blocking = [n for p in profiles for n in p.nodes if n.kind in ops.BLOCKING]
    means = iter(_reduce(comm, [n.time_s for p in profiles for n in p.nodes],
                         dist.ReduceOp.SUM, device))
    # one MAX reduction: live and output bytes (ranks that compiled a graph for different
    # shapes: the larger), each graph's run time and compute sum, and (negated, so that their
    # MAX is the MIN) the blocking nodes' times
    maxima = iter(agree_max(comm, [x for p in profiles for n in p.nodes
                                   for x in (n.live_bytes, n.out_bytes)]
                            + [x for p in profiles
                               for x in (p.total_s, sum(n.time_s for n in p.nodes
                                                        if n.kind == "compute"))]
                            + [-n.time_s for n in blocking], device))
    for p in profiles:
        for n in p.nodes:
            n.time_s = next(means) / comm.world
            n.live_bytes, n.out_bytes = int(next(maxima)), int(next(maxima))
    for p in profiles:
        p.total_s, slowest = next(maxima), next(maxima)
        compute = [n for n in p.nodes if n.kind == "compute"]
        mean_sum = sum(n.time_s for n in compute)
        if mean_sum > 0:
            for n in compute:
                n.time_s *= slowest / mean_sum
    for n in blocking:
        n.time_s = -next(maxima)
    return local


def _mean_launched(runs: list[GraphProfile]) -> dict[str, list[float]] | None:
    """Collectives per run by kind, the mean over `runs` (a kind a run did not launch: 0)."""
    if any(r.launched is None for r in runs):
        return None
    out: dict[str, list[float]] = {}
    for r in runs:
        for kind, (n, nbytes) in r.launched.items():
            c = out.setdefault(kind, [0.0, 0.0])
            c[0] += n / len(runs)
            c[1] += nbytes / len(runs)
    return out


def usable_bytes(device: torch.device) -> int:
    """Device memory this process's caching allocator can come to hold: what it has reserved
    plus what is free. The total less the CUDA context, NCCL's buffers and other processes,
    which the budget (a bound on `memory_allocated`) would otherwise count as room."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def local_budget(budget: int | float | None, device: torch.device) -> float:
    """`Config.memory_budget` in bytes on this rank (inf: unbounded)."""
    if budget is None:
        if device.type != "cuda":
            return float("inf")
        budget = 0.9
    if isinstance(budget, float):
        if device.type != "cuda":
            raise ValueError("Config.memory_budget: a fraction of device memory needs a "
                             "CUDA device; on CPU give bytes (an int) or None (unbounded)")
        budget = budget * usable_bytes(device)
    return float(budget)


def agreed_budget(comm, budget: int | float | None, device: torch.device) -> float:
    """The memory budget in bytes, the smallest over ranks (inf: unbounded)."""
    budget = local_budget(budget, device)
    if budget == float("inf"):
        return budget
    vec = torch.tensor([float(budget)], dtype=torch.float64, device=device)
    comm.all_reduce(vec, op=dist.ReduceOp.MIN, count=False)
    return vec.item()


def agree_decisions(comm, name: str, decisions: Any) -> None:
    """A pass plans from what every rank holds alike (PassContext): the same decisions on
    every rank, or the ranks would rewrite their graphs differently. Checked (one small
    all-gather per pass planned), so that a pass that plans from local timings fails on
    every rank instead of hanging collectives. Compared: the decisions' structure (groups,
    positions, names, counts); floats are estimates (predicted seconds) that rewrite
    nothing."""
    if comm.world == 1:
        return
    mine = digest(json.dumps(_structure(decisions), sort_keys=True, default=str))
    every = comm.all_gather_object(mine)
    if len(set(every)) > 1:
        groups: dict[int, list[int]] = {}
        for r, d in enumerate(every):
            groups.setdefault(d, []).append(r)
        raise DivergenceError(
            f"deepcompile: pass {name!r} planned differently on different ranks (ranks "
            f"grouped by plan: {sorted(groups.values())}); a pass must plan from the agreed "
            "profiles and the PassContext only, never from this rank's own timings or state. "
            "The engine stops on every rank.")


def _structure(x: Any) -> Any:
    """`x` with every float left out (a pass's decisions, for `agree_decisions`)."""
    if isinstance(x, float):
        return "<float>"
    if isinstance(x, dict):
        return {str(k): _structure(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_structure(v) for v in x]
    return x
