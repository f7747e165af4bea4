"""Which passes run, in what order (`passes="auto"`), how they fuse, and whether a pass is kept.

[Note: choosing passes] `choose` reads the first agreed profile, the graphs and the memory
budget, and returns the built-in passes worth running, in order, each with the reason, and the
ones left out with theirs. It only reads facts that do not move with the machine's load (which
collectives the graphs have, the ZeRO stage, the world size, the profiled peak against the
budget), so every launch of the same program chooses the same list:

* `offload_optimizer` first, when the budget is bounded and the step with all optimizer state on
  the device (the profiled peak, or the optimizer step itself) exceeds it: the passes after it
  then plan within what its plan leaves;
* `selective_unshard` next (ZeRO-3, more than one rank, memory left under the budget): keeping a
  parameter gathered removes whole collectives, and planned before `prefetch` it values every
  gather at the cost of its own collective (after `prefetch` it would see a share of a fused one);
  at world size 1 when the compute dtype is not the masters' (a gather is then a cast of the
  local shard at every use, and a kept copy is cast once per optimizer step);
* `prefetch` (ZeRO-3, more than one rank, gathers in the graphs): the gathers that are left
  become asynchronous and fused;
* `bucket_reduce` (more than one rank, reduce-scatters in the graphs): bucketed, asynchronous
  gradient reductions.

The step can grow while the chosen passes are planned (a longer sequence in a re-profile) or
after (a new shape in steady state). So `offload_optimizer`, when left out, is asked again on
the latest profiles once the chosen passes have run (`offload_choice(late=True)`; it then plans
last, within what they left), and the engine plans it on a drift in steady state
(`Engine._replan_offload`): a budget that the first profile met is held when the step grows.

[Note: fusion policy] How `prefetch` and `bucket_reduce` group collectives (`fusion_policy`):
"overlap" splits a group where the compute between two members is clearly longer than the
newcomer's own collective (it can hide behind that compute), "cap" fuses up to the size cap.
On a GPU, NCCL runs on its own stream and a collective in flight costs the compute nothing:
"overlap". On the CPU, gloo's threads run on the cores the compute needs, so a collective is
never hidden for free and each one pays its latency: "cap" (measured on 2 cores: in the experiment the README's
Benchmarks section describes, fusing to the cap was faster than the overlap rule in every cell).
"Clearly longer" is `SPLIT_MARGIN` times: a ±20% error on both sides of the comparison cannot
turn a fuse into a split (1.2 / 0.8 = 1.5 < 2).

[Note: keeping a pass] A pass that changed graphs is re-profiled. It is reverted — graphs and
the runtime state it configured — when its re-profiled peak exceeds the budget (and grew); a
pass that lowers a peak that is over the budget (`offload_optimizer`: within it, or toward it
where nothing brings it within) is kept however slow: reverting it would raise a peak that
already runs out of memory (`by_memory`). Otherwise, unless `Config.measure_steps` is 0, it is
timed against the graphs from before it, in interleaved steps ([Note: interleaved measurement]
in compiler/pipeline.py), and reverted when it is slower with confidence: every measured step
after it slower than every step before it (with 3 steps each, a chance of 1 in 20 when nothing
changed), and the median slower by more than `TIME_MARGIN`. A pass within the noise is kept:
plans do not flip with the load of the machine. So once one step after it is no slower than
one step before it, no later step can revert it (`time_settled`), and the trial stops there: a
pass that clearly helps is decided after one step of each side, and the decision is the one
the whole trial would have given on the same steps. Every figure read is agreed over the ranks
(peaks in the agreed profiles, each step's time the slowest rank's), so every rank stops the
trial at the same step and decides alike.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from ..passes._common import SPLIT_MARGIN  # noqa: F401  (documented here)
from ..runtime import ops

TIME_MARGIN = 0.03     # a pass is slower when its median step is > 3% slower (and see verdict)

# the built-in passes, in the order `choose` runs them
ORDER = ("offload_optimizer", "selective_unshard", "prefetch", "bucket_reduce")


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"pass": self.name, "reason": self.reason}


def fusion_policy(device_type: str) -> tuple[str, str]:
    """(policy, why) for `prefetch` and `bucket_reduce` ([Note: fusion policy])."""
    if device_type == "cuda":
        return "overlap", ("GPU: collectives run on their own stream, so a group is split where "
                           "the compute between its members can hide the next collective")
    return "cap", ("CPU: gloo's threads share the cores with the compute, so a collective in "
                   "flight is not hidden for free; groups are fused up to the size cap")


def _counts(ctx) -> tuple[int, int]:
    gathers = reduces = 0
    for slot in ctx.slots.values():
        if not getattr(slot, "training", True):
            continue
        for node in slot.gm.graph.nodes:
            if node.op == "call_function":
                gathers += node.target is ops.ALLGATHER
                reduces += node.target is ops.REDUCE_GRAD
    return gathers, reduces


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def offload_choice(ctx, warmup_steps: int, late: bool = False) -> tuple[bool, str]:
    """Whether offload_optimizer runs, and why, from the latest agreed profiles. `late`: asked
    after the chosen passes ran ([Note: choosing passes]: the step grew while they were
    planned, e.g. a longer sequence profiled on the way)."""
    budget = ctx.memory_budget
    store = getattr(ctx.runtime, "offload", None)
    if budget == float("inf"):
        return False, "memory budget unbounded: all optimizer state stays"
    if store is None or not store.movable():
        flat = getattr(store, "flat", None)
        return False, ("no movable optimizer state" if flat is None or flat.inner is not None
                       else f"{type(flat.facade).__name__} steps parameter by parameter (not an "
                       "elementwise torch.optim optimizer): its state cannot be offloaded")
    if warmup_steps == 0:
        return False, "warmup_steps is 0: the state it plans for does not exist when profiling starts"
    peak = max((p.peak_bytes for p in ctx.profiles.values()), default=0)
    need = max(peak, store.step_bytes())
    if need <= budget:
        return False, (f"the step needs {_mib(need)} with all optimizer state on the device, "
                       f"within the budget {_mib(budget)}")
    return True, (f"the step needs {_mib(need)} with all optimizer state on the device, over the "
                  f"budget {_mib(budget)}: "
                  + ("its profiles grew after the passes were chosen: offload last" if late else
                     "offload first, later passes plan in what is left"))


def choose(ctx, *, zero_stage: int, warmup_steps: int) -> tuple[list[Choice], list[Choice]]:
    """(passes to run in order, passes left out), each with its reason ([Note: choosing
    passes]). Reads only what every rank agrees on."""
    from ..passes import known_passes

    gathers, reduces = _counts(ctx)
    world, budget = ctx.world_size, ctx.memory_budget
    peak = max((p.peak_bytes for p in ctx.profiles.values()), default=0)
    chosen: list[Choice] = []
    out: list[Choice] = []
    store = getattr(ctx.runtime, "offload", None)

    def add(name: str, yes: bool, why: str) -> None:
        if name in known_passes():
            (chosen if yes else out).append(Choice(name, why))

    add("offload_optimizer", *offload_choice(ctx, warmup_steps))
    one = "world size 1: a gather is a view of the local shard, a reduction a cast"
    # selective_unshard: at world size 1 a gather casts the shard when the compute dtype is not
    # the masters' (param_dtype), at every use; a kept copy is cast once per optimizer step
    from ..passes.selective_unshard import candidate

    casts = sum(candidate(e, 1) for e in ctx.registry) if world == 1 else 0
    room = budget - peak
    if world == 1 and not casts:
        add("selective_unshard", False, "world size 1, compute in the masters' dtype: a gather "
                                        "is a view of the local shard")
    elif zero_stage < 3:
        add("selective_unshard", False, f"ZeRO-{zero_stage}: parameters are replicated")
    elif not gathers:
        add("selective_unshard", False, "no parameter gathers in the graphs")
    elif room <= 0:
        add("selective_unshard", False, f"no memory left: profiled peak {_mib(peak)} >= "
                                        f"budget {_mib(budget)}")
    elif world == 1:
        add("selective_unshard", True,
            ("memory budget unbounded" if room == float("inf") else f"{_mib(room)} under the "
             "budget") + f": world size 1, {casts} parameters cast to their compute dtype at "
            "every use; a kept copy is cast once per optimizer step")
    else:
        add("selective_unshard", True,
            ("memory budget unbounded" if room == float("inf") else f"{_mib(room)} under the "
             "budget") + ": keeping parameters gathered removes whole collectives (before "
            "prefetch, so that each gather is valued at its own collective's cost)")
    # prefetch
    if world == 1:
        add("prefetch", False, one)
    elif zero_stage < 3:
        add("prefetch", False, f"ZeRO-{zero_stage}: parameters are replicated, nothing to gather")
    elif not gathers:
        add("prefetch", False, "no parameter gathers in the graphs")
    else:
        add("prefetch", True, f"{gathers} gathers in the graphs: the ones not kept become "
                              "asynchronous and fused")
    # bucket_reduce
    if world == 1:
        add("bucket_reduce", False, one)
    elif not reduces:
        add("bucket_reduce", False, "no gradient reductions in the graphs")
    else:
        add("bucket_reduce", True, f"{reduces} gradient reductions: bucketed and asynchronous")
    order = {name: i for i, name in enumerate(ORDER)}
    chosen.sort(key=lambda c: order.get(c.name, len(order)))
    return chosen, out


def by_memory(before: dict[str, Any], after: dict[str, Any],
              budget: float) -> tuple[bool, str] | None:
    """The verdict where the re-profiled peaks decide it whatever the steps' times, else None
    ([Note: keeping a pass]: such a pass is not timed)."""
    pb, pa = before["peak_bytes"], after["peak_bytes"]
    if pa > budget and pa > pb:
        return False, f"re-profiled peak {_mib(pa)} exceeds the budget {_mib(budget)}"
    if pb > budget >= pa:   # reverting it would run over the budget, however slow it is
        return True, f"kept: brings the peak {_mib(pb)} within the budget {_mib(budget)}"
    if pb > budget and pa < pb:   # over the budget either way: memory comes before time
        return True, (f"kept: lowers the peak {_mib(pb)} -> {_mib(pa)}, still over the budget "
                      f"{_mib(budget)} (reverting it would raise the peak)")
    return None


def time_settled(before: list[float], after: list[float]) -> bool:
    """Whether more timed steps can no longer revert the pass: some step after it was no
    slower than some step before it ([Note: keeping a pass])."""
    return bool(before and after) and min(after) <= max(before)


def verdict(before: dict[str, Any], after: dict[str, Any], budget: float) -> tuple[bool, str]:
    """Whether a pass is kept, and why ([Note: keeping a pass]). `before`/`after`: step
    summaries (`peak_bytes`, and `measured_s`: agreed step times, when measured)."""
    decided = by_memory(before, after, budget)
    if decided is not None:
        return decided
    b, a = before.get("measured_s") or [], after.get("measured_s") or []
    if not a or not b:
        return True, "kept (judged on memory only: steps not measured)"
    mb, ma = statistics.median(b), statistics.median(a)
    change = f"measured step {mb * 1e3:.2f} -> {ma * 1e3:.2f} ms (median of {len(a)})"
    if not time_settled(b, a) and ma > mb * (1 + TIME_MARGIN):
        return False, f"slower: {change}, every step after slower than every step before"
    if ma < mb:
        return True, f"faster: {change}"
    return True, f"kept within the noise: {change}"
