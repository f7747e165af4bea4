"""Parameters kept gathered across graphs and micro-steps: the run-time side of `selective_unshard`.

`KeptParams` (one per engine, found from its registry) holds, for each kept parameter, the full
parameter in compute dtype, and for each parameter whose gradient is accumulated locally, a full
gradient accumulator. Two ops use them in place of communication:

* `kept_param(shard, pid, shape, dtype) -> full` replaces `allgather_param` (same arguments):
  a copy of the kept full parameter, no collective;
* `accumulate_grad(grad, pid, shard_numel, shard_dtype) -> shard_grad` replaces `reduce_grad`
  (same arguments): adds the full gradient to the accumulator and returns zeros on every
  micro-step but the last of the accumulation window; on the last one it reduce-scatters the
  sum once and returns this rank's shard of it (`StepState.last_micro_step`).

The kept parameters are re-gathered from the updated shards after every optimizer step
(`refresh`, called by the engine), in fused collectives of at most `MAX_REFRESH_BYTES`.

[Note: kept parameters are copied out] DESIGN §3: an op returns only memory it gives up.
Inductor treats a custom op's output as a buffer of its own: at the buffer's last use it may
hand its memory to the next buffer of the same size and write into it. Seen with a weight whose
last use is a pointwise kernel (`tanh(w)`): `buf2 = buf1; del buf1  # reuse` then
`cpp_fused_tanh_0(buf2)` computes in place, in the op's output. Returning the runtime's
persistent full parameter there overwrites it, and every later use of the parameter (the
backward, the next micro-steps, until the next refresh) reads garbage
(tests/test_selective_unshard.py has that graph). So `kept_param` returns a fresh copy: a
memory copy instead of a collective still saves all the communication, and the graph's memory
is what it was with the gather (the copy is the same size as the gathered tensor it replaces,
and lives exactly as long). The accumulator is never handed out either: `accumulate_grad` reads its
`grad` input and returns new memory (zeros, or the reduce-scatter's output), and copies the
gradient into the accumulator rather than keeping a reference to a graph buffer.

[Note: local gradient accumulation and graph reuse] The accumulator is keyed by the pid baked
into the graph. Dynamo may run one compiled graph for several parameters of the same layout
([Note: graph reuse] in compiler/backend.py): the gradient reaching the op then belongs to
whichever parameter the graph was called with, which the op cannot tell. The planner never
accumulates a parameter involved in graph reuse; should a reuse appear after planning,
`accumulate_grad` raises instead of mixing two parameters' gradients. `kept_param` has no such
problem: it finds the kept copy from the shard it is given, and gathers when that shard is not
kept.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.profiler import record_function

from . import memory, ops, regather
from .registry import ParamEntry, ParamRegistry, lookup

MAX_REFRESH_BYTES = 64 << 20   # one refresh collective at most this many bytes (temporary buffer)

MISSES = {"not_kept": 0}       # kept_param calls that had to gather (a shard not kept)


@dataclasses.dataclass
class _Kept:
    entry: ParamEntry
    full: torch.Tensor   # runtime-owned, compute dtype, the parameter's shape


def kept_bytes(entry: ParamEntry) -> int:
    """Bytes the runtime holds to keep `entry` gathered (the full parameter, compute dtype)."""
    return entry.numel * entry.compute_dtype.itemsize


def accumulator_bytes(entry: ParamEntry) -> int:
    """Bytes of `entry`'s full gradient accumulator (padded, master dtype)."""
    return entry.padded_numel * entry.shard.dtype.itemsize


def refresh_groups(entries: list[ParamEntry], max_bytes: int = MAX_REFRESH_BYTES) -> list[list[ParamEntry]]:
    """How the refresh fuses the kept parameters ([Note: fused re-gather] in regather.py)."""
    return regather.groups(entries, max_bytes)


class KeptParams:
    """The kept parameters and gradient accumulators of one engine."""

    def __init__(self, registry: ParamRegistry) -> None:
        self._registry = weakref.ref(registry)
        self.kept: dict[int, _Kept] = {}          # pid -> kept full parameter
        self._by_ptr: dict[int, _Kept] = {}       # shard data pointer -> kept full parameter
        self.accumulate: set[int] = set()          # pids whose gradient is accumulated here
        self.accum: dict[int, torch.Tensor] = {}   # pid -> accumulator (inside a window only)
        self.groups: list[list[ParamEntry]] = []

    def configure(self, keep: list[int], accumulate: list[int]) -> None:
        """Keep `keep` gathered from now on (filled here, from the current shards) and
        accumulate the gradients of `accumulate` (a subset of `keep`) locally."""
        if self.accum:
            raise RuntimeError("deepcompile: selective unsharding reconfigured inside an "
                               "accumulation window")
        if not set(accumulate) <= set(keep):
            raise ValueError("deepcompile: local gradient accumulation only for kept parameters")
        entries = [lookup(pid) for pid in keep]
        self.kept = {e.pid: _Kept(e, torch.empty(e.shape, dtype=e.compute_dtype,
                                                 device=e.shard.device)) for e in entries}
        self._by_ptr = {k.entry.shard.data_ptr(): k for k in self.kept.values()}
        self.accumulate = set(accumulate)
        self.groups = refresh_groups(entries)
        self.refresh()

    def held_bytes(self) -> int:
        return sum(k.full.untyped_storage().nbytes() for k in self.kept.values()) + \
            sum(a.untyped_storage().nbytes() for a in self.accum.values())

    def refresh(self) -> None:
        """Re-gather every kept parameter from its (updated) shard, in `self.groups`."""
        entries = [e for group in self.groups for e in group]
        if entries:
            regather.regather(entries, [self.kept[e.pid].full for e in entries],
                              MAX_REFRESH_BYTES, label="deepcompile.refresh_kept")

    def full_copy(self, shard: torch.Tensor, pid: int) -> torch.Tensor:
        kept = self._by_ptr.get(shard.data_ptr())
        if kept is None or kept.entry.shard.numel() != shard.numel():
            MISSES["not_kept"] += 1
            return lookup(pid).gather(shard)
        out = kept.full.clone()
        if memory.TRACKER is not None:
            memory.TRACKER.track(out)
        return out

    def accumulate_grad(self, grad: torch.Tensor, pid: int) -> torch.Tensor:
        entry = lookup(pid)
        registry = self._registry()
        if registry is not None and any(pid in pair for pair in registry.reuses):
            raise RuntimeError(
                f"deepcompile: the graph that accumulates the gradient of {entry.name!r} locally "
                "is also run for another parameter (graph reuse appeared after planning); its "
                "gradients cannot be told apart. Leave out the pass `selective_unshard`.")
        acc = self.accum.get(pid)
        last = entry.state.last_micro_step
        if acc is None and last:   # nothing accumulated: an ordinary reduce-scatter
            return entry.reduce_grad(grad)
        if acc is None:
            acc = self.accum[pid] = torch.zeros(entry.padded_numel, dtype=entry.shard.dtype,
                                                device=grad.device)
        acc[: entry.numel].add_(grad.detach().reshape(-1))
        if not last:
            return torch.zeros(entry.shard.numel(), dtype=entry.shard.dtype, device=grad.device)
        del self.accum[pid]
        flat = acc if acc.dtype == entry.reduce_dtype else acc.to(entry.reduce_dtype)
        return entry.comm.reduce_scatter_avg(flat).to(entry.shard.dtype)

    @torch.no_grad()
    def stale(self) -> list[str]:
        """Names of kept parameters whose copy differs from a fresh gather of their shard
        (uncounted collectives, one per kept parameter, in the same order on every rank)."""
        out = []
        for k in self.kept.values():
            e = k.entry
            full = e.comm.all_gather(e.shard.detach().to(e.compute_dtype), count=False)
            if not torch.equal(full[: e.numel].view(e.shape), k.full):
                out.append(e.name)
        return out


_STORES: "weakref.WeakKeyDictionary[ParamRegistry, KeptParams]" = weakref.WeakKeyDictionary()
_BY_PID: "weakref.WeakValueDictionary[int, KeptParams]" = weakref.WeakValueDictionary()


def store_for(registry: ParamRegistry) -> KeptParams:
    """The engine's store (created on first use); its pids resolve to it in the ops."""
    store = _STORES.get(registry)
    if store is None:
        store = _STORES[registry] = KeptParams(registry)
        for entry in registry:
            _BY_PID[entry.pid] = store
    return store


def store_of(registry: ParamRegistry) -> KeptParams | None:
    """The engine's store, or None when nothing was ever kept."""
    return _STORES.get(registry)


def refresh(registry: ParamRegistry) -> None:
    """After the optimizer step: kept parameters follow the updated shards."""
    store = _STORES.get(registry)
    if store is not None:
        store.refresh()


def held_bytes(registry: ParamRegistry) -> int:
    """Bytes the engine's store holds (counted by the CPU memory model)."""
    store = _STORES.get(registry)
    return 0 if store is None else store.held_bytes()


def _store(pid: int) -> KeptParams:
    store = _BY_PID.get(pid)
    if store is None:
        raise RuntimeError(f"deepcompile: parameter id {pid} has no kept-parameter store (its "
                           "engine was deleted while a compiled graph still refers to it)")
    return store


# -- ops -------------------------------------------------------------------------------------
@torch.library.custom_op(f"{ops.NAMESPACE}::kept_param", mutates_args=())
def kept_param(shard: torch.Tensor, pid: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    with record_function(ops._label("kept", (pid,))):
        return _store(pid).full_copy(shard, pid)


@kept_param.register_fake
def _(shard, pid, shape, dtype):
    return shard.new_empty(shape, dtype=dtype)


@torch.library.custom_op(f"{ops.NAMESPACE}::accumulate_grad", mutates_args=())
def accumulate_grad(grad: torch.Tensor, pid: int, shard_numel: int,
                    shard_dtype: torch.dtype) -> torch.Tensor:
    with record_function(ops._label("accumulate_grad", (pid,))):
        return _store(pid).accumulate_grad(grad, pid)


@accumulate_grad.register_fake
def _(grad, pid, shard_numel, shard_dtype):
    return grad.new_empty((shard_numel,), dtype=shard_dtype)


KEPT_PARAM = torch.ops.deepcompile.kept_param.default
ACCUMULATE_GRAD = torch.ops.deepcompile.accumulate_grad.default
# A copy is compute, not communication: kept_param is not a comm op. accumulate_grad blocks on
# a reduce-scatter on the last micro-step only, so it names no collective launched per run.
ops.register_comm_op(ACCUMULATE_GRAD, "reduce_scatter_accumulate", blocking=True)
