"""Parity of deepcompile ZeRO-3 training with plain eager single-process training.

Each distributed job runs several scenarios in one set of spawned ranks (gloo, CPU); each
scenario trains DEFAULT_STEPS (8) optimizer steps on a deterministic global batch split over
the ranks, and is compared with the eager reference on the whole batch:
  losses (mean of the ranks' local losses per micro-step) within 1e-5 absolute;
  parameters (engine.full_state_dict() vs the reference's named_parameters) within 1e-5 with
  SGD and 1e-4 with AdamW (fp32).

Matrix:
  fx, 2 ranks, MLP (odd sizes): every combination of {SGD, AdamW} x gas {1, 4} x clip {off, 0.1}
  fx, 2 ranks, tiny Llama: 4 combinations that take each value of each factor
  fx, 4 ranks: MLP (AdamW, gas 4, clip), tiny Llama (SGD, gas 2, clip; AdamW, gas 1)
  inductor (marked `inductor`): MLP (SGD) and tiny Llama (AdamW, gas 2, clip), on 2 ranks
The exact communication counts of tests/_exact.py on the tiny Llama: fx, 2 ranks, SGD, gas 1;
and with Inductor, on the Inductor runs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import _exact
from _train import Jobs, compare_to_reference, reference_training, scenario

SGD_LR, ADAMW_LR, CLIP = 0.1, 1e-2, 0.1


def _sc(model, optim, gas, clip, **kw):
    cid = f"{model}-{optim}-gas{gas}-{'clip' if clip else 'noclip'}"
    if kw.get("compiler", "fx") != "fx":
        cid += f"-{kw['compiler']}"
    return scenario(cid, model, optim, SGD_LR if optim == "sgd" else ADAMW_LR,
                    gas=gas, clip=clip, **kw)


_RECORD = {("sgd", 1, None): ("initial_state",),
           # engine.step() called after every micro-step: a no-op before the boundary
           ("sgd", 4, CLIP): ("step_every_micro",), ("adamw", 4, None): ("step_every_micro",)}
# the core matrix ([Note: the core matrix] in tests/_train.py) keeps the MLP cells with a
# recorded extra and both optimizers at both accumulations; the full one has every cell
_MLP_ALL = [_sc("mlp", o, g, c, record=_RECORD.get((o, g, c), ()),
                extended=(o, g, c) in (("sgd", 1, CLIP), ("adamw", 1, CLIP), ("adamw", 4, CLIP)))
            for o, g, c in itertools.product(("sgd", "adamw"), (1, 4), (None, CLIP))]
# SGD gas 1 also records the exact counts (tests/_exact.py); it is the core matrix's
# ([Note: the core matrix] in tests/_train.py) one fx cell here: AdamW with accumulation and
# clipping on the tiny Llama, no pass, is the full suite's (here with Inductor, and
# test_prefetch's `llama-adamw-gas2-clip` with fx); the core's fx run of it has prefetch and
# bucket_reduce, test_prefetch's `llama-adamw-gas2-clip-prefetch-reduce`
_LLAMA_2 = [_sc("llama", "sgd", 1, None, record=("initial_state", "comm")),
            _sc("llama", "adamw", 4, CLIP, extended=True),
            _sc("llama", "adamw", 1, None, extended=True),
            _sc("llama", "sgd", 4, CLIP, extended=True)]
# 4 ranks: the full suite's (the MLP's shards are padded on 2 ranks too; the core's 4-rank
# runs are test_layouts.py's)
_FX4 = [_sc("mlp", "adamw", 4, CLIP, record=("initial_state",), extended=True),
        _sc("llama", "sgd", 2, CLIP),
        _sc("llama", "adamw", 1, None)]
# Inductor: the MLP's shards are padded at 2 ranks too (37 and 29 wide layers). The core's
# plain ZeRO-3 Inductor job is the MLP's; the tiny Llama's (its HF graphs under Inductor) is the
# full suite's
_INDUCTOR = [_sc("llama", "adamw", 2, CLIP, compiler="inductor", record=("comm",)),
             _sc("mlp", "sgd", 1, None, compiler="inductor", record=("comm",), core=True)]

JOBS = Jobs({
    "fx2": (2, _MLP_ALL + _LLAMA_2),
    "fx4": (4, _FX4),
    "inductor2": (2, _INDUCTOR),
}, timeout=900)


@pytest.mark.parametrize("job, sc", JOBS.params())
def test_parity_with_eager_reference(job, sc):
    results = JOBS.results(job, sc["id"])
    ref = reference_training(sc)
    if sc["config"]["max_grad_norm"] is not None:
        # the threshold really clips: every step's global gradient norm is above it
        assert min(ref["grad_norms"]) > sc["config"]["max_grad_norm"], ref["grad_norms"]
    compare_to_reference(sc, results, kind=f"{sc['model']}/{sc['config']['compiler']}")
    if "step_every_micro" in sc["record"]:
        for r in results:
            assert len(r["comm_step_nonboundary"]) == sc["steps"] * 3
    if "initial_state" in sc["record"]:
        # full_state_dict right after initialize is the model's initial weights, exactly
        for r in results:
            assert set(r["initial_state"]) == set(ref["initial"])
            for k, v in ref["initial"].items():
                assert torch.equal(r["initial_state"][k], v), k


def test_llama_comm_counts_exact():
    """The exact communication counts of tests/_exact.py on the tiny Llama (ZeRO-3, no pass):
    at initialize, per micro-step in every phase, per optimizer step, full_state_dict."""
    sc = _LLAMA_2[0]
    _exact.check_comm_counts(sc, JOBS.results("fx2", sc["id"]))


@pytest.mark.inductor
def test_inductor_comm_counts_match_insertion():
    """Inductor runs the same insertion: per micro-step every parameter is gathered once in the
    forward and reduce-scattered once; the backward re-gathers exactly what fx re-gathers
    (tests/_exact.py: the MLP's fc2 and fc3 weights; every parameter of the tiny Llama but the
    embedding table). On every Inductor run of the matrix: the MLP's, and in the full suite the
    tiny Llama's."""
    import math

    world, scenarios = JOBS.jobs["inductor2"]
    assert scenarios
    for sc in scenarios:
        params, fwd, bwd, rs = _exact.comm_expected(sc["model"])

        def count(names):
            return (len(names),
                    sum(math.ceil(params[n].numel() / world) * world * 4 for n in names))

        assert fwd == rs == list(params)
        for r in JOBS.results("inductor2", sc["id"]):
            assert len(r["comm_fwd"]) == sc["steps"] * sc["config"]["gradient_accumulation_steps"]
            for f, b in zip(r["comm_fwd"], r["comm_bwd"]):
                assert f["all_gather"] == count(fwd), (sc["id"], f)
                assert b["reduce_scatter"] == count(rs), (sc["id"], b)
                assert b["all_gather"] == count(bwd), (sc["id"], b)
            # (the clipping norm rides in the inf/NaN check's reduction: bookkeeping, uncounted)
            assert all(s["all_reduce"] == (0, 0) for s in r["comm_step"])
