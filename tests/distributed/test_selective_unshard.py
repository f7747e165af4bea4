"""Pass `selective_unshard` (issue 5): parameters kept gathered, gradients accumulated locally.

Unit tests of the planner on synthetic inputs (the knapsack against brute force and against
greedy-by-ratio, values from counts per optimizer step and the cost model, predicted counts)
and of the rewrite on synthetic FX graphs (synchronous ops retargeted; members pulled out of
fused gather groups, cross-graph groups and reduce buckets, groups erased when empty).

Multi-rank (gloo, tiny Llama, gradient_accumulation_steps=4): all-gathers and reduce-scatters
per optimizer step from `comm_stats()` with a budget that fits everything, a part, nothing;
the measured peak within the budget; parity with single-process training (2 and 4 ranks, fx
and Inductor, with prefetch and bucket_reduce before it, clipping); kept copies intact through
every accumulation window and refreshed by every optimizer step (with a negative control: a
skipped refresh is caught).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import random

import pytest
import torch
from torch import fx, nn

import _models
from _dist import run_distributed
from _train import Jobs, compare_to_reference, run_training, scenario
from deepcompile.compiler.cost import LinearCostModel
from deepcompile.passes import selective_unshard as S
from deepcompile.runtime import ops

INF = float("inf")


# ------------------------------------------------------------------------------- knapsack
def _greedy_by_ratio(options, capacity):
    """Keep items by value per byte (their first option), stop at the first that does not fit."""
    order = sorted(range(len(options)), key=lambda i: -options[i][0][1] / options[i][0][0])
    out, used = [None] * len(options), 0
    for i in order:
        w, _ = options[i][0]
        if used + w > capacity:
            break
        out[i], used = 0, used + w
    return out


def _value(options, choice):
    return sum(options[i][k][1] for i, k in enumerate(choice) if k is not None)


def _weight(options, choice):
    return sum(options[i][k][0] for i, k in enumerate(choice) if k is not None)


def test_knapsack_beats_greedy_stop_at_first_misfit():
    # the best ratio (7/6) takes 6 of 10 bytes, then 5 does not fit: greedy keeps 7;
    # the two items of ratio 1 fill the budget exactly: 10
    options = [[(6, 7.0)], [(5, 5.0)], [(5, 5.0)]]
    greedy = _greedy_by_ratio(options, 10)
    best = S.choose(options, 10)
    assert _value(options, greedy) == 7.0
    assert best == [None, 0, 0] and _value(options, best) == 10.0


def _brute_force(options, capacity):
    best = 0.0
    for combo in itertools.product(*[[None] + list(range(len(o))) for o in options]):
        if _weight(options, combo) <= capacity:
            best = max(best, _value(options, combo))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_knapsack_is_exact_against_brute_force(seed):
    rnd = random.Random(seed)
    options = []
    for _ in range(6):   # keep, and keep + accumulate (heavier, worth more)
        w, v = rnd.randint(1, 40), rnd.uniform(-0.5, 3.0)
        options.append([(w, v), (w + rnd.randint(1, 40), v + rnd.uniform(0.0, 3.0))])
    capacity = rnd.randint(10, 120)
    choice = S.choose(options, capacity)   # capacity < GRID_CELLS: one byte per cell, exact
    assert _weight(options, choice) <= capacity
    assert _value(options, choice) == pytest.approx(_brute_force(options, capacity))


def test_knapsack_on_a_coarse_grid_never_exceeds_the_capacity():
    rnd = random.Random(7)
    options = [[(rnd.randint(1000, 50_000), rnd.uniform(0.1, 1.0))] for _ in range(300)]
    capacity = 1_000_003
    choice = S.choose(options, capacity, cells=512)
    assert 0 < _weight(options, choice) <= capacity
    # rounding weights up to 1954-byte cells loses little against the exact fractional bound
    ratio = sorted((v / w, w) for ((w, v),) in options)[::-1]
    bound, room = 0.0, capacity
    for r, w in ratio:
        take = min(w, room)
        bound, room = bound + r * take, room - take
    assert _value(options, choice) >= 0.95 * bound


def test_unbounded_keeps_everything_that_helps_and_nothing_else():
    options = [[(10, 1.0), (20, 3.0)], [(10, -1.0)], [(5, 0.0)], [(7, 2.0), (9, 1.0)]]
    assert S.choose(options, INF) == [1, None, None, 0]
    assert S.choose(options, 0) == [None] * 4
    assert S.choose(options, -5) == [None] * 4


# ------------------------------------------------------------------- values and counts
class _Entry:
    """A registry entry's sizes (the planner and the rewrite only read these)."""

    def __init__(self, pid, numel=6, world=2):
        self.pid, self.name = pid, f"p{pid}"
        self.numel, self.shape = numel, torch.Size([numel])
        self.padded_numel = math.ceil(numel / world) * world
        self.compute_dtype = self.reduce_dtype = torch.float32
        self.shard = torch.empty(self.padded_numel // world)


@pytest.fixture
def entries(monkeypatch):
    table = {pid: _Entry(pid) for pid in range(1, 6)}
    monkeypatch.setattr(S, "lookup", table.__getitem__)
    return table


def test_values_count_runs_per_optimizer_step_and_fused_shares():
    cost = LinearCostModel(coeffs={"all_gather": (1.0, 0.01), "reduce_scatter": (2.0, 0.01)})
    gas = 4
    colls = [S.Collective("all_gather", 4, [(1, 100)]),              # forward, alone
             S.Collective("all_gather", 4, [(1, 100), (2, 50)]),     # backward, fused with 2
             S.Collective("reduce_scatter", 4, [(1, 100)])]
    cands = [S.Candidate(1, "p1", keep_bytes=96, accum_bytes=100, refresh_bytes=100),
             S.Candidate(2, "p2", keep_bytes=48, accum_bytes=50, refresh_bytes=50)]
    o1, o2 = S.options_of(cands, colls, cost, gas, excluded=set())
    # p1: 4 gathers of its own (2 s each), 4 shares of the fused one (1 s each), minus its
    # share of the refresh (1 s); accumulated: 3 of 4 reduce-scatters (3 s each) saved
    assert o1["gathers_per_step"] == 8 and o1["reduces_per_step"] == 4
    assert o1["keep"] == (96, pytest.approx(4 * 2.0 + 4 * 1.0 - 1.0))
    assert o1["keep_accumulate"] == (196, pytest.approx(11.0 + 3 * 3.0))
    assert o2["keep"] == (48, pytest.approx(4 * 0.5 - 0.5)) and o2["keep_accumulate"] is None
    counts = S.predict_counts(colls, keep={1}, accumulate={1}, gas=gas, refresh=[100])
    assert counts["all_gather"] == {"before": {"count": 8, "bytes": 1000},
                                    "after": {"count": 4 + 1, "bytes": 200 + 100}}
    assert counts["reduce_scatter"] == {"before": {"count": 4, "bytes": 400},
                                        "after": {"count": 1, "bytes": 100}}
    # accumulated members of a bucket are reduced together, once, on the last micro-step
    bucket = [S.Collective("reduce_scatter", 4, [(1, 100), (2, 50), (3, 30)])]
    assert S.predict_counts(bucket, keep={1, 2}, accumulate={1, 2}, gas=gas, refresh=[]) \
        ["reduce_scatter"]["after"] == {"count": 4 + 1, "bytes": 4 * 30 + 150}
    # without accumulation (gas 1) there is no accumulate option
    (o,) = S.options_of(cands[:1], colls, cost, 1, excluded=set())
    assert o["keep_accumulate"] is None


def test_collectives_are_read_from_graphs_with_their_runs(entries):
    g = fx.Graph()
    s1, s2, x = g.placeholder("s1"), g.placeholder("s2"), g.placeholder("x")
    a = g.call_function(ops.ALLGATHER, (s1, 1, [6], torch.float32))
    tok = g.call_function(ops.ALLGATHER_START, ([s1, s2], [1, 2], torch.float32))
    w = g.call_function(ops.ALLGATHER_WAIT, (tok, [1, 2]))
    r = g.call_function(ops.REDUCE_GRAD, (x, 3, 3, torch.float32))
    g.output((a, w, r))
    colls = S.collectives_of({"g0.fw": fx.GraphModule(nn.Module(), g)}, ["g0.fw"] * 4)
    assert [(c.kind, c.runs, c.members) for c in colls] == [
        ("all_gather", 4, [(1, 24)]), ("all_gather", 4, [(1, 24), (2, 24)]),
        ("reduce_scatter", 4, [(3, 24)])]


# ------------------------------------------------------------------------------- rewrite
def _calls(graph):
    return [n for n in graph.nodes if n.op == "call_function"]


def _val(n):
    return torch.empty(n)


def test_rewrite_retargets_synchronous_ops(entries):
    g = fx.Graph()
    s1, s2, x = g.placeholder("s1"), g.placeholder("s2"), g.placeholder("x")
    a = g.call_function(ops.ALLGATHER, (s1, 1, [6], torch.float32))
    b = g.call_function(ops.ALLGATHER, (s2, 2, [6], torch.float32))
    ra = g.call_function(ops.REDUCE_GRAD, (x, 1, 3, torch.float32))
    rb = g.call_function(ops.REDUCE_GRAD, (x, 2, 3, torch.float32))
    g.output((a, b, ra, rb))
    assert S.rewrite(g, keep={1, 2}, accumulate={1})
    assert [n.target for n in _calls(g)] == [ops.KEPT_PARAM, ops.KEPT_PARAM,
                                             ops.ACCUMULATE_GRAD, ops.REDUCE_GRAD]
    assert a.args == (s1, 1, [6], torch.float32) and ra.args == (x, 1, 3, torch.float32)
    assert not S.rewrite(g, keep={5}, accumulate=set())   # absent: a no-op


def _fused_graph():
    g = fx.Graph()
    shards = [g.placeholder(f"s{i}") for i in (1, 2, 3)]
    x = g.placeholder("x")
    c0 = g.call_function(torch.ops.aten.relu.default, (x,), name="c0")
    tok = g.call_function(ops.ALLGATHER_START, (shards, [1, 2, 3], torch.float32), name="start")
    tok.meta["val"] = _val(18)
    c1 = g.call_function(torch.ops.aten.sin.default, (c0,), name="c1")
    w = g.call_function(ops.ALLGATHER_WAIT, (tok, [1, 2, 3]), name="wait")
    w.meta["val"] = [_val(6)] * 3
    parts = [g.call_function(operator.getitem, (w, i), name=f"part{i}") for i in range(3)]
    uses = [g.call_function(torch.ops.aten.mul.default, (c1, p), name=f"use{i}")
            for i, p in enumerate(parts)]
    g.output(tuple(uses))
    return g, shards, uses


def test_rewrite_pulls_kept_members_out_of_a_fused_group(entries):
    g, shards, uses = _fused_graph()
    assert S.rewrite(g, keep={2}, accumulate=set())
    calls = _calls(g)
    start = next(n for n in calls if n.target is ops.ALLGATHER_START)
    wait = next(n for n in calls if n.target is ops.ALLGATHER_WAIT)
    kept = next(n for n in calls if n.target is ops.KEPT_PARAM)
    assert start.args == ([shards[0], shards[2]], [1, 3], torch.float32)
    assert wait.args == (start, [1, 3]) and len(wait.meta["val"]) == 2
    assert start.meta["val"].numel() == 12     # the in-flight buffer of the two left
    assert kept.args == (shards[1], 2, [6], torch.float32)
    assert calls.index(kept) < calls.index(wait)
    # every use reads its own parameter: getitem indices follow the rebuilt group
    assert uses[0].args[1].args == (wait, 0) and uses[2].args[1].args == (wait, 1)
    assert uses[1].args[1] is kept
    g.lint()


def test_rewrite_erases_a_group_whose_members_are_all_kept(entries):
    g, shards, uses = _fused_graph()
    assert S.rewrite(g, keep={1, 2, 3}, accumulate=set())
    targets = [n.target for n in _calls(g)]
    assert ops.ALLGATHER_START not in targets and ops.ALLGATHER_WAIT not in targets
    assert operator.getitem not in targets
    assert [u.args[1].args[:2] for u in uses] == [(s, p) for s, p in zip(shards, (1, 2, 3))]


def test_rewrite_pulls_kept_members_out_of_cross_graph_groups(entries):
    a = fx.Graph()
    xa = a.placeholder("x")
    ya = a.call_function(torch.ops.aten.relu.default, (xa,), name="ya")
    nxt = a.call_function(ops.ALLGATHER_FOR_NEXT, (ya, [1, 2], torch.float32), name="for_next")
    a.output((ya,))
    b = fx.Graph()
    s1, s2, xb = b.placeholder("s1"), b.placeholder("s2"), b.placeholder("x")
    prev = b.call_function(ops.ALLGATHER_FROM_PREV, ([s1, s2], [1, 2], torch.float32))
    prev.meta["val"] = [_val(6)] * 2
    p0 = b.call_function(operator.getitem, (prev, 0))
    p1 = b.call_function(operator.getitem, (prev, 1))
    out = b.call_function(torch.ops.aten.add.default, (p0, p1))
    b.output((out, xb))
    assert S.rewrite(a, keep={1}, accumulate=set()) and S.rewrite(b, keep={1}, accumulate=set())
    # both sides of the group keep the same members (the parked gather's key)
    assert nxt.args == (ya, [2], torch.float32)
    assert prev.args == ([s2], [2], torch.float32) and p1.args == (prev, 0)
    assert out.args[0].target is ops.KEPT_PARAM and out.args[0].args[:2] == (s1, 1)
    assert S.rewrite(a, keep={2}, accumulate=set()) and S.rewrite(b, keep={2}, accumulate=set())
    assert ops.ALLGATHER_FOR_NEXT not in [n.target for n in _calls(a)]
    assert [n.target for n in _calls(b)] == [ops.KEPT_PARAM, ops.KEPT_PARAM,
                                             torch.ops.aten.add.default]


def _reduce_bucket():
    """A graph with one bucket of two gradients (pids 1 and 2): (graph, ga, gb, start, wait)."""
    g = fx.Graph()
    x = g.placeholder("x")
    ga = g.call_function(torch.ops.aten.relu.default, (x,), name="ga")
    gb = g.call_function(torch.ops.aten.sin.default, (x,), name="gb")
    tok = g.call_function(ops.REDUCE_START, ([ga, gb], [1, 2]), name="start")
    tok.meta["val"] = _val(18)
    w = g.call_function(ops.REDUCE_WAIT, (tok, [1, 2]), name="wait")
    w.meta["val"] = [_val(3)] * 2
    outs = [g.call_function(operator.getitem, (w, i)) for i in range(2)]
    g.output(tuple(outs))
    return g, ga, gb, tok, w


def test_rewrite_pulls_accumulated_gradients_out_of_reduce_buckets(entries):
    g, ga, gb, tok, w = _reduce_bucket()
    # kept but not accumulated: the reduce stays in its bucket
    assert not S.rewrite(g, keep={1}, accumulate=set())
    assert S.rewrite(g, keep={1, 2}, accumulate={1})
    out = next(n for n in g.nodes if n.op == "output").args[0]
    assert out[0].target is ops.ACCUMULATE_GRAD and out[0].args == (ga, 1, 3, torch.float32)
    assert out[1].args == (w, 0) and tok.args == ([gb], [2]) and w.args == (tok, [2])
    assert tok.meta["val"].numel() == 6 + 3
    assert S.rewrite(g, keep={2}, accumulate={2})
    assert [n.target for n in _calls(g)] == [torch.ops.aten.relu.default,
                                             torch.ops.aten.sin.default,
                                             ops.ACCUMULATE_GRAD, ops.ACCUMULATE_GRAD]


def test_rewrite_takes_accumulated_members_out_of_a_bucket_together(entries):
    """A bucket of three gradients, two of them accumulated (a budget that keeps a part): the
    two leave together as one `accumulate_start` bucket (one reduce-scatter on the last
    micro-step), not as one `accumulate_grad` each; the third stays in the old bucket; every
    output reads the value of its own member."""
    g = fx.Graph()
    x = g.placeholder("x")
    grads = [g.call_function(torch.ops.aten.relu.default, (x,), name=f"g{i}") for i in (1, 2, 3)]
    tok = g.call_function(ops.REDUCE_START, (grads, [1, 2, 3]), name="start")
    tok.meta["val"] = _val(27)
    w = g.call_function(ops.REDUCE_WAIT, (tok, [1, 2, 3]), name="wait")
    w.meta["val"] = [_val(3), _val(3), _val(3)]
    outs = [g.call_function(operator.getitem, (w, i)) for i in range(3)]
    g.output(tuple(outs))
    assert S.rewrite(g, keep={1, 3}, accumulate={1, 3})
    g.lint()
    starts = [n for n in _calls(g) if n.target in (ops.REDUCE_START, ops.ACCUMULATE_START)]
    assert [(n.target, n.args) for n in starts] == [
        (ops.ACCUMULATE_START, ([grads[0], grads[2]], [1, 3])), (ops.REDUCE_START, ([grads[1]], [2]))]
    acc = starts[0]
    assert acc.meta["val"].numel() == 2 * (6 + 3)         # padded gradient + shard, per member
    assert tok.meta["val"].numel() == 6 + 3 and w.args == (tok, [2])
    (acc_wait,) = [n for n in acc.users]
    assert acc_wait.target is ops.REDUCE_WAIT and acc_wait.args == (acc, [1, 3])
    out = next(n for n in g.nodes if n.op == "output").args[0]
    assert [o.args for o in out] == [(acc_wait, 0), (w, 0), (acc_wait, 1)]
    assert not any(n.target is ops.ACCUMULATE_GRAD for n in _calls(g))
    assert not S.rewrite(g, keep={1, 3}, accumulate={1, 3})   # done already: unchanged
    # one accumulated member alone: an accumulate_grad of its own, the others stay bucketed
    counts = S.predict_counts([S.Collective("reduce_scatter", 4, [(1, 10), (2, 10), (3, 10)])],
                              keep=set(), accumulate={1, 3}, gas=4, refresh=[])
    assert counts["reduce_scatter"]["after"] == {"count": 4 + 1, "bytes": 4 * 10 + 20}
    counts = S.predict_counts([S.Collective("reduce_scatter", 4, [(1, 10), (2, 10), (3, 10)])],
                              keep=set(), accumulate={1}, gas=4, refresh=[])
    assert counts["reduce_scatter"]["after"] == {"count": 4 + 1, "bytes": 4 * 20 + 10}


def test_rewrite_keeps_a_bucket_whose_members_are_all_accumulated(entries):
    """Every member accumulated: the bucket stays whole, as `accumulate_start` (one
    reduce-scatter on the window's last micro-step), not one `accumulate_grad` per member."""
    g, ga, gb, tok, w = _reduce_bucket()
    assert S.rewrite(g, keep={1, 2}, accumulate={1, 2})
    assert tok.target is ops.ACCUMULATE_START and tok.args == ([ga, gb], [1, 2])
    assert w.args == (tok, [1, 2]) and not any(n.target is ops.ACCUMULATE_GRAD for n in _calls(g))
    assert not S.rewrite(g, keep={1, 2}, accumulate={1, 2})   # accumulated already: unchanged


# ------------------------------------------------------------------------- multi-rank
GAS = 4
STEPS = 6
_UNSHARD = {"passes": ("selective_unshard",), "warmup_steps": 1}
_REC = ("comm", "report", "unshard")
# the pass alone at accumulation 4, and the budgets made from its figures (`budget_runs`), in
# the full suite ([Note: the core matrix] in tests/_train.py): the core runs the pass with
# prefetch on graph_break here and on the tiny Llama in test_prefetch's fx2-random-times, and
# under a budget in test_activation_budget's trade-all scenario
FITS_ALL = scenario("llama-adamw-gas4-clip-unshard", "llama", "adamw", 1e-2, gas=GAS, clip=0.1,
                    steps=STEPS, record=_REC, extended=True, **_UNSHARD)
# auto's order: bucket_reduce after selective_unshard buckets the accumulated gradients
UNSHARD_REDUCE = scenario("llama-adamw-gas4-clip-unshard-reduce", "llama", "adamw", 1e-2,
                          gas=GAS, clip=0.1, steps=STEPS, record=_REC, warmup_steps=1,
                          passes=("selective_unshard", "bucket_reduce"), extended=True)

JOBS = Jobs({
    "fx2": (2, [
        FITS_ALL, UNSHARD_REDUCE,
        scenario("llama-adamw-gas2-clip-prefetch-unshard", "llama", "adamw", 1e-2, gas=2,
                 clip=0.1, record=_REC, passes=("prefetch", "selective_unshard"), warmup_steps=1,
                 extended=True),
        scenario("llama-sgd-gas2-prefetch-reduce-unshard", "llama", "sgd", 0.1, gas=2,
                 record=_REC, passes=("prefetch", "bucket_reduce", "selective_unshard"),
                 warmup_steps=1, extended=True),
        scenario("graph_break-sgd-gas2-clip-prefetch-unshard", "graph_break", "sgd", 0.1, gas=2,
                 clip=0.1, record=_REC, passes=("prefetch", "selective_unshard"), warmup_steps=1),
    ]),
    "fx4": (4, [scenario("llama-sgd-gas2-clip-unshard-prefetch", "llama", "sgd", 0.1, gas=2,
                         clip=0.1, record=_REC, passes=("selective_unshard", "prefetch"),
                         warmup_steps=1, extended=True),
                {**FITS_ALL, "id": FITS_ALL["id"] + "-4ranks"}]),
    # every scheduling pass under Inductor, on 2 ranks (tests/distributed/test_prefetch.py's Inductor
    # coverage too: one cold Inductor job instead of two)
    "inductor2": (2, [scenario("llama-sgd-gas2-clip-prefetch-reduce-unshard-inductor", "llama",
                               "sgd", 0.1, gas=2, clip=0.1, compiler="inductor", record=_REC,
                               passes=("prefetch", "bucket_reduce", "selective_unshard"),
                               warmup_steps=1)]),
}, timeout=900)


def _kind(sc):
    return f"{sc['model']}/{sc['config']['compiler']}+" + "+".join(sc["config"].get("passes") or ("insertion",))


def _decisions(result):
    (entry,) = [p for p in result["report"]["passes"] if p["pass"] == "selective_unshard"]
    return entry


def _per_step(result, gas):
    """Collectives (count, bytes) of the last optimizer step, measured with comm_stats()."""
    out = {}
    for k in ("all_gather", "reduce_scatter"):
        parts = [c[k] for c in result["comm_fwd"][-gas:] + result["comm_bwd"][-gas:]]
        parts.append(result["comm_step"][-1][k])
        out[k] = {"count": sum(p[0] for p in parts), "bytes": sum(p[1] for p in parts)}
    return out


def _check_kept(result, entry):
    """The runtime keeps exactly the planned set; copies intact in the window, fresh after
    every step."""
    d = entry["decisions"]
    planned = [i["param"] for i in d["keep"]]
    checks = result["unshard_before_step"] + result["unshard_after_step"]
    applied = [c for c in checks if c["kept"]]
    assert applied, "nothing was ever kept"
    for c in applied:
        assert c["kept"] == planned and c["accumulate"] == sorted(d["accumulate"])
        assert c["stale"] == [], c["stale"]


@pytest.mark.parametrize("job, sc", [p for p in JOBS.params()
                                     if p.values[1] is not UNSHARD_REDUCE])
def test_parity_with_selective_unshard(job, sc):
    results = JOBS.results(job, sc["id"])
    compare_to_reference(sc, results, kind=_kind(sc))
    for r in results:
        _check_kept(r, _decisions(r))
        assert _decisions(r) == _decisions(results[0])   # every rank decided the same
    d = _decisions(results[0])["decisions"]
    assert d["keep"], "the pass kept nothing"
    if sc["config"]["gradient_accumulation_steps"] > 1:
        # accumulating saves a bucketed gradient's bytes of its reduce-scatter: chosen unless
        # the calibration on a loaded machine found bytes free (a zero slope, cost._fit)
        per_byte = results[0]["report"]["cost_model"]["coeffs"]["reduce_scatter"][1]
        assert d["accumulate"] or per_byte == 0, per_byte
    # measured counts per optimizer step are the predicted ones
    measured = _per_step(results[0], sc["config"]["gradient_accumulation_steps"])
    assert measured == {k: v["after"] for k, v in d["per_step"].items()}, (measured, d["per_step"])
    # the report counts them where they run: an accumulating graph reduces in the window's
    # last micro-step only (not once per run), the refresh after the step
    rep = results[0]["report"]
    counted = {k: sum(row["count"] for row in rep["step_collectives"] if row["kind"] == k)
               for k in measured}
    assert counted == {k: v["count"] for k, v in measured.items()}, rep["step_collectives"]
    assert rep["step_summary"]["collectives"] == sum(v["count"] for v in measured.values())


def test_accumulated_gradients_are_reduced_in_buckets():
    """selective_unshard then bucket_reduce (auto's order), 4 micro-steps: every gradient is
    accumulated locally, and the last micro-step reduces the accumulators in bucket_reduce's
    buckets, one reduce-scatter per bucket, not one per parameter (21 here); parity with the
    eager reference, and the report counts them where they run."""
    results = JOBS.results("fx2", UNSHARD_REDUCE["id"])
    compare_to_reference(UNSHARD_REDUCE, results, kind=_kind(UNSHARD_REDUCE))
    r = results[0]
    d = _decisions(r)["decisions"]
    padded = _padded_bytes("llama", 2)
    assert sorted(d["accumulate"]) == sorted(padded)
    (br,) = [p for p in r["report"]["passes"] if p["pass"] == "bucket_reduce"]
    buckets = [b for g in br["decisions"].values() for b in g["buckets"]]
    assert buckets and all(b["accumulated"] for b in buckets)
    assert sorted(n for b in buckets for n in b["params"]) == sorted(padded)
    measured = _per_step(r, GAS)
    assert measured["reduce_scatter"] == {"count": len(buckets), "bytes": sum(padded.values())}
    assert len(buckets) < len(padded)
    # reduced on the last micro-step only: nothing in the earlier backward runs
    assert all(b["reduce_scatter"] == (0, 0) for b in r["comm_bwd"][-GAS:-1])
    counted = sum(row["count"] for row in r["report"]["step_collectives"]
                  if row["kind"] == "reduce_scatter")
    assert counted == len(buckets)


def _padded_bytes(model_name, world):
    model = _models.build_model(model_name)
    return {n: math.ceil(p.numel() / world) * world * 4 for n, p in model.named_parameters()}


@pytest.mark.extended
def test_budget_that_fits_everything_gathers_and_reduces_once_per_parameter(budget_runs):
    base = budget_runs["none"][1][0]   # the collectives of the graphs as compiled
    r = JOBS.results("fx2", FITS_ALL["id"])[0]
    d = _decisions(r)["decisions"]
    padded = _padded_bytes("llama", 2)
    assert d["budget_bytes"] is None
    assert sorted(i["param"] for i in d["keep"]) == sorted(padded)
    assert sorted(d["accumulate"]) == sorted(padded)
    before, after = _per_step(base, GAS), _per_step(r, GAS)
    print(f"per optimizer step (gas {GAS}): all-gathers {before['all_gather']} -> "
          f"{after['all_gather']}; reduce-scatters {before['reduce_scatter']} -> "
          f"{after['reduce_scatter']}")
    # one refresh collective carries exactly one gather's worth of bytes per parameter
    assert after["all_gather"] == {"count": len(d["refresh_bytes"]), "bytes": sum(padded.values())}
    assert len(d["refresh_bytes"]) == 1
    # one reduce-scatter per parameter (the last micro-step's), of its padded gradient
    assert after["reduce_scatter"] == {"count": len(padded), "bytes": sum(padded.values())}
    assert before == {k: v["before"] for k, v in d["per_step"].items()}
    assert before["reduce_scatter"]["count"] == GAS * len(padded)


def _initial_peak(result) -> int:
    return max(p["peak_bytes"] for g in result["report"]["graphs"] for s in g["slots"]
               for p in s["profiles"] if p["label"] == "initial")


@pytest.fixture(scope="module")
def budget_runs():
    """Budgets from the measured figures of the run that fits everything: its insertion-only
    peak plus half of what keeping everything costs (a part), or plus nothing (the pass
    changes no graph: the other tests' baseline of collectives), and plus all of it shared
    with prefetch and bucket_reduce; the three run in one job."""
    r = JOBS.results("fx2", FITS_ALL["id"])[0]
    d = _decisions(r)["decisions"]
    peak = _initial_peak(r)
    assert peak == d["peak_bytes"]
    total = d["kept_bytes"] + d["accumulator_bytes"]
    scs = [scenario(f"llama-adamw-gas4-clip-unshard-{name}", "llama", "adamw", 1e-2, gas=GAS,
                    clip=0.1, steps=STEPS, record=_REC, memory_budget=budget, **_UNSHARD)
           for name, budget in (("part", peak + total // 2), ("none", peak))]
    # after prefetch and bucket_reduce took their share of the same budget: fused groups and
    # buckets lose some members and keep others
    scs.append(scenario("llama-adamw-gas4-clip-prefetch-reduce-unshard-shared", "llama", "adamw",
                        1e-2, gas=GAS, clip=0.1, steps=STEPS, record=_REC,
                        memory_budget=peak + total, warmup_steps=1,
                        passes=("prefetch", "bucket_reduce", "selective_unshard")))
    per_rank = run_distributed(run_training, 2, scs, timeout=900)
    out = {"peak": peak, "total": total}
    for i, sc in enumerate(scs):
        results = [rank[i] for rank in per_rank]
        for res in results:
            assert "error" not in res, res["error"]
        out[sc["id"].rsplit("-", 1)[1]] = (sc, results)
    return out


@pytest.mark.extended
def test_budget_that_fits_a_part_keeps_exactly_the_chosen_set_within_budget(budget_runs):
    sc, results = budget_runs["part"]
    budget = sc["config"]["memory_budget"]
    entry = _decisions(results[0])
    d = entry["decisions"]
    assert d["budget_bytes"] == budget and d["peak_bytes"] == budget_runs["peak"]
    assert 0 < len(d["keep"]) < 21
    assert 0 < d["kept_bytes"] + d["accumulator_bytes"] <= budget - d["peak_bytes"]
    for r in results:
        _check_kept(r, _decisions(r))
    measured = _per_step(results[0], GAS)
    assert measured == {k: v["after"] for k, v in d["per_step"].items()}
    base = _per_step(budget_runs["none"][1][0], GAS)
    assert measured["all_gather"]["count"] < base["all_gather"]["count"]
    # measured: every profile (before the pass, and the re-profile with the kept parameters
    # and accumulators held) stays within the budget
    peaks = {s["slot"]: [(p["label"], p["peak_bytes"]) for p in s["profiles"]]
             for g in results[0]["report"]["graphs"] for s in g["slots"]}
    print(f"budget {budget} (peak {d['peak_bytes']} + {budget - d['peak_bytes']}): kept "
          f"{len(d['keep'])} params, {d['kept_bytes']} + {d['accumulator_bytes']} bytes; "
          f"profiles {peaks}")
    assert any(label == "after selective_unshard" for v in peaks.values() for label, _ in v)
    assert max(_all_peaks(results[0])) <= budget
    compare_to_reference(sc, results, kind=_kind(sc) + " (part)")


def _all_peaks(result):
    return [p["peak_bytes"] for g in result["report"]["graphs"] for s in g["slots"]
            for p in s["profiles"]]


@pytest.mark.extended
def test_budget_shared_with_prefetch_and_bucket_reduce(budget_runs):
    sc, results = budget_runs["shared"]
    budget = sc["config"]["memory_budget"]
    d = _decisions(results[0])["decisions"]
    groups = [len(g["pids"]) for p in results[0]["report"]["passes"] if p["pass"] == "prefetch"
              for dec in p["decisions"].values() for g in dec["groups"]]
    print(f"prefetch groups {groups}; kept {len(d['keep'])} of 21 in "
          f"{d['capacity_bytes']} bytes left")
    for r in results:
        _check_kept(r, _decisions(r))
    assert d["keep"] and max(_all_peaks(results[0])) <= budget
    measured = _per_step(results[0], GAS)
    assert measured == {k: v["after"] for k, v in d["per_step"].items()}
    # bucket_reduce's buckets as selective_unshard leaves them: the accumulated members of a
    # bucket reduced together once per optimizer step (one alone by itself), the others per run
    (br,) = [p for p in results[0]["report"]["passes"] if p["pass"] == "bucket_reduce"]
    acc = set(d["accumulate"])
    expect, split = 0, 0
    for g in br["decisions"].values():
        for b in g["buckets"]:
            a = [n for n in b["params"] if n in acc]
            expect += (1 if a else 0) + (GAS if len(a) < len(b["params"]) else 0)
            split += 1 < len(a) < len(b["params"])
    print(f"accumulated {len(acc)}; buckets split in two: {split}; reduce-scatters per step "
          f"{measured['reduce_scatter']['count']}")
    assert measured["reduce_scatter"]["count"] == expect
    compare_to_reference(sc, results, kind=_kind(sc) + " (budget)")


@pytest.mark.extended
def test_budget_with_no_spare_memory_changes_nothing(budget_runs):
    sc, results = budget_runs["none"]
    entry = _decisions(results[0])
    assert entry["decisions"]["keep"] == [] and entry["changed"] == []
    assert all(c["kept"] == [] for c in results[0]["unshard_after_step"])
    # the collectives measured are those the pass counted in the graphs as compiled
    per_step = entry["decisions"]["per_step"]
    assert _per_step(results[0], GAS) == {k: v["before"] for k, v in per_step.items()} \
        == {k: v["after"] for k, v in per_step.items()}
    assert [s["version"] for g in results[0]["report"]["graphs"] for s in g["slots"]] == [0, 0]


# --------------------------------------------------- a stale kept copy would be caught
def _stale_job(rank, world):
    import deepcompile

    model = _models.build_model("mlp")
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx", "warmup_steps": 1,
                                            "gradient_accumulation_steps": 2,
                                            "passes": ("selective_unshard",), "measure_steps": 0})
    micro, checks = 0, []

    def step():
        nonlocal micro
        for _ in range(2):
            batch = _models.local_batch("mlp", micro, rank, world)
            engine.backward(_models.loss_of(engine(**batch)))
            micro += 1
        engine.step()
        return engine._runtime.kept.stale()

    for _ in range(5):
        checks.append(step())
    store = engine._runtime.kept
    kept = [e.name for e in store.entries]
    store.refresh = lambda: 0   # this engine's refresh skipped: the copies go stale
    skipped = step()
    return {"checks": checks, "kept": kept, "skipped": skipped}


def test_kept_parameters_are_refreshed_after_every_optimizer_step():
    r = run_distributed(_stale_job, 2, timeout=600)[0]
    assert len(r["kept"]) == 6                 # mlp: every parameter kept (unbounded)
    assert r["checks"] == [[]] * 5            # fresh after every step, once kept (step 3 on)
    assert sorted(r["skipped"]) == sorted(r["kept"])   # the check catches a skipped refresh


# ------------------------------------------------------------------------- plan cache
def test_a_plan_from_the_cache_fills_the_kept_parameters_before_the_next_forward(tmp_path):
    scs = [scenario(f"mlp-sgd-gas2-unshard-cache-{i}", "mlp", "sgd", 0.1, gas=2, steps=5,
                    record=_REC, cache_dir=str(tmp_path), **_UNSHARD) for i in (1, 2)]
    per_rank = run_distributed(run_training, 2, scs, timeout=900)
    first, second = ([rank[i] for rank in per_rank] for i in range(2))
    assert not first[0]["report"]["cache"]["hit"] and second[0]["report"]["cache"]["hit"]
    assert _decisions(second[0])["decisions"] == _decisions(first[0])["decisions"]
    # loaded at the end of the warm-up step: kept and fresh from the first step on
    assert second[0]["unshard_after_step"][0]["kept"]
    for sc, results in zip(scs, (first, second)):
        for r in results:
            _check_kept(r, _decisions(r))
        compare_to_reference(sc, results, kind=_kind(sc) + " (cache)")
    assert _per_step(second[0], 2) == _per_step(first[0], 2)


# ------------------------------------------ Inductor may not write into a kept parameter
class _PointwiseOnWeights(nn.Module):
    """Each weight's last use in a graph is a pointwise kernel of its own size: the pattern in
    which Inductor computes the result in place, in the buffer of its input."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.v = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        return (torch.tanh(x @ torch.tanh(self.w)) @ (self.v * 2.0)).square().mean()


def _batches(step, rank, world, gas=2, per_rank=4):
    g = torch.Generator().manual_seed(100 + step)
    full = torch.randn(gas, per_rank * world, 16, generator=g)
    return full, full[:, rank * per_rank:(rank + 1) * per_rank]


def _inductor_ownership_job(rank, world, steps):
    import deepcompile

    torch.manual_seed(0)
    engine = deepcompile.initialize(_PointwiseOnWeights(),
                                    optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "inductor", "warmup_steps": 1,
                                            "gradient_accumulation_steps": 2,
                                            "passes": ("selective_unshard",), "measure_steps": 0})
    losses, stale = [], []
    for step in range(steps):
        _, local = _batches(step, rank, world)
        for micro in range(2):
            loss = engine(local[micro])
            engine.backward(loss)
            losses.append(loss.item())
        stale.append(engine._runtime.kept.stale())   # before the refresh: nothing overwritten
        engine.step()
    return {"losses": losses, "stale": stale, "state": engine.full_state_dict(),
            "kept": [e.name for e in engine._runtime.kept.entries]}


def _eager_reference(steps, world):
    torch.manual_seed(0)
    model = _PointwiseOnWeights()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        full, _ = _batches(step, 0, world)
        per_rank = full.shape[1] // world
        for micro in range(2):
            # the mean over ranks of each rank's mean loss: the loss of the whole batch
            rank_losses = [model(full[micro, r * per_rank:(r + 1) * per_rank]) for r in range(world)]
            loss = sum(rank_losses) / world
            (loss / 2).backward()
            losses.append([x.item() for x in rank_losses])
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.inductor
def test_inductor_never_writes_into_a_kept_parameter():
    steps = 6   # warm-up, profile, re-profile, then three steps of Inductor code
    results = run_distributed(_inductor_ownership_job, 2, steps, timeout=900)
    ref_losses, ref_state = _eager_reference(steps, 2)
    for rank, r in enumerate(results):
        assert r["kept"] == ["w", "v"]
        assert r["stale"] == [[]] * steps, r["stale"]
        assert max(abs(a - b[rank]) for a, b in zip(r["losses"], ref_losses)) < 1e-5
    for name, ref in ref_state.items():
        assert (results[0]["state"][name] - ref).abs().max() < 1e-5, name


# --------------------------------------------------------------------------- world size 1
def _world1_engine(passes, dtype):
    import deepcompile

    model = _models.build_model("mlp")
    return deepcompile.initialize(
        model, functools.partial(torch.optim.AdamW, lr=1e-2),
        deepcompile.Config(compiler="fx", passes=passes, param_dtype=dtype,
                           gradient_accumulation_steps=2, measure_steps=0))


def _casts_in_graphs(engine, run):
    """Casts of a shard (its storage) to another dtype inside the lowered graphs while `run`
    runs (a dispatch mode inside each graph's runner: around a compiled call it would make
    Dynamo run eagerly), and in `engine.step()` (the refresh)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shards = {e.shard.untyped_storage().data_ptr(): e.shard.dtype for e in engine._registry}
    seen = {"graphs": 0, "step": 0}

    class Casts(TorchDispatchMode):
        where = "graphs"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._foreach_copy_.default:   # (destinations, sources)
                pairs = zip(args[0], args[1])
            else:
                pairs = [(out, args[0] if args else None)]
            for dst, src in pairs:
                if (isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)
                        and shards.get(src.untyped_storage().data_ptr()) == src.dtype
                        and dst.dtype != src.dtype):
                    seen[self.where] += 1
            return out

    def wrap(fn, where):
        def inner(*a, **k):
            mode = Casts()
            mode.where = where
            with mode:
                return fn(*a, **k)
        return inner

    slots = list(engine._pipeline.slots.values())
    saved = [s.runner for s in slots]
    for s in slots:
        s.runner = wrap(s.runner, "graphs")
    step = engine.step
    engine.step = wrap(step, "step")
    try:
        run()
    finally:
        for s, r in zip(slots, saved):
            s.runner = r
        engine.step = step
    return seen


def test_at_world_size_1_a_casting_gather_is_kept_and_cast_once_per_step(group):
    """At world size 1 with a compute dtype other than the masters' every use of a parameter
    casts its shard (forward and backward, each micro-step). `selective_unshard` keeps a copy
    cast once per optimizer step by the refresh: the lowered graphs cast nothing, and training
    is bitwise the same as without the pass (a cast is a cast). In fp32 (the gather is a view)
    it keeps nothing. The MLP, its inputs in the compute dtype."""
    def batch(micro, dtype):
        return {k: v.to(dtype) if dtype is not None else v
                for k, v in _models.local_batch("mlp", micro, 0, 1).items()}

    def train(passes, dtype, steps=14):
        torch.manual_seed(0)
        engine = _world1_engine(passes, dtype)
        losses = []
        for i in range(steps):
            for m in range(2):
                loss = _models.loss_of(engine(**batch(2 * i + m, dtype)))
                engine.backward(loss)
                losses.append(loss.item())
            engine.step()
        return engine, losses

    def one_step(engine, i):
        def run():
            for m in range(2):
                engine.backward(_models.loss_of(engine(**batch(2 * i + m, torch.bfloat16))))
            engine.step()
        return run

    plain, plain_losses = train((), torch.bfloat16)
    kept, kept_losses = train(("selective_unshard",), torch.bfloat16)
    assert kept.report().phase == "steady"
    (entry,) = [p for p in kept.report().to_dict()["passes"] if p["pass"] == "selective_unshard"]
    assert entry["kept"] and len(entry["decisions"]["keep"]) == len(list(kept._registry))
    n = len(list(plain._registry))
    before = _casts_in_graphs(plain, one_step(plain, 14))
    after = _casts_in_graphs(kept, one_step(kept, 14))
    assert before["graphs"] >= 2 * n and before["step"] == 0, before   # forward + backward, x2
    assert after == {"graphs": 0, "step": n}, after                    # the refresh, once each
    assert kept_losses == plain_losses
    a, b = plain.full_state_dict(), kept.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    fp32, _ = train(("selective_unshard",), None, steps=8)
    (entry,) = [p for p in fp32.report().to_dict()["passes"] if p["pass"] == "selective_unshard"]
    assert entry["decisions"]["keep"] == [] and not entry["changed"]
