"""Exact communication counts (engine.comm_stats(), fx compiler, 2 ranks, fp32, no pass):
the checks and their derivation are tests/_exact.py's, run here on the MLPs and the graph-break
model. The tiny Llama's and its tied variant's are test_parity.py's (`llama-sgd-gas1-noclip`)
and test_models.py's (`llama_tied-sgd-gas1`), on engines those files train anyway.
"""

from __future__ import annotations

import pytest

import _exact
from _train import COMM_KINDS, Jobs, scenario

WORLD = 2


def _sc(id, model, *, gas=1, clip=None, optim="sgd", lr=0.1, record=("comm",)):
    return scenario(id, model, optim, lr, gas=gas, clip=clip, steps=2, record=record)


_SCENARIOS = [
    _sc("mlp_nobias-gas1", "mlp_nobias"),
    _sc("mlp-gas2-clip", "mlp", gas=2, clip=0.1, record=("comm", "step_every_micro")),
    _sc("graph_break-gas1-clip", "graph_break", clip=0.1),
]
JOBS = Jobs({"fx2": (WORLD, _SCENARIOS)})
_BY_ID = {sc["id"]: sc for sc in _SCENARIOS}


def test_comm_stats_reports_every_kind():
    """comm_stats() always has all three kinds, with zero counts before any traffic."""
    for r in JOBS.results("fx2", "mlp_nobias-gas1"):
        assert set(COMM_KINDS) <= set(r["comm_raw_init"]), r["comm_raw_init"]
        for k in COMM_KINDS:
            assert r["comm_raw_init"][k] == {"count": 0, "bytes": 0}


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_nothing_counted_at_initialize(sid):
    _exact.check_nothing_counted_at_initialize(JOBS.results("fx2", sid))


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_micro_step_counts_exact(sid):
    _exact.check_micro_step_counts(_BY_ID[sid], JOBS.results("fx2", sid))


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_step_counts_exact(sid):
    _exact.check_step_counts(_BY_ID[sid], JOBS.results("fx2", sid))


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_full_state_dict_counts_exact(sid):
    _exact.check_full_state_dict_counts(_BY_ID[sid], JOBS.results("fx2", sid))


def test_step_before_the_boundary_communicates_nothing():
    """engine.step() between micro-steps of an accumulation window is a no-op."""
    for r in JOBS.results("fx2", "mlp-gas2-clip"):
        assert len(r["comm_step_nonboundary"]) == 2
        for s in r["comm_step_nonboundary"]:
            assert all(s[k] == (0, 0) for k in COMM_KINDS), s
