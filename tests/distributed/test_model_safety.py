"""The model object after `deepcompile.initialize` is safe to touch, at ZeRO-1 and 3 (and 2 in
the full suite) ([Note: the guarded model] in src/deepcompile/guard.py): `state_dict()`,
`save_pretrained()`, reading and printing a parameter, `to(...)`, `eval()` + `model(...)` either
work (and give the trained values) or raise one clear error naming what to call instead.
Training goes on unharmed and matches single-process training; no graph break is added."""

from __future__ import annotations

import copy
import functools
import io
import os

import pytest
import torch

import _models
from _dist import run_distributed
from _train import FULL, mean_losses, scenario

WORLD = 2
STEPS = 4          # 2 before the checks, 2 after
MODEL = "llama_tied"   # its batches; the model: the tied tiny Llama of `DEPTHS` decoder layers
# what the guard meets is the same at any depth: one decoder layer in the default run, and the
# two of the suite's tiny Llama too in the full suite ([Note: the core matrix] in tests/_train.py)
DEPTHS = (1, 2) if FULL else (1,)


def _sc(stage: int) -> dict:
    return scenario(f"safety-z{stage}", MODEL, "adamw", 1e-2, steps=STEPS, zero_stage=stage)


def _build(layers: int, seed: int = _models.SEED) -> torch.nn.Module:
    """`_models.build_model(MODEL, seed)` with `layers` decoder layers (2: that model)."""
    torch.manual_seed(seed)
    return _models._llama(tie=True, layers=layers).float().train()


@functools.lru_cache(maxsize=None)
def _reference_losses(layers: int) -> list[float]:
    """The losses of eager training on the global batches, in this process."""
    from deepcompile.tools.workloads import train_reference

    model = _build(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return train_reference(model, opt, functools.partial(_models.global_batch, MODEL),
                           steps=STEPS, loss_of=_models.loss_of).micro_losses


def _attempt(fn):
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 -- the test inspects type and message
        return ("raised", type(e).__name__, str(e))


def _train(engine, rank, world, steps, first):
    losses = []
    for step in range(first, first + steps):
        loss = engine(**_models.local_batch(MODEL, step, rank, world)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _stage_job(rank, world, stage, tmp):
    return {layers: _one_depth(rank, world, stage, os.path.join(tmp, f"layers{layers}"), layers)
            for layers in DEPTHS}


def _one_depth(rank, world, stage, tmp, layers):
    import deepcompile
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sc = _sc(stage)
    model = _build(layers)
    engine = deepcompile.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-2),
                                    deepcompile.Config(**sc["config"]))
    out = {"losses": _train(engine, rank, world, 2, 0)}
    full = engine.full_state_dict()
    weight = model.lm_head.weight
    out["param_class"] = type(weight).__name__
    out["is_parameter"] = isinstance(weight, torch.nn.Parameter)
    out["metadata"] = (tuple(weight.shape), str(weight.dtype), str(weight.device),
                       weight.requires_grad, weight.grad is None)

    def state_dict_equal():
        sd = model.state_dict()
        return all(torch.equal(sd[k], v.to(sd[k].dtype)) for k, v in full.items())
    out["state_dict"] = _attempt(state_dict_equal)

    def torch_save_roundtrip():
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        buf.seek(0)
        fresh = _build(layers, seed=7)
        fresh.load_state_dict(torch.load(buf, weights_only=True))
        return all(torch.equal(p, full[n]) for n, p in fresh.named_parameters())
    out["torch_save"] = _attempt(torch_save_roundtrip)

    target = os.path.join(tmp, f"z{stage}-pretrained")
    if rank == 0:   # as users do: the main process saves
        def save_pretrained_roundtrip():
            from transformers import AutoModelForCausalLM

            model.save_pretrained(target)
            loaded = AutoModelForCausalLM.from_pretrained(target)
            return all(torch.equal(p, full[n]) for n, p in loaded.named_parameters())
        out["save_pretrained"] = _attempt(save_pretrained_roundtrip)
        out["save_pretrained_wrote"] = os.path.exists(target)
    out["param_sum"] = _attempt(lambda: torch.equal(weight.sum(), full["lm_head.weight"].sum()))
    out["param_item"] = _attempt(lambda: float(model.model.norm.weight[0]))
    out["param_data"] = _attempt(lambda: torch.equal(weight.data, full["lm_head.weight"]))
    out["repr"] = _attempt(lambda: repr(weight))
    out["print"] = _attempt(lambda: f"{weight}")
    out["deepcopy"] = _attempt(lambda: type(copy.deepcopy(model)).__name__)
    out["to_same"] = _attempt(lambda: (model.to("cpu") is model, model.float() is model,
                                       model.to(torch.float32) is model, model.cpu() is model))
    out["to_double"] = _attempt(lambda: model.double())
    out["load_state_dict"] = _attempt(lambda: model.load_state_dict(full))
    out["metadata_after"] = (tuple(weight.shape), str(weight.dtype))

    # evaluation through the model object itself, on every rank
    batch = _models.local_batch(MODEL, 100, rank, world)
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    model.train()
    reference = _build(layers)
    reference.load_state_dict(full)
    reference.eval()
    with torch.no_grad():
        expected = reference(**batch).logits
    out["eval_dev"] = (logits - expected).abs().max().item()
    out["second_initialize"] = _attempt(lambda: deepcompile.initialize(model))
    out["losses"] += _train(engine, rank, world, STEPS - 2, 2)
    out["graph_breaks"] = int(sum(counters["graph_break"].values()))
    del engine
    torch._dynamo.reset()
    return out


# ZeRO-2 beside ZeRO-1 (replicated parameters, the same guard) is the full suite's ([Note: the
# core matrix] in tests/_train.py)
@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.extended), 3],
                ids=lambda s: f"zero{s}")
def stage_run(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"safety{request.param}")
    per_rank = run_distributed(_stage_job, WORLD, request.param, str(tmp), timeout=600)
    # {decoder layers: every rank's outcome}
    return request.param, {n: [r[n] for r in per_rank] for n in DEPTHS}, tmp


def test_training_around_the_checks_matches_single_process(stage_run):
    stage, runs, _ = stage_run
    for layers, per_rank in runs.items():
        ref = _reference_losses(layers)
        dev = max(abs(a - b) for a, b in zip(mean_losses(per_rank), ref))
        print(f"\n[safety zero{stage}, {layers} layer(s)] loss deviation {dev:.3g}")
        assert len(per_rank[0]["losses"]) == len(ref) == STEPS
        assert dev <= 1e-5, (mean_losses(per_rank), ref)
        for r in per_rank:
            assert r["graph_breaks"] == 0
            assert r["is_parameter"] and r["metadata"] == ((_models.VOCAB, 32), "torch.float32",
                                                           "cpu", True, True)
            assert r["metadata_after"] == ((_models.VOCAB, 32), "torch.float32")


def _raised(result, kind, *fragments):
    assert result[0] == "raised", result
    assert result[1] == kind, result
    for f in fragments:
        assert f in result[2], (f, result[2])


def test_state_dict_and_saving(stage_run):
    stage, runs, tmp = stage_run
    for per_rank in runs.values():
        for r in per_rank:
            if stage == 3:
                for key in ("state_dict", "torch_save"):
                    _raised(r[key], "ShardedParameterError", "model.state_dict()", "zero_stage=3",
                            "engine.full_state_dict()", "engine.save_pretrained(dir)")
            else:   # complete replicas: the trained values, a loadable file
                assert r["state_dict"] == ("ok", True)
                assert r["torch_save"] == ("ok", True)
        r0 = per_rank[0]
        if stage == 3:
            _raised(r0["save_pretrained"], "ShardedParameterError", "model.save_pretrained()",
                    "engine.save_pretrained(dir)", "nothing was written")
            assert not r0["save_pretrained_wrote"]
        else:
            assert r0["save_pretrained"] == ("ok", True)


def test_reading_and_printing_a_parameter(stage_run):
    stage, runs, _ = stage_run
    for per_rank in runs.values():
        for r in per_rank:
            if stage == 3:
                assert r["param_class"] == "ShardedParameter"
                for key in ("param_sum", "param_item", "param_data", "deepcopy"):
                    _raised(r[key], "ShardedParameterError", "is sharded over 2 ranks",
                            "engine.full_state_dict()")
                assert "lm_head.weight" in r["param_sum"][2]
                assert "model.norm.weight" in r["param_item"][2]
                for key in ("repr", "print"):
                    assert r[key][0] == "ok" and "lm_head.weight" in r[key][1] \
                        and "sharded over 2 ranks" in r[key][1], r[key]
            else:
                assert r["param_class"] == "GuardedParameter"   # its .grad warns (guard.py)
                assert r["param_sum"] == ("ok", True) and r["param_data"] == ("ok", True)
                assert r["param_item"][0] == "ok"
                assert r["repr"][0] == "ok" and "Parameter containing" in r["repr"][1]
                assert r["deepcopy"][0] == "ok"


def test_to_eval_and_calling_the_model(stage_run):
    stage, runs, _ = stage_run
    for per_rank in runs.values():
        for r in per_rank:
            assert r["to_same"] == ("ok", (True, True, True, True))
            _raised(r["to_double"], "RuntimeError", "cannot be moved or cast",
                    "before initialize", "param_dtype")
            _raised(r["load_state_dict"], "RuntimeError", "model.load_state_dict()",
                    "engine.load_checkpoint(dir)")
            _raised(r["second_initialize"], "RuntimeError",
                    "already given to deepcompile.initialize")
            print(f"\n[safety zero{stage}] model(...) in eval vs the trained weights: "
                  f"{r['eval_dev']:.3g}")
            assert r["eval_dev"] <= 1e-5
