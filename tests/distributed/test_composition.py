"""The stages and passes that landed separately, together (fx, 2 ranks, tiny Llama, AdamW,
accumulation 2, clipping): parity with the eager reference, and each pass a no-op where its
pattern is absent.

  * ZeRO-1 and ZeRO-2 (ZeRO-2 in the full matrix only: [Note: the core matrix] in
    tests/_train.py) with every ZeRO-3 pass configured: `prefetch` and `selective_unshard` find no gathers and change
    nothing; `offload_optimizer` (a budget the step fits in: 1 GiB) runs its start-up offload
    and reload through the warm-up and profiled steps, then keeps everything;
  * ZeRO-3 with all four passes, unbounded budget: everything is kept gathered, nothing is
    offloaded (nor ever was: no provisional offload without a budget), one all-gather (the
    refresh) per optimizer step.
"""

from __future__ import annotations

import pytest

from _train import Jobs, compare_to_reference, scenario

ALL = ("prefetch", "bucket_reduce", "selective_unshard", "offload_optimizer")


def _sc(id, steps=6, **config):
    return scenario(id, "llama", "adamw", 1e-2, gas=2, clip=0.1, steps=steps,
                    record=("report", "comm"), **config)


_SCENARIOS = [
    _sc("zero1-all-passes", zero_stage=1, passes=ALL, memory_budget=1 << 30),
    # the full matrix's: the core's ZeRO-1 run has the same passes and checks
    _sc("zero2-all-passes", zero_stage=2, passes=ALL, memory_budget=1 << 30, extended=True),
    # warm-up 2, profile 1, a re-profile after each pass that changed a graph: steady by step 8
    _sc("zero3-all-passes", steps=10, zero_stage=3, passes=ALL),
]
JOBS = Jobs({"fx2": (2, _SCENARIOS)}, timeout=900)
_BY_ID = {sc["id"]: sc for sc in _SCENARIOS}


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_parity(sid):
    compare_to_reference(_BY_ID[sid], JOBS.results("fx2", sid), kind="llama/composition")


@pytest.mark.parametrize("sid", ["zero1-all-passes", "zero2-all-passes"])
def test_zero3_passes_change_nothing_at_stages_1_and_2(sid):
    for r in JOBS.results("fx2", sid):
        passes = {e["pass"]: e for e in r["report"]["passes"]}
        assert set(passes) == set(ALL)
        assert passes["prefetch"]["changed"] == [] and passes["selective_unshard"]["changed"] == []
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
    for r in JOBS.results("fx2", "zero3-all-passes"):
        assert r["report"]["phase"] == "steady"
        off = next(e for e in r["report"]["passes"] if e["pass"] == "offload_optimizer")
        assert off["changed"] == [] and off["decisions"]["profiled_offloaded_bytes"] == 0
        # steady state (the last steps): no gather inside the graphs, one refresh after the step
        for f, b in zip(r["comm_fwd"][-4:], r["comm_bwd"][-4:]):
            assert f["all_gather"][0] == 0 and b["all_gather"][0] == 0, (f, b)
        for s in r["comm_step"][-2:]:
            assert s["all_gather"][0] == 1, s
