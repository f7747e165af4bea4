"""`Config.layout="auto"`: the data-parallel layout chosen when the engine is made.

[Note: choosing the layout] The layout decides how parameters are sharded, so it is chosen
before anything is sharded, compiled or profiled: from what is known then, the same on every
rank:

* the model: every parameter's element count, its compute dtype (`param_dtype`, else its own)
  and its reduce dtype;
* the cluster's shape: W ranks in groups of G (runtime/mesh.py);
* the memory budget (`Config.memory_budget`, agreed over the ranks; unbounded on the CPU);
* the collectives, measured: all-gather and reduce-scatter over every rank and within a group,
  all-reduce (and at ZeRO-3 reduce-scatter and all-gather) across the groups
  (`compiler/cost.py::measure_groups`, the slowest rank's timings, a few milliseconds on GPUs).

Per layout it predicts one optimizer step's communication (`predict`: every parameter's collectives
under the layout, as the lowering runs them, without overlap: the compute that could hide them is
not known yet, and is the same under every layout) and the model state per rank (masters,
gradients, an Adam-like optimizer's two moments per master element, ZeRO-1/2's replicated
parameters, hpz's and hsdp_zero's secondary shards). The memory a layout leaves free is worth
communication: the model state takes half the budget at most (the other half: the activations and
the gathered parameters, which no layout changes), and what it leaves of that half goes to the
passes that will run and say what they make of it (`Pass.spare_memory`: selective_unshard keeps
parameters gathered, saving their gathers). It takes the layout of least predicted communication,
after those savings, among those whose model state fits; "shard" when none fits (the least memory).
Ties (within `TIE`) go to the layout with less memory. The report states the choice and every
layout's figures; `deepcompile plan` shows the layouts side by side with their simulated steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

from ..passes.context import Keepable, SpareMemory, get_pass

TIE = 0.02                  # predicted times within 2% are a tie
ADAM_STATE = 2              # optimizer state per master element, in master elements (assumed)
ORDER = ("shard", "hpz", "hsdp_zero", "hsdp")   # least memory first


@dataclasses.dataclass(frozen=True)
class ParamFacts:
    numel: int
    compute_bytes: int   # bytes per element of a gathered parameter
    reduce_bytes: int    # bytes per element of a reduced gradient
    master_bytes: int    # bytes per element of the master (and of its gradient)


def params_of(module: torch.nn.Module, param_dtype, reduce_dtype) -> list[ParamFacts]:
    seen, out = set(), []
    for p in module.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        compute = param_dtype or p.dtype
        master = torch.float32 if param_dtype is not None else p.dtype
        out.append(ParamFacts(p.numel(), compute.itemsize, (reduce_dtype or compute).itemsize,
                              master.itemsize))
    return out


def predict(name: str, params: list[ParamFacts], world: int, group: int, stage: int, gas: int,
            collective_s: Callable[[str, str, int], float]
            ) -> tuple[dict[str, Any], tuple[Keepable, ...]]:
    """One optimizer step's communication under layout `name` (seconds from `collective_s(group
    label, kind, bytes)`; bytes per group label) and the model state per rank; and every
    parameter as one kept gathered would save (ZeRO-3)."""
    shards = group if name == "hsdp" else world
    in_group = name in ("hsdp", "hsdp_zero")   # gathers and the first reduce-scatter
    seconds, nbytes, state = 0.0, {}, 0
    keepable = []

    def add(label: str, kind: str, size: int, times: int) -> float:
        """Count `times` collectives of `size` bytes; returns one's seconds."""
        nonlocal seconds
        one = collective_s(label, kind, size)
        seconds += times * one
        nbytes[label] = nbytes.get(label, 0) + times * size
        return one

    wide = "world" if world > group else "intra"
    for p in params:
        shard = -(-p.numel // shards)
        padded = shard * shards
        state += shard * p.master_bytes * (2 + ADAM_STATE)
        home = "intra" if in_group else wide
        if stage == 3:
            size = padded * p.compute_bytes
            fw_s = add(home, "all_gather", size, gas)                    # the forward's
            bw = "intra" if name in ("hsdp", "hsdp_zero", "hpz") else wide
            bw_s = add(bw, "all_gather", size, gas)                      # the backward's
            # a kept copy's refresh: the forward's gather (hsdp_zero: from the secondary shards,
            # refreshed after each step whether or not a parameter is kept)
            keepable.append(Keepable(size, fw_s + bw_s, fw_s))
            if name in ("hpz", "hsdp_zero"):
                state += -(-padded // group) * p.compute_bytes           # the secondary shard
            if name == "hsdp_zero" and world > group:   # the secondary shard's refresh
                add("inter", "all_gather", padded // group * p.compute_bytes, 1)
        else:
            state += p.numel * p.compute_bytes                           # the replica
            add(home, "all_gather", padded * p.compute_bytes, 1)         # after the step
        reductions = 1 if stage == 1 else gas
        add(home, "reduce_scatter", padded * p.reduce_bytes, reductions)
        if name == "hsdp" and world > group:
            add("inter", "all_reduce", shard * p.reduce_bytes, reductions)
        if name == "hsdp_zero" and world > group:   # the group's slice, across the groups
            add("inter", "reduce_scatter", padded // group * p.reduce_bytes, reductions)
    crossing = sum(b for label, b in nbytes.items() if label in ("world", "inter"))
    return ({"comm_s": seconds, "bytes": nbytes, "crossing_bytes": crossing,
             "state_bytes": state}, tuple(keepable))


def choose(params: list[ParamFacts], world: int, group: int, stage: int, gas: int,
           budget: float, collective_s: Callable[[str, str, int], float],
           names: tuple[str, ...] = ORDER, passes: Iterable[str] = ()
           ) -> tuple[str, str, dict[str, Any]]:
    """[Note: choosing the layout]: (layout, why, every layout's figures). `passes`: the passes
    that will run (their `spare_memory` values the memory each layout leaves)."""
    spenders = [p for p in map(get_pass, passes) if p.spare_memory is not None]
    room = budget / 2
    figures = {}
    for n in names:
        if n in ("hpz", "hsdp_zero") and stage != 3:
            continue
        f, keepable = predict(n, params, world, group, stage, gas, collective_s)
        spare = SpareMemory(stage, gas, room - f["state_bytes"], keepable)
        saved = used = 0.0
        for p in spenders:
            s, u = p.spare_memory(spare)
            saved, used = saved + s, used + u
        f["comm_before_s"], f["comm_s"], f["spare_used_bytes"] = \
            f["comm_s"], max(0.0, f["comm_s"] - saved), used
        figures[n] = f
    fits = [n for n in ORDER if n in figures and figures[n]["state_bytes"] <= room]
    for n, f in figures.items():
        f["fits"] = n in fits
    if not fits:
        return "shard", ("no layout's model state fits in half the memory budget; 'shard' "
                         "holds the least"), figures
    best = min(figures[n]["comm_s"] for n in fits)
    pick = next(n for n in fits if figures[n]["comm_s"] <= best * (1 + TIE))
    others = ", ".join(f"{n} {figures[n]['comm_s'] * 1e3:.2f} ms"
                       + ("" if n in fits else " (does not fit)") for n in figures if n != pick)
    why = (f"least predicted communication per optimizer step: {figures[pick]['comm_s'] * 1e3:.2f}"
           f" ms ({others}); model state {figures[pick]['state_bytes'] / 2**20:.1f} MiB per "
           "rank" + ("" if room == float("inf") else f" of {room / 2**20:.0f} MiB (half the budget)"))
    if spenders:
        why += (f"; after what {', '.join(p.name for p in spenders)} would make of the memory "
                f"left ({figures[pick]['spare_used_bytes'] / 2**20:.1f} MiB used)")
    return pick, why, figures


def collective_time(models: dict[str, Any]) -> Callable[[str, str, int], float]:
    """`collective_s(label, kind, bytes)` over cost models per group label (compiler/cost.py);
    a label without a model costs nothing."""
    def collective_s(label: str, kind: str, nbytes: int) -> float:
        model = models.get(label)
        return 0.0 if model is None else model.collective_s(kind, nbytes)
    return collective_s


def auto(candidates: dict[str, Any], module: torch.nn.Module, config, device: torch.device,
         repeats: int = 3) -> tuple[str, str, dict[str, Any]]:
    """Config.layout="auto" over the groups of `candidates` (runtime/mesh.py's layouts, one per
    name, over the same groups): measure each group's collectives, agree them (MAX), choose.
    Collective: every rank."""
    from ..passes.context import known_passes
    from .agree import agreed_budget
    from .cost import _fit, LinearCostModel, SWEEP_BYTES, measure_groups

    hsdp = candidates["hsdp"]
    world = hsdp.world
    across = ("all_reduce", "reduce_scatter", "all_gather") if "hsdp_zero" in candidates \
        else ("all_reduce",)
    groups = [(world, ("all_gather", "reduce_scatter")),
              (hsdp.shard, ("all_gather", "reduce_scatter")), (hsdp.replicate, across)]
    times = measure_groups(groups, device, repeats)
    keys = list(times)
    flat = torch.tensor([t for k in keys for t in times[k]], dtype=torch.float64, device=device)
    world.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, count=False)
    n = len(SWEEP_BYTES)
    fitted = {k: _fit(list(zip(SWEEP_BYTES, flat.tolist()[i * n:(i + 1) * n])))
              for i, k in enumerate(keys)}
    models: dict[str, LinearCostModel] = {}
    for key, coeffs in fitted.items():
        label, _, kind = key.partition(":")
        models.setdefault(label, LinearCostModel(coeffs={})).coeffs[kind] = coeffs
    budget = agreed_budget(world, config.memory_budget, device)
    params = params_of(module, config.param_dtype, config.reduce_dtype)
    passes = known_passes() if config.auto_passes else config.passes
    name, why, figures = choose(params, world.world, hsdp.group_size, config.zero_stage,
                                config.gradient_accumulation_steps, budget,
                                collective_time(models),
                                names=tuple(n for n in ORDER if n in candidates), passes=passes)
    return name, f"auto: {why}", figures
