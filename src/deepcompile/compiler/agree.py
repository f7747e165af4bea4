"""Rank agreement: every figure a decision reads is the same on every rank (DESIGN §3).

Pure functions over `Comm`: profiles (per node, the median over this rank's runs of the step,
then the MAX over ranks), the memory budget (MIN over ranks), measured step times (MAX over
ranks: a step takes as long as its slowest rank). Ranks that profiled different graphs, or ran
them in a different order, fail loudly here: their decisions would diverge and hang collectives.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from .profiler import GraphProfile, NodeProfile


def agree_max(comm, values: list[float], device: torch.device) -> list[float]:
    """Element-wise MAX over ranks (bookkeeping: not counted as training traffic)."""
    if not values:
        return []
    vec = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(vec, op=dist.ReduceOp.MAX, count=False)
    return vec.tolist()


def agree_profiles(comm, slots: dict, order: list[str], device: torch.device) -> dict[str, GraphProfile]:
    """The agreed profile of every slot profiled this phase (median over this step's runs, then
    MAX over ranks; identical on every rank). Sets each slot's `local` profile (this rank's own
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
        slot.local = GraphProfile(slot=key, version=slot.version, nodes=nodes, total_s=total)
        local[key] = GraphProfile(slot=key, version=slot.version, total_s=total,
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
    values = [x for p in local.values() for n in p.nodes for x in (n.time_s, n.live_bytes)]
    values += [p.total_s for p in local.values()]
    flat = agree_max(comm, values, device)
    i = 0
    for p in local.values():
        for n in p.nodes:
            n.time_s, n.live_bytes = flat[i], int(flat[i + 1])
            i += 2
    for p in local.values():
        p.total_s = flat[i]
        i += 1
    return local


def agreed_budget(comm, budget: int | float | None, device: torch.device) -> float:
    """The memory budget in bytes, the smallest over ranks (inf: unbounded)."""
    if budget is None:
        if device.type != "cuda":
            return float("inf")
        budget = 0.9
    if isinstance(budget, float):
        if device.type != "cuda":
            raise ValueError("Config.memory_budget: a fraction of device memory needs a "
                             "CUDA device; on CPU give bytes (an int) or None (unbounded)")
        budget = budget * torch.cuda.get_device_properties(device).total_memory
    vec = torch.tensor([float(budget)], dtype=torch.float64, device=device)
    comm.all_reduce(vec, op=dist.ReduceOp.MIN, count=False)
    return vec.item()
