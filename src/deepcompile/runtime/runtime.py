"""One engine's run-time state: what the compiled graphs read and write besides their own values.

`EngineRuntime` owns, for one engine:

* `registry`: the parameters, their layouts and shards (runtime/registry.py);
* `step`: where the engine is within the accumulation window (runtime/state.py);
* `kept`: the parameters `selective_unshard` keeps gathered (runtime/kept.py);
* `accum`: the gradients accumulated locally over the micro-steps, ZeRO-1's and
  `selective_unshard`'s alike (runtime/accumulators.py);
* `parked`: gathers a graph started for the next graph, until that graph takes them;
* `replicas`: ZeRO-1/2's replicated module parameters and their refresh after the optimizer
  step, which `overlap_refresh` leaves in flight (runtime/replicas.py);
* `layout`: the data-parallel layout and its groups (runtime/mesh.py), and under "hpz"
  `secondary`, the secondary shards the forward keeps for the backward (runtime/secondary.py);
* `offload`: the optimizer state kept on the host (runtime/offload/), when the pass is on;
* `eager_grads`: gradients eager code made, held until the optimizer step (runtime/eager.py);
* `activations`: the activations kept on the host between forward and backward
  (runtime/activations.py), made on first use by `activation_budget`'s ops.

The lowered graphs take what they need from here as extra inputs, looked up once per graph call
([Note: runtime inputs] in compiler/lower.py); the engine calls `before_optimizer_step` and
`shards_changed` around the optimizer step (the flat step calls `stepped` as it updates each
chunk), and `settle` where nothing may be left in flight. Nothing here is global: two engines
in one process have two runtimes. An op outside the lowered graphs' inputs (offload's, the
activations') names its engine by an integer handle (`EngineRuntime.handle`), which `runtime_of`
resolves; the table holds the runtimes weakly, so a released engine is freed.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Iterable

import torch

from .. import _compat
from .accumulators import GradAccumulators
from .comm import Comm
from .kept import KeptParams
from .registry import ParamEntry, ParamRegistry
from .replicas import Replicas
from .secondary import SecondaryShards
from .state import StepState

log = logging.getLogger("deepcompile")

_NEXT_HANDLE = itertools.count()
_RUNTIMES: "weakref.WeakValueDictionary[int, EngineRuntime]" = weakref.WeakValueDictionary()


def runtime_of(handle: int) -> "EngineRuntime | None":
    """The runtime of the engine whose handle is `handle`; None once it is released."""
    return _RUNTIMES.get(handle)


class ParkedGathers:
    """[Note: cross-graph prefetch] A gather started at the tail of graph A for graph B is an
    extra output of A, parked here under B's group (the pids), and an extra input of B, which
    waits for it. B takes it only if it was started for exactly the shards B is called with
    (Dynamo may reuse one graph for several layers); otherwise, or if A did not run, B's group
    is gathered synchronously here. Every rank runs the same graphs in the same order, so every
    rank takes the same path. Whatever is parked and not taken by the next graph is waited for
    and dropped when that graph starts (the plan counts its memory up to B's use only; another
    graph came instead: one of another structure of B's code, compiled after planning), and
    before the optimizer changes the shards (`drop_unused`)."""

    def __init__(self) -> None:
        self.parked: dict[tuple[int, ...], torch.Tensor] = {}
        self.misses = {"missing": 0, "other_tensors": 0, "unused": 0}

    def park(self, key: tuple[int, ...], buffer: torch.Tensor) -> None:
        stale = self.parked.pop(key, None)
        if stale is not None:   # started twice before a use: the older one was wasted
            _wait(stale)
            self.misses["unused"] += 1
        self.parked[key] = buffer

    def take(self, key: tuple[int, ...], shards, expected, gather) -> torch.Tensor:
        buffer = self.parked.pop(key, None)
        if buffer is not None:
            if all(map(_same, shards, expected)):
                return buffer
            _wait(buffer)
            self.misses["other_tensors"] += 1
        else:
            self.misses["missing"] += 1
        return gather(shards)

    def drop_unused(self) -> int:
        n = len(self.parked)
        for buffer in self.parked.values():
            _wait(buffer)
        self.parked.clear()
        self.misses["unused"] += n
        return n

    def held_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.parked.values())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or a.data_ptr() == b.data_ptr()


def _wait(t: torch.Tensor) -> None:
    _compat.funcol_ops()[2](t)


class EngineRuntime:
    def __init__(self, registry: ParamRegistry, comm: Comm, step: StepState,
                 device: torch.device, flat_masters: Iterable[torch.Tensor] = ()) -> None:
        self.registry = registry
        self.comm = comm
        self.step = step
        self.device = device
        self.entry_by_ptr: dict[int, ParamEntry] = {e.shard.data_ptr(): e for e in registry}
        self.kept = KeptParams(self.entry_by_ptr)
        self.accum = GradAccumulators(registry.entries, step, self.entry_by_ptr)
        self.parked = ParkedGathers()
        self.replicas = Replicas(registry.entries) if registry.zero_stage < 3 else None
        self.layout = registry.layout
        self.secondary = SecondaryShards(self.entry_by_ptr, self.layout.refreshed_secondary) \
            if self.layout.secondary is not None else None
        if self.layout.refreshed_secondary:
            self.kept.secondary = self.secondary
        self.offload: Any = None          # runtime/offload/ (its Offloader is made after this)
        self.eager_grads: dict[int, torch.Tensor] = {}   # pid -> gradient ([Note: eager
                                                         # gradients are agreed])
        self.activations: Any = None      # runtime/activations.py (`store_of`)
        self.count_offload_bytes = False  # the offload pass is on: its state is in the budget
        # data pointers of the flat buffers the shards are views of (the CPU memory model
        # counts a shard by its own extent: [Note: CPU memory model] in compiler/profiler.py)
        self.flat_masters = list(flat_masters)   # the chunks' flat masters (runtime/flat.py)
        # bumped when what the lowered graphs read changes: offload tier 3's copies of the
        # shards ([Note: masters on the host] in runtime/offload/masters.py)
        self.epoch = 0
        self._warned_unused = False
        self.handle = next(_NEXT_HANDLE)   # what ops name this engine by (`runtime_of`)
        _RUNTIMES[self.handle] = self

    @property
    def defers_reduce(self) -> bool:
        """ZeRO-1 keeps gradients local until the last micro-step (only where there is more
        than one micro-step and more than one rank)."""
        return (self.registry.zero_stage == 1 and self.step.gradient_accumulation_steps > 1
                and self.comm.world > 1)

    @property
    def flat_storages(self) -> frozenset[int]:
        """The data pointers of the flat masters' allocated storages, which the CPU memory model
        splits by view (compiler/profiler.py); read when a graph is profiled (a tier-3 master's
        storage moves at every step: [Note: masters on the host] in runtime/offload/masters.py)."""
        return frozenset(p for t in self.flat_masters if (p := t.untyped_storage().data_ptr()))

    def host_storages(self) -> set[int] | frozenset[int]:
        """The addresses of host buffers that graphs pass around (activations on the host),
        which the CPU memory model does not count (compiler/profiler.py)."""
        return self.activations.host_ptrs if self.activations is not None else frozenset()

    def held_bytes(self) -> int:
        """Bytes held outside graph values (the CPU memory model's runtime source; on CUDA the
        allocator counts them)."""
        total = self.kept.held_bytes() + self.accum.held_bytes() + self.parked.held_bytes() + \
            sum(g.untyped_storage().nbytes() for g in self.eager_grads.values())
        if self.replicas is not None:
            total += self.replicas.held_bytes()
        if self.secondary is not None:
            total += self.secondary.held_bytes()
        if self.count_offload_bytes and self.offload is not None:
            total += self.offload.held_bytes()
        return total

    # -- what passes configure ------------------------------------------------------------------
    def plan_state(self) -> dict[str, Any]:
        """What passes configure here (kept parameters, accumulators, the offload plan), taken
        before a pass applies so that a reverted pass leaves nothing behind
        (`restore_plan_state`)."""
        return {"kept": list(self.kept.entries), "accum": set(self.accum.by_pid),
                "offload": self.offload.plan_state() if self.offload is not None else None,
                "count_offload_bytes": self.count_offload_bytes,
                "refresh": self.replicas.layout() if self.replicas is not None else None}

    def restore_plan_state(self, state: dict[str, Any]) -> None:
        """Back to `state` (at an optimizer-step boundary, on every rank: a changed kept set is
        gathered again, which is collective)."""
        if [e.pid for e in self.kept.entries] != [e.pid for e in state["kept"]]:
            self.kept.configure(state["kept"])
        self.accum.disable([pid for pid in list(self.accum.by_pid) if pid not in state["accum"]])
        if self.offload is not None and state["offload"] is not None:
            self.offload.restore_plan_state(state["offload"])
        self.count_offload_bytes = state["count_offload_bytes"]
        if self.replicas is not None and self.replicas.layout() != state.get("refresh"):
            self.replicas.defer(state.get("refresh"))

    def after_step_collectives(self) -> list[dict[str, Any]]:
        """The collectives the runtime runs after every optimizer step, outside the graphs:
        ZeRO-1/2's replica refresh, hsdp_zero's secondary shards' refresh and the kept
        parameters' refresh (one all-gather per fused group, nothing where the shards span one
        rank)."""
        out = []
        if self.replicas is not None and self.replicas.groups is not None:
            groups = self.replicas.groups   # [Note: deferred refresh] in runtime/replicas.py
            out.append({"where": "launched in the optimizer step, waited for in the next forward",
                        "what": "replica refresh", "kind": "all_gather", "count": len(groups),
                        "bytes": sum(g.nbytes for g in groups)})
            plans = [("kept-parameter refresh", self.kept.plan)]
        else:
            plans = [("replica refresh", getattr(self.replicas, "plan", None)),
                     ("kept-parameter refresh", self.kept.plan)]
        if self.secondary is not None:
            plans.insert(0, ("secondary-shard refresh", self.secondary.plan))
        for what, plan in plans:
            if plan is not None and len(plan) and plan.communicates:
                out.append({"where": "after the optimizer step", "what": what,
                            "kind": "all_gather", "count": len(plan), "bytes": plan.nbytes(),
                            "group": plan.groups[0].comm.label})
        return out

    # -- around the optimizer step -------------------------------------------------------------
    def drop_parked(self) -> None:
        """Gathers started for a graph that did not run next are dropped ([Note: cross-graph
        prefetch])."""
        dropped = self.parked.drop_unused()
        if dropped and not self._warned_unused:
            self._warned_unused = True
            log.warning("deepcompile: %d gathers started for a next graph were not used (the "
                        "graphs ran in another order than when profiled); they are dropped",
                        dropped)

    def before_optimizer_step(self) -> None:
        """Gathers started for a graph that did not run are dropped before the shards change;
        gradients still held locally are reduced into the shard gradients."""
        self.drop_parked()
        self.accum.flush()

    @property
    def step_segments(self) -> int:
        """Calls the optimizer step of the resident chunks is split into (`Offloader.run_step`
        in runtime/offload/): more than one only where the deferred refresh gathers the chunks
        stepped first while the next ones step."""
        replicas = self.replicas
        return replicas.segments if replicas is not None and replicas.deferred else 1

    def stepped(self, chunks) -> None:
        """The optimizer step updated `chunks` (runtime/flat.py's): ZeRO-1/2's deferred
        refresh starts their gathers."""
        if self.replicas is not None:
            self.replicas.stepped(chunks)

    def settle(self) -> None:
        """Nothing the runtime launched is left in flight: ZeRO-1/2's deferred refresh is
        waited for ([Note: deferred refresh] in runtime/replicas.py)."""
        if self.replicas is not None:
            self.replicas.wait()

    def shards_changed(self, frozen_too: bool = False) -> None:
        """What is derived from the shards follows them (after the optimizer step, after loading
        a checkpoint): ZeRO-1/2's replicated parameters (the frozen ones only where they changed
        too: a checkpoint load), hsdp_zero's secondary shards and the parameters kept
        gathered."""
        if self.replicas is not None:
            self.replicas.refresh(frozen_too)
        if self.secondary is not None:
            self.secondary.refresh(frozen_too)
        self.kept.refresh()
