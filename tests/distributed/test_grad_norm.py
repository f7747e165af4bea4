"""The step's gradient norm (`engine.grad_norm()`, `metrics()["grad_norm"]`; [Note: the step's
gradient norm] in engine.py) at world size 1, in this process, and what the model object says
when a plain loop's clipping line reads its gradients.

At 2 and 4 ranks the norm is checked against eager `clip_grad_norm_` by every parity test
(`_train.compare_to_reference`: test_parity.py at ZeRO-3, test_zero12.py at ZeRO-1/2, with and
without clipping, with on_nonfinite="off"), in bf16 by test_mixed_precision.py, inf/NaN by
test_faults.py, and through the HF Trainer by test_hf_trainer.py.
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest
import torch

import _models
from _train import (FULL, check_grad_norms, compare_to_reference, reference_training,
                    run_training, scenario)

# bf16 compute against the fp32 reference, relative (as test_mixed_precision.py): at the first
# step, the same parameters (measured 2.6e-4); at every step (measured 0.0099 over 4 steps)
BF16_NORM_REL_TOL_FIRST = 5e-3
BF16_NORM_REL_TOL = 0.15


_WORLD1 = [
    scenario("z1-mlp-sgd-gas2-clip", "mlp", "sgd", 0.1, gas=2, clip=0.1, zero_stage=1, steps=4),
    scenario("z2-mlp-adamw-noclip", "mlp", "adamw", 1e-2, zero_stage=2, steps=4),
    scenario("z3-mlp-adamw-gas2-clip", "mlp", "adamw", 1e-2, gas=2, clip=0.1, steps=4),
    scenario("z3-mlp-sgd-nocheck", "mlp", "sgd", 0.1, on_nonfinite="off", steps=4),
]
# the tiny Llama at world size 1, fp32 and bf16: the full suite's ([Note: the core matrix] in
# tests/_train.py); the default run checks its norm in bf16 against fp32 at 2 ranks
# (test_mixed_precision.py) and in fp32 in every parity test
_LLAMA = [scenario("z2-llama-adamw-noclip", "llama", "adamw", 1e-2, zero_stage=2, steps=4)]
_BF16 = scenario("z3-llama-bf16-clip", "llama", "adamw", 1e-2, clip=0.1, steps=4,
                 param_dtype="bfloat16")


def test_the_norm_is_eagers_at_world_size_1(group):
    fp32 = _WORLD1 + (_LLAMA if FULL else [])
    results = run_training(0, 1, fp32 + ([_BF16] if FULL else []))
    for sc, r in zip(fp32, results):
        assert "error" not in r, r["error"]
        entry = compare_to_reference(sc, [r])
        print(f"{sc['id']}: grad norm relative deviation {entry['max_grad_norm_rel_dev']:.2g}")
    if FULL:
        _check_bf16_norms(results[-1])


def _check_bf16_norms(r):
    assert "error" not in r, r["error"]
    ref = reference_training(_BF16)["grad_norms"]
    dev = check_grad_norms([r], ref)
    first = abs(r["grad_norms"][0] / ref[0] - 1)
    print(f"bf16: grad norms {r['grad_norms']} vs fp32 {ref}: relative {first:.2g} at the "
          f"first step, {dev:.2g} at most")
    assert first <= BF16_NORM_REL_TOL_FIRST and dev <= BF16_NORM_REL_TOL


def _engine(model, **config):
    import deepcompile

    cfg = {"compiler": "fx", "passes": (), "warmup_steps": 0, "profile_steps": 0,
           "measure_steps": 0, **config}
    return deepcompile.initialize(model, functools.partial(torch.optim.SGD, lr=0.1),
                                  deepcompile.Config(**cfg))


@pytest.mark.parametrize("stage", [1, 3])
def test_clip_grad_norm_on_the_model_warns(group, stage):
    """The habit `clip_grad_norm_(model.parameters(), 1.0)` after initialize clips nothing (the
    model holds no gradients): it warns, naming Config.max_grad_norm and engine.grad_norm();
    `model.zero_grad()` is quiet, and training goes on."""
    model = _models.build_model("mlp")
    engine = _engine(model, zero_stage=stage)
    batch = _models.local_batch("mlp", 0, 0, 1)
    for _ in range(2):
        engine.backward(_models.loss_of(engine(**batch)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model.zero_grad()   # quiet: nothing to zero
        with pytest.warns(UserWarning, match=r"clips nothing and returns 0\. Clip with "
                          r"deepcompile\.Config\(max_grad_norm=\.\.\.\); the step's gradient "
                          r"norm is engine\.grad_norm\(\)"):
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0
        assert engine.step()
        assert math.isfinite(float(engine.grad_norm())) and float(engine.grad_norm()) > 0
