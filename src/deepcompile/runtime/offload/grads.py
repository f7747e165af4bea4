"""Tier 2: a chunk's shard gradients on the host.

[Note: gradients on the host] A tier-2 chunk's shard gradients never reach `shard.grad`: the
pass puts a `grad_to_host(grad, pid)` op right after the node that makes each of them, and the
lowering (compiler/lower.py) returns None in that gradient's place, so the value is freed once
its copy has read it. The first gradient of the window is copied into its slice of the chunk's
`host_grad`; a later one (the next micro-step, a second use of the parameter) is added to it on
the device (the slice copied back, `old + new` as autograd accumulates, copied out again):
bitwise autograd's sum. Each write records the squared norm of the slice's new value (`sumsq`,
per shard, overwritten: the last write is the window's gradient), from which the step gets the
gradient norm and the inf/NaN check without reading host buffers (`host_grad_sumsq`). At the
step the chunk's gradient streams into its flat gradient with its state (`bring`), the gaps and
unwritten shards are zeroed and the engine's factor applied (`ready`). A stray device gradient
of a tier-2 shard (the eager fallback, a local accumulator flushed at the step) is sent to the
host before the check (`Offloader.begin_step`). A graph planned for a tier no longer in force (a
re-plan within an accumulation window) still calls the op: the gradient then goes to
`shard.grad` as autograd would have put it, and a chunk leaving tier 2 gets its host gradients
back there (`back`). A re-plan profiles the graphs as compiled, without the ops ([Note: a
re-plan starts over] in compiler/pass_manager.py): an op accumulates its gradient as soon as it is
made, where autograd keeps it to the graph's end, and the re-plan would plan from a step
lighter than its own.
"""

from __future__ import annotations

import torch

from .slot import ChunkBuffers


def make_buffers(slot: ChunkBuffers, copier, device: torch.device) -> None:
    """The chunk's host gradient buffer and its per-shard squared norms (on the device)."""
    c = slot.chunk
    slot.host_grad = copier.host_buffer(c.grad)
    slot.sumsq = torch.zeros(len(c.shards), dtype=torch.float32, device=device)


@torch.no_grad()
def send(slot: ChunkBuffers, i: int, g: torch.Tensor, copier, own_sources: bool,
         counts: dict[str, int]) -> None:
    """Shard `i`'s gradient `g` (flat) into its slice of the chunk's host gradient, added to
    what the window wrote there before; `own_sources`: the copy reads a copy of `g` of its own
    (Inductor may hand `g`'s buffer to its next kernel before the copy ran)."""
    off = slot.chunk.offsets[i]
    host = slot.host_grad[off:off + g.numel()]
    if i in slot.written:   # autograd's accumulation, old + new, on the device
        old = torch.empty_like(g)
        copier.wait([copier.to_device([(old, host)], after=slot.grad_saved)])
        g = old.add_(g)
        counts["grad_h2d_bytes"] += g.numel() * g.element_size()
    elif own_sources:
        g = g.clone()
    slot.sumsq[i] = torch.linalg.vector_norm(g, dtype=torch.float32).square()
    slot.grad_saved = copier.to_host([(host, g)], late=True)
    slot.written.add(i)
    counts["grad_d2h_bytes"] += g.numel() * g.element_size()


def back(slot: ChunkBuffers, copier, device: torch.device) -> None:
    """The window's host gradients of `slot` into its shards' `.grad` (the chunk leaves
    tier 2 in the middle of an accumulation window)."""
    if not slot.written:
        return
    c = slot.chunk
    for i in sorted(slot.written):
        off, n = c.offsets[i], c.shards[i].numel()
        g = torch.empty(n, dtype=c.dtype, device=device)
        copier.wait([copier.to_device([(g, slot.host_grad[off:off + n])],
                                      after=slot.grad_saved)])
        accumulate(c.shards[i], g)
    slot.written.clear()
    slot.sumsq.zero_()


def bring(slot: ChunkBuffers, copier, counts: dict[str, int]) -> object:
    """Start copying a tier-2 chunk's host gradient into its flat gradient; the event."""
    c = slot.chunk
    c.grad.untyped_storage().resize_(c.nbytes)
    if slot.host_grad is None or not slot.written:
        return None
    counts["grad_h2d_bytes"] += c.nbytes
    return copier.to_device([(c.grad, slot.host_grad)], after=slot.grad_saved)


@torch.no_grad()
def ready(slot: ChunkBuffers, scale: torch.Tensor | None) -> None:
    """After its copy: the flat gradient of a tier-2 chunk as the fold would have made it
    (gaps and shards no graph wrote are zero), times the engine's factor `scale`."""
    c = slot.chunk
    if c.gaps:
        torch._foreach_zero_(c.gaps)
    if len(slot.written) < len(c.shards):
        for i, v in enumerate(c.grad_views):
            if i not in slot.written:
                v.zero_()
    if scale is not None:
        c.grad.mul_(scale)


def accumulate(shard: torch.Tensor, grad: torch.Tensor) -> None:
    """`shard.grad` as autograd's accumulation leaves it: the gradient, or old + new."""
    if shard.grad is None:
        shard.grad = grad.detach().clone().view_as(shard)
    else:
        shard.grad.add_(grad.view_as(shard.grad))
