"""The planner's step simulator (tools/plan/simulate.py) on synthetic event lists."""

from __future__ import annotations

import pytest

from deepcompile.tools.plan.simulate import Event, simulate


def C(name, dur, live=0, host=0.0, peak=None):
    return Event("compute", name, dur, host, live=live, peak=peak)


def S(name, dur, cid, live=0, host=0.0, lane="comm"):
    return Event("start", name, dur, host, cid, lane, live)


def W(cid, live=0, lane="comm"):
    return Event("wait", f"wait{cid}", cid=cid, lane=lane, live=live)


def test_a_synchronous_collective_is_fully_exposed():
    r = simulate([C("a", 1.0), S("ag", 0.5, 1), W(1), C("b", 1.0)])
    assert r.step_s == pytest.approx(2.5)
    assert r.exposed_comm_s == pytest.approx(0.5)
    assert r.compute_s == pytest.approx(2.0) and r.comm_s == pytest.approx(0.5)


def test_a_prefetched_collective_hides_behind_the_compute_before_its_wait():
    r = simulate([S("ag", 0.5, 1), C("a", 1.0), W(1), C("b", 1.0)])
    assert r.step_s == pytest.approx(2.0) and r.exposed_comm_s == 0.0
    # longer than the compute it overlaps: only the rest is exposed
    r = simulate([S("ag", 1.5, 1), C("a", 1.0), W(1), C("b", 1.0)])
    assert r.step_s == pytest.approx(2.5) and r.exposed_comm_s == pytest.approx(0.5)


def test_a_collective_starts_after_the_compute_issued_before_it():
    # its input is produced by "a": it cannot overlap "a"
    r = simulate([C("a", 1.0), S("rs", 1.0, 1), C("b", 1.0), W(1)])
    assert r.step_s == pytest.approx(2.0)
    assert [(s.lane, s.t0, s.t1) for s in r.segments if s.lane == "comm"] == [("comm", 1.0, 2.0)]
    assert r.exposed_comm_s == 0.0


def test_collectives_of_one_lane_run_in_issue_order():
    ev = [S("x", 1.0, 1), S("y", 1.0, 2), C("a", 0.5), W(2), C("b", 0.5)]
    r = simulate(ev)
    comm = [(s.name, s.t0, s.t1) for s in r.segments if s.lane == "comm"]
    assert comm == [("x", 0.0, 1.0), ("y", 1.0, 2.0)]
    assert r.exposed_comm_s == pytest.approx(1.5) and r.step_s == pytest.approx(2.5)
    # a copy lane runs beside the communication lane
    r = simulate([S("x", 1.0, 1), S("h2d", 1.0, 2, lane="copy"), W(1), W(2, lane="copy")])
    assert r.step_s == pytest.approx(1.0)
    assert r.exposed_comm_s == pytest.approx(1.0)   # the copy's wait is not communication


def test_a_copy_back_starts_after_its_copy_out_ends():
    # a copy out (2 s) on "d2h", its copy back on "h2d" issued 1 s later: the copy back waits
    # for it (the runtime's stream waits for the copy out's event), then the reader for both
    out = S("out", 2.0, 1, lane="d2h")
    back = Event("start", "back", 1.0, 0.0, 2, "h2d", after=1)
    r = simulate([out, C("a", 1.0), back, W(2, lane="h2d"), C("b", 1.0)])
    assert [(s.name, s.t0, s.t1) for s in r.segments if s.lane == "h2d"] == [("back", 2.0, 3.0)]
    assert r.step_s == pytest.approx(4.0)


def test_the_host_runs_ahead_of_the_device_unless_it_is_the_device():
    ev = [C("a", 1.0, host=0.1), C("b", 1.0, host=0.1), S("ag", 0.5, 1, host=0.2), W(1)]
    gpu = simulate(ev)
    # "a" waits 0.1 s for its launch; "ag" waits for "b" (its input), not for the host
    assert gpu.step_s == pytest.approx(2.6) and gpu.host_s == pytest.approx(0.4)
    assert gpu.host_bound_s == pytest.approx(0.1)     # only the first kernel waited for it
    cpu = simulate(ev, host_is_compute=True)
    assert cpu.step_s == pytest.approx(0.1 + 1.0 + 0.1 + 1.0 + 0.2 + 0.5)


def test_a_host_bound_step():
    ev = [C(f"k{i}", 1e-6, host=10e-6) for i in range(100)]
    r = simulate(ev)
    assert r.step_s == pytest.approx(100 * 10e-6 + 1e-6)
    assert r.host_bound_s == pytest.approx(100 * 10e-6 - 99 * 1e-6, rel=1e-6)


def test_memory_curve_and_peak():
    ev = [C("a", 1.0, live=10), S("ag", 1.0, 1, live=30), C("b", 1.0, live=25, peak=40),
          W(1, live=25), C("c", 1.0, live=5)]
    r = simulate(ev)
    assert r.peak_bytes == 40
    assert [m for _, m in r.memory] == [10, 30, 40, 25, 5]
    times = [t for t, _ in r.memory]
    assert times == sorted(times)


def test_unknown_event_kind_is_an_error():
    with pytest.raises(ValueError):
        simulate([Event("nap", "x")])


def test_a_collective_launched_late_by_the_host_is_host_bound_not_exposed():
    ev = [C("a", 1.0), S("ag", 0.5, 1, host=3.0), W(1), C("b", 1.0)]
    r = simulate(ev)
    # the host issues "ag" at 3.0; it runs 3.0-3.5; "b" waits from 1.0: 2.0 s for the host,
    # 0.5 s for the wire
    assert r.step_s == pytest.approx(4.5)
    assert r.host_bound_s == pytest.approx(2.0) and r.exposed_comm_s == pytest.approx(0.5)
