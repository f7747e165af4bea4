"""offload_optimizer's offers to a pass that frees memory ([Note: a memory trade] in
passes/activation_budget.py): what a lower peak in the graphs would save its plan, on synthetic
curves (passes/_offload_plan.py `offers`, `added_s`)."""

from __future__ import annotations

import dataclasses

from deepcompile.passes import _offload_plan as P


def _points(live):
    return [P.Point("g0.bw", f"n{j}", b, 1e-3, True) for j, b in enumerate(live)]


def _planner(items, step_base, budget):
    def plan_at(points):
        return P.plan_step(points, items, step_base, lambda n: 1e-6 * n, budget)
    return plan_at


def _lowered(points, nbytes):
    return [dataclasses.replace(p, live_bytes=p.live_bytes - nbytes) for p in points]


def test_each_offer_is_what_a_lower_peak_saves_the_plan():
    items = [P.Item(i, n, f"p{i}") for i, n in enumerate([100, 100, 100])]
    points, plan_at = _points([500, 1000, 800]), _planner(items, 200, 850)
    planned = plan_at(points)
    assert len(planned["chunks"]) == 2 and P.added_s(planned) > 0
    offers = P.offers(points, plan_at, planned)
    # the planned chunks' bytes, smallest first; together they save all the plan adds
    assert [b for b, _ in offers] == sorted(c["bytes"] for c in planned["chunks"])
    assert all(s > 0 for _, s in offers)
    assert abs(sum(s for _, s in offers) - P.added_s(planned)) < 1e-12
    # the first offer is the plan on the curve lowered by its bytes
    one = plan_at(_lowered(points, offers[0][0]))
    assert len(one["chunks"]) == 1
    assert abs(offers[0][1] - (P.added_s(planned) - P.added_s(one))) < 1e-12


def test_the_offers_end_where_the_optimizer_step_binds():
    # the step with all state (650 + 400) is over the budget whatever the graphs' peak: a lower
    # peak buys only the chunks the graphs, not the step, take off the device
    items = [P.Item(i, 40, f"p{i}") for i in range(10)]
    points, plan_at = _points([500, 1290, 800]), _planner(items, 650, 900)
    planned = plan_at(points)
    offers = P.offers(points, plan_at, planned)
    assert len(planned["chunks"]) == 10
    assert 0 < len(offers) < 10 and all(s > 0 for _, s in offers)
    freed = sum(b for b, _ in offers)
    rest = plan_at(_lowered(points, freed))
    assert rest["chunks"], "the step still takes state off the device"
    assert abs(P.added_s(rest) - (P.added_s(planned) - sum(s for _, s in offers))) < 1e-12
    # lowering the graphs further saves nothing more
    assert P.added_s(plan_at(_lowered(points, freed + 1000))) == P.added_s(rest)


def test_nothing_is_offered_without_a_plan_or_by_an_unattainable_one():
    items = [P.Item(0, 100, "p0")]
    points = _points([500, 600])
    assert P.offers(points, _planner(items, 200, 1000), _planner(items, 200, 1000)(points)) == []
    plan_at = _planner(items, 200, 300)
    unattainable = plan_at(points)
    assert unattainable["unattainable"]
    assert P.offers(points, plan_at, unattainable) == []
