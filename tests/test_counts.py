"""Exact communication counts (engine.comm_stats(), fx compiler, 2 ranks, fp32).

Semantics (per micro-step):
  * forward: every parameter is all-gathered once per graph that uses it;
  * backward: re-gathered (never saved) where the backward needs the parameter's value;
    a parameter whose gradient computation does not need its value (a bias; an embedding
    table; the first layer's weight when the input does not require grad) is not re-gathered;
  * every gradient is reduce-scattered once per graph that uses its parameter;
  * optimizer step: nothing (the global gradient norm, also clipping's, rides in the inf/NaN
    check's all-reduce: bookkeeping, not counted);
  * full_state_dict: one all_gather per unique parameter.
bytes = full (unsharded, padded to a multiple of the world size) tensor size x element size.

The expected backward gathers are derived from the models below by hand:
  mlp_nobias   fc1 -> GELU -> fc2 -> fc3, input x does not require grad:
               dL/dx1 is not needed, so W1 is not re-gathered; W2 and W3 are (input grads).
  mlp          the same with biases: biases are never re-gathered.
  graph_break  graph 1: block1.0 (input x: not needed), shared (weight needed);
               graph 2: shared (weight needed), block2.0 (weight), block2.2 (weight).
  llama        every Linear weight and every RMSNorm weight is needed for the input gradient
               (RMSNorm: dx depends on w); the embedding table is not (its backward is an
               index-add of the output gradient).
  llama_tied   the tied table is needed by lm_head's input gradient: re-gathered once.
"""

from __future__ import annotations

import math

import pytest

import _models
from _train import COMM_KINDS, Jobs, scenario

WORLD = 2
F32 = 4


def _sc(id, model, *, gas=1, clip=None, optim="sgd", lr=0.1, record=("comm",)):
    return scenario(id, model, optim, lr, gas=gas, clip=clip, steps=2, record=record)


_SCENARIOS = [
    _sc("mlp_nobias-gas1", "mlp_nobias"),
    _sc("mlp-gas2-clip", "mlp", gas=2, clip=0.1, record=("comm", "step_every_micro")),
    _sc("graph_break-gas1-clip", "graph_break", clip=0.1),
    _sc("llama-adamw-gas1", "llama", optim="adamw", lr=1e-2),
    _sc("llama_tied-gas2", "llama_tied", gas=2),
]
JOBS = Jobs({"fx2": (WORLD, _SCENARIOS)})
_BY_ID = {sc["id"]: sc for sc in _SCENARIOS}


def _padded_bytes(p):
    return math.ceil(p.numel() / WORLD) * WORLD * F32


def _expected(model_name):
    """(forward gathers, backward gathers, reduce-scatters) as lists of parameter fqns."""
    model = _models.build_model(model_name)
    params = dict(model.named_parameters())   # unique parameters
    names = list(params)
    if model_name in ("mlp", "mlp_nobias"):
        fwd = names
        bwd = ["fc2.weight", "fc3.weight"]
        rs = names
    elif model_name == "graph_break":
        g1 = ["block1.0.weight", "block1.0.bias", "shared.weight", "shared.bias"]
        g2 = ["shared.weight", "shared.bias", "block2.0.weight", "block2.0.bias",
              "block2.2.weight", "block2.2.bias"]
        fwd = g1 + g2
        bwd = ["shared.weight", "shared.weight", "block2.0.weight", "block2.2.weight"]
        rs = g1 + g2
    elif model_name in ("llama", "llama_tied"):
        fwd = names
        bwd = [n for n in names if n != "model.embed_tokens.weight"]
        if model_name == "llama_tied":
            bwd.append("model.embed_tokens.weight")  # tied to lm_head.weight
        rs = names
    else:  # pragma: no cover
        raise KeyError(model_name)
    for n in fwd + bwd + rs:
        assert n in params, n
    return params, fwd, bwd, rs


def _count(params, names):
    return (len(names), sum(_padded_bytes(params[n]) for n in names))


def test_comm_stats_reports_every_kind():
    """comm_stats() always has all three kinds, with zero counts before any traffic."""
    for r in JOBS.results("fx2", "mlp_nobias-gas1"):
        assert set(COMM_KINDS) <= set(r["comm_raw_init"]), r["comm_raw_init"]
        for k in COMM_KINDS:
            assert r["comm_raw_init"][k] == {"count": 0, "bytes": 0}


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_nothing_counted_at_initialize(sid):
    for r in JOBS.results("fx2", sid):
        assert all(r["comm_init"][k] == (0, 0) for k in COMM_KINDS), r["comm_init"]


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_micro_step_counts_exact(sid):
    sc = _BY_ID[sid]
    params, fwd, bwd, rs = _expected(sc["model"])
    n_micro = sc["steps"] * sc["config"]["gradient_accumulation_steps"]
    for r in JOBS.results("fx2", sid):
        assert len(r["comm_fwd"]) == len(r["comm_bwd"]) == n_micro
        for i, (f, b) in enumerate(zip(r["comm_fwd"], r["comm_bwd"])):
            where = f"{sid} rank {r['rank']} micro-step {i}"
            assert f["all_gather"] == _count(params, fwd), (where, "forward all_gather", f)
            assert f["reduce_scatter"] == (0, 0), (where, f)
            assert b["all_gather"] == _count(params, bwd), (where, "backward all_gather", b)
            assert b["reduce_scatter"] == _count(params, rs), (where, "backward reduce_scatter", b)
            assert f["all_reduce"] == b["all_reduce"] == (0, 0), (where, f, b)


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_step_counts_exact(sid):
    sc = _BY_ID[sid]
    clip = sc["config"]["max_grad_norm"] is not None
    for r in JOBS.results("fx2", sid):
        assert len(r["comm_step"]) == sc["steps"]
        for s in r["comm_step"]:
            assert s["all_gather"] == s["reduce_scatter"] == (0, 0), s
            # the global norm rides in the inf/NaN check's reduction (uncounted), clip or not
            assert s["all_reduce"] == (0, 0), (clip, s)


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_full_state_dict_counts_exact(sid):
    params, *_ = _expected(_BY_ID[sid]["model"])
    for r in JOBS.results("fx2", sid):
        assert r["comm_full_state_dict"] == {
            "all_gather": _count(params, list(params)),
            "reduce_scatter": (0, 0), "all_reduce": (0, 0)}


def test_step_before_the_boundary_communicates_nothing():
    """engine.step() between micro-steps of an accumulation window is a no-op."""
    for r in JOBS.results("fx2", "mlp-gas2-clip"):
        assert len(r["comm_step_nonboundary"]) == 2
        for s in r["comm_step_nonboundary"]:
            assert all(s[k] == (0, 0) for k in COMM_KINDS), s
