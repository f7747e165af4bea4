"""Opt-in fuzz of the scheduling passes: every order of selective_unshard, prefetch and
bucket_reduce (and ZeRO-1's bucket_reduce), on models with graph breaks, loops, tied weights and
experts, at 1 and 2 accumulation steps, under seeded random profiled times
(`_train.random_times`): where the passes place their ops depends on the times, and one
machine's times meet few of the placements. Parity with the eager reference on 2 ranks (and the
first seed on 4; a Llama under Inductor); and a memory budget between the insertion peak and
what the passes take unbounded holds in every measured profile. About 11 minutes on 2 cores,
so not in the default run:

    DEEPCOMPILE_FUZZ=1 OMP_NUM_THREADS=1 python -m pytest tests/test_fuzz_schedules.py -q

`DEEPCOMPILE_FUZZ=N` runs N seeds per case (1 counts as 3). The models whose eager code reads a
parameter inside an inlined module's forward (nested_break, mixtral_eager) need
`Config.eager_modules` (tests/test_models.py) and are left out.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import _models
from _dist import run_distributed
from _train import Jobs, compare_to_reference, random_times, scenario

_SEEDS = int(os.environ.get("DEEPCOMPILE_FUZZ", "0") or 0)
_SEEDS = 3 if _SEEDS == 1 else _SEEDS
ORDERS = [("selective_unshard", "prefetch", "bucket_reduce"),
          ("prefetch", "bucket_reduce", "selective_unshard"),
          ("bucket_reduce", "prefetch", "selective_unshard"),
          ("prefetch", "selective_unshard", "bucket_reduce")]
MODELS = ("graph_break", "loop_break", "llama_tied", "disabled", "mixtral")

_Z3 = [scenario(f"{m}-o{o}-gas{gas}-t{seed}", m, "sgd", 0.1, gas=gas, steps=3, passes=order,
                profile_seed=seed + 100 * o, warmup_steps=1)
       for m in MODELS for o, order in enumerate(ORDERS) for gas in (1, 2)
       for seed in range(_SEEDS)]
_Z1 = [scenario(f"{m}-z1-gas{gas}-t{seed}", m, "adamw", 1e-2, gas=gas, steps=3,
                passes=("bucket_reduce",), zero_stage=1, profile_seed=seed, warmup_steps=1)
       for m in ("graph_break", "llama_tied") for gas in (1, 2) for seed in range(_SEEDS)]
# Inductor (its scheduler reorders what the lowering emits): auto's order, 2 seeds
_IND = [scenario(f"llama-inductor-gas2-t{seed}", "llama", "sgd", 0.1, gas=2, steps=3,
                 compiler="inductor", passes=ORDERS[0], profile_seed=seed, warmup_steps=1)
        for seed in range(min(_SEEDS, 2))]
JOBS = Jobs({"fuzz2": (2, _Z3 + _Z1),
             "fuzz4": (4, [s for s in _Z3 if s["id"].endswith("-t0")]),
             "inductor-fuzz2": (2, _IND)}, timeout=3600)


@pytest.mark.skipif(not _SEEDS, reason="opt-in: DEEPCOMPILE_FUZZ=1 (about 11 minutes)")
@pytest.mark.parametrize("job, sc", JOBS.params() or [("none", None)])
def test_parity_under_random_profiled_times(job, sc):
    compare_to_reference(sc, JOBS.results(job, sc["id"]), kind=sc["id"])


# ------------------------------------------- a memory budget under random profiled times
_PASSES = ("selective_unshard", "prefetch", "bucket_reduce")


def _budget_job(rank, world, model_name, seed, budget):
    import deepcompile

    model = _models.build_model(model_name)
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx", "warmup_steps": 1,
                                            "passes": _PASSES, "measure_steps": 0,
                                            "memory_budget": budget})
    engine._pipeline.perturb = functools.partial(random_times, seed)
    for step in range(8):   # warm-up, profile, then a pass and its re-profile per step
        batch = _models.local_batch(model_name, step, rank, world)
        engine.backward(_models.loss_of(engine(**batch)))
        engine.step()
    rep = engine.report().to_dict()
    return {"passes": {p["pass"]: p for p in rep["passes"]},
            "peaks": {s["slot"]: [p["peak_bytes"] for p in s["profiles"]]
                      for g in rep["graphs"] for s in g["slots"]}}


@pytest.mark.skipif(not _SEEDS, reason="opt-in: DEEPCOMPILE_FUZZ=1")
@pytest.mark.parametrize("model_name", ["llama", "graph_break"])
@pytest.mark.parametrize("seed", range(max(_SEEDS, 1)))
def test_a_budget_holds_under_random_profiled_times(model_name, seed):
    """The budget between the insertion peak and what the passes take unbounded: every
    graph's measured peak, initial and re-profiled after each pass, stays within it."""
    free = run_distributed(_budget_job, 2, model_name, seed, None, timeout=900)[0]
    before = max(p[0] for p in free["peaks"].values())
    after = max(p[-1] for p in free["peaks"].values())
    assert after > before   # unbounded, the passes spend memory (keeping, prefetching)
    budget = (before + after) // 2
    r = run_distributed(_budget_job, 2, model_name, seed, budget, timeout=900)[0]
    assert set(r["passes"]) == set(_PASSES), (list(r["passes"]), {
        k: v.get("status") or v.get("verdict") for k, v in r["passes"].items()})
    for name in _PASSES:
        for key, dec in r["passes"][name]["decisions"].items():
            if isinstance(dec, dict) and "peak_after" in dec:
                assert not dec.get("unattainable") and dec["peak_after"] <= budget, (name, key)
    over = {k: max(p) for k, p in r["peaks"].items() if max(p) > budget}
    assert not over, (budget, over)
