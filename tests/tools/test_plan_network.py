"""The planner's network models (tools/plan/network.py): NCCL ring/tree latency-bandwidth
figures, and a measured gloo network read off its sweep."""

from __future__ import annotations

import json
import math

import pytest

from deepcompile.tools.plan.network import Fabric, Measured

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


def test_a_measured_collective_is_its_launch_and_the_rest():
    m = Measured(2, {"all_gather": (1e-4, 1e-9)}, launch={"all_gather": 3e-6})
    # a synchronous op's measured time is its launch on the host plus the rest on its lane
    assert m.collective_s("all_gather", 1000) + m.launch_s("all_gather") == \
        pytest.approx(1e-4 + 1e-6)
    assert m.collective_s("reduce_scatter", 1000) == pytest.approx(1e-4 + 1e-6)
    assert m.launch_s("all_gather") == 3e-6 and m.launch_s("reduce_scatter") == 0.0


def test_a_collective_is_read_off_the_sweep_not_its_line():
    """[Note: a sweep is read, not fitted]: the 2-core VM's all-gathers at 2 ranks (stop 37).
    Read off the sweep, a collective between two sizes is interpolated, the noisy dip at 8 KiB
    is pooled with its neighbours (a larger collective is not faster), and beyond the largest
    size the last segment's slope goes on; the line (latency + bytes x seconds per byte) only
    stands in where there are no points."""
    from deepcompile.tools.plan.network import interpolate, monotone

    us = 1e-6
    pts = [(1 << 10, 139 * us), (1 << 13, 108 * us), (1 << 16, 115 * us), (1 << 18, 151 * us),
           (1 << 20, 323 * us), (1 << 22, 1487 * us)]
    line = (50 * us, 3e-10)
    m = Measured(2, {"all_gather": line, "all_gather_async": line},
               launch={"all_gather": 20 * us},
               samples={"all_gather": pts, "all_gather_async": [(x, 2 * y) for x, y in pts]})
    pooled = (139 + 108 + 115) / 3 * us
    assert [y for _, y in monotone(pts)][:4] == pytest.approx([pooled] * 3 + [151 * us])
    assert m.collective_s("all_gather", 19_000) + 20 * us == pytest.approx(pooled)
    assert m.collective_s("all_gather", 1 << 19) + 20 * us == pytest.approx(
        (151 + (323 - 151) / 3) * us)                          # a third of the way to 1 MiB
    assert m.collective_s("all_gather", 1 << 23) + 20 * us == pytest.approx(
        (1487 + (1487 - 323) * 4 / 3) * us)                    # the last slope, 4 MiB further
    assert m.async_s("all_gather", 19_000) + 20 * us == pytest.approx(2 * pooled)
    assert interpolate([(100, 5.0)], 10_000) == 5.0
    # as a host profile's JSON holds it
    assert Measured.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    # without points, the line stands in (as for a network given as coefficients)
    bare = Measured(2, {"all_gather": line})
    assert bare.collective_s("all_gather", 19_000) == pytest.approx(line[0] + line[1] * 19_000)


def test_layout_fabrics_run_each_collective_in_its_group():
    """[Note: layouts in the plan]: under hsdp and hsdp_zero every gather runs in the group
    (a node's NVLink), a gradient's reduction in the group and then its 1/G slice across the
    groups (hsdp: an all-reduce; hsdp_zero: a reduce-scatter, half the ring's bytes); under hpz
    only the backward's gathers stay in the group."""
    from deepcompile.tools.plan.network import LayoutFabric

    world = fabric(4, 8)
    nbytes = 64 * MB
    for name in ("hsdp", "hsdp_zero", "hpz"):
        f = LayoutFabric(world, name, 8)
        intra, inter = f.fabrics["intra"], f.fabrics["inter"]
        bw = intra.collective_s("all_gather", nbytes)
        assert f.collective_s("all_gather_bw", nbytes) == bw
        fw = f.collective_s("all_gather", nbytes)
        rs = f.collective_s("reduce_scatter", nbytes)
        if name == "hpz":
            assert fw == world.collective_s("all_gather", nbytes)
            assert rs == world.collective_s("reduce_scatter", nbytes)
            continue
        assert fw == bw
        across = inter.collective_s("all_reduce" if name == "hsdp" else "reduce_scatter",
                                    nbytes // 8)
        assert rs == pytest.approx(intra.collective_s("reduce_scatter", nbytes) + across)
    hsdp, hz = (LayoutFabric(world, n, 8).collective_s("reduce_scatter", nbytes)
                for n in ("hsdp", "hsdp_zero"))
    assert hz < hsdp
