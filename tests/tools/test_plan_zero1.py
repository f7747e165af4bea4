"""The planner at ZeRO-1/2 (tools/plan/ours*.py, peers.py): `overlap_refresh`'s refresh in flight
under the next forward, and the peers beside it, DDP and DeepSpeed ZeRO-1, on synthetic graphs."""

from __future__ import annotations

import pytest

from deepcompile.tools.plan import ours, ours_passes, peers
from deepcompile.tools.plan.schedule import Setting
from deepcompile.tools.plan.simulate import simulate
from test_plan_schedules import MS, NUMEL, setting, synthetic

ON = ("bucket_reduce", "overlap_refresh")


def _z(stage, m, gas=1, world=8):
    return Setting(m, world, setting(m, world=world).cost, float("inf"), gas, 2.68e12, 0.0, 0.0,
                   optimizer_s=1 * MS, stage=stage)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_refresh_runs_under_the_next_forward(stage):
    m = synthetic(layers=8)
    s = _z(stage, m)
    sync = ours.schedule(s, ("bucket_reduce",), "sync", "")
    over = ours.schedule(s, ON, "overlap", "")
    r_sync, r_over = simulate(sync.events), simulate(over.events)
    # the same bytes gathered per step (the groups may differ), in flight from the step's start
    assert over.collectives["all_gather"]["bytes"] == sync.collectives["all_gather"]["bytes"]
    first = [e for e in over.events if e.kind == "start"][0]
    assert first.name.startswith("refresh") and first.lane == "comm"
    assert not [e for e in over.events if e.name == "refresh copy-out"]   # straight into them
    # waited for inside the first forward, before the first read of each group
    waits = [i for i, e in enumerate(over.events) if e.name == "refresh.wait"]
    fw_end = max(i for i, e in enumerate(over.events) if e.label.endswith(" fw"))
    assert waits and max(waits) < fw_end
    assert r_over.step_s < r_sync.step_s and r_over.exposed_comm_s < r_sync.exposed_comm_s
    d = over.decisions["overlap_refresh"]
    assert d["exposed_s"] <= d["refresh_s"] and d["bytes"] == len(m.params) * NUMEL * 2


def test_world_size_one_and_zero3_plan_no_refresh():
    m = synthetic()
    assert ours.schedule(_z(1, m, world=1), ON, "x", "").decisions["overlap_refresh"] == \
        {"skipped": "world size 1: nothing is communicated"}
    assert ours.schedule(_z(3, m), ("overlap_refresh",), "x", "").decisions[
        "overlap_refresh"] == {"skipped": "ZeRO-3: no replicated parameters"}


def test_auto_chooses_the_refresh_overlap_at_zero1():
    m = synthetic()
    chosen, out = ours_passes.auto_choice(_z(1, m))
    assert chosen == ["bucket_reduce", "overlap_refresh"]
    assert "overlap_refresh" in ours_passes.auto_choice(setting(m))[1]   # ZeRO-3


def test_ddp_all_reduces_in_the_backward_and_steps_every_parameter():
    m = synthetic(layers=8)
    s = _z(1, m)
    for compiled in (False, True):
        sch = peers.ddp(s, peers.PeerCosts(), compiled=compiled, name="ddp", description="")
        assert set(sch.collectives) == {"all_reduce"}
        grads = sum(p.numel for p in m.params) * 4   # fp32 gradients
        assert sch.collectives["all_reduce"]["bytes"] == grads
        step = [e for e in sch.events if e.name == "optimizer step"]
        assert step[0].dur == pytest.approx(1 * MS * sum(p.numel for p in m.params)
                                            / s.shard_elems())
        assert sch.decisions["state_bytes_per_rank"] == 16 * sum(p.numel for p in m.params)
    # with accumulation (no_sync), once per optimizer step
    sch = peers.ddp(_z(1, m, gas=4), peers.PeerCosts(), compiled=True, name="ddp", description="")
    assert sch.collectives["all_reduce"]["bytes"] == grads


def test_deepspeed_zero1_reduces_and_gathers_inside_the_step():
    m = synthetic(layers=8)
    s = _z(1, m)
    sch = peers.deepspeed_z1(s, peers.PeerCosts(), name="ds-z1", description="")
    assert set(sch.collectives) == {"all_gather", "reduce_scatter"}
    r = simulate(sch.events)
    ours_r = simulate(ours.schedule(s, ON, "x", "").events)
    assert r.exposed_comm_s > ours_r.exposed_comm_s
    # the gathers come after the optimizer step, and the step waits for them
    names = [e.name for e in sch.events]
    assert names.index("optimizer step") < names.index("allgather 0")
