"""What every schedule shares: the setting (model, ranks, cost model, dtypes, budget), the
sizes of a parameter's collectives, the persistent per-rank state and the optimizer step.

Sizes follow the runtime (runtime/registry.py): a parameter's flat shard is `ceil(numel / S)`
elements (S: the N ranks, or a group's G under the "hsdp" layout, [Note: layouts] in
runtime/mesh.py); a gather moves the padded full tensor in the compute dtype; a gradient is reduced in
the reduce dtype (= the compute dtype, deepcompile's default with `param_dtype`); masters,
gradient shards and Adam's two moments are fp32 shards (16 bytes per shard element), what
`offload_optimizer` calls the step's bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ...compiler.cost import CostModel
from .compose import Model, Param
from .simulate import Event

MASTER_BYTES = 4          # fp32 master shard
ADAM_BYTES = 8            # exp_avg + exp_avg_sq (fp32)
GRAD_SHARD_BYTES = 4      # shard.grad (fp32)
# Bytes moved per shard element by torch's AdamW (foreach, the default on CUDA; fp32): lerp_ of
# exp_avg (12), mul_ + addcmul_ of exp_avg_sq (20), weight decay mul_ of the param (8), sqrt,
# div and add_ for the denominator (24), addcdiv_ into the param (16). A fused AdamW would
# move 28 (read p g m v, write p m v).
ADAMW_TRAFFIC = 80


@dataclasses.dataclass
class Setting:
    model: Model
    world: int
    cost: CostModel
    budget: float                  # bytes per rank (planners' memory budget)
    gas: int
    mem_bw: float                  # achievable device memory bandwidth (on-device copies)
    kernel_host_s: float           # host time per compiled kernel
    eager_op_host_s: float         # host time per eager op
    host_is_compute: bool = False  # a CPU rank: host and compute are one thread
    optimizer_s: float | None = None   # measured optimizer step (CPU); else from bandwidth
    stage: int = 3
    framework_s: float = 0.0       # host time per micro-step outside the graphs (guards, ...)
    framework_async_s: float | None = None   # the same with asynchronous collectives, where it
                                             # was measured apart (CPU ranks: ours.schedule)
    plan_cost: CostModel | None = None  # the cost model the passes plan with (default: `cost`)
    replay: dict | None = None     # a run's decisions to replay (ours_passes.py; validation)
    fusion: str = "overlap"        # the runtime's fusion policy: "overlap" (GPU), "cap" (CPU)
    layout: str = "shard"          # the data-parallel layout: "shard", "hsdp", "hsdp_zero", "hpz"
    group: int = 0                 # its group size G (0: every rank)

    @property
    def planner_cost(self) -> CostModel:
        return self.plan_cost if self.plan_cost is not None else self.cost

    @property
    def csize(self) -> int:
        return torch.empty((), dtype=self.model.dtype).element_size()

    @property
    def shards(self) -> int:
        """The ranks a parameter's shards span."""
        return self.group if self.layout == "hsdp" else self.world

    def shard_numel(self, p: Param) -> int:
        return -(-p.numel // self.shards)

    def padded(self, p: Param) -> int:
        return self.shard_numel(p) * self.shards

    def label_of(self, figure: str) -> str:
        """The group ("world", "intra") a collective of `figure` runs in."""
        fn = getattr(self.cost, "label_of", None)
        return fn(figure) if fn is not None else "world"

    def gather_bytes(self, p: Param) -> int:
        return self.padded(p) * self.csize

    def full_bytes(self, p: Param) -> int:
        return p.numel * self.csize

    def shard_elems(self) -> int:
        return sum(self.shard_numel(p) for p in self.model.params)

    def persistent_bytes(self) -> int:
        """Master shards, gradient shards and Adam state (ZeRO-3: all sharded); ZeRO-1/2 also
        hold the full parameters in the compute dtype."""
        per = (MASTER_BYTES + ADAM_BYTES + GRAD_SHARD_BYTES) * self.shard_elems()
        if self.stage < 3:
            per += sum(self.full_bytes(p) for p in self.model.params)
        if self.layout in ("hpz", "hsdp_zero"):   # the secondary shards ([Note: secondary shards])
            per += sum(self.padded(p) // self.group * self.csize for p in self.model.params)
        return per

    def copy_on_device_s(self, nbytes: int) -> float:
        """A device-memory copy of `nbytes` (read + write)."""
        return 2 * nbytes / self.mem_bw

    def cast_s(self, numel: int) -> float:
        """A cast between the fp32 master and the compute dtype of `numel` elements."""
        return numel * (MASTER_BYTES + self.csize) / self.mem_bw

    def optimizer_step_s(self) -> float:
        if self.optimizer_s is not None:
            return self.optimizer_s
        return ADAMW_TRAFFIC * self.shard_elems() / self.mem_bw


def async_s(cost: CostModel, kind: str, nbytes: int) -> float:
    """Lane time of an asynchronous collective (a measured CPU network times them apart)."""
    fn = getattr(cost, "async_s", None)
    return fn(kind, nbytes) if fn is not None else cost.collective_s(kind, nbytes)


def wait_s(cost: CostModel, kind: str) -> float:
    """Host time of an asynchronous collective's wait op (0 where the cost model has none)."""
    fn = getattr(cost, "wait_s", None)
    return fn(kind) if fn is not None else 0.0


def async_launch_s(cost: CostModel, kind: str, nbytes: int) -> float:
    """Host time of launching an asynchronous collective: the launch, plus the part of the
    collective that cannot overlap the host's compute (a CPU rank: `overlap` < 1; a GPU: 1)."""
    overlap = getattr(cost, "overlap", 1.0)
    extra = (1.0 - overlap) * async_s(cost, kind, nbytes) if overlap < 1.0 else 0.0
    return cost.launch_s(kind) + extra


def node_host(setting: Setting, kernels: int, eager: bool) -> float:
    if setting.host_is_compute:
        return 0.0   # a measured CPU node's time already includes its dispatch
    return kernels * (setting.eager_op_host_s if eager else setting.kernel_host_s)


def framework_event(setting: Setting, live: int) -> Event:
    """deepcompile's own host time per micro-step outside its graphs (Dynamo's guards,
    AOTAutograd's wrappers, the engine's calls, the autograd engine)."""
    return Event("compute", "framework", 0.0, setting.framework_s, live=live, label="host")


def optimizer_events(setting: Setting, live: int, label: str = "optimizer",
                     share: float = 1.0) -> list[Event]:
    """The device's optimizer step; `share`: the fraction of the parameters it steps (the rest
    step on the host: offload tier 4)."""
    n = len(setting.model.params)
    host = 0.0 if setting.host_is_compute else n * setting.eager_op_host_s
    return [Event("compute", "optimizer step", setting.optimizer_step_s() * share, host,
                  live=live, label=label)]


@dataclasses.dataclass
class Schedule:
    """One system's optimizer step as events, and what it decided."""
    system: str
    description: str
    events: list[Event]
    collectives: dict[str, dict[str, int]]      # kind -> {"count", "bytes"} per step
    decisions: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    group_bytes: dict[str, int] = dataclasses.field(default_factory=dict)   # per group, per step


class Counter:
    """Collectives launched per optimizer step, and their bytes per group (as the runtime's
    `comm_stats(by_group=True)`)."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}
        self.groups: dict[str, int] = {}

    def add(self, kind: str, nbytes: int, times: int = 1, group: str = "world") -> None:
        c = self.counts.setdefault(kind, {"count": 0, "bytes": 0})
        c["count"] += times
        c["bytes"] += nbytes * times
        self.groups[group] = self.groups.get(group, 0) + nbytes * times
