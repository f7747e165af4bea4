"""Pass `offload_optimizer` (issue 8): optimizer state kept on the host between steps.

Unit tests of the planner on synthetic step curves (the budget held at every node of the
simulated curve, recomputed here independently; a budget that fits half the state offloads
about half; nothing offloaded when the step fits; unattainable budgets reported; copies back
placed as late as their copy time allows and no earlier than memory allows; reloads only in the
last micro-step's backward), of the run-time store on one process (the optimizer's state dict
sees offloaded values, without touching the live state), and multi-rank tests on 2 gloo ranks,
tiny Llama, AdamW, fx: parity with and without offloading (with each other at 1e-6 and with the
eager reference), gradient accumulation 1 and 4, a half-state budget respected by the measured
re-profile, composition with prefetch (in both orders), checkpoints resumed with and without
offloading, and one Inductor run (the reload ops survive compilation and run).
"""

from __future__ import annotations

import functools

import pytest
import torch

import _models
from _dist import run_distributed
from _train import _one_scenario, compare_to_reference, max_param_deviation, mean_losses, scenario
from deepcompile.passes import offload_optimizer as O

INF = float("inf")


def _copy(latency, per_byte):
    return lambda nbytes: latency + per_byte * nbytes


def _points(live, times=None, placeable=None):
    times = times or [1.0] * len(live)
    placeable = placeable if placeable is not None else [True] * len(live)
    return [O.Point("bw", f"n{j}", b, t, p) for j, (b, t, p) in enumerate(zip(live, times, placeable))]


def _frags(sizes):
    return [O.Frag(pid=i, key="exp_avg", nbytes=n, param=f"p{i}") for i, n in enumerate(sizes)]


def _simulated(points, plan):
    """The plan's memory curve, recomputed from its decisions alone."""
    index = {p.name: j for j, p in enumerate(points)}
    curve = []
    for j, p in enumerate(points):
        back = sum(r["bytes"] for r in plan["reloads"]
                   if r["after"] is not None and index[r["after"]] <= j)
        curve.append(p.live_bytes - plan["offloaded_bytes"] + back)
    return curve


def test_budget_holds_at_every_node_of_the_simulated_curve():
    live = [300, 500, 900, 1000, 800, 700, 650, 600]
    frags = _frags([100, 80, 60, 50, 40, 30, 20, 10])
    for budget in (650, 700, 800, 950):
        plan = O.plan_step(_points(live), frags, step_bytes=500, copy_s=_copy(0.0, 1e-3),
                           budget=budget)
        assert not plan["unattainable"], plan
        curve = _simulated(_points(live), plan)
        assert max(curve) <= budget and curve == plan["curve"], (budget, curve)
        assert plan["offloaded_bytes"] >= max(live) - budget
        assert plan["peak_after"] <= budget
        # every offloaded fragment comes back before the step, in a graph or at the step
        assert sum(r["bytes"] for r in plan["reloads"]) == plan["offloaded_bytes"]


def test_a_budget_that_fits_half_the_state_offloads_about_half():
    sizes = [64, 64, 32, 32, 32, 16, 16, 8, 8, 4, 4]
    state = sum(sizes)
    live = [1000, 1400, 1800, 1600, 1200]
    plan = O.plan_step(_points(live), _frags(sizes), step_bytes=600, copy_s=_copy(0, 0),
                       budget=max(live) - state // 2)
    assert state // 2 <= plan["offloaded_bytes"] <= state // 2 + max(sizes)
    assert plan["need_bytes"] == state // 2
    assert max(plan["curve"]) <= max(live) - state // 2


def test_selection_takes_few_bytes_over_the_excess():
    frags = _frags([50, 40, 30, 5])
    assert [f.nbytes for f in O.select(frags, 45)] == [40, 5]      # 45 exactly
    assert [f.nbytes for f in O.select(frags, 52)] == [50, 5]      # 50, then the smallest cover
    for need in range(1, 126):
        got = [f.nbytes for f in O.select(frags, need)]
        # enough, at most one fragment more than needed, and nothing that could be given back
        assert need <= sum(got) <= need + max(got), (need, got)
        assert all(sum(got) - b < need for b in got), (need, got)
    assert O.select(frags, 126) is None and O.select(frags, 0) == []


def test_nothing_is_offloaded_when_the_step_fits():
    plan = O.plan_step(_points([100, 200, 150]), _frags([50, 50]), step_bytes=180,
                       copy_s=_copy(0, 0), budget=200)
    assert plan["fragments"] == [] and plan["reloads"] == [] and not plan["unattainable"]
    unbounded = O.plan_step(_points([100, 200]), _frags([50]), 180, _copy(0, 0), INF)
    assert unbounded["fragments"] == [] and unbounded["budget_bytes"] is None


def test_unattainable_budgets_are_reported_with_the_reason():
    # the step needs every fragment on the device at once
    step = O.plan_step(_points([100, 300]), _frags([100, 100]), step_bytes=260,
                       copy_s=_copy(0, 0), budget=250)
    assert step["unattainable"] and "optimizer step" in step["reason"]
    assert step["fragments"] == [] and step["budget_bytes"] == 250
    # all the movable state is not enough
    state = O.plan_step(_points([100, 500]), _frags([100, 100]), step_bytes=200,
                        copy_s=_copy(0, 0), budget=250)
    assert state["unattainable"] and "not enough" in state["reason"]


def test_copies_back_start_as_late_as_their_copy_time_allows():
    live = [900] * 4 + [500] * 6        # the peak is early: memory allows reloads from node 4
    plan = O.plan_step(_points(live), _frags([100]), step_bytes=500, copy_s=_copy(2.5, 0.0),
                       budget=800)
    (r,) = plan["reloads"]
    # 10 nodes of 1 s: the copy (2.5 s) must start by t = 7.5 s: after node 6 (ends at 7 s)
    assert r["after"] == "n6" and plan["predicted_exposed_s"] == 0.0
    assert plan["predicted_hidden_s"] == 2.5
    # memory wins over hiding: the peak is late, the reload waits for it (exposed)
    late = [500] * 6 + [900] * 4
    plan = O.plan_step(_points(late), _frags([100]), step_bytes=500, copy_s=_copy(2.5, 0.0),
                       budget=800)
    assert plan["reloads"][0]["after"] is None           # not even the last node has room
    assert plan["predicted_exposed_s"] == 2.5
    assert max(_simulated(_points(late), plan)) <= 800


def test_serial_copies_back_are_spread_to_finish_before_the_step():
    plan = O.plan_step(_points([1000] + [500] * 9), _frags([100, 100]), step_bytes=500,
                       copy_s=_copy(2.0, 0.0), budget=800)
    # both copies run one after the other on the copy stream: 4 s before the end (t = 6 s)
    # for the first, 2 s before (t = 8 s) for the second
    assert [r["after"] for r in plan["reloads"]] == ["n5", "n7"]
    assert plan["predicted_exposed_s"] == 0.0


def test_reloads_go_only_into_the_last_micro_steps_backward():
    class Prof:
        def __init__(self, names):
            self.nodes = [type("N", (), {"name": n, "live_bytes": 10, "time_s": 0.1})
                          for n in names]

    class Slot:
        def __init__(self, kind):
            self.kind = kind

    state = type("S", (), {"gradient_accumulation_steps": 4})()
    ctx = type("Ctx", (), {
        "order": ["g0.fw", "g0.bw"] * 4, "slots": {"g0.fw": Slot("fw"), "g0.bw": Slot("bw")},
        "profiles": {"g0.fw": Prof(["f0", "f1"]), "g0.bw": Prof(["b0", "b1"])},
        "runtime": type("R", (), {"step": state})()})()
    points = O.timeline(ctx)
    assert len(points) == 16
    assert [j for j, p in enumerate(points) if p.placeable] == [14, 15]   # last bw run only


def test_config_needs_a_warmup_step_for_the_state_to_exist():
    import deepcompile

    with pytest.raises(ValueError, match="Config.warmup_steps: 0 is not allowed with offload"):
        deepcompile.Config(passes=("offload_optimizer",), warmup_steps=0)
    from deepcompile.passes import known_passes

    assert "offload_optimizer" in known_passes()


# ------------------------------------------------------------------ the store on one process
def _store_job(rank, world):
    import deepcompile

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.AdamW, lr=0.1),
                                    config={"compiler": "fx", "passes": ()})
    x = torch.randn(4, 8)
    engine.backward(engine(x).sum())
    engine.step()
    store = engine._offload
    frags = store.movable()
    assert {k for _, k, _ in frags} == {"exp_avg", "exp_avg_sq"} and len(frags) == 8
    held = store.held_bytes()
    expect = {(pid, key): store._state(pid)[key].clone() for pid, key, _ in frags}
    live = {(pid, key): store._state(pid)[key] for pid, key, _ in frags}
    store.set_plan([(pid, key) for pid, key, _ in frags[:3]])
    store.after_step()
    out = {"held_drop": held - store.held_bytes(), "moved": sum(n for _, _, n in frags[:3]),
           "released": all(store._state(p)[k].untyped_storage().nbytes() == 0
                           for p, k, _ in frags[:3])}
    sd = engine.optimizer.state_dict()
    index = {id(p): i for i, p in enumerate(engine.optimizer.param_groups[0]["params"])}
    from deepcompile.runtime.registry import lookup
    out["state_dict_ok"] = all(
        torch.equal(sd["state"][index[id(lookup(p).shard)]][k], expect[(p, k)])
        for p, k in expect)
    out["live_untouched"] = all(store._state(p)[k] is t for (p, k), t in live.items())
    # a reload op brings back its own fragments only (here exp_avg, not exp_avg_sq, of pid 0)
    group = store.add_reload_group([frags[0][:2]])
    store.reload_group(group)
    out["group_only"] = [store._state(p)[k].untyped_storage().nbytes() > 0 for p, k, _ in frags[:3]]
    store.before_step()
    out["reloaded_ok"] = all(torch.equal(store._state(p)[k], v) for (p, k), v in expect.items())
    out["last_step"] = store.last_step
    return out


def test_store_offloads_and_the_state_dict_sees_offloaded_values():
    r = run_distributed(_store_job, 1, timeout=300)[0]
    assert r["released"] and r["held_drop"] == r["moved"]
    assert r["state_dict_ok"] and r["live_untouched"] and r["reloaded_ok"]
    assert r["group_only"] == [True, False, False]
    assert r["last_step"]["reloaded_in_graph"] == 1 and r["last_step"]["reloaded_at_step"] == 2
    assert r["last_step"]["h2d_bytes"] == r["moved"]


# ------------------------------------------------------------------------------ multi-rank
WORLD = 2
STEPS = 8


def _offload_report(res: dict) -> dict:
    return next(p for p in res["report"]["passes"] if p["pass"] == "offload_optimizer")


def _parity_job(rank, world):
    """Per accumulation: a run without the pass, an unbounded run with it (it finds nothing
    to offload once planned; the figures give the budget), then a run under a budget that fits
    half the movable state; then the compositions with prefetch under the accumulation-1
    budget."""
    out = {}
    for gas in (1, 4):
        plain = scenario(f"llama-adamw-gas{gas}", "llama", "adamw", 1e-2, gas=gas, steps=STEPS,
                         warmup_steps=1)
        base = scenario(f"llama-adamw-gas{gas}-unbounded", "llama", "adamw", 1e-2, gas=gas,
                        steps=STEPS, warmup_steps=1, passes=("offload_optimizer",),
                        record=("report",))
        r0 = _one_scenario(rank, world, base)
        d = _offload_report(r0)["decisions"]
        budget = int(d["peak_before"] - d["state_bytes"] // 2)
        half = scenario(f"llama-adamw-gas{gas}-half", "llama", "adamw", 1e-2, gas=gas,
                        steps=STEPS, warmup_steps=1, passes=("offload_optimizer",),
                        memory_budget=budget, record=("report",))
        out[gas] = {"base": (base, r0), "half": (half, _one_scenario(rank, world, half)),
                    "plain": (plain, _one_scenario(rank, world, plain))}
    budget = out[1]["half"][0]["config"]["memory_budget"]
    for passes in (("offload_optimizer", "prefetch"), ("prefetch", "offload_optimizer")):
        sc = scenario("llama-adamw-" + "-".join(passes), "llama", "adamw", 1e-2, steps=STEPS,
                      warmup_steps=1, passes=passes, memory_budget=budget, record=("report",))
        out[passes] = (sc, _one_scenario(rank, world, sc))
    return out


@pytest.fixture(scope="module")
def parity():
    per_rank = run_distributed(_parity_job, WORLD, timeout=900)
    for r in per_rank:
        for v in r.values():
            for sc, res in (v.values() if isinstance(v, dict) else [v]):
                assert "error" not in res, res.get("error")
    return per_rank


def _runs(parity, key, which=None):
    entries = [r[key] if which is None else r[key][which] for r in parity]
    return entries[0][0], [res for _, res in entries]


@pytest.mark.parametrize("gas", [1, 4])
def test_losses_and_parameters_identical_with_and_without_offloading(parity, gas):
    plain_sc, plain = _runs(parity, gas, "plain")
    base_sc, base = _runs(parity, gas, "base")
    half_sc, half = _runs(parity, gas, "half")
    assert _offload_report(base[0])["decisions"]["fragments"] == []
    assert _offload_report(half[0])["decisions"]["fragments"]
    for other in (base, half):
        loss_dev = max(abs(a - b) for a, b in zip(mean_losses(plain), mean_losses(other)))
        param_dev, where = max_param_deviation(other[0]["state"], plain[0]["state"])
        print(f"\n[offload gas={gas}] {other[0]['id']} vs without the pass: loss {loss_dev:.3g}, "
              f"param {param_dev:.3g} ({where})")
        assert loss_dev <= 1e-6 and param_dev <= 1e-6
    compare_to_reference(plain_sc, plain, kind="llama/fx")
    compare_to_reference(base_sc, base, kind="llama/fx+offload_optimizer(unbounded)")
    compare_to_reference(half_sc, half, kind="llama/fx+offload_optimizer")


@pytest.mark.parametrize("gas", [1, 4])
def test_half_budget_offloads_about_half_within_budget(parity, gas):
    half_sc, half = _runs(parity, gas, "half")
    budget = half_sc["config"]["memory_budget"]
    rep = half[0]["report"]
    d = _offload_report(half[0])["decisions"]
    largest = max(f["bytes"] for f in d["fragments"])
    print(f"\n[offload gas={gas}] budget {budget}: offloaded {d['offloaded_bytes']} of "
          f"{d['state_bytes']} bytes in {len(d['fragments'])} fragments; peak "
          f"{d['peak_before']} -> {d['peak_after']}; step {d['step_bytes']}")
    assert d["state_bytes"] // 2 <= d["offloaded_bytes"] <= d["state_bytes"] // 2 + largest
    assert max(d["curve"]) <= budget and d["peak_after"] <= budget
    # measured: every graph re-profiled with the state offloaded stays within the budget
    for g in rep["graphs"]:
        for s in g["slots"]:
            label, peak = s["profiles"][-1]["label"], s["profiles"][-1]["peak_bytes"]
            assert label == "after offload_optimizer" and peak <= budget, (s["slot"], peak)
    # with all state on the device the step would be over the budget: offloading is what
    # brings it under; the profiled steps ran with all movable state off the device
    assert d["peak_before"] > budget
    assert d["profiled_offloaded_bytes"] == d["state_bytes"]
    # bytes moved per step: everything planned leaves after the step and comes back once per
    # optimizer step (not once per micro-step), in graphs or at the step
    off = rep["offload"]
    assert off["offloaded_bytes"] == d["offloaded_bytes"]
    assert off["last_step"]["d2h_bytes"] == off["last_step"]["h2d_bytes"] == d["offloaded_bytes"]
    assert off["last_step"]["reloaded_in_graph"] + off["last_step"]["reloaded_at_step"] \
        == len(d["fragments"])
    in_graph = sum(len(r["fragments"]) for r in d["reloads"] if r["after"] is not None)
    assert off["last_step"]["reloaded_in_graph"] == in_graph
    # the reload ops are in the backward graph, and ran
    bw = [s for g in rep["graphs"] for s in g["slots"] if s["kind"] == "bw"]
    nodes = [n for s in bw for n in s["profiles"][-1]["nodes"] if n["kind"] == "state_reload"]
    assert len(nodes) == len({(r["slot"], r["after"]) for r in d["reloads"] if r["after"]})


@pytest.mark.parametrize("order", [("offload_optimizer", "prefetch"),
                                   ("prefetch", "offload_optimizer")])
def test_composes_with_prefetch_under_one_budget(parity, order):
    sc, res = _runs(parity, order)
    compare_to_reference(sc, res, kind="llama/fx+" + "+".join(order))
    budget = sc["config"]["memory_budget"]
    rep = res[0]["report"]
    by_pass = {p["pass"]: p for p in rep["passes"]}
    assert by_pass["offload_optimizer"]["decisions"]["fragments"]
    for g in rep["graphs"]:
        for s in g["slots"]:
            last = s["profiles"][-1]
            # prefetch's plan does not count the 1-byte tokens of its starts (left to it)
            tokens = sum(n["kind"] == "all_gather_start" for n in last["nodes"])
            assert last["peak_bytes"] <= budget + tokens, (order, s["slot"], _excess(rep))
    # either way prefetch found memory to gather ahead: before offloading it planned on the
    # curve measured with the state off the device (provisional offload); after, on what the
    # plan left
    prefetch = by_pass["prefetch"]["decisions"]
    assert not any(d["unattainable"] for d in prefetch.values())
    assert any(d["groups"] for d in prefetch.values())


def _excess(rep) -> list:
    """Where the measured profile after offload_optimizer exceeds the curve its plan
    simulated (nodes that existed when it planned), for a failure message."""
    d = _offload_report({"report": rep})["decisions"]
    slots = {s["slot"]: s["profiles"] for g in rep["graphs"] for s in g["slots"]}
    label = "after offload_optimizer"
    planned, i = {}, 0
    for key in sorted(slots, key=lambda k: k.endswith(".bw")):   # one graph, accumulation 1
        profs = slots[key]
        at = next(j for j, p in enumerate(profs) if p["label"] == label)
        for n in profs[at - 1]["nodes"]:
            planned[(key, n["name"])] = d["curve"][i]
            i += 1
    return [(key, n["name"], n["live_bytes"], planned[(key, n["name"])])
            for key, profs in slots.items() for p in profs if p["label"] == label
            for n in p["nodes"] if (key, n["name"]) in planned
            and n["live_bytes"] > planned[(key, n["name"])]][:5] + [d["reloads"]]


# -------------------------------------------------------------------------------- checkpoints
def _ckpt_run(rank, world, config, steps, save_at=None, load=None, ckpt=None):
    import deepcompile

    torch._dynamo.reset()
    model = _models.build_model("llama")
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                                    config=config)
    first = 0
    if load is not None:
        engine.load_checkpoint(load)
        first = engine._optimizer_steps
    losses, offloaded_at_save = [], None
    for step in range(first, steps):
        loss = _models.loss_of(engine(**_models.local_batch("llama", step, rank, world)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step + 1 == save_at:
            offloaded_at_save = sum(f.offloaded for f in engine._offload.fragments)
            engine.save_checkpoint(ckpt)
    state = engine.full_state_dict()
    out = {"losses": losses, "state": state, "offloaded_at_save": offloaded_at_save}
    del engine
    torch._dynamo.reset()
    return out


def _checkpoint_job(rank, world, tmp, budget):
    plain = {"compiler": "fx", "warmup_steps": 1, "passes": (), "measure_steps": 0}
    offloaded = {**plain, "passes": ("offload_optimizer",), "memory_budget": budget}
    out = {}
    zero1 = {**plain, "zero_stage": 1, "passes": ("bucket_reduce",)}   # the replicated parameters follow the loaded shards
    for name, config in (("plain", plain), ("offload", offloaded), ("zero1", zero1)):
        ckpt = f"{tmp}/{name}"
        whole = _ckpt_run(rank, world, config, 6, save_at=4, ckpt=ckpt)
        resumed = _ckpt_run(rank, world, config, 6, load=ckpt)
        out[name] = {"whole": whole, "resumed": resumed}
    return out


def test_training_resumed_from_a_checkpoint_matches_uninterrupted_training(parity, tmp_path):
    budget = parity[0][1]["half"][0]["config"]["memory_budget"]
    per_rank = run_distributed(_checkpoint_job, WORLD, str(tmp_path), budget, timeout=900)
    for rank, r in enumerate(per_rank):
        for name in ("plain", "offload", "zero1"):
            whole, resumed = r[name]["whole"], r[name]["resumed"]
            assert len(resumed["losses"]) == 2
            dev = max(abs(a - b) for a, b in zip(whole["losses"][4:], resumed["losses"]))
            pdev, where = max_param_deviation(resumed["state"], whole["state"])
            print(f"\n[checkpoint {name} rank {rank}] loss {dev:.3g}, "
                  f"param {pdev:.3g} ({where})")
            assert dev <= 1e-6 and pdev <= 1e-6, (name, dev, pdev, where)
        # the offloaded run saved while its state was on the host
        assert r["offload"]["whole"]["offloaded_at_save"] > 0
        assert r["plain"]["whole"]["offloaded_at_save"] == 0


# ------------------------------------------------------------------------------- Inductor
def _inductor_job(rank, world, budget):
    sc = scenario("llama-adamw-offload-inductor", "llama", "adamw", 1e-2, steps=6,
                  compiler="inductor", warmup_steps=1, passes=("offload_optimizer",),
                  memory_budget=budget, record=("report",))
    return sc, _one_scenario(rank, world, sc)


@pytest.mark.inductor
def test_inductor_keeps_and_runs_the_reload_ops(parity):
    budget = parity[0][1]["half"][0]["config"]["memory_budget"]
    per_rank = run_distributed(_inductor_job, WORLD, budget, timeout=1500)
    sc, results = per_rank[0][0], [r for _, r in per_rank]
    compare_to_reference(sc, results, kind="llama/inductor+offload_optimizer")
    d = _offload_report(results[0])["decisions"]
    in_graph = sum(len(r["fragments"]) for r in d["reloads"] if r["after"] is not None)
    last = results[0]["report"]["offload"]["last_step"]
    # the last step ran Inductor's code: its reload ops survived compilation and ran
    assert results[0]["report"]["phase"] == "steady" and in_graph > 0
    assert last["reloaded_in_graph"] == in_graph
    assert last["h2d_bytes"] == d["offloaded_bytes"]
