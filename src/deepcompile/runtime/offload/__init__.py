"""What the device does not hold between optimizer steps: the run-time side of `offload_optimizer`.

The unit is a *chunk* of the flat layout (runtime/flat.py): a few contiguous buffers per chunk,
so everything here is per chunk and per reload group, never per parameter. A chunk's tier says
what of it lives on the host between optimizer steps (offload/slot.py).

The optimizer step runs on the device, chunk by chunk where it must (`Offloader.run_step`): the
chunks whose state is on the device step in one inner-optimizer call; each remaining chunk's
state is copied in (the next one's copy already running), stepped, and copied out again, so the
step needs room for at most two offloaded chunks, not for all the state. Tier-4 chunks step on
the host instead, and need no room at all.

  __init__.py   `Offloader`: the plan's tiers, moving the state, the optimizer step, the report
  slot.py       the tiers; `ChunkBuffers`, one chunk's buffers and events; `device_bytes`
  copy.py       the copy streams on CUDA, their imitation on the CPU ([Note: offload streams])
  grads.py      tier 2: gradients on the host ([Note: gradients on the host])
  masters.py    tier 3: masters on the host ([Note: masters on the host])
  host_step.py  tier 4: the host step and the host optimizer ([Note: the host step])
  ops.py        the `reload_state` and `grad_to_host` ops the pass puts in backward graphs

`Offloader` is one class, and this module is that class: every mechanism above reads and changes
the placement it keeps (tiers, reload groups, the copies in flight).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Iterable

import torch
from torch.profiler import record_function

from ..flat import Chunk, FlatState, _grad_of, _is_not_none
from . import grads, masters
from .copy import make_copier
from .host_step import host_optimizer, host_ready, host_step_seconds, mem_available, step_on_host
from .ops import GRAD_TO_HOST, RELOAD_STATE, grad_to_host, reload_state
from .slot import (GRADS, HOST, LOOKAHEAD, MASTERS, RESIDENT, STATE, TIER_NAMES, ChunkBuffers,
                   device_bytes)

__all__ = ["Offloader", "ChunkBuffers", "device_bytes", "host_optimizer", "RESIDENT", "STATE",
           "GRADS", "MASTERS", "HOST", "TIER_NAMES", "LOOKAHEAD", "RELOAD_STATE", "GRAD_TO_HOST",
           "reload_state", "grad_to_host"]


class Offloader:
    """Places the chunks of one engine between device and host and runs the optimizer step."""

    def __init__(self, flat: FlatState, device: torch.device, runtime=None,
                 compiler: str = "fx", host_step: str = "auto") -> None:
        self.flat = flat
        self.device = device
        self.runtime = runtime
        # Inductor's generated code hands a buffer to a later kernel once its last reader
        # returned ([Note: gradients on the host]): a `grad_to_host` op whose copy may still read
        # its gradient then copies from a buffer of its own (fx frees through the allocator,
        # which `record_stream` holds off)
        self.own_sources = compiler == "inductor"
        self._copier = make_copier(device)
        self.slots = [ChunkBuffers(c) for c in flat.chunks]
        self.tiers = [RESIDENT] * len(self.slots)
        self._groups: list[list[ChunkBuffers]] = []    # what each reload op brings back
        self._pending: list = []               # copy-back events the step waits for
        # [Note: provisional offload] Until the pass has planned, an engine configured with it
        # keeps every chunk at tier 1: the warm-up and profiled steps fit whatever the budget is
        # (that is what the plan is about), the profiles are measured without the state, and
        # the planner adds it back (`profile_offset`). Under an unbounded budget nothing would
        # ever be offloaded, and the chunks stay on the device from the start (the pass then
        # plans nothing and changes no graph: no re-profile, no timed verdict).
        self.provisional = False
        self.host_step = host_step             # Config.host_step (the offload pass's plan reads it)
        self.budget: float = float("inf")
        # CUDA: the allocator's count, read before each in-graph reload (the plan is a model;
        # a reload that would go over the budget now is left to the step). Tests set a model.
        self.meter: Callable[[], int] | None = (
            (lambda: torch.cuda.memory_allocated(device)) if device.type == "cuda" else None)
        self.stats = {"steps": 0, **self._zero_counts()}
        self.last_step: dict[str, int] = {}
        self._counts = self._zero_counts()
        self.step_starts: list[int] = []   # CUDA: device bytes at profiled steps' start, no state
        self.host_seconds = 0.0            # wall time of the host steps (tier 4), all steps
        # tier 2: where each parameter's gradient goes, and the factor the engine decided for
        # the host gradients (loss scale, clipping; None: 1)
        self._where = {e.pid: (s, i) for s in self.slots for i, e in enumerate(s.chunk.entries)}
        self.grad_scale: torch.Tensor | None = None
        if flat.inner is not None:
            flat.facade.register_state_dict_post_hook(self._state_dict_hook)
            flat.facade.register_load_state_dict_pre_hook(self._before_load)
            flat.on_load.append(self._after_load)
            flat.on_layout.append(self._layout_changed)

    @property
    def copier(self):
        """The copy streams (or their CPU imitation), shared with the activations on the host
        (runtime/activations.py)."""
        return self._copier

    # -- placement ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.provisional or any(self.tiers)

    def tier(self, slot: ChunkBuffers) -> int:
        return STATE if self.provisional else self.tiers[slot.chunk.index]

    def grad_tier(self, slot: ChunkBuffers) -> bool:
        """The chunk's gradients go to the host (tier 2; never while provisional)."""
        return not self.provisional and self.tiers[slot.chunk.index] >= GRADS

    def master_tier(self, slot: ChunkBuffers) -> bool:
        """The chunk's master lives on the host (tier 3; never while provisional)."""
        return not self.provisional and self.tiers[slot.chunk.index] >= MASTERS

    def host_tier(self, slot: ChunkBuffers) -> bool:
        """The chunk steps on the host (tier 4; never while provisional)."""
        return not self.provisional and self.tiers[slot.chunk.index] >= HOST

    def sends_grad(self, pid: int) -> bool:
        """Parameter `pid`'s gradient goes to the host (its chunk is at tier 2)."""
        where = self._where.get(pid)
        return where is not None and self.grad_tier(where[0])

    def device_grad_chunks(self) -> list[Chunk]:
        """The chunks whose gradients are on the device at the step (the engine folds these)."""
        return [s.chunk for s in self.slots if not self.grad_tier(s)]

    def set_plan(self, tiers: dict[int, int], budget: float = float("inf")) -> None:
        """Chunk index -> tier (missing: resident). Brings everything back first."""
        for i, t in tiers.items():
            if t >= MASTERS and not self.master_saving(self.slots[i]):
                raise ValueError(f"deepcompile offload: chunk {i} "
                                 f"({self.slots[i].chunk.entries[0].name}, ...) cannot keep its "
                                 "master on the host (tier 3 needs ZeRO-3 and a compute dtype "
                                 "narrower than the master's)")
        self.reload_all(count=False)
        self._reloaded()
        self._masters_back()
        for s in self.slots:
            if tiers.get(s.chunk.index, RESIDENT) < GRADS:
                grads.back(s, self._copier, self.device)
        self.provisional = False
        self.budget = budget
        self.tiers = [tiers.get(s.chunk.index, RESIDENT) for s in self.slots]
        self._groups = []

    def go_provisional(self) -> None:
        """Back to the provisional placement now (a re-plan is coming: the step changed under
        the plan): every chunk's state leaves the device, and reload ops do nothing."""
        self._reloaded()
        self._masters_back()
        for s in self.slots:
            grads.back(s, self._copier, self.device)
        self.provisional = True
        self.step_starts = []
        for s in self.slots:
            self._offload(s)

    def add_reload_group(self, chunks: Iterable[int]) -> int:
        """Register the chunks one reload op brings back; returns the op's group id."""
        self._groups.append([self.slots[i] for i in chunks])
        return len(self._groups) - 1

    def plan_state(self) -> dict:
        """The plan as data (`restore_plan_state`): tiers, reload groups, provisional."""
        return {"tiers": list(self.tiers), "budget": self.budget,
                "groups": [[s.chunk.index for s in g] for g in self._groups],
                "provisional": self.provisional}

    def restore_plan_state(self, state: dict) -> None:
        """Back to a plan taken by `plan_state` (a reverted pass's plan is dropped; at a step
        boundary: `after_step` then offloads what the restored plan keeps on the host)."""
        if state == self.plan_state():
            return
        self.set_plan(dict(enumerate(state["tiers"])), state["budget"])
        for group in state["groups"]:
            self.add_reload_group(group)
        self.provisional = state["provisional"]

    # -- what can move (compiler/autoplan.py) -----------------------------------------------------
    def movable(self) -> list[tuple[int, int]]:
        """(chunk index, device bytes) of every chunk whose optimizer state can leave the
        device: none where the optimizer steps parameter by parameter (`FlatState.inner` is
        None: [Note: flat step] in runtime/flat.py)."""
        return [(s.chunk.index, n) for s in self.slots if (n := self.state_bytes(s))]

    def step_bytes(self) -> int:
        """Device bytes of the optimizer step with all optimizer state on the device."""
        return self.step_base() + sum(self.state_bytes(s) for s in self.slots)

    # -- what the device holds ------------------------------------------------------------------
    def state_bytes(self, slot: ChunkBuffers) -> int:
        inner = self.flat.inner
        if inner is None:
            return 0
        return sum(device_bytes(t.numel() * t.element_size(), self.device)
                   for t in slot.tensors(inner).values())

    def grad_bytes(self, slot: ChunkBuffers) -> int:
        """Device bytes of the chunk's shard gradients while autograd holds them (one block
        per shard) — what tier 2 keeps off the device between the backward and the step."""
        return sum(device_bytes(sh.numel() * sh.element_size(), self.device)
                   for sh in slot.chunk.shards)

    def profile_offset(self) -> int:
        """Device bytes the profiled steps did not hold that an all-resident step would: the
        state of the chunks offloaded while profiling."""
        return sum(self.state_bytes(s) for s in self.slots if self.tier(s) >= STATE)

    def resident_state_bytes(self) -> int:
        return sum(self.state_bytes(s) for s in self.slots if not s.offloaded)

    def step_peak(self) -> int:
        """Device bytes of the optimizer step with the state placed as it is now: the base,
        the state on the device, and the state the step streams in (at most LOOKAHEAD + 1
        chunks at once). A pass that holds memory through the step (kept parameters and their
        accumulators) plans within the budget less this as well as less the graphs' peaks."""
        away = sorted((self.state_bytes(s) for s in self.slots if s.offloaded), reverse=True)
        return self.step_base() + self.resident_state_bytes() + sum(away[:LOOKAHEAD + 1])

    def step_base(self) -> int:
        """The device's bytes during the optimizer step with no optimizer state on it: what
        it held when the profiled steps started (CUDA: the allocator's count before the fold,
        measured; the CPU: modelled), less their resident state, plus one chunk's flat
        gradient (the fold holds a chunk's flat gradient and its shards' gradients at once)."""
        fold = max((device_bytes(c.nbytes, self.device) for c in self.flat.chunks), default=0)
        start = max(self.step_starts, default=None)
        if start is None:
            start = self.modeled_step_start()
        return start + fold

    def modeled_step_start(self) -> int:
        """The CPU model of the device's bytes when the step starts, without optimizer state:
        every shard, the folded flat gradients, ZeRO-1/2's replicas, the runtime's buffers."""
        rt = self.runtime
        total = sum(c.nbytes for c in self.flat.chunks) * 2   # masters, flat gradients
        if rt is not None:
            chunked = {e.pid for c in self.flat.chunks for e in c.entries}
            for e in rt.registry:
                if e.pid not in chunked:
                    total += e.shard.numel() * e.shard.element_size()
                if e.replica is not None:
                    total += e.padded_numel * e.compute_dtype.itemsize
            total += rt.kept.held_bytes() + rt.accum.held_bytes()
        return total

    def layout_signature(self) -> list:
        """The chunks as (first parameter, parameters): a cached plan names chunks by index."""
        return [[c.entries[0].name, len(c.entries)] for c in self.flat.chunks]

    def held_bytes(self) -> int:
        """The CPU memory model's runtime source (on CUDA the allocator counts these): the
        optimizer state on the device, the shards' gradients and the flat gradients."""
        total = 0
        inner = self.flat.inner
        for s in self.slots:
            c = s.chunk
            if inner is not None:
                total += sum(t.untyped_storage().nbytes() for t in s.tensors(inner).values())
            total += c.grad.untyped_storage().nbytes()
            total += sum(g.untyped_storage().nbytes() for sh in c.shards
                         if (g := sh.grad) is not None)
            if s.lowp is not None:   # tier 3's copy (the masters are graph inputs)
                total += s.lowp.untyped_storage().nbytes()
        return total

    def master_saving(self, slot: ChunkBuffers) -> int:
        """Device bytes the chunk's master on the host saves (its bytes less its copy's in the
        compute dtype), 0 where it cannot go ([Note: masters on the host]): not ZeRO-3, a
        compute dtype no narrower, or mixed compute dtypes in the chunk."""
        c = slot.chunk
        dtypes = {e.compute_dtype for e in c.entries}
        if len(dtypes) != 1 or any(e.zero_stage != 3 for e in c.entries):
            return 0
        low = dtypes.pop().itemsize
        if low >= c.param.element_size():
            return 0
        return (device_bytes(c.nbytes, self.device)
                - device_bytes(c.numel * low, self.device))

    # -- moving ------------------------------------------------------------------------------
    def _offload(self, slot: ChunkBuffers) -> None:
        inner = self.flat.inner
        tensors = slot.tensors(inner)
        if slot.offloaded or not tensors:
            return
        if not slot.host:
            slot.host = {k: self._copier.host_buffer(t) for k, t in tensors.items()}
        pairs = [(slot.host[k], t) for k, t in tensors.items()]
        slot.saved = self._copier.to_host(pairs)
        for t in tensors.values():
            t.untyped_storage().resize_(0)
        slot.offloaded = True
        slot.show(self.flat.facade.state, tensors)
        self._counts["d2h_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())

    def _reload(self, slot: ChunkBuffers) -> object:
        if not slot.offloaded:
            return None
        tensors = slot.tensors(self.flat.inner)
        for t in tensors.values():
            t.untyped_storage().resize_(t.numel() * t.element_size())
        slot.loaded = self._copier.to_device([(t, slot.host[k]) for k, t in tensors.items()],
                                             after=slot.saved)
        slot.offloaded = False
        slot.show(self.flat.facade.state, tensors)
        self._counts["h2d_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        return slot.loaded

    def _layout_changed(self, chunk: Chunk) -> None:
        """The chunk's units or its state dicts changed (runtime/flat.py): what was made from
        them is made again."""
        slot = self.slots[chunk.index]
        slot.faces = None
        slot.host_opt = None

    def reload_group(self, group: int) -> None:
        """A `reload_state` op: bring the group's chunks back, unless the device is fuller now
        than the plan expected (CUDA's count; then the step streams them in)."""
        slots = [s for s in self._groups[group] if s.offloaded]
        if not slots or self.provisional:
            return
        if self.meter is not None and self.budget != float("inf"):
            need = sum(self.state_bytes(s) for s in slots)
            if self.meter() + need > self.budget:
                self._counts["deferred_by_meter"] += len(slots)
                return
        for s in slots:
            self._pending.append(self._reload(s))
            self._counts["reloaded_in_graph"] += 1

    def _reloaded(self) -> None:
        """The compute stream waits for every copy back still under way (the step, a state
        dict, a new plan, a load, the state going out again)."""
        self._copier.wait(self._pending)
        self._pending = []

    def reload_all(self, count: bool = True) -> None:
        for s in self.slots:
            ev = self._reload(s)
            if ev is not None:
                self._pending.append(ev)

    # -- masters on the host ([Note: masters on the host] in offload/masters.py) ---------------
    def _master_out(self, slot: ChunkBuffers) -> None:
        if masters.send(slot, self._copier, self.device, self._counts):
            self._copies_changed()

    def _master_in(self, slot: ChunkBuffers) -> object:
        return masters.bring(slot, self._copier, self._counts)

    def _masters_back(self) -> None:
        """Every master on the device again and no copies (a new plan, a re-plan coming)."""
        self._copier.wait([self._master_in(s) for s in self.slots])
        if masters.drop_copies(self.slots):
            self._copies_changed()

    @contextlib.contextmanager
    def masters_home(self):
        """The masters of tier-3 chunks on the device for the duration (what reads or writes
        the shards outside the graphs and the step: a checkpoint, a load); after it their copies
        are made again from them (a load changed them) and they leave again."""
        away = [s for s in self.slots if s.master_off]
        self._copier.wait([self._master_in(s) for s in away])
        try:
            yield
        finally:
            for s in away:
                if self.master_tier(s):
                    self._master_out(s)

    def _copies_changed(self) -> None:
        """Graphs read a tier-3 shard's copy instead of the shard: lowered code from before a
        copy appeared or went is stale ([Note: masters on the host])."""
        if self.runtime is not None:
            self.runtime.epoch += 1

    # -- gradients on the host ([Note: gradients on the host] in offload/grads.py) ------------
    @torch.no_grad()
    def grad_to_host(self, pid: int, grad: torch.Tensor) -> None:
        """A `grad_to_host` op: the shard gradient of parameter `pid` into the host buffer of
        its chunk (added to what the window wrote there before), or, if the chunk is no longer
        at tier 2, into `shard.grad` as autograd would have put it ([Note: gradients on the
        host] in offload/grads.py)."""
        slot, i = self._where[pid]
        g = grad.detach().reshape(-1)
        if not self.grad_tier(slot):
            grads.accumulate(slot.chunk.shards[i], g)
            return
        if slot.host_grad is None:
            grads.make_buffers(slot, self._copier, self.device)
        # own_sources: the graph's buffer may go to its next kernel (see __init__)
        grads.send(slot, i, g, self._copier, self.own_sources, self._counts)

    def host_grad_sumsq(self) -> torch.Tensor | None:
        """The squared norm (float32, on the device) of this rank's gradients that are on the
        host, None if none is: inf/NaN when one of them holds an inf/NaN."""
        sums = [s.sumsq.sum() for s in self.slots if self.grad_tier(s) and s.sumsq is not None]
        return torch.stack(sums).sum() if sums else None

    # -- the optimizer step ------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before the gradients are folded: while the plan is provisional, the device's count
        less the state on it is the base the plan's step starts from (CUDA); a tier-2 shard's
        gradient that reached `shard.grad` anyway (the eager fallback, a local accumulator
        flushed at the step) joins the host gradient."""
        if self.meter is not None and self.provisional:
            self.step_starts.append(self.meter() - self.resident_state_bytes())
        for s in self.slots:
            if self.grad_tier(s) and any(map(_is_not_none, map(_grad_of, s.chunk.shards))):
                for e, sh in zip(s.chunk.entries, s.chunk.shards):
                    if sh.grad is not None:
                        g, sh.grad = sh.grad, None
                        self.grad_to_host(e.pid, g)

    def run_step(self) -> None:
        """The inner optimizer's step over every chunk (gradients folded, hyperparameters
        synced): resident chunks together, offloaded ones streamed through the device,
        tier-4 ones stepped on the host ([Note: the host step]) while the device works. Each
        chunk's update is announced as soon as it is done (`EngineRuntime.stepped`: ZeRO-1/2's
        deferred refresh launches its gather then, [Note: deferred refresh] in
        runtime/replicas.py), and the resident chunks step in `step_segments` calls where those
        gathers run while the next chunks step."""
        flat, rt = self.flat, self.runtime
        self._reloaded()
        for s in self.slots:   # a host gradient's shards: those some graph wrote this window
            if self.grad_tier(s):
                n = len(s.chunk.shards)
                flat.mark(s.chunk, None if len(s.written) == n
                          else [i in s.written for i in range(n)])
        # a chunk with no gradient in this step does not step ([Note: steps without a
        # gradient] in runtime/flat.py): nothing of it moves
        stepping = [s for s in self.slots if flat.live_units(s.chunk)]
        ready = [s.chunk for s in stepping if not s.offloaded and not self.grad_tier(s)]
        stepped = rt.stepped if rt is not None else _nothing
        with record_function("deepcompile.optimizer_step"):
            for part in _segments(ready, rt.step_segments if rt is not None else 1):
                flat.step(part)
                stepped(part)
        on_host = [self.host_tier(s) and s.offloaded and s.master_off and host_ready(s, flat)
                   for s in stepping]
        hosted = [s for s, h in zip(stepping, on_host) if h]
        streamed = [s for s, h in zip(stepping, on_host)
                    if not h and (s.offloaded or self.grad_tier(s))]
        if streamed:
            with record_function("deepcompile.optimizer_step_streamed"):
                events = [self._bring(s) for s in streamed[:LOOKAHEAD + 1]]
                for i, s in enumerate(streamed):
                    self._copier.wait(events[i])
                    host_grad = self.grad_tier(s)
                    if host_grad:
                        grads.ready(s, self.grad_scale)
                    flat.step([s.chunk])
                    stepped([s.chunk])
                    s.host_opt = None   # its scalars moved on the device ([Note: the host step])
                    self._offload(s)
                    if self.master_tier(s):
                        self._master_out(s)
                    if host_grad:
                        flat.release_grads([s.chunk])
                    j = i + LOOKAHEAD + 1
                    if j < len(streamed):
                        events.append(self._bring(streamed[j]))
            self._counts["streamed_at_step"] += len(streamed)
        if hosted:
            with record_function("deepcompile.optimizer_step_host"):
                t0 = time.perf_counter()
                scale = None if self.grad_scale is None else self.grad_scale.to("cpu")
                groups = {id(p): g for g in flat.inner.param_groups for p in g["params"]}
                ups = [step_on_host(s, flat, self._copier, groups[id(s.chunk.units[0].param)],
                                    scale, self._counts) for s in hosted]
                for s in hosted:   # units split: the facade's state of them made again
                    if s.faces is None:
                        flat.show_state([s.chunk])
                        s.show(flat.facade.state, s.tensors(flat.inner))
                self._copier.wait(ups)   # the next forward's gathers read the copies
                stepped([s.chunk for s in hosted])
                self.host_seconds += time.perf_counter() - t0
            self._counts["stepped_on_host"] += len(hosted)

    def host_step_rate(self) -> float:
        """Seconds per element of the host step on this rank ([Note: the host step]), measured
        on the largest chunk's size (at most 16 M elements: past the host's caches, as the
        step's chunks are). Local: agreed over the ranks at start-up (compiler/host.py)."""
        numel = max((c.numel for c in self.flat.chunks), default=0)
        return host_step_seconds(self.flat, numel) / numel if numel else float("inf")

    def host_capacity(self) -> float:
        """Host bytes this rank's plan may keep: what the node has available now
        (`/proc/meminfo`'s MemAvailable; inf where there is none), shared by its local ranks
        (`LOCAL_WORLD_SIZE`), plus this engine's host buffers already made (a plan reuses
        them). Local: agreed over the ranks at start-up (compiler/host.py)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        return mem_available() / max(local, 1) + self.host_buffer_bytes()

    def host_buffer_bytes(self) -> int:
        """Bytes of this engine's host buffers (state, gradients, masters, the copies' staging)."""
        return sum(s.host_bytes() for s in self.slots)

    def _bring(self, slot: ChunkBuffers) -> list:
        """Start copying what the step needs of a streamed chunk: its state, its gradient."""
        events = [self._reload(slot)]
        if self.grad_tier(slot):
            events.append(grads.bring(slot, self._copier, self._counts))
        if self.master_tier(slot):
            events.append(self._master_in(slot))
        return events

    def after_step(self) -> None:
        """After the optimizer step: every chunk at tier >= 1 leaves the device (the copies
        overlap the next forward); the step's figures are recorded; the host gradients start a
        new window."""
        # copies back still under way (a skipped step never waited for the reloads of the last
        # backward): done before their state goes out again, or the copy out reads it half
        # written and the freed block takes the rest of the copy in
        self._reloaded()
        self._copier.collect()
        self.grad_scale = None
        for s in self.slots:
            if s.written:
                s.written.clear()
                s.sumsq.zero_()
        if self.active:
            for s in self.slots:
                if self.tier(s) >= STATE:
                    self._offload(s)
                if self.master_tier(s):   # a plan just set (a skipped step streamed nothing)
                    self._master_out(s)
            self.stats["steps"] += 1
            for k, v in self._counts.items():
                self.stats[k] += v
            self.last_step = dict(self._counts)
        self._counts = self._zero_counts()

    @staticmethod
    def _zero_counts() -> dict[str, int]:
        return {"d2h_bytes": 0, "h2d_bytes": 0, "reloaded_in_graph": 0, "streamed_at_step": 0,
                "deferred_by_meter": 0, "grad_d2h_bytes": 0, "grad_h2d_bytes": 0,
                "master_d2h_bytes": 0, "master_h2d_bytes": 0, "stepped_on_host": 0,
                "lowp_h2d_bytes": 0}

    def summary(self) -> dict:
        """What is offloaded and what moved: for the report."""
        self._copier.collect(block=True)
        sec = dict(self._copier.seconds)
        copy_s = sec["d2h"] + sec["h2d"]
        # the CPU's copies are synchronous: all of their time is exposed; on CUDA the compute
        # stream is blocked only while it waits for copies back
        exposed = sec["stall"] if self._copier.cuda else copy_s
        chunks = [{"chunk": s.chunk.index, "tier": TIER_NAMES[self.tier(s)],
                   "params": [e.name for e in s.chunk.entries][:3] + (
                       ["..."] if len(s.chunk.entries) > 3 else []),
                   "state_bytes": self.state_bytes(s), "offloaded": s.offloaded,
                   "grad_bytes": self.grad_bytes(s) if self.tier(s) >= GRADS else 0,
                   "master_bytes": self.master_saving(s) if self.master_tier(s) else 0}
                  for s in self.slots if self.tier(s) > RESIDENT]
        return {
            "chunks": chunks,
            "offloaded_bytes": sum(c["state_bytes"] for c in chunks),
            "offloaded_grad_bytes": sum(c["grad_bytes"] for c in chunks),
            "offloaded_master_bytes": sum(c["master_bytes"] for c in chunks),
            "host_buffer_bytes": self.host_buffer_bytes(),
            "pinned": self._copier.cuda,
            "last_step": self.last_step, "totals": dict(self.stats),
            "measured_copy_s": copy_s, "measured_exposed_s": exposed,
            "measured_hidden_s": max(copy_s - exposed, 0.0),
            "measured_host_step_s": self.host_seconds,
        }

    # -- optimizer state dict ------------------------------------------------------------------
    def _state_dict_hook(self, optimizer, state_dict):
        # state brought back by the last backward, its copies not yet waited for (between the
        # backward and the step): the caller reads it after the wait (CUDA: the compute stream)
        self._reloaded()
        off = [s for s in self.slots if s.offloaded]
        if not off:
            return state_dict
        self._copier.host_sync()
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                                 for p in g["params"])}
        for s in off:
            s.host_state(index, state_dict["state"])
        return state_dict

    def _before_load(self, *_) -> None:
        """Before `load_state_dict` replaces the flat state: the copies back into the tensors it
        is about to free are done (CUDA: a block freed under a copy would take its bytes)."""
        self._reloaded()

    def _after_load(self) -> None:
        # the flat state was replaced by resident tensors: what was offloaded is no more
        self._pending = []
        for s in self.slots:
            s.offloaded, s.loaded, s.saved, s.faces = False, None, None, None
            s.host_opt = None   # the loaded scalars are the inner's ([Note: the host step])
        if self.active:
            for s in self.slots:
                if self.tier(s) >= STATE:
                    self._offload(s)


def _nothing(_chunks) -> None:
    return None


def _segments(chunks: list[Chunk], n: int) -> list[list[Chunk]]:
    """`chunks` in at most `n` consecutive parts of (nearly) equal length (one: all of them,
    in one call)."""
    n = max(1, min(n, len(chunks)))
    if n == 1:
        return [chunks]
    size, extra = divmod(len(chunks), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        out.append(chunks[start:end])
        start = end
    return out
