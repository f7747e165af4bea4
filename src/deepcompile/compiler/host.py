"""What the passes read of the host, measured once at start-up and agreed over the ranks.

A pass's plan depends only on its context (passes/__init__.py), so what it needs of the host
arrives there agreed (`PassContext.host_step_rate`, `host_capacity`): the optimizer's step rate
on the host (`Pass.needs` "host_step": the slowest rank's) and the host memory this engine's
plans may keep ("host_memory": the smallest rank's), in one collective, measured only where a
pass that may run needs them.
"""

from __future__ import annotations

import dataclasses

import torch

from ..passes import get_pass, known_passes, needs_of
from .agree import agree_max


@dataclasses.dataclass(frozen=True)
class HostFigures:
    step_rate: float | None = None      # seconds per element; None: not measured
    capacity: float = float("inf")      # bytes; inf: unknown, or not measured


def host_needs(config) -> set[str]:
    """The needs of the passes that may run: those named, or under `passes="auto"` every pass
    auto may choose."""
    names = config.pass_list if not config.auto_passes else [
        n for n in known_passes() if get_pass(n).choose is not None]
    return set(needs_of(names))


def measure_host(runtime, needs: set[str], device: torch.device) -> HostFigures:
    """The host's figures `needs` asks for, measured on this rank by the offloader
    (runtime/offload/) and agreed in one collective (the slowest rate, the smallest capacity:
    every rank plans the same). The step rate only where a chunk's master may go to the host
    (the chunks' dtypes and stages: the same on every rank), as only such chunks step there."""
    store = runtime.offload
    if store is None:
        return HostFigures()
    rate_too = "host_step" in needs and any(map(store.master_saving, store.slots))
    if not rate_too and "host_memory" not in needs:
        return HostFigures()
    rate = store.host_step_rate() if rate_too else 0.0
    rate, neg_capacity = agree_max(runtime.comm, [rate, -store.host_capacity()], device)
    return HostFigures(rate if rate_too else None, -neg_capacity)
