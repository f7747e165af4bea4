"""Pass `activation_budget`: saved activations kept, recomputed or offloaded under one budget.

* the planner (pure), on synthetic pairs of profiled graphs, against an independent simulator of
  the profiler's memory model: the budget held at every node, the cheapest value per byte
  first, a recompute's inputs kept, copies back started early enough to hide them on a GPU,
  an unattainable budget reported with the lowest peak reached, nothing planned with ample
  memory; on small random pairs, a plan whenever an exhaustive search finds one;
* the run-time copies on the CPU's imitation of the copy streams: a forgotten wait, or a copy
  back that does not wait for the copy out, reads other data and training goes wrong; pinned
  buffers are reused across steps;
* in an engine (world size 1 and 2, fx and Inductor, tiny Llama and Mixtral, gradient
  accumulation): a budget below the peak is met by the re-profile and training matches eager
  (and, at world size 1, the same engine without the pass bit for bit); a budget the pass cannot
  reach says so with the lowest peak; with every pass chosen by `auto` under a tight budget;
  with the model's own activation checkpointing, without recomputing anything twice; within
  the budget, activations freed for selective_unshard where the parameters it keeps gathered
  save more (a memory trade), judged with it, alike on every rank and in another launch, chosen
  by `auto` where the room left cannot keep every parameter, and nothing traded with ample
  memory; with prefetch planning next, activations weighed against the gathers it would start
  earlier, under a budget at the peak; with offload_optimizer waiting for it, activations freed
  so that optimizer state stays on the device, alike on both ranks.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import _models
from _train import Jobs, compare_to_reference, scenario
from deepcompile.passes import activation_budget as A
from deepcompile.passes._common import Step

INF = float("inf")
COPY = lambda nbytes: 1e-9 * nbytes   # noqa: E731  (1 GB/s)


# ------------------------------------------------------------------------- pure: the planner
def _pair(fw_base: list[int], bw_base: list[int], acts: list[A.Activation], t: float = 1e-3):
    """Profiled steps of a pair whose live bytes are the other values' (`*_base`) plus the
    saved values, as the profiler sees them: a saved value is alive in the forward from the
    step that makes it (its `fw_free` here: its only reader) to the end, and in the whole
    backward (an input)."""
    fw = [Step(f"f{i}", "compute", t, b + sum(a.nbytes for a in acts if i >= a.fw_free))
          for i, b in enumerate(fw_base)]
    bw = [Step(f"b{j}", "compute", t, b + sum(a.nbytes for a in acts))
          for j, b in enumerate(bw_base)]
    return fw, bw


def _simulate(fw, bw, acts, plan):
    """The live bytes after every step under `plan`, computed independently of the planner:
    a dropped value leaves the forward after its last use and, in the backward, is held from
    where it comes back (a recompute: right before its first use, with its intermediates) to
    its last use."""
    by = {a.name: a for a in acts}
    names = [s.name for s in bw]
    fw_curve = [s.live_bytes - sum(by[c["name"]].nbytes for c in plan["choices"]
                                   if i > by[c["name"]].fw_free) for i, s in enumerate(fw)]
    bw_curve = []
    for j, s in enumerate(bw):
        v = s.live_bytes
        for c in plan["choices"]:
            a = by[c["name"]]
            if c["action"] == "recompute":
                start, extra = max(a.bw_first - 1, 0), a.recompute_bytes
            else:
                start, extra = (names.index(c["reload_after"]) if c["reload_after"] else 0), 0
            v -= a.nbytes
            if start <= j <= a.bw_last:
                v += a.nbytes + (extra if j == start else 0)
        bw_curve.append(v)
    return fw_curve, bw_curve


def _check(fw, bw, acts, plan, budget):
    f, b = _simulate(fw, bw, acts, plan)
    assert plan["peak_after"] == max(f + b), (plan["peak_after"], max(f + b))
    if not plan["unattainable"]:
        assert max(f + b) <= budget
    by = {a.name: a for a in acts}
    for c in plan["choices"]:   # a recompute reads only what stays saved
        if c["action"] == "recompute":
            assert not set(by[c["name"]].leaves) & {d["name"] for d in plan["choices"]}
    return f, b


def test_ample_memory_plans_nothing():
    acts = [A.Activation("a", 400, 2, 1, 3, 1e-4)]
    fw, bw = _pair([100] * 6, [100] * 6, acts)
    for budget in (INF, 500, 10_000):
        plan = A.plan_pair(fw, bw, acts, budget, COPY, overlap=False)
        assert plan["choices"] == [] and not plan["unattainable"]
        assert plan["peak_after"] == plan["peak_before"] == 500


def test_the_cheapest_value_per_byte_goes_first_and_only_what_the_budget_needs():
    # three values of 400 B, made one after the other; recomputing "b" is the cheapest per
    # byte, "a" the dearest; the peak (the backward's top: 1600 B) is 400 B over the budget
    acts = [A.Activation("a", 400, 0, 4, 4, 5e-3), A.Activation("b", 400, 1, 2, 2, 1e-5),
            A.Activation("c", 400, 2, 3, 3, 2e-4, offload=False)]
    fw, bw = _pair([100] * 4, [400, 0, 0, 0, 0, 0], acts)
    plan = A.plan_pair(fw, bw, acts, 1200, COPY, overlap=False)
    assert [(c["name"], c["action"]) for c in plan["choices"]] == [("b", "recompute")]
    _check(fw, bw, acts, plan, 1200)


def test_offload_where_copies_are_cheaper_than_recomputing():
    # the copies (3 x 0.4 us + the ops' host time) are cheaper than a 10 ms recompute
    acts = [A.Activation("a", 400, 1, 2, 4, 1e-2)]
    fw, bw = _pair([100] * 4, [200, 0, 0, 0, 0, 0], acts)
    plan = A.plan_pair(fw, bw, acts, 550, COPY, overlap=False)
    (c,) = plan["choices"]
    assert c["action"] == "offload" and c["reload_after"] == "b1"   # right before its use
    _check(fw, bw, acts, plan, 550)


def test_a_recomputes_inputs_stay_saved():
    # "x" is cheap to recompute from "y": then "y" stays saved, though it could be recomputed
    acts = [A.Activation("x", 400, 1, 2, 3, 1e-6, leaves=("y",)),
            A.Activation("y", 400, 2, 1, 5, 1e-3, offload=False)]
    fw, bw = _pair([100] * 6, [300, 0, 0, 0, 0, 0], acts)
    plan = A.plan_pair(fw, bw, acts, 850, COPY, overlap=False)   # peak 1100: one must go
    assert [(c["name"], c["action"]) for c in plan["choices"]] == [("x", "recompute")]
    _check(fw, bw, acts, plan, 850)
    # with "y" gone first (recomputing "x" is then not allowed), "x" can only be offloaded
    acts[0] = A.Activation("x", 400, 1, 2, 3, 1e-6, leaves=("y",), offload=False)
    acts[1] = A.Activation("y", 400, 2, 1, 5, 1e-9, offload=False)
    plan = A.plan_pair(fw, bw, acts, 850, COPY, overlap=False)
    assert [(c["name"], c["action"]) for c in plan["choices"]] == [("y", "recompute")]


def test_offloads_fit_the_host_memory_there_is():
    # offloading is far cheaper, but the host has room for one copy of one value: the other is
    # recomputed; a forward run twice before its backwards holds two copies: both recomputed
    acts = [A.Activation("a", 400, 0, 2, 2, 1e-2), A.Activation("b", 400, 1, 4, 4, 1e-2)]
    fw, bw = _pair([100] * 4, [400, 0, 0, 0, 0, 0], acts)   # both must go for 700 B
    plan = A.plan_pair(fw, bw, acts, 700, COPY, overlap=False, host_room=500)
    assert sorted(c["action"] for c in plan["choices"]) == ["offload", "recompute"]
    assert plan["host_bytes"] == 400
    _check(fw, bw, acts, plan, 700)
    plan = A.plan_pair(fw, bw, acts, 700, COPY, overlap=False, host_room=500, copies=2)
    assert [c["action"] for c in plan["choices"]] == ["recompute", "recompute"]
    _check(fw, bw, acts, plan, 700)


def test_copies_back_start_early_enough_to_hide_them_on_a_gpu():
    # backward steps of 1 ms; a copy of 2.5 ms starts 3 steps before the first use
    acts = [A.Activation("a", 2_500_000, 0, 8, 9, 1.0)]
    fw, bw = _pair([100] * 4, [100] * 10, acts)
    plan = A.plan_pair(fw, bw, acts, 1_000_000, COPY, overlap=True)
    (c,) = plan["choices"]
    assert c["action"] == "offload" and c["reload_after"] == "b4"
    assert c["cost_s"] == pytest.approx(3 * A.HOST_OP_S)   # both copies hidden
    _check(fw, bw, acts, plan, 1_000_000)
    # without room to start it early, the copy back is exposed (2.5 - 1 ms), and costed so
    acts = [A.Activation("a", 2_500_000, 0, 1, 9, 1.0)]
    plan = A.plan_pair(fw, bw, acts, 1_000_000, COPY, overlap=True)
    (c,) = plan["choices"]
    assert c["reload_after"] is None
    assert c["cost_s"] == pytest.approx(1.5e-3 + 3 * A.HOST_OP_S)


def test_an_unattainable_budget_is_reported_with_the_lowest_peak():
    acts = [A.Activation("a", 400, 1, 1, 4, 1e-4), A.Activation("b", 300, 2, 2, 4, None)]
    fw, bw = _pair([500] * 6, [500] * 6, acts)
    plan = A.plan_pair(fw, bw, acts, 600, COPY, overlap=False)
    assert plan["unattainable"] and plan["peak_before"] == 1200
    f, b = _check(fw, bw, acts, plan, 600)
    # both went, and where both are used they are both held: nothing reaches lower
    assert {c["name"] for c in plan["choices"]} == {"a", "b"}
    assert plan["peak_after"] == max(f + b) == 500 + 400 + 300


def test_choices_of_about_the_same_cost_do_not_follow_20_percent_noise():
    """[Note: stable choices] Three values, any one of which the budget needs, whose costs per
    byte are within 1.3x (the third's offload within 1.1x of recomputing it): whatever ±20%
    noise does to the costs, the same value goes, recomputed."""
    plans = set()
    for seed in range(20):
        rng = random.Random(seed)
        j = lambda t: t * rng.uniform(0.8, 1.2)   # noqa: E731
        acts = [A.Activation("p", 400, 0, 3, 3, j(1.3e-3), offload=False),
                A.Activation("q", 400, 1, 4, 4, j(1e-3), offload=False),
                A.Activation("r", 800, 2, 1, 1, j(1e-3))]
        fw, bw = _pair([100] * 4, [500, 0, 0, 0, 0, 0], acts)
        copy = lambda n, k=j(1e-3 / 3 / 800): k * n   # noqa: E731  (offloading r ~ 1 ms)
        plan = A.plan_pair(fw, bw, acts, 1800, copy, overlap=False)
        _check(fw, bw, acts, plan, 1800)
        plans.add(tuple((c["name"], c["action"]) for c in plan["choices"]))
    assert len(plans) == 1, plans
    (plan,) = plans
    assert all(action == "recompute" for _, action in plan)


def _random_instance(rng: random.Random, n: int):
    n_fw, n_bw = rng.randint(4, 12), rng.randint(4, 12)
    acts = []
    for k in range(n):
        first = rng.randrange(n_bw)
        leaves = tuple(a.name for a in acts if rng.random() < 0.3)
        acts.append(A.Activation(
            f"a{k}", rng.choice([100, 200, 300, 500, 800]), rng.randrange(n_fw - 1), first,
            rng.randint(first, n_bw - 1), rng.choice([None, 1e-4, 1e-3, 1e-2]),
            rng.choice([0, 0, 50, 200]), leaves, offload=rng.random() < 0.7))
    other = lambda n: [rng.choice([0, 0, 100, 400, 1000]) for _ in range(n)]   # noqa: E731
    fw, bw = _pair(other(n_fw), other(n_bw), acts)
    return fw, bw, acts


def _exhaustive(fw, bw, acts, budget, overlap):
    """The cheapest feasible plan of every keep/recompute/offload assignment (None: none is)."""
    opts = {a.name: A.options(a, fw, bw, COPY, overlap) for a in acts}
    best = None
    for combo in itertools.product(*[[None] + opts[a.name] for a in acts]):
        choice = {a.name: o for a, o in zip(acts, combo) if o is not None}
        held = {leaf for a in acts if choice.get(a.name) and choice[a.name].action == "recompute"
                for leaf in a.leaves}
        if held & set(choice):
            continue
        plan = {"choices": [{"name": n, "action": o.action,
                             "reload_after": bw[o.reload_after].name
                             if o.reload_after is not None else None}
                            for n, o in choice.items()]}
        f, b = _simulate(fw, bw, acts, plan)
        cost = sum(o.cost_s for o in choice.values())
        if max(f + b) <= budget and (best is None or cost < best):
            best = cost
    return best


@pytest.mark.parametrize("seed", range(6))
def test_random_pairs_hold_the_budget_the_simulator_measures(seed):
    rng = random.Random(seed)
    found = 0
    for _ in range(40):
        fw, bw, acts = _random_instance(rng, rng.randint(1, 5))
        overlap = rng.random() < 0.5
        peak = max(s.live_bytes for s in fw + bw)
        budget = rng.randint(peak // 2, peak)
        plan = A.plan_pair(fw, bw, acts, budget, COPY, overlap)
        _check(fw, bw, acts, plan, budget)
        optimum = _exhaustive(fw, bw, acts, budget, overlap)
        if optimum is not None and all(a.recompute_bytes == 0 for a in acts):
            # without a recompute's intermediates every choice only lowers the curves: the
            # greedy plan reaches the budget whenever some plan does
            assert not plan["unattainable"], (budget, acts)
        if optimum is None:
            assert plan["unattainable"]
        found += not plan["unattainable"]
    assert found > 3


# ----------------------------------------------------------- world size 1, in this process
LLAMA_PEAK = 1_047_688   # tiny Llama's profiled peak (its backward), world size 1, fx, torch 2.13


def _engine(model: str, budget: float | None, passes=("activation_budget",), compiler="fx"):
    import deepcompile

    cfg = dict(compiler=compiler, passes=passes, measure_steps=0, gradient_accumulation_steps=2,
               max_grad_norm=0.1)
    if budget is not None:
        cfg["memory_budget"] = int(budget)
    return deepcompile.initialize(_models.build_model(model),
                                  optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                                  config=deepcompile.Config(**cfg))


def _train(engine, model: str, steps: int = 4) -> list[float]:
    losses, micro = [], 0
    for _ in range(steps):
        for _ in range(2):
            loss = _models.loss_of(engine(**_models.local_batch(model, micro, 0, 1)))
            engine.backward(loss)
            losses.append(loss.item())
            micro += 1
        engine.step()
    return losses


def _decisions(engine) -> dict:
    (entry,) = [e for e in engine._pipeline.pass_log if e["pass"] == "activation_budget"]
    return entry


STEPS = 6            # 2 warm-up, 1 profiled, the pass, 1 re-profiled, 2 with the plan
# a budget below the peak at world size 1, fx: the MLP's peak is 17,624 B (its backward), the
# lowest the pass reaches about 15,300 B
BUDGETS = {"llama": 0.6 * LLAMA_PEAK, "mlp": 16_000}
_RUNS: dict[str, list[float]] = {}   # the correct run's losses (the tests below compare with it)


def _planned_run(model: str) -> list[float]:
    if model not in _RUNS:
        _RUNS[model] = _train(_engine(model, BUDGETS[model]), model, STEPS)
        torch._dynamo.reset()
    return _RUNS[model]


def test_world1_offloads_and_recomputes_bit_for_bit(group):
    base = _engine("llama", None, passes=())
    want = _train(base, "llama", STEPS)
    want_state = {k: v.clone() for k, v in base.full_state_dict().items()}
    del base
    torch._dynamo.reset()
    eng = _engine("llama", 0.6 * LLAMA_PEAK)
    got = _train(eng, "llama", STEPS)
    _RUNS["llama"] = got
    entry = _decisions(eng)
    d = entry["decisions"]["g0"]
    actions = {c["action"] for c in d["choices"]}
    assert actions == {"offload", "recompute"}, d["choices"]
    assert entry["kept"] and entry["after"]["peak_bytes"] <= 0.6 * LLAMA_PEAK
    assert got == want   # offloaded values come back bit for bit; recomputed ones are the same ops
    state = eng.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in want_state.items())
    # the graphs carry the plan: the forward copies out, the backward copies back and waits
    fw, bw = eng._pipeline.slots["g0.fw"].gm.graph, eng._pipeline.slots["g0.bw"].gm.graph
    n_off = sum(c["action"] == "offload" for c in d["choices"])
    count = lambda g, op: sum(n.target is op for n in g.nodes)   # noqa: E731
    from deepcompile.runtime import activations as R
    assert count(fw, R.OFFLOAD) == count(bw, R.RELOAD) == count(bw, R.WAIT) == n_off
    # pinned buffers are made once and reused by every micro-step after (6 ran with the plan)
    store = eng._runtime.activations
    assert store.stats["buffers"] == n_off and store.stats["offloads"] == 6 * n_off


@pytest.mark.parametrize("broken", ["no wait", "no copy-out event"])
@pytest.mark.parametrize("model", ["mlp", pytest.param("llama", marks=pytest.mark.extended)])
def test_a_missing_wait_reads_other_data(group, monkeypatch, model, broken):
    """The CPU imitation of the copy streams runs a copy only when its event is waited for:
    a reload whose wait is skipped leaves the value uninitialized, and one that does not wait
    for the copy out reads the pooled buffer's previous contents (another micro-step's). Either
    way training differs from the correct run. The MLP's plan offloads (the tiny Llama's, in the
    full suite, offloads and recomputes)."""
    from deepcompile.runtime import activations as R

    want = _planned_run(model)
    if broken == "no wait":
        monkeypatch.setattr(R.ActivationStore, "wait",
                            lambda self, dst: self._give_back(self._loading.pop(dst.data_ptr())[1]))
    else:
        def reload(self, host):   # the copy back does not wait for the copy out
            self._saved.pop(host.data_ptr())
            dst = torch.empty_like(host)
            self._loading[dst.data_ptr()] = (self.copier.to_device([(dst, host)]), host)
            return dst
        monkeypatch.setattr(R.ActivationStore, "reload", reload)
    eng = _engine(model, BUDGETS[model])
    try:
        got = _train(eng, model, STEPS)
    except FloatingPointError as e:   # uninitialized memory: often inf/NaN, which is refused
        assert "inf/NaN" in str(e)
        return
    assert got[:6] == want[:6]   # before the plan: the same run
    assert got[6:] != want[6:]


# ------------------------------------------------------------------------- engines, 1 and 2 ranks
def _sc(model, budget, world, *, compiler="fx", passes=("activation_budget",), tag="", **kw):
    return scenario(f"{model}-{compiler}-w{world}{tag}", model, "adamw", 1e-2, gas=2, clip=0.1,
                    compiler=compiler, memory_budget=int(budget), passes=passes,
                    record=("report",), **kw)


# profiled peaks without the pass (fx, gradient accumulation 2, torch 2.13): world size 1:
# Llama 1,047,688 B, Mixtral 1,500,328 B, Llama with checkpointing 716,808 B; world size 2:
# 531,208 B, 790,568 B, 394,632 B; tied Llama 539,400 B, Mixtral with the experts' loop (13
# graph breaks, graphs called once per layer) 313,024 B. The budgets are about 70-80% of them
# (90% with checkpointing, which saves little: the lowest peak the pass reaches there is
# 614,400 B; 88% with the experts' loop, whose graphs also hold the full-size gradients the
# eager experts made, which the pass cannot move: the lowest peak it reaches there is
# 262,148 B). The MLP at world size 1 under Inductor: 17,844 B (its backward; 17,624 B with fx),
# and the lowest peak the pass reaches there about 15,300 B.
# The core matrix ([Note: the core matrix] in tests/_train.py) runs the pass under a budget
# below the peak with Inductor on the MLP at world size 1 in inductor1 (its offload ops compiled
# by Inductor) and with fx on the tiny Llama at world size 1 in this process (above), the
# model's own checkpointing in fx1, and a trade in fx2's "-trade-all" (every pass under one
# budget); the other scenarios are the full suite's (among them the Llama under Inductor at 2
# ranks in inductor2 and a trade for prefetch's gathers in "-trade-prefetch"; a trade at world
# size 1 is tests/engine/test_memory_trade.py's, an unattainable budget
# tests/tools/test_verify.py's).
TRADE = ("activation_budget", "selective_unshard")
JOBS = Jobs({
    "fx1": (1, [_sc("mixtral", 1_050_000, 1, extended=True),
                _sc("llama", 420_000, 1, tag="-unattainable", extended=True),
                _sc("llama_ckpt", 650_000, 1)]),
    # Mixtral at world size 2 in the full matrix (fx1 runs it at 1, the Llama here at 2)
    "fx2": (2, [_sc("llama", 372_000, 2, extended=True),
                _sc("mixtral", 553_000, 2, extended=True),
                _sc("llama_tied", 380_000, 2, extended=True),
                _sc("mixtral_eager", 275_000, 2, extended=True),
                _sc("llama", 450_000, 2, passes="auto", tag="-auto", steps=10, extended=True),
                # [Note: a memory trade]: a budget 5% above the peak, which keeps a part of the
                # parameters gathered (all of them take 214,272 B more)
                _sc("llama", 560_000, 2, passes=("selective_unshard",), tag="-unshard", steps=6,
                    extended=True),
                _sc("llama", 560_000, 2, passes=TRADE, tag="-trade", steps=6, extended=True),
                _sc("llama", 2_000_000, 2, passes=TRADE, tag="-trade-ample", steps=6,
                    extended=True),
                # auto: the optimizer state counts in the peak (675.7 KiB); 800,000 B leaves
                # 105.6 KiB, not enough for every parameter and its accumulator (209.2 KiB)
                _sc("llama", 800_000, 2, passes="auto", tag="-auto-trade", steps=8,
                    extended=True),
                # timed: 2 warm-up steps, a profile, a re-profile after the trade and the pass,
                # and a trial of up to 2 x measure_steps (fewer where its verdict is certain
                # sooner: [Note: interleaved measurement]), with steps to spare on a busy machine
                _sc("llama", 560_000, 2, passes=TRADE, tag="-trade-timed", steps=12,
                    measure_steps=2, extended=True),
                # offload_optimizer named: the optimizer state counts in the peak (571.1 KiB)
                _sc("llama", 615_000, 2, tag="-trade-all", steps=8,
                    passes=("offload_optimizer",) + TRADE + ("prefetch", "bucket_reduce")),
                # the peak and 792 B: little room for the backward's first gathers to start
                # earlier (unbounded, prefetch's plan peaks at 581,832 B)
                _sc("llama", 532_000, 2, passes=("activation_budget", "prefetch"),
                    tag="-trade-prefetch", steps=6, extended=True)]),
    # the "-trade" scenario again in a launch of its own: other processes, profiles timed again
    "fx2-again": (2, [_sc("llama", 560_000, 2, passes=TRADE, tag="-trade-again", steps=6,
                          extended=True)]),
    "inductor1": (1, [_sc("mlp", 16_000, 1, compiler="inductor", core=True)]),
    "inductor2": (2, [_sc("llama", 400_000, 2, compiler="inductor", extended=True)]),
}, timeout=1500)


def _peaks(report: dict) -> dict[str, int]:
    """The latest profiled peak of every graph that was profiled."""
    return {s["slot"]: s["profiles"][-1]["peak_bytes"] for g in report["graphs"]
            for s in g["slots"] if s["profiles"]}


def _entry(r: dict) -> dict:
    (entry,) = [e for e in r["report"]["passes"] if e["pass"] == "activation_budget"]
    return entry


@pytest.mark.parametrize("job, sc", [p for p in JOBS.params()
                                     if "unattainable" not in p.id and "unshard" not in p.id
                                     and "trade" not in p.id])
def test_within_the_budget_and_as_eager(job, sc):
    results = JOBS.results(job, sc["id"])
    compare_to_reference(sc, results, kind=f"activation_budget {sc['model']}")
    budget = sc["config"]["memory_budget"]
    for r in results:
        entry = _entry(r)
        assert entry["kept"] and entry["decisions"], entry["verdict"]
        for key, peak in _peaks(r["report"]).items():   # the re-profile measures it
            assert peak <= budget, (key, peak, budget)
    # every rank planned the same (the pipeline checks it too)
    assert len({repr(_entry(r)["decisions"]) for r in results}) == 1


@pytest.mark.extended
def test_an_unattainable_budget_says_so_with_the_lowest_peak():
    (sc,) = [s for s in JOBS.jobs["fx1"][1] if "unattainable" in s["id"]]
    (r,) = JOBS.results("fx1", sc["id"])
    compare_to_reference(sc, [r], kind="activation_budget unattainable")
    entry = _entry(r)
    d = entry["decisions"]["g0"]
    assert d["unattainable"] and d["peak_after"] < d["peak_before"]
    assert entry["kept"] and "lowers the peak" in entry["verdict"]
    peaks = list(_peaks(r["report"]).values())
    assert sc["config"]["memory_budget"] < max(peaks) < d["peak_before"]
    assert "unattainable" in "\n".join(entry["summary"])


def test_the_models_own_checkpointing_is_not_recomputed_twice():
    (sc,) = [s for s in JOBS.jobs["fx1"][1] if s["model"] == "llama_ckpt"]
    (r,) = JOBS.results("fx1", sc["id"])
    d = _entry(r)["decisions"]["g0"]
    # the checkpointed layers' inputs are what is saved; recomputing one would redo the layer
    # before it, which the backward recomputes already: they are offloaded
    assert d["choices"] and all(c["action"] == "offload" for c in d["choices"]
                                if c["name"].startswith("add_"))


@pytest.mark.extended
def test_auto_trades_activations_with_the_other_passes():
    """Under a budget that the optimizer state alone cannot meet (auto counts it), the
    activations pay for it, and the passes after plan in what is left."""
    (sc,) = [s for s in JOBS.jobs["fx2"][1] if s["id"].endswith("-auto")]
    r = JOBS.results("fx2", sc["id"])[0]
    log = {e["pass"]: e for e in r["report"]["passes"]}
    assert list(log) == ["offload_optimizer", "activation_budget", "prefetch", "bucket_reduce"]
    assert log["activation_budget"]["kept"] and log["activation_budget"]["changed"]
    assert all(e["kept"] for e in log.values())


# ------------------------------------------------- a memory trade (within the budget)
def _trade_runs(tag: str) -> tuple[dict, list[dict], list[dict[str, dict]]]:
    """The 2-rank Llama scenario made with `tag`, its results and each rank's passes."""
    ((job, sc),) = [(job, s) for job, (_, scs) in JOBS.jobs.items() for s in scs
                    if s["id"] == f"llama-fx-w2{tag}"]
    results = JOBS.results(job, sc["id"])
    return sc, results, [{e["pass"]: e for e in r["report"]["passes"]} for r in results]


@pytest.mark.extended
def test_within_the_budget_activations_pay_for_parameters_kept_gathered():
    """[Note: a memory trade] in passes/activation_budget.py: with the peak within the budget,
    the activations selective_unshard's memory is worth more than are recomputed or offloaded
    for it, and it keeps more parameters gathered than it does alone under the same budget;
    the peaks stay within the budget, training matches eager, every rank plans alike."""
    _, _, alone = _trade_runs("-unshard")
    sc, results, logs = _trade_runs("-trade")
    budget = sc["config"]["memory_budget"]
    compare_to_reference(sc, results, kind="activation_budget trade")
    act, kept = logs[0]["activation_budget"], logs[0]["selective_unshard"]
    t = act["decisions"]["trade"]
    print(f"\n[trade] {t}; kept {len(kept['decisions']['keep'])} parameters, alone "
          f"{len(alone[0]['selective_unshard']['decisions']['keep'])}; {act['verdict']}")
    assert act["kept"] and act["verdict"].startswith("kept with selective_unshard")
    assert t["for"] == "selective_unshard" and t["freed_bytes"] > 0
    assert t["value_s"] >= 2 * t["added_s"] > 0
    assert act["changed"] and any(line.startswith("traded: freed") for line in act["summary"])
    assert len(kept["decisions"]["keep"]) > len(alone[0]["selective_unshard"]["decisions"]["keep"])
    for r in results:
        for key, peak in _peaks(r["report"]).items():
            assert peak <= budget, (key, peak, budget)
    for name in TRADE:
        assert len({repr(log[name]["decisions"]) for log in logs}) == 1, name


def _traded(log: dict[str, dict]) -> tuple:
    """What a trade decided, without its timed figures."""
    d = log["activation_budget"]["decisions"]
    return (d["trade"]["freed_bytes"],
            {k: [(c["name"], c["action"]) for c in v["choices"]] for k, v in d.items()
             if k != "trade"},
            sorted(i["param"] for i in log["selective_unshard"]["decisions"]["keep"]))


@pytest.mark.extended
def test_a_second_launch_trades_the_same():
    """The same trade from profiles timed again, in other processes (a launch of its own)."""
    _, _, first = _trade_runs("-trade")
    _, _, again = _trade_runs("-trade-again")
    assert _traded(first[0]) == _traded(again[0])


@pytest.mark.extended
def test_auto_chooses_the_trade():
    """`passes="auto"` with some room under the budget, not enough for every parameter kept
    gathered: activation_budget is chosen before selective_unshard, trades, and what
    selective_unshard keeps takes more than the room there was before the trade; as eager."""
    sc, results, logs = _trade_runs("-auto-trade")
    compare_to_reference(sc, results, kind="activation_budget trade (auto)")
    log = logs[0]
    print("\n" + "\n".join(f"[trade auto] {n}: {e['verdict']}: {e['summary'][:1]}"
                            for n, e in log.items()))
    assert list(log)[:2] == ["activation_budget", "selective_unshard"], list(log)
    act, kept = log["activation_budget"], log["selective_unshard"]
    assert act["summary"][0].startswith("traded: freed") and act["kept"] and kept["kept"]
    d = kept["decisions"]
    room = sc["config"]["memory_budget"] - act["before"]["peak_bytes"]
    assert d["kept_bytes"] + d["accumulator_bytes"] > room > 0
    assert len({repr({n: e["decisions"] for n, e in lg.items()}) for lg in logs}) == 1


@pytest.mark.extended
def test_with_ample_memory_nothing_is_traded():
    sc, results, logs = _trade_runs("-trade-ample")
    act = logs[0]["activation_budget"]
    assert act["decisions"] == {} and act["verdict"] == "changed no graph"
    assert len(logs[0]["selective_unshard"]["decisions"]["keep"]) == 21


def test_every_pass_under_one_budget_with_a_trade():
    """Every ZeRO-3 pass named, under a budget 5% above the peak: the activations pay for
    parameters kept gathered; the passes after them plan in what is left; the report says what
    each one bought and gave up; the peaks stay within the budget; as eager."""
    sc, results, logs = _trade_runs("-trade-all")
    budget = sc["config"]["memory_budget"]
    compare_to_reference(sc, results, kind="activation_budget trade (every pass)")
    log = logs[0]
    print("\n" + "\n".join(f"[trade all] {n}: {e['verdict']}; {e['summary'][:2]}"
                            for n, e in log.items()))
    assert log["activation_budget"]["verdict"].startswith("kept with selective_unshard")
    assert log["activation_budget"]["summary"][0].startswith("traded: freed")
    assert log["selective_unshard"]["kept"] and log["selective_unshard"]["decisions"]["keep"]
    assert all(e["kept"] for e in log.values())
    for r in results:
        for key, peak in _peaks(r["report"]).items():
            assert peak <= budget, (key, peak, budget)
    assert len({repr({n: e["decisions"] for n, e in lg.items()}) for lg in logs}) == 1


# the full suite's: the core trades end to end for selective_unshard in "-trade-all", and
# tests/unit/test_prefetch_offers.py trades for prefetch's offers (those that pay, one that
# does not, auto's choice of the buyer, the report's line)
@pytest.mark.extended
def test_within_the_budget_activations_are_weighed_against_gathers_started_earlier():
    """[Note: a memory trade] with prefetch planning next, under a budget at the profiled peak:
    prefetch says what the memory would hide (`memory_value`: its planner on the same profiles,
    the live bytes held lower), and the activations are freed for it where that saves at least
    twice the time it adds. On this machine's times that pays in most launches, not all (the
    gathers' predicted time, the compute they hide behind and the copies' cost move with the
    load), so the decision is checked either way from its figures: traded, the report line
    names what prefetch bought, and prefetch plans on the graphs the trade left and spends
    memory they freed; declined, each target tried saves less than twice what it adds and no
    graph changes. Either way the peaks stay within the budget, training matches eager, every
    rank plans alike."""
    sc, results, logs = _trade_runs("-trade-prefetch")
    budget = sc["config"]["memory_budget"]
    compare_to_reference(sc, results, kind="activation_budget trade (prefetch)")
    act, pre = logs[0]["activation_budget"], logs[0]["prefetch"]
    d = act["decisions"]
    print(f"\n[trade prefetch] {d}; {act['summary'][0]}; " + "; ".join(pre["summary"][1:3]))
    if "trade" in d:
        t = d["trade"]
        assert act["kept"] and act["verdict"].startswith("kept with prefetch")
        assert t["for"] == "prefetch" and t["freed_bytes"] > 0 and 1 <= t["bought"] <= t["offers"]
        assert t["peak_before"] <= budget and t["value_s"] >= 2 * t["added_s"] > 0
        assert act["summary"][0].startswith(
            f"traded: freed {A.size(t['freed_bytes'])} below the peak {A.size(t['peak_before'])}"
            f" for prefetch (gathers started earlier: {t['bought']} of its {t['offers']} offers)")
        # prefetch planned the backward on the re-profile after the trade, and holds gathers
        # above the peak the trade left
        bw = pre["decisions"]["g0.bw"]
        assert bw["peak_before"] == act["after"]["peak_bytes"] < t["peak_before"]
        assert bw["peak_before"] < bw["peak_after"] <= budget
    else:
        no = d["declined"]
        assert no["for"] == "prefetch" and no["offers"] >= 1 and no["tried"]
        assert not act["changed"] and act["verdict"] == "changed no graph"
        assert all(p["freed_bytes"] <= 0 or p["value_s"] < 2 * p["added_s"] for p in no["tried"])
        assert act["summary"][0].startswith("not traded for prefetch (gathers started earlier: ")
    for r in results:
        for key, peak in _peaks(r["report"]).items():
            assert peak <= budget, (key, peak, budget)
    for name in ("activation_budget", "prefetch"):
        assert len({repr(log[name]["decisions"]) for log in logs}) == 1, name


def _offload_trade_job(rank, world, budget_of):
    """Two engines on this rank: offload_optimizer alone under an unbounded budget (the
    reference, and the figures the budget comes from), then `auto` under `budget_of(figures)`;
    copies priced slow (tests/engine/test_memory_trade.py `SLOW_COPY`) on every rank alike."""
    import functools

    import deepcompile
    from deepcompile.runtime import flat

    flat.CHUNK_BYTES = 16384   # several chunks of each rank's shards: a plan that can keep some
    out = {}
    for name, passes in (("plain", ("offload_optimizer",)), ("auto", "auto")):
        torch._dynamo.reset()
        budget = None if name == "plain" else budget_of(out["plain"]["figures"])
        engine = deepcompile.initialize(
            _models.build_model("llama"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
            config=deepcompile.Config(compiler="fx", passes=passes, measure_steps=0,
                                      memory_budget=budget or 1 << 40,
                                      gradient_accumulation_steps=2))
        engine._pipeline.cost.copy = (0.0, 1e-5)
        losses = []
        for step in range(8):
            for m in range(2):
                loss = _models.loss_of(engine(**_models.local_batch("llama", 2 * step + m,
                                                                     rank, world)))
                engine.backward(loss)
                losses.append(loss.item())
            engine.step()
        passes_log = engine.report().to_dict()["passes"]
        off = next(p for p in passes_log if p["pass"] == "offload_optimizer")
        out[name] = {"losses": losses, "log": [(p["pass"], p["kept"], p["decisions"])
                                                for p in passes_log],
                     "figures": off["decisions"], "step_peak": engine._offload.step_peak(),
                     "state": {k: v.clone() for k, v in engine.full_state_dict().items()},
                     "budget": budget}
        del engine
    return out


@pytest.mark.extended   # world size 1 in the core: tests/engine/test_memory_trade.py
def test_activations_freed_for_optimizer_state_alike_on_every_rank():
    """[Note: a memory trade] with offload_optimizer as the buyer at 2 ranks: `auto` queues it
    after activation_budget, the activations freed keep state on the device, every rank plans
    the same, and training is bitwise the training with all state on the device."""
    from _dist import run_distributed

    budget_of = _Budget()
    ranks = run_distributed(_offload_trade_job, 2, budget_of, timeout=900)
    for r in ranks:
        auto = r["auto"]
        passes = [p for p, _, _ in auto["log"]]
        assert passes[:2] == ["activation_budget", "offload_optimizer"], passes
        trade = auto["log"][0][2]["trade"]
        assert trade["for"] == "offload_optimizer" and trade["bought"] >= 1, trade
        assert auto["step_peak"] <= auto["budget"]
        assert auto["losses"] == r["plain"]["losses"]
        for k, v in r["plain"]["state"].items():
            assert torch.equal(auto["state"][k], v), k
    assert ranks[0]["auto"]["log"] == ranks[1]["auto"]["log"]


class _Budget:
    """The graphs' peak with all state on the device, less 30% of the state (picklable)."""

    def __call__(self, figures):
        return figures["graph_peak_bytes"] - figures["state_bytes"] * 3 // 10


@pytest.mark.extended
def test_a_timed_trade_is_kept_or_reverted_with_the_pass_it_pays_for():
    """Timed, the trade and selective_unshard are one trial against the graphs from before the
    trade ([Note: interleaved measurement]), and share its verdict."""
    sc, results, logs = _trade_runs("-trade-timed")
    compare_to_reference(sc, results, kind="activation_budget trade (timed)")
    for log in logs:
        assert {"activation_budget", "selective_unshard"} <= set(log), list(log)
        act, kept = log["activation_budget"], log["selective_unshard"]
        print(f"\n[trade timed] {act['verdict']}")
        assert act["kept"] == kept["kept"]
        assert act["verdict"].startswith(("kept with selective_unshard",
                                          "reverted with selective_unshard"))
        assert kept["after"]["measured_s"] and kept["before"]["measured_s"]
        assert kept["before"]["peak_bytes"] == act["before"]["peak_bytes"]


# ------------------------------------------------------------ graphs of another shape
def test_a_member_graph_runs_the_plan_with_its_outputs_and_readers_moved():
    """A graph compiled for another shape of the same code runs the representative's plan
    (compiler/families.py): the values the plan hands over in place of a saved one, and the
    readers it moved to a value of its own, move in the member too."""
    import copy

    from torch import fx, nn

    from deepcompile.compiler import families
    from deepcompile.runtime import activations as R

    def graph() -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        a = g.call_function(torch.ops.aten.relu.default, (x,), name="relu")
        b = g.call_function(torch.ops.aten.sin.default, (a,), name="sin")
        g.output((b, a))
        for n in g.nodes:
            n.meta["val"] = torch.empty(2)
        return fx.GraphModule(nn.Module(), g)

    rep, member = graph(), graph()
    planned = copy.deepcopy(rep)
    relu = next(n for n in planned.graph.nodes if n.name == "relu")
    sin = next(n for n in planned.graph.nodes if n.name == "sin")
    out = next(n for n in planned.graph.nodes if n.op == "output")
    with planned.graph.inserting_after(sin):
        host = planned.graph.call_function(R.OFFLOAD, (relu, 7))
    out.args = ((sin, host),)
    with planned.graph.inserting_before(sin):   # a reader moved to a value of the plan's
        cos = planned.graph.call_function(torch.ops.aten.cos.default, (relu,))
    sin.args = (cos,)
    got, _ = families.transplant(rep, planned, member)
    nodes = {n.name: n for n in got.graph.nodes}
    (off,) = [n for n in got.graph.nodes if n.target is R.OFFLOAD]
    (g_out,) = [n for n in got.graph.nodes if n.op == "output"]
    assert g_out.args[0][1] is off and g_out.args[0][0] is nodes["sin"]
    assert nodes["sin"].args[0].target is torch.ops.aten.cos.default


def test_a_recompute_does_not_transplant_onto_other_shapes():
    import copy

    from torch import fx, nn

    from deepcompile.compiler import families

    def graph(n: int) -> fx.GraphModule:
        g = fx.Graph()
        x = g.placeholder("x")
        a = g.call_function(torch.ops.aten.relu.default, (x,), name="relu")
        g.output((g.call_function(torch.ops.aten.sin.default, (a,), name="sin"),))
        for node in g.nodes:
            node.meta["val"] = torch.empty(n)
        return fx.GraphModule(nn.Module(), g)

    rep = graph(2)
    planned = copy.deepcopy(rep)
    sin = next(n for n in planned.graph.nodes if n.name == "sin")
    with planned.graph.inserting_before(sin):
        again = planned.graph.call_function(torch.ops.aten.view.default, (sin.args[0], [2]))
    again.meta["dc_shape_bound"] = True
    sin.args = (again,)
    families.transplant(rep, planned, graph(2))   # the same shapes: carried over
    with pytest.raises(families.TransplantError, match="representative's shapes"):
        families.transplant(rep, planned, graph(3))
