"""The runtime data path: world size 1 at every stage and with every pass, every custom op
through `torch.library.opcheck`, one gradient-accumulation mechanism (and the hole it closes),
and host work per step that does not grow with the model's depth.

World size 1 (one process, gloo) matches single-process eager with the project's tolerances:
  ZeRO-3, tiny Llama, AdamW, gas 2, clip, fx: insertion only; each pass alone; all three
  scheduling passes together; offload_optimizer under a budget that fits half the state;
  ZeRO-1 and ZeRO-2: insertion only, bucket_reduce, every pass;
  Inductor (marked `inductor`): ZeRO-3 with every pass, ZeRO-1 with every pass.
At world size 1 a gather is a view or a cast of the local shard and a reduction a cast of the
gradient: no collective runs, and the passes find nothing to plan. Of the fx runs the core
matrix ([Note: the core matrix] in tests/_train.py) has the one with every pass at ZeRO-3,
whose graphs are insertion's; the others, and Inductor's, are the full matrix's.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

import _models
from _dist import run_distributed
from _train import (FULL, Jobs, _one_scenario, compare_to_reference, max_param_deviation,
                    mean_losses, scenario)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
ALL = ("prefetch", "bucket_reduce", "selective_unshard")


def _w1(stage: int, passes: tuple[str, ...], compiler: str = "fx", **kw) -> dict:
    name = "-".join(passes) or "insertion"
    return scenario(f"z{stage}-{name}-{compiler}", "llama", "adamw", 1e-2, gas=2, clip=0.1,
                    compiler=compiler, zero_stage=stage, passes=passes, warmup_steps=1,
                    record=("comm", "report"), **kw)


# the core matrix: all the passes at ZeRO-3. At world size 1 they plan nothing, so the run
# compiles insertion's graphs; the core's ZeRO-3 Llama without a pass at world size 1 is
# test_activation_checkpointing's baseline (`llama-adamw-gas2-clip`, compared with eager
# there), its ZeRO-2 Llama there test_grad_norm's, and ZeRO-1 at world size 1 (a pass that
# plans nothing there) test_overlap_refresh's fx1
_FX1 = ([_w1(3, (), extended=True)] + [_w1(3, (p,), extended=True) for p in ALL] + [_w1(3, ALL)]
        + [_w1(stage, p, extended=True)
           for stage in (1, 2) for p in ((), ("bucket_reduce",), ALL)])
JOBS = Jobs({
    "fx1": (1, _FX1),
    "inductor1": (1, [_w1(3, ALL, "inductor"), _w1(1, ALL, "inductor")]),
}, timeout=900)


@pytest.mark.parametrize("job, sc", JOBS.params())
def test_world_size_1_matches_eager(job, sc):
    (r,) = JOBS.results(job, sc["id"])
    compare_to_reference(sc, [r], kind=f"llama/{sc['config']['compiler']} world 1")
    # no collective at all: a gather is the local shard, a reduction the local gradient
    for phase in ("comm_fwd", "comm_bwd", "comm_step"):
        for counts in r[phase]:
            assert counts["all_gather"] == (0, 0) and counts["reduce_scatter"] == (0, 0), counts
    for p in r["report"]["passes"]:   # nothing to plan
        assert p["changed"] == [], p
    # and the report counts none: what the lowered runs launched, not the graph's insertion ops
    assert r["report"]["step_summary"]["collectives_in_graphs"] == 0
    assert not [row for row in r["report"]["step_collectives"] if row["what"].startswith("in the graph")]


# ------------------------------------------------------------------- offload, world size 1
def _offload_w1_job(rank, world):
    chunk = 4096   # the tiny Llama in ~16 chunks (offloading moves whole chunks)
    plain = scenario("llama-adamw-w1", "llama", "adamw", 1e-2, gas=2, warmup_steps=1,
                     chunk_bytes=chunk)
    base = scenario("llama-adamw-w1-offload-unbounded", "llama", "adamw", 1e-2, gas=2,
                    warmup_steps=1, passes=("offload_optimizer",), record=("report",),
                    chunk_bytes=chunk)
    r0 = _one_scenario(rank, world, base)
    d = next(p for p in r0["report"]["passes"] if p["pass"] == "offload_optimizer")["decisions"]
    half = scenario("llama-adamw-w1-offload-half", "llama", "adamw", 1e-2, gas=2,
                    warmup_steps=1, passes=("offload_optimizer",), record=("report",),
                    memory_budget=int(d["peak_before"] - d["state_bytes"] // 2),
                    chunk_bytes=chunk)
    return {"plain": (plain, _one_scenario(rank, world, plain)),
            "half": (half, _one_scenario(rank, world, half))}


# the full suite's: the engine layer (one rank) offloads the optimizer state under a budget of
# half of it and trains bitwise as without the pass (tests/engine/test_flat.py's
# test_auto_offloads_under_a_tight_budget_and_keeps_it)
@pytest.mark.extended
def test_world_size_1_offload_matches_training_without_it():
    (r,) = run_distributed(_offload_w1_job, 1, timeout=600)
    (plain_sc, plain), (half_sc, half) = r["plain"], r["half"]
    d = next(p for p in half["report"]["passes"] if p["pass"] == "offload_optimizer")["decisions"]
    assert d["chunks"] and d["peak_after"] <= half_sc["config"]["memory_budget"]
    assert half["report"]["offload"]["last_step"]["h2d_bytes"] == d["offloaded_bytes"]
    loss_dev = max(abs(a - b) for a, b in zip(mean_losses([plain]), mean_losses([half])))
    param_dev, _ = max_param_deviation(half["state"], plain["state"])
    assert loss_dev == 0 and param_dev == 0   # the same arithmetic, only moved
    compare_to_reference(half_sc, [half], kind="llama/fx+offload world 1")


# -------------------------------------------------------------------------------- opcheck
def _opcheck_job(rank, world):
    """Every custom op of deepcompile through torch.library.opcheck (schema, fake tensor,
    autograd registration, AOT dispatch), with real inputs of a registered parameter."""
    import deepcompile
    from deepcompile.runtime import ops, offload

    engine = deepcompile.initialize(_models.build_model("mlp"),
                                    optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx"})
    out = {}
    for e in list(engine._registry)[:2]:
        torch.library.opcheck(ops.allgather_param,
                              (e.shard, e.pid, list(e.shape), e.compute_dtype))
        grad = torch.randn(e.shape, generator=torch.Generator().manual_seed(e.pid))
        torch.library.opcheck(ops.reduce_grad, (grad, e.pid, e.shard.numel(), e.shard.dtype))
        torch.library.opcheck(ops.reduce_grad,
                              (grad, e.pid, e.shard.numel(), e.shard.dtype, e.shard.detach()))
        out[e.name] = True
    group = engine._offload.add_reload_group([])
    e = next(iter(engine._registry))
    handle = engine._runtime.handle
    torch.library.opcheck(offload.reload_state, (e.shard.detach(), [e.pid], group, handle))
    # at tier 0 the gradient goes to `shard.grad` (a graph planned for tier 2, run after a
    # re-plan); the tier-2 path runs in tests/engine/test_offload_grads.py
    torch.library.opcheck(offload.grad_to_host, (torch.randn(e.shard.numel()), e.pid, handle))
    out["grad_to_host_accumulated"] = e.shard.grad is not None
    # the activation copies start copies that a later op completes (an offload's buffer is
    # valid once its reload waited; a reload consumes its offload and a wait its reload:
    # runtime/activations.py): the offload passes the schema and fake-tensor checks; opcheck
    # calls an op more than once, which a single-use reload or wait cannot take, so those two
    # run once, and the copy through all three is compared
    from deepcompile.runtime import activations

    x = torch.randn(4, 3)
    torch.library.opcheck(activations.activation_offload, (x, handle),
                          test_utils=("test_schema", "test_faketensor"))
    host = activations.activation_offload(x, handle)
    dst = activations.activation_reload(x, host, handle, x.device)
    activations.activation_wait(dst, handle)
    out["activation_copy"] = torch.equal(dst, x)
    out["custom_ops"] = sorted(
        n for n in dir(torch.ops.deepcompile) if not n.startswith("_")
        and isinstance(getattr(torch.ops.deepcompile, n), torch._ops.OpOverloadPacket))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_every_custom_op_passes_opcheck(world):
    for r in run_distributed(_opcheck_job, world, timeout=300):
        assert r["custom_ops"] == ["activation_offload", "activation_reload", "activation_wait",
                                   "allgather_param", "grad_to_host", "reduce_grad",
                                   "reload_state"]
        assert r.pop("grad_to_host_accumulated") is True
        assert r.pop("activation_copy") is True
        assert len([k for k, v in r.items() if v is True]) == 2


# ---------------------------------- a gradient the last micro-step did not reduce (the hole)
class _Optional(torch.nn.Module):
    """`extra` is used only when asked: a parameter with a gradient on some micro-steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.base, self.extra = torch.nn.Linear(5, 5), torch.nn.Linear(5, 5)

    def forward(self, x, use_extra: bool):
        h = self.base(x)
        return (self.extra(h) if use_extra else h).square().mean()


_USES = [True, False] * 4   # extra: a gradient on the first micro-step of each window only


def _xs(world):
    return [torch.randn(4 * world, 5, generator=torch.Generator().manual_seed(i))
            for i in range(len(_USES))]


def _hole_job(rank, world, config):
    import deepcompile

    xs = _xs(world)
    engine = deepcompile.initialize(_Optional(), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                                    config={"compiler": "fx", "gradient_accumulation_steps": 2,
                                            **config})
    for step in range(len(_USES) // 2):
        for m in range(2):
            i = 2 * step + m
            engine.backward(engine(xs[i][rank * 4:(rank + 1) * 4], _USES[i]))
        engine.step()
    rt = engine._runtime
    return {"state": engine.full_state_dict(), "flushed": rt.accum.flushed,
            "accumulated": sorted(e.name for e in rt.registry if e.pid in rt.accum.by_pid),
            "kept": [e.name for e in rt.kept.entries]}


@pytest.mark.parametrize("config", [
    {"zero_stage": 1},
    {"zero_stage": 3, "passes": ("selective_unshard",), "warmup_steps": 1},
], ids=["zero1", "zero3-selective_unshard"])
def test_a_gradient_the_last_micro_step_did_not_reduce_is_flushed(config):
    """ZeRO-1's accumulators and selective_unshard's are one mechanism: `extra` gets a gradient
    on the first micro-step of each window only; what it accumulated is reduced at the
    optimizer step, and training matches eager."""
    world = 2
    xs = _xs(world)
    ref = _Optional()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(len(_USES) // 2):
        for m in range(2):
            i = 2 * step + m
            (ref(xs[i], _USES[i]) / 2).backward()
        opt.step()
        opt.zero_grad()
    for r in run_distributed(_hole_job, world, config, timeout=300):
        assert "extra.weight" in r["accumulated"] and "extra.bias" in r["accumulated"]
        assert r["flushed"] >= 2, r   # extra's two parameters, at least once
        for name, p in ref.named_parameters():
            assert (r["state"][name] - p.detach()).abs().max().item() < 1e-6, name


# -------------------------------------------------------------- host work against depth
class _TanhStack(torch.nn.Module):
    """`blocks` Linear(16, 16) + Tanh blocks between an input and an output Linear, on the
    MLP's data."""

    def __init__(self, blocks: int):
        super().__init__()
        torch.manual_seed(0)
        layers = [torch.nn.Linear(_models.MLP_IN, 16), torch.nn.Tanh()]
        for _ in range(blocks):
            layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(16, _models.MLP_OUT))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


# the shallow and the deep model of each pair: (name, builder, the data's model)
_DEPTHS = {"tanh": (("tanh2", lambda: _TanhStack(2), "mlp"),
                    ("tanh8", lambda: _TanhStack(8), "mlp")),
           "llama": (("llama", lambda: _models.build_model("llama"), "llama"),
                     ("llama4", lambda: _models.build_model("llama4"), "llama4"))}


def _host_calls_job(rank, world, pair, deep, config):
    """deepcompile's own Python function calls in one steady optimizer step (2 micro-steps),
    counted with sys.setprofile: calls whose code lives in the deepcompile package. Generated
    code (FX, Inductor) and torch's own Python are not deepcompile's and are not counted."""
    import deepcompile
    from runtime_figures import python_calls

    _name, build, data = _DEPTHS[pair][deep]
    engine = deepcompile.initialize(build(),
                                    optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                    config={"compiler": "fx", "gradient_accumulation_steps": 2,
                                            "max_grad_norm": 1.0, "warmup_steps": 1,
                                            "measure_steps": 0, **config})
    micro = 0

    def step():
        nonlocal micro
        for _ in range(2):
            batch = _models.local_batch(data, micro, rank, world)
            engine.backward(_models.loss_of(engine(**batch)))
            micro += 1
        engine.step()

    for _ in range(6):   # warm-up, profile, a re-profile per pass, steady (compiles)
        step()
    assert engine.report().phase == "steady"
    counts = python_calls(step)
    return {"calls": sum(counts.values()), "by_function": counts,
            "params": len(engine._registry)}


@pytest.mark.parametrize("config", [
    pytest.param({"zero_stage": 3, "passes": ("bucket_reduce", "selective_unshard")}, id="zero3"),
    # the same runtime with a replicated module: the full suite's ([Note: the core matrix])
    pytest.param({"zero_stage": 1, "passes": ("bucket_reduce",)}, id="zero1",
                 marks=pytest.mark.extended),
])
def test_host_work_per_step_does_not_grow_with_depth(config):
    """The same model shallow and deep, 2 ranks, steady state: a stack of Linear + Tanh blocks
    at 2 and at 8 blocks (8 and 20 parameters), and (the full suite's) the tiny Llama at 2 and
    at 4 decoder layers (21 and 39 parameters). deepcompile makes exactly as many Python
    function calls per optimizer step (the lowered graphs hold no Python op; per graph call
    and per step the runtime runs a fixed number of calls, its per-parameter work in C: `map`
    over tables, foreach ops, one collective and one split-copy per refresh group). The passes
    chosen plan the same structure whatever the timings (selective_unshard keeps every
    parameter under an unbounded budget; bucket_reduce's buckets live inside the graphs);
    prefetch's cross-graph groups add one call per group and graph call, a number its plan
    decides from timings."""
    for pair in ("tanh", "llama") if FULL else ("tanh",):
        r2, r4 = (run_distributed(_host_calls_job, 2, pair, deep, config, timeout=600)[0]
                  for deep in (0, 1))
        (name2, *_), (name4, *_) = _DEPTHS[pair]
        print(f"\n[host] {config}: deepcompile calls per step: {r2['calls']} at "
              f"{r2['params']} parameters ({name2}), {r4['calls']} at {r4['params']} ({name4})")
        assert r4["params"] > 1.5 * r2["params"]
        # Whether selective_unshard accumulates a kept parameter's gradient locally or reduces
        # it every micro-step is a timing decision (the cost model), so the two plans can differ
        # by a call or two per graph call (marking accumulators); a Python call per parameter
        # would add one per extra parameter (12 more at 8 blocks, 18 at 4 layers) in each place
        # it ran
        diff = {f: (r2["by_function"].get(f, 0), r4["by_function"].get(f, 0))
                for f in set(r2["by_function"]) | set(r4["by_function"])
                if r2["by_function"].get(f, 0) != r4["by_function"].get(f, 0)}
        assert r4["calls"] <= r2["calls"] + 8, (pair, diff)
        assert all(b - a <= 4 for a, b in diff.values()), (pair, diff)
