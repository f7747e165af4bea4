"""Parameter registry and sharding.

Each unique `nn.Parameter` (by identity, so tied weights are one parameter) gets a process-wide
integer id (`pid`) and a flat, padded shard of `ceil(numel / S)` elements on this rank (S: the
ranks the layout shards over, every rank or a group's: [Note: layouts] in runtime/mesh.py): a leaf
`nn.Parameter` that the optimizer updates (the master copy; fp32 under mixed precision), at
every ZeRO stage.  ZeRO-3: the module's own parameter keeps its shape, stride and dtype (the
compute dtype) but its storage is freed, so Dynamo traces full-size math and any eager access
to it without a gather fails loudly instead of reading stale values.  ZeRO-1/2: the module's
parameter stays materialized, replicated on every rank in the compute dtype, in a padded buffer
(`padded_numel` elements, the parameter a view of its head) so that the refresh after each
optimizer step copies every rank's shard straight into it (`runtime/replicas.py`).

`lookup(pid)` is the one process-wide table of parameters: it resolves the pid a graph's
insertion ops carry to its entry. Nothing else is keyed by pid across engines (an op that needs
its engine's runtime state names it by its handle: `runtime_of` in runtime/runtime.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from . import memory
from .comm import Comm

if TYPE_CHECKING:
    from .mesh import Layout

_NEXT_PID = itertools.count()
_ENTRIES: "weakref.WeakValueDictionary[int, ParamEntry]" = weakref.WeakValueDictionary()


@dataclasses.dataclass(eq=False)
class ParamEntry:
    pid: int
    names: list[str]               # every fqn of this parameter (tied weights: several)
    param: nn.Parameter            # the module's parameter; storage freed between uses (ZeRO-3)
    shape: torch.Size
    numel: int
    shard: nn.Parameter            # this rank's flat padded shard (master)
    compute_dtype: torch.dtype     # dtype of the gathered parameter
    reduce_dtype: torch.dtype      # dtype of the gradient reduce-scatter
    comm: Comm                     # the ranks the shards span (the layout's `pieces`)
    layout: "Layout"
    zero_stage: int = 3            # 3: param storage freed; 1, 2: param replicated
    # ZeRO-1/2: the replicated parameter's detached alias (same memory), which compiled graphs
    # take in its place ([Note: gradients to shards] in compiler/replicated.py)
    replica: torch.Tensor | None = None
    # offload tier 3 ([Note: masters on the host] in runtime/offload/masters.py): while the master
    # shard lives on the host, the device holds this copy of it in the compute dtype, and
    # every gather reads it instead of `shard` (whose storage is released then)
    lowp: torch.Tensor | None = None

    @property
    def padded_numel(self) -> int:
        return self.shard.numel() * self.comm.world

    @property
    def name(self) -> str:
        return self.names[0]

    def gather(self, shard: torch.Tensor | None = None) -> torch.Tensor:
        """The full parameter in compute dtype, in new memory owned by the caller (the
        reference implementation of a gather; compiled graphs run lowered collectives)."""
        src = (self.shard if shard is None else shard).detach()
        if self.lowp is not None and src.untyped_storage().nbytes() == 0:
            src = self.lowp   # the master is on the host (offload tier 3): its device copy
        if src.dtype != self.compute_dtype:
            src = src.to(self.compute_dtype)
        buffer = self.comm.all_gather(src)
        if memory.TRACKER is not None:
            memory.TRACKER.track(buffer)
        return buffer[: self.numel].view(self.shape)

    def reduce_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Average a full gradient over ranks; this rank's shard slice in the master dtype
        (new memory)."""
        flat = grad.detach().reshape(-1).to(self.reduce_dtype)
        pad = self.padded_numel - self.numel
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        return self.layout.reduce_avg(flat).to(self.shard.dtype, copy=True)

    # -- module parameter storage (eager fallback) --
    def is_materialized(self) -> bool:
        return self.param.untyped_storage().nbytes() > 0

    def materialize(self) -> None:
        full = self.gather()
        p = self.param
        p.untyped_storage().resize_(p.numel() * p.element_size())
        with torch.no_grad():
            p.copy_(full)

    def release(self) -> None:
        self.param.untyped_storage().resize_(0)


def lookup(pid: int) -> ParamEntry:
    try:
        return _ENTRIES[pid]
    except KeyError:
        raise RuntimeError(f"deepcompile: parameter id {pid} is not registered (its engine was "
                           "deleted while a compiled graph still refers to it)") from None


def padded_view(t: torch.Tensor, world: int) -> torch.Tensor:
    """`t` (a contiguous tensor at the head of a storage of `padded_numel` elements) viewed as
    the [world, shard_numel] rows a gather of its shards produces."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.new_empty(0).set_(t.untyped_storage(), 0, (world, n // world))


class ParamRegistry:
    """The sharded parameters of one engine's module."""

    def __init__(self, module: nn.Module, layout: "Layout", *, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, zero_stage: int = 3,
                 on_reuse: Callable[[ParamEntry, ParamEntry], None] | None = None) -> None:
        self.layout = layout
        self.comm = layout.pieces   # (hsdp_zero: [Note: pieces in reduction order])
        self.zero_stage = zero_stage
        self.entries: list[ParamEntry] = []
        self._by_id: dict[int, ParamEntry] = {}
        # (compiled-for pid, actual pid) pairs seen when Dynamo reused a graph for other
        # parameters of the same layout (see [Note: graph reuse] in compiler/backend.py).
        self.reuses: set[tuple[int, int]] = set()
        # called with (compiled-for entry, actual entry) on every new reuse pair
        self.reuse_listeners: list[Callable[[ParamEntry, ParamEntry], None]] = (
            [on_reuse] if on_reuse is not None else [])
        # called with (compiled-for entry, actual entry) on every call of a graph with a
        # parameter it was not compiled for
        self.reuse_call_listeners: list[Callable[[ParamEntry, ParamEntry], None]] = []
        names: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
        for key, p in params.items():
            self._add(p, names[key], param_dtype, reduce_dtype)

    def _add(self, p: nn.Parameter, names: list[str], param_dtype, reduce_dtype) -> None:
        comm, layout = self.comm, self.layout
        compute = param_dtype or p.dtype
        master = torch.float32 if param_dtype is not None and p.dtype.is_floating_point else p.dtype
        shard_numel = math.ceil(p.numel() / comm.world)
        padded = shard_numel * comm.world
        with torch.no_grad():
            full = p.detach().contiguous()
            layout.world.broadcast(full, src=0)   # every rank starts from rank 0's, as DDP does
            flat = full.reshape(-1)
            if padded != flat.numel():
                flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
            shard = flat[comm.rank * shard_numel:(comm.rank + 1) * shard_numel].to(master, copy=True)
        entry = ParamEntry(
            pid=next(_NEXT_PID), names=names, param=p, shape=p.shape, numel=p.numel(),
            shard=nn.Parameter(shard, requires_grad=p.requires_grad), compute_dtype=compute,
            reduce_dtype=reduce_dtype or compute, comm=comm, layout=layout,
            zero_stage=self.zero_stage)
        if self.zero_stage == 3:
            # Free the module parameter: same shape/stride, compute dtype, zero-size storage.
            p.data = torch.empty(p.shape, dtype=compute, device=p.device)
            entry.release()
        else:
            # Replicated (ZeRO-1/2): rank 0's weights in the compute dtype, at the head of a
            # padded buffer (the refresh writes every rank's shard straight into it).
            buf = torch.empty(padded, dtype=compute, device=p.device)
            buf[: p.numel()].copy_(full.reshape(-1))
            p.data = buf[: p.numel()].view(p.shape)
            entry.replica = p.detach()
        _ENTRIES[entry.pid] = entry
        self.entries.append(entry)
        self._by_id[id(p)] = entry

    def entry_for(self, tensor: object) -> ParamEntry | None:
        """The entry whose module parameter *is* `tensor` (identity), else None."""
        entry = self._by_id.get(id(tensor))
        return entry if entry is not None and entry.param is tensor else None

    def note_reuse(self, compiled_for: ParamEntry, actual: ParamEntry) -> None:
        for listener in self.reuse_call_listeners:
            listener(compiled_for, actual)
        pair = (compiled_for.pid, actual.pid)
        if pair not in self.reuses:
            self.reuses.add(pair)
            for listener in self.reuse_listeners:
                listener(compiled_for, actual)

    def pid_by_name(self) -> dict[str, int]:
        """{every fqn: pid}: decisions name parameters, never pids (a plan from the cache was
        made in a process that numbered them differently)."""
        return {name: e.pid for e in self.entries for name in e.names}

    def trainable_shards(self) -> list[nn.Parameter]:
        return [e.shard for e in self.entries if e.shard.requires_grad]

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
