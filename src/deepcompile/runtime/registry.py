"""Parameter registry and sharding.

Each unique `nn.Parameter` (by identity, so tied weights are one parameter) gets a process-wide
integer id (`pid`) and a flat, padded shard of `ceil(numel / world)` elements on this rank: a leaf
`nn.Parameter` that the optimizer updates (the master copy; fp32 under mixed precision), at
every ZeRO stage.  ZeRO-3: the module's own parameter keeps its shape, stride and dtype (the
compute dtype) but its storage is freed, so Dynamo traces full-size math and any eager access
to it without a gather fails loudly instead of reading stale values.  ZeRO-1/2: the module's
parameter stays materialized, replicated on every rank in the compute dtype, and is refreshed
from the shards after each optimizer step (`runtime/replicas.py`).

[Note: ZeRO-1 local accumulation] At stage 1 gradients are reduced once per optimizer step: on
the earlier micro-steps of an accumulation window `reduce_grad` adds the full gradient into a
full-size buffer of this rank (`local_grad`, master dtype) and returns a zero shard gradient; on
the last micro-step it reduce-scatters the sum. The buffer belongs to the parameter that
actually produced the gradient, which a reused graph (Dynamo's [Note: graph reuse]) names only
through its shard tensor: the ops then pass the shard, and `lookup_shard` finds its entry.

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
_BY_SHARD: "weakref.WeakValueDictionary[int, ParamEntry]" = weakref.WeakValueDictionary()


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
    zero_stage: int = 3            # 3: param storage freed; 1, 2: param replicated
    local_grad: torch.Tensor | None = None  # ZeRO-1: full gradient accumulated on this rank

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

    def reduce_grad(self, grad: torch.Tensor, owner: "ParamEntry | None" = None) -> torch.Tensor:
        """Average a full gradient over ranks; this rank's shard slice in the master dtype.

        `owner`: the entry whose gradient this is, when not `self` (a reused graph; it has the
        same layout). ZeRO-1 before the last micro-step: kept local, zeros returned."""
        owner = self if owner is None else owner
        if owner.defers_reduce():
            owner.accumulate_local(grad)
            return self.shard.new_zeros(self.shard.shape)
        flat = owner.take_local(grad).reshape(-1).to(self.reduce_dtype)
        pad = self.padded_numel - self.numel
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        return self.comm.reduce_scatter_avg(flat).to(self.shard.dtype)

    # -- ZeRO-1 local accumulation ([Note: ZeRO-1 local accumulation]) --
    def defers_reduce(self) -> bool:
        return self.zero_stage == 1 and not self.state.last_micro_step

    def accumulate_local(self, grad: torch.Tensor) -> None:
        grad = grad.detach().reshape(self.shape)
        if self.local_grad is None:   # a copy: the graph may reuse the gradient's memory
            self.local_grad = grad.to(self.shard.dtype, memory_format=torch.contiguous_format,
                                      copy=True)
        else:
            self.local_grad.add_(grad)

    def take_local(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` plus what was accumulated locally (and the buffer is dropped)."""
        local, self.local_grad = self.local_grad, None
        return grad if local is None else local.add_(grad.reshape(self.shape))

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


def lookup_shard(shard: torch.Tensor) -> ParamEntry:
    """The entry whose shard is `shard` (by storage: a saved graph input may be another tensor
    object over the same memory)."""
    entry = _BY_SHARD.get(shard.data_ptr())
    if entry is None or entry.shard.data_ptr() != shard.data_ptr() \
            or entry.shard.numel() != shard.numel():
        raise RuntimeError("deepcompile: a gradient reduction was given a tensor that is not a "
                           "registered parameter shard (was a shard's storage replaced?)")
    return entry


def lookup(pid: int) -> ParamEntry:
    try:
        return _ENTRIES[pid]
    except KeyError:
        raise RuntimeError(f"deepcompile: parameter id {pid} is not registered (its engine was "
                           "deleted while a compiled graph still refers to it)") from None


class ParamRegistry:
    """The sharded parameters of one engine's module."""

    def __init__(self, module: nn.Module, comm: Comm, *, param_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None, state: StepState | None = None,
                 zero_stage: int = 3) -> None:
        self.comm = comm
        self.zero_stage = zero_stage
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
            reduce_dtype=reduce_dtype or compute, comm=comm, state=self.state,
            zero_stage=self.zero_stage)
        if self.zero_stage == 3:
            # Free the module parameter: same shape/stride, compute dtype, zero-size storage.
            p.data = torch.empty(p.shape, dtype=compute, device=p.device)
            entry.release()
        elif p.data_ptr() != full.data_ptr() or p.dtype != compute:
            # Replicated (ZeRO-1/2): rank 0's weights in the compute dtype.
            p.data = full.to(compute, copy=True)
        _ENTRIES[entry.pid] = entry
        _BY_SHARD[entry.shard.data_ptr()] = entry
        self.entries.append(entry)
        self._by_id[id(p)] = entry

    def entry_for(self, tensor: object) -> ParamEntry | None:
        """The entry whose module parameter *is* `tensor` (identity), else None."""
        entry = self._by_id.get(id(tensor))
        return entry if entry is not None and entry.param is tensor else None

    def note_reuse(self, compiled_for: ParamEntry, actual: ParamEntry) -> None:
        self.reuses.add((compiled_for.pid, actual.pid))

    def local_grad_bytes(self) -> int:
        """Bytes of ZeRO-1 gradients held locally between micro-steps (a runtime-bytes source
        of the CPU memory model)."""
        return sum(e.local_grad.numel() * e.local_grad.element_size()
                   for e in self.entries if e.local_grad is not None)

    def flush_local_grads(self) -> int:
        """Reduce every locally accumulated gradient that the last micro-step did not reduce
        (its parameter got no gradient then) into its shard; how many there were. Every rank
        runs the same graphs, so every rank flushes the same parameters in the same order."""
        n = 0
        for e in self.entries:
            if e.local_grad is not None:
                full, e.local_grad = e.local_grad, None
                shard_grad = e.reduce_grad(full)
                if e.shard.grad is None:
                    e.shard.grad = shard_grad
                else:
                    e.shard.grad.add_(shard_grad)
                n += 1
        return n

    def trainable_shards(self) -> list[nn.Parameter]:
        return [e.shard for e in self.entries if e.shard.requires_grad]

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
