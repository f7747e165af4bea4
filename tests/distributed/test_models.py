"""Parity on models that stress the parameter bookkeeping (fx compiler, 2 ranks, 8 steps):

  tied weights     tiny Llama with tie_word_embeddings=True: one parameter under two fqns;
                   full_state_dict reports both fqns with the same values.
  graph break      two Dynamo graphs; one parameter (`shared`) used in both.
  eager fallback   a submodule inside a @torch.compiler.disable method, and a loop over a
                   ModuleList with a graph break in the loop body (the eager hooks gather each
                   layer, and one graph compiled for the first layer runs for the others):
                   both must train correctly with the module's parameters freed between
                   uses; and a graph break inside a submodule's forward followed by an eager
                   loop using that submodule's own parameter;
                   and a submodule whose forward the user wrapped with torch.compiler.disable
                   (how one runs a submodule eagerly).
  MoE              tiny Mixtral (4 experts, top-2) in fp32, with transformers' default experts
                   implementation and with the eager one (graph breaks at nonzero): the full
                   suite's.

And the exact checks of tests/_exact.py: the communication counts on the tied Llama (SGD), what
each rank holds between steps on the tied Llama and on Mixtral (AdamW's sharded state: Mixtral
and the tied Llama, in the full matrix; the core checks ZeRO-1/2's in test_zero12's
test_memory_per_rank).
"""

from __future__ import annotations

import math

import pytest
import torch

import _exact
from _train import Jobs, compare_to_reference, scenario

# each family with one optimizer in the core matrix, both in the full one ([Note: the core
# matrix] in tests/_train.py); of the HF models the core has the tied Llama, the full one
# Mixtral's experts too (default and eager). The eager hooks with one graph run for several
# parameters are the core's loop_break (test_parameters_freed_after_eager_use checks both
# there), the eager hooks for whatever module call runs eagerly nested_break's and
# disabled_forward's; Mixtral's eager experts, a graph reused for several experts at ZeRO-1,
# test_zero12's z1-mixtral_eager. The graph-break model's two graphs are test_zero12's
# test_no_graph_breaks (ZeRO-2) and its ZeRO-3 parity test_prefetch's fx2-random-times
_SCENARIOS = [
    scenario("llama_tied-sgd-gas1", "llama_tied", "sgd", 0.1, record=("memory", "comm")),
    scenario("llama_tied-adamw-gas2-clip", "llama_tied", "adamw", 1e-2, gas=2, clip=0.1,
             record=("memory",), extended=True),
    scenario("graph_break-sgd-gas2-clip", "graph_break", "sgd", 0.1, gas=2, clip=0.1,
             extended=True),
    scenario("graph_break-adamw-gas1", "graph_break", "adamw", 1e-2, extended=True),
    scenario("disabled-sgd-gas2", "disabled", "sgd", 0.1, gas=2, record=("memory",)),
    scenario("disabled-adamw-gas1-clip", "disabled", "adamw", 1e-2, clip=0.1, extended=True),
    scenario("loop_break-sgd-gas1", "loop_break", "sgd", 0.1, record=("memory", "report")),
    scenario("loop_break-adamw-gas2-clip", "loop_break", "adamw", 1e-2, gas=2, clip=0.1, extended=True),
    scenario("nested_break-sgd-gas2-clip", "nested_break", "sgd", 0.1, gas=2, clip=0.1,
             record=("memory",)),
    scenario("mixtral-adamw-gas1", "mixtral", "adamw", 1e-2, record=("memory",), extended=True),
    scenario("mixtral-sgd-gas2-clip", "mixtral", "sgd", 0.1, gas=2, clip=0.1, extended=True),
    scenario("mixtral_eager-adamw-gas2-clip", "mixtral_eager", "adamw", 1e-2, gas=2, clip=0.1,
             record=("memory",), extended=True),
    # a submodule the user runs eagerly: its forward wrapped with torch.compiler.disable
    scenario("disabled_forward-sgd-gas2-clip", "disabled_forward", "sgd", 0.1, gas=2, clip=0.1,
             record=("memory",)),
    scenario("disabled_forward-adamw-gas1", "disabled_forward", "adamw", 1e-2, extended=True),
]
JOBS = Jobs({"fx2": (2, _SCENARIOS)})
_BY_ID = {sc["id"]: sc for sc in _SCENARIOS}

# nested_break, mixtral_eager and disabled_forward train because the eager fallback's hooks
# gather for whatever module call runs eagerly ([Note: eager hooks run eagerly] in
# runtime/eager.py; before it, their module's parameters were read from freed storage, on torch
# 2.11 and 2.13 alike).


def _results(sid):
    return JOBS.results("fx2", sid)


@pytest.mark.parametrize("sid", list(_BY_ID))
def test_parity(sid):
    sc = _BY_ID[sid]
    compare_to_reference(sc, _results(sid), kind=sc["model"])


@pytest.mark.parametrize("sid", ["llama_tied-sgd-gas1", "llama_tied-adamw-gas2-clip"])
def test_tied_weights_reported_under_both_names(sid):
    for r in _results(sid):
        state = r["state"]
        emb, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
        assert torch.equal(emb, head)
        # one parameter, one shard: 20 optimizer parameters for 21 fqns
        assert len(state) == len(r["model_shapes"]) + 1 == 21


@pytest.mark.parametrize("sid", ["graph_break-sgd-gas2-clip", "graph_break-adamw-gas1"])
def test_graph_break_model_compiles_two_graphs(sid):
    for r in _results(sid):
        assert r["graphs"]["unique_graphs"] >= 2, r["graphs"]
        assert r["graphs"]["graph_breaks"] >= 1, r["graphs"]


@pytest.mark.parametrize("sid", ["llama_tied-sgd-gas1", "disabled-sgd-gas2", "loop_break-sgd-gas1",
                                 "nested_break-sgd-gas2-clip", "mixtral_eager-adamw-gas2-clip",
                                 "disabled_forward-sgd-gas2-clip"])
def test_parameters_freed_after_eager_use(sid):
    """Eagerly run submodules gather their parameters and free them again. On loop_break the
    eager hooks gather, and one graph Dynamo compiled for the first layer runs for the others
    ([Note: graph reuse] in compiler/backend.py)."""
    for r in _results(sid):
        for snap in [r["memory_init"]] + r["memory_micro"] + r["memory_step"]:
            assert all(n == 0 for n in snap["module_storage_nbytes"]), snap["module_storage_nbytes"]
            assert all(g is None for g in snap["module_grads"]), snap["module_grads"]
        if "report" in r:
            assert r["report"]["eager_fallback_gathers"] > 0, r["report"]["eager_fallback_gathers"]
            reused = {n for pair in r["report"]["graph_reuse"] for n in pair}
            assert {"layers.0.weight", "layers.1.weight", "layers.2.weight"} <= reused, reused


def test_tied_llama_comm_counts_exact():
    """The exact communication counts of tests/_exact.py on the tied Llama (ZeRO-3, no pass):
    the tied table is one parameter, gathered, reduced and saved once."""
    sid = "llama_tied-sgd-gas1"
    _exact.check_comm_counts(_BY_ID[sid], _results(sid))


@pytest.mark.parametrize("sid", ["llama_tied-sgd-gas1", "llama_tied-adamw-gas2-clip",
                                 "mixtral-adamw-gas1"])
def test_each_rank_holds_its_shards_only(sid):
    """tests/_exact.py's memory checks: no module storage, flat fp32 shards in the optimizer
    (tied weights: one), shard-sized gradients, and (AdamW) sharded optimizer state."""
    _exact.check_memory(_BY_ID[sid], _results(sid))


# ------------------------------------------- saved views of a parameter, a different number per rank
class _RankLoop(torch.nn.Module):
    """Runs eagerly (its forward is wrapped with torch.compiler.disable) and uses its weight
    once more on each higher rank: the backward unpacks a different number of saved views of it
    on each rank (an experts loop's data-dependent hits)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(6, 6) / 6 ** 0.5)

    @torch.compiler.disable
    def forward(self, x):
        import torch.distributed as dist

        for _ in range(1 + dist.get_rank()):
            x = x @ self.w
        return x


def _rank_loop_job(rank, world):
    import functools

    import deepcompile

    model = torch.nn.Sequential(torch.nn.Linear(6, 6), _RankLoop())
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx", "warmup_steps": 1,
                                            "startup_timeout_s": 60})
    losses = []
    for _ in range(3):
        loss = engine(torch.ones(4, 6)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def test_a_parameter_saved_a_different_number_of_times_per_rank_is_gathered_once():
    # one gather per unpacked view made rank 1 gather twice where rank 0 gathered once: the
    # ranks' collectives no longer matched (a hang until the timeout, or wrong values)
    from _dist import run_distributed

    per_rank = run_distributed(_rank_loop_job, 2, timeout=300)
    assert all(len(r) == 3 and all(map(math.isfinite, r)) for r in per_rank), per_rank
