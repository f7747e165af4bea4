"""Cost model: predicted seconds for collectives (and host<->device copies where a GPU exists).

`LinearCostModel` is `latency + bytes / bandwidth` per kind, plus the host time it takes to
launch one collective (`launch_s`: the functional collective's C++ call, measured without
waiting for it). A step whose host work is on the critical path (many small collectives on a
fast device) pays the launch cost in full for every collective, so the fusion rule counts it
(`passes/_common.fuses`). `calibrate` fits the model from a short measured sweep at start-up;
every rank ends with the same model (the slowest rank's timings, agreed with an all-reduce MAX).
Pluggable: anything with `collective_s(kind, nbytes)`, `copy_s(nbytes)` and `launch_s(kind)`
works. No GPU-only imports.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Protocol

import torch

SWEEP_BYTES = (1 << 12, 1 << 15, 1 << 18, 1 << 20)


class CostModel(Protocol):
    def collective_s(self, kind: str, nbytes: int) -> float: ...
    def copy_s(self, nbytes: int) -> float: ...
    def launch_s(self, kind: str) -> float: ...


@dataclasses.dataclass
class LinearCostModel:
    # kind -> (latency s, seconds per byte)
    coeffs: dict[str, tuple[float, float]]
    copy: tuple[float, float] | None = None
    samples: dict[str, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)
    launch: dict[str, float] = dataclasses.field(default_factory=dict)   # kind -> host s

    def collective_s(self, kind: str, nbytes: int) -> float:
        a, b = self.coeffs.get(kind) or self.coeffs["all_gather"]
        return a + b * nbytes

    def launch_s(self, kind: str) -> float:
        return self.launch.get(kind, self.launch.get("all_gather", 0.0))

    def copy_s(self, nbytes: int) -> float:
        if self.copy is None:
            return 0.0
        a, b = self.copy
        return a + b * nbytes

    def to_dict(self) -> dict:
        return {"coeffs": {k: list(v) for k, v in self.coeffs.items()},
                "copy": list(self.copy) if self.copy else None,
                "launch": dict(self.launch),
                "samples": {k: [list(s) for s in v] for k, v in self.samples.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "LinearCostModel":
        return cls(coeffs={k: tuple(v) for k, v in d["coeffs"].items()},
                   copy=tuple(d["copy"]) if d.get("copy") else None,
                   samples={k: [tuple(s) for s in v] for k, v in d.get("samples", {}).items()},
                   launch=dict(d.get("launch", {})))


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """latency + bytes * per_byte: the latency is the fastest time of any size (every message
    pays it, and noise only adds time), the per-byte cost what the largest message takes beyond
    it. A least-squares fit over a noisy sweep can put the intercept at or below zero, and a
    model without latency never fuses; one slow small message would tilt a line through the end
    points to a slope of 0, and a model where bytes are free never saves bytes."""
    points = sorted(points)
    latency = min(t for _, t in points)
    x1, y1 = points[-1]
    return latency, (max(0.0, (y1 - latency) / x1) if x1 > 0 else 0.0)


def calibrate(comm, device: torch.device, repeats: int = 5, layout=None) -> LinearCostModel:
    """Measure the collectives over a few sizes; agree across ranks (MAX).

    `layout` (runtime/mesh.py): one figure per group it runs collectives in ([Note: a figure
    per group]); None: all-gather and reduce-scatter over `comm`.

    Each size's time is the fastest of `repeats` runs: noise (another process on the core, a
    late peer) only ever adds time, and the fit goes through the smallest and the largest
    message, so one slow run at either end would tilt the slope (a slope of 0 makes every byte
    free)."""
    groups = group_kinds(layout) if layout is not None else [(comm, ("all_gather", "reduce_scatter"))]
    times = measure_groups(groups, device, repeats)
    # host->device copies (offloading plans with them; on the CPU a host copy stands in)
    times["h2d"] = [t for _, t in _copy_sweep(device, repeats)]
    kinds = list(times)
    launch = _launch_sweep(layout.shard if layout is not None else comm, device)
    flat = torch.tensor([t for k in kinds for t in times[k]] + list(launch.values()),
                        dtype=torch.float64, device=device)
    comm.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, count=False)  # the slowest rank's
    flat = flat.tolist()
    k = len(SWEEP_BYTES)
    samples = {kind: list(zip(SWEEP_BYTES, flat[i * k:(i + 1) * k])) for i, kind in enumerate(kinds)}
    if layout is None:   # one group: its figures under the kinds' names
        samples = {kind.rpartition(":")[2]: v for kind, v in samples.items()}
    coeffs = {kind: _fit(v) for kind, v in samples.items() if kind != "h2d"}
    if layout is not None:
        coeffs.update(compose(coeffs, layout))
    return LinearCostModel(coeffs=coeffs, copy=_fit(samples["h2d"]) if "h2d" in samples else None,
                           samples=samples, launch=dict(zip(launch, flat[len(kinds) * k:])))


# [Note: a figure per group] A hierarchical layout (runtime/mesh.py) runs its collectives in
# groups of different reach: within a node, across nodes, over every rank. The cost model keeps
# one fitted figure per group and kind ("intra:all_gather", "inter:all_reduce", ...; a group
# of one rank: its local copy) and composes from them the figures the passes plan with, as the
# lowering runs each collective: "all_gather" (a forward gather), "all_gather_bw" (a backward
# re-gather: hpz's runs within the group from the secondary shard) and "reduce_scatter" (a
# gradient's reduction: hsdp's is the reduce-scatter in the group plus the all-reduce across
# the groups of its 1/G slice, one after the other; hsdp_zero's the reduce-scatter in the group
# plus a reduce-scatter of the slice across the groups, and every gather runs in the group).
def group_kinds(layout) -> list[tuple[Any, tuple[str, ...]]]:
    """(comm, the kinds the layout runs on it), per group of `layout`."""
    out = [(layout.shard, ("all_gather", "reduce_scatter"))]
    if layout.replicate is not None:
        out.append((layout.replicate, ("reduce_scatter", "all_gather") if layout.primary
                    is not None else ("all_reduce",)))
    if layout.secondary is not None and layout.secondary is not layout.shard:
        out.append((layout.secondary, ("all_gather",)))
    return out


def compose(coeffs: dict[str, tuple[float, float]], layout) -> dict[str, tuple[float, float]]:
    """The passes' figures from the per-group ones ([Note: a figure per group])."""
    zero = (0.0, 0.0)
    ag = coeffs.get(f"{layout.shard.label}:all_gather", zero)
    rs = coeffs.get(f"{layout.shard.label}:reduce_scatter", zero)
    out = {"all_gather": ag, "all_gather_bw": ag, "reduce_scatter": rs}
    if layout.secondary is not None:
        out["all_gather_bw"] = coeffs.get(f"{layout.secondary.label}:all_gather", zero)
    if layout.replicate is not None:
        across = "reduce_scatter" if layout.primary is not None else "all_reduce"
        a, b = coeffs.get(f"{layout.replicate.label}:{across}", zero)
        # the collective across the groups carries 1/G of the reduce-scatter's (full-tensor)
        # bytes
        out["reduce_scatter"] = (rs[0] + a, rs[1] + b / layout.shard.world)
    return out


def measure_groups(groups, device: torch.device, repeats: int = 5) -> dict[str, list[float]]:
    """{"label:kind": the fastest of `repeats` runs at each of SWEEP_BYTES (the full tensor's
    bytes)} for each (comm, kinds) of `groups` (a group of one rank: the local copy that stands
    for its collective, as a gather's cast or view does in the lowered graphs). Every rank runs
    the same sweeps in the same order (each in its own group of a level)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {}
    for comm, kinds in groups:
        for kind in kinds:
            key = f"{comm.label}:{kind}"
            times[key] = []
            for nbytes in SWEEP_BYTES:
                numel = max(comm.world, nbytes // 4) // comm.world * comm.world
                full = torch.zeros(numel, dtype=torch.float32, device=device)
                shard = full[: numel // comm.world].clone()
                fn = {"all_gather": lambda: comm.all_gather(shard, count=False),
                      "reduce_scatter": lambda: comm.reduce_scatter_avg(full, count=False),
                      "all_reduce": lambda: comm.all_reduce(full, count=False)}[kind]
                fn()  # warm
                runs = []
                for _ in range(repeats):
                    sync()
                    t0 = time.perf_counter()
                    fn()
                    sync()
                    runs.append(time.perf_counter() - t0)
                times[key].append(min(runs))
    return times


def _launch_sweep(comm, device: torch.device, launches: int = 16,
                  repeats: int = 3) -> dict[str, float]:
    """Host seconds to launch one functional collective (as the compiled graphs do, below
    autograd), measured without waiting for it: the median over `repeats` rounds of
    `launches` back-to-back launches of a small message. Zero at world size 1 (the lowered
    graphs launch nothing there)."""
    if comm.world == 1:
        return {"all_gather": 0.0, "reduce_scatter": 0.0}
    from .. import _compat

    ag, rs, wait = _compat.funcol_ops()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    small = torch.zeros(256 * comm.world, dtype=torch.float32, device=device)
    shard = small[:256].clone()
    out = {}
    for kind, launch in (("all_gather", lambda: ag(shard, comm.world, comm.group_name)),
                         ("reduce_scatter", lambda: rs(small, "sum", comm.world, comm.group_name))):
        runs = []
        with _compat.below_autograd():
            for _ in range(repeats + 1):
                sync()
                t0 = time.perf_counter()
                pending = [launch() for _ in range(launches)]
                elapsed = time.perf_counter() - t0
                for t in pending:
                    wait(t)
                sync()
                runs.append(elapsed / launches)
        out[kind] = statistics.median(runs[1:])
    return out


def _copy_sweep(device: torch.device, repeats: int) -> list[tuple[int, float]]:
    """Host -> device copy times: from pinned memory on CUDA, host to host on the CPU."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    out = []
    for nbytes in SWEEP_BYTES:
        host = torch.empty(nbytes // 4, dtype=torch.float32)
        host = host.pin_memory() if cuda else host
        dev = torch.empty_like(host, device=device)
        runs = []
        for _ in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=cuda)
            sync()
            runs.append(time.perf_counter() - t0)
        out.append((nbytes, min(runs[1:])))
    return out
