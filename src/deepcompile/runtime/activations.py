"""Activations on the host between forward and backward: the run-time side of `activation_budget`.

The pass (passes/activation_budget.py) rewrites a forward graph so that a value it saves for the
backward leaves the device after its last forward use, and the backward graph so that the value
comes back ahead of its first backward use. Three ops carry it, each one Python call per
activation per graph run:

  forward    `activation_offload(x, engine) -> host`: a pinned host buffer, being filled from `x`;
             the forward returns it in `x`'s place (AOTAutograd saves whatever the forward
             returns there and hands it to the backward);
  backward   `activation_reload(after, host, engine, device) -> dst`: a fresh device tensor in the
             host buffer's layout, being filled from it (`after` orders the op: where the plan
             starts the copy);
             `activation_wait(dst, engine)`: the compute stream waits for that copy, then `dst`
             holds the value (declared as mutating `dst`: every reader comes after it).

`engine` is the engine's handle, through which the op finds its runtime (`runtime_of` in
runtime/runtime.py, as offload's ops do); none of them is communication.

[Note: activation copies] The copies run through the optimizer offload's copier (runtime/
offload.py, [Note: offload streams]): on CUDA its two copy streams, ordered by events, on the
CPU its imitation, where a copy runs only when its event is waited for:
  * out: the device-to-host stream waits for the compute stream, copies `x` into the host
    buffer and records an event, kept under the host buffer's address; `x` is marked as used by
    that stream, so the allocator does not hand its block out before the copy read it. Inductor
    hands a buffer to its next kernel without the allocator once its last reader returned, so
    under Inductor the copy reads a copy of `x` of its own (as `grad_to_host` does);
  * in: `dst` is allocated on the compute stream; the host-to-device stream waits for the
    compute stream and for the buffer's copy-out event, copies, and records an event; the wait
    makes the compute stream wait for it. Only then does the host buffer go back to the pool:
    the next copy out into it waits for the compute stream, hence for this copy in.
On the CPU a reload whose wait is missing leaves `dst` uninitialized, and one that does not wait
for the copy out reads the buffer's previous contents (the pool reuses buffers across steps):
the parity tests see both.

Host buffers are pooled by (elements, dtype) and reused across steps: a forward takes one per
offloaded value, its backward's wait gives it back. A forward whose backward never runs keeps
its buffers until autograd drops them. The CPU memory model (compiler/profiler.py) does not
count host buffers (`host_ptrs`): on CUDA the device's allocator never sees them.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from . import ops
from .runtime import runtime_of


class ActivationStore:
    """One engine's pinned host buffers for activations, and the copies in flight."""

    def __init__(self, copier, device: torch.device, own_sources: bool) -> None:
        self.copier = copier
        self.device = device
        self.own_sources = own_sources      # Inductor: the copy out reads a copy of its own
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._flat: dict[int, torch.Tensor] = {}       # data pointer -> every buffer made
        self._saved: dict[int, object] = {}            # host buffer -> event of its copy out
        self._loading: dict[int, tuple[object, torch.Tensor]] = {}   # dst -> (event, host)
        self.host_ptrs: set[int] = set()               # the buffers' addresses (memory model)
        self.stats = {"buffers": 0, "buffer_bytes": 0, "offloads": 0, "d2h_bytes": 0,
                      "h2d_bytes": 0}

    # -- the pool ---------------------------------------------------------------------------
    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((numel, dtype))
        if free:
            return free.pop()
        flat = self.copier.host_buffer(torch.empty(numel, dtype=dtype, device="meta"))
        ptr = flat.data_ptr()
        self._flat[ptr] = flat
        self.host_ptrs.add(ptr)
        self.stats["buffers"] += 1
        self.stats["buffer_bytes"] += numel * flat.element_size()
        return flat

    def _give_back(self, host: torch.Tensor) -> None:
        flat = self._flat[host.data_ptr()]
        self._free.setdefault((flat.numel(), flat.dtype), []).append(flat)

    def held_host_bytes(self) -> int:
        """Pinned bytes the pool holds (in use or free)."""
        return self.stats["buffer_bytes"]

    # -- the ops' work ----------------------------------------------------------------------
    @torch.no_grad()
    def offload(self, x: torch.Tensor) -> torch.Tensor:
        flat = self._take(x.numel(), x.dtype)
        # the host buffer in `x`'s layout (a dense value's strides fit its element count), a
        # tensor of its own over the pooled storage (an op's output is no view); the copy
        # writes through another such tensor, so that the buffer's version, which autograd
        # checks when the backward unpacks it, is the one it had when it was saved (the CPU's
        # copies run later, when waited for)
        layout = (x.size(), x.stride()) if x.storage_offset() == 0 and dense_strides(x) \
            else (x.size(),)
        host, target = (torch.empty(0, dtype=x.dtype).set_(flat.untyped_storage(), 0, *layout)
                        for _ in range(2))
        src = x.clone() if self.own_sources and self.copier.cuda else x
        self._saved[host.data_ptr()] = self.copier.to_host([(target, src)])
        self.stats["offloads"] += 1
        self.stats["d2h_bytes"] += x.numel() * x.element_size()
        return host

    @torch.no_grad()
    def reload(self, host: torch.Tensor) -> torch.Tensor:
        saved = self._saved.pop(host.data_ptr(), None)
        if saved is None:
            raise RuntimeError(
                "deepcompile: a backward graph reloads an activation that its forward did not "
                "offload (the forward and backward graphs run different plans); please report "
                "this with the model")
        dst = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=self.device)
        self._loading[dst.data_ptr()] = (self.copier.to_device([(dst, host)], after=saved), host)
        self.stats["h2d_bytes"] += host.numel() * host.element_size()
        return dst

    def wait(self, dst: torch.Tensor) -> None:
        event, host = self._loading.pop(dst.data_ptr())
        self.copier.wait([event])
        self._give_back(host)


def dense_strides(t: torch.Tensor) -> bool:
    """The elements of `t` cover its extent once each, in some order of its dimensions."""
    expected = 1
    for st, n in sorted((st, n) for n, st in zip(t.size(), t.stride()) if n != 1):
        if st != expected:
            return False
        expected *= n
    return True


def store_of(runtime) -> ActivationStore:
    """The engine runtime's activations on the host, made on first use, through the optimizer
    offload's copier ([Note: activation copies]). (Made here, not by the runtime: runtime.py
    imports none of the modules that define ops.)"""
    if runtime.activations is None:
        runtime.activations = ActivationStore(runtime.offload.copier, runtime.device,
                                              runtime.offload.own_sources)
    return runtime.activations


def _store(engine: int) -> ActivationStore:
    runtime = runtime_of(engine)
    if runtime is None:
        raise RuntimeError("deepcompile: an activation copy belongs to an engine that was released")
    return store_of(runtime)


# -- the ops the pass inserts -----------------------------------------------------------------
@torch.library.custom_op(f"{ops.NAMESPACE}::activation_offload", mutates_args=())
def activation_offload(x: torch.Tensor, engine: int) -> torch.Tensor:
    """Start copying `x` to a pinned host buffer; returns the buffer ([Note: activation
    copies])."""
    with record_function("deepcompile.activation_offload"):
        return _store(engine).offload(x)


@activation_offload.register_fake
def _(x, engine):
    return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="cpu")


@torch.library.custom_op(f"{ops.NAMESPACE}::activation_reload", mutates_args=())
def activation_reload(after: torch.Tensor, host: torch.Tensor, engine: int,
                      device: torch.device) -> torch.Tensor:
    """Start copying `host` back into a new tensor on `device` in its layout; returns it, valid
    once `activation_wait` ran. `after` only orders the op (ops.ORDER_ONLY)."""
    with record_function("deepcompile.activation_reload"):
        return _store(engine).reload(host)


@activation_reload.register_fake
def _(after, host, engine, device):
    return torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=device)


@torch.library.custom_op(f"{ops.NAMESPACE}::activation_wait", mutates_args=("dst",))
def activation_wait(dst: torch.Tensor, engine: int) -> None:
    """The compute stream waits for the copy into `dst` ([Note: activation copies])."""
    with record_function("deepcompile.activation_wait"):
        _store(engine).wait(dst)


@activation_wait.register_fake
def _(dst, engine):
    return None


OFFLOAD = torch.ops.deepcompile.activation_offload.default
RELOAD = torch.ops.deepcompile.activation_reload.default
WAIT = torch.ops.deepcompile.activation_wait.default
torch.fx.node.has_side_effect(OFFLOAD)   # its output may go unused in a graph of another shape
torch.fx.node.has_side_effect(RELOAD)
ops.ORDER_ONLY.add(RELOAD)
