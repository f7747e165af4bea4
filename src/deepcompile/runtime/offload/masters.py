"""Tier 3: a chunk's master on the host, and its copy in the compute dtype on the device.

[Note: masters on the host] A tier-3 chunk's master (its flat parameter, of which the shards are
views) lives on the host between optimizer steps (`host_master`, pinned). The device keeps a copy
of it in the compute dtype (`lowp`; each registry entry's `lowp` is its slice), made from the
master after each step: the gathers read that copy instead of the shard ([Note: runtime inputs]
in compiler/lower.py: a fixed extra input, so a chunk with a parameter whose graph Dynamo reuses
stays below tier 3, as for tier 2), and so does the eager fallback (`ParamEntry.gather` reads
`lowp` where the shard's storage is released). The device saves the master's bytes less the
copy's: only where the compute dtype is narrower (bf16 or fp16 under fp32 masters), and only at
ZeRO-3 (ZeRO-1/2 keep a full replica anyway). At the step the master streams in with the state
and the gradient, steps, goes back out, and the copy is refreshed from it (`send`); the master's
storage is then released, so its shards' data pointers change at every step: no table may key
a tier-3 shard by its pointer (kept parameters and gradient accumulators stay off tier 3).
Graphs lowered before the copies appeared (or vanished) read the wrong tensor: every change of
the set of copies bumps `EngineRuntime.epoch`, and the pipeline drops its lowered and compiled
code of an older epoch. Whatever reads or writes master values outside the graphs and the step
(a checkpoint, `full_state_dict`, a load) runs inside `Offloader.masters_home()`, which brings
them back and, after it, refreshes the copies and sends them out again.
"""

from __future__ import annotations

import torch

from .slot import ChunkBuffers


@torch.no_grad()
def send(slot: ChunkBuffers, copier, device: torch.device, counts: dict[str, int]) -> bool:
    """The chunk's master to the host; its device copy in the compute dtype made from it; its
    device storage released. Returns whether the copy was made now (the set of copies
    changed)."""
    if slot.master_off:
        return False
    c = slot.chunk
    master = c.param.detach()
    made = slot.lowp is None
    if made:
        slot.lowp = torch.empty(c.numel, dtype=c.entries[0].compute_dtype, device=device)
        for e, off in zip(c.entries, c.offsets):
            e.lowp = slot.lowp[off:off + e.shard.numel()]
    if slot.host_master is None:
        slot.host_master = copier.host_buffer(master)
    slot.lowp.copy_(master)
    slot.master_saved = copier.to_host([(slot.host_master, master)])
    master.untyped_storage().resize_(0)
    slot.master_off = True
    counts["master_d2h_bytes"] += c.nbytes
    return made


def bring(slot: ChunkBuffers, copier, counts: dict[str, int]) -> object:
    """Start copying the chunk's master back into fresh device storage; the event."""
    if not slot.master_off:
        return None
    c = slot.chunk
    master = c.param.detach()
    master.untyped_storage().resize_(c.nbytes)
    event = copier.to_device([(master, slot.host_master)], after=slot.master_saved)
    slot.master_off = False
    counts["master_h2d_bytes"] += c.nbytes
    return event


def drop_copies(slots: list[ChunkBuffers]) -> bool:
    """No device copies any more (every master is on the device); returns whether there were."""
    dropped = False
    for s in slots:
        if s.lowp is not None:
            s.lowp = None
            for e in s.chunk.entries:
                e.lowp = None
            dropped = True
    return dropped
