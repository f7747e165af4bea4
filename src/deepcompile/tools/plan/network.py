"""Collective times at N x G ranks: a latency-bandwidth model of NCCL's ring and tree.

[Note: the network model] `Fabric` is deepcompile's `CostModel` (compiler/cost.py) for a
cluster we don't have: `collective_s(kind, nbytes)` for a collective over the full tensor of
`nbytes` (what the passes plan with), `copy_s(nbytes)` for a host<->device copy, and
`launch_s(kind)` for the host time to launch one collective (the runtime's per-launch cost;
`passes/_common.fuses` counts it once it lands there), and `wait_s(kind)` for the host time of
an asynchronous collective's wait op.

All-gather and reduce-scatter run NCCL's ring over all N = nodes x G ranks (NCCL has no tree
for them). One ring step moves 1/N of the tensor over every link at once, so

    t = base + latency + (N - 1) / N * S / busbw

where `latency` is the pipeline depth of the ring (the hop latencies summed around it: N -
nodes NVLink hops and `nodes` network hops) and `busbw` is the slowest link's share: inside
one node, a GPU's NVLink bandwidth; across nodes, NCCL runs G rings, one per NIC
(rail-aligned), each crossing the network once per node boundary, so `busbw = min(NVLink,
G x NIC)` — which is why 8 x 400 Gb/s H100 nodes reach about NVLink speed for large messages.
All-reduce is reduce-scatter + all-gather on the ring (`2 (N-1)/N S / busbw`, twice the
latency), or NCCL's tree (a chain inside each node, a binary tree across nodes: latency
`2 (log2(nodes) x net hop + (G - 1) x NVLink hop)`, bandwidth `2 S / (busbw x 0.9)`: a tree
reaches less of the links than a ring, as in NCCL's tuning model); `algorithm` "auto" takes the
faster, as NCCL's tuner does: the tree for small messages, the ring for large ones. World size
1 has no wire: 0.

Achievable link bandwidth is the datasheet figure times an efficiency (NCCL reaches ~80% of
NVLink4 in all-gather, ~90% of InfiniBand). Every figure is printed with a plan and can be
overridden (`--assume net.nic_bw=25e9`).

On the CPU (gloo ranks of one machine) there is no datasheet: `Measured` reads a collective's
time off a sweep of sizes measured at N ranks, which a host profile carries (host.py; the
harness that measures it is benchmarks/validation/host_profile.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass
class Fabric:
    nodes: int
    gpus_per_node: int
    nvlink_bw: float               # bytes/s per GPU per direction (datasheet)
    nic_bw: float                  # bytes/s per GPU NIC (datasheet)
    pcie_bw: float                 # bytes/s host<->device (datasheet)
    nvlink_eff: float = 0.80
    nic_eff: float = 0.90
    pcie_eff: float = 0.80
    nvlink_hop_s: float = 0.7e-6   # one ring hop inside a node (NCCL LL128)
    net_hop_s: float = 5.0e-6      # one ring hop across nodes (InfiniBand / RoCE, proxy thread)
    base_s: float = 8e-6           # per collective on the device: kernel start, channel sync
    copy_lat_s: float = 10e-6      # per host<->device copy
    launch_host_s: float = 20e-6   # host seconds to launch one collective (see plan.py)
    tree_bw_factor: float = 0.9    # a tree's bus bandwidth relative to a ring's
    algorithm: str = "auto"        # all-reduce: "ring", "tree" or "auto"
    # the host's optimizer step per parameter (offload tier 4, [Note: the host step] in
    # runtime/offload/host_step.py): plan.py measures this machine's (torch's fused CPU AdamW, fp32);
    # 0: no host step
    host_step_ns: float = 0.0

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def busbw(self) -> float:
        intra = self.nvlink_bw * self.nvlink_eff
        if self.nodes == 1:
            return intra
        return min(intra, self.gpus_per_node * self.nic_bw * self.nic_eff)

    def ring_latency(self) -> float:
        n = self.world
        if self.nodes == 1:
            return (n - 1) * self.nvlink_hop_s
        return (n - self.nodes) * self.nvlink_hop_s + self.nodes * self.net_hop_s

    def tree_latency(self) -> float:
        depth = math.ceil(math.log2(self.nodes)) if self.nodes > 1 else 0
        return 2 * (depth * self.net_hop_s + (self.gpus_per_node - 1) * self.nvlink_hop_s)

    # -- CostModel ------------------------------------------------------------------------
    def collective_s(self, kind: str, nbytes: int) -> float:
        n = self.world
        if n <= 1:
            return 0.0
        bw = self.busbw()
        frac = (n - 1) / n
        if kind in ("all_gather", "all_gather_bw", "reduce_scatter"):   # (one group: the
            return self.base_s + self.ring_latency() + frac * nbytes / bw   # same ring)
        if kind == "all_reduce":
            ring = self.base_s + 2 * self.ring_latency() + 2 * frac * nbytes / bw
            tree = self.base_s + self.tree_latency() + 2 * nbytes / (bw * self.tree_bw_factor)
            return {"ring": ring, "tree": tree}.get(self.algorithm, min(ring, tree))
        raise ValueError(f"deepcompile plan: unknown collective kind {kind!r}")

    def copy_s(self, nbytes: int) -> float:
        return self.copy_lat_s + nbytes / (self.pcie_bw * self.pcie_eff)

    def launch_s(self, kind: str) -> float:
        return self.launch_host_s

    def wait_s(self, kind: str) -> float:
        """Host time of an asynchronous collective's wait: in today's runtime a Python op too
        (a synchronous collective is one op: its launch)."""
        return self.launch_host_s

    def describe(self) -> str:
        return (f"{self.nodes} x {self.gpus_per_node} ranks; NVLink "
                f"{self.nvlink_bw / 1e9:.0f} GB/s "
                f"x {self.nvlink_eff:.2f}, NIC {self.nic_bw / 1e9:.1f} GB/s x {self.nic_eff:.2f} "
                f"per GPU -> ring busbw {self.busbw() / 1e9:.0f} GB/s; hops "
                f"{self.nvlink_hop_s * 1e6:.1f} "
                f"/ {self.net_hop_s * 1e6:.1f} us, base {self.base_s * 1e6:.1f} us -> ring latency "
                f"{(self.base_s + self.ring_latency()) * 1e6:.1f} us; all-reduce {self.algorithm}; "
                f"host {self.launch_host_s * 1e6:.0f} us per launch; PCIe {self.pcie_bw / 1e9:.0f} "
                f"GB/s x {self.pcie_eff:.2f}; host optimizer step {self.host_step_ns:.2f} ns per "
                "parameter")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "world": self.world, "busbw": self.busbw()}


@dataclasses.dataclass
class Measured:
    """A measured network (gloo ranks on one machine): per kind, a synchronous op's time over
    the sweep's sizes, and the host time of launching an asynchronous one. A collective is then
    `launch_s` on the host and `collective_s` (the rest) on its lane: a synchronous one costs
    its measured time in all.

    [Note: a sweep is read, not fitted] A collective's time is read off the sweep's points
    (`samples`: made non-decreasing in size by `monotone`, then interpolated linearly;
    beyond the largest size, the last segment's slope), and `coeffs` (latency + bytes x
    seconds/byte, least squares, fitted by the harness) only summarize them (`describe`) or
    stand in where there are no points. A fitted line is not the time: its least squares are
    dominated by the largest sizes (4 MiB takes 10x what 1 KiB does), and it misses the small
    collectives a tiny model's step is made of."""
    world: int
    coeffs: dict[str, tuple[float, float]]   # kind -> (latency s, s per byte)
    launch: dict[str, float] = dataclasses.field(default_factory=dict)  # kind -> host s (async)
    copy: tuple[float, float] = (0.0, 0.0)
    samples: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    overlap: float = 1.0   # share of an asynchronous collective compute can hide (measured)
    wait: dict[str, float] = dataclasses.field(default_factory=dict)  # kind -> host s of a wait

    def _measured_s(self, kind: str, nbytes: int) -> float:
        if self.samples.get(kind):
            return interpolate(monotone(self.samples[kind]), nbytes)
        a, b = self.coeffs[kind]
        return a + b * nbytes

    def collective_s(self, kind: str, nbytes: int) -> float:
        measured = self._measured_s(kind if kind in self.coeffs else "all_gather", nbytes)
        return max(measured - self.launch_s(kind), 0.0)

    def async_s(self, kind: str, nbytes: int) -> float:
        """Lane time of an asynchronous collective (measured amid compute, less its launch)."""
        if f"{kind}_async" not in self.coeffs:
            return self.collective_s(kind, nbytes)
        return max(self._measured_s(f"{kind}_async", nbytes) - self.launch_s(kind), 0.0)

    def copy_s(self, nbytes: int) -> float:
        a, b = self.copy
        return a + b * nbytes

    def launch_s(self, kind: str) -> float:
        return self.launch.get(kind, 0.0)

    def wait_s(self, kind: str) -> float:
        return self.wait.get(kind, 0.0)

    def describe(self) -> str:
        parts = [f"{k}: {a * 1e6:.0f} us + {1 / b / 1e9 if b else float('inf'):.2f} GB/s "
                 f"(launch {self.launch_s(k) * 1e6:.0f} us, wait {self.wait_s(k) * 1e6:.0f} us)"
                 for k, (a, b) in sorted(self.coeffs.items())]
        return (f"runtime ops on gloo at {self.world} ranks (measured): " + "; ".join(parts)
                + f"; overlap {self.overlap:.2f}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measured":
        """`to_dict`'s output, read back from JSON (lists where it wrote tuples)."""
        return cls(int(d["world"]),
                   {k: (float(a), float(b)) for k, (a, b) in d["coeffs"].items()},
                   launch=dict(d.get("launch", {})), copy=tuple(d.get("copy", (0.0, 0.0))),
                   samples={k: [(int(x), float(y)) for x, y in v]
                            for k, v in d.get("samples", {}).items()},
                   overlap=float(d.get("overlap", 1.0)), wait=dict(d.get("wait", {})))


def monotone(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The least-squares non-decreasing fit of (bytes, s) points (pool adjacent violators): a
    larger collective does not take less time; where the sweep's noise says so, the points
    involved are replaced by their mean."""
    pts = sorted((int(x), float(y)) for x, y in points)
    blocks: list[list[float]] = []   # [sum of y, count]
    for _, y in pts:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            y2, n2 = blocks.pop()
            blocks[-1][0] += y2
            blocks[-1][1] += n2
    ys = [total / n for total, n in blocks for _ in range(int(n))]
    return [(x, y) for (x, _), y in zip(pts, ys)]


def interpolate(points: list[tuple[int, float]], nbytes: float) -> float:
    """Linear interpolation over (bytes, s) points sorted by bytes: below the smallest size its
    time, beyond the largest the last segment's slope."""
    if len(points) == 1 or nbytes <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if nbytes <= x1:
            return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y1 + (y1 - y0) / (x1 - x0) * (nbytes - x1)



class LayoutFabric:
    """[Note: layouts in the plan] The cost model of a data-parallel layout (runtime/mesh.py)
    on `world`'s cluster, in groups of `group` ranks (a node): each collective costs what its
    group's fabric says — within a group a node's NVLink ring (`Fabric(1, G)`), across the
    groups a ring of one rank per node (`Fabric(N, 1)`: one NIC per rank), over every rank
    `world`. The figures the passes plan with are composed as the runtime's cost model composes
    its calibrated ones ([Note: a figure per group] in compiler/cost.py): "all_gather" (a
    forward gather), "all_gather_bw" (a backward re-gather), "reduce_scatter" (a gradient's
    reduction: under hsdp the reduce-scatter in the group and then the all-reduce across the
    groups of its 1/G slice; under hsdp_zero a reduce-scatter of that slice across the groups,
    and every gather runs in the group). Everything else is `world`'s."""

    def __init__(self, world: Fabric, layout: str, group: int) -> None:
        self.world, self.layout, self.group = world, layout, group
        self.fabrics = {"world": world,
                        "intra": dataclasses.replace(world, nodes=1, gpus_per_node=group),
                        "inter": dataclasses.replace(world, nodes=world.world // group,
                                                     gpus_per_node=1)}

    @property
    def across(self) -> str:
        """A gradient's collective across the groups, after the one in the group."""
        return "reduce_scatter" if self.layout == "hsdp_zero" else "all_reduce"

    def __getattr__(self, name: str):
        return getattr(self.world, name)

    def label_of(self, figure: str) -> str:
        """The group a collective of `figure` runs in ("world", "intra")."""
        if self.layout in ("hsdp", "hsdp_zero") or (self.layout == "hpz"
                                                   and figure == "all_gather_bw"):
            return "intra"
        return "world"

    def group_s(self, label: str, kind: str, nbytes: int) -> float:
        return self.fabrics[label].collective_s(kind, nbytes)

    def collective_s(self, kind: str, nbytes: int) -> float:
        if kind in ("all_gather", "all_gather_bw"):
            return self.group_s(self.label_of(kind), "all_gather", nbytes)
        if kind == "reduce_scatter":
            t = self.group_s(self.label_of(kind), kind, nbytes)
            if self.layout in ("hsdp", "hsdp_zero"):
                t += self.group_s("inter", self.across, nbytes // self.group)
            return t
        return self.world.collective_s(kind, nbytes)

    def describe(self) -> str:
        return (self.world.describe() + f"; layout {self.layout} in groups of {self.group} "
                f"(a node: NVLink ring; across: one NIC per rank, busbw "
                f"{self.fabrics['inter'].busbw() / 1e9:.0f} GB/s)")

    def to_dict(self) -> dict[str, Any]:
        return {**self.world.to_dict(), "layout": self.layout, "group": self.group}
