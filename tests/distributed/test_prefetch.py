"""Pass `prefetch` (issue 4): asynchronous, fused gathers scheduled from the profile.

Unit tests of the planner on synthetic graphs with synthetic profiles (budget held at every
node, a start hoisted just far enough, fusion exactly when the cost model favours it, legal
order, unattainable budgets reported), of the rewrite on a synthetic FX graph, and multi-rank
tests: parity with prefetch (fx, tiny Llama and a graph-break model; Inductor: in
tests/distributed/test_selective_unshard.py, with every scheduling pass), fewer
all-gathers with fusion, less exposed communication, a tight budget respected by the measured
re-profile, an unattainable budget reported with its figures, and parity with the scheduling
passes placed by seeded random profiled times (`_train.random_times`).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import fx, nn

import _graphs
import _models
from _dist import run_distributed
from _train import Jobs, compare_to_reference, scenario
from deepcompile.compiler.cost import LinearCostModel
from deepcompile.passes import prefetch as P
from deepcompile.runtime import ops

INF = float("inf")


def _cost(latency, per_byte):
    return LinearCostModel(coeffs={"all_gather": (latency, per_byte)})


def _graph(times, gathers, live=None):
    """steps c0.. with compute `times`, gathers inserted at the given (index, name, bytes)."""
    steps = [P.Step(f"c{i}", "compute", t, (live or [100] * len(times))[i])
             for i, t in enumerate(times)]
    gs = []
    for index, name, nbytes in sorted(gathers):
        steps.insert(index, P.Step(name, "all_gather", 0.5, steps[index].live_bytes if
                                   index < len(steps) else 100))
    for i, s in enumerate(steps):
        if s.kind == "all_gather":
            nbytes = next(b for _, n, b in gathers if n == s.name)
            gs.append(P.Gather(s.name, i, nbytes, pid=len(gs)))
    return steps, gs


def _simulated(steps, plan):
    """Recompute the memory curve of a plan of unfused groups, independently of the planner."""
    index = {s.name: i for i, s in enumerate(steps)}
    extra = [0] * len(steps)
    for g in plan["groups"]:
        assert len(g["members"]) == 1
        for j in range(index[g["start_before"]], index[g["wait_at"]]):
            extra[j] += g["bytes"]
    curve = [s.live_bytes + e for s, e in zip(steps, extra)]
    for g in plan["groups"]:   # the point where each start runs: after the node before it
        k = index[g["start_before"]]
        curve.append(curve[k - 1] + g["bytes"] if k else curve[0])
    return curve


def test_start_moves_just_far_enough_to_hide_the_gather():
    steps, gs = _graph([1.0, 1.0, 1.0, 1.0], [(3, "g", 1000)])
    plan = P.plan_graph(steps, gs, _cost(1.5, 0.0), INF)
    (g,) = plan["groups"]
    # c2 (1.0) does not cover 1.5 s; c1 + c2 do: the start goes before c1, not before c0
    assert g["start_before"] == "c1" and g["moved_nodes"] == 2 and g["hidden_s"] == 2.0
    assert g["overlaps"] == ["c1", "c2"]


def test_budget_holds_at_every_node():
    live = [100, 900, 100, 100, 100]
    steps, gs = _graph([1.0] * 5, [(4, "g", 150)], live=live)
    budget = 1000
    plan = P.plan_graph(steps, gs, _cost(10.0, 0.0), budget)   # would like to go to the top
    (g,) = plan["groups"]
    # c1 holds 900 bytes: 900 + 150 > 1000 after c1 (where a start before c2 would run) and
    # after c1 itself, so the start goes no higher than before c3
    assert g["start_before"] == "c3" and plan["peak_after"] <= budget
    curve = _simulated(steps, plan)
    assert max(curve) <= budget and max(curve) == plan["peak_after"]
    # one node higher would break the budget at the point where the start runs
    assert steps[1].live_bytes + g["bytes"] > budget


def test_fusion_happens_when_and_only_when_the_cost_model_favours_it():
    steps, gs = _graph([1.0, 1.0, 1.0], [(2, "g0", 100), (3, "g1", 100)])
    no_latency = P.plan_graph(steps, gs, _cost(0.0, 1e-3), INF)      # cost(a+b) == cost(a)+cost(b)
    assert [g["members"] for g in no_latency["groups"]] == [["g0"], ["g1"]]
    latency = P.plan_graph(steps, gs, _cost(0.5, 1e-3), INF)         # one launch saves 0.5 s
    assert [g["members"] for g in latency["groups"]] == [["g0", "g1"]]
    # far apart (more compute between them than the second needs): not fused even with latency
    steps, gs = _graph([1.0, 1.0, 5.0, 1.0], [(1, "g0", 100), (4, "g1", 100)])
    apart = P.plan_graph(steps, gs, _cost(0.5, 1e-3), INF)
    assert [g["members"] for g in apart["groups"]] == [["g0"], ["g1"]]
    # fused size cap
    steps, gs = _graph([1.0, 1.0], [(1, "g0", 100), (2, "g1", 100)])
    capped = P.plan_graph(steps, gs, _cost(0.5, 1e-3), INF, max_fused_bytes=150)
    assert [g["members"] for g in capped["groups"]] == [["g0"], ["g1"]]


def test_gathers_of_different_dtypes_are_never_fused():
    steps, gs = _graph([1.0, 1.0, 1.0], [(2, "g0", 100), (3, "g1", 100)])
    gs[0].dtype, gs[1].dtype = "torch.float32", "torch.bfloat16"
    plan = P.plan_graph(steps, gs, _cost(0.5, 1e-3), INF)   # latency alone would fuse them
    assert [g["members"] for g in plan["groups"]] == [["g0"], ["g1"]]


def test_fusion_never_breaks_the_budget_where_an_unmoved_group_starts():
    # fusing g1 into g0 would start 200 bytes right after c0 (150 live): 350 > 300
    steps, gs = _graph([1.0, 0.001, 1.0], [(1, "g0", 100), (2, "g1", 100)], live=[150, 100, 100])
    plan = P.plan_graph(steps, gs, _cost(0.5, 1e-3), 300)
    assert [g["members"] for g in plan["groups"]] == [["g0"], ["g1"]]
    assert plan["peak_after"] <= 300


def test_order_stays_legal():
    steps, gs = _graph([0.2] * 10, [(2, "g0", 10), (5, "g1", 10), (8, "g2", 10)])
    plan = P.plan_graph(steps, gs, _cost(5.0, 0.0), INF, max_fused_bytes=10)
    index = {s.name: i for i, s in enumerate(steps)}
    starts = [index[g["start_before"]] for g in plan["groups"]]
    waits = [index[g["wait_at"]] for g in plan["groups"]]
    assert starts == sorted(starts)                            # starts in wait order (FIFO)
    assert all(s <= w for s, w in zip(starts, waits))          # every start before its wait


def test_unattainable_budget_is_reported_not_ignored():
    steps, gs = _graph([1.0, 1.0], [(1, "g", 100)], live=[500, 500])
    plan = P.plan_graph(steps, gs, _cost(1.0, 0.0), 400)
    assert plan["unattainable"] and plan["groups"] == []
    assert plan["insertion_peak_bytes"] == 500 and plan["budget_bytes"] == 400


# ------------------------------------------------------------------------- across graphs
def test_successions_are_only_the_graphs_that_always_follow_each_other():
    step = ["f0", "f1", "b1", "b0"] * 2                    # two micro-steps, one graph break
    assert P.successions(step) == [("f0", "f1"), ("f1", "b1"), ("b1", "b0")]  # not b0 -> f0
    # a graph Dynamo reuses for two layers is preceded by two graphs: no pair into or out of it
    assert P.successions(["f0", "f1", "f1", "f2"]) == []
    assert P.successions(["f0", "f1", "f2", "f1"]) == []   # f1 preceded by f0 and f2


def _across(b_hidden, budget=INF, live_a=None):
    steps_a = [P.Step(f"a{i}", "compute", 1.0, (live_a or [100] * 4)[i]) for i in range(4)]
    steps_b = [P.Step("b0", "all_gather", 0.1, 100), P.Step("b1", "compute", 1.0, 100)]
    decisions = {"B": {"unattainable": False, "budget_bytes": budget, "peak_before": 100,
                       "peak_after": 150, "curve": [150, 100], "groups": [
                           {"members": ["b0"], "pids": [7], "start_before": "b0", "wait_at": "b0",
                            "bytes": 50, "predicted_s": 2.5, "hidden_s": b_hidden}]}}
    P.plan_across("A", "B", steps_a, steps_b, decisions, budget)
    return decisions


def test_a_group_the_next_graph_cannot_hide_starts_just_early_enough_in_the_previous():
    d = _across(b_hidden=0.0)
    (ahead,) = d["A"]["for_next"]
    # B cannot hide 2.5 s: A's last three nodes (3 s) cover it, two would not
    assert ahead["start_before"] == "a1" and ahead["hidden_s"] == 3.0 and ahead["for"] == "B"
    assert d["B"]["groups"][0]["from_prev"] == "A"
    assert d["A"]["curve"] == [150, 150, 150, 150] and d["A"]["peak_after"] == 150


def test_a_group_the_next_graph_hides_itself_stays_there():
    d = _across(b_hidden=2.5)
    assert "A" not in d and "from_prev" not in d["B"]["groups"][0]


def test_cross_graph_start_respects_the_budget_of_the_previous_graph():
    d = _across(b_hidden=0.0, budget=1000, live_a=[100, 980, 100, 100])
    (ahead,) = d["A"]["for_next"]
    # 980 + 50 > 1000: the start may not run after a1 nor keep its buffer alive across it
    assert ahead["start_before"] == "a3" and ahead["hidden_s"] == 1.0
    assert max(d["A"]["curve"]) <= 1000
    none = _across(b_hidden=0.0, budget=120)   # not even at A's end: nothing moves
    assert "for_next" not in none.get("A", {}) and "from_prev" not in none["B"]["groups"][0]


def test_rewrite_of_a_synthetic_graph():
    g = fx.Graph()
    s0, s1, x = g.placeholder("s0"), g.placeholder("s1"), g.placeholder("x")
    y = g.call_function(torch.ops.aten.relu.default, (x,), name="c0")
    g0 = g.call_function(ops.ALLGATHER, (s0, 1, [4, 4], torch.float32), name="g0")
    z = g.call_function(torch.ops.aten.mm.default, (y, g0), name="c1")
    g1 = g.call_function(ops.ALLGATHER, (s1, 2, [4, 4], torch.float32), name="g1")
    out = g.call_function(torch.ops.aten.mm.default, (z, g1), name="c2")
    g.output((out,))
    gm = fx.GraphModule(nn.Module(), g)

    class Slot:
        pass

    slot = Slot()
    slot.gm = gm
    ctx = type("Ctx", (), {"slots": {"g0.fw": slot}})()
    decisions = {"g0.fw": {"groups": [
        {"members": ["g0", "g1"], "pids": [1, 2], "start_before": "c0", "wait_at": "g0",
         "bytes": 128}]}}
    assert P.apply(ctx, decisions) == ["g0.fw"]
    names = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert names[0] is ops.ALLGATHER_START and names[1] is torch.ops.aten.relu.default
    assert names[2] is ops.ALLGATHER_WAIT and ops.ALLGATHER not in names


def test_a_cross_graph_start_is_ordered_after_compute_not_after_a_collective(monkeypatch):
    # CI (stop 22): the start for the next graph was ordered after the reduce-scatter right
    # before its place; bucket_reduce then moved that reduction into a bucket waited at the end
    # of the graph, and the start used a value defined after it (fx lint: "used before it has
    # been defined"). It depended on the profile (where the start landed), so it was flaky.
    from deepcompile.passes import bucket_reduce as B

    class Entry:
        def __init__(self, pid):
            self.pid, self.padded_numel, self.reduce_dtype = pid, 16, torch.float32
            self.compute_dtype, self.shard = torch.float32, torch.empty(8)

    monkeypatch.setattr(P, "lookup", Entry)
    monkeypatch.setattr(B, "lookup", Entry)
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.relu.default, (x,), name="ga")
    ra = g.call_function(ops.REDUCE_GRAD, (a, 1, 8, torch.float32), name="ra")
    b = g.call_function(torch.ops.aten.sin.default, (x,), name="gb")
    rb = g.call_function(ops.REDUCE_GRAD, (b, 2, 8, torch.float32), name="rb")
    g.output((ra, rb))
    for n in (x, a, b):
        n.meta["val"] = torch.empty(4, 4)
    for n in (ra, rb):
        n.meta["val"] = torch.empty(8)
    gm = fx.GraphModule(nn.Module(), g)
    slot = type("Slot", (), {"gm": gm})()
    registry = type("Registry", (), {"pid_by_name": staticmethod(lambda: {"w": 7})})()
    ctx = type("Ctx", (), {"slots": {"g1.bw": slot}, "registry": registry})()
    P.apply(ctx, {"g1.bw": {"groups": [], "for_next": [
        {"for": "g0.bw", "pids": [7], "params": ["w"], "bytes": 64, "start_before": "gb"}]}})
    (start,) = [n for n in gm.graph.nodes if n.target is ops.ALLGATHER_FOR_NEXT]
    assert start.args[0] is a          # the gradient computed before it, not its reduction
    B.apply(ctx, {"g1.bw": {"buckets": [
        {"members": ["ra", "rb"], "pids": [1, 2], "start_after": "rb", "wait_before": None,
         "bytes": 128}]}})
    gm.graph.lint()
    assert start.args[0] is a


# ------------------------------------------------------------------------- multi-rank
_PREFETCH = {"passes": ("prefetch",), "warmup_steps": 1}
_BOTH = {"passes": ("prefetch", "bucket_reduce"), "warmup_steps": 1}
JOBS = Jobs({
    "fx2": (2, [
        # prefetch alone: the full suite's (test_fusion_cuts_all_gathers_per_micro_step); the
        # core's run with both passes has the prefetch pass's fewer collectives in its report
        # (test_prefetch_overlaps_gathers_with_compute)
        scenario("llama-adamw-gas2-clip-prefetch", "llama", "adamw", 1e-2, gas=2, clip=0.1,
                 record=("comm",), extended=True, **_PREFETCH),
        # its report's pass entries are the unbounded plan of the budget tests; the full
        # suite's (the core runs both passes on the tiny Llama with the other passes in
        # test_activation_budget's trade-all scenario, and on graph_break in fx2-random-times)
        scenario("llama-adamw-gas2-clip-prefetch-reduce", "llama", "adamw", 1e-2, gas=2,
                 clip=0.1, record=("comm", "report"), extended=True, **_BOTH),
        # without a pass: the full suite's (test_buckets_cut_reduce_scatters_per_micro_step); the
        # core's Llama AdamW gas 2 clip at ZeRO-3 without a pass is test_parity's Inductor run
        scenario("llama-adamw-gas2-clip", "llama", "adamw", 1e-2, gas=2, clip=0.1,
                 record=("comm",), warmup_steps=1, extended=True),
        # the core's graph_break with both passes: fx2-random-times (gas 1, the same passes)
        scenario("graph_break-sgd-prefetch-reduce", "graph_break", "sgd", 0.1, extended=True,
                 **_BOTH),
    ]),
    "fx4": (4, [scenario("llama-sgd-gas1-prefetch-reduce", "llama", "sgd", 0.1, extended=True,
                         **_BOTH)]),
    # Inductor: prefetch with bucket_reduce and selective_unshard on 2 ranks is
    # tests/distributed/test_selective_unshard.py's Inductor scenario (one cold Inductor job for
    # both; the full suite's), and the order of Inductor's code is
    # test_inductor_code_keeps_starts_before_the_compute_they_overlap
    # Where the passes place their ops depends on the profiled times: seeded random times
    # (`random_times`) give the placements this machine's times do not (the CI failure of
    # stop 22 came from one such placement)
    # (graph_break's seed 7 failed so before the fix, as did 11 and 21 of 24 tried); the core
    # matrix has that seed, the full one every seed, and the Llama's with selective_unshard
    "fx2-random-times": (2, [
        scenario(f"{model}-sgd-gas{gas}-{'-'.join(passes)}-times{seed}", model, "sgd", 0.1,
                 gas=gas, steps=4, profile_seed=seed, passes=passes, warmup_steps=1,
                 record=("report",), extended=seed != core)
        for model, gas, passes, seeds, core in (
            ("graph_break", 1, ("prefetch", "bucket_reduce"), 8, 7),   # a seed that failed
            ("llama", 2, ("selective_unshard", "prefetch", "bucket_reduce"), 4, None))
        for seed in range(seeds)]),
}, timeout=900)


@pytest.mark.parametrize("job, sc", JOBS.params())
def test_parity_with_prefetch(job, sc):
    results = JOBS.results(job, sc["id"])
    compare_to_reference(sc, results, kind=f"{sc['model']}/{sc['config']['compiler']}+"
                         + "+".join(sc["config"].get("passes", ("insertion",))))


def test_fusion_cuts_all_gathers_per_micro_step():
    with_pass = JOBS.results("fx2", "llama-adamw-gas2-clip-prefetch")[0]
    without = JOBS.results("fx2", "llama-adamw-gas2-clip")[0]
    # steady state (the last micro-step): same bytes, fewer collectives
    gathers = lambda r: r["comm_fwd"][-1]["all_gather"][0] + r["comm_bwd"][-1]["all_gather"][0]  # noqa: E731
    nbytes = lambda r: r["comm_fwd"][-1]["all_gather"][1] + r["comm_bwd"][-1]["all_gather"][1]  # noqa: E731
    print(f"all-gathers per micro-step: {gathers(without)} -> {gathers(with_pass)}")
    assert gathers(with_pass) < gathers(without)
    assert nbytes(with_pass) == nbytes(without)


def test_buckets_cut_reduce_scatters_per_micro_step():
    with_pass = JOBS.results("fx2", "llama-adamw-gas2-clip-prefetch-reduce")[0]
    without = JOBS.results("fx2", "llama-adamw-gas2-clip")[0]
    last = lambda r, i: r["comm_bwd"][-1]["reduce_scatter"][i]  # noqa: E731  (steady state)
    print(f"reduce-scatters per micro-step: {last(without, 0)} -> {last(with_pass, 0)}")
    assert last(with_pass, 0) < last(without, 0)
    assert last(with_pass, 1) == last(without, 1)


def _budget_job(rank, world, budget):
    import deepcompile

    model = _models.build_model("llama")
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx", "warmup_steps": 1,
                                            "passes": ("prefetch", "bucket_reduce"), "measure_steps": 0,
                                            "memory_budget": budget})
    for step in range(4):
        engine.backward(_models.loss_of(engine(**_models.local_batch("llama", step, rank, world))))
        engine.step()
    rep = engine.report().to_dict()
    peaks = {s["slot"]: [p["peak_bytes"] for p in s["profiles"]]
             for g in rep["graphs"] for s in g["slots"]}
    by_name = {p["pass"]: p for p in rep["passes"]}
    return {"pass": by_name["prefetch"], "reduce": by_name["bucket_reduce"], "peaks": peaks}


@pytest.fixture(scope="module")
def unbounded():
    """The prefetch and bucket_reduce entries of the report of fx2's
    `llama-adamw-gas2-clip-prefetch-reduce`: the tiny Llama under no budget. Its graphs'
    peaks before the passes are `_budget_job`'s (the same model, batch size and passes; the
    optimizer, accumulation and clipping run outside the graphs), which the tight budget's
    test checks."""
    rep = JOBS.results("fx2", "llama-adamw-gas2-clip-prefetch-reduce")[0]["report"]
    by_name = {p["pass"]: p for p in rep["passes"]}
    return {"pass": by_name["prefetch"], "reduce": by_name["bucket_reduce"]}


# the core's: graph_break's plan under seeded random times (the seed the core runs)
@pytest.mark.parametrize("job, sid", [
    pytest.param("fx2-random-times", "graph_break-sgd-gas1-prefetch-bucket_reduce-times7",
                 id="graph_break-times7"),
    pytest.param("fx2", "llama-adamw-gas2-clip-prefetch-reduce", id="llama",
                 marks=pytest.mark.extended)])
def test_prefetch_overlaps_gathers_with_compute(job, sid):
    # Counted, not timed: whether the wait time drops depends on the machine's load (two
    # ranks and gloo's threads share 2 cores here); the measured figures go in the notes.
    rep = JOBS.results(job, sid)[0]["report"]
    (p,) = [e for e in rep["passes"] if e["pass"] == "prefetch"]
    print(f"exposed comm {p['before']['exposed_comm_s'] * 1e3:.1f} ms -> "
          f"{p['after']['exposed_comm_s'] * 1e3:.1f} ms; collectives "
          f"{p['before']['collectives']} -> {p['after']['collectives']}")
    assert p["after"]["collectives"] < p["before"]["collectives"]
    groups = [g for d in p["decisions"].values() for g in d["groups"]]
    assert any(g["moved_nodes"] > 0 and g["hidden_s"] > 0 for g in groups)


# the budget tests run the Llama again under a budget: the full suite's. The planner's budget
# at every node and its unattainable budget are the unit tests above
# (test_budget_holds_at_every_node, test_unattainable_budget_is_reported_not_ignored)
@pytest.mark.extended
def test_tight_budget_is_respected_by_the_measured_profile(unbounded):
    before = max(d["peak_before"] for d in unbounded["pass"]["decisions"].values())
    after = max(d["peak_after"] for d in unbounded["pass"]["decisions"].values())
    assert after > before   # unbounded prefetch costs memory ...
    budget = (before + after) // 2   # ... so this budget allows only part of it
    r = run_distributed(_budget_job, 2, budget, timeout=600)[0]
    # the budget lies between this run's own peaks: the same graphs before the passes
    assert max(d["peak_before"] for d in r["pass"]["decisions"].values()) == before
    for key, d in [*r["pass"]["decisions"].items(), *r["reduce"]["decisions"].items()]:
        assert not d["unattainable"] and d["peak_after"] <= budget, (key, d)
        assert max(r["peaks"][key]) <= budget    # initial and re-profiled after each pass, measured
    assert any(len(d["groups"]) for d in r["pass"]["decisions"].values())
    assert r["reduce"]["decisions"]   # the backward graph was planned under the same budget


@pytest.mark.extended
def test_budget_below_insertion_peak_is_reported(unbounded):
    r = run_distributed(_budget_job, 2, 4096, timeout=600)[0]
    assert r["pass"]["changed"] == [] and r["reduce"]["changed"] == []
    for d in [*r["pass"]["decisions"].values(), *r["reduce"]["decisions"].values()]:
        assert d["unattainable"] and d["budget_bytes"] == 4096
        assert d["insertion_peak_bytes"] > 4096


def _cross_graph_job(rank, world):
    import deepcompile
    from deepcompile.compiler.lower import _fallback_gather

    model = _models.build_model("graph_break")
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx", "warmup_steps": 1,
                                            "gradient_accumulation_steps": 2,
                                            "passes": ("prefetch",), "measure_steps": 0})
    for step in range(4):
        before = engine.comm_stats()
        for micro in range(2):
            batch = _models.local_batch("graph_break", 2 * step + micro, rank, world)
            engine.backward(_models.loss_of(engine(**batch)))
        engine.step()
    last_step = {k: engine.comm_stats()[k]["count"] - before[k]["count"]
                 for k in ("all_gather", "reduce_scatter")}
    report = engine.report().to_dict()
    (decisions,) = [p["decisions"] for p in report["passes"]]
    order = engine._pipeline.order
    per_graph = {s["slot"]: s for g in report["graphs"] for s in g["slots"]}
    parked = engine._runtime.parked
    out = {"misses": dict(parked.misses), "order": order, "last_step": last_step,
           "report_counts": {k: sum(per_graph[key][k + "s"] for key in order)
                             for k in ("all_gather", "reduce_scatter")},
           "for_next": {k: [a["for"] for a in d.get("for_next", [])] for k, d in decisions.items()},
           "from_prev": {k: [g["from_prev"] for g in d["groups"] if g.get("from_prev")]
                         for k, d in decisions.items()}}
    # the run-time fallbacks, driven directly: nothing parked; parked for other shards (a
    # reused graph); parked and never taken
    e = next(iter(engine._registry))
    gather = _fallback_gather([e], e.compute_dtype)
    expect = e.gather()
    key = (e.pid,)
    got = parked.take(key, (e.shard,), (e.shard,), gather)
    other = e.shard.detach().clone()
    parked.park(key, gather((e.shard,)))
    got_other = parked.take(key, (other,), (e.shard,), gather)
    parked.park(key, gather((e.shard,)))
    out["dropped"] = parked.drop_unused()
    out["fallback_ok"] = bool(torch.equal(got[: e.numel].view(e.shape), expect)
                              and torch.equal(got_other[: e.numel].view(e.shape), expect))
    out["misses_after"] = dict(parked.misses)
    return out


def test_cross_graph_prefetch_follows_the_recorded_order():
    r = run_distributed(_cross_graph_job, 2, timeout=600)[0]
    assert r["order"] == ["g0.fw", "g1.fw", "g1.bw", "g0.bw"] * 2
    # every planned start has a taker in the graph that always runs next, and vice versa
    started = sorted((a, b) for a, bs in r["for_next"].items() for b in bs)
    taken = sorted((a, b) for b, as_ in r["from_prev"].items() for a in as_)
    assert started == taken and len(started) >= 1
    assert set(started) <= {("g0.fw", "g1.fw"), ("g1.fw", "g1.bw"), ("g1.bw", "g0.bw")}
    assert r["misses"] == {"missing": 0, "other_tensors": 0, "unused": 0}   # all taken in training
    # the report's per-graph collective counts (starts included) add up to a measured step
    assert r["report_counts"] == r["last_step"]
    assert r["fallback_ok"] and r["dropped"] == 1
    assert r["misses_after"] == {"missing": 1, "other_tensors": 1, "unused": 1}


# ------------------------------------------------ Inductor keeps each start ahead of its wait
def _slow(ctx):
    """`ctx` under a bandwidth-only cost model of 1 s per byte: no fusion, maximal overlap."""
    import dataclasses

    return dataclasses.replace(ctx, cost=LinearCostModel(coeffs={"all_gather": (0.0, 1.0)}))


def _nofuse_plan(ctx):
    return P.plan(_slow(ctx))


def _nobucket_plan(ctx):
    from deepcompile.passes import bucket_reduce

    return bucket_reduce.plan(_slow(ctx))


def _inductor_code_job(rank, world):
    import deepcompile
    from deepcompile import _compat
    from deepcompile.passes import known_passes

    from deepcompile.passes import bucket_reduce

    if "test_prefetch_nofuse" not in known_passes():
        deepcompile.register_pass("test_prefetch_nofuse", _nofuse_plan, P.apply)
        deepcompile.register_pass("test_bucket_nofuse", _nobucket_plan, bucket_reduce.apply)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(16, 16), nn.Tanh())])
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "inductor", "warmup_steps": 1,
                                            # bf16: every gather's input is a cast, a buffer
                                            # Inductor could reuse ([Note: an unwaited
                                            # gather's input])
                                            "param_dtype": "bfloat16",
                                            "measure_steps": 0, "passes": ("test_prefetch_nofuse",
                                                       "test_bucket_nofuse")})
    x = torch.randn(4, 16, dtype=torch.bfloat16)

    def step():
        engine.backward(engine(x).sum())
        engine.step()

    for _ in range(4):   # warm-up, profile, re-profile after each pass
        step()
    _, code = _compat.inductor_code_of(step)   # steady: Inductor compiles forward and backward
    return code


@pytest.mark.inductor
def test_inductor_code_keeps_starts_before_the_compute_they_overlap():
    codes = run_distributed(_inductor_code_job, 2, timeout=900)[0]
    assert len(codes) == 2   # forward and backward
    compute = re.compile(r"^(extern_kernels\.\w+|cpp_fused\w*|triton_\w+\.run)\(")
    for kind, graphs in (("allgather", 2), ("reduce", 1)):   # reduce-scatters: backward only
        overlapped = 0
        for code in codes:
            seq = []   # "start" / "wait" / "compute", in program order
            collective = {"allgather": "all_gather_into_tensor",
                          "reduce": "reduce_scatter_tensor"}[kind]
            pending = {}   # buffer -> index of its start
            pairs = []     # (start index, wait index) of collectives waited in this graph
            source = {}    # buffer -> the collective's input
            kept = set()   # the graph's inputs and outputs: never reused for another buffer
            for ln in (ln.strip() for ln in code.splitlines()):
                m = re.match(rf"(\w+) = torch\.ops\._c10d_functional\.{collective}\.default\("
                             r"(\w+)", ln)
                if re.fullmatch(r"[\w, ]+= args", ln) or ln.startswith("return ("):
                    kept.update(re.findall(r"\w+", ln))
                w = re.match(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((\w+)\)", ln)
                if m:
                    pending[m.group(1)] = len(seq)
                    source[m.group(1)] = m.group(2)
                    seq.append("start")
                elif w and w.group(1) in pending:
                    pairs.append((pending.pop(w.group(1)), len(seq)))
                    seq.append("wait")
                elif compute.match(ln):
                    seq.append("compute")
            # a start left unwaited is the one handed to the next graph (at most one here);
            # its input is an input or an output of the graph, which Inductor never gives to
            # another buffer while the collective may still read it
            assert len(pending) <= (1 if kind == "allgather" else 0), pending
            for buf in pending:
                assert source[buf] in kept, (buf, source[buf], kept)
            graphs -= bool(pairs)
            for s, w in pairs:
                assert s < w
                overlapped += "compute" in seq[s + 1:w]
        assert graphs == 0, f"{kind}: not in every graph it belongs to"
        assert overlapped > 0, f"{kind}: no compute between a start and its wait"
    # no Python op is left in the compiled graphs: every collective is a functional collective
    for code in codes:
        assert "torch.ops.deepcompile." not in code
    # the backward's first group is started at the forward's tail and returned unwaited: the
    # forward launches one more all-gather than it waits for, the backward one less
    def count(code, what):
        return len(re.findall(rf"torch\.ops\._c10d_functional\.{what}\.default\(", code))
    fw, bw = codes
    assert count(fw, "all_gather_into_tensor") == count(fw, "wait_tensor") + 1
    assert count(bw, "all_gather_into_tensor") + count(bw, "reduce_scatter_tensor") == \
        count(bw, "wait_tensor") - 1


def test_fused_groups_keep_the_budget_on_random_graphs():
    # Fused members are held from the group's wait to their own use: a newcomer must fit on top
    # of the members fused before it (found composing with offload_optimizer's tight budgets).
    import random

    rng = random.Random(0)
    for _ in range(1000):
        steps, gs = _graphs.random_gathers(rng, P)
        budget = max(s.live_bytes for s in steps) + rng.randint(0, 300)
        plan = P.plan_graph(steps, gs, _cost(rng.uniform(0.1, 3.0), 1e-4), budget)
        assert plan["peak_after"] <= budget and max(plan["curve"]) <= budget, plan


# ------------------------------------------------------------------------------ plan cache
def _two_engines_one_cache(rank: int, world: int, cache_dir: str) -> list[dict]:
    """Two engines in one process, the second hitting the plan the first saved; per engine: the
    pids its graphs' communication ops name, its own pids, the cache hit and the cross-graph
    prefetches that missed."""
    import deepcompile

    out = []
    for _ in range(2):
        torch._dynamo.reset()
        model = _models.build_model("graph_break")
        engine = deepcompile.initialize(
            model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            config={"compiler": "fx", "warmup_steps": 1, "cache_dir": cache_dir,
                    "passes": ("prefetch", "bucket_reduce"), "measure_steps": 0})
        misses = 0
        for step in range(4):
            batch = _models.local_batch("graph_break", step, rank, world)
            engine.backward(_models.loss_of(engine(**batch)))
            engine.step()
        named = set()
        for slot in engine._pipeline.slots.values():
            for node in slot.gm.graph.nodes:
                if node.op == "call_function" and node.target in ops.COMM_KINDS:
                    pids = node.args[1]
                    named |= set(pids) if isinstance(pids, (list, tuple)) else {pids}
        rep = engine.report().to_dict()
        out.append({"named": sorted(named), "own": sorted(e.pid for e in engine._registry),
                    "hit": rep["cache"]["hit"],
                    "misses": sum(engine._runtime.parked.misses.values()) - misses,
                    "changed": [e["changed"] for e in rep["passes"]],
                    "cross": sum(len(d.get("for_next", [])) for e in rep["passes"]
                                 if e["pass"] == "prefetch" for d in e["decisions"].values())})
    return out


def test_a_cached_plan_applies_to_an_engine_with_other_parameter_ids(tmp_path):
    """A plan-cache hit for a second engine in the same process, whose parameters got other ids
    than those the plan was made with: prefetch and bucket_reduce apply by the graphs' own nodes
    and by parameter name, never by the ids stored in the decisions; otherwise the second
    engine's ops would name the first engine's parameters (its cross-graph starts would gather
    the first engine's shards and miss)."""
    for first, second in run_distributed(_two_engines_one_cache, 2, str(tmp_path), timeout=600):
        assert not first["hit"] and second["hit"]
        assert first["own"] != second["own"]
        assert second["changed"] == first["changed"] and any(second["changed"])
        assert first["named"] == first["own"] and second["named"] == second["own"]
        assert second["cross"] > 0 and second["misses"] == 0
