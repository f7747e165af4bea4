"""Parameter registry and sharding.

Each unique `nn.Parameter` (by identity, so tied weights are one parameter) gets a process-wide
integer id (`pid`) and a flat, padded shard of `ceil(numel / world)` elements on this rank: a leaf
`nn.Parameter` that the optimizer updates (the master copy; fp32 under mixed precision).  The
module's own parameter keeps its shape, stride and dtype (the compute dtype) but its storage is
freed, so Dynamo traces full-size math and any eager access to it without a gather fails loudly
instead of reading stale values.

The registry is looked up by the custom ops through `pid`, never by position in a graph.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import weakref

import torch
from torch import nn

from . import memory
from .comm import Comm
from .state import StepState

_NEXT_PID = itertools.count()
_ENTRIES: "weakref.WeakValueDictionary[int, ParamEntry]" = weakref.WeakValueDictionary()


@dataclasses.dataclass(eq=False)
class ParamEntry:
    pid: int
    names: list[str]               # every fqn of this parameter (tied weights: several)
    param: nn.Parameter            # the module's parameter; storage freed between uses
    shape: torch.Size
    numel: int
    shard: nn.Parameter            # this rank's flat padded shard (master)
    compute_dtype: torch.dtype     # dtype of the gathered parameter
    reduce_dtype: torch.dtype      # dtype of the gradient reduce-scatter
    comm: Comm
    state: StepState               # the engine's step state (shared by its entries)

    @property
    def padded_numel(self) -> int:
        return self.shard.numel() * self.comm.world

    @property
    def name(self) -> str:
        return self.names[0]

    def gather(self, shard: torch.Tensor | None = None) -> torch.Tensor:
        """The full parameter in compute dtype, in new memory owned by the caller."""
        src = (self.shard if shard is None else shard).detach()
        if src.dtype != self.compute_dtype:
            src = src.to(self.compute_dtype)
        buffer = self.comm.all_gather(src)
        if memory.TRACKER is not None:
            memory.TRACKER.track(buffer)
        return buffer[: self.numel].view(self.shape)

    def reduce_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Average a full gradient over ranks; this rank's shard slice in the master dtype."""
        flat = grad.reshape(-1).to(self.reduce_dtype)
        pad = self.padded_numel - self.numel
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        return self.comm.reduce_scatter_avg(flat).to(self.shard.dtype)

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


class ParamRegistry:
    """The sharded parameters of one engine's module."""

    def __init__(self, module: nn.Module, comm: Comm, *, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, state: StepState | None = None) -> None:
        self.comm = comm
        self.state = state if state is not None else StepState()
        self.entries: list[ParamEntry] = []
        self._by_id: dict[int, ParamEntry] = {}
        # (compiled-for pid, actual pid) pairs seen when Dynamo reused a graph for other
        # parameters of the same layout (see [Note: graph reuse] in compiler/backend.py).
        self.reuses: set[tuple[int, int]] = set()
        names: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
            params[id(p)] = p
        for key, p in params.items():
            self._add(p, names[key], param_dtype, reduce_dtype)

    def _add(self, p: nn.Parameter, names: list[str], param_dtype, reduce_dtype) -> None:
        comm = self.comm
        compute = param_dtype or p.dtype
        master = torch.float32 if param_dtype is not None and p.dtype.is_floating_point else p.dtype
        shard_numel = math.ceil(p.numel() / comm.world)
        with torch.no_grad():
            full = p.detach().contiguous()
            comm.broadcast(full, src=0)  # every rank starts from rank 0's weights, as DDP does
            flat = full.reshape(-1)
            pad = shard_numel * comm.world - flat.numel()
            if pad:
                flat = torch.nn.functional.pad(flat, (0, pad))
            shard = flat[comm.rank * shard_numel:(comm.rank + 1) * shard_numel].to(master, copy=True)
        entry = ParamEntry(
            pid=next(_NEXT_PID), names=names, param=p, shape=p.shape, numel=p.numel(),
            shard=nn.Parameter(shard, requires_grad=p.requires_grad), compute_dtype=compute,
            reduce_dtype=reduce_dtype or compute, comm=comm, state=self.state)
        # Free the module parameter: same shape/stride, compute dtype, zero-size storage.
        p.data = torch.empty(p.shape, dtype=compute, device=p.device)
        entry.release()
        _ENTRIES[entry.pid] = entry
        self.entries.append(entry)
        self._by_id[id(p)] = entry

    def entry_for(self, tensor: object) -> ParamEntry | None:
        """The entry whose module parameter *is* `tensor` (identity), else None."""
        entry = self._by_id.get(id(tensor))
        return entry if entry is not None and entry.param is tensor else None

    def note_reuse(self, compiled_for: ParamEntry, actual: ParamEntry) -> None:
        self.reuses.add((compiled_for.pid, actual.pid))

    def trainable_shards(self) -> list[nn.Parameter]:
        return [e.shard for e in self.entries if e.shard.requires_grad]

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
