"""Activation checkpointing under deepcompile: the model's own (Hugging Face's
`activation_checkpointing_enable` / `gradient_checkpointing_enable`, i.e. `torch.utils.checkpoint`
around every decoder layer, which Dynamo traces and AOTAutograd recomputes in the backward).
The planner predicts that a 13B shape fits one 80 GB GPU only with it (`deepcompile plan
--activation-checkpointing`, benchmarks/results/2026-11-24-planner-offload): the runtime must
train such a model as eager does, and its graphs must not keep what checkpointing drops.

Parity with the eager reference at world size 1 and 2 (fx, the suite's passes; Inductor at 2),
and the profiled peaks against the same model without checkpointing, which is compared with
eager too (world size 1, ZeRO-3 without a pass)."""

from __future__ import annotations

import pytest

from _train import Jobs, compare_to_reference, scenario


def _sc(model, **kw):
    return scenario(f"{model}-adamw-gas2-clip{'-' + kw['compiler'] if 'compiler' in kw else ''}",
                    model, "adamw", 1e-2, gas=2, clip=0.1, **kw)


JOBS = Jobs({
    "fx1": (1, [_sc("llama_ckpt", record=("report",)), _sc("llama", record=("report",))]),
    # at 2 ranks in the full suite: the default run trains the checkpointed Llama as eager at
    # world size 1 (here, and under activation_budget in test_activation_budget.py)
    "fx2": (2, [_sc("llama_ckpt", extended=True)]),
    "inductor2": (2, [_sc("llama_ckpt", compiler="inductor")]),
}, timeout=900)


@pytest.mark.parametrize("job, sc", JOBS.params())
def test_trains_as_eager(job, sc):
    compare_to_reference(sc, JOBS.results(job, sc["id"]), kind=sc["model"])


def test_checkpointed_graphs_hold_less():
    """The forward keeps no decoder layer's activations (recomputed in the backward), so both
    profiled peaks are lower than without checkpointing (measured at world size 1, fx,
    torch 2.13: forward 309,912 B against 899,736 B; backward 716,808 B against 1,047,688 B)."""
    def peaks(model):
        (r,) = JOBS.results("fx1", _sc(model)["id"])
        return {s["slot"].split(".")[-1]: s["profiles"][-1]["peak_bytes"]
                for g in r["report"]["graphs"] for s in g["slots"] if s["profiles"]}

    ckpt, plain = peaks("llama_ckpt"), peaks("llama")
    print(f"\n[activation checkpointing] profiled peaks: with {ckpt}, without {plain}")
    assert set(ckpt) == set(plain) == {"fw", "bw"}, (ckpt, plain)   # one graph each: no break
    assert ckpt["fw"] < plain["fw"] / 2 and ckpt["bw"] < plain["bw"], (ckpt, plain)
