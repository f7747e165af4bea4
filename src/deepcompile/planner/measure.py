"""Profiles taken on this machine: the pieces' node times, the optimizer step, the network.

[Note: measuring on the CPU] When the target is this machine (`--gpu cpu`: gloo ranks on its
cores), nothing is scaled: the pieces are built with real random weights, traced like the fake
ones, and each graph is run through deepcompile's own profiler (`compiler.profiler.profile_run`:
one wall-clock time per node, the FX graph executed node by node, as `compiler="fx"` runs it);
the optimizer step is AdamW on this rank's shards; the network is a sweep of gloo all-gathers
and reduce-scatters fitted to `latency + bytes x seconds per byte` (the runtime's calibration,
over more sizes). All of it runs in N spawned ranks at once, one thread each as the bench runs
them, so the figures include what N ranks sharing these cores cost each other; per node, the
median over the repeats, then the maximum over ranks (the pipeline's agreement rule).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import torch

from .network import Fitted, fit
from .roofline import NodeCost

SWEEP = (1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20, 1 << 22)


@dataclasses.dataclass
class HostProfile:
    world: int
    node_s: dict[str, dict[str, float]]     # "piece.phase" -> node name -> seconds
    optimizer_s: float
    network: Fitted
    load: list[float]                        # 1/5/15-min load average when measured

    def times(self, piece: str, phase: str) -> dict[str, NodeCost]:
        return {n: NodeCost(t, 0.0, 1) for n, t in self.node_s[f"{piece}.{phase}"].items()}

    def to_dict(self) -> dict[str, Any]:
        return {"world": self.world, "optimizer_s": self.optimizer_s,
                "network": self.network.to_dict(), "load": self.load,
                "graph_s": {k: sum(v.values()) for k, v in self.node_s.items()}}


def profile_pieces(graphs, repeats: int) -> dict[str, dict[str, float]]:
    """Median time per node of each piece's forward and backward on real inputs."""
    from ..compiler.profiler import profile_run

    runs: dict[str, dict[str, list[float]]] = {}
    for name, pg in graphs.items():
        args = [p.detach() for p in pg.piece.params] + [t.detach() for t in pg.piece.inputs]
        for r in range(repeats + 1):
            with torch.no_grad():
                outs, fp = profile_run(pg.fw, args, slot=f"{name}.fw", version=0,
                                       name_of=str)
                outs = list(outs)
                saved = outs[pg.n_outputs:]
                tangents = [torch.ones_like(outs[i]) for i in pg.tangent_of]
                _, bp = profile_run(pg.bw, saved + tangents, slot=f"{name}.bw", version=0,
                                    name_of=str)
            if r == 0:
                continue   # warm-up
            for prof, phase in ((fp, "fw"), (bp, "bw")):
                d = runs.setdefault(f"{name}.{phase}", {})
                for n in prof.nodes:
                    d.setdefault(n.name, []).append(n.time_s)
    return {k: {n: statistics.median(v) for n, v in d.items()} for k, d in runs.items()}


def time_optimizer(numels: list[int], world: int, repeats: int) -> float:
    """Median time of one AdamW step on this rank's fp32 shards of parameters of `numels`."""
    shards = [torch.nn.Parameter(torch.randn(-(-n // world))) for n in numels]
    for p in shards:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(shards, lr=1e-3)
    times = []
    for r in range(repeats + 2):
        t0 = time.perf_counter()
        opt.step()
        if r >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sweep_network(comm, repeats: int) -> dict[str, list[float]]:
    """Median seconds of a synchronous all-gather / reduce-scatter per SWEEP size, and the host
    time of launching an asynchronous one."""
    out: dict[str, list[float]] = {"all_gather": [], "reduce_scatter": [], "launch": []}
    world = comm.world
    for nbytes in SWEEP:
        numel = max(world, nbytes // 4) // world * world
        full = torch.zeros(numel)
        shard = full[: numel // world].clone()
        for kind, fn in (("all_gather", lambda: comm.all_gather(shard, count=False)),
                         ("reduce_scatter", lambda: comm.reduce_scatter_avg(full, count=False))):
            fn()
            ts = []
            for _ in range(repeats):
                torch.distributed.barrier()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            out[kind].append(statistics.median(ts))
    ts = []
    for _ in range(repeats):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        _, work = comm.all_gather_async(shard)
        ts.append(time.perf_counter() - t0)
        work.wait()
    out["launch"].append(statistics.median(ts))
    return out


def _rank(rank: int, world: int, port: int, spec: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        from ..runtime.comm import Comm
        from . import pieces, shapes, trace

        dist.init_process_group("gloo")
        comm = Comm()
        shape = shapes.load(spec["model"])
        ps = pieces.build(shape, batch=spec["batch"], seq=spec["seq"], dtype=torch.float32,
                          fake=False, seed=spec["seed"])
        graphs = trace.trace_all(ps)
        node_s = profile_pieces(graphs, spec["repeats"])
        opt_s = time_optimizer(list(pieces.param_numels(ps).values()), world, spec["repeats"])
        net = sweep_network(comm, spec["net_repeats"])
        flat = [t for d in node_s.values() for t in d.values()] + [opt_s] + \
            [t for k in ("all_gather", "reduce_scatter", "launch") for t in net[k]]
        vec = torch.tensor(flat, dtype=torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
        if rank == 0:
            vals = iter(vec.tolist())
            node_s = {k: {n: next(vals) for n in d} for k, d in node_s.items()}
            opt_s = next(vals)
            net = {k: [next(vals) for _ in net[k]] for k in ("all_gather", "reduce_scatter",
                                                          "launch")}
            queue.put(("ok", {"node_s": node_s, "optimizer_s": opt_s, "net": net}))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- the parent reports it
        import traceback

        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def measure_host(model: str, *, world: int, batch: int, seq: int, repeats: int = 5,
                 net_repeats: int = 20, seed: int = 0, timeout_s: float = 900.0) -> HostProfile:
    """The profiles of `model` at `world` gloo ranks on this machine (see the module note)."""
    import multiprocessing as mp

    from .._demo import _free_port, _terminate

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    spec = {"model": model, "batch": batch, "seq": seq, "repeats": repeats,
            "net_repeats": net_repeats, "seed": seed}
    load = list(os.getloadavg())
    saved = dict(os.environ)
    procs = []
    try:
        os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        for r in range(world):
            p = ctx.Process(target=_rank, args=(r, world, port, spec, queue), daemon=True)
            p.start()
            procs.append(p)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        status, data = queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
        _terminate(procs)
    if status != "ok":
        raise RuntimeError(f"deepcompile plan: measuring on this machine failed:\n{data}")
    net = data["net"]
    network = Fitted(world,
                     {k: fit(list(zip(SWEEP, net[k]))) for k in ("all_gather", "reduce_scatter")},
                     launch={"all_gather": net["launch"][0], "reduce_scatter": net["launch"][0]},
                     copy=(0.0, 0.0),
                     samples={k: list(zip(SWEEP, net[k])) for k in ("all_gather", "reduce_scatter")})
    return HostProfile(world, data["node_s"], data["optimizer_s"], network, load)
