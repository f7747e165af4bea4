"""The Accelerate route (src/deepcompile/integrations/accelerate.py) over 2 gloo ranks:
Accelerator(cpu=True) prepares the data loader (it shards the batches over the ranks), the
engine trains; the losses and weights match plain training in one process on the same global
batches. Accelerator settings that would fight the engine raise clear errors."""

from __future__ import annotations

import functools

import pytest
import torch

import _models
from _dist import run_distributed
from _train import compare_to_reference, scenario

pytest.importorskip("accelerate")

SC = scenario("accelerate-mlp-gas2", "mlp", "adamw", 1e-2, gas=2, steps=3, zero_stage=3)


class _Batches(torch.utils.data.Dataset):
    """Micro-step m's global batch, one sample (a row of x and of y) a row, in order."""

    def __init__(self, micro_steps: int):
        batches = [_models.global_batch(SC["model"], m) for m in range(micro_steps)]
        self.rows = [{"x": x, "y": y} for b in batches for x, y in zip(b["x"], b["y"])]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _job(rank, world):
    from accelerate import Accelerator

    import deepcompile
    from deepcompile.integrations.accelerate import initialize

    errors = {}
    try:   # Accelerate's own accumulation would scale the loss a second time
        initialize(Accelerator(cpu=True, gradient_accumulation_steps=2),
                   _models.build_model(SC["model"]))
    except ValueError as e:
        errors["gas"] = str(e)
    gas = SC["config"]["gradient_accumulation_steps"]
    # rank r's slice of each global batch: with split_batches, each global batch (the loader's
    # batch) is cut into one contiguous piece per rank, as the reference's slicing does
    loader = torch.utils.data.DataLoader(_Batches(SC["steps"] * gas),
                                         batch_size=_models.GLOBAL_BATCH)
    from accelerate import DataLoaderConfiguration

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    loader = accelerator.prepare(loader)
    engine = initialize(accelerator, _models.build_model(SC["model"]),
                        optimizer=functools.partial(torch.optim.AdamW, **SC["optim"][1]),
                        config=deepcompile.Config(**SC["config"]))
    losses, norms, norm_tensors = [], [], []
    for batch in loader:
        loss = engine(**batch)   # the MLP returns its loss
        engine.backward(loss)
        if engine.step():   # the step's gradient norm, at each optimizer step
            norms.append(engine.metrics()["grad_norm"])
            norm_tensors.append(float(engine.grad_norm()))
        losses.append(loss.item())
    return {"id": SC["id"], "rank": rank, "losses": losses, "errors": errors,
            "grad_norms": norms, "grad_norm_tensors": norm_tensors,
            "state": engine.full_state_dict(), "state_devices": ["cpu"]}


def test_accelerate_route_matches_single_process_training():
    per_rank = run_distributed(_job, 2, timeout=600)
    compare_to_reference(SC, per_rank, kind="mlp/accelerate")
    assert "gradient_accumulation_steps=2" in per_rank[0]["errors"]["gas"]
    assert "deepcompile.Config(gradient_accumulation_steps=...)" in per_rank[0]["errors"]["gas"]
