"""A made-up host profile for the planner's tests: `deepcompile plan --gpu cpu` reads one from a
file, and the harness that measures real ones (benchmarks/validation/host_profile.py) runs no
part of the suite."""

from __future__ import annotations

import torch


def synthetic(model: str, world: int, batch: int, seq: int, node_s: float = 1e-5):
    """A profile of `model`'s pieces at these figures: every node `node_s`, a gloo-like
    network of fixed figures (100 us + 1 GB/s, asynchronous kinds 20% slower)."""
    from deepcompile.tools.plan import pieces, shapes, trace
    from deepcompile.tools.plan.host import HostProfile
    from deepcompile.tools.plan.network import Measured

    ps = pieces.build(shapes.load(model), batch=batch, seq=seq, dtype=torch.float32, fake=False)
    graphs = trace.trace_all(ps)
    nodes = {f"{name}.{phase}": {n.name: node_s for n in getattr(pg, phase).graph.nodes
                                 if n.op == "call_function"}
             for name, pg in graphs.items() for phase in ("fw", "bw")}
    line = {"all_gather": (1e-4, 1e-9), "reduce_scatter": (1e-4, 1e-9),
            "all_gather_async": (1.2e-4, 1.2e-9), "reduce_scatter_async": (1.2e-4, 1.2e-9)}
    samples = {k: [(x, a + b * x) for x in (1 << 10, 1 << 16, 1 << 22)]
               for k, (a, b) in line.items()}
    net = Measured(world, line, launch={"all_gather": 1e-5, "reduce_scatter": 1e-5},
                   samples=samples, overlap=0.5,
                   wait={"all_gather": 5e-6, "reduce_scatter": 5e-6})
    return HostProfile(model, world, batch, seq, nodes, optimizer_s=1e-3, peer_optimizer_s=2e-3,
                       framework_s=5e-4, framework_async_s=8e-4 if world > 1 else None,
                       network=net, copy_bw=1e10, record={"made_up": True})
