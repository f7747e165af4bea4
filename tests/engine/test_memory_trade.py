"""`passes="auto"` at world size 1 with bf16 compute under fp32 masters, in-process: with some
room under the budget but not enough to keep every parameter's cast copy (and its accumulator),
`auto` chooses activation_budget before selective_unshard ([Note: a memory trade] in
passes/activation_budget.py), whatever the trade finds, and training is bitwise the training
without either pass (a kept copy is the cast a gather makes, made once per optimizer step). The
MLP (its inputs in the compute dtype); the tiny Llama in the full suite."""

from __future__ import annotations

import functools

import pytest
import torch

import _models
from _train import chunk_bytes

GAS = 2


def _batch(model: str, micro: int, dtype) -> dict:
    batch = _models.local_batch(model, micro, 0, 1)
    if model in _models.LM_MODELS:   # token ids
        return batch
    return {k: v.to(dtype) for k, v in batch.items()}


def _run(model, passes, budget=None, dtype=torch.bfloat16, copy_per_byte=None):
    import deepcompile

    torch._dynamo.reset()
    engine = deepcompile.initialize(
        _models.build_model(model), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
        config=deepcompile.Config(compiler="fx", param_dtype=dtype, passes=passes,
                                  memory_budget=budget, gradient_accumulation_steps=GAS,
                                  measure_steps=0))
    if copy_per_byte is not None:   # the calibrated copy time, before any pass plans
        engine._pipeline.cost.copy = (0.0, copy_per_byte)
    losses = []
    for step in range(8):
        for m in range(GAS):
            loss = _models.loss_of(engine(**_batch(model, GAS * step + m, dtype)))
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    out = {"losses": losses, "passes": engine.report().to_dict()["passes"],
           "chosen": [c["pass"] for c in engine._pipeline.passes.chosen or ()],
           "state": {k: v.clone() for k, v in engine.full_state_dict().items()},
           "step_peak": engine._offload.step_peak()}
    del engine
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("model", ["mlp", pytest.param("llama", marks=pytest.mark.extended)])
def test_auto_chooses_the_trade_at_one_rank(group, model):
    # the step's peak with every optimizer state on the device: offload_optimizer's figures
    # under a budget that never binds (it offloads nothing)
    plain = _run(model, ("offload_optimizer",), budget=1 << 40)
    (offload,) = [p for p in plain["passes"] if p["pass"] == "offload_optimizer"]
    peak = offload["decisions"]["peak_before"]
    assert offload["decisions"]["offloaded_bytes"] == 0
    # every parameter's bf16 copy and fp32 accumulator
    keep_all = sum(p.numel() * (2 + 4) for p in _models.build_model(model).parameters())
    auto = _run(model, "auto", budget=peak + keep_all // 3)
    print(f"\n[trade w1] peak {peak}, room {keep_all // 3} of {keep_all}: "
          + "; ".join(f"{p['pass']}: {p['verdict']}" for p in auto["passes"]))
    assert auto["chosen"][:2] == ["activation_budget", "selective_unshard"], auto["chosen"]
    kept = next(p for p in auto["passes"] if p["pass"] == "selective_unshard")
    assert kept["kept"] and kept["decisions"]["kept_bytes"] > 0
    # the kept copies and accumulators stay through the optimizer step: it stays within the
    # budget too (planned from the graphs' peaks alone, the step went over it)
    assert auto["step_peak"] <= peak + keep_all // 3, (auto["step_peak"], peak + keep_all // 3)
    assert auto["losses"] == plain["losses"]
    for k, v in plain["state"].items():
        assert torch.equal(auto["state"][k], v), k


# the calibrated copies of this host are a memcpy, cheaper than recomputing any activation of
# the MLP; on a GPU the optimizer state crosses PCIe, and an activation recomputed is often the
# cheaper byte: copies priced at 10 us a byte here stand for that ratio on the tiny model
SLOW_COPY = 1e-5


def test_activations_are_freed_so_that_optimizer_state_stays_on_the_device(group):
    """[Note: a memory trade] with offload_optimizer as the buyer: under a budget that the step
    with all optimizer state exceeds by a little, `auto` queues offload_optimizer after
    activation_budget (`Pass.waits_for_memory`), which recomputes or offloads activations where
    what the offload plan then no longer copies pays for them: fewer chunks leave the device than the
    offload plan alone takes, the step stays within the budget, and training is bitwise the
    training with all state on the device."""
    with chunk_bytes(2048):   # several chunks: a plan that can keep some
        plain = _run("mlp", ("offload_optimizer",), budget=1 << 40, dtype=torch.float32,
                     copy_per_byte=SLOW_COPY)
        (figures,) = [p for p in plain["passes"] if p["pass"] == "offload_optimizer"]
        d = figures["decisions"]
        budget = d["graph_peak_bytes"] - d["state_bytes"] * 3 // 20
        alone = _run("mlp", ("offload_optimizer",), budget=budget, dtype=torch.float32,
                     copy_per_byte=SLOW_COPY)
        auto = _run("mlp", "auto", budget=budget, dtype=torch.float32, copy_per_byte=SLOW_COPY)
    print(f"\n[trade for offload] budget {budget}: "
          + "; ".join(f"{p['pass']}: {p['verdict']}" for p in auto["passes"]))
    assert auto["chosen"][:2] == ["offload_optimizer", "activation_budget"], auto["chosen"]
    # activation_budget planned first, and traded for offload_optimizer
    assert [p["pass"] for p in auto["passes"]][:2] == ["activation_budget", "offload_optimizer"]
    act, off = auto["passes"][0], auto["passes"][1]
    trade = act["decisions"]["trade"]
    assert act["kept"] and trade["for"] == "offload_optimizer" and trade["bought"] >= 1, trade
    line = "for offload_optimizer (optimizer state kept on the device: "
    assert line in "\n".join(act["summary"]), act["summary"]
    assert any(v["choices"] for k, v in act["decisions"].items() if k != "trade")
    chunks = lambda run: len(next(p for p in run["passes"]   # noqa: E731
                                  if p["pass"] == "offload_optimizer")["decisions"]["chunks"])
    assert chunks(auto) < chunks(alone), (chunks(auto), chunks(alone))
    assert off["kept"] and max(auto["step_peak"], off["after"]["peak_bytes"]) <= budget
    assert auto["losses"] == plain["losses"] == alone["losses"]
    for k, v in plain["state"].items():
        assert torch.equal(auto["state"][k], v), k
