"""Optimizer state kept on the host between optimizer steps: the run-time side of the pass
`offload_optimizer`.

A *fragment* is one optimizer state tensor of one parameter shard (Adam's `exp_avg` or
`exp_avg_sq`, ...): `(pid, key)`. The pass decides which fragments leave the device; this module
moves them:

* after the optimizer step (`after_step`), each planned fragment is copied into its host buffer
  (one pinned buffer for all fragments, allocated when the plan is set and reused every step)
  and its device storage is released (`untyped_storage().resize_(0)`: the tensor object in
  `optimizer.state` stays the same, with shape and dtype, only its memory goes);
* during the backward of the last micro-step, `reload_state` ops that the pass inserted where
  its plan says re-allocate the storage and start the copy back (`reload`);
* before the optimizer step (`before_step`), anything not reloaded yet is reloaded (the safe
  fallback: a graph compiled after planning has no reload ops; counted as exposed), and the
  compute stream waits for every copy back.

The optimizer step itself runs on the device, on resident tensors, unchanged.

[Note: provisional offload] Until the pass has planned, an engine configured with it offloads
every movable fragment after each step (`provisional`): the warm-up and profiled steps must fit
whatever the budget is (the state that does not fit is exactly what the plan is about), so
they run with the least state on the device. The profiles are then measured without that state
and the planner adds it back (`provisional_bytes`) to get the curve with all state resident.

[Note: offload streams] On CUDA the copies run on one dedicated copy stream, ordered by events,
never by luck:
  * device -> host: the copy stream first waits for the compute stream (the step's writes to the
    state), copies into the pinned buffer, and the device tensor is marked as used by the copy
    stream (`record_stream`) before its storage is released, so the caching allocator does not
    hand that memory out again until the copy has read it;
  * host -> device: the storage is re-allocated on the compute stream (where the optimizer will
    use it), the copy stream waits for the compute stream (the block may have been freed by
    compute work still in flight), copies, and records an event; the compute stream waits for
    that event before the optimizer step (`before_step`). All later compute-stream work on the
    tensor, its release included, is therefore after the copy;
  * a host buffer is written by the next device -> host copy only after the host -> device copy
    that read it: both run on the copy stream, in issue order;
  * the host reads a buffer (a state dict, a checkpoint) only after `copy_stream.synchronize()`.
On the CPU the same code runs with a second host tensor standing in for the device copy and
synchronous copies (`_Copier` is the one place that differs), so the logic is tested in CI.

[Note: optimizer state access] `optimizer.state` keeps the same tensor objects, so a direct read
of an offloaded tensor between steps fails loudly (zero-size storage) instead of returning stale
values. `optimizer.state_dict()` sees the right values: a post-hook replaces each offloaded
fragment in the returned dict with a host copy of its buffer (the dict owns it; no device memory
is needed). `optimizer.load_state_dict()` installs new, resident tensors; a post-hook then
offloads the planned fragments again.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import torch
from torch.profiler import record_function

from . import ops
from .registry import ParamRegistry, lookup

_ALIGN = 64   # bytes; host buffer views start at multiples of this (any dtype can view them)

@dataclasses.dataclass(eq=False)
class Fragment:
    pid: int
    key: str
    name: str                 # parameter name, for reports
    nbytes: int
    host: torch.Tensor        # view of the host buffer, same shape and dtype as the state
    offloaded: bool = False   # device storage released; the value lives in `host`
    ready: object = None      # CUDA event: copy back done (the compute stream waits for it)


class _Copier:
    """The copies and events of the offloader; the only code that differs on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._timed: list[tuple[str, object, object]] = []   # CUDA: (what, start, end) events
        self.seconds = {"d2h": 0.0, "h2d": 0.0, "stall": 0.0}

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf.pin_memory() if self.cuda else buf

    def to_host(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        if not self.cuda:
            t0 = time.perf_counter()
            host.copy_(dev)
            self.seconds["d2h"] += time.perf_counter() - t0
            return
        self.stream.wait_stream(torch.cuda.current_stream())   # after the step wrote it
        with torch.cuda.stream(self.stream):
            start, end = self._events()
            start.record()
            host.copy_(dev, non_blocking=True)
            end.record()
        dev.record_stream(self.stream)   # its memory is not reused before the copy read it
        self._timed.append(("d2h", start, end))

    def to_device(self, dev: torch.Tensor, host: torch.Tensor):
        """Copy `host` into the freshly allocated `dev`; returns the event to wait for."""
        if not self.cuda:
            t0 = time.perf_counter()
            dev.copy_(host)
            self.seconds["h2d"] += time.perf_counter() - t0
            return None
        self.stream.wait_stream(torch.cuda.current_stream())   # `dev`'s block is free by now
        with torch.cuda.stream(self.stream):
            start, end = self._events()
            start.record()
            dev.copy_(host, non_blocking=True)
            end.record()
        self._timed.append(("h2d", start, end))
        return end

    def wait(self, events: list) -> None:
        """The compute stream waits for `events` (CUDA); the stall is measured."""
        if not self.cuda or not events:
            return
        stream = torch.cuda.current_stream()
        start, end = self._events()
        start.record(stream)
        for ev in events:
            stream.wait_event(ev)
        end.record(stream)
        self._timed.append(("stall", start, end))

    def host_sync(self) -> None:
        """Before the host reads a host buffer."""
        if self.cuda:
            self.stream.synchronize()

    def collect(self, block: bool = False) -> None:
        """Fold the timing events of completed copies into `seconds`; with `block`, wait for
        all of them (for a report), else never make the host wait."""
        left = []
        for what, start, end in self._timed:
            if block:
                end.synchronize()
            elif not end.query():
                left.append((what, start, end))
                continue
            self.seconds[what] += start.elapsed_time(end) / 1e3
        self._timed = left

    def _events(self):
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


class OptimizerStateOffload:
    """Moves planned optimizer-state fragments of one engine between device and host."""

    def __init__(self, optimizer: torch.optim.Optimizer, registry: ParamRegistry,
                 device: torch.device) -> None:
        self.optimizer = optimizer
        self.registry = registry
        self.device = device
        self._copier = _Copier(device)
        self.fragments: list[Fragment] = []
        self._by_key: dict[tuple[int, str], Fragment] = {}
        self._groups: list[list[Fragment]] = []   # what each reload op brings back
        self._buffer: torch.Tensor | None = None
        self._pending: list = []            # copy-back events the step must wait for
        self.provisional = False            # offload everything until a plan is set
        self.stats = {"steps": 0, "d2h_bytes": 0, "h2d_bytes": 0, "reloaded_in_graph": 0,
                      "reloaded_at_step": 0}
        self.last_step: dict[str, int] = {}
        self._step_counts = self._zero_counts()
        optimizer.register_state_dict_post_hook(self._state_dict_hook)
        optimizer.register_load_state_dict_post_hook(self._after_load)

    # -- what can move ------------------------------------------------------------------------
    def _state(self, pid: int) -> dict:
        return self.optimizer.state.get(lookup(pid).shard, {})

    def movable(self) -> list[tuple[int, str, int]]:
        """(pid, key, bytes) of every state tensor that can leave the device: on the device,
        not a scalar, owning its whole contiguous storage. Registry order, keys sorted: the
        same on every rank (shards have the same size everywhere)."""
        out = []
        for e in self.registry:
            for key, t in sorted(self._state(e.pid).items()):
                if _movable(t, self.device):
                    out.append((e.pid, key, t.numel() * t.element_size()))
        return out

    def provisional_bytes(self) -> int:
        """Bytes kept off the device by the provisional offload (what the profiles miss)."""
        return sum(f.nbytes for f in self.fragments) if self.provisional else 0

    def step_bytes(self) -> int:
        """Memory the optimizer step holds, all state on the device: shards, their gradients,
        the state, and the step's temporaries, estimated as one state tensor per parameter
        where torch's optimizers run multi-tensor (`foreach`, their default on CUDA) and the
        largest one otherwise (a loop over parameters)."""
        shards = sum(_nbytes(e.shard) for e in self.registry)
        grads = sum(_nbytes(e.shard) for e in self.registry if e.shard.requires_grad)
        per_param = [[_nbytes(t) for t in self._state(e.pid).values()
                      if isinstance(t, torch.Tensor) and t.device == self.device]
                     for e in self.registry]
        state = sum(map(sum, per_param))
        largest = [max(b, default=0) for b in per_param]
        workspace = sum(largest) if self.device.type == "cuda" else max(largest, default=0)
        return shards + grads + state + workspace

    def held_bytes(self) -> int:
        """What the step holds outside graph values (the CPU memory model's runtime source):
        optimizer state resident on the device and accumulated shard gradients."""
        seen, total = set(), 0
        for e in self.registry:
            tensors = [t for t in self._state(e.pid).values() if isinstance(t, torch.Tensor)]
            if e.shard.grad is not None:
                tensors.append(e.shard.grad)
            for t in tensors:
                if t.device != self.device:
                    continue
                s = t.untyped_storage()
                if s.nbytes() and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
        return total

    # -- plan -----------------------------------------------------------------------------------
    def set_plan(self, fragments: Iterable[tuple[int, str]]) -> None:
        """Keep `fragments` on the host between steps (replaces any previous plan)."""
        self.provisional = False
        self.before_step(count=False)   # everything back on the device
        movable = {(pid, key): n for pid, key, n in self.movable()}
        wanted = list(fragments)
        for pid, key in wanted:
            if (pid, key) not in movable:
                raise RuntimeError(f"deepcompile offload_optimizer: state {key!r} of "
                                   f"{lookup(pid).name} is not a movable tensor on {self.device}")
        offsets, total = [], 0
        for pid, key in wanted:
            offsets.append(total)
            total += -(-movable[(pid, key)] // _ALIGN) * _ALIGN
        self._buffer = self._copier.host_buffer(total) if wanted else None
        self.fragments, self._by_key, self._groups = [], {}, []
        for (pid, key), off in zip(wanted, offsets):
            t = self._state(pid)[key]
            n = movable[(pid, key)]
            host = self._buffer[off:off + n].view(t.dtype).view(t.shape)
            frag = Fragment(pid, key, lookup(pid).name, n, host)
            self.fragments.append(frag)
            self._by_key[(pid, key)] = frag

    def plan_state(self) -> dict:
        """The plan as data (`restore_plan_state`): fragments, reload groups, provisional."""
        return {"fragments": [(f.pid, f.key) for f in self.fragments],
                "groups": [[(f.pid, f.key) for f in g] for g in self._groups],
                "provisional": self.provisional}

    def restore_plan_state(self, state: dict) -> None:
        """Back to a plan taken by `plan_state` (a reverted pass's plan is dropped)."""
        if state == self.plan_state():
            return
        self.set_plan(state["fragments"])
        for group in state["groups"]:
            self.add_reload_group(group)
        self.provisional = state["provisional"]

    def add_reload_group(self, fragments: Iterable[tuple[int, str]]) -> int:
        """Register the fragments one reload op brings back; returns the op's group id."""
        self._groups.append([self._by_key[f] for f in fragments])
        return len(self._groups) - 1

    # -- moving ---------------------------------------------------------------------------------
    def after_step(self) -> None:
        """After the optimizer step: offload every planned fragment (start the copies)."""
        self._copier.collect()
        if self.provisional and not self.fragments:
            self.set_plan([(pid, key) for pid, key, _ in self.movable()])
            self.provisional = True
        for frag in self.fragments:
            if frag.offloaded:
                continue
            t = self._state(frag.pid)[frag.key]
            self._copier.to_host(frag.host, t)
            t.untyped_storage().resize_(0)
            frag.offloaded = True
            self._step_counts["d2h_bytes"] += frag.nbytes

    def reload(self, fragments: list[Fragment], *, in_graph: bool) -> None:
        """Bring `fragments` back where offloaded (start the copies)."""
        for frag in fragments:
            if not frag.offloaded:
                continue
            t = self._state(frag.pid)[frag.key]
            t.untyped_storage().resize_(frag.nbytes)
            frag.ready = self._copier.to_device(t, frag.host)
            if frag.ready is not None:
                self._pending.append(frag.ready)
            frag.offloaded = False
            self._step_counts["h2d_bytes"] += frag.nbytes
            self._step_counts["reloaded_in_graph" if in_graph else "reloaded_at_step"] += 1

    def reload_group(self, group: int) -> None:
        self.reload(self._groups[group], in_graph=True)

    def reload_all(self) -> None:
        self.reload(self.fragments, in_graph=False)

    def before_step(self, count: bool = True) -> None:
        """Before the optimizer step: reload what no graph reloaded (exposed), and make the
        compute stream wait for every copy back."""
        self.reload_all()
        self._copier.wait(self._pending)
        self._pending = []
        if count and self.fragments:
            self.stats["steps"] += 1
            for k, v in self._step_counts.items():
                self.stats[k] += v
            self.last_step = dict(self._step_counts)
        self._step_counts = self._zero_counts()

    @staticmethod
    def _zero_counts() -> dict[str, int]:
        return {"d2h_bytes": 0, "h2d_bytes": 0, "reloaded_in_graph": 0, "reloaded_at_step": 0}

    def summary(self) -> dict:
        """What is offloaded and what moved: for the report."""
        self._copier.collect(block=True)
        sec = dict(self._copier.seconds)
        copy_s = sec["d2h"] + sec["h2d"]
        # On the CPU the copies are synchronous: all of their time is exposed. On CUDA the
        # compute stream is blocked only while it waits for copies back before the step.
        exposed = sec["stall"] if self._copier.cuda else copy_s
        return {
            "fragments": [{"param": f.name, "key": f.key, "bytes": f.nbytes,
                           "offloaded": f.offloaded} for f in self.fragments],
            "offloaded_bytes": sum(f.nbytes for f in self.fragments),
            "host_buffer_bytes": 0 if self._buffer is None else self._buffer.numel(),
            "pinned": self._copier.cuda,
            "last_step": self.last_step, "totals": dict(self.stats),
            "measured_copy_s": copy_s, "measured_exposed_s": exposed,
            "measured_hidden_s": max(copy_s - exposed, 0.0),
        }

    # -- optimizer state dict -------------------------------------------------------------------
    def _state_dict_hook(self, optimizer, state_dict):
        off = [f for f in self.fragments if f.offloaded]
        if not off:
            return state_dict
        self._copier.host_sync()
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        for f in off:
            i = index[id(lookup(f.pid).shard)]
            # the packed per-parameter dict IS `optimizer.state[p]`: copy it, never edit it
            state_dict["state"][i] = {**state_dict["state"][i], f.key: f.host.clone()}
        return state_dict

    def _after_load(self, optimizer) -> None:
        # load_state_dict replaced the state tensors with new, resident ones; on the CPU they
        # may be the loaded tensors themselves, whose storage (from the file) cannot be resized
        for state in optimizer.state.values():
            for key, t in state.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device == self.device \
                        and not t.untyped_storage().resizable():
                    state[key] = t.clone()
        self._pending = []
        for f in self.fragments:
            f.offloaded, f.ready = False, None
        self.after_step()


def _movable(t: object, device: torch.device) -> bool:
    return (isinstance(t, torch.Tensor) and t.device == device and t.dim() > 0
            and t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().resizable()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- the op the pass inserts into backward graphs -------------------------------------------------
@torch.library.custom_op(f"{ops.NAMESPACE}::reload_state", mutates_args=())
def reload_state(after: torch.Tensor, pids: list[int], group: int) -> None:
    """Start copying reload group `group` (optimizer state fragments of the parameters `pids`,
    registered by the pass with `add_reload_group`) back to the device, in the last micro-step
    of the accumulation window only (the state is needed at the optimizer step). `after`
    orders the op after the node that produced it; no output, so it is registered as
    side-effecting (FX and Inductor keep it)."""
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
