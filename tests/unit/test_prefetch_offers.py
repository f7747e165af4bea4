"""Pass `prefetch`: what more memory is worth to its planner (`memory_value`, `offers`; [Note: a
memory trade] in passes/activation_budget.py).

Unit tests on synthetic profiled graphs (1 s a compute step, a gather predicted at 3 s): the
offers are the rooms at which the planner starts gathers earlier, each with the exposed gather
time it hides, most saved per byte first, without the room the budget already leaves; a first
step that pays little per byte is merged with the one after it that pays more; every run of
the first offers is a room the planner was run at, and re-planning there saves what they say;
nothing with an unbounded budget, with room for everything, or over the budget; collecting the
moves the budget stops changes no plan; activation_budget's rule trades with these offers, its
report line names what prefetch bought (or, where nothing pays, what each target would have
freed, added and bought), and `auto` frees activations for the pass that plans right after it.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

import _graphs
from deepcompile.compiler.cost import LinearCostModel
from deepcompile.passes import activation_budget as A
from deepcompile.passes import get_pass
from deepcompile.passes import prefetch as P
from deepcompile.passes.context import PassContext

INF = float("inf")
COST = LinearCostModel(coeffs={"all_gather": (3.0, 0.0)})   # every gather 3 s
BUDGET = 1000


def _graph(live: list[int], nbytes: int):
    """Compute steps c0.. of 1 s with `live` bytes, then a gather of `nbytes` (its node holds
    the bytes before it and its own buffer, as the profiler measures it)."""
    steps = [P.Step(f"c{i}", "compute", 1.0, b) for i, b in enumerate(live)]
    steps.append(P.Step("g", "all_gather", 0.0, live[-1] + nbytes))
    return steps, [P.Gather("g", len(live), nbytes, pid=0)]


# X: the gather's start stops below c2 (900 + 150 B > 1000 B), 130 B short of the peak's 980 B
# room; Y: below c2 (980 + 40 B), 20 B short. Each hides 3 s with the room, in 2 runs a step.
GRAPHS = {"x": _graph([100, 500, 900, 100], 150), "y": _graph([100, 100, 980, 100], 40)}
RUNS = {"x": 2, "y": 2}


def _plan_at(graphs):
    def plan_at(held: float, short: list[int]) -> dict:
        return {k: P.plan_graph(P.held_steps(steps, held), gs, COST, BUDGET, short=short)
                for k, (steps, gs) in graphs.items()}
    return plan_at


def _level(graphs) -> int:
    return max(s.live_bytes for steps, _ in graphs.values() for s in steps)


def test_offers_are_the_rooms_the_planner_hides_more_at_most_saved_per_byte_first():
    level = _level(GRAPHS)
    assert level == 980   # y's c2: 20 B of room under the budget
    plan_at = _plan_at(GRAPHS)
    now = plan_at(level, [])
    assert [d["groups"][0]["moved_nodes"] for d in now.values()] == [0, 0]   # both stopped
    offers = P.offers(plan_at, RUNS, level, BUDGET)
    # y needs 40 B above c2's 980, of which the budget leaves 20; x 150 above 900, 130 beyond
    # the room; each then hides its 3 s, twice a step
    assert offers == [(20, 6.0), (110, 6.0)]
    per_byte = [s / b for b, s in offers]
    assert per_byte == sorted(per_byte, reverse=True)
    # each run of the first offers is a room the planner makes what they say with
    base = P.exposed_s(now, RUNS)
    room, saved = 0, 0.0
    for b, s in offers:
        room, saved = room + b, saved + s
        assert base - P.exposed_s(plan_at(level - room, []), RUNS) == pytest.approx(saved)
        # a byte less buys the last one not
        assert base - P.exposed_s(plan_at(level - room + 1, []), RUNS) < saved


def test_what_already_fits_is_no_offer():
    # z's gather hides its 3 s in the room there is (peak 600 B): it adds nothing
    graphs = dict(GRAPHS, z=_graph([100, 100, 100, 500], 100))
    plan_at = _plan_at(graphs)
    assert plan_at(980, [])["z"]["groups"][0]["hidden_s"] == 3.0
    assert P.offers(plan_at, dict(RUNS, z=5), 980, BUDGET) == [(20, 6.0), (110, 6.0)]


def test_a_step_that_pays_little_per_byte_is_taken_with_the_next():
    # p's start needs 20 B beyond the room to pass c3 (where it runs after c2: 990 + 30 B)
    # and hides c3's 1 s (the steps above take no time); q's 30 B (970 + 40 B) and hides 3 s:
    # 20 B for 1 s, then 10 B for 3 s more: one offer, 30 B for 4 s
    graphs = {"p": _graph([100, 100, 990, 100], 30), "q": _graph([100, 100, 970, 100], 40)}
    graphs["p"][0][:3] = [P.Step(f"c{i}", "compute", 0.0, b) for i, b in enumerate([100, 100, 990])]
    plan_at = _plan_at(graphs)
    level = _level(graphs)
    assert level == 990
    assert P.offers(plan_at, {"p": 1, "q": 1}, level, BUDGET) == [(30, 4.0)]


def test_nothing_with_an_unbounded_budget_room_for_all_or_over_the_budget():
    plan_at = _plan_at(GRAPHS)
    assert P.offers(plan_at, RUNS, 980, INF) == []
    assert P.offers(plan_at, RUNS, 1100, BUDGET) == []   # over the budget: no trade

    def roomy(held, short):
        return {k: P.plan_graph(P.held_steps(steps, held), gs, COST, 10_000, short=short)
                for k, (steps, gs) in GRAPHS.items()}
    assert P.offers(roomy, RUNS, 980, 10_000) == []   # every gather hidden already
    ctx = PassContext(slots={}, profiles={}, order=[], registry=None, runtime=None, cost=COST,
                      memory_budget=INF, world_size=2, decisions={})
    assert get_pass("prefetch").memory_value is P.memory_value
    assert P.memory_value(ctx) == []


def test_collecting_the_stopped_moves_changes_no_plan():
    rng = random.Random(0)
    for _ in range(300):
        steps, gs = _graphs.random_gathers(rng, P)
        budget = max(s.live_bytes for s in steps) + rng.randint(0, 300)
        cost = LinearCostModel(coeffs={"all_gather": (rng.uniform(0.1, 3.0), 1e-4)})
        short: list[int] = []
        assert P.plan_graph(steps, gs, cost, budget, short=short) == \
            P.plan_graph(steps, gs, cost, budget)
        level = max(s.live_bytes for s in steps)
        offers = P.offers(lambda held, sh: {"g": P.plan_graph(P.held_steps(steps, held), gs, cost,
                                                               budget, short=sh)},
                          {"g": 1}, level, budget)
        per_byte = [s / b for b, s in offers]
        assert all(b > 0 and s > 0 for b, s in offers)
        assert per_byte == sorted(per_byte, reverse=True)


def test_activation_budget_trades_for_the_offers_that_pay():
    # freeing activations costs 1 ms per 10 B: y's 20 B (6 s) pay twice their 2 ms, and so do
    # x's 110 B more (6 s for 11 ms)
    offers = P.offers(_plan_at(GRAPHS), RUNS, 980, BUDGET)
    best = A.choose_trade(offers, 980, lambda target: (target, (980 - target) * 1e-4, target))
    assert best == (850, 130, 12.0, pytest.approx(0.013))
    # at 1 s per 10 B only y's pays: 20 B for 6 s, at 2 s
    best = A.choose_trade(offers, 980, lambda target: (target, (980 - target) * 0.1, target))
    assert best == (960, 20, 6.0, pytest.approx(2.0))


def test_the_report_names_what_prefetch_bought():
    offers = P.offers(_plan_at(GRAPHS), RUNS, 980, BUDGET)
    t = A.trade_record("prefetch", 20, 980, 2.0, 6.0, offers)
    assert (t["for"], t["offers"], t["bought"]) == ("prefetch", 2, 1)
    (line,) = A.summary({"trade": t})
    assert line == ("traded: freed 20 B below the peak 980 B for prefetch (gathers started "
                    "earlier: 1 of its 2 offers): +2000.00 ms a step predicted, for 6000.00 ms "
                    "it predicts to save with it")


def test_auto_frees_activations_for_the_pass_that_plans_next():
    from deepcompile.passes.context import Facts

    # no room: selective_unshard is not chosen, prefetch plans next and is the buyer
    f = Facts(world_size=2, zero_stage=3, memory_budget=1000, peak_bytes=1000, gathers=4,
              reduces=4, keep_all_bytes=500)
    yes, why = A.auto(f)
    assert yes and "freed for prefetch, which plans next" in why
    # some room: selective_unshard plans next, and it alone is named
    yes, why = A.auto(dataclasses.replace(f, memory_budget=1100))
    assert yes and "freed for selective_unshard, which plans next" in why


def test_a_trade_that_does_not_pay_says_what_it_tried():
    # at 1 s per byte freed neither target pays: both are reported with their figures
    offers = P.offers(_plan_at(GRAPHS), RUNS, 980, BUDGET)
    tried: list = []
    assert A.choose_trade(offers, 980, lambda target: (target, (980 - target) * 1.0, target),
                          tried) is None
    assert tried == [(20, 6.0, 20.0), (130, 12.0, 130.0)]
    declined = {"for": "prefetch", "peak_before": 980, "offers": 2,
                "tried": [{"freed_bytes": f, "value_s": v, "added_s": c} for f, v, c in tried]}
    assert A.summary({"declined": declined}) == [
        "not traded for prefetch (gathers started earlier: 2 offers): freeing 20 B below the "
        "peak 980 B adds +20000.00 ms a step for 6000.00 ms; freeing 130 B below the peak 980 B "
        "adds +130000.00 ms a step for 12000.00 ms, less than 2x"]
