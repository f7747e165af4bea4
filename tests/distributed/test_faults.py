"""Fault injection: every way the ranks can fall out of step ends with a clear error on every
rank, within the collective timeout, naming the rank, the step and the graph or check where it
happened (issue 17's table; runtime/guardrails.py).

Each scenario runs a small model on a pair of gloo ranks with `collective_timeout_s=T` and
injects one fault in the steady state (or at the profile step). Scenarios that keep every
process alive run two at a time on 4 ranks (two pairs, each on its own process group, so the
default group stays healthy between rounds); scenarios that kill a process run in jobs of their
own. Every rank's outcome is asserted: the exception type, its message, and how long it took
from the start of the faulty step.
"""

from __future__ import annotations

import functools
import math
import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _dist import DistributedTestError, run_distributed

T = 2.0          # Config.collective_timeout_s in these tests
BOUND = 3 * T + 10.0   # a rank's error comes within the timeout, the report wait, and slack
FAULT: dict = {}  # this process's injected fault: {"forward": fn, "backward": fn}


class _Probe(torch.autograd.Function):
    """Runs eagerly between two compiled graphs (forward and backward): where faults happen."""

    @staticmethod
    def forward(ctx, h):
        if "forward" in FAULT:
            FAULT.pop("forward")()
        return h.clone()

    @staticmethod
    def backward(ctx, g):
        if "backward" in FAULT:
            FAULT.pop("backward")()
        return g


class Faulty(nn.Module):
    """Linear layers with a graph break in the middle (a probe the faults go through) and three
    same-shaped branches, chosen by an argument (a graph per branch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(13, 17)
        self.a, self.b, self.c = nn.Linear(17, 17), nn.Linear(17, 17), nn.Linear(17, 17)
        self.out = nn.Linear(17, 7)

    @torch.compiler.disable
    def probe(self, h):
        return _Probe.apply(h)

    def forward(self, x, y, branch: str = "a"):
        h = torch.tanh(self.inp(x))
        h = self.probe(h)
        h = torch.tanh(getattr(self, branch)(h))
        return F.mse_loss(self.out(h), y)


def _data(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(4, 13, generator=g), torch.randn(4, 7, generator=g)


def _engine(group, **config):
    from deepcompile import Config
    from deepcompile.engine import Engine

    cfg = {"compiler": "fx", "warmup_steps": 1, "collective_timeout_s": T,
           "startup_timeout_s": 120.0, "passes": (), "measure_steps": 0, **config}
    return Engine(Faulty(), functools.partial(torch.optim.SGD, lr=0.05), Config(**cfg), group)


def _step(engine, step, rank, micros=1, branch="a", nan=False, backward=True):
    for m in range(micros):
        x, y = _data(step, m, rank)
        if nan:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = engine(x, y, branch=branch)
        if backward:
            engine.backward(loss)
    return engine.step()


def _fault_step(engine, out):
    """The faulty step starts: in the steady state (Config.collective_timeout_s applies)."""
    out["steady"] = engine._rails.steady
    out["t0"] = time.monotonic()


def _raise():
    raise ValueError("injected fault")


def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


# ------------------------------------------------------------------------ scenarios
# scenario(rank, group, out) trains and injects; `out["t0"]` is set at the start of the faulty
# step (the runner measures the time to the error from there)
def raise_forward(rank, group, out):
    engine = _engine(group, zero_stage=3, passes=("prefetch", "bucket_reduce"))
    for step in range(7):
        if step == 5:
            _fault_step(engine, out)
            if rank == 1:
                FAULT["forward"] = _raise
        try:
            _step(engine, step, rank)
        except ValueError:
            out["phase"] = engine._pipeline.phase.value
            try:   # the user's loop catches it and carries on: the engine refuses
                _step(engine, step + 1, rank)
            except Exception as e:  # noqa: BLE001
                out["next_call"] = f"{type(e).__name__}: {e}"
            raise


def raise_backward(rank, group, out):
    engine = _engine(group, zero_stage=1, gradient_accumulation_steps=2)
    for step in range(7):
        if step == 5:
            _fault_step(engine, out)
            if rank == 1:
                FAULT["backward"] = _raise
        _step(engine, step, rank, micros=2)


def extra_micro_gas2(rank, group, out):
    engine = _engine(group, zero_stage=3, gradient_accumulation_steps=2)
    for step in range(5):
        if step == 3:
            _fault_step(engine, out)
        _step(engine, step, rank, micros=3 if (step == 3 and rank == 1) else 2)


def extra_micro_gas1(rank, group, out):
    engine = _engine(group, zero_stage=2, passes=("bucket_reduce",))
    for step in range(7):
        if step == 5:
            _fault_step(engine, out)
        _step(engine, step, rank, micros=2 if (step == 5 and rank == 1) else 1)


def step_without_backward(rank, group, out):
    engine = _engine(group, zero_stage=3)
    for step in range(5):
        if step == 3:
            _fault_step(engine, out)
        _step(engine, step, rank, backward=not (step == 3 and rank == 1))


def pass_plan(rank, group, out):
    import torch.distributed as dist

    from deepcompile import register_pass
    from deepcompile.passes import known_passes

    if "test_rank_dependent" not in known_passes():
        register_pass("test_rank_dependent", lambda ctx: {"rank": dist.get_rank()},
                      lambda ctx, decisions: [])
    engine = _engine(group, zero_stage=3, passes=("test_rank_dependent",))
    out["t0"] = time.monotonic()
    for step in range(4):
        _step(engine, step, rank)


def silent_divergence(rank, group, out):
    engine = _engine(group, zero_stage=3)
    for step in range(5):   # both branches compiled on every rank at steps 0 and 1
        if step == 3:
            _fault_step(engine, out)
        branch = "b" if step == 1 or (step == 3 and rank == 1) else "a"
        _step(engine, step, rank, branch=branch)


def new_graph_one_rank(rank, group, out):
    engine = _engine(group, zero_stage=3)
    for step in range(5):
        if step == 3:
            _fault_step(engine, out)
        _step(engine, step, rank, branch="c" if (step == 3 and rank == 1) else "a")


def nan_skip(rank, group, out):
    engine = _engine(group, zero_stage=3, passes=("prefetch",), on_nonfinite="skip")
    for step in range(6):
        if step == 3:
            before = engine.full_state_dict()
        out.setdefault("stepped", []).append(_step(engine, step, rank, nan=step == 3 and rank == 1))
        out.setdefault("norms", []).append(engine.metrics()["grad_norm"])
        if step == 3:
            after = engine.full_state_dict()
            out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        if step == 4:
            out["moved_after"] = any(not torch.equal(after[k], v)
                                     for k, v in engine.full_state_dict().items())
    out["skipped"] = engine.nonfinite_skipped
    out["phase"] = engine._pipeline.phase.value


def nan_raise(rank, group, out):
    from deepcompile.runtime.guardrails import NonFiniteError

    engine = _engine(group, zero_stage=1)   # the default: on_nonfinite="raise"
    for step in range(6):
        if step == 3:
            before = engine.full_state_dict()
            try:
                _step(engine, step, rank, nan=rank == 1)
            except NonFiniteError as e:
                out["error"] = str(e)
            out["norm"] = float(engine.grad_norm())
            out["unchanged"] = all(torch.equal(before[k], v)
                                   for k, v in engine.full_state_dict().items())
        elif step == 4:   # the loop's misuses, on every rank: refused, and the engine goes on
            from deepcompile.runtime.guardrails import UsageError

            usage = out.setdefault("usage", [])
            try:
                engine.step()
            except UsageError as e:
                usage.append(str(e))
            x, y = _data(step, 0, rank)
            loss = engine(x, y)
            engine.backward(loss)
            try:
                engine.backward(loss)
            except UsageError as e:
                usage.append(str(e))
            out["stepped_after_misuse"] = engine.step()
        else:
            _step(engine, step, rank)   # and the engine goes on
    out["steps"] = engine._optimizer_steps


SCENARIOS = {f.__name__: f for f in (raise_forward, raise_backward, extra_micro_gas2,
                                     extra_micro_gas1, step_without_backward, pass_plan,
                                     silent_divergence, new_graph_one_rank, nan_skip, nan_raise,
                                     )}


def _run(name: str, rank: int, group) -> dict:
    out: dict = {}
    FAULT.clear()
    torch._dynamo.reset()
    try:
        SCENARIOS[name](rank, group, out)
    except BaseException as e:  # noqa: BLE001 -- the outcome under test
        out["type"] = type(e).__name__
        out["message"] = "\n".join([str(e), *getattr(e, "__notes__", [])])
    out["elapsed"] = time.monotonic() - out.get("t0", time.monotonic())
    torch._dynamo.reset()
    return out


def _pairs_job(rank, world, rounds):
    """Each round: pair p (ranks 2p, 2p+1) runs rounds[i][p] on its own group; then every rank
    meets on the default group (which no fault touches)."""
    import torch.distributed as dist

    pair, r = divmod(rank, 2)
    results = {}
    for names in rounds:
        groups = [dist.new_group([2 * p, 2 * p + 1]) for p in range(world // 2)]
        results[names[pair]] = _run(names[pair], r, groups[pair])
        dist.barrier()
    return results


# a round lasts as long as its slower pair: the six scenarios a rank ends by waiting out the
# collective timeout in three rounds, the four that end at once in two
ROUNDS = [("raise_forward", "raise_backward"), ("extra_micro_gas2", "extra_micro_gas1"),
          ("step_without_backward", "new_graph_one_rank"), ("silent_divergence", "pass_plan"),
          ("nan_skip", "nan_raise")]


@pytest.fixture(scope="module")
def alive():
    t0 = time.monotonic()
    per_rank = run_distributed(_pairs_job, 4, ROUNDS, timeout=600)
    print(f"\n[faults] {len(ROUNDS) * 2} scenarios on 2 pairs in {time.monotonic() - t0:.1f}s")
    return {name: [per_rank[2 * p][name], per_rank[2 * p + 1][name]]
            for names in ROUNDS for p, name in enumerate(names)}


def _show(name, outs):
    for r, o in enumerate(outs):
        assert o.get("steady", True), f"{name}: rank {r}'s fault came before the steady state"
        print(f"\n--- {name} rank {r} ({o.get('type')}, {o['elapsed']:.1f}s):\n{o.get('message')}")


def test_a_rank_that_raises_in_its_forward_stops_every_rank(alive):
    r0, r1 = alive["raise_forward"]
    _show("raise_forward", (r0, r1))
    assert r1["phase"] == "steady"
    assert r1["type"] == "ValueError" and "deepcompile: raised on rank 1 at step 5" in r1["message"]
    assert r1["next_call"].startswith("EngineStoppedError: deepcompile: this engine stopped")
    assert r0["type"] == "DistributedError"
    assert "rank 0 stopped at step 5 (micro-step 0, " in r0["message"] and "graph g1." in r0["message"]
    assert "rank 1: raised ValueError: injected fault at step 5 (micro-step 0, forward" in r0["message"]
    assert T <= r0["elapsed"] < BOUND and r1["elapsed"] < BOUND


def test_a_rank_that_raises_in_its_backward_stops_every_rank(alive):
    r0, r1 = alive["raise_backward"]
    _show("raise_backward", (r0, r1))
    assert r1["type"] == "ValueError" and "step 5 (micro-step 0, backward" in r1["message"]
    assert r0["type"] == "DistributedError"
    assert "rank 0 stopped at step 5 (micro-step " in r0["message"]
    assert "rank 1: raised ValueError: injected fault at step 5 (micro-step 0, backward" in r0["message"]
    assert T <= r0["elapsed"] < BOUND


def test_one_more_micro_step_on_one_rank_within_a_window(alive):
    r0, r1 = alive["extra_micro_gas2"]
    _show("extra_micro_gas2", (r0, r1))
    assert r1["type"] == "UsageError" and "micro-step 3 of an accumulation window of 2" in r1["message"]
    assert r0["type"] == "DistributedError"
    assert "rank 0 ended step 3 (micro-step 2, step) after 2 micro-steps" in r0["message"]
    assert "rank 1: UsageError: deepcompile: a training forward for micro-step 3" in r0["message"]
    assert T <= r0["elapsed"] < BOUND


def test_one_more_micro_step_on_one_rank_without_accumulation(alive):
    """gas 1 and more micro-steps than that before step() is how the HF Trainer accumulates:
    legal on one rank, caught at the step check when the ranks differ."""
    r0, r1 = alive["extra_micro_gas1"]
    _show("extra_micro_gas1", (r0, r1))
    assert r0["type"] == r1["type"] == "DistributedError"
    assert "rank 0 ended step 5 (micro-step 1, step) after 1 micro-steps" in r0["message"]
    assert "rank 1: a collective failed at step 5 (micro-step 1, backward, graph g" in r0["message"]
    assert "rank 1 stopped at step 5 (micro-step 1, backward, graph g" in r1["message"]
    assert "rank 0: at the end of step 5" in r1["message"]
    assert T <= r0["elapsed"] < BOUND and T <= r1["elapsed"] < BOUND


def test_step_without_backward_on_one_rank(alive):
    r0, r1 = alive["step_without_backward"]
    _show("step_without_backward", (r0, r1))
    assert r1["type"] == "UsageError" and "engine.step() without engine.backward()" in r1["message"]
    assert r0["type"] == "DistributedError"
    assert "rank 1: UsageError: deepcompile: engine.step() without engine.backward()" in r0["message"]
    assert T <= r0["elapsed"] < BOUND


def test_a_pass_that_plans_differently_per_rank(alive):
    r0, r1 = alive["pass_plan"]
    _show("pass_plan", (r0, r1))
    for r in (r0, r1):
        assert r["type"] == "DivergenceError"
        assert "pass 'test_rank_dependent' planned differently on different ranks" in r["message"]
        assert "[[0], [1]]" in r["message"]
        assert r["elapsed"] < BOUND   # no timeout: every rank finds it at once


def test_silent_divergence_is_caught_by_the_step_check(alive):
    """The ranks run graphs of the same collective sizes over other parameters: nothing fails,
    and the gathered parameters are wrong; the fingerprint check stops both ranks."""
    r0, r1 = alive["silent_divergence"]
    _show("silent_divergence", (r0, r1))
    assert r0["type"] == r1["type"] == "DivergenceError"
    assert r0["message"] == r1["message"]
    msg = r0["message"]
    assert "ran different collectives in optimizer step 3" in msg
    assert "first difference at graph call 1 of the step" in msg
    assert "allgather_param(a.weight)" in msg and "allgather_param(b.weight)" in msg
    assert r0["elapsed"] < T   # no timeout: both ranks reach the check


def test_a_graph_compiled_on_one_rank_only(alive):
    r0, r1 = alive["new_graph_one_rank"]
    _show("new_graph_one_rank", (r0, r1))
    assert r1["type"] == r0["type"] == "DistributedError"
    assert "rank 1 compiled a new graph g2.fw at step 3" in r1["message"]
    assert "ranks [0] did not compile it" in r1["message"]
    assert "rank 1: at step 3 (micro-step 0, compile, graph g2.fw): waits at the agreement" in r0["message"]
    assert T <= r0["elapsed"] < BOUND and T <= r1["elapsed"] < BOUND


def test_nonfinite_skip_skips_the_step_on_every_rank(alive):
    for r in alive["nan_skip"]:
        assert "type" not in r, r
        assert r["stepped"] == [True] * 6 and r["skipped"] == 1
        assert r["unchanged"] and r["moved_after"] and r["phase"] == "steady"
        # the step's gradient norm: NaN where a gradient was, on every rank; finite elsewhere
        norms = r["norms"]
        assert math.isnan(norms[3]) and all(math.isfinite(n) and n > 0 for n in norms[:3] + norms[4:])
    assert alive["nan_skip"][0]["norms"][:3] == alive["nan_skip"][1]["norms"][:3]


def test_nonfinite_raise_raises_on_every_rank(alive):
    for r in alive["nan_raise"]:
        assert "type" not in r, r
        assert "inf/NaN at optimizer step 3 (loss on rank(s) [1], gradients on rank(s)" in r["error"]
        assert math.isnan(r["norm"])
        assert r["unchanged"] and r["steps"] == 6
        assert len(r["usage"]) == 2 and r["stepped_after_misuse"]
        assert "engine.step() without engine.backward()" in r["usage"][0]
        assert "engine.backward() without a training forward" in r["usage"][1]


# ----------------------------------------------------------------- a rank is killed
def _killed(rank, group, out, where, stage, passes):
    engine = _engine(group, zero_stage=stage, passes=passes)
    if where == "step":
        engine.optimizer.register_step_pre_hook(lambda *a: FAULT.pop("step", lambda: None)())
    for step in range(7):
        if step == 5:
            out["t0"] = time.monotonic()
            if rank == 1:
                FAULT[where] = _kill
        _step(engine, step, rank)


def _kill_job(rank, world, cases, done_dir):
    """Pair p runs cases[p]: (where its second rank is killed, ZeRO stage, passes). The store
    lives with rank 0's process, and a survivor reads the other ranks' reports from it: rank 0
    returns only once every pair's survivor has written its file in `done_dir` (or after 120 s),
    so that no pair's survivor finds the store gone because another pair finished first."""
    import torch.distributed as dist

    pair, r = divmod(rank, 2)
    groups = [dist.new_group([2 * p, 2 * p + 1]) for p in range(world // 2)]
    out: dict = {}
    FAULT.clear()
    try:
        _killed(r, groups[pair], out, *cases[pair])
    except BaseException as e:  # noqa: BLE001
        out["type"], out["message"] = type(e).__name__, str(e)
    out["elapsed"] = time.monotonic() - out.get("t0", time.monotonic())
    os.close(os.open(os.path.join(done_dir, f"survivor-{pair}"), os.O_CREAT | os.O_WRONLY))
    if rank == 0:
        deadline = time.monotonic() + 120
        while (time.monotonic() < deadline and
               len(os.listdir(done_dir)) < world // 2):
            time.sleep(0.05)
    return out


def test_a_rank_killed_in_its_forward_or_its_optimizer_step(tmp_path):
    cases = [("forward", 3, ("prefetch", "bucket_reduce")), ("step", 1, ("bucket_reduce",))]
    res = run_distributed(_kill_job, 4, cases, str(tmp_path), timeout=300, failures_ok=True,
                          grace=60)
    for p, (where, stage, _passes) in enumerate(cases):
        survivor, killed = res[2 * p], res[2 * p + 1]
        print(f"\n--- killed in {where} (ZeRO-{stage}), survivor ({survivor.get('elapsed', 0):.1f}s):"
              f"\n{survivor.get('message')}")
        assert isinstance(killed, DistributedTestError) and "exited with code" in str(killed)
        assert survivor["type"] == "DistributedError"
        # killed in its forward, the rank may already have sent what the survivor's forward
        # needs (prefetched gathers): the survivor then fails in its backward
        phases = {"forward": (", forward", ", backward"), "step": (", step",)}[where]
        assert "rank 0 stopped at step 5 (micro-step" in survivor["message"]
        assert any(p in survivor["message"] for p in phases)
        assert "rank 1: nothing reported within" in survivor["message"]
        assert "it exited (killed or crashed)" in survivor["message"]
        assert survivor["elapsed"] < BOUND


def test_rank_0_killed_in_its_backward_takes_the_store_with_it():
    res = run_distributed(_kill_job_rank0, 2, timeout=300, failures_ok=True, grace=60)
    killed, survivor = res
    print(f"\n--- rank 0 killed in backward, survivor ({survivor.get('elapsed', 0):.1f}s):"
          f"\n{survivor.get('message')}")
    assert isinstance(killed, DistributedTestError)
    assert survivor["type"] == "DistributedError"
    assert "rank 1 stopped at step 5 (micro-step 0, backward" in survivor["message"]
    assert "the store lives with rank 0's process, which probably exited" in survivor["message"]
    assert survivor["elapsed"] < BOUND


def _kill_job_rank0(rank, world):
    out: dict = {}
    FAULT.clear()
    try:
        engine = _engine(None, zero_stage=2)
        for step in range(7):
            if step == 5:
                out["t0"] = time.monotonic()
                if rank == 0:
                    FAULT["backward"] = _kill
            _step(engine, step, rank)
    except BaseException as e:  # noqa: BLE001
        out["type"], out["message"] = type(e).__name__, str(e)
    out["elapsed"] = time.monotonic() - out.get("t0", time.monotonic())
    return out


# ------------------------------------------------- a timeout the user gave the process group
USER_TIMEOUT = 3.0   # init_process_group(timeout=...) in this job; Config's left at its defaults


def _user_timeout_job(rank, world):
    """Rank 1 stops calling collectives in the steady state: rank 0 stops within the user's
    timeout (the job's own timeout, 120 s, is far below Config's 600 s)."""
    from datetime import timedelta

    import torch.distributed as dist
    from deepcompile import Config, _compat
    from deepcompile.engine import Engine

    def engine(group=None):
        return Engine(Faulty(), functools.partial(torch.optim.SGD, lr=0.05),
                      Config(compiler="fx", warmup_steps=1, passes=(), measure_steps=0), group)

    out: dict = {"default_group": engine(dist.new_group())._rails.timeout_s}  # torch's default
    e = engine()
    out["startup"] = e._rails.timeout_s
    step = 0
    while not e._rails.steady and step < 8:
        _step(e, step, rank)
        step += 1
    out["steady"] = e._rails.timeout_s if e._rails.steady else None
    store = _compat.default_store()
    if rank == 1:   # no more collectives until rank 0 has given up
        store.wait(["user-timeout/done"], timedelta(seconds=100))
        return out
    try:
        _step(e, step, rank)
    except Exception as exc:  # noqa: BLE001
        out["type"], out["message"] = type(exc).__name__, str(exc)
    finally:
        store.set("user-timeout/done", "1")
    return out


def test_a_shorter_timeout_the_user_gave_the_process_group_is_kept():
    """[Note: the user's timeout] in runtime/guardrails.py."""
    r0, r1 = run_distributed(_user_timeout_job, 2, timeout=120, pg_timeout=USER_TIMEOUT)
    print(f"\n--- rank 1 stopped calling collectives; rank 0:\n{r0.get('message')}")
    for r in (r0, r1):
        # Config's 1800 s and 600 s; torch's default timeout is no timeout the user gave
        assert r["default_group"] == 1800.0
        assert r["startup"] == r["steady"] == USER_TIMEOUT
    assert r0["type"] == "DistributedError"
    assert "rank 1: nothing reported within 3 s" in r0["message"]
    assert f"A rank waits at most {USER_TIMEOUT:g} s for the others" in r0["message"]
