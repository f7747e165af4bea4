"""ZeRO-1/2: the replicated module parameters, refreshed from the shards after the optimizer step.

Each rank steps only its shards (the optimizer's parameters), so after `optimizer.step()` the
replicas — the module's own parameters, which the compiled graphs read as plain inputs — are
rebuilt from every rank's updated shards. By default the refresh ends inside `engine.step()`:
fused all-gathers of at most `BUCKET_BYTES` ([Note: fused re-gather] in runtime/regather.py),
copied straight into the parameters' padded storage (`registry.ParamRegistry._add`).

[Note: deferred refresh] With the pass `overlap_refresh` the refresh is an edge of the schedule
instead: each group of replicas (consecutive parameters of one flat chunk) is all-gathered as
soon as its chunk's optimizer update is done (`stepped`, called by the flat step; whatever the
step did not step, e.g. a skipped step, is launched at its end: `refresh`), and nothing waits
for it in the step. Each launch is one coalesced all-gather straight into the members' padded
storage (no buffer of our own: the replica *is* the output), and the work is registered on
every output, so that `wait_tensor` of a replica waits for its group. The replicas are then
*pending* until waited for, and every reader waits first:
  * the next compiled forward: the pass puts a `replica_wait` before the first use of each
    replica (lowered to `wait_tensor`), so the gather runs under the forward up to there;
  * any other compiled graph (one the pass did not plan: an inference graph, a graph compiled
    later) waits for all of them before it runs (`Lowered.prepare`, compiler/lower.py);
  * after the engine's forward returns, whatever is still pending (a parameter no graph read)
    is waited for (`wait`): the backward and the next step never see a pending replica;
  * eager code: a module's forward run eagerly waits first (the eager fallback's hooks,
    runtime/eager.py), and between `step()` and the next forward the module's trainable
    parameters are `PendingParameter`s, whose every non-metadata op waits (guard.py): user
    code reading `model.state_dict()` or a parameter sees the updated values;
  * a checkpoint load waits before it writes the shards (`EngineRuntime.settle`).
Every rank launches the same groups in the same order (chunk order; the plan is agreed), and a
group is launched once per step. The values are bitwise those of the synchronous refresh: the
same shards, cast the same way, copied into the same storage.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Callable

import torch
from torch.profiler import record_function

from .. import _compat
from .regather import RegatherPlan
from .registry import ParamEntry, padded_view

BUCKET_BYTES = 256 << 20


def padded_flat(entry: ParamEntry) -> torch.Tensor:
    """The replica's whole padded storage as one flat tensor (what a gather of its shards
    fills)."""
    return padded_view(entry.param.data, entry.comm.world).view(-1)


class _Group:
    """One deferred launch: consecutive trainable replicas of one chunk, in one compute dtype."""
    __slots__ = ("entries", "chunk", "shards", "outputs", "dtype", "sizes", "cast", "nbytes",
                 "comm")

    def __init__(self, entries: list[ParamEntry], chunk: int) -> None:
        self.entries = entries
        self.chunk = chunk
        self.shards = [e.shard for e in entries]       # the live leaves (views of the chunk)
        self.outputs = [padded_flat(e) for e in entries]
        self.dtype = entries[0].compute_dtype
        self.sizes = [e.shard.numel() for e in entries]
        self.cast = any(e.shard.dtype != self.dtype for e in entries)
        self.comm = entries[0].comm
        self.nbytes = sum(self.sizes) * self.comm.world * self.dtype.itemsize

    @torch.no_grad()
    def launch(self) -> tuple[object, list[torch.Tensor]]:
        """(work, the inputs it reads): the inputs are the shards, or their cast into one
        buffer of the compute dtype (a few calls, none per parameter)."""
        inputs = self.shards
        if self.cast:
            inputs = list(torch.empty(sum(self.sizes), dtype=self.dtype,
                                      device=self.shards[0].device).split(self.sizes))
            torch._foreach_copy_(inputs, self.shards)
        work = self.comm.all_gather_coalesced_async(self.outputs, inputs, self.nbytes)
        _compat.register_work(self.outputs, work)
        return work, inputs


class Replicas:
    def __init__(self, entries: list[ParamEntry], bucket_bytes: int = BUCKET_BYTES) -> None:
        self.entries = entries
        self.bucket_bytes = bucket_bytes
        self._plans: dict[bool, RegatherPlan] = {}
        # the deferred refresh ([Note: deferred refresh]): None, or the groups in launch order
        self.groups: list[_Group] | None = None
        self._by_chunk: dict[int, list[int]] = {}   # chunk index -> its groups' positions
        self.segments = 1   # calls the optimizer step of the resident chunks is split into
        self._launched: set[int] = set()            # groups launched since the last refresh
        # per pending group: (work, its outputs, its inputs, bytes of the inputs it cast)
        self._pending: list[tuple[object, list[torch.Tensor], list[torch.Tensor], int]] = []
        self.suspended = False
        # called with True when replicas become pending, with False when they are waited for
        # (the model guard switches the parameters' class: guard.py)
        self.listeners: list[Callable[[bool], None]] = []
        # the refresh of a training loop's last step is still pending when the script ends: it
        # is waited for then (c10d warns at exit about work registered for `wait_tensor` and
        # never waited for)
        atexit.register(_wait_at_exit, weakref.ref(self))

    def _plan(self, frozen_too: bool) -> RegatherPlan:
        plan = self._plans.get(frozen_too)
        if plan is None:
            entries = [e for e in self.entries if frozen_too or e.shard.requires_grad]
            plan = self._plans[frozen_too] = RegatherPlan(
                entries, [padded_view(e.param.data, e.comm.world) for e in entries],
                self.bucket_bytes, label="deepcompile.refresh_replicas")
        return plan

    @property
    def plan(self) -> RegatherPlan:
        """How the synchronous refresh after every optimizer step gathers the trainable
        replicas."""
        return self._plan(False)

    # -- the deferred refresh ---------------------------------------------------------------
    @property
    def deferred(self) -> bool:
        """The refresh after the optimizer step is left in flight ([Note: deferred refresh])."""
        return self.groups is not None and not self.suspended

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def defer(self, layout: tuple[int, list[tuple[int, list[ParamEntry]]]] | None) -> None:
        """From the next step on, refresh without waiting: `layout` is (the number of calls the
        optimizer step of the resident chunks is split into, the groups as (chunk index,
        entries) in launch order); None: synchronously. At a step boundary, on every rank
        alike."""
        self.wait()
        self._launched.clear()
        if layout is None:
            self.groups, self._by_chunk, self.segments = None, {}, 1
            return
        self.segments, groups = layout
        self.groups = [_Group(entries, chunk) for chunk, entries in groups]
        self._by_chunk = {}
        for i, g in enumerate(self.groups):
            self._by_chunk.setdefault(g.chunk, []).append(i)

    def layout(self) -> tuple[int, list[tuple[int, list[ParamEntry]]]] | None:
        """The deferred refresh as `defer` takes it (None: synchronous)."""
        if self.groups is None:
            return None
        return self.segments, [(g.chunk, list(g.entries)) for g in self.groups]

    def stepped(self, chunks) -> None:
        """The optimizer step updated `chunks` (runtime/flat.py's): launch their groups."""
        if not self.deferred:
            return
        with record_function("deepcompile.refresh_replicas_start"):
            for c in chunks:
                for i in self._by_chunk.get(c.index, ()):
                    self._launch(i)

    def _launch(self, i: int) -> None:
        if i in self._launched:
            return
        self._launched.add(i)
        g = self.groups[i]
        work, inputs = g.launch()
        first = not self._pending
        self._pending.append((work, g.outputs, inputs,
                              sum(g.sizes) * g.dtype.itemsize if g.cast else 0))
        if first:
            for fn in self.listeners:
                fn(True)

    def wait(self) -> None:
        """Wait for every pending group (no-op when none is)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        with record_function("deepcompile.refresh_replicas_wait"):
            for _work, outputs, _inputs, _cast in pending:   # pops each output's work
                _compat.wait_tensors(outputs)
        for fn in self.listeners:
            fn(False)

    def suspend(self) -> None:
        """Refresh synchronously until `resume` (steps that run graphs from before the pass:
        they do not wait)."""
        self.wait()
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False

    def held_bytes(self) -> int:
        """The cast inputs of pending groups (the outputs are the replicas themselves)."""
        return sum(p[3] for p in self._pending)

    def refresh(self, frozen_too: bool = False) -> int:
        """Copy every rank's shards into the replicated module parameters (the frozen ones too
        when they changed: a checkpoint load). Deferred: launch the groups the step did not
        launch and return; otherwise (and for a load) wait for anything pending and gather
        now. Returns the number of collectives launched."""
        if self.deferred and not frozen_too:
            n = len(self.groups) - len(self._launched)
            for i in range(len(self.groups)):
                self._launch(i)
            self._launched.clear()
            return n
        self.wait()
        return self._plan(frozen_too).run()


def _wait_at_exit(ref: weakref.ref) -> None:
    replicas = ref()
    if replicas is not None:
        replicas.wait()
