"""`activation_budget` in the planner (tools/plan/ours_activations.py): its decisions on composed
graphs, what they do to the plan's memory and time, and the built-in shapes on 8 H100s."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from deepcompile.tools.plan import compose, ours, ours_passes, pieces, roofline  # noqa: E402
from deepcompile.tools.plan import shapes, trace  # noqa: E402
from deepcompile.tools.plan import plan as P  # noqa: E402
from deepcompile.tools.plan.network import Fabric  # noqa: E402
from deepcompile.tools.plan.roofline import NodeCost  # noqa: E402
from deepcompile.tools.plan.schedule import Setting  # noqa: E402
from deepcompile.tools.plan.simulate import simulate  # noqa: E402

ACTS = ("activation_budget",)
NODE_S = 1e-5


@pytest.fixture(scope="module")
def tiny() -> compose.Model:
    """tiny-llama with two layers, bf16, traced on fake tensors; every node 10 us."""
    s = shapes.load("tiny-llama")
    shape = shapes.ModelShape(s.name, s.arch, dict(s.config, num_hidden_layers=2))
    ps = pieces.build(shape, batch=2, seq=64, dtype=torch.bfloat16, fake=True)
    graphs = trace.trace_all(ps)

    def times(piece, phase):
        gm = getattr(graphs[piece], phase)
        return {n.name: NodeCost(NODE_S, roofline.flops(n)[1], 1)
                for n in gm.graph.nodes if n.op == "call_function"}

    return compose.compose(graphs, 2, times, name="tiny", batch=2, seq=64, dtype=torch.bfloat16)


def setting(model, budget, gas=1, **fabric) -> Setting:
    net = Fabric(1, 8, **{"nvlink_bw": 450e9, "nic_bw": 50e9, "pcie_bw": 55e9, **fabric})
    return Setting(model, 8, net, budget, gas, mem_bw=2.68e12, kernel_host_s=0.0,
                   eager_op_host_s=0.0, optimizer_s=1e-3)


def tight(model, fraction=0.8) -> float:
    """A budget `fraction` of the way from the persistent state to the insertion-only peak."""
    base = ours_passes.plan(setting(model, float("inf")), ())
    return base.persistent() + fraction * (base.peak() - base.persistent())


def test_unbounded_or_ample_memory_moves_nothing(tiny):
    assert ours_passes.plan(setting(tiny, float("inf")), ACTS).decisions[
        "activation_budget"]["skipped"].startswith("memory budget unbounded")
    peak = ours_passes.plan(setting(tiny, float("inf")), ()).peak()
    pl = ours_passes.plan(setting(tiny, peak), ACTS)
    d = pl.decisions["activation_budget"]
    assert pl.acts == [] and d["recomputed"] == d["offloaded"] == 0 and d["peak_before"] == peak
    a = simulate(ours.schedule(setting(tiny, peak), (), "x", "").events)
    b = simulate(ours.schedule(setting(tiny, peak), ACTS, "x", "").events)
    assert (a.step_s, a.peak_bytes) == (b.step_s, b.peak_bytes)


def test_a_tight_budget_moves_saved_values_and_the_curve_shows_each(tiny):
    budget = tight(tiny)
    base = ours_passes.plan(setting(tiny, float("inf")), ())
    pl = ours_passes.plan(setting(tiny, budget), ACTS)
    d = pl.decisions["activation_budget"]
    assert pl.acts and d["recomputed"] + d["offloaded"] == len(pl.acts)
    assert not d["unattainable"] and pl.peak() <= budget < base.peak()
    moved = sum(a.nbytes for a in pl.acts)
    assert d["recomputed_bytes"] + d["offloaded_bytes"] == moved
    # the end of the forward holds the moved values no more; the backward ends as without
    # the pass (every value freed after its last reader)
    assert base.items("fw")[-1].live - pl.items("fw")[-1].live == moved
    assert base.items("bw")[-1].live == pl.items("bw")[-1].live
    fw, bw = pl.items("fw"), pl.items("bw")
    names = [it.name for it in bw]
    for a in pl.acts:
        first = next(j for j, it in enumerate(bw) if it.kind == "compute" and it.ref == a.first)
        if a.action == "recompute":   # its nodes' time, right before its first reader
            j = names.index(f"recompute.{a.name}")
            assert bw[j].dur == a.time_s and j < first
            assert all(it.kind != "compute" for it in bw[j + 1:first])
            continue
        out = next(j for j, it in enumerate(fw) if it.name == f"offload.{a.name}")
        assert fw[out - 1].kind == "compute" and fw[out - 1].ref == a.fw_free
        back, wait = names.index(f"reload.{a.name}"), names.index(f"reload.{a.name}.wait")
        assert back < wait < first and bw[back].nbytes == a.nbytes
        assert a.reload == -1 or bw[back - 1].ref == a.reload
    # the recomputes run on the compute lane, in every micro-step: the simulated compute grows
    # by their time
    for gas in (1, 2):
        pg = ours_passes.plan(setting(tiny, budget, gas), ACTS)
        a = simulate(ours.schedule(setting(tiny, budget, gas), (), "x", "").events)
        b = simulate(ours.schedule(setting(tiny, budget, gas), ACTS, "x", "").events)
        rec = pg.decisions["activation_budget"]["recompute_s"]
        assert rec > 0
        assert b.compute_s - a.compute_s == pytest.approx(gas * rec, rel=1e-9, abs=1e-12)
        assert b.peak_bytes == pg.peak()


def test_auto_chooses_it_and_the_planner_models_it(tiny):
    chosen, left = ours_passes.auto_choice(setting(tiny, tight(tiny)))
    assert "activation_budget" in chosen
    assert not any("not modelled" in why for why in left.values())


# -- built-in shapes: Llama-3-8B on 8 H100s ---------------------------------------------------
# The two Llama-3-8B figures are the full suite's ([Note: the core matrix] in tests/_train.py):
# the default run plans the pass on the tiny Llama above (a budget it meets by moving saved
# values, ample memory that moves nothing) and plans built-in shapes through the command in
# tests/tools/test_plan_cli.py.
def _plan(**kw):
    args = P.PlanArgs(model="llama-3-8b", nodes=1, gpus_per_node=8, peers=(),
                      assume={"net.host_step_ns": 2.0}, **kw)
    return P.make_plan(args)


def test_within_the_budget_it_frees_activations_for_parameters_kept_gathered(tiny):
    """[Note: a memory trade] as the planner models it: named before selective_unshard, with
    the peak within the budget and no room left, the activations it moves pay for parameters
    kept gathered (none without them), by the runtime's rule; the plan stays within the budget;
    with room for every parameter it trades nothing; with no room, `auto` chooses it for
    prefetch."""
    peak = ours_passes.plan(setting(tiny, float("inf")), ()).peak()
    pair = ("activation_budget", "selective_unshard")
    alone = ours_passes.plan(setting(tiny, peak), ("selective_unshard",))
    pl = ours_passes.plan(setting(tiny, peak), pair)
    t = pl.decisions["activation_budget"]["trade"]
    assert alone.decisions["selective_unshard"]["kept"] == 0
    assert t["for"] == "selective_unshard" and t["freed_bytes"] > 0
    assert t["value_s"] >= 2 * t["added_s"] > 0 and pl.acts
    assert pl.decisions["selective_unshard"]["kept"] > 0 and pl.peak() <= peak
    ample = ours_passes.plan(setting(tiny, 2 * peak), pair)
    assert "trade" not in ample.decisions["activation_budget"] and ample.acts == []
    # `passes="auto"` chooses the pair where some room is left but not enough for every
    # parameter, and neither pass where there is none; with room for all, no trade
    gathered = sum(setting(tiny, peak).full_bytes(p) for p in tiny.params)   # gas 1
    chosen, left = ours_passes.auto_choice(setting(tiny, peak + gathered / 4))
    assert chosen[:2] == list(pair), (chosen, left)
    auto = ours_passes.plan(setting(tiny, peak + gathered / 4), tuple(chosen))
    assert auto.decisions["activation_budget"]["trade"]["freed_bytes"] > 0
    chosen, left = ours_passes.auto_choice(setting(tiny, peak + 2 * gathered))
    assert "activation_budget" not in chosen and "selective_unshard" in chosen
    assert "room for every parameter gathered" in left["activation_budget"]
    # with no room left selective_unshard is not chosen; prefetch, which then plans next, says
    # what more memory is worth to it: activation_budget is chosen for it, and the planner asks
    # prefetch's planner, which hides at the peak all that these graphs let it: no offer, no trade
    chosen, left = ours_passes.auto_choice(setting(tiny, peak))
    assert "selective_unshard" not in chosen
    assert chosen[:2] == ["activation_budget", "prefetch"], (chosen, left)
    assert ours_passes._prefetch_offers(ours_passes.plan(setting(tiny, peak), ())) == ([], peak)
    auto = ours_passes.plan(setting(tiny, peak), tuple(chosen))
    assert "trade" not in auto.decisions["activation_budget"] and auto.acts == []


def test_a_trade_that_does_not_pay_is_declined_with_what_it_tried(tiny):
    """Where the gathers a kept parameter saves are ~free (a fabric without latency, 1,000x
    faster), the activations selective_unshard would buy cost more than twice what they save:
    the planner, as the runtime's pass, moves nothing and records each target it planned
    (`declined`), and the plan's table line says so."""
    from deepcompile.tools.plan import report

    free = {"nvlink_bw": 450e12, "nvlink_hop_s": 0.0, "base_s": 0.0, "launch_host_s": 0.0}
    peak = ours_passes.plan(setting(tiny, float("inf"), **free), ()).peak()
    pair = ("activation_budget", "selective_unshard")
    pl = ours_passes.plan(setting(tiny, peak, **free), pair)
    d = pl.decisions["activation_budget"]
    assert "trade" not in d and pl.acts == [] and pl.peak() == peak
    t = d["declined"]
    assert t["for"] == "selective_unshard" and t["offers"] > 0 and t["tried"]
    assert all(p["freed_bytes"] <= 0 or p["value_s"] < 2 * p["added_s"] for p in t["tried"])
    line = report.summarize_decision("activation_budget", d)
    assert line.startswith("nothing moved") and "not traded for selective_unshard (" in line


def test_activations_are_freed_for_optimizer_state_kept_on_the_device(tiny):
    """[Note: a memory trade] with offload_optimizer as the buyer, as the runtime queues it: the
    offload plan waits for activation_budget where a lower peak would keep its state on the
    device (its copies back do not hide behind the backward). Over a slow PCIe (5.5 MB/s for
    the tiny model's 0.1 MiB of state) the activations moved pay for state kept (fewer bytes
    offloaded than the offload plan alone takes, within the budget); where the copies all but
    hide (41 MB/s) the trade is declined, activation_budget plans once more after the offload
    plan, and that plan is the offload plan alone's; where they hide, no offer, no wait."""
    order = ("offload_optimizer", "activation_budget")
    base = ours_passes.plan(setting(tiny, float("inf")), ())
    state = ours_passes.plan(setting(tiny, float("inf")), ("offload_optimizer",)).decisions[
        "offload_optimizer"]["state_bytes"]
    budget = base.peak() - state // 4
    for pcie, pays in ((5.5e6, True), (41e6, False)):
        alone = ours_passes.plan(setting(tiny, budget, pcie_bw=pcie), ("offload_optimizer",))
        pl = ours_passes.plan(setting(tiny, budget, pcie_bw=pcie), order)
        off, act = pl.decisions["offload_optimizer"], pl.decisions["activation_budget"]
        assert alone.decisions["offload_optimizer"]["offloaded_bytes"] > 0
        if pays:
            t = act["trade"]
            assert t["for"] == "offload_optimizer" and t["bought"] >= 1 and pl.acts
            assert t["value_s"] >= 2 * t["added_s"] > 0
            assert off["offloaded_bytes"] < alone.decisions["offload_optimizer"]["offloaded_bytes"]
        else:
            assert act["declined_first"]["for"] == "offload_optimizer" and pl.acts == []
            assert off == alone.decisions["offload_optimizer"]
        assert not off["unattainable"] and pl.peak() <= budget
    fast = setting(tiny, budget, pcie_bw=55e9)
    assert ours_passes._offload_offers(ours_passes.plan(fast, ()))[0] == []
    assert "declined_first" not in ours_passes.plan(fast, order).decisions["activation_budget"]


@pytest.mark.extended
def test_llama_8b_at_seq_4096_fits_with_it_and_beats_full_checkpointing():
    plan = _plan(seq=4096, batch=4, passes=[(), ACTS])
    plain, acts = plan.rows()
    budget = plan.setting["memory_budget_bytes"]
    assert plain["peak_bytes"] > 80e9 and not plain["fits"]
    assert acts["fits"] and acts["peak_bytes"] <= budget
    d = acts["decisions"]["activation_budget"]
    assert d["peak_before"] > budget >= d["peak_after"] and d["recomputed"] + d["offloaded"] > 0
    (ac,) = _plan(seq=4096, batch=4, passes=[()], ac=True).rows()
    assert ac["fits"] and acts["step_s"] <= ac["step_s"]


@pytest.mark.extended
def test_llama_8b_at_seq_1024_plans_nothing():
    plain, acts = _plan(seq=1024, batch=1, passes=[(), ACTS]).rows()
    assert acts["decisions"]["activation_budget"]["offloaded"] == 0
    assert acts["decisions"]["activation_budget"]["recomputed"] == 0
    assert (acts["step_s"], acts["peak_bytes"]) == (plain["step_s"], plain["peak_bytes"])
