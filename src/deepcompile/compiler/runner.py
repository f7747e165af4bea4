"""The slot runner: every graph the backend hands over becomes a slot here, and every call of a
slot runs here.

`add_slot` files a partitioned graph under its family and kind ([Note: shape families] in
compiler/families.py): the first graph of a family and kind is its representative, which the
passes plan for; another shape of it is a member, which runs the representative's plan
transplanted (`follow`). `run(slot, args)` is the hot path, once per graph call: the
cross-rank structure check, the member's plan, the drift watch (compiler/drift.py), the
lowering of the slot's current version for this runtime epoch and micro-step variant, the
divergence fingerprint, and then, as the phase says (compiler/phases.py: the phase machine in
compiler/pipeline.py sets `phase`), a profiled run or a run of the code compiled for it.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable

import torch
from torch import fx
from torch.profiler import record_function

from .. import _compat
from ..runtime import memory
from ..runtime.divergence import FP_MASK, FP_MUL, digest
from ..runtime.guardrails import Guardrails
from . import families as _families
from .agree import agree_max
from .coverage import Coverage
from .drift import SizeWatch
from .lower import Lowered, fold_profile, lower, needs_variants
from .phases import Phase, param_name
from .profiler import GraphProfile, profile_run
from .slots import GraphSlot

log = logging.getLogger("deepcompile")


class _ReusedCall:
    """A reused graph's call as the divergence check records it (runtime/divergence.py)."""
    graph_key = "reuse"

    def __init__(self, describe: str) -> None:
        self.describe = describe
        self.digest = digest(describe)


class SlotRunner:
    def __init__(self, *, runtime, config, device: torch.device, guard: Guardrails,
                 phase: Phase, on_drift: list[Callable[[str], None]],
                 kept_passes: Callable[[], list[str]]) -> None:
        self.runtime = runtime
        self.registry = runtime.registry
        self.comm = runtime.comm
        self.config = config
        self.device = device
        self.phase = phase   # the pipeline's, set by it as each phase begins
        self.slots: dict[str, GraphSlot] = {}    # every graph: representatives and members
        # [Note: shape families], [Note: graph structure] in compiler/families.py
        self._families: dict[tuple, int] = {}   # (frame, parameter ids, structure) -> family
        # (frame, parameter ids) -> the structures of that code; family -> (its structure, the
        # structures of its code)
        self._structures: dict[tuple, _families.Structures] = {}
        self._family_structure: dict[int, tuple[int, _families.Structures]] = {}
        self.reps: dict[tuple[int, str], GraphSlot] = {}  # (family, kind) -> representative
        # failures and cross-rank checks (runtime/guardrails.py); `trace` fingerprints the calls
        self.guard = guard
        self.trace = guard.trace
        self.registry.reuse_call_listeners.append(self._reused_call)
        self._reused: dict[tuple[int, int], _ReusedCall] = {}
        self._kept_passes = kept_passes   # () -> the passes of the plan in force
        # called before a training graph's call while a plan waits for the graphs ([Note: the
        # plan in a checkpoint] in compiler/pipeline.py)
        self.on_training_call: Callable[[], Any] | None = None
        self.order_now: list[str] = []   # slot keys in execution order, this profiled step
        self.profile_host: dict[str, float] = {}   # slot -> the profiler's last host time
        self.perturb: Callable[[GraphProfile], None] | None = None  # test hook: local profiles
        self.tracing: list | None = None   # graph runs of a traced step (report/steptrace.py)
        # steady-state drift (compiler/drift.py): the pipeline's listeners get a reason
        self.on_drift = on_drift
        self.watches: dict[str, SizeWatch] = {}
        self.unplanned: set[str] = set()        # slots compiled in steady state, not run yet

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
            self.follow(slot)
            log.info("deepcompile: graph %s compiled (another shape of %s); it runs %s's plan",
                     key, rep.key, rep.key)
            if self.phase is Phase.STEADY and slot.training:
                self.unplanned.add(key)   # never profiled: its first run tells the drift listeners
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
            self.guard.agree_graph(   # [Note: new graphs are agreed] in runtime/divergence.py
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
        kept = self._kept_passes()
        if self.phase is Phase.STEADY and kept and slot.training:
            log.warning("deepcompile: graph %s was compiled after planning (new code, new "
                        "parameters, or another structure of a graph's code); it runs with "
                        "insertion only, without the passes %s", key, ", ".join(kept))
            self.unplanned.add(key)   # its first run tells the drift listeners
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
        """[Note: structures are agreed at each call] in runtime/divergence.py: from now on
        (every rank is here: it agreed on the second structure), the calls of this code's
        graphs that `_checks` names check that every rank runs the same structure."""
        structures.checked = True
        self.guard.open_structure_checks()
        for slot in self.slots.values():
            if slot.structures is structures:
                slot.checked = self._checks(slot)

    def follow(self, member: GraphSlot) -> None:
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
            # [Note: a member's versions] A face's version is new for the member's lifetime:
            # its code is cached under its version (`lowered`, `compiled`), and the steady
            # state keeps one face and its code; a later face numbered by how many faces are
            # left would find that code, of another plan, under its number.
            face = member.faces[rep.version] = (gm, to_rep, member.faces_made)
            member.faces_made += 1
        member.swap(face[0], face[2])
        member.to_rep, member.following = face[1], rep.version
        if self.phase is Phase.STEADY:   # other plans are gone for good
            member.faces = {rep.version: face}
            member.prune()

    def planning(self) -> dict[str, GraphSlot]:
        """The graphs the passes plan for: the training graphs' representatives."""
        return {k: s for k, s in self.slots.items() if s.rep is None and s.training}

    # -- drift --------------------------------------------------------------------------------
    def drift_marks(self) -> tuple[dict[str, tuple[int, ...] | None], set[str]]:
        """What the profiles so far saw: each watched graph's sizes, and the graphs not run
        since they were compiled in steady state (`forget_profile` returns to them)."""
        return {k: w.limit for k, w in self.watches.items()}, set(self.unplanned)

    def forget_profile(self, marks: tuple[dict[str, tuple[int, ...] | None], set[str]]) -> None:
        """A re-profile is dropped (its pass reverted), and with it what only that profile saw:
        larger sizes of a graph (`SizeWatch`), a graph compiled for a new shape on the way (a
        longer sequence): in the steady state they tell the drift listeners, as if unprofiled.
        `marks`: `drift_marks` from before the pass."""
        limits, unplanned = marks
        self.unplanned |= unplanned   # (one that told nobody: its first run was in there)
        for key, watch in self.watches.items():
            if key in limits:
                watch.limit = limits[key]
            else:
                watch.limit = None
                if self.slots[key].training:
                    self.unplanned.add(key)

    # -- one graph call -----------------------------------------------------------------------
    def run(self, slot: GraphSlot, args: list[Any]) -> Any:
        rt = self.runtime
        if slot.checked:   # [Note: structures are agreed at each call] in runtime/divergence.py
            self.guard.agree_structure(slot.key, slot.structure, rt.step.optimizer_steps,
                                       rt.step.micro_step)
        if self.on_training_call is not None and slot.training:
            self.on_training_call()   # [Note: the plan in a checkpoint]
        if slot.rep is not None and slot.following != slot.rep.version:
            self.follow(slot)   # its representative's plan changed
        if self.unplanned and slot.key in self.unplanned:   # (compiled under a fake mode)
            self.unplanned.discard(slot.key)
            for listener in self.on_drift:
                listener(f"graph {slot.key} compiled after planning")
        watch = self.watches.get(slot.key)
        if watch is None:
            watch = self.watches[slot.key] = SizeWatch(slot.gm)
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
        tr = self.trace   # [Note: divergence check] in runtime/divergence.py
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
            self.order_now.append(target.key)
            # `runtime_bytes`: what the runtime holds outside graph values, for the CPU memory
            # model (on CUDA the allocator counts it): kept parameters, accumulators, parked
            # gathers, and the optimizer state where the offload pass plans with it
            # (runtime/runtime.py)
            try:
                out, prof = profile_run(low.gm, full, slot=target.key, version=slot.version,
                                        name_of=param_name, runtime_bytes=rt.held_bytes,
                                        uncounted=low.uncounted, transient=low.transient,
                                        split=rt.flat_storages,
                                        host_memory=rt.host_storages(),
                                        lead_s=self._profile_lead(slot))
            except BaseException:
                self.guard.failed_graph = slot.key
                raise
            self.profile_host[slot.key] = prof.host_s
            if prof.lead_s and prof.lead_s < prof.host_s:
                log.debug("deepcompile: profiling %s, the host took %.1f ms to issue it, the "
                          "device was kept busy %.1f ms: the later nodes' times are the host's",
                          slot.key, prof.host_s * 1e3, prof.lead_s * 1e3)
            prof.launched = {kind: [n, nbytes] for kind, n, nbytes in low.counts}
            prof = fold_profile(prof, low.gm, slot.gm, param_name)
            if slot.rep is not None:
                prof = _families.fold_to_rep(prof, slot.to_rep, target.gm, param_name)
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
        host] in runtime/offload/masters.py)."""
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
        last = self.profile_host.get(slot.key)
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

    def ready(self, slot: GraphSlot) -> None:
        """`slot`'s current version lowered and compiled as `run` would on its next call
        (every variant it runs), outside the steady state."""
        self._check_epoch(slot)
        if slot.variants is None:
            slot.variants = needs_variants(slot.gm, self.runtime)
        for last in (True, False) if slot.variants else (True,):
            tag = (last, slot.version, False)
            if tag not in slot.compiled:
                slot.compiled[tag] = self._compile(slot, self._lowered(slot, last), [], False)

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
