"""The flat fused optimizer step with the optimizers users pass (runtime/flat.py), in-process at
world size 1: the flat step trains as torch's own optimizer does on the unsharded model (SGD
with Nesterov momentum, AdamW with a weight-decay group and an LR scheduler on the facade);
`optimizer.state_dict()` stays per parameter; an optimizer whose update is not known to be
elementwise steps parameter by parameter, says so in the log, and `offload_optimizer` refuses
it with the reason; `passes="auto"` under a budget the step with all state does not meet
chooses `offload_optimizer` and keeps it. Under a minute in all."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from _train import chunk_bytes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _groups(params, wd=0.1):
    """Weights decay, biases do not (parameters in `named_parameters` order: w0, b0, w1, b1)."""
    params = list(params)
    return [{"params": params[0::2], "weight_decay": wd},
            {"params": params[1::2], "weight_decay": 0.0}]


class _MySGD(torch.optim.SGD):
    """A user's subclass: it may override `step`, so it is not stepped flat."""


CASES = {
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "adamw-groups": lambda ps: torch.optim.AdamW(_groups(ps), lr=0.01),
    "subclass": lambda ps: _MySGD(ps, lr=0.05, momentum=0.9),
}


def _train(make_opt, steps=5, chunk=None, load_first=False):
    import deepcompile

    ref = _model()
    model = copy.deepcopy(ref)
    with chunk_bytes(chunk):
        engine = deepcompile.initialize(model, optimizer=make_opt,
                                        config={"compiler": "fx", "passes": ()})
    if load_first:   # what accelerate's `prepare` does before the first step
        engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    ref_opt = make_opt(list(ref.parameters()))
    calls = engine.hook_calls = []   # the user's step hooks run as around optimizer.step()
    engine.optimizer.register_step_pre_hook(lambda opt, a, kw: calls.append(("pre", opt)))
    engine.optimizer.register_step_post_hook(lambda opt, a, kw: calls.append(("post", opt)))
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).square().mean())
        engine.step()
        sched.step()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    return engine, ref, ref_opt


@pytest.mark.parametrize("load_first", [False, True], ids=["", "loaded-first"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_flat_step_trains_as_torch_does(group, case, load_first, caplog):
    """... also where a load of the (empty) state dict comes before the first step: the state
    the first step makes is in the optimizer's state dict (what a checkpoint saves)."""
    if load_first and case == "subclass":
        pytest.skip("not stepped flat")
    with caplog.at_level(logging.WARNING, logger="deepcompile"):
        engine, ref, ref_opt = _train(CASES[case], chunk=256, load_first=load_first)
    flat = engine._flat
    fallback = [r.getMessage() for r in caplog.records if "elementwise" in r.getMessage()]
    if case == "subclass":
        assert flat.inner is None and fallback and "_MySGD" in fallback[0], fallback
    else:
        assert flat.inner is not None and not fallback, fallback
    if case == "adamw-groups":   # chunks of 256 bytes: w0, w1, and both biases in one
        assert [[e.name for e in c.entries] for c in flat.chunks] == \
            [["0.weight"], ["2.weight"], ["0.bias", "2.bias"]]
        assert [c.group for c in flat.chunks] == [0, 0, 1]   # a chunk never mixes groups
    assert engine.hook_calls == [("pre", engine.optimizer), ("post", engine.optimizer)] * 5
    state = engine.full_state_dict()
    for name, p in ref.named_parameters():
        assert torch.allclose(state[name], p.detach(), rtol=0, atol=1e-6), (case, name)
    # per parameter, as torch's own optimizer has it
    sd, ref_sd = engine.optimizer.state_dict(), ref_opt.state_dict()
    assert [g["lr"] for g in sd["param_groups"]] == [g["lr"] for g in ref_sd["param_groups"]]
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for i, st in ref_sd["state"].items():
        assert sorted(sd["state"][i]) == sorted(st), (case, i)
        for k, v in st.items():
            got = sd["state"][i][k]
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert got.shape == (v.numel(),)
                assert torch.allclose(got, v.reshape(-1), rtol=0, atol=1e-6), (case, i, k)


def test_a_state_dict_loads_back_into_the_flat_state(group):
    engine, _, _ = _train(CASES["adamw-groups"], steps=3, chunk=256)
    sd = copy.deepcopy(engine.optimizer.state_dict())
    flat = engine._flat
    before = {(c.index, k): v.clone() for c in flat.chunks
              for k, v in c.state_tensors(flat.inner).items()}
    for c in flat.chunks:
        for v in c.state_tensors(flat.inner).values():
            v.zero_()
    engine.optimizer.load_state_dict(sd)
    after = {(c.index, k): v for c in flat.chunks for k, v in c.state_tensors(flat.inner).items()}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_hyperparameters_written_after_a_load_reach_the_flat_step(group):
    """`optimizer.load_state_dict` (a checkpoint load, accelerate's `prepare`) replaces the
    facade's group dicts; what an LR scheduler then writes there must still drive the step."""
    engine, _, _ = _train(CASES["adamw-groups"], steps=2, chunk=256)
    engine.optimizer.load_state_dict(engine.optimizer.state_dict())
    for g in engine.optimizer.param_groups:
        g["lr"] = 0.0
    before = engine.full_state_dict()
    engine.backward(engine(torch.randn(4, 8)).square().mean())
    assert engine.step()
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "lr 0 moved the weights"


def test_offload_refuses_an_optimizer_that_is_not_stepped_flat(group):
    import deepcompile

    with pytest.raises(ValueError, match="elementwise.*_MySGD steps parameter by parameter"):
        deepcompile.initialize(_model(), optimizer=CASES["subclass"],
                               config={"compiler": "fx", "passes": ("offload_optimizer",),
                                       "warmup_steps": 1})


def _auto_run(config, steps=8):
    import deepcompile

    torch._dynamo.reset()
    with chunk_bytes(256):
        engine = deepcompile.initialize(_model(), optimizer=CASES["adamw-groups"],
                                        config={"compiler": "fx", "warmup_steps": 1, **config})
    losses = []
    for step in range(steps):
        x = torch.randn(256, 8, generator=torch.Generator().manual_seed(step))   # activations
        loss = engine(x).square().mean()   # dominate: the graphs' peak is over the step's
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def test_auto_offloads_under_a_tight_budget_and_keeps_it(group):
    """passes="auto" with a budget the step with all state does not meet: offload_optimizer is
    chosen first, planned on the chunks, kept (on its re-profiled peak, without timed steps:
    reverting it would run over the budget), and training is bitwise the same."""
    _, plain = _auto_run({"passes": ()}, steps=10)
    unbounded, _ = _auto_run({"passes": ("offload_optimizer",), "measure_steps": 0})
    d = next(p for p in unbounded.report().to_dict()["passes"]
             if p["pass"] == "offload_optimizer")["decisions"]
    budget = int(d["peak_before"] - d["state_bytes"] // 2)
    engine, losses = _auto_run({"memory_budget": budget, "measure_steps": 1}, steps=10)
    rep = engine.report().to_dict()
    assert [c["pass"] for c in rep["auto"]["chosen"]][:1] == ["offload_optimizer"], rep["auto"]
    entry = next(p for p in rep["passes"] if p["pass"] == "offload_optimizer")
    assert entry["kept"] and "within the budget" in entry["verdict"], entry["verdict"]
    assert entry["after"].get("measured_s") is None   # memory decided it: not timed
    assert entry["decisions"]["chunks"] and entry["decisions"]["peak_after"] <= budget
    assert rep["phase"] == "steady" and rep["offload"]["offloaded_bytes"] > 0
    assert losses == plain
