"""The planner's network model (planner/network.py): NCCL ring/tree latency-bandwidth figures."""

from __future__ import annotations

import math

import pytest

from deepcompile.tools.plan.network import Fabric, Fitted, fit

MB = 1 << 20


def fabric(nodes, gpus, **kw):
    return Fabric(nodes, gpus, **{"nvlink_bw": 450e9, "nic_bw": 50e9, "pcie_bw": 55e9, **kw})


def test_world_size_one_has_no_wire():
    f = fabric(1, 1)
    assert f.collective_s("all_gather", 64 * MB) == 0.0
    assert f.collective_s("all_reduce", 64 * MB) == 0.0


def test_ring_all_gather_inside_one_node_by_hand():
    f = fabric(1, 8, nvlink_eff=0.8, nvlink_hop_s=1e-6, base_s=10e-6)
    nbytes = 360 * MB
    want = 10e-6 + 7 * 1e-6 + (7 / 8) * nbytes / (450e9 * 0.8)
    assert f.collective_s("all_gather", nbytes) == pytest.approx(want, rel=1e-12)
    assert f.collective_s("reduce_scatter", nbytes) == f.collective_s("all_gather", nbytes)


def test_across_nodes_the_slower_of_nvlink_and_the_rails():
    # 8 rails of 50 GB/s x 0.9 = 360 GB/s, NVLink 450 x 0.8 = 360: equal; with 4 rails the
    # network is the bottleneck at half that
    eight = fabric(4, 8, nvlink_eff=0.8, nic_eff=0.9)
    assert eight.busbw() == pytest.approx(360e9)
    four = fabric(8, 4, nvlink_eff=0.8, nic_eff=0.9)
    assert four.busbw() == pytest.approx(4 * 50e9 * 0.9)
    slow = fabric(4, 8, nic_bw=12.5e9)
    assert slow.busbw() == pytest.approx(8 * 12.5e9 * 0.9)
    # the latency is the ring's: N - nodes NVLink hops and one network hop per node
    assert eight.ring_latency() == pytest.approx(28 * eight.nvlink_hop_s + 4 * eight.net_hop_s)


def test_large_messages_are_bandwidth_bound_small_ones_latency_bound():
    f = fabric(4, 8)
    small, large = f.collective_s("all_gather", 1024), f.collective_s("all_gather", 1 << 30)
    assert small == pytest.approx(f.base_s + f.ring_latency(), rel=1e-3)
    assert large == pytest.approx(f.base_s + f.ring_latency() + (31 / 32) * (1 << 30) / f.busbw(),
                                  rel=1e-12)
    assert large > 50 * small
    # fusing two small gathers saves a latency: what the prefetch planner's rule looks for
    assert f.collective_s("all_gather", 2048) < 2 * f.collective_s("all_gather", 1024)


def test_all_reduce_takes_the_faster_of_ring_and_tree():
    f = fabric(16, 8)
    ring = Fabric(**{**f.__dict__, "algorithm": "ring"})
    tree = Fabric(**{**f.__dict__, "algorithm": "tree"})
    for nbytes in (1024, 64 * MB, 1 << 30):
        auto = f.collective_s("all_reduce", nbytes)
        assert auto == min(ring.collective_s("all_reduce", nbytes),
                           tree.collective_s("all_reduce", nbytes))
    # a tree's latency grows with log2(nodes), a ring's with N: small messages go by tree
    assert tree.collective_s("all_reduce", 1024) < ring.collective_s("all_reduce", 1024)
    assert ring.collective_s("all_reduce", 1 << 30) < tree.collective_s("all_reduce", 1 << 30)
    assert f.tree_latency() == pytest.approx(
        2 * (math.log2(16) * f.net_hop_s + 7 * f.nvlink_hop_s))
    assert tree.collective_s("all_reduce", 1 << 30) == pytest.approx(
        f.base_s + f.tree_latency() + 2 * (1 << 30) / (f.busbw() * f.tree_bw_factor))


def test_launch_and_copy_costs():
    f = fabric(2, 8, launch_host_s=15e-6, pcie_eff=0.5)
    assert f.launch_s("all_gather") == 15e-6
    assert f.copy_s(55 * MB) == pytest.approx(f.copy_lat_s + 55 * MB / (55e9 * 0.5))
    with pytest.raises(ValueError):
        f.collective_s("broadcast", 10)


def test_fit_recovers_a_linear_model_and_stays_non_negative():
    a, b = fit([(x, 20e-6 + x / 1e9) for x in (1 << 10, 1 << 16, 1 << 20, 1 << 22)])
    assert a == pytest.approx(20e-6, rel=1e-6) and b == pytest.approx(1e-9, rel=1e-6)
    a, b = fit([(1 << 10, 5e-4), (1 << 20, 1e-4)])   # noise: slope would be negative
    assert b == 0.0 and a > 0
    m = Fitted(2, {"all_gather": (1e-4, 1e-9)}, launch={"all_gather": 3e-6})
    # a synchronous op's measured time is its launch on the host plus the rest on its lane
    assert m.collective_s("all_gather", 1000) + m.launch_s("all_gather") == \
        pytest.approx(1e-4 + 1e-6)
    assert m.collective_s("reduce_scatter", 1000) == pytest.approx(1e-4 + 1e-6)
    assert m.launch_s("all_gather") == 3e-6 and m.launch_s("reduce_scatter") == 0.0


def test_the_sweeps_synchronous_collectives_are_scaled_to_a_steps():
    """[Note: the sweep checked in a step] (planner/measure.py): the one-layer model's
    collectives took 1.5x in a step what the sweep gives them (10 all-gathers of 1 KiB at
    100 us, 5 reduce-scatters of 64 KiB at 200 us: 2 ms by the sweep, 3 ms in the step). The
    synchronous kinds' sweeps are scaled by 1.5, the asynchronous ones are not; a step whose
    collectives took no time, or one with none, is an error, not a free network."""
    from deepcompile.tools.plan.measure import check_in_step

    us = 1e-6
    samples = {"all_gather": [(1 << 10, 100 * us), (1 << 16, 150 * us)],
               "reduce_scatter": [(1 << 10, 120 * us), (1 << 16, 200 * us)],
               "all_gather_async": [(1 << 10, 300 * us), (1 << 16, 400 * us)]}
    net = Fitted(2, {k: fit(v) for k, v in samples.items()}, samples=samples)
    comm = {"all_gather": (10, 10 << 10), "reduce_scatter": (5, 5 << 16), "all_reduce": (0, 0)}
    m, record = check_in_step(net, 3e-3, comm)
    assert record["sweep_s"] == pytest.approx(2e-3)
    assert record["factor"] == pytest.approx(1.5)
    assert [b for b, _ in m.samples["all_gather"]] == [1 << 10, 1 << 16]
    assert [t for _, t in m.samples["all_gather"]] == pytest.approx([150 * us, 225 * us])
    assert m.samples["all_gather_async"] == samples["all_gather_async"]
    assert m.collective_s("reduce_scatter", 1 << 16) == pytest.approx(300 * us)
    assert m.coeffs["reduce_scatter"] == pytest.approx(
        tuple(1.5 * c for c in net.coeffs["reduce_scatter"]))   # the line, scaled alike
    assert net.samples["all_gather"][0][1] == 100 * us       # the measured network is left as it was
    for bad in (0.0, -1e-4):
        with pytest.raises(RuntimeError, match="measurement failed"):
            check_in_step(net, bad, comm)
    with pytest.raises(RuntimeError, match="no synchronous collective"):
        check_in_step(net, 3e-3, {"all_reduce": (2, 64)})


def test_a_collective_is_read_off_the_sweep_not_its_line():
    """[Note: a sweep is read, not fitted]: the least-squares line through a sweep is set by its
    largest sizes. These are the 2-core VM's all-gathers at 2 ranks (stop 37): the line puts a
    19 KB one (tiny-llama's parameters) at 88 us, where the sweep measured 108-139 us at
    1-64 KiB. Read off the sweep, a collective between two sizes is interpolated, the noisy dip
    at 8 KiB is pooled with its neighbours (a larger collective is not faster), and beyond the
    largest size the last segment's slope goes on."""
    from deepcompile.tools.plan.network import interpolate, monotone

    us = 1e-6
    pts = [(1 << 10, 139 * us), (1 << 13, 108 * us), (1 << 16, 115 * us), (1 << 18, 151 * us),
           (1 << 20, 323 * us), (1 << 22, 1487 * us)]
    line = fit(pts)
    m = Fitted(2, {"all_gather": line, "all_gather_async": line},
               launch={"all_gather": 20 * us},
               samples={"all_gather": pts, "all_gather_async": [(x, 2 * y) for x, y in pts]})
    pooled = (139 + 108 + 115) / 3 * us
    assert [y for _, y in monotone(pts)][:4] == pytest.approx([pooled] * 3 + [151 * us])
    assert line[0] + line[1] * 19_000 < 0.75 * pooled        # what the line said
    assert m.collective_s("all_gather", 19_000) + 20 * us == pytest.approx(pooled)
    assert m.collective_s("all_gather", 1 << 19) + 20 * us == pytest.approx(
        (151 + (323 - 151) / 3) * us)                          # a third of the way to 1 MiB
    assert m.collective_s("all_gather", 1 << 23) + 20 * us == pytest.approx(
        (1487 + (1487 - 323) * 4 / 3) * us)                    # the last slope, 4 MiB further
    assert m.async_s("all_gather", 19_000) + 20 * us == pytest.approx(2 * pooled)
    assert interpolate([(100, 5.0)], 10_000) == 5.0
    # without points, the line stands in (as for a network given as coefficients)
    bare = Fitted(2, {"all_gather": line})
    assert bare.collective_s("all_gather", 19_000) == pytest.approx(line[0] + line[1] * 19_000)


def test_the_wait_of_a_done_collective_is_timed_once_it_is_done(group, monkeypatch):
    """`measure.sweep_ops` times the host cost of waiting for a collective that has finished.
    With more ranks than cores, gloo's thread may still be running it when every rank has
    launched (the barrier): a fake collective that takes 20 ms on a thread of its own stands in
    for that. The wait then measured the rest of the collective (the plan charged it on top
    of the collective: 4 ranks on 2 cores predicted 33% slow); now it measures the wait."""
    import threading
    import time

    from deepcompile.tools.plan import measure

    took = 0.02

    def launch(t):
        th = threading.Thread(target=time.sleep, args=(took,))
        th.start()
        return th, t

    def wait(token):
        th, t = token
        th.join()
        return t

    monkeypatch.setattr(measure, "_funcol", lambda comm: (launch, launch, wait))
    monkeypatch.setattr(measure, "SWEEP", (1 << 10,))

    class Comm:
        world = 1

    out = measure.sweep_ops(Comm(), repeats=2)
    assert out["all_gather"][0] >= took * 0.9          # the collective itself: 20 ms
    assert out["wait_all_gather"][0] < took / 4, out   # waiting for it once done: ~0
    assert out["wait_reduce_scatter"][0] < took / 4, out


def test_the_sweep_keeps_a_collectives_stalls(group, monkeypatch):
    """[Note: gloo's stalls] (planner/measure.py): a gloo collective here takes ~0.2 ms, or a
    scheduler tick more in some calls, and a step adds up every call. A fake synchronous
    collective that stalls 30 ms in each of the first `repeats` calls (one of the sweep's three
    rounds) and takes nothing otherwise: the sweep's figure is the mean over the rounds
    (~10 ms a call); the median of the rounds' means, as before, said ~0."""
    import time

    from deepcompile.tools.plan import measure

    repeats = 4
    calls = [0]

    def launch(t):
        calls[0] += 1
        return t

    def wait(t):
        if 2 <= calls[0] <= repeats + 1:   # the first call warms up; then one round stalls
            time.sleep(0.03)
        return t

    def gather_only(comm):
        return launch, (lambda t: t), wait

    monkeypatch.setattr(measure, "_funcol", gather_only)
    monkeypatch.setattr(measure, "SWEEP", (1 << 10,))

    class Comm:
        world = 1

    out = measure.sweep_ops(Comm(), repeats=repeats)
    assert 0.007 < out["all_gather"][0] < 0.015, out["all_gather"]
