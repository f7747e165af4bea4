"""The engine's collectives on gloo: one worker thread, so functional all-gathers never run two
at a time (two at once corrupt gloo's heap; see _compat.serial_gloo_group and
benchmarks/validation/gloo_inflight.py, which reproduces the crash on a default gloo group)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from _dist import run_distributed


def _threads_and_stress(rank: int, world: int, rounds: int, inflight: int):
    from deepcompile import _compat
    from deepcompile.runtime.comm import Comm

    comm = Comm()
    ag, _, wait = _compat.funcol_ops()
    shard = torch.full((256,), float(rank))
    with _compat.below_autograd():
        for _ in range(rounds):
            pending = [ag(shard.clone(), comm.world, comm.group_name) for _ in range(inflight)]
            outs = [wait(t) for t in pending]
    expect = torch.cat([torch.full((256,), float(r)) for r in range(world)])
    return {"engine": _compat.gloo_threads(comm.group), "default": _compat.gloo_threads(None),
            "rank": comm.rank, "ok": all(torch.equal(o, expect) for o in outs)}


def test_engine_gloo_group_runs_collectives_one_at_a_time():
    # 16 functional all-gathers in flight, 400 rounds: on a default (two-thread) gloo group this
    # killed a rank in 3 of 10 launches (benchmarks/validation/gloo_inflight.py)
    out = run_distributed(_threads_and_stress, 2, 400, 16, timeout=300)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["engine"] == 1 and o["default"] == 2 for o in out), out
    assert all(o["ok"] for o in out)


def _one_rank(rank: int, world: int):
    from deepcompile.runtime.comm import Comm

    comm = Comm()
    return comm.group is None and comm.world == 1


def test_world_size_one_makes_no_group():
    assert run_distributed(_one_rank, 1) == [True]
