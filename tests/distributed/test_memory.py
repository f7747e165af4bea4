"""ZeRO-3 memory: between steps each rank holds only its 1/N of parameters, gradients and
optimizer state (fx compiler, 2 ranks).

  * the module's parameters keep their shapes but their storage is empty (nbytes == 0) after
    initialize, after every micro-step's backward and after every optimizer step;
  * the optimizer's parameters are 1-D fp32 nn.Parameters of ceil(numel / N) elements, one per
    unique parameter (tied weights: one);
  * AdamW's exp_avg / exp_avg_sq hold sum(ceil(numel / N)) elements on each rank;
  * gradients live on the shards only: shard-sized after backward, None (or shard-sized) after
    the step; the module parameters never hold a .grad.
"""

from __future__ import annotations

import math

import pytest

import _models
from _train import Jobs, scenario

WORLD = 2
_SCENARIOS = [
    scenario("mlp-adamw-gas2-clip", "mlp", "adamw", 1e-2, gas=2, clip=0.1, steps=3,
             record=("memory",)),
    scenario("llama_tied-adamw-gas2", "llama_tied", "adamw", 1e-2, gas=2, steps=3,
             record=("memory",)),
    scenario("mixtral-sgd-gas1", "mixtral", "sgd", 0.1, steps=2, record=("memory",)),
]
JOBS = Jobs({"fx2": (WORLD, _SCENARIOS)})
_BY_ID = {sc["id"]: sc for sc in _SCENARIOS}


def _expected_shards(model_name):
    model = _models.build_model(model_name)
    return [math.ceil(p.numel() / WORLD) for p in model.parameters()]  # unique parameters


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_module_parameters_hold_no_storage(sid):
    for r in JOBS.results("fx2", sid):
        snaps = [r["memory_init"]] + r["memory_micro"] + r["memory_step"]
        assert len(r["memory_step"]) == _BY_ID[sid]["steps"]
        for snap in snaps:
            assert snap["module_shapes"] == list(r["model_shapes"].values())
            assert all(n == 0 for n in snap["module_storage_nbytes"]), snap["module_storage_nbytes"]
            assert all(g is None for g in snap["module_grads"]), snap["module_grads"]


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_optimizer_holds_flat_fp32_shards(sid):
    expected = _expected_shards(_BY_ID[sid]["model"])
    for r in JOBS.results("fx2", sid):
        for snap in [r["memory_init"]] + r["memory_step"]:
            assert sorted(snap["opt_param_numel"]) == sorted(expected)
            assert snap["opt_param_numel"] == expected  # and in the model's parameter order
            assert set(snap["opt_param_dim"]) == {1}
            assert set(snap["opt_param_dtype"]) == {"torch.float32"}
            assert all(snap["opt_param_is_parameter"])


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_gradients_are_shard_sized(sid):
    expected = _expected_shards(_BY_ID[sid]["model"])
    for r in JOBS.results("fx2", sid):
        assert r["memory_init"]["opt_grads"] == [None] * len(expected)
        for snap in r["memory_micro"]:
            # every parameter of these models is used every micro-step (Mixtral: the global
            # batch hits every expert; with a rank's slice an expert may get no token, but its
            # shard still receives the (zero) reduced gradient through the reduce-scatter)
            assert snap["opt_grads"] == expected, snap["opt_grads"]
        for snap in r["memory_step"]:
            assert all(g is None or g == n for g, n in zip(snap["opt_grads"], expected))


@pytest.mark.parametrize("sid", [s for s in _BY_ID if _BY_ID[s]["optim"][0] == "adamw"])
def test_adamw_state_is_sharded(sid):
    total = sum(_expected_shards(_BY_ID[sid]["model"]))
    for r in JOBS.results("fx2", sid):
        assert r["memory_init"]["opt_state_numel"] == {}
        for snap in r["memory_step"]:
            assert snap["opt_state_numel"] == {"exp_avg": total, "exp_avg_sq": total}
