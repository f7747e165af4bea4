"""The profile-guided pipeline: the phase machine that takes an engine's graphs from warm-up to
the steady state. It owns the slot runner (compiler/runner.py: every graph call), the pass
manager (compiler/pass_manager.py: one pass at a time, kept or reverted), a pass's timed trial
(compiler/trial.py) and the plan cache (compiler/cache.py).

Phases advance at optimizer-step boundaries (`end_step`), on every rank at once:

  WARMUP   `warmup_steps` steps run normally (the first one compiles).
  PROFILE  `profile_steps` steps run every graph through the profiler; at the end the local
           profiles are agreed across ranks (compiler/agree.py). After the first profile, with
           `passes="auto"`, the passes to run are chosen from it (compiler/autoplan.py).
  ...      the next pass plans from the latest agreed profiles and rewrites the graphs
           (compiler/pass_manager.py); a pass that changed a graph is followed by PROFILE and
           MEASURE, and then kept or reverted ([Note: keeping a pass] in compiler/autoplan.py);
           a pass that changed nothing is not.
  MEASURE  at most 2 x `measure_steps` steps that alternate between the graphs after the pass
           and the graphs from before it, each step's time the slowest rank's, until the
           decision is certain ([Note: interleaved measurement] in compiler/trial.py).
  STEADY   the final graphs run, compiled by the configured compiler (Inductor compiles once,
           here: warm-up and profiling run the FX graphs). When the step drifts from what was
           planned (a graph compiled after planning, larger symbolic sizes: compiler/drift.py)
           the `on_drift` listeners may `request_replan`: PROFILE again, then the passes named
           (the engine: `offload_optimizer`) and the kept ones, from the graphs as compiled
           ([Note: a re-plan starts over] in compiler/pass_manager.py), judged on memory only,
           not timed against the plan they replace (which no longer fits).

With `cache_dir`, the agreed profiles and the passes' decisions (reverted ones marked) are
stored under a key made of everything that determines them; a later run with the same key
applies the stored decisions after warm-up and goes straight to STEADY. Rank 0 reads and writes
the cache and broadcasts what it found, so every rank takes the same path.

Per step the pipeline keeps O(1) figures (`step_log`: phase and time of the first steps;
`last_step`: the latest step's time and collectives) for `engine.metrics()` and the plots.
[Note: setup steps] The steps before the first STEADY one are the setup; rank 0 logs one line
as each phase begins (where the setup is, and an estimate of its length), and one when the plan
is final; `setup_steps` counts them once it is.
"""

from __future__ import annotations

import collections
import functools
import logging
import statistics
import time
from typing import Any, Callable

import torch

from .. import _compat
from ..passes import PassContext
from ..runtime.guardrails import Guardrails
from . import autoplan
from . import cache as _cache
from .agree import agree_decisions, agree_max, agree_profiles, agreed_budget
from .cost import CostModel, LinearCostModel, calibrate
from .host import HostFigures, host_needs, measure_host
from .pass_manager import PassManager
from .phases import Phase
from .profiler import GraphProfile
from .runner import SlotRunner
from .slots import GraphSlot
from .trial import Trial

log = logging.getLogger("deepcompile")


STEP_LOG = 512   # steps whose phase and time are kept (the step-time plot)
STEADY_OUTSIDE = 32      # steady steps whose time outside the graphs the report's median takes
MIN_STEADY_OUTSIDE = 3   # fewer, and the report shows the profiled figure


def synchronize(device: torch.device) -> None:
    """Wait for the device's work (a no-op on the CPU, where every op has finished)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(profiles: dict[str, GraphProfile], order: list[str], budget: float,
              after_step: list[dict] = (), outside_s: float = 0.0) -> dict:
    """Step-level figures from per-graph profiles, weighted by how often each graph runs, plus
    the collectives the runtime runs after the optimizer step (`after_step`: refreshes) and the
    measured time of the step outside the graphs (`outside_s`: [Note: outside the graphs])."""
    runs = {k: order.count(k) or 1 for k in profiles}
    in_graphs = round(sum(runs[k] * p.collectives() for k, p in profiles.items()))
    outside = sum(c["count"] for c in after_step)
    return {
        "collectives": in_graphs + outside,
        "collectives_in_graphs": in_graphs,
        "collectives_after_step": outside,
        "comm_s": sum(runs[k] * p.comm_s() for k, p in profiles.items()),
        "exposed_comm_s": sum(runs[k] * p.exposed_comm_s() for k, p in profiles.items()),
        "compute_s": sum(runs[k] * p.compute_s() for k, p in profiles.items()),
        "outside_graphs_s": outside_s,
        "graphs_s": sum(runs[k] * p.total_s for k, p in profiles.items()),
        "peak_bytes": max((p.peak_bytes for p in profiles.values()), default=0),
        "budget_bytes": None if budget == float("inf") else budget,
    }


class Pipeline:
    def __init__(self, *, runtime, config, device: torch.device, engine_fingerprint: dict,
                 guard: Guardrails | None = None):
        self.runtime = runtime
        self.registry = runtime.registry
        self.comm = runtime.comm
        self.config = config
        self.device = device
        self.phase = Phase.WARMUP if config.warmup_steps > 0 else Phase.PROFILE
        # steady-state drift (compiler/drift.py): listeners get a reason; `request_replan`
        # runs passes again on new profiles from the next step on
        self.on_drift: list[Callable[[str], None]] = []
        # every graph call; `guard`: failures and cross-rank checks (runtime/guardrails.py)
        self.runner = SlotRunner(
            runtime=runtime, config=config, device=device, phase=self.phase,
            guard=guard if guard is not None else Guardrails(runtime.comm, config),
            on_drift=self.on_drift, kept_passes=lambda: self.passes.kept())
        self.slots: dict[str, GraphSlot] = self.runner.slots   # representatives and members
        self._steps_in_phase = 0
        self._profile_label = "initial"
        self.order: list[str] = []               # slot keys in execution order, last profiled step
        # [Note: outside the graphs] The profiled graphs' node times are not the whole step:
        # the optimizer step and the collectives around it (refreshes, clipping, the divergence
        # check) run outside them. The engine times that part of every step (`end_step`); the
        # profile takes the median over the phase's steps, the MIN over ranks (a rank that
        # arrives early at a collective waits there for the others: [Note: agreed node times]).
        # Not counted: the Python between graphs (Dynamo's guards, AOTAutograd's wrappers). The
        # profiled step's own wall time is no measure of it: it includes lowering the graphs a
        # pass rewrote and the profiler's bookkeeping.
        # That figure is what the passes had; what the report shows (`step_summary`) is the
        # steady steps' own, once there are a few: the median of the last STEADY_OUTSIDE, this
        # rank's. One profiled step is one sample of a time that varies from step to step with
        # its collectives' latency (gloo's latency varies several-fold from step to step for
        # the same work), and the profile phase has one step by default.
        self._outside_now: list[float] = []
        self._outside_steady: collections.deque[float] = collections.deque(maxlen=STEADY_OUTSIDE)
        self.outside_s = 0.0
        self._step_order: list[str] = []
        self.cost: CostModel | None = None
        self.host: HostFigures | None = None   # measured with the cost model
        self.memory_budget = agreed_budget(self.comm, config.memory_budget, device)
        self.fusion, self.fusion_reason = autoplan.fusion_policy(device.type)
        self.passes = PassManager(slots=self.slots, runtime=runtime, context=self._context,
                                  summarize=self._summary)
        self.passes.configure(config.pass_list)
        self._awaiting: dict | None = None       # pass log entry waiting for its re-profile
        # a pass's entry that freed memory for the next pass, with the drift marks from before
        # it: judged with that pass ([Note: a memory trade] in passes/activation_budget.py)
        self._trade: tuple[dict, tuple] | None = None
        self.trial: Trial | None = None          # the interleaved measurement under way
        self.cache = _cache.PlanCache(config.cache_dir, self.comm, engine_fingerprint)
        self.timings: dict[str, Any] = {"warmup_steps_s": [], "profiled_steps_s": [],
                                        "measured_steps_s": [], "calibration_s": 0.0,
                                        "passes_s": 0.0, "steady_steps_s": []}
        self.step_log: list[tuple[str, float]] = []   # (phase, seconds) of the first steps
        self.last_step: dict[str, Any] = {"phase": None, "seconds": None}
        self.steps = 0
        # the runner's drift marks before the pass under way (`SlotRunner.drift_marks`)
        self._before_pass: tuple[dict[str, tuple[int, ...] | None], set[str]] = ({}, set())
        self._replan: tuple[list[str], str] | None = None   # this rank's request
        self._replan_agreed = False              # ... and every rank knows of a request
        self._replanning: str | None = None      # the reason of the re-plan under way
        self.replans = 0
        self.setup_steps: int | None = None   # [Note: setup steps]; None until the plan is final
        self._adopted: dict | None = None   # [Note: the plan in a checkpoint]: waiting for graphs
        self._calibrate_if_needed()
        if self.comm.rank == 0 and self.phase is Phase.WARMUP:
            log.info("deepcompile: setup, step %d: warm-up (%d steps, the first compiles)",
                     runtime.step.optimizer_steps + 1, config.warmup_steps)

    @property
    def pass_log(self) -> list[dict]:
        return self.passes.entries

    # -- schedule ---------------------------------------------------------------------------
    def wait_device(self) -> None:
        """[Note: timed steps on a GPU] The passes' verdicts compare step times: before the
        steady state they must be the device's, not how long the host took to launch the work.
        The engine calls this as each of its calls of a training step returns (forward,
        backward, step), so that the device's work is done inside the call that launched it,
        not in the user's code after it (nothing else need wait for the device: with
        on_nonfinite="off" no step does). Steady steps are left alone: a sync would cost the
        overlap of a step's tail with the next."""
        if self.phase is not Phase.STEADY:
            synchronize(self.device)

    def end_step(self, seconds: float, outside_s: float = 0.0) -> None:
        """Called by the engine after every optimizer step, on every rank; `seconds`: the
        engine's own work in the step ([Note: the engine's step time] in engine.py);
        `outside_s`: how long its optimizer step took ([Note: outside the graphs])."""
        phase = self.phase
        self.steps += 1
        self.last_step = {"phase": phase.value, "seconds": seconds}
        if len(self.step_log) < STEP_LOG:
            self.step_log.append((phase.value, seconds))
        if self._adopted is not None and self._try_adopt(final=True):
            return   # [Note: the plan in a checkpoint]: it applies from the next step
        if phase is Phase.WARMUP:
            self.timings["warmup_steps_s"].append(seconds)
            self._steps_in_phase += 1
            if self._steps_in_phase >= self.config.warmup_steps:
                self._after_warmup()
        elif phase is Phase.PROFILE:
            self.timings["profiled_steps_s"].append(seconds)
            self._steps_in_phase += 1
            self._step_order, self.runner.order_now = self.runner.order_now, []
            self._outside_now.append(outside_s)
            if self._steps_in_phase >= self.config.profile_steps:
                self._finish_profile()
        elif phase is Phase.MEASURE:
            self.timings["measured_steps_s"].append(seconds)
            self._steps_in_phase += 1
            if self.trial.record(seconds):   # the graphs are back on the side after the pass
                entry, self.trial = self.trial.entry, None
                self._judge(entry)
                self._next_pass()
        else:
            if len(self.timings["steady_steps_s"]) < 64:
                self.timings["steady_steps_s"].append(seconds)
            self._outside_steady.append(outside_s)
            if self._replan is not None and self._replan_agreed:
                passes, reason = self._replan
                self._replan, self._replan_agreed = None, False
                self.replans += 1
                # [Note: a re-plan starts over] in compiler/pass_manager.py
                self.passes.queue = self.passes.restart(passes)
                self._replanning = reason
                self._enter(Phase.PROFILE, f"replan: {reason}")

    def request_replan(self, passes: list[str], reason: str) -> None:
        """Run `passes` again (with the kept passes: `PassManager.restart`), on new profiles,
        from the next optimizer step after every rank agreed to (`agree_replan`; steady state
        only)."""
        if self.phase is Phase.STEADY and self._replan is None:
            log.warning("deepcompile: re-planning %s once the ranks agree (at the next step "
                        "boundary): %s", ", ".join(passes), reason)
            self._replan = (list(passes), reason)

    def replan_request(self) -> bool | None:
        """What this rank brings to the re-plan agreement at the step boundary ([Note: agreed
        re-planning] in compiler/drift.py): whether it asks; None where no re-plan can be
        asked for (not in the steady state, or nothing listens to drift), alike on every rank."""
        if self.phase is not Phase.STEADY or not self.on_drift:
            return None
        return self._replan is not None

    def agree_replan(self, asked: bool) -> None:
        """Some rank asked for a re-plan (`asked`, the same on every rank): every rank re-plans
        from the next step on ([Note: agreed re-planning]). A rank whose own step did not drift
        tells its drift listeners now, before the optimizer step (the engine puts all state off
        the device, as the rank that asked did, and requests the same passes)."""
        if not asked:
            return
        if self._replan is None:
            for listener in self.on_drift:
                listener("the step drifted on another rank")
            if self._replan is None:
                raise RuntimeError("deepcompile: another rank re-plans and this one did not "
                                   "request it: the ranks would plan differently")
        self._replan_agreed = True

    def _enter(self, phase: Phase, label: str = "") -> None:
        self.phase, self._steps_in_phase = phase, 0
        self.runner.phase = phase
        if phase is Phase.PROFILE:
            self._profile_label = label
            self.runner.order_now = []
            self._outside_now = []
            self._outside_steady.clear()
            for slot in self.slots.values():
                slot.pending.clear()
        if self.comm.rank == 0:
            log.info("%s", self._announce(phase, label))
        if phase is Phase.STEADY:
            for slot in self.slots.values():
                slot.prune()
            if self.setup_steps is None:
                self.setup_steps = self.steps

    def _announce(self, phase: Phase, label: str) -> str:
        """The line that says where the setup is as `phase` begins ([Note: setup steps])."""
        done = self.runtime.step.optimizer_steps   # the training's steps (a resumed one's too)
        step = done + 1   # the phase's first step
        what = "setup" if self.setup_steps is None else "re-plan"
        if phase is Phase.STEADY:
            entries = self.passes.current()
            kept = [e["pass"] for e in entries if e.get("kept", True) and e["changed"]]
            reverted = [e["pass"] for e in entries if not e.get("kept", True)]
            idle = [e["pass"] for e in entries if e.get("kept", True) and not e["changed"]]
            return (f"deepcompile: {'plan' if what == 'setup' else 're-plan'} final at step "
                    f"{done}{f' ({label})' if label else ''}: passes kept: "
                    f"{', '.join(kept) or 'none'}"
                    + (f"; reverted: {', '.join(reverted)}" if reverted else "")
                    + (f"; changed nothing: {', '.join(idle)}" if idle else "")
                    + f"; steady state from step {step}")
        left = self._steps_left(phase)
        where = f"deepcompile: {what}, step {step}" + (f" of about {done + left}"
                                                       if left is not None else "")
        if phase is Phase.MEASURE:
            return (f"{where}: timing {self.trial.entry['pass']} against the graphs before it "
                    f"(2 to {2 * self.config.measure_steps} steps)")
        return f"{where}: {phase.value}" + (f" ({label})" if label else "")

    def _steps_left(self, phase: Phase) -> int | None:
        """About how many steps the setup has left as `phase` begins: each pass left
        re-profiled and timed for the least a trial takes (one step of each side); None before
        `passes="auto"` chose them."""
        if self.config.auto_passes and self.passes.chosen is None:
            return None
        trial = 2 if self.config.measure_steps else 0
        left = len(self.passes.queue) * (self.config.profile_steps + trial)
        if phase is Phase.PROFILE:
            left += self.config.profile_steps + (trial if self._awaiting is not None else 0)
        elif phase is Phase.MEASURE:
            left += trial
        return left

    def _after_warmup(self) -> None:
        # the cache's key describes the graphs as compiled, before any pass rewrote them
        if self.config.cache_dir is not None and self._load_cached_plan():
            self._enter(Phase.STEADY)
        elif self.config.profile_steps > 0:
            self._enter(Phase.PROFILE, "initial")
        else:
            self._enter(Phase.STEADY)

    def _calibrate_if_needed(self) -> None:
        if self.config.profile_steps == 0:
            return
        t0 = time.perf_counter()
        self.cost = calibrate(self.comm, self.device, layout=self.runtime.layout)
        self.host = self._measure_host()
        self.timings["calibration_s"] = time.perf_counter() - t0

    def _measure_host(self) -> HostFigures:
        return measure_host(self.runtime, host_needs(self.config), self.device)

    def _finish_profile(self) -> None:
        self.order = list(self._step_order)  # one step's execution order
        local = statistics.median(self._outside_now) if self._outside_now else 0.0
        self.outside_s = -agree_max(self.comm, [-local], self.device)[0]
        agreed = agree_profiles(self.comm, self.slots, self.order, self.device)
        for key, prof in agreed.items():
            self.slots[key].history.append((self._profile_label, prof))
        entry = self._awaiting
        if entry is not None:          # a pass's re-profile
            entry["after"] = self._summary(self.latest_profiles())
            decided = autoplan.by_memory(entry["before"], entry["after"], self.memory_budget)
            if entry["decisions"].get("trade") and (decided is None or decided[0]):
                # judged with the pass it freed memory for, which plans next
                self._trade, self._awaiting = (entry, self._before_pass), None
                self._next_pass()
                return
            # a re-plan is not timed against the plan before it: that plan no longer fits; nor
            # is a pass whose memory decides it ([Note: keeping a pass] in compiler/autoplan.py)
            if self.config.measure_steps > 0 and not entry.get("replan") and decided is None:
                self._start_measure(entry)
                return
            self._judge(entry)
        elif self.config.auto_passes and self.passes.chosen is None:
            self.passes.choose(zero_stage=self.registry.zero_stage,
                               warmup_steps=self.config.warmup_steps)
        self._next_pass()

    def _start_measure(self, entry: dict) -> None:
        first, changed = entry, entry["changed"]
        if entry.get("traded"):   # the trade and this pass against the graphs before the trade
            first = self._trade[0]
            changed = sorted(set(first["changed"]) | set(changed))
        self.trial = Trial(entry, self.passes.snapshot(first), runner=self.runner,
                           measure_steps=self.config.measure_steps, changed=changed)
        self._enter(Phase.MEASURE, f"{entry['pass']} against the graphs before it")

    def _judge(self, entry: dict) -> bool:
        self._awaiting = None
        trade, before = None, self._before_pass
        if entry.get("traded"):
            (trade, before), self._trade = self._trade, None
        kept = self.passes.judge(entry, self.memory_budget, trade)
        if not kept:
            self.runner.forget_profile(before)
        return kept

    def _drop_trade(self, why: str) -> None:
        """Revert the trade waiting for its pass ([Note: a memory trade]): the memory it freed
        buys nothing."""
        self._close_trade(False, why)

    def _close_trade(self, keep: bool, why: str) -> None:
        (trade, before), self._trade = self._trade, None
        trade["verdict"] = why
        self.passes.close(trade, keep)
        if not keep:
            self.runner.forget_profile(before)

    def _next_pass(self) -> None:
        """Plan and apply the next pass; enter PROFILE after one that changed a graph, STEADY
        when none is left."""
        t0 = time.perf_counter()
        while self.passes.queue or (
                self.passes.retry() if self._replanning is not None else
                self.config.auto_passes and self.passes.choose_late(
                    zero_stage=self.registry.zero_stage, warmup_steps=self.config.warmup_steps)):
            # what the profiles before this pass saw (restored if it is reverted: _judge)
            before = self.runner.drift_marks()
            name = self.passes.queue.pop(0)
            if self.passes.waits(name):
                continue
            if self._trade is not None and name != self._trade[0]["decisions"]["trade"]["for"]:
                self._drop_trade(f"reverted: {name} plans next, not the pass it freed memory for")
            entry = self.passes.start(name)
            self._before_pass = before
            if self._trade is not None:   # judged with the trade, from the step before it
                if entry["changed"]:
                    entry["traded"], entry["before"] = True, self._trade[0]["before"]
                elif self._trade[0]["before"]["peak_bytes"] > self.memory_budget >= \
                        self._trade[0]["after"]["peak_bytes"]:
                    # the pass needs nothing more with the memory freed (offload_optimizer
                    # keeps all its state on the device): the trade alone meets the budget
                    self._close_trade(True, f"kept: with the memory it freed, {name} changes "
                                            "nothing and the step is within the budget")
                else:
                    self._drop_trade(f"reverted: {name} changed nothing with the memory it freed")
            if self._replanning is not None:
                entry["replan"] = self._replanning
            agree_decisions(self.comm, entry["pass"], entry["decisions"])   # before any graph runs
            if entry["changed"]:
                self._awaiting = entry
                self.timings["passes_s"] += time.perf_counter() - t0
                self._enter(Phase.PROFILE, f"after {entry['pass']}")
                return
            self.passes.unchanged(entry)
        if self._trade is not None:
            self._drop_trade("reverted: the pass it freed memory for did not run")
        self.timings["passes_s"] += time.perf_counter() - t0
        if self.config.cache_dir is not None and not self.replans:   # a cached plan is the first
            self.cache.store({**self._record(),
                              "profiling_overhead_s": self.profiling_overhead_s()})
        self._replanning = None
        self._enter(Phase.STEADY)

    def _summary(self, profiles: dict[str, GraphProfile]) -> dict:
        return summarize(profiles, self.order, self.memory_budget,
                         self.runtime.after_step_collectives(), self.outside_s)

    def step_summary(self) -> dict | None:
        """The step as the latest profiles see it (`summarize`), with the time outside the
        graphs measured over the steady steps where there are enough of them ([Note: outside
        the graphs]); `outside_graphs_from` says which. None before any profile."""
        profiles = self.latest_profiles()
        if not profiles:
            return None
        summary = self._summary(profiles)
        steady = list(self._outside_steady)
        if len(steady) >= MIN_STEADY_OUTSIDE:
            summary["outside_graphs_s"] = statistics.median(steady)
            summary["outside_graphs_from"] = f"median of {len(steady)} steady steps"
        else:
            summary["outside_graphs_from"] = "profiled step(s)"
        return summary

    def _context(self) -> PassContext:
        # the profiles of the graphs as they are: a graph a pass rewrote whose structure did not
        # run in the re-profile that followed ([Note: graph structure] in compiler/families.py)
        # has none, and the later passes leave it as it is
        if self.host is None:   # a plan loaded from the cache skipped the calibration
            self.host = self._measure_host()
        current = {k: p for k, p in self.latest_profiles().items()
                   if p.version == self.slots[k].version}
        return PassContext(slots=self.runner.planning(), profiles=current, order=self.order,
                           registry=self.registry, runtime=self.runtime, cost=self.cost,
                           memory_budget=self.memory_budget, world_size=self.comm.world,
                           decisions=self.passes.decisions(), fusion=self.fusion,
                           layout=self.runtime.layout, host_step_rate=self.host.step_rate,
                           host_capacity=self.host.capacity)

    def latest_profiles(self) -> dict[str, GraphProfile]:
        return {k: s.profile for k, s in self.slots.items() if s.profile is not None}

    # -- plan cache, and the plan in a checkpoint --------------------------------------------
    def _record(self) -> dict:
        """What re-applies the plan in force and what the report shows of how it was made:
        the cost model, the step's graph order, the agreed profiles, the passes' entries (the
        reverted ones marked) and `passes="auto"`'s choice."""
        return {
            "cost": self.cost.to_dict() if isinstance(self.cost, LinearCostModel) else None,
            "order": self.order,
            "outside_graphs_s": self.outside_s,
            "profiles": {k: [(label, p.to_dict()) for label, p in s.history]
                         for k, s in self.slots.items() if s.history},
            "passes": [{k: e.get(k) for k in ("pass", "decisions", "before", "after", "kept",
                                              "verdict")} for e in self.passes.current()],
            "chosen": self.passes.chosen, "left_out": self.passes.left_out,
        }

    def _apply_record(self, plan: dict) -> None:
        """Re-apply a plan `_record` wrote (kept passes with their decisions) to the graphs as
        compiled."""
        self.cost = LinearCostModel.from_dict(plan["cost"]) if plan.get("cost") else self.cost
        self.order = plan["order"]
        self.outside_s = plan.get("outside_graphs_s", 0.0)
        for key_, hist in plan["profiles"].items():
            if key_ in self.slots:
                self.slots[key_].history = [(label, _cache.profile_from_dict(p)) for label, p in hist]
        self.passes.chosen, self.passes.left_out = plan.get("chosen"), plan.get("left_out")
        self.passes.replay(plan["passes"])

    def _load_cached_plan(self) -> bool:
        plan = self.cache.lookup(self.runner.planning())
        if plan is None:
            return False
        self._apply_record(plan)
        self.cache.applied(plan)
        return True

    def profiling_overhead_s(self) -> float:
        t = self.timings
        normal = min(t["warmup_steps_s"][1:] or t["warmup_steps_s"] or [0.0])
        extra = sum(max(0.0, s - normal) for s in t["profiled_steps_s"] + t["measured_steps_s"])
        return extra + t["calibration_s"] + t["passes_s"]

    # [Note: the plan in a checkpoint] A checkpoint saved once the plan is final carries it
    # (`checkpoint_plan`: what the plan cache stores, with its key and the graphs it is for),
    # so that a run resumed from it runs the same code as the run that saved it, from its
    # first step: its losses are those of the unbroken run, bit for bit. A plan made afresh
    # would differ (the passes' trials read times), and so would the resumed run's first
    # steps, which would run the graphs as compiled (warm-up and profiling) where the unbroken
    # run ran the planned ones, compiled by Inductor: a pass can change the numerics (a
    # gradient accumulated in full before its reduce-scatter, not after) and Inductor's code
    # is not FX's. So an engine that has taken no step adopts the plan (`adopt_plan`), the
    # backend hands it every graph of a Dynamo frame at once (AOTAutograd's backward compiled
    # with the forward, not at the first backward), and as soon as the step's training graphs
    # are all there — at the first graph call — the plan is re-applied and the engine is in
    # its steady state (Inductor compiles at the first call: [Note: first call]). Where the
    # graphs are made in more than one call (graph breaks), the plan applies after the first
    # step instead, which runs the graphs as compiled. The plan applies only where its key
    # matches: the same world size, config, parameters, versions and graphs; any other run
    # plans afresh (with a line that says why).
    def checkpoint_plan(self) -> dict | None:
        """The plan in force, for a checkpoint ([Note: the plan in a checkpoint]); None while
        the setup or a re-plan runs."""
        if self.phase is not Phase.STEADY or self.setup_steps is None:
            return None
        planning = self.runner.planning()
        return {"key": self.cache.key_of(planning), "graphs": sorted(planning), **self._record()}

    def adopt_plan(self, plan: dict) -> bool:
        """Apply `plan` (`checkpoint_plan`'s) as soon as this engine's graphs are compiled;
        False where this engine has run steps (its own plan stays)."""
        if self.steps or self.runner.planning():
            return False
        self._adopted = plan
        self.runner.on_training_call = functools.partial(self._try_adopt, False)
        return True

    @property
    def adopting(self) -> bool:
        """Whether a plan waits for the graphs ([Note: the plan in a checkpoint])."""
        return self._adopted is not None

    def _try_adopt(self, final: bool) -> bool:
        """Apply the adopted plan if the training graphs it is for are all compiled (`final`:
        the step is over, no other graph comes); returns whether it applied."""
        plan = self._adopted
        have = sorted(self.runner.planning())
        if not have or (not final and set(have) < set(plan["graphs"])):
            return False
        self._adopted = self.runner.on_training_call = None
        if have != plan["graphs"] or self.cache.key_of(self.runner.planning()) != plan["key"]:
            if self.comm.rank == 0:
                log.info("deepcompile: the checkpoint's plan is for other graphs or settings "
                         "(world size, config, model or versions): planning afresh")
            return False
        with _compat.outside_dispatch_modes():   # inside a first call: [Note: first call]
            self._apply_record(plan)
        self._enter(Phase.STEADY, "from the checkpoint")
        return True

