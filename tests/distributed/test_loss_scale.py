"""float16 with dynamic loss scaling (src/deepcompile/runtime/loss_scale.py), on 2 ranks at
ZeRO-3 and ZeRO-1: an overflowing step is skipped on every rank and leaves no trace (the run
that skipped steps is bitwise the run that started at the scale they settled on), the scale
halves on overflow and doubles after `loss_scale_window` good steps, the same on every rank."""

from __future__ import annotations

import functools

import pytest
import torch

import _models
from _dist import run_distributed

MODEL = "mlp"


def _run(rank, world, stage, first_batch, steps, **config):
    import deepcompile

    torch._dynamo.reset()
    model = _models.build_model(MODEL)
    engine = deepcompile.initialize(
        model, functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
        deepcompile.Config(compiler="fx", zero_stage=stage, param_dtype=torch.float16,
                           passes=(), profile_steps=0, **config))
    initial = engine.full_state_dict()
    out = {"scales": [], "skipped": [], "losses": [], "unchanged": []}
    for i in range(steps):
        batch = _models.local_batch(MODEL, first_batch + i, rank, world)
        batch = {k: v.half() for k, v in batch.items()}
        out["scales"].append(engine._scaler.scale)
        skipped = engine._scaler.skipped_steps
        loss = engine(**batch)
        engine.backward(loss)
        assert engine.step()
        out["skipped"].append(engine._scaler.skipped_steps > skipped)
        out["losses"].append(loss.float().item())
        state = engine.full_state_dict()
        out["unchanged"].append(all(torch.equal(state[k], initial[k]) for k in state))
        out["opt_state"] = len(engine.optimizer.state)
    out["final"] = engine.full_state_dict()
    out["final_scale"] = engine._scaler.scale
    out["dtype"] = str(engine._registry.entries[0].shard.dtype)
    return out


def _job(rank, world, stage):
    skipping = _run(rank, world, stage, 0, 10, initial_loss_scale=2.0 ** 22)
    first_good = skipping["skipped"].index(False)
    settled = skipping["scales"][first_good]
    static = _run(rank, world, stage, first_good, 10 - first_good, loss_scale=settled)
    growing = _run(rank, world, stage, 0, 5, initial_loss_scale=256.0, loss_scale_window=2)
    return {"skipping": skipping, "static": static, "growing": growing, "first_good": first_good}


@pytest.mark.parametrize("stage", [3, 1])
def test_dynamic_loss_scaling(stage):
    per_rank = run_distributed(_job, 2, stage, timeout=600)
    r0 = per_rank[0]
    for r in per_rank[1:]:   # every rank took the same decisions
        for key in ("skipping", "growing"):
            assert r[key]["scales"] == r0[key]["scales"] and r[key]["skipped"] == r0[key]["skipped"]
    sk, st, first = r0["skipping"], r0["static"], r0["first_good"]
    print(f"\n[loss scale zero{stage}] scales {sk['scales']} skipped {sk['skipped']}")
    assert r0["skipping"]["dtype"] == "torch.float32"   # fp32 masters
    assert first >= 3                              # 2**22 overflows float16
    assert sk["skipped"] == [True] * first + [False] * (10 - first)
    assert sk["unchanged"][:first] == [True] * first and not sk["unchanged"][first]
    assert sk["scales"][:first + 1] == [2.0 ** (22 - i) for i in range(first + 1)]
    assert all(torch.isfinite(torch.tensor(sk["losses"][first:])))
    # the skipped steps left nothing behind: bitwise the run that started at the settled scale
    assert sk["losses"][first:] == st["losses"]
    assert all(torch.equal(sk["final"][k], st["final"][k]) for k in st["final"])
    assert not any(st["skipped"]) and st["final_scale"] == sk["scales"][first]
    gr = r0["growing"]
    assert gr["skipped"] == [False] * 5
    assert gr["scales"] == [256.0, 256.0, 512.0, 512.0, 1024.0] and gr["final_scale"] == 1024.0


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("flat", [False, True])
def test_the_check_without_a_loss_scale_reads_the_gradients_and_writes_none(bad, flat):
    """Without a loss scale the inf/NaN check only reads the gradients (on a GPU, a pass that
    writes them back costs as much again); it finds an inf or NaN anywhere, in either dtype."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from deepcompile.runtime.loss_scale import GradCheck

    shards = [torch.zeros(5, requires_grad=True), torch.zeros(3, dtype=torch.bfloat16,
                                                                requires_grad=True)]
    for i, s in enumerate(shards):
        s.grad = torch.arange(s.numel(), dtype=s.dtype) - 2.0 * i
    if bad is not None:
        shards[1].grad[1] = bad
    grads = [s.grad for s in shards]
    before = [(g._version, g.clone()) for g in grads]
    check = GradCheck(shards, torch.device("cpu"))

    class Writes(TorchDispatchMode):   # ops that write an argument, other than the flag's
        seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.is_mutable and args and args[0] is not check.found:
                self.seen.append(func)
            return func(*args, **(kwargs or {}))

    with Writes():
        found = check(None, grads if flat else None)
    assert Writes.seen == []
    assert found.item() == (0.0 if bad is None else 1.0)
    for g, (version, value) in zip(grads, before):
        assert g._version == version
        torch.testing.assert_close(g, value, rtol=0, atol=0, equal_nan=True)
    # under a loss scale, the kernel that unscales in place
    found = check(torch.tensor(0.5), grads if flat else None)
    assert found.item() == (0.0 if bad is None else 1.0)
    assert grads[0][1].item() == 0.5


class _PerParameterAdamW(torch.optim.AdamW):
    """Not one of torch.optim's own classes: the engine steps it parameter by parameter."""


# each step (flat, per parameter) and each policy once; the other two pairs are the full
# suite's ([Note: the core matrix] in tests/_train.py)
@pytest.mark.parametrize("policy, flat", [
    pytest.param("raise", True, id="raise-flat"),
    pytest.param("raise", False, id="raise-per-parameter", marks=pytest.mark.extended),
    pytest.param("skip", True, id="skip-flat", marks=pytest.mark.extended),
    pytest.param("skip", False, id="skip-per-parameter")])
def test_with_clipping_one_read_serves_the_check_and_the_clip(group, monkeypatch, policy, flat):
    """With clipping and no loss scale, the step computes the gradients' 2-norms once (the
    flat step, and an optimizer stepped parameter by parameter alike): the inf/NaN check
    reads them (a 2-norm is inf/NaN when an element is) and the clip uses them — one pass
    over the gradients per step (on a GPU, gigabytes) where there were two. Training is
    bitwise the engine's with the check off; an inf is still found ("raise" names the rank,
    "skip" leaves the weights as they were)."""
    import deepcompile
    from deepcompile.runtime.guardrails import NonFiniteError

    def engine(on_nonfinite):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4))
        opt = torch.optim.AdamW if flat else _PerParameterAdamW
        return deepcompile.initialize(
            model, optimizer=functools.partial(opt, lr=0.01),
            config={"compiler": "fx", "passes": (), "max_grad_norm": 0.05,
                    "on_nonfinite": on_nonfinite})

    def step(e, i):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        e.backward(e(x).square().mean())
        return e.step()

    def weights(e):
        return {k: v.clone() for k, v in e.full_state_dict().items()}

    checked, plain = engine(policy), engine("off")
    assert (checked._flat.inner is not None) == flat
    for i in range(3):
        step(checked, i)
        step(plain, i)
    calls = []
    norm = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(a[1]) or norm(*a, **k))
    step(checked, 3)
    assert calls == [2.0], calls            # before: an inf-norm for the check, then the 2-norm
    monkeypatch.undo()
    step(plain, 3)
    a, b = weights(checked), weights(plain)
    assert all(torch.equal(a[k], b[k]) for k in a)

    before = weights(checked)
    hook = checked._flat.chunks[0].shards[0].register_hook(lambda g: g * float("inf"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    checked.backward(checked(x).square().mean())
    hook.remove()
    if policy == "raise":
        with pytest.raises(NonFiniteError, match=r"gradients on rank\(s\) \[0\]"):
            checked.step()
    else:
        assert checked.step() and checked.nonfinite_skipped == 1
    assert all(torch.equal(before[k], v) for k, v in weights(checked).items())


def test_a_float16_gradient_past_float16s_range_is_finite():
    """The check's 2-norms are accumulated and returned in float32 ([Note: the check reads
    2-norms]): a float16 gradient whose 2-norm is past 65504 (each element well inside float16's
    range) is finite, and an inf or NaN in it is still found."""
    from deepcompile.runtime.loss_scale import GradCheck

    shard = torch.zeros(100, dtype=torch.float16, requires_grad=True)
    shard.grad = torch.full((100,), 1e4, dtype=torch.float16)   # 2-norm 1e5
    check = GradCheck([shard], torch.device("cpu"))
    assert check(None).item() == 0.0
    assert check(None, [shard.grad]).item() == 0.0
    for bad in (float("inf"), float("nan")):
        shard.grad[7] = bad
        assert check(None).item() == 1.0
        assert check(None, [shard.grad]).item() == 1.0


@pytest.mark.timing
def test_the_check_costs_about_one_read_of_the_gradients():
    """Without a loss scale the check is one read of the gradients. On the CPU torch's
    inf-norm kernel (the check's before) took ~18x a copy of the same flat gradient (10.4 ms
    against 0.57 ms at 3.95 M float32, one thread): 7% of small-llama's step at world size 1.
    A ratio against a copy in the same process, best of several, so the machine's speed and
    load cancel out."""
    import time

    from deepcompile.runtime.loss_scale import GradCheck

    shard = torch.zeros(4_000_000, requires_grad=True)
    shard.grad = torch.randn(4_000_000, generator=torch.Generator().manual_seed(0))
    check = GradCheck([shard], torch.device("cpu"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def best(f):
            f()
            times = []
            for _ in range(7):
                t = time.perf_counter()
                f()
                times.append(time.perf_counter() - t)
            return min(times)

        copy = best(shard.grad.clone)
        checked = best(lambda: check(None, [shard.grad]))
    finally:
        torch.set_num_threads(threads)
    assert checked < 3 * copy, (checked, copy)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_a_step_at_world_size_1_runs_no_collective(group, clip):
    """At world size 1 nothing needs agreeing: the inf/NaN verdict and the clip's global norm
    launch no collective (on NCCL each would still be a kernel launch; the bench counted one
    all-reduce per step at world size 1). The check still works: an inf raises."""
    import deepcompile
    from deepcompile.runtime.guardrails import NonFiniteError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    engine = deepcompile.initialize(
        model, optimizer=functools.partial(torch.optim.AdamW, lr=0.01),
        config={"compiler": "fx", "passes": (), "max_grad_norm": clip})

    def step(i):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        engine.backward(engine(x).square().mean())
        return engine.step()

    for i in range(3):
        step(i)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(3)
    collectives = sorted({e.name for e in prof.events()
                          if e.name.startswith(("c10d::", "gloo:", "_c10d_functional::"))})
    assert collectives == [], collectives
    hook = engine._flat.chunks[0].shards[0].register_hook(lambda g: g * float("inf"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(4))
    engine.backward(engine(x).square().mean())
    hook.remove()
    with pytest.raises(NonFiniteError, match=r"gradients on rank\(s\) \[0\]"):
        engine.step()
