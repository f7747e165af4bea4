"""Schedules on synthetic composed graphs (tools/plan/ours*.py, peers.py): deepcompile's passes
planned by their own planners, FSDP2's and DeepSpeed's schedules, simulated."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepcompile.tools.plan import ours, ours_passes, peers
from deepcompile.tools.plan.compose import Graph, Grad, Model, Node, Param, Use
from deepcompile.tools.plan.network import Fabric
from deepcompile.tools.plan.schedule import Setting
from deepcompile.tools.plan.simulate import simulate

MS = 1e-3
NUMEL = 8_000_000          # 16 MB in bf16: ~39 us on the wire at 8 ranks of 360 GB/s + latency


def synthetic(layers: int = 4, node_s: float = 0.2 * MS, act: int = 4 << 20) -> Model:
    """Embedding (block 0), `layers` layers of two nodes and one parameter, head (L + 1); each
    layer's forward adds `act` bytes of activations, its backward frees them."""
    params = [Param(0, "embed.weight", NUMEL, 0)]
    params += [Param(1 + i, f"model.layers.{i}.w", NUMEL, 1 + i) for i in range(layers)]
    params += [Param(layers + 1, "head.weight", NUMEL, layers + 1)]
    fw_nodes, fw_uses = [], []
    for b in range(layers + 2):
        for k in range(2):
            i = len(fw_nodes)
            fw_nodes.append(Node(f"F{b}.n{k}", b, node_s, 2.0 * node_s * 1e14, 1,
                                 act * (i + 1) // 2))
        fw_uses.append(Use(b, 2 * b, 2 * b + 1))
    bw_nodes, bw_uses, grads = [], [], []
    top = fw_nodes[-1].live
    for b in reversed(range(layers + 2)):
        for k in range(2):
            i = len(bw_nodes)
            bw_nodes.append(Node(f"B{b}.n{k}", b, 2 * node_s, 4.0 * node_s * 1e14, 1,
                                 max(top - act * (i + 1) // 2, 0)))
        bw_uses.append(Use(b, len(bw_nodes) - 2, len(bw_nodes) - 1))
        grads.append(Grad(b, len(bw_nodes) - 1, NUMEL * 2))
    fw = Graph("fw", fw_nodes, fw_uses, [])
    bw = Graph("bw", bw_nodes, sorted(bw_uses, key=lambda u: u.first), grads)
    return Model("synthetic", layers, 1, 128, torch.bfloat16, False, params, fw, bw, 0)


def setting(model, gas=1, budget=float("inf"), world=8, launch=0.0) -> Setting:
    net = Fabric(1, world, nvlink_bw=450e9, nic_bw=50e9, pcie_bw=55e9, launch_host_s=launch)
    return Setting(model, world, net, budget, gas, mem_bw=2.68e12, kernel_host_s=0.0,
                   eager_op_host_s=0.0, optimizer_s=1 * MS)


def run(s, passes):
    sch = ours.schedule(s, passes, "x", "")
    return sch, simulate(sch.events)


def test_insertion_only_is_every_collective_exposed():
    m = synthetic()
    s = setting(m, gas=2)
    sch, r = run(s, ())
    n = len(m.params)
    # a gather per parameter per graph, a reduce per gradient, every micro-step
    assert sch.collectives["all_gather"]["count"] == 2 * 2 * n
    assert sch.collectives["reduce_scatter"]["count"] == 2 * n
    ag = s.cost.collective_s("all_gather", s.gather_bytes(m.params[0]))
    rs = s.cost.collective_s("reduce_scatter", s.padded(m.params[0]) * 2)
    compute = 2 * (m.fw.compute_s() + m.bw.compute_s())
    want = compute + 2 * (2 * n * ag + n * rs) + 1 * MS
    assert r.step_s == pytest.approx(want, rel=1e-9)
    assert r.exposed_comm_s == pytest.approx(want - compute - 1 * MS, rel=1e-9)


def test_prefetch_and_buckets_hide_communication():
    m = synthetic()
    s = setting(m)
    _, r0 = run(s, ())
    sch1, r1 = run(s, ("prefetch",))
    sch2, r2 = run(s, ("prefetch", "bucket_reduce"))
    assert r1.exposed_comm_s < r0.exposed_comm_s
    assert r2.exposed_comm_s < r1.exposed_comm_s
    assert r2.step_s < r1.step_s < r0.step_s
    d = sch1.decisions["prefetch"]["fw"]
    assert d["gathers"] == len(m.params) and d["hidden_s"] > 0
    # no more hidden than there is to hide: a node here (0.2 ms) is longer than a gather, and
    # a start moved over it hides the gather, not the node ("x of y ms hidden", x <= y)
    for d in (*sch2.decisions["prefetch"].values(), sch2.decisions["bucket_reduce"]):
        assert 0 < d["hidden_s"] <= d["predicted_s"], d
    # every reduce still happens, in buckets
    assert sum(1 for e in sch2.events if e.kind == "start" and e.label == "reduce_scatter") \
        == sch2.collectives["reduce_scatter"]["count"] <= len(m.params)


def test_prefetch_respects_the_memory_budget():
    m = synthetic()
    loose = setting(m)
    _, r_loose = run(loose, ("prefetch",))
    _, r0 = run(loose, ())
    budget = r0.peak_bytes + s_gather(loose) // 2   # no room for a second parameter early
    tight = setting(m, budget=budget)
    sch, r = run(tight, ("prefetch",))
    assert r.peak_bytes <= budget < r_loose.peak_bytes
    # below the insertion-only peak the budget is unattainable: nothing is moved
    pl = ours_passes.plan(loose, ())
    low = min(max(it.live for it in pl.items(k)) for k in ("fw", "bw")) - 1
    sch, r = run(setting(m, budget=low), ("prefetch",))
    assert sch.decisions["prefetch"]["fw"]["unattainable"]
    assert sch.decisions["prefetch"]["bw"]["unattainable"]
    assert r.step_s == pytest.approx(r0.step_s)


def s_gather(s):
    return s.gather_bytes(s.model.params[0])


def test_selective_unshard_keeps_within_capacity_and_saves_with_accumulation():
    m = synthetic(node_s=0.01 * MS)   # communication-bound: keeping saves time
    passes = ("prefetch", "bucket_reduce")
    for gas in (1, 4):
        s = setting(m, gas=gas)
        _, base = run(s, passes)
        room = 3 * m.params[0].numel * 2     # three parameters' worth
        s_b = setting(m, gas=gas, budget=base.peak_bytes + room)
        sch, r = run(s_b, passes + ("selective_unshard",))
        d = sch.decisions["selective_unshard"]
        assert d["kept_bytes"] + d["accumulator_bytes"] <= room
        assert d["kept"] >= 1
        assert r.peak_bytes <= s_b.budget
        ag = sch.collectives["all_gather"]["count"]
        assert ag == d["per_step"]["all_gather"]["after"]["count"]
        if gas == 4:   # gathers saved on every micro-step, refreshed once
            assert r.step_s < base.step_s
            # bytes: kept parameters leave fused groups (the group count may stay)
            before = run(s, passes)[0].collectives["all_gather"]["bytes"]
            assert sch.collectives["all_gather"]["bytes"] < before


def test_offload_when_the_state_does_not_fit():
    m = synthetic(act=16 << 20)
    s = setting(m)
    _, r0 = run(s, ())
    adam = sum(s.shard_numel(p) for p in m.params) * 8
    budget = r0.peak_bytes - adam // 4            # a quarter of Adam's state too much
    passes = ("prefetch", "bucket_reduce", "offload_optimizer")
    sch, r = run(setting(m, budget=budget), passes)
    d = sch.decisions["offload_optimizer"]
    # whole chunks move (the runtime's flat layout: >= 64 MiB of masters per chunk; this
    # model's state is one chunk)
    assert not d["unattainable"] and adam // 4 <= d["offloaded_bytes"] <= adam
    # the profiler's memory model: live bytes after each node within the budget (while a node
    # runs, the parameters it frees are still there: the simulated peak may be above)
    assert max(e.live for e in sch.events) <= budget < r0.peak_bytes
    copies = {e.lane for e in sch.events if e.kind == "start" and e.label == "offload"}
    assert copies == {"h2d", "d2h"}   # reloaded in a backward, back to the host after the step
    # the passes before it planned with the state off the device (the runtime's provisional
    # offload): they did move gathers although the state-on curve is over the budget
    assert sch.decisions["prefetch"]["fw"]["groups"] > 0
    # nothing fits: all movable state is not enough
    sch, _ = run(setting(m, budget=r0.peak_bytes - 2 * adam), ("offload_optimizer",))
    assert sch.decisions["offload_optimizer"]["unattainable"]


def test_streamed_state_is_not_on_the_device_at_once():
    """World size 1, a budget no graph can reload in: the offloaded chunks stream through the
    optimizer step (runtime/offload/ `run_step`: two on the device at a time). The simulated
    step holds what is resident plus the staging, not all the state (it held all of it, and a
    plan that fits was reported as not fitting), and waits for the copies in."""
    m = synthetic(layers=6)
    s = setting(m, world=1)
    _, r0 = run(s, ())
    adam = sum(s.shard_numel(p) for p in m.params) * 8
    budget = r0.peak_bytes - adam // 4
    sch, r = run(setting(m, world=1, budget=budget), ("offload_optimizer",))
    d = sch.decisions["offload_optimizer"]
    assert not d["unattainable"] and d["offloaded_bytes"] >= adam // 4
    assert d["predicted_copy_s"] == 0 and d["predicted_streamed_s"] > 0   # nothing reloaded
    assert r.peak_bytes <= budget < r0.peak_bytes
    assert r0.peak_bytes - r.peak_bytes < d["offloaded_bytes"]            # the staging stays
    streamed = [e for e in sch.events if e.name == "stream state"]
    assert len(streamed) == 1
    assert streamed[0].dur == pytest.approx(s.cost.copy_s(d["offloaded_bytes"]))
    assert r.step_s == pytest.approx(r0.step_s + streamed[0].dur, rel=0.05)


def test_chunks_step_on_the_host_where_that_is_faster_or_only_it_fits():
    """Offload tier 4 ([Note: the host step] in offload/host_step.py) as the planner plans it with
    the pass's `plan_step`: at the host's assumed rate (`net.host_step_ns`) against streaming;
    a hosted chunk stages nothing on the device, the device's optimizer step covers the rest,
    and the host's step is host time before its copies' way up."""
    m = synthetic(layers=6, act=16 << 20)

    def at(ns, budget=float("inf")):
        s = setting(m, world=1, budget=budget)
        s.cost.host_step_ns = ns
        sch, r = run(s, ("offload_optimizer",))
        return s, sch, r, sch.decisions["offload_optimizer"]

    _, _, _, streamed_only = at(0.0)            # no host step: tiers 1-3
    _, _, _, fast = at(0.01)
    assert fast["lowest_peak_bytes"] < streamed_only["lowest_peak_bytes"]
    # below what streaming reaches, only the host step fits
    s, sch, r, d = at(0.01, fast["lowest_peak_bytes"])
    assert not d["unattainable"] and d["host_step"]["why"] == "only the host step fits"
    assert d["stepped_on_host"] > 0 and r.peak_bytes <= fast["lowest_peak_bytes"]
    [host] = [e for e in sch.events if e.name == "host step"]
    elems = sum(s.shard_numel(p) for p in m.params)
    hosted = sum(n for n, _ in ours_passes.plan(s, ("offload_optimizer",)).hosted.values())
    assert hosted == elems   # every chunk here
    # on the host: Adam's moments, the fp32 gradient and master, the bf16 copy's staging
    assert d["host_bytes"] == elems * (8 + 4 + 4 + 2)
    assert host.host_s == pytest.approx(elems * 0.01e-9)
    [opt] = [e for e in sch.events if e.name == "optimizer step"]
    assert opt.dur == pytest.approx(0.0)
    assert not [e for e in sch.events if e.name == "stream state"]
    # where streaming fits too, the faster one
    budget = streamed_only["lowest_peak_bytes"]
    _, _, r_fast, d_fast = at(0.01, budget)
    _, sch_slow, r_slow, d_slow = at(100.0, budget)
    _, _, r_stream, _ = at(0.0, budget)
    assert d_fast["host_step"]["chosen"] and d_fast["host_step"]["why"] == "faster"
    assert not d_slow["host_step"]["chosen"] and d_slow["host_step"]["why"] == "slower"
    assert d_slow["stepped_on_host"] == 0 and r_slow.step_s == pytest.approx(r_stream.step_s)
    assert r_fast.step_s < r_stream.step_s


def test_fsdp2_gathers_a_unit_one_ahead_and_reduces_per_layer():
    m = synthetic()
    s = setting(m)
    sch = peers.fsdp2(s, peers.PeerCosts(fsdp_hook_s=0.0), compiled=True, name="fsdp2",
                      description="")
    r = simulate(sch.events)
    # forward: the root (embedding + head) and each layer; backward: each layer (the root
    # stays gathered); reduce-scatters: each layer, then the root
    assert sch.collectives["all_gather"]["count"] == 1 + m.layers + m.layers
    assert sch.collectives["reduce_scatter"]["count"] == m.layers + 1
    _, insertion = run(s, ())
    assert r.exposed_comm_s < insertion.exposed_comm_s
    # the root stays gathered; at most two layers and one reduce-scatter's buffers besides
    per_param = s.gather_bytes(m.params[0])
    assert insertion.peak_bytes < r.peak_bytes <= insertion.peak_bytes + 5 * per_param


def test_deepspeed_keeps_small_parameters_and_prefetches_within_its_bucket():
    m = synthetic()
    small = Model(m.name, m.layers, m.batch, m.seq, m.dtype, m.ac,
                  [Param(p.pid, p.name, 50_000 if p.pid == 1 else p.numel, p.block)
                   for p in m.params], m.fw, m.bw, 0)
    s = setting(small)
    sch = peers.deepspeed(s, peers.PeerCosts(ds_hook_s=0.0), name="ds", description="")
    assert sch.decisions["persistent_params"] == 1
    # every other parameter is gathered per module in the forward and the backward
    assert sch.collectives["all_gather"]["count"] == (len(m.params) - 1) * 2
    r = simulate(sch.events)
    _, insertion = run(setting(small), ())
    assert r.exposed_comm_s < insertion.exposed_comm_s
    # host hooks make a host-bound step slower
    slow = peers.deepspeed(s, peers.PeerCosts(ds_hook_s=5 * MS), name="ds", description="")
    assert simulate(slow.events).step_s > r.step_s


def test_zero1_and_zero2():
    m = synthetic()
    for stage in (1, 2):
        s = Setting(m, 8, setting(m).cost, float("inf"), 4, 2.68e12, 0.0, 0.0,
                    optimizer_s=1 * MS, stage=stage)
        sch, r = run(s, ("bucket_reduce",))
        rs = sch.collectives["reduce_scatter"]["count"]
        assert "all_gather" in sch.collectives   # the replicas' refresh after the step
        if stage == 1:   # reduced once, on the last micro-step
            assert rs <= len(m.params)
        else:            # every micro-step
            assert rs >= 4 and rs % 4 == 0


def test_replaying_a_runs_decisions_reproduces_them():
    """Validation replays a run's groups and buckets (by parameter name) through the planners'
    own placement: a plan replayed from itself is the same plan."""
    import dataclasses

    m = synthetic(node_s=0.02 * MS)
    s = setting(m, gas=2)
    passes = ("prefetch", "bucket_reduce", "selective_unshard")
    pl = ours_passes.plan(s, passes)
    name = {p.pid: p.name for p in m.params}
    replay = {"prefetch": {k: [[name[p] for p in g.pids] for g in pl.groups[k]]
                           for k in ("fw", "bw")},
              "bucket_reduce": [[name[p] for p in b.pids] for b in pl.buckets],
              "selective_unshard": {"keep": [name[p] for p in pl.kept],
                                    "accumulate": [name[p] for p in pl.accumulated]}}
    again = ours_passes.plan(dataclasses.replace(s, replay=replay), passes)
    for k in ("fw", "bw"):
        assert [g.pids for g in again.groups[k]] == [g.pids for g in pl.groups[k]]
    assert [b.pids for b in again.buckets] == [b.pids for b in pl.buckets]
    assert again.kept == pl.kept and again.accumulated == pl.accumulated
    r1 = simulate(ours.schedule(s, passes, "x", "").events)
    r2 = simulate(ours.schedule(dataclasses.replace(s, replay=replay), passes, "x", "").events)
    assert r2.step_s == pytest.approx(r1.step_s, rel=0.05)
    # a replayed grouping the planner would not choose: every gather alone
    alone = {"prefetch": {k: [[p.name] for p in m.params] for k in ("fw", "bw")}}
    pl1 = ours_passes.plan(dataclasses.replace(s, replay=alone), ("prefetch",))
    assert all(len(g.pids) == 1 for k in ("fw", "bw") for g in pl1.groups[k])


def test_world_size_one_communicates_nothing_and_casts():
    """The lowered runtime at one rank: a gather is the shard or its cast (bf16 here), a
    reduction the gradient's cast; the collective passes plan nothing."""
    m = synthetic()
    s = setting(m, world=1)
    sch, r = run(s, ("prefetch", "bucket_reduce", "selective_unshard"))
    assert sch.collectives == {}
    assert r.comm_s == 0 and r.exposed_comm_s == 0
    assert all(d == {"skipped": "world size 1: nothing is communicated"}
               for d in sch.decisions.values())
    casts = [e for e in sch.events if e.name.startswith("cast.")]
    assert len(casts) == 2 * len(m.params) + len(m.params)   # fw + bw gathers, reductions
    compute = m.fw.compute_s() + m.bw.compute_s()
    assert r.step_s == pytest.approx(compute + sum(e.dur for e in casts) + 1 * MS, rel=1e-9)


def test_auto_chooses_as_the_runtime_does():
    from deepcompile.tools.plan.plan import resolve_auto

    m = synthetic()
    chosen, out = ours_passes.auto_choice(setting(m))
    assert chosen == ["selective_unshard", "prefetch", "bucket_reduce"]
    assert "offload_optimizer" in out
    # world size 1: a gather casts each bf16 use of an fp32 master, so a kept copy pays (the
    # runtime's rule); in fp32 a gather is a view and nothing is chosen
    assert ours_passes.auto_choice(setting(m, world=1))[0] == ["selective_unshard"]
    fp32 = dataclasses.replace(m, dtype=torch.float32)
    assert ours_passes.auto_choice(setting(fp32, world=1))[0] == []
    base = simulate(ours.schedule(setting(m), (), "x", "").events)
    tight = setting(m, budget=base.peak_bytes - 1)   # the step over the budget: offload first
    assert ours_passes.auto_choice(tight)[0][0] == "offload_optimizer"
    kept, d = resolve_auto(setting(m, gas=4), float("inf"), False)
    assert set(d["verdicts"]) == set(d["chosen"]) and list(kept) == d["passes"]
    assert all(v.startswith(("kept", "reverted")) for v in d["verdicts"].values())


def test_bucket_reduce_buckets_accumulated_gradients_on_the_last_micro_step():
    """auto's order: selective_unshard first accumulates gradients locally (accumulate_grad
    nodes); bucket_reduce puts them in buckets of their own, launched on the window's last
    micro-step only (as the runtime's `accumulate_start`): one reduce-scatter per bucket per
    optimizer step, not one per parameter."""
    m = synthetic(node_s=0.01 * MS)
    unbucketed, _ = run(setting(m, gas=4), ("selective_unshard", "prefetch"))
    sch, _ = run(setting(m, gas=4), ("selective_unshard", "prefetch", "bucket_reduce"))
    d = sch.decisions["selective_unshard"]
    assert d["accumulated"] == len(m.params)
    b = sch.decisions["bucket_reduce"]
    assert b["reduces"] == len(m.params) and 0 < b["buckets"] < len(m.params)
    assert unbucketed.collectives["reduce_scatter"]["count"] == len(m.params)
    assert sch.collectives["reduce_scatter"] == {
        "count": b["buckets"], "bytes": unbucketed.collectives["reduce_scatter"]["bytes"]}
    # launched once per optimizer step (the last micro-step), not once per backward
    starts = [e for e in sch.events if e.kind == "start" and e.label == "reduce_scatter"]
    assert len(starts) == b["buckets"]


def test_selective_unshard_after_bucket_reduce_keeps_whole_buckets():
    """The canonical order (bucket_reduce before selective_unshard), everything accumulated:
    each bucket stays one reduce-scatter on the last micro-step (the runtime retargets it to
    `accumulate_start`), as selective_unshard predicts."""
    m = synthetic(node_s=0.01 * MS)
    sch, _ = run(setting(m, gas=4), ("prefetch", "bucket_reduce", "selective_unshard"))
    d = sch.decisions
    assert d["selective_unshard"]["accumulated"] == len(m.params)
    buckets = d["bucket_reduce"]["buckets"]
    assert 0 < buckets < len(m.params)
    assert sch.collectives["reduce_scatter"]["count"] == buckets
    assert d["selective_unshard"]["per_step"]["reduce_scatter"]["after"]["count"] == buckets


def test_selective_unshard_takes_accumulated_members_out_of_buckets_together():
    """bucket_reduce before selective_unshard under budgets that accumulate a part: in every
    bucket the accumulated members (two or more) become one bucket of their own, launched on
    the last micro-step, one alone is reduced by itself, the others stay together (as the
    runtime's rewrite); the schedule launches what selective_unshard predicts."""
    m = synthetic(layers=8, node_s=0.01 * MS)
    passes = ("prefetch", "bucket_reduce", "selective_unshard")
    s0 = setting(m, gas=4)
    _, lo = run(s0, passes[:2])
    _, hi = run(s0, passes)
    before = ours_passes.plan(s0, passes[:2]).buckets
    together = 0
    for frac in (0.5, 0.6, 0.7, 0.8, 0.9):
        s = setting(m, gas=4, budget=lo.peak_bytes + frac * (hi.peak_bytes - lo.peak_bytes))
        pl = ours_passes.plan(s, passes)
        acc = pl.accumulated
        if not 0 < len(acc) < len(m.params):
            continue
        expect = []
        for b in before:
            a = [p for p in b.pids if p in acc]
            rest = [p for p in b.pids if p not in acc]
            expect += ([(a, True)] if len(a) > 1 else []) + ([(rest, False)] if rest else [])
            together += len(a) > 1 and bool(rest)
        assert sorted((b.pids, b.accumulated) for b in pl.buckets) == sorted(expect)
        sch, _ = run(s, passes)
        d = sch.decisions["selective_unshard"]
        assert sch.collectives["reduce_scatter"]["count"] == \
            d["per_step"]["reduce_scatter"]["after"]["count"]
    assert together, "no budget split a bucket: the test did not test the split"


def test_copies_to_and_from_the_host_run_in_both_directions_at_once():
    """The runtime copies on two streams, one per direction (PCIe is full duplex): the copy out
    of the state that came back in the last step overlaps this step's reloads. On a slow host
    link (the copy out outlasts the forward) the schedule is shorter than the same events on
    one lane, where the reloads wait for the copy out."""
    import dataclasses

    m = synthetic(act=16 << 20)
    s0 = setting(m)
    _, r0 = run(s0, ())
    adam = sum(s0.shard_numel(p) for p in m.params) * 8
    slow = Fabric(1, 8, nvlink_bw=450e9, nic_bw=50e9, pcie_bw=2e9, launch_host_s=0.0)
    s = dataclasses.replace(s0, cost=slow, budget=r0.peak_bytes - adam // 4)
    sch, two = run(s, ("offload_optimizer",))
    assert any(e.name == "reload state" for e in sch.events), "nothing reloaded in a backward"
    one = simulate([dataclasses.replace(e, lane="copy") if e.lane in ("h2d", "d2h") else e
                    for e in sch.events])
    (out,) = [x for x in two.segments if x.lane == "d2h"]
    first_in = min(x.t0 for x in two.segments if x.lane == "h2d")
    assert first_in < out.t1                 # a reload started while the copy out ran
    assert two.step_s < one.step_s


@pytest.mark.parametrize("world,layers,passes", [
    (1, 6, ("offload_optimizer",)),
    # more than the step's staging (LOOKAHEAD + 1 chunks), or gradients off save nothing there
    (2, 14, ("offload_optimizer", "prefetch", "bucket_reduce"))])   # auto's order
@pytest.mark.parametrize("gas", [1, 2])
def test_gradients_go_to_the_host_when_all_state_off_is_not_enough(gas, world, layers, passes):
    """Tier 2 in the planner, planned by offload_optimizer.plan_step as the runtime plans it:
    below the peak with all optimizer state off the device, chunks' gradients leave the device
    once the backward completes them (a copy out per chunk on the "d2h" lane; a later
    micro-step's gradient comes back to be added to); the step streams state and gradient in.
    The simulated curve stays within the budget it was planned for."""
    m = synthetic(layers=layers)
    probe, _ = run(setting(m, world=world, gas=gas, budget=1), passes)
    d0 = probe.decisions["offload_optimizer"]
    assert d0["unattainable"]      # 1 byte: not even all of it is enough
    # tier 2 alone: between all state off and all state and gradients off (below that, the
    # masters would go too)
    lo, hi = d0["lowest_grads_peak_bytes"], d0["lowest_state_peak_bytes"]
    assert d0["lowest_peak_bytes"] <= lo < hi
    budget = (lo + hi) // 2
    sch, r = run(setting(m, world=world, gas=gas, budget=budget), passes)
    d = sch.decisions["offload_optimizer"]
    assert not d["unattainable"] and d["offloaded_bytes"] == d["state_bytes"]
    grads = d["offloaded_grad_bytes"]
    assert 0 < grads < sum(m.params[i].numel for i in range(len(m.params))) * 4
    assert max(e.live for e in sch.events) <= budget < hi
    assert d["peak_after"] <= budget
    tier2 = ours_passes.plan(setting(m, world=world, gas=gas, budget=budget),
                      passes).grads_off
    assert sum(g.nbytes for g in tier2) == grads
    starts = [e for e in sch.events if e.kind == "start"]
    out = [e for e in starts if e.name.startswith("grads to host")]
    back = [e for e in starts if e.name.startswith("grads back")]
    assert len(out) == gas * len(tier2) and {e.lane for e in out} == {"d2h"}
    assert len(back) == (gas - 1) * len(tier2) and {e.lane for e in back} <= {"h2d"}
    cost = setting(m).cost
    assert sum(e.dur for e in out) == pytest.approx(gas * sum(cost.copy_s(g.nbytes) for g in tier2))
    stream = next(e for e in sch.events if e.name == "stream state")
    assert stream.dur == pytest.approx(cost.copy_s(d["state_bytes"] + grads))
    # the step waits for every copy out and the stream in (the simulated step is no shorter)
    assert r.step_s >= max(sum(e.dur for e in out), stream.dur)
    # below all state, all gradients and the masters that help off: unattainable, and it says
    # why
    sch, _ = run(setting(m, world=world, gas=gas, budget=d0["lowest_peak_bytes"] - 1), passes)
    assert "all gradients" in sch.decisions["offload_optimizer"]["reason"]


@pytest.mark.parametrize("gas", [1, 2])
def test_tier2_gradients_stay_on_the_device_until_their_copies_end(gas):
    """The simulated curve counts each tier-2 gradient until its copy out ends, the copies one
    after another (`Plan._tier2_moves`, as `offload_optimizer._all_state_off` plans them; a
    later micro-step's is the sum, back from the host): over a slow host link the graphs hold
    more than over a fast one, and still no more than the plan's own peak."""
    m = synthetic(layers=6)
    peaks = {}
    for pcie in (55e9, 0.5e9):
        def at(budget):
            s = setting(m, gas=gas, world=1, budget=budget)
            return dataclasses.replace(s, cost=dataclasses.replace(s.cost, pcie_bw=pcie))
        d0 = run(at(1), ("offload_optimizer",))[0].decisions["offload_optimizer"]
        budget = (d0["lowest_grads_peak_bytes"] + d0["lowest_state_peak_bytes"]) // 2
        sch, _ = run(at(budget), ("offload_optimizer",))
        d = sch.decisions["offload_optimizer"]
        assert not d["unattainable"] and d["offloaded_grad_bytes"] > 0, d
        graphs = [e for e in sch.events if e.kind == "compute" and e.name != "optimizer step"]
        peaks[pcie] = max(max(e.live, e.peak or 0) for e in graphs)
        assert peaks[pcie] <= d["peak_after"] <= budget
    assert peaks[0.5e9] > peaks[55e9], peaks


@pytest.mark.parametrize("system", ["ours", "fsdp2"])
def test_gradient_shards_exist_from_their_reduction_to_the_step(system):
    """[Note: gradient lifetime] in tools/plan/ours_model.py: zero_grad sets the shard gradients
    to None after each step (ours and FSDP2), so the first micro-step's forward holds none of
    them and its backward gains each where it is reduced; the second micro-step and the step
    hold all."""
    m = synthetic()
    s = setting(m, gas=2)
    grads = sum(4 * s.shard_numel(p) for p in m.params)
    if system == "ours":
        sch = ours.schedule(s, (), "x", "")
    else:
        sch = peers.fsdp2(s, peers.PeerCosts(fsdp_hook_s=0.0), compiled=True, name="fsdp2",
                          description="")
    computes = [e for e in sch.events if e.kind == "compute" and e.name != "optimizer step"]
    per_micro = len(computes) // 2
    first, second = computes[:per_micro], computes[per_micro:]
    fw0 = next(e for e in first if e.name.startswith("F"))
    fw1 = next(e for e in second if e.name.startswith("F"))
    assert fw1.live - fw0.live == grads            # same activations, all gradients now
    step = next(e for e in sch.events if e.name == "optimizer step")
    assert step.live == s.persistent_bytes() + m.base_bytes
    # the first backward starts without the gradients the second one starts with
    bw0 = next(e for e in first if e.name.startswith("B"))
    bw1 = next(e for e in second if e.name.startswith("B"))
    assert bw1.live - bw0.live == grads


@pytest.mark.parametrize("world", [1, 8])
def test_schedules_with_asynchronous_collectives_take_their_own_framework_time(world):
    """[Note: the framework's time with async collectives] (benchmarks/validation/
    host_profile.py): where the framework's time per micro-step was measured apart with
    asynchronous collectives (CPU ranks), a schedule with prefetch or bucket_reduce takes that figure, one without them the
    other; at one rank nothing is asynchronous and every schedule takes the first."""
    m = synthetic()
    gas = 2
    # a CPU rank's: the framework's time is on the one thread that computes
    plain = dataclasses.replace(setting(m, gas=gas, world=world), framework_s=1 * MS,
                                host_is_compute=True)
    both = dataclasses.replace(plain, framework_async_s=3 * MS)
    for passes, asynchronous in (((), False), (("prefetch",), True), (("bucket_reduce",), True),
                                 (("selective_unshard",), False),
                                 (("selective_unshard", "prefetch", "bucket_reduce"), True)):
        a = simulate(ours.schedule(plain, passes, "x", "").events, host_is_compute=True)
        b = simulate(ours.schedule(both, passes, "x", "").events, host_is_compute=True)
        extra = 2 * MS * gas if asynchronous and world > 1 else 0.0
        assert b.step_s - a.step_s == pytest.approx(extra, abs=1e-9), (passes, world)
