"""ZeRO-3 memory: between steps each rank holds only its 1/N of parameters, gradients and
optimizer state (fx compiler, 2 ranks). The checks are tests/_exact.py's, run here on the MLP
(AdamW, accumulation, clipping); the tied Llama's and Mixtral's are test_models.py's, on
engines that file trains anyway.
"""

from __future__ import annotations

import pytest

import _exact
from _train import Jobs, scenario

WORLD = 2
_SCENARIOS = [
    scenario("mlp-adamw-gas2-clip", "mlp", "adamw", 1e-2, gas=2, clip=0.1, steps=3,
             record=("memory",)),
]
JOBS = Jobs({"fx2": (WORLD, _SCENARIOS)})
_BY_ID = {sc["id"]: sc for sc in _SCENARIOS}


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_module_parameters_hold_no_storage(sid):
    _exact.check_module_parameters_hold_no_storage(_BY_ID[sid], JOBS.results("fx2", sid))


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_optimizer_holds_flat_fp32_shards(sid):
    _exact.check_optimizer_holds_flat_fp32_shards(_BY_ID[sid], JOBS.results("fx2", sid))


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_gradients_are_shard_sized(sid):
    _exact.check_gradients_are_shard_sized(_BY_ID[sid], JOBS.results("fx2", sid))


@pytest.mark.parametrize("sid", [s for s in _BY_ID if _BY_ID[s]["optim"][0] == "adamw"])
def test_adamw_state_is_sharded(sid):
    _exact.check_adamw_state_is_sharded(_BY_ID[sid], JOBS.results("fx2", sid))
