"""The stages and passes that landed separately, together (fx, 2 ranks, AdamW, accumulation 2,
clipping): parity with the eager reference, and each pass a no-op where its pattern is absent.

  * ZeRO-1 and ZeRO-2 with every ZeRO-3 pass configured: `prefetch` and `selective_unshard` find
    no gathers and change nothing; `offload_optimizer` (a budget the step fits in: 1 GiB) runs
    its start-up offload and reload through the warm-up and profiled steps, then keeps
    everything;
  * ZeRO-3 with all four passes, unbounded budget: everything is kept gathered, nothing is
    offloaded (nor ever was: no provisional offload without a budget), one all-gather (the
    refresh) per optimizer step.

Each case runs on the MLP in the default run and on the tiny Llama in the full suite ([Note: the
core matrix] in tests/_train.py); ZeRO-2 runs in the full suite only (the default run's ZeRO-1
case has the same passes and checks).
"""

from __future__ import annotations

import pytest

from _train import Jobs, compare_to_reference, scenario

ALL = ("prefetch", "bucket_reduce", "selective_unshard", "offload_optimizer")


def _sc(id, model, steps=6, **config):
    return scenario(id if model == "llama" else f"{id}-{model}", model, "adamw", 1e-2, gas=2,
                    clip=0.1, steps=steps, record=("report", "comm"), **config)


# case: its scenarios, the MLP's (the default run's) first
CASES = {
    "zero1-all-passes": [_sc("zero1-all-passes", m, zero_stage=1, passes=ALL,
                             memory_budget=1 << 30, extended=m == "llama")
                         for m in ("mlp", "llama")],
    "zero2-all-passes": [_sc("zero2-all-passes", "llama", zero_stage=2, passes=ALL,
                             memory_budget=1 << 30, extended=True)],
    # warm-up 2, profile 1, a re-profile after each pass that changed a graph: steady by step 8
    "zero3-all-passes": [_sc("zero3-all-passes", m, steps=10, zero_stage=3, passes=ALL,
                             extended=m == "llama") for m in ("mlp", "llama")],
}
JOBS = Jobs({"fx2": (2, [sc for scs in CASES.values() for sc in scs])}, timeout=900)


def _runs(case):
    """(scenario, every rank's result) of each scenario of `case` this run trains."""
    scs = [sc for sc in CASES[case] if sc["id"] not in JOBS.left_out["fx2"]]
    if not scs:
        JOBS.results("fx2", CASES[case][0]["id"])   # skips, saying why
    return [(sc, JOBS.results("fx2", sc["id"])) for sc in scs]


@pytest.mark.parametrize("case", list(CASES))
def test_parity(case):
    for sc, results in _runs(case):
        compare_to_reference(sc, results, kind=f"{sc['model']}/composition")


@pytest.mark.parametrize("case", ["zero1-all-passes", "zero2-all-passes"])
def test_zero3_passes_change_nothing_at_stages_1_and_2(case):
    for _, results in _runs(case):
        for r in results:
            passes = {e["pass"]: e for e in r["report"]["passes"]}
            assert set(passes) == set(ALL)
            assert passes["prefetch"]["changed"] == [] and \
                passes["selective_unshard"]["changed"] == []
            assert passes["bucket_reduce"]["changed"], "bucket_reduce buckets the reduce-scatters"
            # profiled with the state off the device (provisional), then all of it back
            off = passes["offload_optimizer"]["decisions"]
            assert off["profiled_offloaded_bytes"] > 0 and off["chunks"] == []
            # no collective in the forward, never an all-reduce of gradients
            assert all(f["all_gather"] == (0, 0) and f["reduce_scatter"] == (0, 0)
                       for f in r["comm_fwd"])
            # the clipping norm rides in the inf/NaN check's reduction (bookkeeping, uncounted)
            assert all(s["all_reduce"] == (0, 0) for s in r["comm_step"])


def test_zero3_all_passes_unbounded_keeps_everything():
    for _, results in _runs("zero3-all-passes"):
        for r in results:
            assert r["report"]["phase"] == "steady"
            off = next(e for e in r["report"]["passes"] if e["pass"] == "offload_optimizer")
            assert off["changed"] == [] and off["decisions"]["profiled_offloaded_bytes"] == 0
            # steady state (the last steps): no gather inside the graphs, one refresh after the
            # step
            for f, b in zip(r["comm_fwd"][-4:], r["comm_bwd"][-4:]):
                assert f["all_gather"][0] == 0 and b["all_gather"][0] == 0, (f, b)
            for s in r["comm_step"][-2:]:
                assert s["all_gather"][0] == 1, s
