"""Pass `bucket_reduce` (issue 4, reduce side): asynchronous, bucketed gradient reduce-scatters.

Unit tests of the planner on synthetic backward graphs with synthetic profiles (budget held at
every node, a wait not pushed further than it needs, buckets exactly when the cost model favours
them, unattainable budgets reported) and of the rewrite on a synthetic FX graph. The multi-rank
tests (parity, fewer reduce-scatters with the same bytes) run in `test_prefetch.py`'s jobs.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx, nn

from deepcompile.compiler.cost import LinearCostModel
from deepcompile.passes import bucket_reduce as B
from deepcompile.passes.prefetch import Step

INF = float("inf")


def _cost(latency, per_byte):
    return LinearCostModel(coeffs={"all_gather": (0.0, 0.0),
                                   "reduce_scatter": (latency, per_byte)})


def _graph(times, reduces, live=None):
    """compute steps c0.. with `times`; a reduce of (bytes) right after each index in `reduces`."""
    live = live or [100] * len(times)
    steps, rs = [], []
    for i, t in enumerate(times):
        steps.append(Step(f"c{i}", "compute", t, live[i]))
        if i in reduces:
            rs.append(B.Reduce(f"r{i}", len(steps), reduces[i], pid=len(rs),
                               grad_bytes=reduces[i] // 2))
            steps.append(Step(f"r{i}", "reduce_scatter", 0.5, live[i]))
    return steps, rs


def _simulated(steps, plan, reduces):
    """The memory curve of a plan, recomputed independently of the planner."""
    index = {s.name: i for i, s in enumerate(steps)}
    by_name = {r.name: r for r in reduces}
    extra = [0] * len(steps)
    for b in plan["buckets"]:
        last = index[b["start_after"]]
        for m in b["members"][:-1]:   # earlier members' gradients wait for the last one
            for j in range(index[m], last):
                extra[j] += by_name[m].grad_bytes
        end = len(steps) if b["wait_before"] is None else index[b["wait_before"]]
        for j in range(last + 1, end):
            extra[j] += b["bytes"]
    return [s.live_bytes + e for s, e in zip(steps, extra)]


def test_wait_is_not_pushed_further_than_it_needs():
    # reduce of 10 bytes at 1 s/byte = 10 s; after it, compute 4, 4, 4, 4: covered after three
    steps, rs = _graph([1, 4, 4, 4, 4], {0: 10})
    plan = B.plan_graph(steps, rs, _cost(0.0, 1.0), INF)
    (b,) = plan["buckets"]
    assert b["start_after"] == "r0" and b["wait_before"] == "c4"
    assert b["hidden_s"] == 12 and b["predicted_s"] == 10


def test_wait_goes_to_the_end_when_compute_cannot_hide_it():
    steps, rs = _graph([1, 1, 1], {0: 100})
    (b,) = B.plan_graph(steps, rs, _cost(0.0, 1.0), INF)["buckets"]
    assert b["wait_before"] is None and b["hidden_s"] == 2


@pytest.mark.parametrize("budget", [195, 200, 205, 250, 400])
def test_budget_holds_at_every_node(budget):
    live = [100, 150, 190, 120, 100, 180, 100, 100]
    steps, rs = _graph([1] * 8, {0: 10, 2: 10, 4: 10, 5: 10}, live)
    plan = B.plan_graph(steps, rs, _cost(0.0, 1.0), budget)
    assert not plan["unattainable"]
    curve = _simulated(steps, plan, rs)
    assert max(curve) <= budget and plan["peak_after"] == max(curve)


def test_buckets_form_when_and_only_when_the_cost_model_favours_them():
    steps, rs = _graph([0.001] * 6, {0: 64, 1: 64, 2: 64, 3: 64})
    latency_bound = B.plan_graph(steps, rs, _cost(1.0, 1e-6), INF)
    assert [len(b["members"]) for b in latency_bound["buckets"]] == [4]
    bandwidth_bound = B.plan_graph(steps, rs, _cost(0.0, 1e-3), INF)   # cost(a+b) == cost(a)+cost(b)
    assert [len(b["members"]) for b in bandwidth_bound["buckets"]] == [1, 1, 1, 1]
    capped = B.plan_graph(steps, rs, _cost(1.0, 1e-6), INF, max_bucket_bytes=128)
    assert [len(b["members"]) for b in capped["buckets"]] == [2, 2]


def test_accumulated_gradients_get_buckets_of_their_own():
    """`accumulate_grad`s (reduced on the window's last micro-step only) and `reduce_grad`s
    (every micro-step) never share a bucket; each kind fuses as before."""
    import dataclasses

    steps, rs = _graph([0.001] * 6, {0: 64, 1: 64, 2: 64, 3: 64, 4: 64})
    rs = [dataclasses.replace(r, accumulated=i in (0, 1, 3)) for i, r in enumerate(rs)]
    plan = B.plan_graph(steps, rs, _cost(1.0, 1e-6), INF)
    assert [(b["members"], b["accumulated"]) for b in plan["buckets"]] == [
        (["r0", "r1"], True), (["r2"], False), (["r3"], True), (["r4"], False)]
    # the summary says which buckets launch once per optimizer step, not per graph run
    lines = B.summary({"g0.bw": plan})
    assert lines[0] == "reduce-scatters per graph run: 5 -> 4"
    assert lines[1].startswith("of which 2 buckets of 3 accumulated gradients: launched once "
                               "per optimizer step")


def test_a_gradient_is_not_held_back_longer_than_its_collective_takes():
    # the compute between the first and the second gradient (5 s) exceeds the second's
    # predicted time (1 s): no bucket, though latency favours one
    steps, rs = _graph([0.1, 5, 0.1], {0: 8, 1: 8})
    plan = B.plan_graph(steps, rs, _cost(1.0, 1e-9), INF)
    assert [len(b["members"]) for b in plan["buckets"]] == [1, 1]


def test_budget_below_the_insertion_peak_is_unattainable():
    steps, rs = _graph([1, 1], {0: 10}, [300, 100])
    plan = B.plan_graph(steps, rs, _cost(0.0, 1.0), 200)
    assert plan["unattainable"] and plan["buckets"] == []
    assert plan["insertion_peak_bytes"] == 300 and plan["budget_bytes"] == 200


def _backward_graph(monkeypatch, use_ra=False):
    from deepcompile.runtime import ops

    class Entry:
        def __init__(self, pid):
            self.pid, self.padded_numel, self.reduce_dtype = pid, 16, torch.float32
            self.shard, self.name = torch.empty(8), f"p{pid}"

    monkeypatch.setattr(B, "lookup", Entry)
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.relu.default, (x,), name="ga")
    ra = g.call_function(ops.REDUCE_GRAD, (a, 1, 8, torch.float32), name="ra")
    b = g.call_function(torch.ops.aten.sin.default, (x,), name="gb")
    rb = g.call_function(ops.REDUCE_GRAD, (b, 2, 8, torch.float32), name="rb")
    c = g.call_function(torch.ops.aten.cos.default, (x,), name="c")
    if use_ra:   # a use of the reduction in the graph, before its planned wait
        c = g.call_function(torch.ops.aten.add.Tensor, (c, ra), name="c")
    g.output((ra, rb, c))
    for n in (a, b, c):
        n.meta["val"] = torch.empty(4, 4)
    for n in (ra, rb):
        n.meta["val"] = torch.empty(8)
    gm = fx.GraphModule(nn.Module(), g)

    class Slot:
        pass

    slot = Slot()
    slot.gm = gm
    ctx = type("Ctx", (), {"slots": {"g0.bw": slot}})()
    decisions = {"g0.bw": {"buckets": [
        {"members": ["ra", "rb"], "pids": [1, 2], "start_after": "rb", "wait_before": None,
         "bytes": 128}]}}
    return gm, ctx, decisions, (a, b)


def test_apply_rewrites_a_backward_graph(monkeypatch):
    from deepcompile.runtime import ops

    gm, ctx, decisions, (a, b) = _backward_graph(monkeypatch)
    assert B.apply(ctx, decisions) == ["g0.bw"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    targets = [n.target for n in calls]
    assert ops.REDUCE_GRAD not in targets
    start, wait = targets.index(ops.REDUCE_START), targets.index(ops.REDUCE_WAIT)
    assert targets[:start] == [torch.ops.aten.relu.default, torch.ops.aten.sin.default]
    assert targets[start + 1] is torch.ops.aten.cos.default and wait == start + 2
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert [o.target for o in out[:2]] == [operator.getitem, operator.getitem]
    assert [o.args for o in out[:2]] == [(calls[wait], 0), (calls[wait], 1)]
    assert calls[start].args[0] == [a, b]


def test_apply_refuses_a_bucket_whose_value_the_graph_uses_before_the_wait(monkeypatch):
    gm, ctx, decisions, _ = _backward_graph(monkeypatch, use_ra=True)
    with pytest.raises(RuntimeError, match=r"bucket_reduce: g0.bw: the plan buckets \['ra'\]"):
        B.apply(ctx, decisions)


@pytest.mark.parametrize("use_ra", [False, True])
def test_a_reduction_the_graph_uses_is_left_out_of_the_buckets(monkeypatch, use_ra):
    from deepcompile.runtime import ops

    gm, ctx, _, _ = _backward_graph(monkeypatch, use_ra=use_ra)
    node = type("ProfiledNode", (), {})
    nodes = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            p = node()
            p.name, p.time_s, p.live_bytes = n.name, 1.0, 100
            p.kind = "reduce_scatter" if n.target is ops.REDUCE_GRAD else "compute"
            nodes.append(p)
    ctx.profiles = {"g0.bw": type("Profile", (), {"nodes": nodes})()}
    ctx.world_size, ctx.memory_budget, ctx.fusion = 2, INF, "overlap"
    ctx.cost = _cost(1.0, 0.0)   # latency only: fusing the two always pays
    (bucket,) = B.plan(ctx)["g0.bw"]["buckets"]
    assert bucket["members"] == (["rb"] if use_ra else ["ra", "rb"])
    B.apply(ctx, B.plan(ctx))
    gm.graph.lint()


def test_a_gradient_sent_to_the_host_is_bucketed_and_its_op_follows_the_wait(monkeypatch):
    """offload_optimizer's `grad_to_host` right after a reduction (tier 2) is not a use that
    keeps it out of a bucket (ops.FOLLOWERS), and moves after the bucket's wait with it: the
    graph stays valid (a value is never used before it is defined)."""
    from deepcompile.runtime import offload, ops

    gm, ctx, decisions, _ = _backward_graph(monkeypatch)
    graph = gm.graph
    ra = next(n for n in graph.nodes if n.name == "ra")
    with graph.inserting_after(ra):
        graph.call_function(offload.GRAD_TO_HOST, (ra, 1, 0))
    assert not B._used_in_graph(ra)
    assert B.apply(ctx, decisions) == ["g0.bw"]
    graph.lint()
    nodes = list(graph.nodes)
    (op,) = [n for n in nodes if n.target is offload.GRAD_TO_HOST]
    wait = next(n for n in nodes if n.target is ops.REDUCE_WAIT)
    part = op.args[0]
    assert part.target is operator.getitem and part.args == (wait, 0)
    assert nodes.index(wait) < nodes.index(part) < nodes.index(op)
