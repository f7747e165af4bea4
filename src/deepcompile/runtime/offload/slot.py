"""The tiers of a chunk, its buffers between the device and the host, and the device's count.

A chunk's *tier* says what of it lives on the host between optimizer steps:

  0  everything on the device;
  1  its optimizer state (Adam's moments), brought back by the backward of the window's last
     micro-step (`reload_state` ops, where the plan puts them) or streamed in during the step;
  2  its state and its gradients ([Note: gradients on the host]);
  3  its state, its gradients and its master shards ([Note: masters on the host]);
  4  as 3, and the chunk steps on the host ([Note: the host step]).
"""

from __future__ import annotations

import dataclasses

import torch

from ..flat import Chunk

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
class ChunkBuffers:
    """One chunk's optimizer state, its buffers on the host, and the events of their copies."""
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
    # device (views), off it (meta)) ([Note: optimizer state access])
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

    def host_bytes(self) -> int:
        """Bytes of the chunk's host buffers (state, gradient, master, the copy's staging)."""
        return sum(t.numel() * t.element_size()
                   for t in [*self.host.values(), self.host_grad, self.host_master,
                             self.host_lowp] if t is not None)

    def show(self, state: dict, tensors: dict[str, torch.Tensor]) -> None:
        """The facade's state (`state`) of the chunk's shards: views of the flat state where it
        is on the device, meta tensors where it is not (`tensors`: the flat state's tensors).

        [Note: optimizer state access] The facade's per-parameter state (views, runtime/flat.py)
        of an offloaded chunk would have no storage between steps, and reading a view of a
        released storage crashes the process (a segfault on the CPU, an illegal memory access
        on CUDA). So while a chunk is off the device its shards' entries in
        `engine.optimizer.state` are *meta* tensors of the same shapes (the dicts are made once
        per chunk and swapped, one store per shard): printing one says `device='meta'`, and
        reading its values raises. `engine.optimizer.state_dict()` gets the values through a
        post-hook that puts views of the host buffers in the returned dict (`host_state`, after
        the copies out are done); `load_state_dict` installs resident state, then the planned
        chunks are offloaded again."""
        c = self.chunk
        if self.faces is None:
            shards = [sh for sh in c.shards if state.get(sh)]   # a shard never stepped: none
            if not shards:
                return
            views = [state[sh] for sh in shards]
            meta = [{k: torch.empty_like(v, device="meta") if k in tensors else v
                     for k, v in d.items()} for d in views]
            self.faces = (shards, views, meta)
        shards, views, meta = self.faces
        for sh, d in zip(shards, meta if self.offloaded else views):
            state[sh] = d

    def host_state(self, index: dict[int, int], packed: dict) -> None:
        """Views of the host buffers as the state of the chunk's shards in `packed` (a state
        dict's "state": parameter index -> state; `index`: id of a parameter -> its index)."""
        c = self.chunk
        for shard, off in zip(c.shards, c.offsets):
            i = index[id(shard)]
            if i not in packed:   # never stepped: no state
                continue
            n = shard.numel()
            # the packed per-parameter dict IS `optimizer.state[p]`: copy it, never edit it
            packed[i] = {**packed[i], **{k: h[off:off + n] for k, h in self.host.items()}}

