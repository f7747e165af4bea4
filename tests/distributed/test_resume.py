"""Exact resume ([Note: the plan in a checkpoint] in compiler/pipeline.py, [Note: random state
in a checkpoint] in checkpoint.py): a run saved once its plan is final and resumed in a fresh
engine at the same world size runs the plan the saved run made from its first step, and its
losses are those of the unbroken run bit for bit — fp32 and bf16, with gradient accumulation,
fx and Inductor, with the passes `passes="auto"` picks, and with dropout (each rank's random
number generators come back) — and so is an evaluation after it. On another world size the random states are not restored (a
warning says so) and the engine plans afresh.

On 2 gloo ranks: the tiny Llama, and in the default run's two cases (the default trial; bf16
with accumulation) the MLP with dropout (`DropoutMLP`). The passes are judged on memory only (`measure_steps=0`) where the test needs
them kept whatever the machine's load; one case runs the default trial.
"""

from __future__ import annotations

import functools
import logging
import random

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _models
from _dist import run_distributed
from _train import FULL

WORLD = 2
AFTER = 2      # optimizer steps trained after the checkpoint (the unbroken run, the resumed one)

CASES = {   # name: (model, config)
    "fx-fp32": ("llama", {"compiler": "fx", "measure_steps": 0}),
    "fx-bf16-gas2": ("llama" if FULL else "mlp_dropout",
                     {"compiler": "fx", "measure_steps": 0, "param_dtype": torch.bfloat16,
                      "gradient_accumulation_steps": 2}),
    "inductor-bf16": ("llama", {"compiler": "inductor", "measure_steps": 0,
                                "param_dtype": torch.bfloat16}),
    # the default trial; the tiny Llama with dropout in the full suite, the MLP with dropout in
    # the default run (an engine compiled in ~1 s, not ~10: the same plan saved and restored,
    # the same random streams)
    "fx-dropout-trial": ("llama_dropout" if FULL else "mlp_dropout", {"compiler": "fx"}),
    "fx-zero1": ("llama", {"compiler": "fx", "measure_steps": 0, "zero_stage": 1}),
}
# The core matrix ([Note: the core matrix] in tests/_train.py) resumes the MLP with dropout
# under the default trial: the saved plan (the passes the trial kept) re-applied, and each
# rank's random streams restored (dropout draws from them at every step), in one case; its
# checkpoint is test_on_another_world_size_the_engine_plans_afresh's; and the same MLP in bf16
# with accumulation (fp32 masters under bf16 compute, resumed bit for bit). The others are the
# full suite's: ZeRO-1 (its plan with overlap_refresh), and fp32 and Inductor (bf16's without
# the cast, the fx case compiled otherwise).
RUN = list(CASES) if FULL else ["fx-dropout-trial", "fx-bf16-gas2"]


class DropoutMLP(nn.Module):
    """_models' MLP (its data) with dropout after each hidden layer: it draws from the rank's
    torch generator at every training step."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(_models.MLP_IN, 37)
        self.fc2 = nn.Linear(37, 29)
        self.fc3 = nn.Linear(29, _models.MLP_OUT)

    def forward(self, x, y):   # inputs in the parameters' dtype, the loss in fp32
        h = F.dropout(F.gelu(self.fc1(x.to(self.fc1.weight.dtype))), 0.1, self.training)
        h = F.dropout(self.fc2(h), 0.1, self.training)
        return F.mse_loss(self.fc3(h).float(), y)


def _build(model: str) -> nn.Module:
    if model == "mlp_dropout":
        torch.manual_seed(_models.SEED)
        return DropoutMLP().train()
    return _models.build_model(model)


def _batch(model: str, micro_step: int, rank: int, world: int) -> dict:
    return _models.local_batch("mlp" if model == "mlp_dropout" else model, micro_step, rank,
                               world)


def _engine(model: str, config: dict, rank: int):
    import deepcompile

    engine = deepcompile.initialize(_build(model),
                                    functools.partial(torch.optim.AdamW, lr=1e-2), config)
    # every rank its own random streams (the model was built from one seed on every rank)
    torch.manual_seed(100 + rank)
    random.seed(100 + rank)
    numpy.random.seed(100 + rank)
    return engine


def _draws() -> list[float]:
    """The next numbers of the generators training leaves alone."""
    return [random.random(), float(numpy.random.rand())]


def _steps(engine, model, rank, world, first, last) -> list[float]:
    losses = []
    gas = engine.config.gradient_accumulation_steps
    for step in range(first, last):
        for m in range(gas):
            loss = _models.loss_of(engine(**_batch(model, step * gas + m, rank,
                                                                world)))
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    return losses


def _evaluate(engine, model, rank, world) -> float:
    """An eval forward (its graph compiled in the steady state: Inductor at its first call)."""
    engine.module.eval()
    with torch.no_grad():
        loss = _models.loss_of(engine(**_batch(model, 1000, rank, world))).item()
    engine.module.train()
    return loss


def _plan(engine) -> list:
    """Each pass, kept or not, and the graphs a kept one changed."""
    return [(e["pass"], e["kept"], e["changed"] if e["kept"] else None)
            for e in engine._pipeline.passes.current()]


def _job(rank, world, tmp, names):
    out = {}
    for name in names:
        model, config = CASES[name]
        path = f"{tmp}/{name}"
        torch._dynamo.reset()   # each run a fresh process's: Dynamo's caches hold no other
        engine = _engine(model, config, rank)   # engine's graphs of the same code
        save_at = 0
        while engine.setup_steps is None and save_at < 40:   # saved once the plan is final
            _steps(engine, model, rank, world, save_at, save_at + 1)
            save_at += 1
        save_at += 1
        _steps(engine, model, rank, world, save_at - 1, save_at)   # a steady step
        engine.save_checkpoint(path)
        draws = _draws()
        unbroken = _steps(engine, model, rank, world, save_at, save_at + AFTER)
        unbroken.append(_evaluate(engine, model, rank, world))
        plan = _plan(engine)
        del engine
        torch._dynamo.reset()
        resumed = _engine(model, config, rank)
        resumed.load_checkpoint(path)
        resumed_draws = _draws()
        phases = []
        losses = []
        for step in range(save_at, save_at + AFTER):
            losses += _steps(resumed, model, rank, world, step, step + 1)
            phases.append(resumed.phase)
        losses.append(_evaluate(resumed, model, rank, world))
        out[name] = {"unbroken": unbroken, "resumed": losses, "plan": plan,
                     "resumed_plan": _plan(resumed),
                     "phases": phases, "setup_steps": resumed.setup_steps,
                     "draws": draws, "resumed_draws": resumed_draws}
        del resumed
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    runs = run_distributed(_job, WORLD, str(tmp), RUN, timeout=1800)
    return tmp, runs


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in RUN else pytest.mark.extended)
                                  for n in CASES])
def test_a_resumed_run_has_the_losses_of_the_unbroken_run(resumed, name):
    _, runs = resumed
    for rank, r in enumerate(runs):
        case = r[name]
        assert case["resumed"] == case["unbroken"], (rank, case)   # bit for bit
        assert case["resumed_plan"] == case["plan"]                 # the same plan, re-applied
        assert case["phases"] == ["steady"] * AFTER                 # from the first step on
        assert case["setup_steps"] == 0
        assert case["resumed_draws"] == case["draws"]   # Python's and numpy's streams too
    if name != "fx-dropout-trial":   # judged on memory: every pass that changed a graph kept
        plan = runs[0][name]["plan"]
        assert [p for p, kept, changed in plan if kept and changed] == (
            ["bucket_reduce", "overlap_refresh"] if name == "fx-zero1"
            else ["selective_unshard", "bucket_reduce"]), plan
    assert runs[0][name]["draws"] != runs[1][name]["draws"]   # each rank's own streams


def _other_world_job(rank, world, path, model, config):
    engine = _engine(model, config, rank)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("deepcompile").addHandler(handler)
    logging.getLogger("deepcompile").setLevel(logging.INFO)
    engine.load_checkpoint(path)
    losses = _steps(engine, model, rank, world, 0, 2)
    return {"phases": [p for p, _ in engine._pipeline.step_log], "losses": losses,
            "log": [r.getMessage() for r in records]}


def test_on_another_world_size_the_engine_plans_afresh(resumed):
    tmp, _ = resumed
    model, config = CASES["fx-dropout-trial"]
    (r,) = run_distributed(_other_world_job, 1, f"{tmp}/fx-dropout-trial", model, config,
                           timeout=600)
    assert r["phases"] == ["warmup", "warmup"]   # the setup starts over
    assert any("saved by 2 ranks and are not restored on 1" in m for m in r["log"]), r["log"]
    assert any("made on 2 ranks; on 1 the engine plans afresh" in m for m in r["log"]), r["log"]
    assert all(x == x for x in r["losses"])
