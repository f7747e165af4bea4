"""Figures that do not depend on the machine's load: collectives and memory.

[Note: counting every system's collectives the same way]
Each system calls torch.distributed differently (ours and FSDP2 from Python, DDP's reducer from
C++, DeepSpeed through its own comm layer), so the bench counts below all of them: one counted
optimizer step, after the timed ones, runs under `torch.profiler` (nothing patched; its raw events come through `_compat`),
which records

* one `c10d::<op>` event per collective a system *asks for* (the ProcessGroup dispatcher ops;
  DDP's C++ reducer goes through them too), counted here by kind ("requested"), and
* one `gloo:<op>` (or `nccl:<op>`) event per collective the *transport runs*, with its tensor's
  element count and dtype, from which the bytes come ("transport"). Bytes are those of the full
  tensor of each collective (an all-gather's output, an all-reduce's buffer), the convention of
  `engine.comm_stats()`. On gloo a reduce-scatter runs as an all-reduce of the full tensor, so
  the two levels differ there, and the transport level is what the machine pays.

The same profiled step records every allocation and free (of the GPU in GPU mode), from which
`step_alloc_peak_bytes`
is the highest tensor memory allocated above what was live when the step began (activations,
gathered parameters, gradient and communication buffers): the part of the peak that the system's
schedule decides. What stays allocated between steps is in the RSS figures: `rss()` reads the
process's resident set and its high-water mark (VmHWM) from /proc, and `reset_rss_peak()` sets
the mark back to the current RSS (Linux >= 4.0), so a peak over the steady steps excludes
compilation. RSS includes the Python interpreter, torch and (for compiled systems) the
compiler's memory: compare systems with each other, not with a model's size.
"""

from __future__ import annotations

import contextlib
import re

import torch

from ... import _compat
from ..._proc import kib_field

_REQUESTED = {
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather", "allgather": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "allgather_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "alltoall_base": "all_to_all", "alltoall": "all_to_all",
    "barrier": "barrier", "send": "send", "recv": "recv", "reduce": "reduce",
    "gather": "gather", "scatter": "scatter",
}
_TRANSPORT = re.compile(r"^(gloo|nccl):(\w+)$")
_ESIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8,
          "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
          "Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Byte": 1,
          "Char": 1, "Bool": 1}


def _element_size(dtype: str | None) -> int:
    if not dtype:
        return 4
    return _ESIZE.get(dtype, 4)


def _numel(shape) -> int:
    n = 1
    for s in shape or ():
        n *= int(s)
    return n


class StepProbe:
    """Profile one optimizer step: `with probe: step()`, then `probe.summary()`."""

    def __init__(self, world: int, cuda: bool = False) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.world = world
        device_types = torch.autograd.DeviceType
        self._memory_device = device_types.CUDA if cuda else device_types.CPU
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._prof = profile(activities=activities, record_shapes=True, profile_memory=True)

    def __enter__(self) -> "StepProbe":
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)

    def summary(self) -> dict:
        requested: dict[str, int] = {}
        transport: dict[str, dict[str, int]] = {}
        allocs: list[tuple[int, int]] = []
        for e in _compat.profiler_events(self._prof):
            name = e.name()
            if name == "[memory]":
                if e.device_type() == self._memory_device:
                    allocs.append((e.start_ns(), int(e.nbytes())))
            elif name.startswith("c10d::"):
                op = name[6:].rstrip("_")
                kind = _REQUESTED.get(op, op)
                requested[kind] = requested.get(kind, 0) + 1
            elif m := _TRANSPORT.match(name):
                kind = m.group(2)
                shapes, dtypes = e.shapes() or [[]], e.dtypes() or [None]
                nbytes = _numel(shapes[0]) * _element_size(dtypes[0])
                if kind == "all_gather":  # the event's tensor is this rank's input shard
                    nbytes *= self.world
                entry = transport.setdefault(kind, {"count": 0, "bytes": 0})
                entry["count"] += 1
                entry["bytes"] += nbytes
        live = peak = 0
        for _, delta in sorted(allocs):
            live += delta
            peak = max(peak, live)
        return {"requested": dict(sorted(requested.items())),
                "transport": dict(sorted(transport.items())),
                "step_alloc_peak_bytes": peak}


def rss() -> dict[str, int | None]:
    """{"rss": current resident bytes, "hwm": resident high-water mark} (None off Linux)."""
    return {"rss": kib_field("/proc/self/status", "VmRSS"),
            "hwm": kib_field("/proc/self/status", "VmHWM")}


def reset_rss_peak() -> bool:
    """Set VmHWM back to the current RSS; False where the kernel does not allow it."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    return False
