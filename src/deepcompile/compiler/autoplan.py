"""Which passes run, in what order (`passes="auto"`), how they fuse, and whether a pass is kept.

[Note: choosing passes] `choose` asks every pass that describes a `choose` (passes/__init__.py:
`Pass`), in its `order`, whether it runs, from `Facts`: the first agreed profile, the graphs and
the memory budget. It returns the passes worth running, in order, each with the reason, and the
ones left out with theirs. The facts do not move with the machine's load (which collectives the
graphs have, the ZeRO stage, the world size, the profiled peak against the budget), so every
launch of the same program chooses the same list; `deepcompile plan` computes the same facts
for the model it simulates and asks the same passes. The built-in ones:

* `offload_optimizer` first, when the budget is bounded and the step with all optimizer state on
  the device (the profiled peak, or the optimizer step itself) exceeds it: the passes after it
  then plan within what its plan leaves;
* `activation_budget` next, when the budget is bounded and a profiled peak still exceeds it: the
  values the backward saves are recomputed or offloaded where that is cheapest per byte
  (passes/activation_budget.py), after `offload_optimizer` (which plans on a step whose peak
  counts the state) and before the passes that spend memory left under the budget; also within
  the budget when a pass chosen after it says what more memory is worth to it (`memory_value`)
  and the room left cannot keep every parameter gathered: it then frees activations for that
  pass only where that pays ([Note: a memory trade] in passes/activation_budget.py);
* `selective_unshard` next (ZeRO-3, more than one rank, memory left under the budget): keeping a
  parameter gathered removes whole collectives, and planned before `prefetch` it values every
  gather at the cost of its own collective (after `prefetch` it would see a share of a fused one);
  at world size 1 when the compute dtype is not the masters' (a gather is then a cast of the
  local shard at every use, and a kept copy is cast once per optimizer step);
* `prefetch` (ZeRO-3, more than one rank, gathers in the graphs): the gathers that are left
  become asynchronous and fused;
* `bucket_reduce` (more than one rank, reduce-scatters in the graphs): bucketed, asynchronous
  gradient reductions;
* `overlap_refresh` (ZeRO-1/2, more than one rank, trainable parameters): the all-gather of the
  updated replicas leaves the optimizer step and runs under the next forward ([Note: deferred
  refresh] in runtime/replicas.py); last, on the profile with the buckets, since it reads only
  where the forward first reads each parameter.

The step can grow while the chosen passes are planned (a longer sequence in a re-profile) or
after (a new shape in steady state). So a pass that describes `choose_late` (`offload_optimizer`),
when left out, is asked again on the latest profiles once the chosen passes have run
(`choose_late`; it then plans last, within what they left), and the engine re-plans the passes
that describe `replans_on_drift` on a drift in steady state (`Engine._replan_on_drift`): a
budget that the first profile met is held when the step grows.

[Note: fusion policy] How `prefetch` and `bucket_reduce` group collectives (`fusion_policy`):
"overlap" splits a group where the compute between two members is clearly longer than the
newcomer's own collective (it can hide behind that compute), "cap" fuses up to the size cap.
On a GPU, NCCL runs on its own stream and a collective in flight costs the compute nothing:
"overlap". On the CPU, gloo's threads run on the cores the compute needs, so a collective is
never hidden for free and each one pays its latency: "cap".
"Clearly longer" is `SPLIT_MARGIN` times: a ±20% error on both sides of the comparison cannot
turn a fuse into a split (1.2 / 0.8 = 1.5 < 2).

[Note: keeping a pass] A pass that changed graphs is re-profiled. It is reverted — graphs and
the runtime state it configured — when its re-profiled peak exceeds the budget (and grew); a
pass that lowers a peak that is over the budget (`offload_optimizer`: within it, or toward it
where nothing brings it within) is kept however slow: reverting it would raise a peak that
already runs out of memory (`by_memory`). Otherwise, unless `Config.measure_steps` is 0, it is
timed against the graphs from before it, in interleaved steps ([Note: interleaved measurement]
in compiler/trial.py), and reverted when it is slower with confidence: every measured step
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

from ..passes import Facts, get_pass, known_passes
from ..passes._common import SPLIT_MARGIN  # noqa: F401  (documented here)
from ..passes._common import mib as _mib
from ..runtime import ops
from ..runtime.accumulators import accumulator_bytes
from ..runtime.kept import kept_bytes

TIME_MARGIN = 0.03     # a pass is slower when its median step is > 3% slower (and see verdict)

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


def facts(ctx, *, zero_stage: int, warmup_steps: int, late: bool = False) -> Facts:
    """The facts `choose` reads, from the latest agreed profiles and the graphs (the same on
    every rank)."""
    gathers = reduces = 0
    for slot in ctx.slots.values():
        if not getattr(slot, "training", True):
            continue
        for node in slot.gm.graph.nodes:
            if node.op == "call_function":
                gathers += node.target is ops.ALLGATHER
                reduces += node.target is ops.REDUCE_GRAD
    # world size 1: a gather casts the shard where the compute dtype is not the master's
    casts = sum(e.zero_stage == 3 and e.compute_dtype != e.shard.dtype and e.lowp is None
                for e in ctx.registry) if ctx.world_size == 1 else 0
    store = getattr(ctx.runtime, "offload", None)
    step_bytes, unmovable = None, "no movable optimizer state"
    if store is not None and store.movable():
        step_bytes = store.step_bytes()
    elif getattr(store, "flat", None) is not None and store.flat.inner is None:
        unmovable = (f"{type(store.flat.facade).__name__} steps parameter by parameter (not an "
                     "elementwise torch.optim optimizer): its state cannot be offloaded")
    replicas = 0 if zero_stage == 3 or ctx.world_size == 1 else sum(
        e.padded_numel * e.compute_dtype.itemsize for e in ctx.registry if e.shard.requires_grad)
    accumulate = ctx.runtime.step.gradient_accumulation_steps > 1
    keep_all = sum(kept_bytes(e) + (accumulator_bytes(e) if accumulate else 0)
                   for e in ctx.registry if e.zero_stage == 3)
    return Facts(world_size=ctx.world_size, zero_stage=zero_stage, replica_bytes=replicas,
                 keep_all_bytes=keep_all,
                 memory_budget=ctx.memory_budget,
                 peak_bytes=max((p.peak_bytes for p in ctx.profiles.values()), default=0),
                 gathers=gathers, reduces=reduces, casts=casts, step_bytes=step_bytes,
                 unmovable=unmovable, warmup_steps=warmup_steps, late=late)


def choose(f: Facts) -> tuple[list[Choice], list[Choice]]:
    """(passes to run in order, passes left out), each with its reason ([Note: choosing
    passes]): every registered pass that describes a `choose`, asked in its `order`."""
    chosen: list[Choice] = []
    out: list[Choice] = []
    for p in sorted((get_pass(n) for n in known_passes()), key=lambda p: p.order):
        if p.choose is not None:
            yes, why = p.choose(f)
            (chosen if yes else out).append(Choice(p.name, why))
    return chosen, out


def choose_late(f: Facts, ran: set[str]) -> list[Choice]:
    """The passes asked again once the chosen ones ran (`Pass.choose_late`; `f.late`) that did
    not run and now should ([Note: choosing passes])."""
    late = []
    for p in sorted((get_pass(n) for n in known_passes()), key=lambda p: p.order):
        if p.choose_late and p.choose is not None and p.name not in ran:
            yes, why = p.choose(f)
            if yes:
                late.append(Choice(p.name, why))
    return late


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
    change = f"measured step {mb * 1e3:.2f} -> {ma * 1e3:.2f} ms (median of {len(b)} -> {len(a)})"
    if ma < mb:
        return True, f"faster: {change}"
    if time_settled(b, a):
        # the medians of a few steps can be far apart when one step is an outlier: what keeps
        # the pass is the step named here
        return True, (f"kept: a step after it ({min(a) * 1e3:.2f} ms) was no slower than a step "
                      f"before it ({max(b) * 1e3:.2f} ms); {change}")
    if ma > mb * (1 + TIME_MARGIN):
        return False, f"slower: {change}, every step after slower than every step before"
    return True, f"kept within the noise: {change}"
