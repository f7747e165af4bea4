"""Synthetic profiled graphs for the planners' tests (no process group)."""

from __future__ import annotations


def random_gathers(rng, P) -> tuple[list, list]:
    """A random graph's profile as the profiler measures it, for prefetch's planner `P`
    (deepcompile.passes.prefetch): (steps, gathers), 6-30 compute nodes with a gather before
    about half of them; a gather's node holds the node before's bytes plus its own buffer."""
    steps, gs = [], []
    for i in range(rng.randint(6, 30)):
        if i and rng.random() < 0.5:
            nbytes = rng.choice([64, 128, 256, 512])
            gs.append(P.Gather(f"g{len(gs)}", len(steps), nbytes, pid=len(gs)))
            steps.append(P.Step(f"g{len(gs) - 1}", "all_gather", 0.01,
                                steps[-1].live_bytes + nbytes))
        steps.append(P.Step(f"c{i}", "compute", rng.expovariate(1.0), rng.randint(100, 1000)))
    return steps, gs
