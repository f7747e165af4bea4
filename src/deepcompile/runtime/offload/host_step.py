"""Tier 4: a chunk stepped on the host, and what the plan needs to know of the host.

[Note: the host step] A tier-4 chunk has everything the optimizer reads and writes on the host
(its master, its Adam moments, its window's gradient: tier 3), so it steps there, as DeepSpeed's
ZeRO-Offload does with its CPU Adam: per step its gradient goes down (during the backward, as
at tier 2) and its copy in the compute dtype goes up (2 bytes per parameter under bf16), where
streaming it through the device moves master, state and gradient in and master and state out.
Which is faster depends on the host's cores against PCIe: the host step's rate is measured at
start-up (`host_step_seconds`, compiler/host.py) and the plan compares (passes/
offload_optimizer.py). A step (`step_on_host`):
  * waits on the host for the chunk's copies out (gradient, state, master);
  * makes the gradient what the device's fold would have made (gaps and unwritten shards zero,
    times the engine's factor `grad_scale`, brought to the host once per step);
  * steps it with a host instance of the inner optimizer's class (`ChunkBuffers.host_opt`: its
    parameter the pinned master, its state the chunk's host buffers; torch's fused CPU kernel
    where the inner optimizer is fused), with the inner group's hyperparameters of now. The
    inner's scalars (Adam's `step`) are read when the instance is made and written back after
    each host step, so the facade, a checkpoint and a later device step see one count; a load,
    or a step of the chunk on the device, drops the instance;
  * casts the master into a pinned buffer in the compute dtype (`host_lowp`) and copies that up
    into the device copy (`lowp`) after the compute stream's queued work (the last backward read
    the old copy); the compute stream waits for every such copy before the optimizer step
    returns. Before the host writes `host_lowp` again it waits for the last copy up from it.
A tier-4 chunk whose state or master is still on the device (the step right after a plan was
set) is streamed as tier 3 this once. On the CPU both ways run the same kernels on the same
memory: bitwise the same; on CUDA equal within rounding.
"""

from __future__ import annotations

import inspect
import time

import torch

from ..._proc import kib_field
from ..flat import Chunk, FlatState
from .slot import ChunkBuffers

_HOST_IMPL = ("foreach", "fused", "capturable", "differentiable")   # the host instance's own


@torch.no_grad()
def step_on_host(slot: ChunkBuffers, flat: FlatState, copier, group: dict,
                 scale: torch.Tensor | None, counts: dict[str, int]) -> object:
    """Step a tier-4 chunk on the host and start copying its new copy in the compute dtype
    up to the device; the copy's event ([Note: the host step])."""
    c = slot.chunk
    copier.host_wait([slot.saved, slot.master_saved, slot.grad_saved])
    if slot.host_grad is None:
        slot.host_grad = copier.host_buffer(c.grad)
    g = slot.host_grad
    if len(slot.written) < len(c.shards):   # as the device's fold: per shard only if some are
        for i, (off, sh) in enumerate(zip(c.offsets, c.shards)):
            if i not in slot.written:
                g[off:off + sh.numel()].zero_()
    for start, end in _gaps(c):
        g[start:end].zero_()
    if scale is not None:
        g.mul_(scale)
    opt = slot.host_opt or _host_instance(slot, flat.inner)
    opt.param_groups[0].update({k: v for k, v in group.items()
                                if k != "params" and k not in _HOST_IMPL})
    live = {id(u) for u in flat.live_units(c)}
    for u, param in slot.host_units:
        if id(u) in live:
            param.grad = g[u.start:u.stop]
    opt.step()
    for u, param in slot.host_units:
        param.grad = None
        inner = flat.inner.state[u.param]
        for k, v in opt.state[param].items():   # the scalars back (Adam's step)
            if k not in slot.host:
                if isinstance(v, torch.Tensor):
                    inner[k].copy_(v)
                else:
                    inner[k] = v
    if slot.host_lowp is None:
        slot.host_lowp = copier.host_buffer(slot.lowp)
    copier.host_wait([slot.lowp_loaded])
    slot.host_lowp.copy_(slot.host_master)
    slot.lowp_loaded = copier.to_device([(slot.lowp, slot.host_lowp)])
    counts["lowp_h2d_bytes"] += slot.lowp.numel() * slot.lowp.element_size()
    return slot.lowp_loaded


def _host_instance(slot: ChunkBuffers, inner_opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The host instance of the inner optimizer for a tier-4 chunk: its parameters the
    pinned master's slices of the chunk's units that have state (one: the whole master),
    their state the chunk's host buffers' slices and host copies of the inner's scalars."""
    inner = inner_opt.state
    slot.host_units = [(u, torch.nn.Parameter(slot.host_master[u.start:u.stop],
                                              requires_grad=True))   # share the buffer
                       for u in slot.chunk.units if inner.get(u.param)]
    opt = host_optimizer(inner_opt, [p for _u, p in slot.host_units])
    for u, param in slot.host_units:
        opt.state[param] = {k: slot.host[k][u.start:u.stop] if k in slot.host
                            else v.to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                            for k, v in inner[u.param].items()}
    slot.host_opt = opt
    return opt


def host_ready(slot: ChunkBuffers, flat: FlatState) -> bool:
    """Every unit of the chunk that steps has state: a unit's first step creates it on the
    device ([Note: steps without a gradient] in runtime/flat.py)."""
    inner = flat.inner.state
    return all(inner.get(u.param) for u in flat.live_units(slot.chunk))


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


def host_step_seconds(flat: FlatState, numel: int, repeats: int = 3) -> float:
    """Seconds the host takes to step `numel` elements of this engine's optimizer (its
    class, its first group's hyperparameters, its implementation as the host step would
    use it), measured here on scratch tensors: the fastest of `repeats` steps of at most
    16 M elements, scaled linearly. `inf` where there is no flat step."""
    inner = flat.inner
    if inner is None or numel <= 0:
        return float("inf")
    n = min(numel, 1 << 24)
    dtype = flat.chunks[0].dtype
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


def mem_available() -> float:
    """The host's available memory in bytes (Linux's MemAvailable), inf where unknown."""
    avail = kib_field("/proc/meminfo", "MemAvailable")
    return float("inf") if avail is None else float(avail)


def _gaps(c: Chunk) -> list[tuple[int, int]]:
    """The chunk's alignment gaps as (start, end) element offsets: where `Chunk.gaps` (views of
    the flat gradient) lie, for a host buffer."""
    return [(v.storage_offset(), v.storage_offset() + v.numel()) for v in c.gaps]
