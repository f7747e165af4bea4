"""Collective engine methods called on some ranks only fail fast, on every rank that can know
([Note: collective calls] in runtime/collective_calls.py).

Each scenario trains a small model on 2 gloo ranks (a process group of its own per scenario,
`collective_timeout_s=T`), then calls one collective method on rank 0 only, the habit of
`if rank == 0: engine.save_checkpoint(...)`:

* "caller first": rank 1 goes on to its next training forward once rank 0 is in the method.
  Both ranks raise CollectiveCallError at once, without waiting for a collective: rank 1 at the
  start of its forward (before any collective of it), rank 0 reading rank 1's progress;
* "skipper first": rank 1 is in its next step's collectives before rank 0 calls. Rank 0 raises
  at once; rank 1, blocked in a collective, stops at the timeout with a DistributedError that
  quotes rank 0's report.

And: every method on every rank (one rank late, a load that moves the step counter back) runs;
two different methods at the same call raise at once on both ranks; a released engine is not
waited for; a transport error inside a method is a DistributedError.

Which path an error took is asserted from its message (what the rank saw), not from a clock;
`BOUND` only keeps a broken run from waiting out the default timeouts.
"""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _dist import run_distributed
from _train import FULL

T = 2.0                 # Config.collective_timeout_s
BOUND = 3 * T + 10.0    # no scenario's error waits for more than a timeout and the report wait
CALL_STEP = 2           # rank 0 calls the method at the start of this optimizer step


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        return F.mse_loss(self.b(torch.tanh(self.a(x))), y)


def _engine(group, **config):
    from deepcompile import Config
    from deepcompile.engine import Engine

    cfg = {"compiler": "fx", "warmup_steps": 0, "profile_steps": 0, "passes": (),
           "measure_steps": 0, "collective_timeout_s": T, "startup_timeout_s": 120.0, **config}
    return Engine(Small(), functools.partial(torch.optim.SGD, lr=0.1), Config(**cfg), group)


def _step(engine, step, rank):
    g = torch.Generator().manual_seed(10 * step + rank)
    engine.backward(engine(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)))
    return engine.step()


def _call(engine, method, tmp):
    args = {"full_state_dict": (), "save_checkpoint": (f"{tmp}/ckpt",),
            "load_checkpoint": (f"{tmp}/ckpt",), "save_pretrained": (f"{tmp}/hf",),
            "export_trace": (f"{tmp}/trace.json",), "save_report": (f"{tmp}/report.json",),
            "plot": (f"{tmp}/plots",)}[method]
    return getattr(engine, method)(*args)


def _wait_for(predicate, what):
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.01)


def _one_rank(rank, group, out, method, order, tmp, zero_stage=3, profile_steps=0):
    engine = _engine(group, zero_stage=zero_stage, profile_steps=profile_steps)
    store = engine._rails.store
    for step in range(CALL_STEP):
        _step(engine, step, rank)
    out["steady"] = engine._rails.steady   # Config.collective_timeout_s applies
    out["t0"] = time.monotonic()
    if rank == 1 and order == "skipper first":   # tell rank 0 when its forward's check is over
        check = engine._rails.at_forward

        def at_forward(*args):
            check(*args)
            store.set("test/checked", "1")
        engine._rails.at_forward = at_forward
    if rank == 0:
        if order == "skipper first":   # rank 1 is in its next step (and then blocks in it)
            _wait_for(lambda: store.check(["test/checked"]), "rank 1's forward")
        _call(engine, method, tmp)
    else:
        if order == "caller first":
            _wait_for(lambda: store.check(["call/0"]), "rank 0 in the method")
        _step(engine, CALL_STEP, rank)


def _every_method(rank, group, out, tmp):
    """Every rank calls every collective method (rank 1 late by a second once: a slow rank is
    not a rank that skipped the call), and training goes on; each method entered the
    collective handshake once (plot's nested trace export included). The load goes back a
    step, and the call after it compares positions with the step counter it restored."""
    # (rank 0 draws plot's pictures alone, for seconds, while rank 1 waits in its next step)
    engine = _engine(group, zero_stage=3, profile_steps=1, collective_timeout_s=120.0)
    for step in range(CALL_STEP):
        _step(engine, step, rank)
    out["results"] = {}
    for method in METHODS:
        if method == "load_checkpoint":
            _step(engine, CALL_STEP, rank)   # then back to CALL_STEP
        if rank == 1 and method == "save_checkpoint":
            time.sleep(1.0)
        out["results"][method] = type(_call(engine, method, tmp)).__name__
    out["again"] = type(_call(engine, "full_state_dict", tmp)).__name__
    out["calls"] = engine._rails.calls
    out["stepped"] = _step(engine, CALL_STEP, rank)


def _different(rank, group, out, tmp):
    """Rank 0 saves a checkpoint while rank 1 exports the model: both raise at once."""
    engine = _engine(group, zero_stage=1)
    for step in range(CALL_STEP):
        _step(engine, step, rank)
    out["t0"] = time.monotonic()
    _call(engine, "save_checkpoint" if rank == 0 else "save_pretrained", tmp)


def _stalled_inside(rank, group, out, tmp):
    """Both ranks call export_trace, and rank 1 stalls inside it, before its collective, past
    the timeout: rank 0's gather times out, a DistributedError naming the method (not gloo's
    raw timeout)."""
    from deepcompile.report import trace

    engine = _engine(group, zero_stage=3, profile_steps=1)
    for step in range(CALL_STEP):
        _step(engine, step, rank)
    out["t0"] = time.monotonic()
    events = trace._profiled_events
    if rank == 1:
        trace._profiled_events = lambda e: (time.sleep(T + 1.0), events(e))[1]
    try:
        engine.export_trace(f"{tmp}/trace.json")
    finally:
        trace._profiled_events = events


def _released(rank, group, out, tmp):
    """Rank 1 is done and releases its engine; rank 0 then saves alone: it raises at once."""
    import gc

    engine = _engine(group, zero_stage=2)
    for step in range(CALL_STEP):
        _step(engine, step, rank)
    out["t0"] = time.monotonic()
    if rank == 1:
        store = engine._rails.store
        del engine
        gc.collect()
        out["gone"] = store.get("pos/1").decode()
        return
    _wait_for(lambda: engine._rails.store.get("pos/1").decode() == "gone", "rank 1 leave")
    _call(engine, "save_pretrained", tmp)


METHODS = ("full_state_dict", "save_checkpoint", "save_pretrained", "export_trace",
           "save_report", "plot", "load_checkpoint")
ONE_RANK = ("full_state_dict", "save_checkpoint", "save_pretrained", "plot")
# plot called on rank 0 first: the full suite's ([Note: the core matrix] in tests/_train.py);
# the default run has the other methods' calls on rank 0 first, and plot's skipped call in
# "plot/skipper first, ZeRO-1"
ONE_RANK_FULL_ONLY = ("plot",)
SCENARIOS = {"every method": _every_method,
             # rank 0 alone: caller first (no rank waits for a timeout) ...
             **{f"{m}/caller first": functools.partial(_one_rank, method=m, order="caller first",
                                                       profile_steps=int(m == "plot"))
                for m in ONE_RANK if FULL or m not in ONE_RANK_FULL_ONLY},
             # ... and rank 1 first (it waits in a collective for the timeout)
             "save_checkpoint/skipper first": functools.partial(
                 _one_rank, method="save_checkpoint", order="skipper first"),
             "plot/skipper first, ZeRO-1": functools.partial(
                 _one_rank, method="plot", order="skipper first", zero_stage=1, profile_steps=1),
             "different": _different,
             "stalled inside": _stalled_inside,
             "released": _released}


def _job(rank, world, names, tmp):
    import torch.distributed as dist

    results = {}
    for name in names:
        group = dist.new_group([0, 1])
        out: dict = {}
        torch._dynamo.reset()
        try:
            SCENARIOS[name](rank, group, out, tmp=os.path.join(tmp, name.replace("/", "_")))
        except BaseException as e:  # noqa: BLE001 -- the outcome under test
            out["type"] = type(e).__name__
            out["message"] = "\n".join([str(e), *getattr(e, "__notes__", [])])
        out["elapsed"] = time.monotonic() - out.get("t0", time.monotonic())
        results[name] = out
        dist.barrier()
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    pytest.importorskip("matplotlib")
    pytest.importorskip("safetensors")
    tmp = str(tmp_path_factory.mktemp("collective"))
    t0 = time.monotonic()
    per_rank = run_distributed(_job, 2, list(SCENARIOS), tmp, timeout=300)
    print(f"\n[collective calls] {len(SCENARIOS)} scenarios in {time.monotonic() - t0:.1f}s")
    return {name: [per_rank[0][name], per_rank[1][name]] for name in SCENARIOS}


def _show(name, outs):
    for r, o in enumerate(outs):
        print(f"\n--- {name} rank {r} ({o.get('type')}, {o['elapsed']:.1f}s):\n{o.get('message')}")


def test_every_method_on_every_rank(outcomes):
    for r in outcomes["every method"]:
        assert "type" not in r, r.get("message")
        assert r["results"] == {"full_state_dict": "dict", "save_checkpoint": "str",
                                "load_checkpoint": "NoneType", "save_pretrained": "str",
                                "export_trace": "str", "save_report": "str", "plot": "list"}
        assert r["again"] == "dict"
        assert r["calls"] == len(METHODS) + 1 and r["stepped"] is True


@pytest.mark.parametrize("method", [
    pytest.param(m, marks=pytest.mark.extended) if m in ONE_RANK_FULL_ONLY else m
    for m in ONE_RANK])
def test_called_on_one_rank_both_ranks_raise_at_once(outcomes, method):
    r0, r1 = outcomes[f"{method}/caller first"]
    _show(method, (r0, r1))
    assert r0["type"] == r1["type"] == "CollectiveCallError"
    assert (f"engine.{method}() on rank 0: this rank called it at the start of step {CALL_STEP}, "
            f"and rank(s) [1] did not: rank 1 went on to a training forward at the start of "
            f"step {CALL_STEP}") in r0["message"]
    assert (f"engine.{method}() on rank 1: rank(s) [0] called it at the start of step "
            f"{CALL_STEP}, and this rank did not: it went on to a training forward at the start "
            f"of step {CALL_STEP}") in r1["message"]
    for r in (r0, r1):
        assert "call it on every rank, at the same point of the training loop" in r["message"]
        assert r["elapsed"] < BOUND


@pytest.mark.parametrize("name", ["save_checkpoint/skipper first", "plot/skipper first, ZeRO-1"])
def test_the_caller_raises_at_once_and_the_blocked_rank_names_it(outcomes, name):
    method = name.split("/")[0]
    r0, r1 = outcomes[name]
    _show(name, (r0, r1))
    assert r0["steady"] and r1["steady"]
    assert r0["type"] == "CollectiveCallError"
    assert (f"and rank(s) [1] did not: rank 1 went on to a training forward at the start of "
            f"step {CALL_STEP}") in r0["message"]
    # rank 1 waited in its forward's (ZeRO-3) or step's (ZeRO-1) collective until the timeout
    assert r1["type"] == "DistributedError", r1
    assert (f"rank 0: at step {CALL_STEP} (micro-step 0, {method}): called engine.{method}() at "
            f"the start of step {CALL_STEP}; rank(s) [1] did not: rank 1 went on to a training "
            f"forward") in r1["message"]
    assert r0["elapsed"] < BOUND and r1["elapsed"] < BOUND


def test_different_methods_at_the_same_call(outcomes):
    r0, r1 = outcomes["different"]
    _show("different", (r0, r1))
    assert r0["type"] == r1["type"] == "CollectiveCallError"
    text = " ".join([r0["message"], r1["message"]])
    assert "called engine.save_checkpoint()" in text and "called engine.save_pretrained()" in text
    assert r0["elapsed"] < BOUND and r1["elapsed"] < BOUND


def test_a_transport_error_inside_is_a_distributed_error(outcomes):
    r0, r1 = outcomes["stalled inside"]
    _show("stalled inside", (r0, r1))
    assert r0["type"] == "DistributedError"
    assert (f"rank 0 stopped at step {CALL_STEP} (micro-step 0, export_trace): a collective "
            "failed: ") in r0["message"]
    assert "What the other ranks reported:" in r0["message"]
    assert r1["type"] == "DistributedError"   # its peer gave up on the collective
    assert r0["elapsed"] < BOUND and r1["elapsed"] < BOUND


def test_a_released_engine_is_not_waited_for(outcomes):
    r0, r1 = outcomes["released"]
    _show("released", (r0, r1))
    assert "type" not in r1 and r1["gone"] == "gone"
    assert r0["type"] == "CollectiveCallError"
    assert "and rank(s) [1] did not: rank 1 released its engine (or exited)" in r0["message"]
    assert r0["elapsed"] < BOUND
