"""What the device does not hold between optimizer steps: the run-time side of `offload_optimizer`.

The unit is a *chunk* of the flat layout (runtime/flat.py): a few contiguous buffers per chunk,
so everything here is per chunk and per reload group, never per parameter. A chunk's *tier*
says what of it lives on the host between optimizer steps:

  0  everything on the device;
  1  its optimizer state (Adam's moments), on the host from the end of one optimizer step to
     the backward of the next window's last micro-step (`reload_state` ops bring it back where
     the plan says) or, if no graph brought it back, streamed in during the step itself;
  2  its optimizer state and its gradients: each shard gradient leaves the device where the
     backward graph produces it (`grad_to_host` ops, [Note: gradients on the host]), and the
     step streams the chunk's gradient in with its state;
  3  its optimizer state, its gradients and its master shards ([Note: masters on the host]):
     the device keeps a copy of the shards in the compute dtype, which the gathers read;
  4  as 3, and the chunk steps on the host ([Note: the host step]): nothing of it crosses
     PCIe at the step but its copy in the compute dtype, going up.

The optimizer step runs on the device, chunk by chunk where it must (`run_step`): the chunks
whose state is on the device step in one inner-optimizer call; each remaining chunk's state is
copied in (the next one's copy already running), stepped, and copied out again, so the step
needs room for at most two offloaded chunks, not for all the state. Tier-4 chunks step on the
host instead, and need no room at all.

[Note: provisional offload] Until the pass has planned, an engine configured with it keeps
every chunk at tier 1 (`provisional`): the warm-up and profiled steps fit whatever the budget is
(that is what the plan is about), the profiles are measured without the state, and the planner
adds it back (`profile_offset`). Under an unbounded budget nothing would ever be offloaded, and
the chunks stay on the device from the start (the pass then plans nothing and changes no graph:
no re-profile, no timed verdict).

[Note: offload streams] On CUDA the copies run on two copy streams (`_CudaCopier`), one per
direction (PCIe is full duplex), ordered by events, never by luck:
  * device -> host: the d2h stream waits for the compute stream (the step wrote the state),
    copies into the chunk's pinned host buffers, records an event (`Slot.saved`), and the
    device tensors are marked as used by the d2h stream (`record_stream`) before their storage
    is released, so the caching allocator does not hand the memory out before the copy read it;
  * host -> device: the storage is re-allocated on the compute stream (where the optimizer
    uses it); the h2d stream waits for the compute stream (the block may have been freed by
    compute work still queued) and for the chunk's last `saved` event (its host buffer is
    complete), copies, and records `Slot.loaded`; the compute stream waits for that event
    before stepping the chunk;
  * the host reads a host buffer (a state dict, a checkpoint) only after the d2h stream is
    synchronized (`host_sync`).
On the CPU `_SimCopier` imitates this: a copy to the device is *deferred* until someone waits
for its event (so a step that forgot to wait reads garbage and the parity tests fail). A copy
to the host is deferred too: one in-order queue, as the d2h stream, run when an event in it (or
one after it) is waited for, or at `host_sync`. Where the source is released right after (the
state, a master: on CUDA, `record_stream` keeps the block intact until the copy read it) the
queued copy reads a snapshot taken now; where the source lives on in the caller's hands (a
gradient, `late=True`) it reads the source itself — so a source that the caller overwrites before
the copy ran shows up on the CPU too, and so does a host reader that did not wait (the host
step, a state dict). Everything else — which chunks, which events, which storage is
released — is the same code on both.

[Note: gradients on the host] A tier-2 chunk's shard gradients never reach `shard.grad`: the
pass puts a `grad_to_host(grad, pid)` op right after the node that produces each of them in
the backward graphs, and the lowering (compiler/lower.py) returns None in that gradient's place
(autograd then accumulates nothing), so the value is freed once its copy has read it. The op
copies the gradient into its slice of the chunk's host gradient buffer (`Slot.host_grad`): the
first gradient of the window is copied, a later one (the next micro-step, or a second use of
the parameter) is added to it on the device — the slice is copied back, `old + new` added as
autograd's accumulation does, and copied out again — so the sum is bitwise the one autograd
makes. Each write also records the norm of the slice's new value (`Slot.sumsq`, per shard,
overwritten: the last write is the window's gradient), from which the step gets the gradient
norm and the inf/NaN check without reading the host buffers (`host_grad_sumsq`). At the step
(`run_step`) the chunk's gradient is copied into its flat gradient with its state, the slices
of shards no graph wrote are zeroed, the loss scale and clipping factor the engine decided are
applied (`grad_scale`), and the chunk steps. A stray device gradient of a tier-2 shard (the eager
fallback, a local accumulator flushed at the step) is sent to the host before the check
(`begin_step`). A graph planned for a tier that is no longer in force (a re-plan in the middle
of an accumulation window) still calls the op: the gradient then goes to `shard.grad` as
autograd would have put it, and the host gradients of a chunk leaving tier 2 are brought back
into `shard.grad` (`_grads_back`). A re-plan profiles the graphs as compiled, without the ops
([Note: a re-plan starts over] in compiler/planner.py): an op accumulates its gradient as soon
as it is made, where autograd keeps it to the graph's end, and the re-plan would plan from a
step lighter than its own.

[Note: masters on the host] A tier-3 chunk's master (its flat parameter, of which the shards
are views) lives on the host between optimizer steps, in a pinned buffer (`Slot.host_master`).
What the device keeps is a copy of it in the compute dtype (`Slot.lowp`; each registry entry's
`lowp` is its slice), made from the master after each step: the gathers read that copy instead
of the shard ([Note: runtime inputs] in compiler/lower.py: a fixed extra input, which is why a
chunk with a parameter whose graph Dynamo reuses stays below tier 3, as for tier 2), and so
does the eager fallback (`ParamEntry.gather` reads `lowp` where the shard's storage is
released). The device saves the master's bytes less the copy's: only where the compute dtype
is narrower (bf16 or fp16 under fp32 masters), and only at ZeRO-3 (ZeRO-1/2 keep a full
replica anyway). At the step the master streams in with the state and the gradient, steps,
goes back out, and the copy is refreshed from it (`_master_out`); the master's storage is then
released (its shards' data pointers change at every step: no table may key a tier-3 shard by
its pointer — kept parameters and gradient accumulators stay off tier 3). Graphs lowered
before the copies appeared (or vanished) read the wrong tensor: every change of the set of
copies bumps `EngineRuntime.epoch`, and the pipeline drops its lowered and compiled code of an
older epoch. Whatever reads or writes master values outside the graphs and the step (a
checkpoint, `full_state_dict`, a load) runs inside `masters_home()`, which brings them back and,
after it, refreshes the copies and sends them out again.

[Note: the host step] A tier-4 chunk has everything the optimizer reads and writes on the host
(its master, its Adam moments, its window's gradient: tier 3), so it steps there, as DeepSpeed's
ZeRO-Offload does with its CPU Adam: per step its gradient goes down (during the backward, as
at tier 2) and its copy in the compute dtype goes up (2 bytes per parameter under bf16),
where streaming it through the device moves master, state and gradient in and master and state
out (28 bytes per parameter for fp32 AdamW). Whether that is faster depends on the host's cores
against PCIe: the pass measures the host step here (`host_step_seconds`) and plans it where the
prediction says so (passes/offload_optimizer.py). The step itself (`_host_step`):
  * waits on the host for the chunk's copies out (its gradient's last one, its state's, its
    master's): on CUDA the events are synchronized, so the host reads complete buffers;
  * makes the gradient what the device's fold would have made (gaps and unwritten shards zero,
    times the engine's factor: `grad_scale`, brought to the host once per step);
  * steps it with a host instance of the inner optimizer's class (`Slot.host_opt`: one
    parameter, the pinned master; its state *is* the chunk's host buffers; torch's fused CPU
    kernel where the inner optimizer is fused), with the inner group's hyperparameters of now
    (the LR scheduler's); the inner optimizer's scalars (Adam's `step`) are read once when the
    host instance is made and written back after each host step, so the facade's state, a
    checkpoint and a later device step see the same count. A load, or a step of the chunk on the
    device, drops the host instance (it is made again from the inner's scalars);
  * casts the master into a pinned buffer in the compute dtype (`Slot.host_lowp`) and copies
    that up into the device copy (`Slot.lowp`) on the copy stream, after the compute stream's
    queued work (the last backward read the old copy); the compute stream waits for every such
    copy before the step returns (the next forward's gathers read them). The next chunk's host
    step runs while it goes up. Before the host writes `host_lowp` again, it waits for the last
    copy up from it.
A tier-4 chunk whose state or master is still on the device (the step right after the plan was
set) is streamed as tier 3 this once. On the CPU the two ways run the same kernels on the same
memory: bitwise the same (tests/test_offload_masters.py); on CUDA the host's kernel is torch's CPU
one, the device's the CUDA one: equal within rounding, not bitwise.

[Note: optimizer state access] The facade's per-parameter state (views, runtime/flat.py) of an
offloaded chunk would have no storage between steps, and reading a view of a released storage
crashes the process (a segfault on the CPU, an illegal memory access on CUDA). So while a chunk
is off the device its shards' entries in `engine.optimizer.state` are *meta* tensors of the
same shapes (`_show`: the dicts are made once per chunk and swapped, one store per shard):
printing one says `device='meta'`, and reading its values (`.item()`, `.cpu()`) raises.
`engine.optimizer.state_dict()` gets the values through a post-hook that puts views of the host
buffers in the returned dict (after the copies out are done); `load_state_dict` installs
resident state, then the planned chunks are offloaded again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
from typing import Callable, Iterable

import torch
from torch.profiler import record_function

from .. import _compat
from . import ops
from .flat import Chunk, FlatState, _grad_of, _is_not_none
from .registry import lookup

RESIDENT, STATE, GRADS, MASTERS, HOST = 0, 1, 2, 3, 4
TIER_NAMES = {RESIDENT: "resident", STATE: "state", GRADS: "state+grads",
              MASTERS: "state+grads+masters", HOST: "state+grads+masters, stepped on the host"}
LOOKAHEAD = 1      # offloaded chunks whose copy in runs while the step works on another


def device_bytes(nbytes: int, device: torch.device) -> int:
    """What a tensor of `nbytes` costs the device: CUDA's caching allocator rounds every block
    up to a multiple of 512 bytes (and counts that in `memory_allocated`); the CPU model counts
    storages exactly."""
    if device.type == "cuda":
        return max(512, -(-nbytes // 512) * 512)
    return nbytes


@dataclasses.dataclass(eq=False)
class Slot:
    """One chunk's optimizer state and its host copy."""
    chunk: Chunk
    host: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # key -> host buffer
    offloaded: bool = False          # device storage released; the values live in `host`
    loaded: object = None            # event: copy to the device done
    saved: object = None             # event: copy to the host done
    # tier 2 ([Note: gradients on the host]): the chunk's gradient on the host
    host_grad: torch.Tensor | None = None
    grad_saved: object = None        # event: the last copy into `host_grad` done
    written: set = dataclasses.field(default_factory=set)   # shards written this window
    sumsq: torch.Tensor | None = None   # device, per shard: squared norm of its window gradient
    # the facade's per-shard state dicts of the shards that have state: (shards, on the
    # device (views), off it (meta)): `_show`
    faces: tuple[list, list[dict], list[dict]] | None = dataclasses.field(default=None,
                                                                         repr=False)
    # tier 3 ([Note: masters on the host]): the master on the host, its copy on the device
    host_master: torch.Tensor | None = None
    master_saved: object = None      # event: the copy of the master to the host done
    master_off: bool = False         # the master's device storage is released
    lowp: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    # tier 4 ([Note: the host step]): the host optimizer, the copy's host buffer, its copy up
    host_opt: torch.optim.Optimizer | None = dataclasses.field(default=None, repr=False)
    # its parameters: (unit, the unit's slice of `host_master`) ([Note: steps without a
    # gradient] in runtime/flat.py)
    host_units: list = dataclasses.field(default_factory=list, repr=False)
    host_lowp: torch.Tensor | None = dataclasses.field(default=None, repr=False)
    lowp_loaded: object = None       # event: the copy up from `host_lowp` done

    def tensors(self, optimizer) -> dict[str, torch.Tensor]:
        return self.chunk.state_tensors(optimizer)


class _SimCopier:
    """CPU imitation of the CUDA copier (see [Note: offload streams])."""

    cuda = False

    def __init__(self) -> None:
        self.seconds = {"d2h": 0.0, "h2d": 0.0, "stall": 0.0}
        self.deferred = 0          # copies that ran only when waited for (both ways)
        self._d2h: list[_Pending] = []   # deferred copies to the host, in order (one stream)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], late: bool = False):
        """Queued: it runs when waited for (module doc). Not `late`: the source is released
        right after, so the copy reads a snapshot of it (CUDA's `record_stream`)."""
        if not late:
            pairs = [(host, dev.clone()) for host, dev in pairs]
        copy = _Pending(self, pairs, d2h=True)
        self._d2h.append(copy)
        return copy

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after=None):
        return _Pending(self, pairs, after=after)

    def run_d2h(self, through: "_Pending | None" = None) -> None:
        """Run the deferred copies to the host, in order, up to `through` (all: None)."""
        while self._d2h:
            copy = self._d2h.pop(0)
            copy.copy()
            if copy is through:
                return

    def wait(self, events: Iterable) -> None:
        for ev in events:
            if ev is not None:
                ev.run()

    def host_sync(self) -> None:
        self.run_d2h()

    def host_wait(self, events: Iterable) -> None:
        """The host waits for `events` (it is about to read or write their host buffers)."""
        self.wait(events)

    def collect(self, block: bool = False) -> None:
        pass


class _Pending:
    """A deferred copy (the CPU's stand-in for a copy on a stream and its event): to the
    device, (dev, host) pairs, after the copy to the host `after`; to the host (`d2h`),
    (host, dev) pairs, in its copier's queue."""

    __slots__ = ("copier", "pairs", "after", "d2h")

    def __init__(self, copier: _SimCopier, pairs, after=None, d2h: bool = False) -> None:
        self.copier, self.pairs, self.after, self.d2h = copier, pairs, after, d2h

    def run(self) -> None:
        """Waited for: it (and, to the host, every copy queued before it) has run."""
        if self.pairs is None:
            return
        if self.d2h:
            self.copier.run_d2h(through=self)
            return
        if self.after is not None:
            self.after.run()
        self.copy()

    def copy(self) -> None:
        if self.pairs is None:
            return
        t0 = time.perf_counter()
        for dst, src in self.pairs:
            dst.copy_(src)
        self.copier.seconds["d2h" if self.d2h else "h2d"] += time.perf_counter() - t0
        self.copier.deferred += 1
        self.pairs = None


class _CudaCopier:
    """The copies and events of the offloader on CUDA: the only code that touches streams."""

    cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self._timed: list[tuple[str, object, object]] = []
        self.seconds = {"d2h": 0.0, "h2d": 0.0, "stall": 0.0}
        self.deferred = 0

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return _compat.pinned_empty(like.shape, like.dtype)

    def to_host(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], late: bool = False):
        """Copy device tensors into host buffers; returns the event of completion. (`late`:
        the caller keeps the sources, `_SimCopier`'s business; on CUDA every copy is late.)"""
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)               # after the step wrote them
        start, end = self._events()
        with torch.cuda.stream(self.d2h):
            start.record()
            for host, dev in pairs:
                host.copy_(dev, non_blocking=True)
            end.record()
        for _, dev in pairs:
            dev.record_stream(self.d2h)             # not reused before the copy read it
        self._timed.append(("d2h", start, end))
        return end

    def to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after=None):
        """Copy host buffers into freshly allocated device tensors; returns the event."""
        self.h2d.wait_stream(torch.cuda.current_stream(self.device))   # the blocks are free by now
        if after is not None:
            self.h2d.wait_event(after)                      # the host buffer is complete
        start, end = self._events()
        with torch.cuda.stream(self.h2d):
            start.record()
            for dev, host in pairs:
                dev.copy_(host, non_blocking=True)
            end.record()
        self._timed.append(("h2d", start, end))
        return end

    def wait(self, events: Iterable) -> None:
        """The compute stream waits for `events`; the wait is timed (exposed copy time)."""
        events = [e for e in events if e is not None]
        if not events:
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = self._events()
        start.record(stream)
        for ev in events:
            stream.wait_event(ev)
        end.record(stream)
        self._timed.append(("stall", start, end))

    def host_sync(self) -> None:
        self.d2h.synchronize()

    def host_wait(self, events: Iterable) -> None:
        """The host waits for `events` (it is about to read or write their host buffers)."""
        for ev in events:
            if ev is not None:
                ev.synchronize()

    def collect(self, block: bool = False) -> None:
        left = []
        for what, start, end in self._timed:
            if block:
                end.synchronize()
            elif not end.query():
                left.append((what, start, end))
                continue
            self.seconds[what] += start.elapsed_time(end) / 1e3
        self._timed = left

    @staticmethod
    def _events():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


class Offloader:
    """Places the chunks of one engine between device and host and runs the optimizer step."""

    def __init__(self, flat: FlatState, device: torch.device, runtime=None,
                 compiler: str = "fx") -> None:
        self.flat = flat
        self.device = device
        self.runtime = runtime
        # [Note: gradients on the host] Inductor's generated code hands a buffer to a later
        # kernel once its last reader returned: a `grad_to_host` op whose copy may still read
        # its gradient then copies from a buffer of its own (fx frees through the allocator,
        # which `record_stream` holds off)
        self.own_sources = compiler == "inductor"
        self._copier = _CudaCopier(device) if device.type == "cuda" else _SimCopier()
        self.slots = [Slot(c) for c in flat.chunks]
        self.tiers = [RESIDENT] * len(self.slots)
        self._groups: list[list[Slot]] = []    # what each reload op brings back
        self._pending: list = []               # copy-back events the step waits for
        self.provisional = False               # tier 1 everywhere until a plan is set
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
        self._host_rate: float | None = None   # `host_step_rate`, once measured
        # tier 2: where each parameter's gradient goes, and the factor the engine decided for
        # the host gradients (loss scale, clipping; None: 1)
        self._where = {e.pid: (s, i) for s in self.slots for i, e in enumerate(s.chunk.entries)}
        self.grad_scale: torch.Tensor | None = None
        if flat.inner is not None:
            flat.facade.register_state_dict_post_hook(self._state_dict_hook)
            flat.facade.register_load_state_dict_pre_hook(self._before_load)
            flat.on_load.append(self._after_load)
            flat.on_layout.append(self._layout_changed)

    # -- placement ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.provisional or any(self.tiers)

    def tier(self, slot: Slot) -> int:
        return STATE if self.provisional else self.tiers[slot.chunk.index]

    def grad_tier(self, slot: Slot) -> bool:
        """The chunk's gradients go to the host (tier 2; never while provisional)."""
        return not self.provisional and self.tiers[slot.chunk.index] >= GRADS

    def master_tier(self, slot: Slot) -> bool:
        """The chunk's master lives on the host (tier 3; never while provisional)."""
        return not self.provisional and self.tiers[slot.chunk.index] >= MASTERS

    def host_tier(self, slot: Slot) -> bool:
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
                self._grads_back(s)
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
            self._grads_back(s)
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
    def state_bytes(self, slot: Slot) -> int:
        inner = self.flat.inner
        if inner is None:
            return 0
        return sum(device_bytes(t.numel() * t.element_size(), self.device)
                   for t in slot.tensors(inner).values())

    def grad_bytes(self, slot: Slot) -> int:
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

    def master_saving(self, slot: Slot) -> int:
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
    def _offload(self, slot: Slot) -> None:
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
        self._show(slot, tensors)
        self._counts["d2h_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())

    def _reload(self, slot: Slot) -> object:
        if not slot.offloaded:
            return None
        tensors = slot.tensors(self.flat.inner)
        for t in tensors.values():
            t.untyped_storage().resize_(t.numel() * t.element_size())
        slot.loaded = self._copier.to_device([(t, slot.host[k]) for k, t in tensors.items()],
                                             after=slot.saved)
        slot.offloaded = False
        self._show(slot, tensors)
        self._counts["h2d_bytes"] += sum(t.numel() * t.element_size() for t in tensors.values())
        return slot.loaded

    def _show(self, slot: Slot, tensors: dict[str, torch.Tensor]) -> None:
        """[Note: optimizer state access] The facade's state of the chunk's shards: views of
        the flat state where it is on the device, meta tensors where it is not."""
        state = self.flat.facade.state
        c = slot.chunk
        if slot.faces is None:
            shards = [sh for sh in c.shards if state.get(sh)]   # a shard never stepped: none
            if not shards:
                return
            views = [state[sh] for sh in shards]
            meta = [{k: torch.empty_like(v, device="meta") if k in tensors else v
                     for k, v in d.items()} for d in views]
            slot.faces = (shards, views, meta)
        shards, views, meta = slot.faces
        for sh, d in zip(shards, meta if slot.offloaded else views):
            state[sh] = d

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

    # -- masters on the host ([Note: masters on the host]) ---------------------------------------
    @torch.no_grad()
    def _master_out(self, slot: Slot) -> None:
        """The chunk's master to the host; its device copy in the compute dtype made from it;
        its device storage released."""
        if slot.master_off:
            return
        c = slot.chunk
        master = c.param.detach()
        if slot.lowp is None:
            slot.lowp = torch.empty(c.numel, dtype=c.entries[0].compute_dtype,
                                    device=self.device)
            for e, off in zip(c.entries, c.offsets):
                e.lowp = slot.lowp[off:off + e.shard.numel()]
            self._copies_changed()
        if slot.host_master is None:
            slot.host_master = self._copier.host_buffer(master)
        slot.lowp.copy_(master)
        slot.master_saved = self._copier.to_host([(slot.host_master, master)])
        master.untyped_storage().resize_(0)
        slot.master_off = True
        self._counts["master_d2h_bytes"] += c.nbytes

    def _master_in(self, slot: Slot) -> object:
        """Start copying the chunk's master back into fresh device storage; the event."""
        if not slot.master_off:
            return None
        c = slot.chunk
        master = c.param.detach()
        master.untyped_storage().resize_(c.nbytes)
        event = self._copier.to_device([(master, slot.host_master)], after=slot.master_saved)
        slot.master_off = False
        self._counts["master_h2d_bytes"] += c.nbytes
        return event

    def _masters_back(self) -> None:
        """Every master on the device again and no copies (a new plan, a re-plan coming)."""
        self._copier.wait([self._master_in(s) for s in self.slots])
        dropped = False
        for s in self.slots:
            if s.lowp is not None:
                s.lowp = None
                for e in s.chunk.entries:
                    e.lowp = None
                dropped = True
        if dropped:
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

    # -- gradients on the host ([Note: gradients on the host]) -----------------------------------
    @torch.no_grad()
    def grad_to_host(self, pid: int, grad: torch.Tensor) -> None:
        """A `grad_to_host` op: the shard gradient of parameter `pid` into the host buffer of
        its chunk (added to what the window wrote there before), or, if the chunk is no longer
        at tier 2, into `shard.grad` as autograd would have put it."""
        slot, i = self._where[pid]
        g = grad.detach().reshape(-1)
        if not self.grad_tier(slot):
            _accumulate(slot.chunk.shards[i], g)
            return
        c = slot.chunk
        if slot.host_grad is None:
            slot.host_grad = self._copier.host_buffer(c.grad)
            slot.sumsq = torch.zeros(len(c.shards), dtype=torch.float32, device=self.device)
        off = c.offsets[i]
        host = slot.host_grad[off:off + g.numel()]
        if i in slot.written:   # autograd's accumulation, old + new, on the device
            old = torch.empty_like(g)
            self._copier.wait([self._copier.to_device([(old, host)], after=slot.grad_saved)])
            g = old.add_(g)
            self._counts["grad_h2d_bytes"] += g.numel() * g.element_size()
        elif self.own_sources:   # the graph's buffer may go to its next kernel (see __init__)
            g = g.clone()
        slot.sumsq[i] = torch.linalg.vector_norm(g, dtype=torch.float32).square()
        slot.grad_saved = self._copier.to_host([(host, g)], late=True)
        slot.written.add(i)
        self._counts["grad_d2h_bytes"] += g.numel() * g.element_size()

    def host_grad_sumsq(self) -> torch.Tensor | None:
        """The squared norm (float32, on the device) of this rank's gradients that are on the
        host, None if none is: inf/NaN when one of them holds an inf/NaN."""
        sums = [s.sumsq.sum() for s in self.slots if self.grad_tier(s) and s.sumsq is not None]
        return torch.stack(sums).sum() if sums else None

    def _grads_back(self, slot: Slot) -> None:
        """The window's host gradients of `slot` into its shards' `.grad` (the chunk leaves
        tier 2 in the middle of an accumulation window)."""
        if not slot.written:
            return
        c = slot.chunk
        for i in sorted(slot.written):
            off, n = c.offsets[i], c.shards[i].numel()
            g = torch.empty(n, dtype=c.dtype, device=self.device)
            self._copier.wait([self._copier.to_device([(g, slot.host_grad[off:off + n])],
                                                      after=slot.grad_saved)])
            _accumulate(c.shards[i], g)
        slot.written.clear()
        slot.sumsq.zero_()

    def _grad_in(self, slot: Slot) -> object:
        """Start copying a tier-2 chunk's host gradient into its flat gradient; the event."""
        c = slot.chunk
        c.grad.untyped_storage().resize_(c.nbytes)
        if slot.host_grad is None or not slot.written:
            return None
        self._counts["grad_h2d_bytes"] += c.nbytes
        return self._copier.to_device([(c.grad, slot.host_grad)], after=slot.grad_saved)

    @torch.no_grad()
    def _grad_ready(self, slot: Slot) -> None:
        """After its copy: the flat gradient of a tier-2 chunk as the fold would have made it
        (gaps and shards no graph wrote are zero), times the engine's factor."""
        c = slot.chunk
        if c.gaps:
            torch._foreach_zero_(c.gaps)
        if len(slot.written) < len(c.shards):
            for i, v in enumerate(c.grad_views):
                if i not in slot.written:
                    v.zero_()
        if self.grad_scale is not None:
            c.grad.mul_(self.grad_scale)

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
        synced): resident chunks in one call, offloaded ones streamed through the device,
        tier-4 ones stepped on the host ([Note: the host step]) while the device works."""
        flat = self.flat
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
        with record_function("deepcompile.optimizer_step"):
            flat.step(ready)
        on_host = [self.host_tier(s) and s.offloaded and s.master_off and self._host_ready(s)
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
                        self._grad_ready(s)
                    flat.step([s.chunk])
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
                ups = [self._host_step(s, groups[id(s.chunk.units[0].param)], scale)
                       for s in hosted]
                for s in hosted:   # units split: the facade's state of them made again
                    if s.faces is None:
                        flat.show_state([s.chunk])
                        self._show(s, s.tensors(flat.inner))
                self._copier.wait(ups)   # the next forward's gathers read the copies
                self.host_seconds += time.perf_counter() - t0
            self._counts["stepped_on_host"] += len(hosted)

    @torch.no_grad()
    def _host_step(self, slot: Slot, group: dict, scale: torch.Tensor | None) -> object:
        """Step a tier-4 chunk on the host and start copying its new copy in the compute dtype
        up to the device; the copy's event ([Note: the host step])."""
        c = slot.chunk
        self._copier.host_wait([slot.saved, slot.master_saved, slot.grad_saved])
        if slot.host_grad is None:
            slot.host_grad = self._copier.host_buffer(c.grad)
        g = slot.host_grad
        if len(slot.written) < len(c.shards):   # as `_grad_ready`: per shard only if some are
            for i, (off, sh) in enumerate(zip(c.offsets, c.shards)):
                if i not in slot.written:
                    g[off:off + sh.numel()].zero_()
        for start, end in _gaps(c):
            g[start:end].zero_()
        if scale is not None:
            g.mul_(scale)
        opt = slot.host_opt or self._host_optimizer(slot)
        opt.param_groups[0].update({k: v for k, v in group.items()
                                    if k != "params" and k not in _HOST_IMPL})
        live = {id(u) for u in self.flat.live_units(c)}
        for u, param in slot.host_units:
            if id(u) in live:
                param.grad = g[u.start:u.stop]
        opt.step()
        for u, param in slot.host_units:
            param.grad = None
            inner = self.flat.inner.state[u.param]
            for k, v in opt.state[param].items():   # the scalars back (Adam's step)
                if k not in slot.host:
                    if isinstance(v, torch.Tensor):
                        inner[k].copy_(v)
                    else:
                        inner[k] = v
        if slot.host_lowp is None:
            slot.host_lowp = self._copier.host_buffer(slot.lowp)
        self._copier.host_wait([slot.lowp_loaded])
        slot.host_lowp.copy_(slot.host_master)
        slot.lowp_loaded = self._copier.to_device([(slot.lowp, slot.host_lowp)])
        self._counts["lowp_h2d_bytes"] += slot.lowp.numel() * slot.lowp.element_size()
        return slot.lowp_loaded

    def _host_optimizer(self, slot: Slot) -> torch.optim.Optimizer:
        """The host instance of the inner optimizer for a tier-4 chunk: its parameters the
        pinned master's slices of the chunk's units that have state (one: the whole master),
        their state the chunk's host buffers' slices and host copies of the inner's scalars."""
        inner = self.flat.inner.state
        slot.host_units = [(u, torch.nn.Parameter(slot.host_master[u.start:u.stop],
                                                  requires_grad=True))   # share the buffer
                           for u in slot.chunk.units if inner.get(u.param)]
        opt = host_optimizer(self.flat.inner, [p for _u, p in slot.host_units])
        for u, param in slot.host_units:
            opt.state[param] = {k: slot.host[k][u.start:u.stop] if k in slot.host
                                else v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                                for k, v in inner[u.param].items()}
        slot.host_opt = opt
        return opt

    def _host_ready(self, slot: Slot) -> bool:
        """Every unit of the chunk that steps has state: a unit's first step creates it on the
        device ([Note: steps without a gradient] in runtime/flat.py)."""
        inner = self.flat.inner.state
        return all(inner.get(u.param) for u in self.flat.live_units(slot.chunk))

    def host_step_rate(self) -> float:
        """Seconds per element of the host step on this rank ([Note: the host step]), measured
        once per engine on the largest chunk's size (at most 16 M elements: past the host's
        caches, as the step's chunks are). Local: the pass agrees it over the ranks."""
        if self._host_rate is None:
            numel = max((c.numel for c in self.flat.chunks), default=0)
            self._host_rate = self.host_step_seconds(numel) / numel if numel else float("inf")
        return self._host_rate

    def host_capacity(self) -> float:
        """Host bytes this rank's plan may keep: what the node has available now
        (`/proc/meminfo`'s MemAvailable; inf where there is none), shared by its local ranks
        (`LOCAL_WORLD_SIZE`), plus this engine's host buffers already made (a plan reuses
        them). Local: the pass agrees it over the ranks."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        return _mem_available() / max(local, 1) + self.host_buffer_bytes()

    def host_buffer_bytes(self) -> int:
        """Bytes of this engine's host buffers (state, gradients, masters, the copies' staging)."""
        return sum(t.numel() * t.element_size() for s in self.slots
                   for t in [*s.host.values(), s.host_grad, s.host_master, s.host_lowp]
                   if t is not None)

    def host_step_seconds(self, numel: int, repeats: int = 3) -> float:
        """Seconds the host takes to step `numel` elements of this engine's optimizer (its
        class, its first group's hyperparameters, its implementation as the host step would
        use it), measured here on scratch tensors: the fastest of `repeats` steps of at most
        16 M elements, scaled linearly. `inf` where there is no flat step."""
        inner = self.flat.inner
        if inner is None or numel <= 0:
            return float("inf")
        n = min(numel, 1 << 24)
        dtype = self.flat.chunks[0].dtype
        param = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        param.grad = torch.full((n,), 1e-3, dtype=dtype)
        opt = host_optimizer(inner, [param])
        opt.step()   # the state is made
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            opt.step()
            runs.append(time.perf_counter() - t0)
        return min(runs) * numel / n

    def _bring(self, slot: Slot) -> list:
        """Start copying what the step needs of a streamed chunk: its state, its gradient."""
        events = [self._reload(slot)]
        if self.grad_tier(slot):
            events.append(self._grad_in(slot))
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
            c = s.chunk
            for shard, off_, in zip(c.shards, c.offsets):
                i = index[id(shard)]
                if i not in state_dict["state"]:   # never stepped: no state
                    continue
                n = shard.numel()
                # the packed per-parameter dict IS `optimizer.state[p]`: copy it, never edit it
                state_dict["state"][i] = {**state_dict["state"][i],
                                          **{k: h[off_:off_ + n] for k, h in s.host.items()}}
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


_HOST_IMPL = ("foreach", "fused", "capturable", "differentiable")   # the host instance's own


def host_optimizer(inner: torch.optim.Optimizer, params: list) -> torch.optim.Optimizer:
    """An instance of `inner`'s class over host `params`, with its first group's settings: the
    fused CPU kernel where `inner` is fused and the class has one on the CPU, else torch's
    default implementation ([Note: the host step])."""
    cls = type(inner)
    accepted = inspect.signature(cls.__init__).parameters
    group = inner.param_groups[0]
    kwargs = {k: v for k, v in group.items() if k in accepted and k != "params"
              and k not in _HOST_IMPL}
    if group.get("foreach") is not None and "foreach" in accepted:
        kwargs["foreach"] = group["foreach"]
    if group.get("fused"):
        try:
            return cls(params, **kwargs, fused=True)
        except (RuntimeError, ValueError, TypeError):
            pass
    return cls(params, **kwargs)


def _mem_available() -> float:
    """The host's available memory in bytes (Linux's MemAvailable), inf where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def _gaps(c: Chunk) -> list[tuple[int, int]]:
    """The chunk's alignment gaps as (start, end) element offsets: where `Chunk.gaps` (views of
    the flat gradient) lie, for a host buffer."""
    return [(v.storage_offset(), v.storage_offset() + v.numel()) for v in c.gaps]


def _accumulate(shard: torch.Tensor, grad: torch.Tensor) -> None:
    """`shard.grad` as autograd's accumulation leaves it: the gradient, or old + new."""
    if shard.grad is None:
        shard.grad = grad.detach().clone().view_as(shard)
    else:
        shard.grad.add_(grad.view_as(shard.grad))


# -- the ops the pass inserts into backward graphs ------------------------------------------------
@torch.library.custom_op(f"{ops.NAMESPACE}::reload_state", mutates_args=())
def reload_state(after: torch.Tensor, pids: list[int], group: int) -> None:
    """Start copying reload group `group` (the optimizer state of chunks registered by the pass
    with `add_reload_group`; `pids` name a parameter of the engine) back to the device, in the
    last micro-step of the accumulation window only (the state is needed at the optimizer
    step). `after` orders the op after the node that produced it; no output, so it is
    registered as side-effecting (FX and Inductor keep it)."""
    runtime = lookup(pids[0]).runtime()
    if runtime is None or not runtime.step.last_micro_step:
        return
    with record_function("deepcompile.reload_state"):
        runtime.offload.reload_group(group)


@reload_state.register_fake
def _(after, pids, group):
    return None


RELOAD_STATE = torch.ops.deepcompile.reload_state.default
torch.fx.node.has_side_effect(RELOAD_STATE)
ops.register_comm_op(RELOAD_STATE, "state_reload")   # a host->device copy: not a collective
ops.ORDER_ONLY.add(RELOAD_STATE)


@torch.library.custom_op(f"{ops.NAMESPACE}::grad_to_host", mutates_args=())
def grad_to_host(grad: torch.Tensor, pid: int) -> None:
    """Send the shard gradient `grad` of parameter `pid` to its chunk's host buffer ([Note:
    gradients on the host]): placed right after the node that produces it; the lowered graph
    returns None in its place. No output: registered as side-effecting (FX and Inductor keep
    it), and as a follower (ops.FOLLOWERS: a pass that moves the gradient's node moves it too)."""
    runtime = lookup(pid).runtime()
    if runtime is None:
        raise RuntimeError("deepcompile: a gradient to send to the host belongs to an engine "
                           "that was released")
    with record_function("deepcompile.grad_to_host"):
        runtime.offload.grad_to_host(pid, grad)


@grad_to_host.register_fake
def _(grad, pid):
    return None


GRAD_TO_HOST = torch.ops.deepcompile.grad_to_host.default
torch.fx.node.has_side_effect(GRAD_TO_HOST)
ops.register_comm_op(GRAD_TO_HOST, "grad_offload")   # a device->host copy: not a collective
ops.FOLLOWERS.add(GRAD_TO_HOST)
