"""The profile-guided pipeline (issue 3), on 2 gloo ranks with the fx compiler.

* every node of every graph is profiled; the profile's node times add up to the time the same
  graphs take when they run normally; the CPU live-memory curve equals the static liveness
  computation of the same graph; a profiled step runs every collective exactly once (no replay)
  and costs at most 3x a normal step;
* a pass that rewrites a graph is followed by a re-profile, visible in report();
* decisions are identical on every rank even when one rank's measurements are perturbed;
* the plan cache: a second run skips profiling and re-applies the decisions; a changed config or
  world size profiles again;
* export_trace writes a Chrome trace with a compute and a communication lane per rank and one
  event per collective, labelled with its parameter.
"""

from __future__ import annotations

import functools
import json
import statistics

import pytest
import torch

from deepcompile.compiler.profiler import collectives_launched

import _models
from _dist import run_distributed
from _train import FULL

WORLD = 2


# --------------------------------------------------------------------- test passes (registered
# inside each rank: passes are looked up by name in the process that runs them)
def _hoist_plan(ctx) -> dict:
    """Hoist the last gather of each forward graph to the top (a pure scheduling change)."""
    from deepcompile.compiler.graph import call_nodes
    from deepcompile.runtime import ops

    out = {}
    for key, slot in sorted(ctx.slots.items()):
        gathers = call_nodes(slot.gm, ops.ALLGATHER)
        if slot.kind == "fw" and len(gathers) > 1:
            out[key] = gathers[-1].name
    return out


def _hoist_apply(ctx, decisions: dict) -> list[str]:
    changed = []
    for key, node_name in decisions.items():
        gm = ctx.slots[key].gm
        node = next(n for n in gm.graph.nodes if n.name == node_name)
        anchor = next(n for n in gm.graph.nodes if n.op != "placeholder")
        if node is not anchor:
            src = node.args[0]
            if src.op != "placeholder":
                continue
            anchor.prepend(node)
            changed.append(key)
    return changed


def _slowest_plan(ctx) -> dict:
    """Decisions that depend on measured times: the 5 slowest compute nodes of the step."""
    nodes = [(n.time_s, key, n.name) for key, p in sorted(ctx.profiles.items())
             for n in p.nodes if n.kind == "compute"]
    return {"slowest": [[k, name] for _, k, name in sorted(nodes, reverse=True)[:5]]}


def _register_test_passes():
    import deepcompile
    from deepcompile.passes import known_passes

    if "test_hoist" not in known_passes():
        deepcompile.register_pass("test_hoist", _hoist_plan, _hoist_apply)
    if "test_slowest" not in known_passes():
        deepcompile.register_pass("test_slowest", _slowest_plan, lambda ctx, d: [])


class _Block(torch.nn.Module):
    """A small attention block, laid out as the tiny Llama's (a projection each for the queries,
    keys and values; even sizes): what its graphs hold for the memory model (views: the heads
    split off and merged back; ops with several outputs: LayerNorm, attention, the
    cross-entropy), at an MLP's compile cost."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(16)
        self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))
        self.out = torch.nn.Linear(16, 12)

    def forward(self, x, y):
        b, t, _ = x.shape
        h = self.norm(x)
        q, k, v = (f(h).view(b, t, 2, 8).transpose(1, 2) for f in (self.q, self.k, self.v))
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.out(h.transpose(1, 2).reshape(b, t, 16) + x)
        return torch.nn.functional.cross_entropy(logits.view(-1, 12), y.view(-1))


def _batch(model_name, micro, rank, world):
    if model_name != "block":
        return _models.local_batch(model_name, micro, rank, world)
    g = torch.Generator().manual_seed(micro)
    x, y = torch.randn(8, 6, 16, generator=g), torch.randint(0, 12, (8, 6), generator=g)
    per = 8 // world
    return {"x": x[rank * per:(rank + 1) * per], "y": y[rank * per:(rank + 1) * per]}


def _train(rank, world, model_name, config, steps, *, perturb=None):
    import deepcompile

    _register_test_passes()
    model = _Block() if model_name == "block" else _models.build_model(model_name)
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.SGD, lr=0.05),
                                    config=config)
    if perturb is not None:
        engine._pipeline.runner.perturb = perturb
    per_step = []
    gas = engine.config.gradient_accumulation_steps
    for step in range(steps):
        before = engine.comm_stats()
        for micro in range(gas):
            batch = _batch(model_name, step * gas + micro, rank, world)
            engine.backward(_models.loss_of(engine(**batch)))
        phase = engine._pipeline.phase.value
        engine.step()
        after = engine.comm_stats()
        per_step.append({"phase": phase, "collectives": {
            k: after[k]["count"] - before.get(k, {"count": 0})["count"] for k in after}})
    return engine, per_step


# ------------------------------------------------------------------ profiles and memory model
def _profile_job(rank, world, model_name):
    from deepcompile.compiler.liveness import static_live_bytes

    engine, per_step = _train(rank, world, model_name, {"compiler": "fx", "warmup_steps": 2,
                                                        "profile_steps": 3, "passes": ()},
                              steps=12)
    pipe = engine._pipeline
    out = {"per_step": per_step, "timings": pipe.timings, "slots": {},
           "runs_per_step": {k: pipe.order.count(k) for k in pipe.slots}}
    for key, slot in pipe.slots.items():
        prof = slot.profile
        gm_nodes = [n.name for n in slot.gm.graph.nodes if n.op not in ("placeholder", "output")]
        out["slots"][key] = {
            "graph_nodes": gm_nodes,
            "profiled_nodes": [n.name for n in prof.nodes],
            "node_time_s": sum(n.time_s for n in slot.local.nodes),
            "run_s": statistics.median(slot.run_s),
            "measured_live": [n.live_bytes for n in slot.local.nodes],
            "static_live": static_live_bytes(slot.gm),
        }
    return out


@pytest.fixture(scope="module")
def profiled_llama():
    return run_distributed(_profile_job, WORLD, "llama", timeout=600)


@pytest.fixture(scope="module")
def profiled(request):
    """Every rank's profiled run of the attention block, and of the tiny Llama in the full suite
    ([Note: the core matrix] in tests/_train.py), one after the other."""
    runs = run_distributed(_profile_job, WORLD, "block", timeout=600)
    if FULL:
        runs = runs + request.getfixturevalue("profiled_llama")
    return runs


def test_every_node_of_every_graph_is_profiled(profiled):
    for r in profiled:
        assert set(r["slots"]) == {"g0.fw", "g0.bw"}
        for s in r["slots"].values():
            assert s["profiled_nodes"] == s["graph_nodes"]


def test_cpu_memory_curve_matches_static_liveness(profiled):
    for r in profiled:
        for key, s in r["slots"].items():
            assert s["measured_live"] == s["static_live"], key


# the timing tests time the tiny Llama's steps (an MLP-sized graph's step is mostly the host's
# work outside the graphs)
@pytest.mark.timing
def test_node_times_add_up_to_the_step_time(profiled_llama):
    # the sum of this rank's per-node times over a step (medians over 3 profiled steps, times
    # the runs per step) vs the measured wall time of a normal step (median over the steady
    # steps): what the profile attributes to nodes accounts for the step, within 25%
    for r in profiled_llama:
        node_s = sum(s["node_time_s"] * r["runs_per_step"][k] for k, s in r["slots"].items())
        step_s = statistics.median(r["timings"]["steady_steps_s"])
        graph_s = sum(s["run_s"] * r["runs_per_step"][k] for k, s in r["slots"].items())
        steady = r["timings"]["steady_steps_s"]
        spread = (max(steady) - min(steady)) / step_s
        print(f"node-time sum {node_s * 1e3:.1f} ms; normal step {step_s * 1e3:.1f} ms "
              f"(spread {spread:.0%}); the same graphs unprofiled {graph_s * 1e3:.1f} ms")
        assert spread <= 0.25, f"the machine is not quiet: normal steps vary by {spread:.0%}"
        assert abs(node_s - step_s) <= 0.25 * step_s


def test_a_profiled_step_replays_nothing(profiled):
    for r in profiled:
        phases = [s["phase"] for s in r["per_step"]]
        assert phases == ["warmup"] * 2 + ["profile"] * 3 + ["steady"] * 7
        normal = [s["collectives"] for s in r["per_step"] if s["phase"] == "steady"]
        prof = [s["collectives"] for s in r["per_step"] if s["phase"] == "profile"]
        assert prof == normal[:3]   # every collective ran exactly once in each profiled step


@pytest.mark.timing
def test_a_profiled_step_costs_at_most_three_normal_ones(profiled_llama):
    for r in profiled_llama:
        t = r["timings"]
        ratio = statistics.median(t["profiled_steps_s"]) / statistics.median(t["steady_steps_s"])
        assert ratio <= 3.0, ratio


# ------------------------------------------------- passes, re-profiling, rank consistency
def _pass_job(rank, world, perturb_rank, trace_path):
    def perturb(prof):
        for i, n in enumerate(prof.nodes):
            if i % 3 == 0:
                n.time_s *= 50.0

    engine, _ = _train(rank, world, "mlp", {
        "compiler": "fx", "warmup_steps": 1, "profile_steps": 1, "measure_steps": 0,
        "passes": ("test_slowest", "test_hoist")}, steps=5,
        perturb=perturb if rank == perturb_rank else None)
    report = engine.report()
    json.dumps(report.to_dict())
    engine.export_trace(trace_path)   # test_export_trace's
    collectives = sum(1 for s in engine._pipeline.slots.values() for n in s.local.nodes
                      if n.kind != "compute")
    return {"report": report.to_dict(), "text": str(report), "trace": trace_path,
            "collectives": collectives}


@pytest.fixture(scope="module")
def with_passes(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("trace") / "trace.json")
    return run_distributed(_pass_job, WORLD, 1, path, timeout=600)


def test_decisions_are_identical_across_ranks(with_passes):
    a, b = (r["report"]["passes"] for r in with_passes)
    assert [p["decisions"] for p in a] == [p["decisions"] for p in b]
    assert a[0]["pass"] == "test_slowest" and len(a[0]["decisions"]["slowest"]) == 5


def test_reprofile_after_a_pass_is_visible(with_passes):
    rep = with_passes[0]["report"]
    hoist = rep["passes"][1]
    assert hoist["pass"] == "test_hoist" and hoist["changed"] == ["g0.fw"]
    assert rep["passes"][0]["changed"] == []   # nothing changed: no re-profile after it
    fw = next(s for g in rep["graphs"] for s in g["slots"] if s["slot"] == "g0.fw")
    labels = [p["label"] for p in fw["profiles"]]
    assert labels == ["initial", "after test_hoist"] and fw["version"] == 1
    first, second = fw["profiles"]
    assert [n["name"] for n in first["nodes"]] != [n["name"] for n in second["nodes"]]
    # the hoisted gather now runs first, and its buffer is alive over every node it moved past:
    # the re-profile shows exactly its size more live memory there, and nowhere else (the
    # buffer: the parameter, fp32, padded to a multiple of the world size; the MLP's sizes
    # are odd)
    moved = second["nodes"][0]
    assert moved["kind"] == "all_gather" and moved["name"] == hoist["decisions"]["g0.fw"]
    buffer = -(-moved["out_bytes"] // (4 * WORLD)) * 4 * WORLD
    old_index = [n["name"] for n in first["nodes"]].index(moved["name"])
    before = {n["name"]: n["live_bytes"] for n in first["nodes"]}
    after = {n["name"]: n["live_bytes"] for n in second["nodes"]}
    for i, n in enumerate(first["nodes"]):
        if n["name"] == moved["name"]:
            continue
        extra = after[n["name"]] - before[n["name"]]
        assert extra == (buffer if i < old_index else 0), (n["name"], extra)
    assert "test_hoist" in with_passes[0]["text"]


# --------------------------------------------------------------------------------- cache
def _cache_job(rank, world, cache_dir, config_extra):
    engine, per_step = _train(rank, world, "mlp", {
        "compiler": "fx", "warmup_steps": 1, "profile_steps": 1, "cache_dir": cache_dir,
        "measure_steps": 0, "passes": ("test_hoist",), **config_extra}, steps=4)
    rep = engine.report().to_dict()
    return {"phases": [s["phase"] for s in per_step], "cache": rep["cache"],
            "versions": {s["slot"]: s["version"] for g in rep["graphs"] for s in g["slots"]},
            "passes": rep["passes"]}


def test_plan_cache_skips_profiling_and_rejects_stale_plans(tmp_path):
    d = str(tmp_path / "plans")
    first = run_distributed(_cache_job, WORLD, d, {}, timeout=300)[0]
    assert not first["cache"]["hit"] and "profile" in first["phases"]
    second = run_distributed(_cache_job, WORLD, d, {}, timeout=300)[0]
    assert second["cache"]["hit"] and "profile" not in second["phases"]
    assert second["cache"]["key"] == first["cache"]["key"]
    assert second["cache"]["saved_s"] > 0
    assert second["versions"] == first["versions"] == {"g0.fw": 1, "g0.bw": 0}
    assert second["passes"][0]["decisions"] == first["passes"][0]["decisions"]
    changed_config = run_distributed(_cache_job, WORLD, d, {"max_grad_norm": 1.0}, timeout=300)[0]
    assert not changed_config["cache"]["hit"] and "profile" in changed_config["phases"]
    changed_world = run_distributed(_cache_job, 1, d, {}, timeout=300)[0]
    assert not changed_world["cache"]["hit"] and "profile" in changed_world["phases"]


# --------------------------------------------------------------------------------- trace
def test_export_trace(with_passes):
    """The trace the passes' run above wrote at its end."""
    counts = [r["collectives"] for r in with_passes]
    with open(with_passes[0]["trace"]) as f:
        events = json.load(f)["traceEvents"]
    for rank in range(WORLD):
        lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["pid"] == rank
                 and e["name"] == "thread_name"}
        assert lanes == {"compute", "communication"}
        comm = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "comm"]
        compute = [e for e in events if e["ph"] == "X" and e["pid"] == rank and e["cat"] == "compute"]
        assert len(comm) == counts[rank] > 0 and compute
        assert {e["tid"] for e in comm} == {1} and {e["tid"] for e in compute} == {0}
        params = {e["args"]["param"] for e in comm}
        assert params == {n for n, _ in _models.build_model("mlp").named_parameters()}


# ------------------------------------------------------------ what torch.profiler sees
def _profiler_job(rank, world):
    engine, _ = _train(rank, world, "mlp", {"compiler": "fx", "warmup_steps": 1,
                                            "profile_steps": 1, "measure_steps": 0,
                                            "passes": ("prefetch", "bucket_reduce")}, steps=4)
    batch = _models.local_batch("mlp", 99, rank, world)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.backward(_models.loss_of(engine(**batch)))
        engine.step()
    names = [e.name for e in prof.events()]
    planned = {"all_gather": 0, "reduce_scatter": 0}
    for slot in engine._pipeline.slots.values():
        for k, v in collectives_launched(slot.gm).items():
            planned[k] += v
    return {"custom": sorted({n for n in names if n.startswith("deepcompile::")}),
            "all_gather": names.count("_c10d_functional::all_gather_into_tensor"),
            "reduce_scatter": names.count("_c10d_functional::reduce_scatter_tensor"),
            "planned": planned}


def test_steady_step_runs_functional_collectives_only():
    """A steady step runs no deepcompile op: every collective is a functional collective
    (C++), one per planned group, as torch.profiler records them."""
    for r in run_distributed(_profiler_job, WORLD, timeout=300):
        assert r["custom"] == []
        assert r["all_gather"] == r["planned"]["all_gather"] > 0
        assert r["reduce_scatter"] == r["planned"]["reduce_scatter"] > 0


def test_cost_model_fit_keeps_latency():
    from deepcompile.compiler.cost import LinearCostModel, _fit

    # a noisy sweep whose least-squares intercept would be negative still has a latency
    latency, per_byte = _fit([(4096, 1.0e-3), (32768, 0.9e-3), (1 << 20, 3.0e-3)])
    assert latency > 0 and per_byte > 0
    # one slow smallest message (measured on the 2-core VM: 1.69 ms, then 0.31-0.79 ms) leaves
    # the latency at the fastest and the bytes priced
    latency, per_byte = _fit([(4096, 1.69e-3), (32768, 0.31e-3), (1 << 18, 0.46e-3),
                              (1 << 20, 0.79e-3)])
    assert latency == 0.31e-3 and per_byte == (0.79e-3 - 0.31e-3) / (1 << 20)
    model = LinearCostModel(coeffs={"all_gather": (latency, per_byte)})
    assert model.collective_s("all_gather", 2 << 20) > model.collective_s("all_gather", 1 << 20)
    assert LinearCostModel.from_dict(model.to_dict()) == model


# ------------------------------------------------------------ agreement of node times over ranks
def _agree_job(rank, world):
    import types

    import torch.distributed as dist

    from deepcompile.compiler.agree import agree_profiles
    from deepcompile.compiler.profiler import GraphProfile, NodeProfile
    from deepcompile.runtime.comm import Comm

    def node(name, kind, ms):
        return NodeProfile(name=name, op=name, kind=kind, param=None, time_s=ms / 1e3,
                           start_s=0.0, out_bytes=0, live_bytes=100 * (rank + 1))

    # rank 0 computes fast and waits at the collective for rank 1, which computes slowly; the
    # transfer itself takes 1 ms (what rank 1, the last to arrive, waits)
    mine = {0: (2.0, 9.0, 1.0), 1: (6.0, 1.0, 3.0)}[rank]
    runs = [GraphProfile(slot="g0.fw", version=0, total_s=0.02, nodes=[
        node("mm", "compute", mine[0]), node("ag", "all_gather", mine[1]),
        node("relu", "compute", mine[2])]) for _ in range(2)]
    slot = types.SimpleNamespace(pending=runs, version=0, local=None)
    agreed = agree_profiles(Comm(dist.group.WORLD), {"g0.fw": slot}, ["g0.fw"],
                            torch.device("cpu"))
    return {n.name: (round(n.time_s * 1e3, 6), n.live_bytes) for n in agreed["g0.fw"].nodes}


def test_agreed_node_times_blocking_min_compute_scaled_to_the_slowest_rank():
    """[Note: agreed node times]: a blocking node gets the last-arriving rank's wait (the MIN);
    compute nodes the mean over ranks, scaled to the slowest rank's compute sum (rank 1: 9 ms
    against rank 0's 3 ms, means 4 + 2); live bytes the MAX; the same on every rank."""
    got = run_distributed(_agree_job, WORLD, timeout=120)
    assert got[0] == got[1]
    assert got[0] == {"mm": (6.0, 200), "ag": (1.0, 200), "relu": (3.0, 200)}


# ------------------------------------------------------- on a GPU (imitated in-process, world 1)
_SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _small():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_steps_before_the_steady_state_wait_for_the_device(group, monkeypatch):
    """[Note: timed steps on a GPU]: the pipeline's step times (which the passes' verdicts
    compare) end with the device's work done in every phase but the steady one, where a sync
    would cost overlap: each call that trains the step (forward, backward, step) waits for the
    device before it returns. Counted by replacing the pipeline's synchronize."""
    import deepcompile
    from deepcompile.compiler import pipeline

    calls = []
    monkeypatch.setattr(pipeline, "synchronize", lambda device: calls.append(device))
    engine = deepcompile.initialize(_small(), optimizer=_SGD,
                                    config={"compiler": "fx", "passes": (), "warmup_steps": 1})
    for i in range(6):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        engine.step()
    phases = [p for p, _ in engine._pipeline.step_log]
    assert phases[0] == "warmup" and phases[-1] == "steady", phases
    assert calls == [torch.device("cpu")] * 3 * sum(p != "steady" for p in phases)


def test_the_reported_time_outside_the_graphs_is_the_steady_steps(group):
    """[Note: outside the graphs]: the report's step summary takes the time outside the graphs
    from the steady steps (their median) once there are a few, not from the one profiled step:
    here the optimizer step becomes 30 ms slower after the profile (a pre-hook on the user's
    optimizer, which the engine's step runs), and the report shows it."""
    import time

    import deepcompile
    from deepcompile.compiler.pipeline import MIN_STEADY_OUTSIDE, Phase

    engine = deepcompile.initialize(_small(), optimizer=_SGD,
                                    config={"compiler": "fx", "passes": (), "warmup_steps": 1})
    slow, now = [], [0.0]
    engine._clock = lambda: now[0]   # injected: the steps take no time but what the hook adds

    def hook(*_):
        if slow:
            now[0] += 0.03
    engine.optimizer.register_step_pre_hook(hook)

    def step(i):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        engine.step()

    i = 0
    while engine._pipeline.phase is not Phase.STEADY:
        step(i)
        i += 1
    profiled = engine.report().step_summary
    assert profiled["outside_graphs_s"] < 0.03, profiled
    assert profiled["outside_graphs_from"] == "profiled step(s)"
    slow.append(True)
    for j in range(MIN_STEADY_OUTSIDE):
        step(i + j)
    summary = engine.report().step_summary
    assert summary["outside_graphs_s"] >= 0.03, summary
    assert summary["outside_graphs_from"] == f"median of {MIN_STEADY_OUTSIDE} steady steps"
    assert f"ms (median of {MIN_STEADY_OUTSIDE} steady steps)" in str(engine.report())


def test_a_fraction_budget_counts_the_memory_pytorch_can_use(monkeypatch):
    """A budget given as a fraction (and the default 0.9 on CUDA) is of the memory PyTorch's
    allocator can hold — its reserved plus the free memory — not of the device's total, which
    counts the CUDA context, NCCL's buffers and other processes as room."""
    from deepcompile.compiler.agree import local_budget

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    cuda = torch.device("cuda", 0)
    assert local_budget(None, cuda) == 0.9 * 70 * gib
    assert local_budget(0.5, cuda) == 35 * gib
    assert local_budget(12345, cuda) == 12345
    assert local_budget(None, torch.device("cpu")) == float("inf")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        local_budget(0.5, torch.device("cpu"))


def test_a_profiled_run_is_issued_behind_a_lead_sized_from_the_last(group, monkeypatch):
    """[Note: profiling ahead of the device]: each profiled run of a graph asks the profiler
    to keep the device busy for 1.5 times the host time of its last profiled run (the first:
    three times the median of its runs as FX code); the profiler records its host time, and
    ignores the lead on the CPU."""
    import deepcompile
    from deepcompile.compiler import runner

    seen = []
    real = runner.profile_run

    def spy(gm, args, **kw):
        out, prof = real(gm, args, **kw)
        seen.append((kw["slot"], kw["lead_s"], prof.host_s, prof.lead_s))
        return out, prof

    monkeypatch.setattr(runner, "profile_run", spy)
    engine = deepcompile.initialize(_small(), optimizer=_SGD,
                                    config={"compiler": "fx", "passes": (), "warmup_steps": 2,
                                            "profile_steps": 2})
    for i in range(5):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        engine.step()
    slots = sorted({s for s, *_ in seen})
    assert slots == ["g0.bw", "g0.fw"], seen
    pipe = engine._pipeline
    for key in slots:
        runs = [r for r in seen if r[0] == key]
        assert len(runs) == 2, runs
        (_, lead0, host0, rec0), (_, lead1, host1, rec1) = runs
        assert lead0 > 0 and host0 > 0 and host1 > 0
        assert lead1 == pytest.approx(1.5 * host0)
        assert rec0 == rec1 == 0.0   # the CPU: nothing runs ahead
        assert pipe.runner.profile_host[key] == host1
