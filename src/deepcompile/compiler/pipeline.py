"""The profile-guided pipeline: the phase schedule and the runner of the graph slots.

Phases advance at optimizer-step boundaries (`end_step`), on every rank at once:

  WARMUP   `warmup_steps` steps run normally (the first one compiles).
  PROFILE  `profile_steps` steps run every graph through the profiler; at the end the local
           profiles are agreed across ranks (compiler/agree.py). After the first profile, with
           `passes="auto"`, the passes to run are chosen from it (compiler/autoplan.py).
  ...      the next pass plans from the latest agreed profiles and rewrites the graphs
           (compiler/planner.py); a pass that changed a graph is followed by PROFILE and
           MEASURE, and then kept or reverted ([Note: keeping a pass] in compiler/autoplan.py);
           a pass that changed nothing is not.
  MEASURE  [Note: interleaved measurement] at most 2 x `measure_steps` steps that alternate
           between the graphs after the pass and the graphs from before it (`GraphSlot.swap`),
           so that a change in the machine's load between two windows of time falls on both
           sides alike (on a shared machine, consecutive windows of steps differ by 30% and
           more). Both sides are lowered and compiled when the trial starts (`_prepare_sides`),
           outside the timed steps: every timed step runs code made before it. Each step's time
           is the engine's own work in it ([Note: the engine's step time] in engine.py), the
           slowest rank's (agreed with MAX at each step). The trial stops as soon as its
           decision is certain (`autoplan.time_settled`: some step after the pass is no slower
           than some step before it), which a pass that clearly helps reaches after one step of
           each side. Steps of the side before a pass that kept parameters gathered skip their
           refresh (`KeptParams.suspend`), and the refresh is redone, outside the timed steps,
           before the other side runs again; steps of the side before `overlap_refresh`
           refresh the replicas synchronously (`Replicas.suspend`).
  STEADY   the final graphs run, compiled by the configured compiler (Inductor compiles once,
           here: warm-up and profiling run the FX graphs). When the step drifts from what was
           planned (a graph compiled after planning, larger symbolic sizes: compiler/drift.py)
           the `on_drift` listeners may `request_replan`: PROFILE again, then the passes named
           (the engine: `offload_optimizer`) and the kept ones, from the graphs as compiled
           ([Note: a re-plan starts over] in compiler/planner.py), judged on memory only, not
           timed against the plan they replace (which no longer fits).

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
import enum
import json
import logging
import statistics
import time
from typing import Any, Callable

import torch
from torch import fx
from torch.profiler import record_function

from .. import _compat
from ..passes import PassContext
from ..runtime import memory
from ..runtime import registry as _registry
from ..runtime.guardrails import FP_MASK, FP_MUL, DivergenceError, Guardrails, digest
from . import autoplan
from . import cache as _cache
from . import families as _families
from .agree import agree_max, agree_profiles, agreed_budget
from .cost import CostModel, LinearCostModel, calibrate
from .host import HostFigures, host_needs, measure_host
from .coverage import Coverage
from .drift import SizeWatch
from .lower import Lowered, fold_profile, lower, needs_variants
from .planner import Planner, copy_graph
from .profiler import GraphProfile, profile_run
from .slots import GraphSlot

log = logging.getLogger("deepcompile")


class Phase(enum.Enum):
    WARMUP = "warmup"
    PROFILE = "profile"
    MEASURE = "measure"
    STEADY = "steady"


STEP_LOG = 512   # steps whose phase and time are kept (the step-time plot)
STEADY_OUTSIDE = 32      # steady steps whose time outside the graphs the report's median takes
MIN_STEADY_OUTSIDE = 3   # fewer, and the report shows the profiled figure


def synchronize(device: torch.device) -> None:
    """Wait for the device's work (a no-op on the CPU, where every op has finished)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _param_name(pid: int) -> str:
    try:
        return _registry.lookup(pid).name
    except RuntimeError:
        return f"pid{pid}"


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


class _ReusedCall:
    """A reused graph's call as the divergence check records it (runtime/guardrails.py)."""
    graph_key = "reuse"

    def __init__(self, describe: str) -> None:
        self.describe = describe
        self.digest = digest(describe)


class Pipeline:
    def __init__(self, *, runtime, config, device: torch.device, engine_fingerprint: dict,
                 guard: Guardrails | None = None):
        self.runtime = runtime
        self.registry = runtime.registry
        self.comm = runtime.comm
        self.config = config
        self.device = device
        self.fingerprint = engine_fingerprint
        self.slots: dict[str, GraphSlot] = {}    # every graph: representatives and members
        # [Note: shape families], [Note: graph structure] in compiler/families.py
        self._families: dict[tuple, int] = {}   # (frame, parameter ids, structure) -> family
        # (frame, parameter ids) -> the structures of that code; family -> (its structure, the
        # structures of its code)
        self._structures: dict[tuple, _families.Structures] = {}
        self._family_structure: dict[int, tuple[int, _families.Structures]] = {}
        self.reps: dict[tuple[int, str], GraphSlot] = {}  # (family, kind) -> representative
        # failures and cross-rank checks (runtime/guardrails.py); `trace` fingerprints the calls
        self.guard = guard if guard is not None else Guardrails(runtime.comm, config)
        self.trace = self.guard.trace
        self.registry.reuse_call_listeners.append(self._reused_call)
        self._reused: dict[tuple[int, int], _ReusedCall] = {}
        self.phase = Phase.WARMUP if config.warmup_steps > 0 else Phase.PROFILE
        self._steps_in_phase = 0
        self._profile_label = "initial"
        self.order: list[str] = []               # slot keys in execution order, last profiled step
        self._order_now: list[str] = []
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
        self._profile_host: dict[str, float] = {}   # slot -> the profiler's last host time
        self.outside_s = 0.0
        self._step_order: list[str] = []
        self.cost: CostModel | None = None
        self.memory_budget = agreed_budget(self.comm, config.memory_budget, device)
        self.fusion, self.fusion_reason = autoplan.fusion_policy(device.type)
        self.planner = Planner(slots=self.slots, runtime=runtime, context=self._context,
                               summarize=self._summary)
        self.planner.configure(config.pass_list)
        self._awaiting: dict | None = None       # pass log entry waiting for its re-profile
        self._ab: dict | None = None             # the interleaved measurement under way
        self.cache_info: dict[str, Any] = {"enabled": config.cache_dir is not None, "hit": False}
        self.perturb: Callable[[GraphProfile], None] | None = None  # test hook: local profiles
        self.timings: dict[str, Any] = {"warmup_steps_s": [], "profiled_steps_s": [],
                                        "measured_steps_s": [], "calibration_s": 0.0,
                                        "passes_s": 0.0, "steady_steps_s": []}
        self.step_log: list[tuple[str, float]] = []   # (phase, seconds) of the first steps
        self.last_step: dict[str, Any] = {"phase": None, "seconds": None}
        self.steps = 0
        self.tracing: list | None = None   # graph runs of a traced step (report/steptrace.py)
        # What the runtime holds outside graph values, for the CPU memory model (on CUDA the
        # allocator counts it): kept parameters, accumulators, parked gathers, and the
        # optimizer state where the offload pass plans with it (runtime/runtime.py).
        self.runtime_bytes_sources: list[Callable[[], int]] = [runtime.held_bytes]
        # steady-state drift (compiler/drift.py): listeners get a reason; `request_replan`
        # runs passes again on new profiles from the next step on
        self.on_drift: list[Callable[[str], None]] = []
        self._watches: dict[str, SizeWatch] = {}
        self._before_pass: tuple[dict[str, tuple[int, ...] | None], set[str]] = ({}, set())
        self._unplanned: set[str] = set()        # slots compiled in steady state, not run yet
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
        return self.planner.entries

    # -- slots ------------------------------------------------------------------------------
    def family_of(self, frame_id: int | None, pids: tuple[int, ...], structure: int) -> int:
        """The family index of a Dynamo graph traced from frame `frame_id` over the parameters
        `pids` (in its input order) with the structure `structure` ([Note: graph structure] in
        compiler/families.py): a recompilation with the same parameters and structure (a new
        input shape, or another guard) joins the family of the first graph."""
        key = (frame_id, pids, structure)
        family = self._families.get(key)
        if family is None:
            family = self._families[key] = len(self._families)
            structures = self._structures.setdefault((frame_id, pids), _families.Structures())
            structures.families.append(family)
            self._family_structure[family] = (structure, structures)
        return family

    def add_slot(self, family: int, kind: str, gm: fx.GraphModule,
                 params: list[str] | tuple[str, ...] = ()) -> GraphSlot:
        structure, structures = self._family_structure[family]
        rep = self.reps.get((family, kind))
        if rep is not None:
            # another shape of a graph the family has: it runs the family's plan
            key = f"{rep.key}~{len(rep.members) + 1}"
            slot = GraphSlot(key, family, kind, gm, self.run)
            slot.rep, slot.training = rep, rep.training
            slot.original = _families.snapshot(gm)
            self._structured(slot, structure, structures)
            slot.coverage = Coverage.of(gm)
            rep.members.append(slot)
            self.slots[key] = slot
            self._follow(slot)
            log.info("deepcompile: graph %s compiled (another shape of %s); it runs %s's plan",
                     key, rep.key, rep.key)
            if self.phase is Phase.STEADY and slot.training:
                self._unplanned.add(key)   # never profiled: its first run tells the drift listeners
            return slot
        key = f"g{family}.{kind}"
        slot = GraphSlot(key, family, kind, gm, self.run)
        slot.training = kind != "inference"   # eval / no_grad graphs are never planned for
        slot.original = _families.snapshot(gm)
        slot.coverage = Coverage.of(gm)
        self.reps[(family, kind)] = slot
        self.slots[key] = slot
        names = list(params)
        if not structures.checked:
            self.guard.agree_graph(   # [Note: new graphs are agreed] in runtime/guardrails.py
                f"{kind} graph over {len(names)} parameters ({', '.join(names[:4])}"
                f"{', ...' if len(names) > 4 else ''}; digest {digest(repr(names)):x}; "
                f"structure {structure:x})",
                {"phase": "compile", "step": self.runtime.step.optimizer_steps,
                 "micro": self.runtime.step.micro_step, "graph": key})
            if len(structures.families) > 1:   # every rank compiled a second structure
                self._check_structures(structures)
        self._structured(slot, structure, structures)
        if len(structures.families) > 1:
            log.info("deepcompile: graph %s compiled: structure %x of the code of %s", key,
                     structure, ", ".join(f"g{f}" for f in structures.families))
        kept = [e["pass"] for e in self.planner.current() if e.get("kept", True)]
        if self.phase is Phase.STEADY and kept and slot.training:
            log.warning("deepcompile: graph %s was compiled after planning (new code, new "
                        "parameters, or another structure of a graph's code); it runs with "
                        "insertion only, without the passes %s", key, ", ".join(kept))
            self._unplanned.add(key)   # its first run tells the drift listeners
        return slot

    def _structured(self, slot: GraphSlot, structure: int,
                    structures: _families.Structures) -> None:
        slot.structure, slot.structures = structure, structures
        slot.checked = structures.checked and self._checks(slot)

    def _checks(self, slot: GraphSlot) -> bool:
        """Whether a call of `slot`, of code with several structures, is agreed across ranks: a
        forward graph's (the backward graph that runs is the forward's), an inference graph's
        where it gathers (ZeRO-3; at ZeRO-1/2 it issues no collective, and the ranks may
        evaluate data that take different paths)."""
        return slot.kind == "fw" or (slot.kind == "inference" and self.registry.zero_stage == 3)

    def _check_structures(self, structures: _families.Structures) -> None:
        """[Note: structures are agreed at each call] in runtime/guardrails.py: from now on
        (every rank is here: it agreed on the second structure), the calls of this code's
        graphs that `_checks` names check that every rank runs the same structure."""
        structures.checked = True
        self.guard.open_structure_checks()
        for slot in self.slots.values():
            if slot.structures is structures:
                slot.checked = self._checks(slot)

    def _follow(self, member: GraphSlot) -> None:
        """The member runs its representative's current plan ([Note: shape families]): checked
        at each call (O(1)), transplanted once per version of the representative (a pass, a
        revert, and the two sides of a measurement each make one)."""
        rep = member.rep
        face = member.faces.get(rep.version)
        if face is None:
            try:
                gm, to_rep = _families.transplant(rep.original, rep.gm, member.original)
            except _families.TransplantError as e:
                raise RuntimeError(
                    f"deepcompile: graph {member.key}, compiled for other inputs of the code of "
                    f"{rep.key}, cannot run {rep.key}'s plan ({e}); the ranks that run "
                    f"{rep.key} would issue other collectives. Report this with the model; as a "
                    "workaround, give every rank inputs of one shape (pad), or leave out the "
                    "passes.") from e
            if member.coverage is not None:   # [Note: gradient coverage]
                member.coverage.check(gm, f"the plan of {rep.key} transplanted", member.key)
            face = member.faces[rep.version] = (gm, to_rep, len(member.faces))
        member.swap(face[0], face[2])
        member.to_rep, member.following = face[1], rep.version
        if self.phase is Phase.STEADY:   # other plans are gone for good
            member.faces = {rep.version: face}
            member.prune()

    def _planning(self) -> dict[str, GraphSlot]:
        """The graphs the passes plan for: the training graphs' representatives."""
        return {k: s for k, s in self.slots.items() if s.rep is None and s.training}

    def run(self, slot: GraphSlot, args: list[Any]) -> Any:
        rt = self.runtime
        if slot.checked:   # [Note: structures are agreed at each call] in runtime/guardrails.py
            self.guard.agree_structure(slot.key, slot.structure, rt.step.optimizer_steps,
                                       rt.step.micro_step)
        if self._adopted is not None and slot.training:
            self._try_adopt(final=False)   # [Note: the plan in a checkpoint]
        if slot.rep is not None and slot.following != slot.rep.version:
            self._follow(slot)   # its representative's plan changed
        if self._unplanned and slot.key in self._unplanned:   # (compiled under a fake mode)
            self._unplanned.discard(slot.key)
            for listener in self.on_drift:
                listener(f"graph {slot.key} compiled after planning")
        watch = self._watches.get(slot.key)
        if watch is None:
            watch = self._watches[slot.key] = SizeWatch(slot.gm)
        if watch.positions:   # symbolic sizes: profiled with which, called with larger ones?
            if self.phase is Phase.PROFILE:
                watch.record(args)
            elif self.phase is Phase.STEADY and watch.exceeded(args):
                watch.record(args)
                for listener in self.on_drift:
                    listener(f"graph {slot.key} called with sizes beyond its profiles")
        self._check_epoch(slot)
        if slot.variants is None:
            slot.variants = needs_variants(slot.gm, rt)
        last = not slot.variants or rt.step.last_micro_step
        low = self._lowered(slot, last)
        tr = self.trace   # [Note: divergence check] in runtime/guardrails.py
        tr.fp = (tr.fp * FP_MUL + low.digest) & FP_MASK
        tr.calls.append(low)
        full, accs = low.prepare(args)
        # started for a graph that did not come next ([Note: cross-graph prefetch] in
        # runtime/runtime.py)
        if rt.parked.parked:
            rt.drop_parked()
        args.clear()   # boxed calling convention: the list is ours; inputs die at last use
        if self.phase is Phase.PROFILE and slot.training:
            target = slot.rep or slot   # a member's runs are its representative's
            self._order_now.append(target.key)
            try:
                out, prof = profile_run(low.gm, full, slot=target.key, version=slot.version,
                                        name_of=_param_name, runtime_bytes=self._runtime_bytes,
                                        uncounted=low.uncounted, transient=low.transient,
                                        split=rt.flat_storages,
                                        host_memory=rt.host_storages(),
                                        lead_s=self._profile_lead(slot))
            except BaseException:
                self.guard.failed_graph = slot.key
                raise
            self._profile_host[slot.key] = prof.host_s
            if prof.lead_s and prof.lead_s < prof.host_s:
                log.debug("deepcompile: profiling %s, the host took %.1f ms to issue it, the "
                          "device was kept busy %.1f ms: the later nodes' times are the host's",
                          slot.key, prof.host_s * 1e3, prof.lead_s * 1e3)
            prof.launched = {kind: [n, nbytes] for kind, n, nbytes in low.counts}
            prof = fold_profile(prof, low.gm, slot.gm, _param_name)
            if slot.rep is not None:
                prof = _families.fold_to_rep(prof, slot.to_rep, target.gm, _param_name)
                prof.version = target.version
            if self.perturb is not None:
                self.perturb(prof)
            target.pending.append(prof)
            return low.finish(out, accs)
        # [Note: first call] A forward graph's first call runs inside AOTAutograd's first
        # invocation of the graph Dynamo just compiled, under a dispatch mode that inspects
        # custom ops' inputs and outputs; a nested Inductor compile (its AOTAutograd trace)
        # fails under it. So Inductor compiles with the dispatch modes set aside
        # (`_compat.outside_dispatch_modes`), and a graph that first runs in the steady state
        # (a recompilation for a new shape; every graph of a run resumed with its plan) runs
        # its final code from its first call.
        final = self.phase is Phase.STEADY
        tag = (last, slot.version, final)
        fn = slot.compiled.get(tag)
        if fn is None:
            fn = slot.compiled[tag] = self._compile(slot, low, full, final)
        t0 = time.perf_counter()
        try:
            with _compat.below_autograd():
                if self.tracing is not None:   # a traced step (report/steptrace.py)
                    with record_function(f"deepcompile:{slot.key}"):
                        out = fn(full)
                    self.tracing.append((slot.key, last, slot.version))
                elif memory.TRACKER is None:
                    out = fn(full)
                else:   # tests: what the graph gathers, and when it frees it
                    with memory.watch():
                        out = fn(full)
        except BaseException:
            self.guard.failed_graph = slot.key   # named in the error (runtime/guardrails.py)
            raise
        slot.run_s.append(time.perf_counter() - t0)
        return low.finish(out, accs)

    def _reused_call(self, compiled_for, actual) -> None:
        """A graph runs for `actual` where it was compiled for `compiled_for` ([Note: graph
        reuse] in compiler/backend.py): its digest names the compile-time parameter, so the
        fingerprint takes the actual one too ([Note: divergence check]: ranks that run one
        graph for different parameters, an experts loop skipping an expert on some ranks,
        reduce one's gradient with the other's)."""
        call = self._reused.get((compiled_for.pid, actual.pid))
        if call is None:
            call = self._reused[(compiled_for.pid, actual.pid)] = _ReusedCall(
                f"a graph compiled for {compiled_for.name} ran for {actual.name}")
        tr = self.trace
        tr.fp = (tr.fp * FP_MUL + call.digest) & FP_MASK
        tr.calls.append(call)

    def _check_epoch(self, slot: GraphSlot) -> None:
        """Code lowered in an earlier epoch of the runtime is made anew ([Note: masters on the
        host] in runtime/offload.py)."""
        if slot.epoch != self.runtime.epoch:
            slot.lowered.clear()
            slot.compiled.clear()
            slot.epoch = self.runtime.epoch

    def _profile_lead(self, slot: GraphSlot) -> float:
        """[Note: profiling ahead of the device] in compiler/profiler.py: how long to keep the
        device busy before a profiled run of `slot` — half as long again as the profiler last
        took to issue it (the first time: three times a run as FX code), the same on every
        rank (the MAX: a rank whose device starts later would find its first wait longer).
        The profiler ignores it on the CPU, where nothing runs ahead."""
        last = self._profile_host.get(slot.key)
        if last is not None:
            lead = 1.5 * last
        else:
            lead = 3.0 * statistics.median(slot.run_s) if slot.run_s else 0.0
        if self.comm.world > 1:
            (lead,) = agree_max(self.comm, [lead], self.device)
        return lead

    def _lowered(self, slot: GraphSlot, last: bool) -> Lowered:
        key = (last, slot.version)
        low = slot.lowered.get(key)
        if low is None:
            low = slot.lowered[key] = lower(slot.gm, self.runtime, last=last, kind=slot.kind,
                                            key=slot.key)
            # what one run issues, for the cross-rank fingerprint and its messages
            low.digest = _families.comm_digest(slot.gm, last)
            low.graph_key = slot.key
            low.describe = _families.describe(slot.gm)
        return low

    def _compile(self, slot: GraphSlot, low: Lowered, args: list[Any], final: bool) -> Callable:
        gm = low.gm
        if self.config.compiler == "inductor" and final and _dynamic(gm):
            # [Note: dynamic graphs run as FX] Inductor here compiles for the example inputs'
            # sizes (static fakes): code for one shape, wrong for the next. A graph with dynamic
            # sizes (a new input shape made Dynamo recompile) runs as FX code instead.
            log.warning("deepcompile: graph %s has dynamic shapes; it runs as FX code, not "
                        "compiled by Inductor", slot.key)
            return _compat.boxed_fx(gm)
        if self.config.compiler == "inductor" and final:
            log.info("deepcompile: Inductor compiles %s (version %d)", slot.key, slot.version)
            with _compat.outside_dispatch_modes():   # [Note: first call]
                return _compat.inductor_compile_graph(gm, list(args))
        return _compat.boxed_fx(gm)

    def _runtime_bytes(self) -> int:
        """Buffers the runtime holds outside graph values (`runtime_bytes_sources`)."""
        return sum(source() for source in self.runtime_bytes_sources)

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
            self._step_order, self._order_now = self._order_now, []
            self._outside_now.append(outside_s)
            if self._steps_in_phase >= self.config.profile_steps:
                self._finish_profile()
        elif phase is Phase.MEASURE:
            self.timings["measured_steps_s"].append(seconds)
            self._steps_in_phase += 1
            ab = self._ab
            ab["samples"][ab["side"]].append(agree_max(self.comm, [seconds], self.device)[0])
            after, before = ab["samples"]["after"], ab["samples"]["before"]
            if autoplan.time_settled(before, after) or len(before) >= self.config.measure_steps:
                self._finish_measure()
            else:
                self._set_side("before" if ab["side"] == "after" else "after")
        else:
            if len(self.timings["steady_steps_s"]) < 64:
                self.timings["steady_steps_s"].append(seconds)
            self._outside_steady.append(outside_s)
            if self._replan is not None and self._replan_agreed:
                passes, reason = self._replan
                self._replan, self._replan_agreed = None, False
                self.replans += 1
                # [Note: a re-plan starts over] in compiler/planner.py
                self.planner.queue = self.planner.restart(passes)
                self._replanning = reason
                self._enter(Phase.PROFILE, f"replan: {reason}")

    def request_replan(self, passes: list[str], reason: str) -> None:
        """Run `passes` again (with the kept passes: `Planner.restart`), on new profiles, from
        the next optimizer step after every rank agreed to (`agree_replan`; steady state
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
        if phase is Phase.PROFILE:
            self._profile_label = label
            self._order_now = []
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
            entries = self.planner.current()
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
            return (f"{where}: timing {self._ab['entry']['pass']} against the graphs before it "
                    f"(2 to {2 * self.config.measure_steps} steps)")
        return f"{where}: {phase.value}" + (f" ({label})" if label else "")

    def _steps_left(self, phase: Phase) -> int | None:
        """About how many steps the setup has left as `phase` begins: each pass left
        re-profiled and timed for the least a trial takes (one step of each side); None before
        `passes="auto"` chose them."""
        if self.config.auto_passes and self.planner.chosen is None:
            return None
        trial = 2 if self.config.measure_steps else 0
        left = len(self.planner.queue) * (self.config.profile_steps + trial)
        if phase is Phase.PROFILE:
            left += self.config.profile_steps + (trial if self._awaiting is not None else 0)
        elif phase is Phase.MEASURE:
            left += trial
        return left

    def _after_warmup(self) -> None:
        if self.config.cache_dir is not None:
            # The key describes the graphs as compiled, before any pass rewrote them.
            self._key = self._cache_key()
            self.cache_info["key"] = self._key[0]
        if self.config.cache_dir is not None and self._load_cached_plan():
            self._enter(Phase.STEADY)
        elif self.config.profile_steps > 0:
            self._enter(Phase.PROFILE, "initial")
        else:
            self._enter(Phase.STEADY)

    def _calibrate_if_needed(self) -> None:
        self.host = HostFigures()
        if self.config.profile_steps == 0:
            return
        t0 = time.perf_counter()
        self.cost = calibrate(self.comm, self.device, layout=self.runtime.layout)
        self.host = measure_host(self.runtime, host_needs(self.config), self.device)
        self.timings["calibration_s"] = time.perf_counter() - t0

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
            # a re-plan is not timed against the plan before it: that plan no longer fits; nor
            # is a pass whose memory decides it ([Note: keeping a pass] in compiler/autoplan.py)
            if self.config.measure_steps > 0 and not entry.get("replan") and autoplan.by_memory(
                    entry["before"], entry["after"], self.memory_budget) is None:
                self._start_measure(entry)
                return
            self._judge(entry)
        elif self.config.auto_passes and self.planner.chosen is None:
            self.planner.choose(zero_stage=self.registry.zero_stage,
                                warmup_steps=self.config.warmup_steps)
        self._next_pass()

    # -- [Note: interleaved measurement] ----------------------------------------------------
    def _start_measure(self, entry: dict) -> None:
        snap = self.planner.snapshot(entry)
        faces = {}
        for key in entry["changed"]:
            slot = self.slots[key]
            before = fx.GraphModule(slot.gm, copy_graph(snap.graphs[key]))
            faces[key] = {"after": (slot.gm, slot.version), "before": (before, -slot.version - 1)}
        kept_now = [e.pid for e in self.runtime.kept.entries]
        self._ab = {"entry": entry, "faces": faces, "side": "after",
                    "samples": {"after": [], "before": []},
                    # the pass started keeping parameters: the side before it skips the refresh
                    "suspend": bool(kept_now) and not snap.runtime["kept"],
                    # the pass left the replicas' refresh in flight: the side before it (whose
                    # graphs do not wait for it) refreshes synchronously
                    "sync_refresh": self.runtime.replicas is not None
                    and self.runtime.replicas.groups is not None
                    and snap.runtime.get("refresh") is None}
        self._prepare_sides()
        # the ranks start the timed steps together: the time one rank took longer to prepare
        # would be in the others' first timed step, spent waiting at its first collective
        agree_max(self.comm, [0.0], self.device)
        self._enter(Phase.MEASURE, f"{entry['pass']} against the graphs before it")

    def _prepare_sides(self) -> None:
        """Both sides' code lowered and compiled now, outside the timed steps ([Note:
        interleaved measurement]), for the graphs the pass changed and the members that run
        their plans; the graphs are left on the side after the pass."""
        for side in ("before", "after"):
            for key, face in self._ab["faces"].items():
                slot = self.slots[key]
                slot.swap(*face[side])
                self._ready(slot)
                for member in slot.members:
                    self._follow(member)
                    self._ready(member)

    def _ready(self, slot: GraphSlot) -> None:
        """`slot`'s current version lowered and compiled as run() would on its next call
        (every variant it runs)."""
        self._check_epoch(slot)
        if slot.variants is None:
            slot.variants = needs_variants(slot.gm, self.runtime)
        for last in (True, False) if slot.variants else (True,):
            tag = (last, slot.version, False)
            if tag not in slot.compiled:
                slot.compiled[tag] = self._compile(slot, self._lowered(slot, last), [], False)

    def _set_side(self, side: str) -> None:
        ab = self._ab
        ab["side"] = side
        for key, face in ab["faces"].items():
            self.slots[key].swap(*face[side])
        if ab["suspend"]:
            if side == "before":
                self.runtime.kept.suspend()
            else:
                self.runtime.kept.resume()
        if ab["sync_refresh"]:
            if side == "before":
                self.runtime.replicas.suspend()
            else:
                self.runtime.replicas.resume()

    def _finish_measure(self) -> None:
        ab = self._ab
        self._set_side("after")
        self._ab = None
        entry = ab["entry"]
        entry["after"]["measured_s"] = ab["samples"]["after"]    # agreed at each step
        entry["before"]["measured_s"] = ab["samples"]["before"]
        self._judge(entry)
        self._next_pass()

    def _judge(self, entry: dict) -> bool:
        self._awaiting = None
        kept = self.planner.judge(entry, self.memory_budget)
        if not kept:
            # its re-profile is dropped, and with it what only that profile saw: larger sizes
            # of a graph (`SizeWatch`), a graph compiled for a new shape on the way (a longer
            # sequence): in the steady state they tell the drift listeners, as if unprofiled
            limits, unplanned = self._before_pass
            self._unplanned |= unplanned   # (one that told nobody: its first run was in there)
            for key, watch in self._watches.items():
                if key in limits:
                    watch.limit = limits[key]
                else:
                    watch.limit = None
                    if self.slots[key].training:
                        self._unplanned.add(key)
        return kept

    def _next_pass(self) -> None:
        """Plan and apply the next pass; enter PROFILE after one that changed a graph, STEADY
        when none is left."""
        t0 = time.perf_counter()
        while self.planner.queue or (
                self.planner.retry() if self._replanning is not None else
                self.config.auto_passes and self.planner.choose_late(
                    zero_stage=self.registry.zero_stage, warmup_steps=self.config.warmup_steps)):
            # what the profiles before this pass saw (restored if it is reverted: _judge)
            before = ({k: w.limit for k, w in self._watches.items()}, set(self._unplanned))
            entry = self.planner.start(self.planner.queue.pop(0))
            self._before_pass = before
            if self._replanning is not None:
                entry["replan"] = self._replanning
            self._agree_decisions(entry["pass"], entry["decisions"])   # before any graph runs
            if entry["changed"]:
                self._awaiting = entry
                self.timings["passes_s"] += time.perf_counter() - t0
                self._enter(Phase.PROFILE, f"after {entry['pass']}")
                return
            self.planner.unchanged(entry)
        self.timings["passes_s"] += time.perf_counter() - t0
        if self.config.cache_dir is not None and not self.replans:   # a cached plan is the first
            self._save_plan()
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
        current = {k: p for k, p in self.latest_profiles().items()
                   if p.version == self.slots[k].version}
        return PassContext(slots=self._planning(), profiles=current, order=self.order,
                           registry=self.registry, runtime=self.runtime, cost=self.cost,
                           memory_budget=self.memory_budget, world_size=self.comm.world,
                           decisions=self.planner.decisions(), fusion=self.fusion,
                           layout=self.runtime.layout, host_step_rate=self.host.step_rate,
                           host_capacity=self.host.capacity)

    def latest_profiles(self) -> dict[str, GraphProfile]:
        return {k: s.profile for k, s in self.slots.items() if s.profile is not None}

    def _agree_decisions(self, name: str, decisions: Any) -> None:
        """A pass plans from what every rank holds alike (PassContext): the same decisions on
        every rank, or the ranks would rewrite their graphs differently. Checked (one small
        all-gather per pass planned), so that a pass that plans from local timings fails on
        every rank instead of hanging collectives. Compared: the decisions' structure (groups,
        positions, names, counts); floats are estimates (predicted seconds) that rewrite
        nothing."""
        if self.comm.world == 1:
            return
        mine = digest(json.dumps(_structure(decisions), sort_keys=True, default=str))
        every = self.comm.all_gather_object(mine)
        if len(set(every)) > 1:
            groups: dict[int, list[int]] = {}
            for r, d in enumerate(every):
                groups.setdefault(d, []).append(r)
            raise DivergenceError(
                f"deepcompile: pass {name!r} planned differently on different ranks (ranks "
                f"grouped by plan: {sorted(groups.values())}); a pass must plan from the agreed "
                "profiles and the PassContext only, never from this rank's own timings or state. "
                "The engine stops on every rank.")

    # -- plan cache, and the plan in a checkpoint --------------------------------------------
    def _cache_key(self) -> tuple[str, dict]:
        """The digest of everything that determines a plan: the fingerprint and the training
        graphs as compiled (before any pass rewrote them)."""
        parts = {
            **self.fingerprint,
            "graphs": {k: _cache.graph_signature(
                s.original if s.original is not None else s.gm, _param_name)
                       for k, s in sorted(self._planning().items())},
        }
        return _cache.digest(parts), parts

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
                                              "verdict")} for e in self.planner.current()],
            "chosen": self.planner.chosen, "left_out": self.planner.left_out,
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
        self.planner.chosen, self.planner.left_out = plan.get("chosen"), plan.get("left_out")
        self.planner.replay(plan["passes"])

    def _load_cached_plan(self) -> bool:
        key, _ = self._key
        plan = _cache.load(self.config.cache_dir, key) if self.comm.rank == 0 else None
        plan = self.comm.broadcast_object(plan)
        if plan is None:
            return False
        self._apply_record(plan)
        self.cache_info.update(hit=True, saved_s=plan.get("profiling_overhead_s", 0.0),
                               path=str(_cache.path_for(self.config.cache_dir, key)))
        log.info("deepcompile: plan loaded from cache (%s); profiling skipped, saving about %.1f s",
                 self.cache_info["path"], self.cache_info["saved_s"])
        return True

    def profiling_overhead_s(self) -> float:
        t = self.timings
        normal = min(t["warmup_steps_s"][1:] or t["warmup_steps_s"] or [0.0])
        extra = sum(max(0.0, s - normal) for s in t["profiled_steps_s"] + t["measured_steps_s"])
        return extra + t["calibration_s"] + t["passes_s"]

    def _save_plan(self) -> None:
        key, parts = self._key
        if self.comm.rank != 0:
            return
        plan = {"key_parts": parts, **self._record(),
                "profiling_overhead_s": self.profiling_overhead_s()}
        path = _cache.save(self.config.cache_dir, key, plan)
        self.cache_info["path"] = str(path)
        log.info("deepcompile: plan saved to %s", path)

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
        return {"key": self._cache_key()[0], "graphs": sorted(self._planning()), **self._record()}

    def adopt_plan(self, plan: dict) -> bool:
        """Apply `plan` (`checkpoint_plan`'s) as soon as this engine's graphs are compiled;
        False where this engine has run steps (its own plan stays)."""
        if self.steps or self._planning():
            return False
        self._adopted = plan
        return True

    @property
    def adopting(self) -> bool:
        """Whether a plan waits for the graphs ([Note: the plan in a checkpoint])."""
        return self._adopted is not None

    def _try_adopt(self, final: bool) -> bool:
        """Apply the adopted plan if the training graphs it is for are all compiled (`final`:
        the step is over, no other graph comes); returns whether it applied."""
        plan = self._adopted
        have = sorted(self._planning())
        if not have or (not final and set(have) < set(plan["graphs"])):
            return False
        self._adopted = None
        if have != plan["graphs"] or self._cache_key()[0] != plan["key"]:
            if self.comm.rank == 0:
                log.info("deepcompile: the checkpoint's plan is for other graphs or settings "
                         "(world size, config, model or versions): planning afresh")
            return False
        with _compat.outside_dispatch_modes():   # inside a first call: [Note: first call]
            self._apply_record(plan)
        self._enter(Phase.STEADY, "from the checkpoint")
        return True


def _structure(x: Any) -> Any:
    """`x` with every float left out (a pass's decisions, for `_agree_decisions`)."""
    if isinstance(x, float):
        return "<float>"
    if isinstance(x, dict):
        return {str(k): _structure(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_structure(v) for v in x]
    return x


def _dynamic(gm: fx.GraphModule) -> bool:
    """Whether the graph takes symbolic sizes (Dynamo compiled it with dynamic shapes)."""
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            break
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return True
        if isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape):
            return True
    return False
