"""Graphs whose structure depends on the data train as one process does ([Note: graph
structure] in compiler/families.py; [Note: structures are agreed at each call] in
runtime/divergence.py).

`loop_count` runs a loop `int(k.max())` times after a graph break (Dynamo unrolls it: one graph
per count over the same parameters), `branch_count` takes one of two paths over the same
parameters by the count's parity; the count changes from micro-step to micro-step, the same on
every rank (tests/_models.py `COUNTS`: 1, 2, 3, 1, ..., with 4 and 5 first coming after the
passes planned). On 2 gloo ranks with passes="auto", at ZeRO-1, 2 and 3 (with gradient
accumulation), FX and one Inductor case, against one eager process: every structure is a graph
of its own (inserted, profiled and planned when it ran in a profiled step, insertion-only when
it first came after planning), each call of the code's forward graphs is agreed across ranks,
the collectives of every step are the same on both ranks, and the divergence check passes at
every step.

Also: ranks whose counts differ in one step all raise the same DivergenceError at that step,
naming the graphs, without waiting for a timeout (both structures known, or both new); a count
only one rank meets for the first time ends on both ranks within the collective timeout,
naming the graph; an evaluation at ZeRO-1 may take another path on each rank. A loop count
past Dynamo's recompile limit: one warning naming the code and the limit, and training as one
process does (the eager fallback). A gather a cross-graph prefetch started for a graph that does
not come next (another structure came) is dropped when the next graph starts.
"""

from __future__ import annotations

import functools
import logging
import time

import pytest
import torch

import _models
from _dist import run_distributed
from _train import Jobs, compare_to_reference, scenario

STEPS = 12


def _sc(id, model, stage, **kw):
    return scenario(id, model, "sgd", 0.05, steps=STEPS, zero_stage=stage, passes="auto",
                    record=("structures", "comm"), **kw)


JOBS = Jobs({
    "structure": (2, [
        _sc("loop-z1-gas2", "loop_count", 1, gas=2),
        _sc("loop-z2", "loop_count", 2, extended=True),
        _sc("loop-z3", "loop_count", 3, extended=True),   # loop-z3-gas2 in the core
        _sc("loop-z3-gas2", "loop_count", 3, gas=2),
        _sc("branch-z1", "branch_count", 1),
        _sc("branch-z2", "branch_count", 2, extended=True),
        # the branch at ZeRO-3: the full suite's (the branch is branch-z1's, ZeRO-3's structures
        # loop-z3-gas2's)
        _sc("branch-z3", "branch_count", 3, extended=True),
        # Dynamo compiles the loop for counts 1 and 2 only: 3 and 4 run eagerly (ZeRO-1's: the
        # full suite's; the core runs a submodule eagerly at ZeRO-1 in test_zero12's `disabled`)
        {**scenario("loop-z3-limit", "loop_count", "sgd", 0.05, steps=10, zero_stage=3,
                    passes="auto", record=("structures",)), "recompile_limit": 2},
        {**scenario("loop-z1-limit", "loop_count", "sgd", 0.05, steps=10, zero_stage=1,
                    passes="auto", record=("structures",), extended=True),
         "recompile_limit": 2},
    ]),
    "inductor-structure": (2, [
        _sc("loop-z3-inductor", "loop_count", 3, compiler="inductor"),
    ]),
}, timeout=1200)


def test_the_structure_digest_leaves_sizes_out_and_not_the_unrolled_loop():
    """A graph recompiled for new sizes (static, then dynamic) has its first graph's structure;
    an unrolled loop of another count does not."""
    from deepcompile.compiler.families import structure_digest

    seen: list[tuple[int, int, bool]] = []   # (the call's count, digest, dynamic sizes)
    count = [0]

    def backend(gm, example_inputs):
        dynamic = any(not isinstance(v, torch.Tensor) for v in example_inputs)
        seen.append((count[0], structure_digest(gm), dynamic))
        return gm.forward

    def f(x, w, n: int):
        h = x
        for _ in range(n):
            h = torch.tanh(h @ w + x[:, : w.shape[1]])
        return h.sum(-1)

    torch._dynamo.reset()
    fc = torch.compile(f, backend=backend)
    w = torch.randn(8, 8)
    for rows, n in ((4, 1), (6, 1), (7, 1), (4, 2), (5, 2), (9, 2)):
        count[0] = n
        fc(torch.randn(rows, 8), w, n)
    torch._dynamo.reset()
    assert any(dynamic for *_, dynamic in seen) and len(seen) >= 3, seen
    by_count: dict[int, set[int]] = {}
    for n, d, _ in seen:
        by_count.setdefault(n, set()).add(d)
    assert len(by_count[1]) == 1 and len(by_count[2]) == 1 and by_count[1] != by_count[2], seen


def _structure_checks(results, sc):
    """What every rank compiled and ran for the loop's (or branch's) code."""
    r0, r1 = (r["structures"] for r in results)
    assert r0["slots"].keys() == r1["slots"].keys()
    for key, s in r0["slots"].items():   # the same graphs, structures and plans on both ranks
        other = r1["slots"][key]
        assert (s["structure"], s["varies"], s["checked"], s["version"], s["calls"]) == \
            (other["structure"], other["varies"], other["checked"], other["version"],
             other["calls"]), key
    assert r0["passes"] == r1["passes"] and r0["structure_group"]
    reps = {k: s for k, s in r0["slots"].items() if s["rep"] is None}
    varying = {k: s for k, s in reps.items() if s["varies"]}
    counts = sorted({_models.COUNTS[m % len(_models.COUNTS)]
                     for m in range(sc["steps"] * sc["config"]["gradient_accumulation_steps"])})
    # one forward and one backward graph per structure of the code after the break: a count
    # each (the loop), or a parity each (the branch)
    n = len(counts) if sc["model"] == "loop_count" else 2
    assert len([k for k, s in varying.items() if s["kind"] == "fw"]) == n, sorted(varying)
    assert len([k for k, s in varying.items() if s["kind"] == "bw"]) == n, sorted(varying)
    assert len({s["structure"] for s in varying.values()}) == n
    for key, s in varying.items():   # each forward's calls agreed across ranks, not the backward's
        assert s["checked"] == (s["kind"] == "fw"), (key, s)
    # the frame before the break has one structure: never checked per call
    assert all(not s["checked"] for s in reps.values() if not s["varies"])
    phases = r0["phases"]
    assert phases[-1] == "steady", phases
    return r0, reps, varying


@pytest.mark.parametrize("job,sc", JOBS.params())
def test_a_structure_per_count_trains_like_one_process(job, sc):
    results = JOBS.results(job, sc["id"])
    compare_to_reference(sc, results, kind="structure")
    if "limit" in sc["id"]:
        return   # test_recompile_limit
    r0, reps, varying = _structure_checks(results, sc)
    # the structures that ran before planning were profiled, and some planned (a pass changed
    # them); the loop's counts 4 and 5 first come in the steady state: insertion only, with a
    # warning
    planned = {k for _, changed, kept in r0["passes"] if kept for k in changed}
    assert planned & set(varying), (r0["passes"], sorted(varying))
    late = [w for w in r0["warnings"] if "compiled after planning" in w]
    print(f"\n[structure] {sc['id']}: phases {r0['phases']}; passes {r0['passes']}; "
          f"graphs { {k: (s['version'], s['profiled'], s['calls']) for k, s in reps.items()} }")
    if sc["model"] == "loop_count":   # (the branch's two structures come at once)
        assert late and all("another structure of a graph's code" in w for w in late), late
        newest = [w.split()[2] for w in late]
        assert sorted(newest) == sorted(f"{k.split('.')[0]}.{kind}" for k in newest
                                        if k.endswith(".fw") for kind in ("fw", "bw"))
        assert all(not varying[k]["profiled"] and varying[k]["version"] == 0 for k in newest)
    # the same collectives on both ranks, step by step (the divergence check passed: no error)
    assert results[0]["comm_step"] == results[1]["comm_step"]
    assert results[0]["comm_fwd"] == results[1]["comm_fwd"]
    assert results[0]["comm_bwd"] == results[1]["comm_bwd"]
    assert not [w for w in r0["warnings"] if "not used" in w], r0["warnings"]


@pytest.mark.parametrize("sc_id", ["loop-z3-limit", "loop-z1-limit"])
def test_recompile_limit(sc_id):
    """Past Dynamo's recompile limit the code after the break runs eagerly: one warning (on
    each rank) naming it and the limit; the training is one process's (checked above)."""
    for r in JOBS.results("structure", sc_id):
        warned = [w for w in r["structures"]["warnings"] if "Dynamo stopped compiling" in w]
        assert len(warned) == 1, r["structures"]["warnings"]
        assert "the code of forward() after its graph break at line" in warned[0]
        assert "_models.py" in warned[0]
        assert "torch._dynamo.config.recompile_limit (now 2)" in warned[0]
        fws = [k for k, s in r["structures"]["slots"].items()
               if s["varies"] and s["kind"] == "fw"]
        assert len(fws) == 2, r["structures"]["slots"]   # counts 1 and 2 compiled


# ------------------------------------------------------- counts that differ between the ranks
T = 2.0            # Config.collective_timeout_s where a rank waits for the timeout
BOUND = 3 * T + 10.0
LONG = 120.0       # ... where none should: a rank waits for the other's compile only


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _diverge(rank, counts, stage, timeout=LONG):
    """Train `loop_count` with `counts[step][rank]`; returns how the faulty step ended."""
    import deepcompile

    torch._dynamo.reset()
    engine = deepcompile.initialize(
        _models.build_model("loop_count"), optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        config={"compiler": "fx", "zero_stage": stage, "warmup_steps": 1, "passes": "auto",
                "measure_steps": 0, "collective_timeout_s": timeout, "startup_timeout_s": 120.0})
    out = {}
    for step, per_rank in enumerate(counts):
        batch = _models.local_batch("loop_count", step, rank, 2)
        batch["k"] = torch.full_like(batch["k"], per_rank[rank])
        if per_rank[0] != per_rank[1]:
            out["t0"], out["steady"] = time.monotonic(), engine._rails.steady
        try:
            engine.backward(engine(**batch))
            engine.step()
        except Exception as e:  # noqa: BLE001 -- what the test asserts
            out.update(type=type(e).__name__, message=str(e), step=step,
                       elapsed=time.monotonic() - out["t0"])
            try:   # the engine refuses to go on
                engine(**batch)
            except Exception as again:  # noqa: BLE001
                out["next_call"] = type(again).__name__
            break
    del engine
    torch._dynamo.reset()
    return out


def _eval_job(rank):
    """ZeRO-1: an evaluation whose count differs between the ranks (each rank's own data) runs
    no collective: not checked, each rank's loss is its own model's."""
    import deepcompile

    torch._dynamo.reset()
    engine = deepcompile.initialize(
        _models.build_model("loop_count"), optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        config={"compiler": "fx", "zero_stage": 1, "warmup_steps": 1, "passes": "auto",
                "measure_steps": 0})
    out = {}
    for step, n in enumerate((1, 2, 1, 2, 1)):
        batch = _models.local_batch("loop_count", step, rank, 2)
        batch["k"] = torch.full_like(batch["k"], n)
        engine.backward(engine(**batch))
        engine.step()
    batch = _models.local_batch("loop_count", 99, rank, 2)
    batch["k"] = torch.full_like(batch["k"], 1 + rank)   # rank 0: 1, rank 1: 2
    engine.module.eval()
    with torch.no_grad():
        out["eval"] = engine(**batch).item()
    engine.module.train()
    model = _models.build_model("loop_count")
    model.load_state_dict(engine.full_state_dict())
    with torch.no_grad():
        out["expected"] = model.eval()(**batch).item()
    out["checked"] = sorted(k for k, s in engine._pipeline.slots.items() if s.checked)
    out["inference"] = sorted(k for k, s in engine._pipeline.slots.items()
                              if s.kind == "inference")
    del engine
    torch._dynamo.reset()
    return out


def _diverge_job(rank, world):
    same = [(c, c) for c in (1, 2, 1, 2, 1, 2, 1)]
    return {
        "eval": _eval_job(rank),
        # counts 1 and 2 compiled and planned on both ranks; then rank 0 runs 1, rank 1 runs 2
        "known": _diverge(rank, same + [(1, 2)], 3),
        # both ranks meet a new count in the same step, each another one
        "both_new": _diverge(rank, same + [(3, 4)], 1),
        # only rank 1 meets a second count (last: the timeout leaves the group unusable)
        "first_on_one_rank": _diverge(rank, [(1, 1)] * 5 + [(1, 2)], 3, timeout=T),
    }


@pytest.fixture(scope="module")
def diverged():
    return run_distributed(_diverge_job, 2, timeout=600)


def test_an_evaluation_at_zero1_may_take_another_path_on_each_rank(diverged):
    for r in diverged:
        assert abs(r["eval"]["eval"] - r["eval"]["expected"]) <= 1e-6, r["eval"]
        assert len(r["eval"]["inference"]) == 2, r["eval"]   # g0's and the loop's
        assert not [k for k in r["eval"]["checked"] if k.endswith(".inference")], r["eval"]
        assert r["eval"]["checked"], r["eval"]   # the training forwards are


def test_known_structures_that_differ_between_ranks_raise_at_once(diverged):
    r0, r1 = (r["known"] for r in diverged)
    print(f"\n[diverge] {r0['message']}")
    for r in (r0, r1):
        assert r["type"] == "DivergenceError" and r["step"] == 7 and r["steady"], r
        assert r["elapsed"] < LONG / 4, r   # no timeout: both ranks are at the check
        assert r["next_call"] == "EngineStoppedError"
    assert r0["message"] == r1["message"]
    msg = r0["message"]
    assert "different structures of one piece of code in optimizer step 7 (micro-step 0)" in msg
    assert "ranks [0]: g1.fw (structure" in msg and "ranks [1]: g2.fw (structure" in msg


def test_new_structures_that_differ_between_ranks_raise_at_once(diverged):
    r0, r1 = (r["both_new"] for r in diverged)
    for r in (r0, r1):
        assert r["type"] == "DivergenceError" and r["step"] == 7, r
        assert r["elapsed"] < LONG / 4, r
    assert r0["message"] == r1["message"]
    assert "ranks [0]: g3.fw (structure" in r0["message"]
    assert "ranks [1]: g3.fw (structure" in r0["message"]


def test_a_second_structure_on_one_rank_ends_within_the_timeout(diverged):
    r0, r1 = (r["first_on_one_rank"] for r in diverged)
    print(f"\n[diverge] rank 0: {r0['message']}\n[diverge] rank 1: {r1['message']}")
    for r in (r0, r1):
        assert r["type"] == "DistributedError" and r["step"] == 5 and r["steady"], r
        assert T <= r["elapsed"] < BOUND, r
    assert "rank 1 compiled a new graph g2.fw at step 5" in r1["message"]
    # rank 1 reports once its wait at the agreement ends, after compiling g2.fw: where that
    # compile takes longer than rank 0's wait for reports (a loaded machine), rank 0 reports
    # nothing from it and may have left, and with it the store, before rank 1 reads who
    # arrived. Either way each rank says what it knows, and rank 1 never names itself.
    assert ("ranks [0] did not compile it" in r1["message"]
            or "some rank did not compile it within" in r1["message"]
            and "the store cannot say" in r1["message"]), r1["message"]
    assert ("graph g2.fw): waits at the agreement" in r0["message"]
            or "rank 1: nothing reported within" in r0["message"]), r0["message"]


# ------------------------------------- a structure met after a cross-graph prefetch was planned
def _late_job(rank, world, counts):
    import deepcompile

    torch._dynamo.reset()
    engine = deepcompile.initialize(
        _models.build_model("loop_count"), optimizer=functools.partial(torch.optim.SGD, lr=0.05),
        config={"compiler": "fx", "zero_stage": 3, "warmup_steps": 1, "measure_steps": 0,
                "passes": ("prefetch",)})
    parked = engine._runtime.parked
    out = {"losses": [], "held_after_forward": []}
    for step, n in enumerate(counts):
        batch = _models.local_batch("loop_count", step, rank, world)
        batch["k"] = torch.full_like(batch["k"], n)
        loss = engine(**batch)
        out["held_after_forward"].append(len(parked.parked))
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
    (entry,) = engine._pipeline.pass_log
    out["for_next"] = {k: [a["for"] for a in d.get("for_next", [])]
                       for k, d in entry["decisions"].items()}
    out["misses"] = dict(parked.misses)
    out["phases"] = [p for p, _ in engine._pipeline.step_log]
    out["state"] = engine.full_state_dict()
    del engine
    return out


def test_a_gather_started_for_a_graph_that_does_not_come_next_is_dropped_at_once():
    """prefetch planned g0.fw to start g1.fw's first gather (the loop's only structure then);
    in the steady state the count changes: g2.fw follows g0.fw, and the gather parked for g1.fw
    is dropped when g2.fw starts, not held through the step."""
    counts = [1, 1, 1, 1, 2, 1, 2]
    r0, r1 = run_distributed(_late_job, 2, counts, timeout=600)
    assert r0["phases"][4] == "steady", r0["phases"]
    assert r0["for_next"].get("g0.fw") == ["g1.fw"], r0["for_next"]
    for r in (r0, r1):
        # a count of 1: g1.fw takes what g0.fw parked (and may park for g1.bw); 2: dropped as
        # g2.fw starts, nothing held after the forward
        assert [h for h, n in zip(r["held_after_forward"], counts) if n == 2] == [0, 0], r
        assert r["misses"] == {"missing": 0, "other_tensors": 0, "unused": 2}, r["misses"]
    model = _models.build_model("loop_count")   # one process, every rank's batch
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, n in enumerate(counts):
        batch = _models.global_batch("loop_count", step)
        batch["k"] = torch.full_like(batch["k"], n)
        model(**batch).backward()
        opt.step()
        opt.zero_grad()
    for k, v in model.state_dict().items():
        assert (r0["state"][k] - v).abs().max() <= 1e-5, k
