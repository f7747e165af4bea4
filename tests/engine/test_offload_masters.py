"""Masters on the host (offload tier 3, [Note: masters on the host] in runtime/offload/masters.py),
in-process at world size 1, bf16 compute under fp32 masters (a 2-rank run is in
tests/distributed/test_offload.py):

* the runtime alone (tiers set by hand): between steps every master's storage is released and
  the device holds its bf16 copy; the graphs read the copies (fx and Inductor) and training is
  bitwise the same as with the masters on the device, with gradient accumulation and clipping;
* what reads or writes the masters outside the graphs brings them back for the time it needs:
  `full_state_dict`, a checkpoint saved and loaded (the copies are made again from the loaded
  masters), the eager implementation of a gather;
* planned by the pass under a budget that all state and all gradients off the device do not
  meet: masters of chunks on the host, the measured peak within the budget, training bitwise
  the same;
* a chunk whose master cannot save anything (fp32 compute) is refused tier 3.
"""

from __future__ import annotations

import functools

import pytest
import torch

from _train import assert_peaks_within, chunk_bytes, tanh_stack

CHUNK = 256
ADAMW = functools.partial(torch.optim.AdamW, lr=0.01)


_model = tanh_stack


def _engine(**config):
    import deepcompile

    config = {"compiler": "fx", "passes": (), "param_dtype": "bfloat16", **config}
    with chunk_bytes(CHUNK):
        return deepcompile.initialize(_model(), optimizer=ADAMW, config=config)


def _train(engine, steps, gas=1, start=0):
    losses = []
    for step in range(start, start + steps):
        for micro in range(gas):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + micro))
            loss = engine(x.bfloat16()).float().square().mean()
            engine.backward(loss)
            losses.append(loss.item())
        engine.step()
    return losses


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def _all_masters_to_host(engine, tier: int = 3) -> None:
    engine._offload.set_plan({c.index: tier for c in engine._flat.chunks})


def _same(a: dict, b: dict) -> list[str]:
    return [k for k in b if not torch.equal(a[k], b[k])]


def _train_params():
    """(compiler, gas, clip, tier) with the ids pytest gave the two stacked parametrizations.
    The default run ([Note: the core matrix] in tests/_train.py) has the host step (tier 4)
    with fx and clipping; the masters streamed (tier 3) train bitwise as on the device, planned
    by the pass, in test_the_pass_keeps_masters_on_the_host_within_the_budget[never], and
    Inductor's graphs at world size 1 run offloading's ops in
    tests/engine/test_offload_grads.py's Inductor test. The other cells (tier 3 with Inductor:
    the graphs that read the copies are the same at both tiers; accumulation 1 beside 2; each
    tier with the other compiler) are the full suite's."""
    default = {("fx", 2, 0.05, 4)}
    out = []
    for compiler, gas, clip in (("fx", 1, None), ("fx", 2, 0.05), ("inductor", 2, None)):
        for tier, tier_id in ((3, "streamed"), (4, "host-step")):
            marks = [pytest.mark.inductor] if compiler == "inductor" else []
            if (compiler, gas, clip, tier) not in default:
                marks.append(pytest.mark.extended)
            out.append(pytest.param(compiler, gas, clip, tier, marks=marks,
                                    id=f"{compiler}-{gas}-{clip}-{tier_id}"))
    return out


@pytest.mark.parametrize("compiler, gas, clip, tier", _train_params())
def test_masters_on_the_host_train_as_on_the_device(group, compiler, gas, clip, tier):
    """Tier 3 streams each master through the device's step; tier 4 steps it on the host
    ([Note: the host step]): on the CPU both run the same kernels, bitwise."""
    plain = _engine(compiler=compiler, gradient_accumulation_steps=gas, max_grad_norm=clip)
    want = _train(plain, 4, gas)
    engine = _engine(compiler=compiler, gradient_accumulation_steps=gas, max_grad_norm=clip)
    _all_masters_to_host(engine, tier)
    got = _train(engine, 4, gas)
    assert got == want
    store = engine._offload
    chunks = engine._flat.chunks
    # between steps: no master on the device, a bf16 copy of each; the gathers read the copies
    assert all(c.param.untyped_storage().nbytes() == 0 for c in chunks)
    for c in chunks:
        for e, shard in zip(c.entries, c.shards):
            assert e.lowp is not None and e.lowp.dtype == torch.bfloat16
            assert e.lowp.numel() == shard.numel()
    masters = sum(c.nbytes for c in chunks)
    last = store.last_step
    if tier == 3:
        assert last["master_h2d_bytes"] == last["master_d2h_bytes"] == masters
        assert last["stepped_on_host"] == last["lowp_h2d_bytes"] == 0
    else:   # only the bf16 copies go up; nothing else crosses at the step
        assert last["master_h2d_bytes"] == last["master_d2h_bytes"] == 0
        assert last["h2d_bytes"] == last["d2h_bytes"] == last["grad_h2d_bytes"] == 0
        assert last["streamed_at_step"] == 0 and last["stepped_on_host"] == len(chunks)
        assert last["lowp_h2d_bytes"] == masters // 2
        assert store.summary()["measured_host_step_s"] > 0
    assert store.summary()["offloaded_master_bytes"] == masters // 2   # fp32 less bf16
    # the facade's per-parameter state counts the host's steps
    steps = {int(st["step"]) for st in engine.optimizer.state_dict()["state"].values()}
    assert steps == {4}
    _close(engine, plain, clip)
    # and back on the device: the graphs read the shards again
    store.set_plan({})
    assert all(e.lowp is None for c in chunks for e in c.entries)
    _train(engine, 2, gas, start=4)
    _train(plain, 2, gas, start=4)
    _close(engine, plain, clip)


def _close(engine, plain, clip) -> None:
    got, want = _weights(engine), _weights(plain)
    for k in want:   # clipping scales host gradients as they come back: within a rounding
        assert (torch.equal(got[k], want[k]) if clip is None
                else torch.allclose(got[k], want[k], rtol=0, atol=1e-6)), k


# the host step (tier 4) in the full suite: its masters are at home on the host as tier 3's
# are, read and written through the same slot
@pytest.mark.parametrize("tier", [pytest.param(3, id="streamed"),
                                  pytest.param(4, id="host-step", marks=pytest.mark.extended)])
def test_the_masters_are_read_and_written_outside_the_graphs_through_their_home(group, tmp_path,
                                                                              tier):
    """A checkpoint of an engine with its masters on the host holds the masters' values; loaded
    into it after more training, the masters are the saved ones again and the device copies
    the gathers read are made from them (the next step's loss is the saved run's)."""
    from deepcompile.runtime import ops

    plain = _engine()
    _train(plain, 3)
    engine = _engine()
    _all_masters_to_host(engine, tier)
    _train(engine, 3)
    assert not _same(_weights(engine), _weights(plain))
    assert all(c.param.untyped_storage().nbytes() == 0 for c in engine._flat.chunks)
    # the eager gather (ops' reference implementation, the eager fallback) reads the copy
    e = engine._flat.chunks[0].entries[0]
    full = ops.allgather_param(e.shard, e.pid, list(e.shape), torch.bfloat16)
    assert torch.equal(full, plain.full_state_dict()[e.name].to(torch.bfloat16))
    engine.save_checkpoint(tmp_path / "ckpt")
    assert all(c.param.untyped_storage().nbytes() == 0 for c in engine._flat.chunks)
    after_save = _train(engine, 2, start=3)
    engine.load_checkpoint(tmp_path / "ckpt")
    assert not _same(_weights(engine), _weights(plain))
    assert all(c.param.untyped_storage().nbytes() == 0 for c in engine._flat.chunks)
    assert _train(engine, 2, start=3) == after_save == _train(plain, 2, start=3)


def test_a_chunk_whose_master_saves_nothing_is_refused(group):
    from deepcompile.runtime import offload

    engine = _engine(param_dtype=None)   # fp32 compute: the copy would be the master's size
    assert engine._offload.master_saving(engine._offload.slots[0]) == 0
    with pytest.raises(ValueError, match="cannot keep its master on the host"):
        engine._offload.set_plan({0: offload.MASTERS})


def _decisions(engine) -> dict:
    rep = engine.report().to_dict()
    return next(p for p in rep["passes"] if p["pass"] == "offload_optimizer")["decisions"]


# "always" in the full suite: on the CPU it plans what "auto" does (the host step); the
# planner's "always" is tested on its own in tests/distributed/test_offload.py
@pytest.mark.parametrize("mode", ["never", "auto", pytest.param("always", marks=pytest.mark.extended)])
def test_the_pass_keeps_masters_on_the_host_within_the_budget(group, monkeypatch, mode):
    """Planned under the lowest peak the pass can reach: masters on the host, streamed through
    the step (Config.host_step="never") or stepped on the host (auto: on the CPU a host
    step is the device's step without the copies, so it is never slower; always)."""
    from deepcompile.runtime import offload

    plain = _engine(gradient_accumulation_steps=2)
    _train(plain, 5, gas=2)
    probe = _engine(gradient_accumulation_steps=2, passes=("offload_optimizer",), warmup_steps=1,
                    host_step=mode)
    _train(probe, 3, gas=2)
    d = _decisions(probe)
    # all state, all gradients and every master that may go off the device: below what the
    # state and gradients alone reach
    budget = d["lowest_peak_bytes"]
    assert budget < d["lowest_grads_peak_bytes"]
    engine = _engine(gradient_accumulation_steps=2, passes=("offload_optimizer",),
                     warmup_steps=1, memory_budget=budget, measure_steps=0, host_step=mode)
    _train(engine, 5, gas=2)
    d = _decisions(engine)
    want = offload.MASTERS if mode == "never" else offload.HOST
    taken = [c for c in d["chunks"] if c["tier"] >= offload.MASTERS]
    assert taken and all(c["tier"] == want for c in taken), d["chunks"]
    assert not d["unattainable"] and d["peak_after"] <= budget, d
    assert d["offloaded_master_bytes"] == sum(c["master_bytes"] for c in taken) > 0
    host = d["host_step"]
    assert host["mode"] == mode and host["chosen"] == (mode != "never"), host
    if mode != "never":
        assert host["predicted_host_s"] <= host["predicted_streamed_s"], host
        assert engine._offload.last_step["stepped_on_host"] == len(taken)
    rep = engine.report().to_dict()
    assert_peaks_within(rep, budget)   # measured with the plan
    assert rep["offload"]["offloaded_master_bytes"] == d["offloaded_master_bytes"]
    text = str(engine.report())
    assert "masters of" in text and "masters on the host:" in text, text
    assert ("they step on the host" in text) == (mode != "never"), text
    assert ("stepped on the host:" in text) == (mode != "never"), text
    assert not _same(_weights(engine), _weights(plain))


def test_an_unknown_host_step_mode_is_refused():
    import deepcompile

    with pytest.raises(ValueError, match="Config.host_step: 'sometimes' is not allowed; allowed: "
                                         "'auto', 'always', 'never'"):
        deepcompile.Config(host_step="sometimes")


# the host step (tier 4) in the full suite: the eager gather reads the copy whatever the tier;
# the default run gathers eagerly in `disabled` (a disabled submodule; `disabled_forward`'s
# disabled forward gathers through the same fallback), and a graph break's graphs read the
# copies as any graph does (test_masters_on_the_host_train_as_on_the_device)
@pytest.mark.parametrize("tier", [pytest.param(3, id="streamed"),
                                  pytest.param(4, id="host-step", marks=pytest.mark.extended)])
@pytest.mark.parametrize("name", ["disabled",
                                  pytest.param("disabled_forward", marks=pytest.mark.extended),
                                  pytest.param("graph_break", marks=pytest.mark.extended)])
def test_code_outside_the_graphs_gathers_from_the_copies(group, name, tier):
    """Submodules that run eagerly (`torch.compiler.disable`) gather their parameters outside
    the compiled graphs (runtime/eager.py): with the masters on the host they read the bf16
    copies, and training is bitwise the same; a graph break splits the graphs that read them."""
    import deepcompile
    from deepcompile.runtime import offload

    import _models

    def engine_of():
        with chunk_bytes(CHUNK):
            return deepcompile.initialize(
                _models.build_model(name), optimizer=ADAMW,
                config={"compiler": "fx", "passes": (), "param_dtype": torch.bfloat16})

    def train(engine):
        losses = []
        for step in range(4):
            batch = {k: v.bfloat16() if v.is_floating_point() else v
                     for k, v in _models.local_batch(name, step, 0, 1).items()}
            loss = _models.loss_of(engine(**batch))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    plain = engine_of()
    want = train(plain)
    engine = engine_of()
    _all_masters_to_host(engine, tier)
    assert train(engine) == want
    moved = "master_h2d_bytes" if tier == offload.MASTERS else "lowp_h2d_bytes"
    assert engine._offload.last_step[moved] > 0
    if name != "graph_break":
        assert engine._fallback.materializations > 0
    assert not _same(_weights(engine), _weights(plain))


# in the full suite: the default run brings the masters back to the device with the plan
# emptied (test_masters_on_the_host_train_as_on_the_device's last steps), and re-plans on a
# drift with host gradients (test_offload_grads.py's
# test_a_replan_profiles_the_graphs_without_the_previous_plans_gradient_ops)
@pytest.mark.extended
def test_a_replan_brings_the_masters_back_and_plans_them_again(group):
    """A re-plan in the steady state (the step drifted: Engine._replan_on_drift, here by hand)
    brings every master back to the device, profiles the graphs reading the shards, and plans
    the masters onto the host again; training stays bitwise the same."""
    from deepcompile.runtime import offload

    plain = _engine()
    _train(plain, 8)
    probe = _engine(passes=("offload_optimizer",), warmup_steps=1)
    _train(probe, 3)
    budget = _decisions(probe)["lowest_peak_bytes"]
    engine = _engine(passes=("offload_optimizer",), warmup_steps=1, memory_budget=budget,
                     measure_steps=0)
    pipe = engine._pipeline
    _train(engine, 4)
    assert pipe.phase.value == "steady"
    assert any(engine._offload.master_tier(s) for s in engine._offload.slots)
    engine._replan_on_drift("a test")
    chunks = engine._flat.chunks
    assert all(c.param.untyped_storage().nbytes() > 0 for c in chunks)
    assert all(e.lowp is None for c in chunks for e in c.entries)
    _train(engine, 4, start=4)
    entries = [e for e in pipe.pass_log if e["pass"] == "offload_optimizer"]
    assert len(entries) == 2 and all(e["kept"] for e in entries)
    # on the CPU the host step is never slower (Config.host_step="auto"): tier 4
    assert any(c["tier"] == offload.HOST for c in entries[-1]["decisions"]["chunks"])
    assert engine._offload.last_step["stepped_on_host"] > 0
    assert all(c.param.untyped_storage().nbytes() == 0 for c in chunks
               if engine._offload.master_tier(engine._offload.slots[c.index]))
    assert not _same(_weights(engine), _weights(plain))


# the masters streamed (tier 3) in the full suite: the default run skips the host step
# (tier 4), whose copies are written outside the device's step
@pytest.mark.parametrize("tier", [pytest.param(3, id="streamed", marks=pytest.mark.extended),
                                  pytest.param(4, id="host-step")])
def test_a_skipped_step_leaves_the_masters_and_their_copies_as_they_were(group, tier):
    """An inf gradient with on_nonfinite="skip": no step, so no master moves; the weights and
    the copies the gathers read are the step's before, and the next step trains from them
    (against an engine that never saw the bad micro-step: the same losses)."""
    plain = _engine(on_nonfinite="skip")
    _all_masters_to_host(plain, tier)
    _train(plain, 2)
    engine = _engine(on_nonfinite="skip")
    _all_masters_to_host(engine, tier)
    _train(engine, 2)
    before = _weights(engine)
    copies = [s.lowp.clone() for s in engine._offload.slots]
    shard = engine._flat.chunks[-1].shards[0]
    hook = shard.register_hook(lambda g: g * float("inf"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    engine.backward(engine(x.bfloat16()).float().square().mean())
    hook.remove()
    assert engine.step() and engine.nonfinite_skipped == 1
    assert not _same(_weights(engine), before)
    assert all(torch.equal(s.lowp, c) for s, c in zip(engine._offload.slots, copies))
    assert _train(engine, 2, start=2) == _train(plain, 2, start=2)


# the masters streamed (tier 3) in the full suite: their gradients stay on the device and are
# unscaled as without offloading; the default run unscales the host step's (tier 4)
@pytest.mark.parametrize("tier", [pytest.param(3, id="streamed", marks=pytest.mark.extended),
                                  pytest.param(4, id="host-step")])
def test_fp16_compute_with_a_dynamic_loss_scale(group, tier):
    """fp16 copies under fp32 masters, the loss scale dynamic (param_dtype float16's default):
    the host gradients are unscaled as the device's are, and training is bitwise the same as
    with the masters on the device."""
    plain = _engine(param_dtype="float16")
    assert plain._scaler is not None
    x = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(4)]

    def train(engine):
        out = []
        for xs in x:
            loss = engine(xs.half()).float().square().mean()
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    want = train(plain)
    engine = _engine(param_dtype="float16")
    _all_masters_to_host(engine, tier)
    assert train(engine) == want
    assert all(s.lowp.dtype == torch.float16 for s in engine._offload.slots)
    assert not _same(_weights(engine), _weights(plain))


def _decay_groups(params):
    params = list(params)
    return [{"params": params[0::2], "weight_decay": 0.1},
            {"params": params[1::2], "weight_decay": 0.0}]


HOST_OPTIMIZERS = {
    "adamw-groups": lambda ps: torch.optim.AdamW(_decay_groups(ps), lr=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}


# Adam with amsgrad and SGD with Nesterov momentum in the full suite: the host instance is made
# of the user's class as AdamW's is (the flat step's own SGD Nesterov: tests/engine/test_flat.py)
@pytest.mark.parametrize("name", [n if n == "adamw-groups" else
                                  pytest.param(n, marks=pytest.mark.extended)
                                  for n in HOST_OPTIMIZERS])
def test_the_host_step_keeps_the_optimizer_its_groups_and_its_schedule(group, name):
    """[Note: the host step] steps each chunk with a host instance of the user's optimizer
    class, its group's hyperparameters as the LR scheduler sets them each step: losses, weights
    and the per-parameter optimizer state (Adam's step count included) are bitwise those of the
    step on the device."""
    import deepcompile

    def run(tier):
        with chunk_bytes(CHUNK):
            engine = deepcompile.initialize(
                _model(), optimizer=HOST_OPTIMIZERS[name],
                config={"compiler": "fx", "passes": (), "param_dtype": "bfloat16"})
        if tier:
            _all_masters_to_host(engine, tier)
        sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=2, gamma=0.5)
        losses = []
        for step in range(5):
            losses += _train(engine, 1, start=step)
            sched.step()
        return engine, losses

    plain, want = run(0)
    engine, got = run(4)
    assert got == want
    assert engine._offload.last_step["stepped_on_host"] == len(engine._flat.chunks) > 1
    assert not _same(_weights(engine), _weights(plain))
    a, b = engine.optimizer.state_dict(), plain.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, st in b["state"].items():
        assert st.keys() == a["state"][i].keys()
        for k, v in st.items():
            assert torch.equal(a["state"][i][k], v), (i, k)


def test_the_pass_refuses_a_plan_the_host_cannot_hold(group, monkeypatch, caplog):
    """`Offloader.host_capacity` (the node's available memory shared by its local ranks, plus
    the engine's host buffers) bounds what a plan keeps on the host: below the plan's
    `host_bytes` the pass plans nothing (the state stays where it was before the plan) and
    says why; the figure halves with two local ranks."""
    import logging

    from deepcompile.runtime import offload

    probe = _engine(passes=("offload_optimizer",), warmup_steps=1)
    _train(probe, 3)
    d = _decisions(probe)
    store = probe._offload
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = store.host_capacity()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    two = store.host_capacity()
    held = sum(t.numel() * t.element_size() for s in store.slots for t in s.host.values())
    assert 0 < one < float("inf")   # unbounded: nothing offloaded, held 0
    assert two - held == pytest.approx((one - held) / 2, rel=0.05)   # MemAvailable moves a bit
    budget = d["lowest_peak_bytes"]
    monkeypatch.setattr(offload.Offloader, "host_capacity", lambda self: 1000.0)
    with caplog.at_level(logging.WARNING, logger="deepcompile"):
        engine = _engine(passes=("offload_optimizer",), warmup_steps=1, memory_budget=budget,
                         measure_steps=0)
        _train(engine, 3)
    d = _decisions(engine)
    assert d["unattainable"] and d["chunks"] == [] and d["host_capacity_bytes"] == 1000.0
    assert d["host_bytes"] > 1000 and "on the host" in d["reason"], d["reason"]
    assert any("bytes on the host" in r.getMessage() for r in caplog.records)
    # nothing more went to the host than the state it held before the plan (provisional)
    assert all(s.host_grad is None and s.host_master is None for s in engine._offload.slots)


def test_a_shard_without_a_gradient_is_not_stepped_on_the_host(group):
    """A parameter the forward never uses has no gradient in the window: the host step leaves
    it and its state alone, as the device's step does and torch's optimizer would ([Note: steps
    without a gradient] in runtime/flat.py), whatever its slice of the host gradient buffer
    holds (never written). Bitwise against the device."""
    import deepcompile

    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = tanh_stack()
            self.unused = torch.nn.Parameter(torch.ones(24))

        def forward(self, x):
            return self.body(x)

    def run(tier):
        torch.manual_seed(0)
        with chunk_bytes(CHUNK):
            engine = deepcompile.initialize(WithUnused(), optimizer=ADAMW, config={
                "compiler": "fx", "passes": (), "param_dtype": "bfloat16"})
        if tier:
            _all_masters_to_host(engine, tier)
        losses = _train(engine, 1)
        for s in engine._offload.slots:   # what a reused buffer may hold where none wrote
            if s.host_grad is not None:
                s.host_grad.fill_(7.0)
        return engine, losses + _train(engine, 3, start=1)

    plain, want = run(0)
    engine, got = run(4)
    assert got == want and engine._offload.last_step["stepped_on_host"] > 0
    assert not _same(_weights(engine), _weights(plain))
    assert torch.equal(_weights(engine)["unused"], torch.ones(24))
    unused = next(e for e in engine._registry if e.name == "unused")
    assert not engine.optimizer.state.get(unused.shard)   # never stepped: no state, as torch's
