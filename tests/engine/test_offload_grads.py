"""Gradients on the host (offload tier 2, [Note: gradients on the host] in offload/grads.py),
in-process at world size 1 (the multi-rank runs are in tests/distributed/test_offload.py):

* the runtime alone (tiers set by hand, no graph ops: every gradient reaches `shard.grad` and
  the step sends it to the host first): training is bitwise the same as with the gradients on
  the device, with and without clipping, and matches torch's own optimizer on the unsharded
  model; with loss scaling (static and dynamic) the host gradients are unscaled (and clipped)
  as the device's are;
* an inf in a gradient that is on the host is found at the step ("raise" names it, "skip"
  skips the step and leaves the weights as they were), and the next step trains;
* planned by the pass under a budget the state alone cannot meet: a `grad_to_host` op per
  gradient of the chunks it chose, their outputs None, the measured peak within the budget,
  training bitwise the same; a re-plan in the middle of an accumulation window brings the
  host gradients back, and the graphs still planned for tier 2 hand theirs to `shard.grad`.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from _train import assert_peaks_within, chunk_bytes, tanh_stack

CHUNK = 256
ADAMW = functools.partial(torch.optim.AdamW, lr=0.01)


_model = tanh_stack


def _engine(optimizer=ADAMW, **config):
    import deepcompile

    model = _model()
    with chunk_bytes(CHUNK):
        return deepcompile.initialize(model, optimizer=optimizer,
                                      config={"compiler": "fx", "passes": (), **config})


def _x(step: int, micro: int = 0) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + micro))


def _train(engine, steps, gas=1, start=0, between=None):
    for step in range(start, start + steps):
        for micro in range(gas):
            engine.backward(engine(_x(step, micro)).square().mean())
            if between is not None:
                between(step, micro)
        engine.step()


def _weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.full_state_dict().items()}


def _all_to_host(engine) -> None:
    from deepcompile.runtime import offload

    engine._offload.set_plan({c.index: offload.GRADS for c in engine._flat.chunks})


# with clipping in the full suite: the default run clips gradients on the host in
# test_gradients_on_the_host_are_unscaled_as_on_the_device[0.05-dynamic]
@pytest.mark.parametrize("clip", [None, pytest.param(0.05, marks=pytest.mark.extended)])
def test_gradients_on_the_host_train_as_on_the_device(group, clip):
    plain = _engine(max_grad_norm=clip)
    _train(plain, 4)
    engine = _engine(max_grad_norm=clip)
    _all_to_host(engine)
    _train(engine, 4)
    store = engine._offload
    grads = sum(p.numel() * 4 for p in _model().parameters())
    assert store.last_step["grad_d2h_bytes"] == grads
    assert store.last_step["streamed_at_step"] == len(engine._flat.chunks)
    assert all(s.host_grad is not None and not s.written for s in store.slots)
    got, want = _weights(engine), _weights(plain)
    for k in want:   # clipping sums the norm in another order: within a rounding
        assert (torch.equal(got[k], want[k]) if clip is None
                else torch.allclose(got[k], want[k], rtol=0, atol=1e-6)), k
    # and as torch trains the unsharded model
    ref = _model()
    opt = ADAMW(ref.parameters())
    for step in range(4):
        ref(_x(step)).square().mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-5), k


# the default run has the dynamic scale with clipping (the norm of unscaled host gradients);
# a static scale, and either without clipping, are the full suite's
@pytest.mark.parametrize("loss_scale", [pytest.param(1024.0, marks=pytest.mark.extended),
                                        "dynamic"])
@pytest.mark.parametrize("clip", [pytest.param(None, marks=pytest.mark.extended), 0.05])
def test_gradients_on_the_host_are_unscaled_as_on_the_device(group, loss_scale, clip):
    # SGD: a gradient left scaled (or clipped by a norm of scaled gradients) moves the weights
    # by as much more (AdamW's update would hardly show it)
    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    config = {"max_grad_norm": clip, "loss_scale": loss_scale, "gradient_accumulation_steps": 2}
    plain = _engine(optimizer=sgd, **config)
    _train(plain, 4, gas=2)
    engine = _engine(optimizer=sgd, **config)
    _all_to_host(engine)
    _train(engine, 4, gas=2)
    assert engine._offload.last_step["streamed_at_step"] == len(engine._flat.chunks)
    got, want = _weights(engine), _weights(plain)
    for k in want:   # clipping sums the norm in another order: within a rounding
        assert (torch.equal(got[k], want[k]) if clip is None
                else torch.allclose(got[k], want[k], rtol=0, atol=1e-6)), k


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_an_inf_in_a_gradient_on_the_host_is_found(group, policy):
    from deepcompile.runtime.guardrails import NonFiniteError

    engine = _engine(on_nonfinite=policy)
    _all_to_host(engine)
    _train(engine, 2)
    before = _weights(engine)
    shard = engine._flat.chunks[-1].shards[0]
    hook = shard.register_hook(lambda g: g * float("inf"))
    engine.backward(engine(_x(2)).square().mean())
    hook.remove()
    if policy == "raise":
        with pytest.raises(NonFiniteError, match=r"gradients on rank\(s\) \[0\]"):
            engine.step()
        return
    assert engine.step() and engine.nonfinite_skipped == 1
    after = _weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped step moved weights"
    _train(engine, 1, start=3)   # the host gradients start a clean window
    assert engine.nonfinite_skipped == 1
    assert all(torch.isfinite(v).all() for v in _weights(engine).values())


def _decisions(engine) -> dict:
    rep = engine.report().to_dict()
    return next(p for p in rep["passes"] if p["pass"] == "offload_optimizer")["decisions"]


def _bw_slot(engine):
    return next(s for s in engine._pipeline.slots.values() if s.kind == "bw")


def _tier2_budget() -> int:
    """Below what all the state off the device gives (the graphs, or the step streaming it),
    by an eighth of the gradients: the plan must send gradients to the host (tier 2)."""
    from deepcompile.passes import offload_optimizer as O

    probe = _engine(gradient_accumulation_steps=2, passes=("offload_optimizer",), warmup_steps=1)
    _train(probe, 3, gas=2)
    d = _decisions(probe)
    grads = sum(p.numel() * 4 for p in _model().parameters())
    state_only = max(d["graph_peak_bytes"] - d["state_bytes"], d["step_base_bytes"]
                     + O.staging_bytes(O.items_of(probe._offload)))
    return state_only - grads // 8


def _moments(engine) -> dict:
    st = engine.optimizer.state_dict()["state"]
    return {(i, k): v.clone() for i, s in st.items() for k, v in s.items()
            if torch.is_tensor(v) and v.dim() == 1}


@pytest.mark.parametrize("then", ["skipped step", "load_state_dict"])
def test_copies_back_still_under_way_finish_before_the_state_moves_again(group, then):
    """The last backward brought state back (`reload_state` ops), and then no step waited for
    those copies: the step was skipped (an inf gradient, on_nonfinite="skip"), or the state
    dict was taken and loaded back before the step. The copies are waited for before the state
    is read (`_state_dict_hook`), goes out again (`after_step`) or is replaced
    (`_before_load`): on CUDA the copy out would read it half written and the freed block
    would take the rest of the copy in; on the CPU the deferred copies would be lost. (Found in
    review: a skipped step changed every offloaded chunk's moments.) Training is as without."""
    from deepcompile.runtime import offload

    def run(interrupt: bool):
        engine = _engine(on_nonfinite="skip")
        store = engine._offload
        store.set_plan({c.index: offload.STATE for c in engine._flat.chunks})
        group_id = store.add_reload_group([c.index for c in engine._flat.chunks])
        _train(engine, 2)
        before = _moments(engine)
        hook = None
        if interrupt and then == "skipped step":
            hook = engine._flat.chunks[-1].shards[0].register_hook(lambda g: g * float("inf"))
        engine.backward(engine(_x(2)).square().mean())
        if hook is not None:
            hook.remove()
        store.reload_group(group_id)   # what the reload op does in the last micro-step's backward
        assert store._pending
        if interrupt and then == "load_state_dict":
            engine.optimizer.load_state_dict(engine.optimizer.state_dict())
            assert not store._pending
        skipped = engine.step() and engine.nonfinite_skipped == 1
        assert not store._pending
        return engine, before, skipped

    engine, before, skipped = run(interrupt=True)
    if then == "skipped step":
        assert skipped
        after = _moments(engine)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert not changed, changed
    else:
        plain, _, _ = run(interrupt=False)
        _train(engine, 2, start=3)
        _train(plain, 2, start=3)
        got, want = _weights(engine), _weights(plain)
        assert all(torch.equal(got[k], want[k]) for k in want), \
            [k for k in want if not torch.equal(got[k], want[k])]


def test_the_state_of_an_offloaded_chunk_reads_as_meta_not_as_released_memory(group):
    """[Note: optimizer state access] in runtime/offload/slot.py: between steps an offloaded chunk's
    per-parameter state in `engine.optimizer.state` is meta tensors of the right shapes —
    printing them works, reading their values raises — where a view of the released device
    storage crashed the process on any read (a segfault; on CUDA an illegal memory access).
    state_dict() has the values; back on the device the entries are views again."""
    from deepcompile.runtime import offload

    engine = _engine()
    store = engine._offload
    store.set_plan({c.index: offload.STATE for c in engine._flat.chunks})
    _train(engine, 2)
    shards = [sh for c in engine._flat.chunks for sh in c.shards]
    packed = engine.optimizer.state_dict()["state"]
    for i, sh in enumerate(shards):
        st = engine.optimizer.state[sh]
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].device.type == "meta" and st[k].shape == sh.shape, (k, st[k])
            assert "meta" in repr(st[k])
            with pytest.raises((NotImplementedError, RuntimeError)):
                st[k].cpu()
            assert packed[i][k].device.type == "cpu" and torch.isfinite(packed[i][k]).all()
    store.reload_all()
    store._copier.wait(store._pending)
    for i, sh in enumerate(shards):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(engine.optimizer.state[sh][k].reshape(-1),
                               packed[i][k].reshape(-1)), k


# in the full suite: the default run has the pass send gradients to the host at accumulation
# 2 under Inductor (test_gradients_sent_from_inductor_graphs_are_copied_before_their_buffers_
# are_reused), within the budget at 2 ranks (tests/distributed/test_offload.py's
# test_gradients_go_to_the_host_under_a_budget_all_the_state_does_not_meet), and a re-plan in
# the middle of a window bringing them back (test_a_replan_profiles_the_graphs_without_the_
# previous_plans_gradient_ops)
@pytest.mark.extended
def test_the_pass_sends_gradients_to_the_host_within_the_budget(group):
    from deepcompile.runtime import offload

    plain = _engine(gradient_accumulation_steps=2)
    _train(plain, 5, gas=2)
    budget = _tier2_budget()
    engine = _engine(gradient_accumulation_steps=2, passes=("offload_optimizer",),
                     warmup_steps=1, memory_budget=budget, measure_steps=0)
    _train(engine, 4, gas=2)
    d = _decisions(engine)
    tier2 = [c for c in d["chunks"] if c["tier"] == offload.GRADS]
    assert tier2 and not d["unattainable"] and d["peak_after"] <= budget, d
    assert d["offloaded_bytes"] == d["state_bytes"]   # all state first
    ops = [n for n in _bw_slot(engine).gm.graph.nodes if n.target is offload.GRAD_TO_HOST]
    assert len(ops) == sum(len(engine._flat.chunks[c["chunk"]].shards) for c in tier2)
    rep = engine.report().to_dict()
    assert_peaks_within(rep, budget)   # measured with the plan
    off = rep["offload"]
    assert off["offloaded_grad_bytes"] == d["offloaded_grad_bytes"] > 0
    # two micro-steps: sent twice (the second added on the device), back once for the step
    sent = sum(engine._flat.chunks[c["chunk"]].nbytes for c in tier2)
    assert off["last_step"]["grad_d2h_bytes"] == 2 * d["offloaded_grad_bytes"]
    assert off["last_step"]["grad_h2d_bytes"] == d["offloaded_grad_bytes"] + sent
    # a re-plan in the middle of a window: the host gradients come back to `shard.grad`, and
    # the graphs still planned for tier 2 hand theirs there too (until they are re-planned)
    def replan(step, micro):
        if step == 4 and micro == 0:
            engine._offload.set_plan({})
            assert all(not s.written for s in engine._offload.slots)
    _train(engine, 1, gas=2, start=4, between=replan)
    got, want = _weights(engine), _weights(plain)
    assert all(torch.equal(got[k], want[k]) for k in want), \
        [k for k in want if not torch.equal(got[k], want[k])]


def test_a_replan_profiles_the_graphs_without_the_previous_plans_gradient_ops(group):
    """A re-plan in the steady state (the step drifted: Engine._replan_on_drift, here by hand,
    in the middle of a window) profiles the graphs as the pass plans from them: as compiled,
    without the `grad_to_host` ops of the plan it replaces ([Note: a re-plan starts over] in
    compiler/pass_manager.py). With them, the gradients of
    the chunks that were at tier 2 are accumulated into `shard.grad` as soon as they are made,
    the profile misses them until the graph's end, and the re-plan keeps too little off the
    device (seen with ragged lengths: a re-plan under the same inputs exceeded the budget and
    was reverted)."""
    from deepcompile.runtime import offload

    plain = _engine(gradient_accumulation_steps=2)
    _train(plain, 8, gas=2)
    engine = _engine(gradient_accumulation_steps=2, passes=("offload_optimizer",),
                     warmup_steps=1, memory_budget=_tier2_budget(), measure_steps=0)
    pipe = engine._pipeline
    _train(engine, 4, gas=2)   # warm-up, profile, re-profile with the plan, steady
    store = engine._offload
    assert pipe.phase.value == "steady" and any(store.grad_tier(s) for s in store.slots)

    def drift(step, micro):
        if micro == 0:
            engine._replan_on_drift("a test")
    _train(engine, 1, gas=2, start=4, between=drift)
    assert pipe.phase.value == "profile"
    bw = _bw_slot(engine)
    assert not [n for n in bw.gm.graph.nodes if n.target is offload.GRAD_TO_HOST]
    _train(engine, 3, gas=2, start=5)   # profile, re-profile with the new plan, steady
    entries = [e for e in pipe.pass_log if e["pass"] == "offload_optimizer"]
    assert [e["kept"] for e in entries] == [True, True], [e["verdict"] for e in entries]
    first, again = (e["decisions"] for e in entries)
    assert any(c["tier"] == offload.GRADS for c in first["chunks"])
    assert again["chunks"] == first["chunks"]   # the same inputs' sizes: the same plan
    # the re-plan's profile (the graphs as compiled, all state off the device) is the first one's
    peaks = {label: prof.peak_bytes for label, prof in bw.history}
    assert peaks["replan: a test"] == peaks["initial"], peaks
    assert [n for n in bw.gm.graph.nodes if n.target is offload.GRAD_TO_HOST]
    got, want = _weights(engine), _weights(plain)
    assert all(torch.equal(got[k], want[k]) for k in want), \
        [k for k in want if not torch.equal(got[k], want[k])]


def test_the_report_says_what_gradients_went_to_the_host(group):
    engine = _engine()
    _all_to_host(engine)
    _train(engine, 2)
    text = str(engine.report())
    assert "gradients on the host: " in text and "last step sent" in text, text


def test_a_graph_reused_after_planning_for_a_parameter_sent_to_the_host_is_an_error(group):
    """The op names its parameter by the compile-time id: a graph Dynamo starts reusing for
    another parameter after the plan would mix their gradients (the plan leaves out what was
    reused before it: tests/distributed/test_offload.py::test_gradients_of_a_reused_graphs_*)."""
    engine = _engine()
    _all_to_host(engine)
    a, b = list(engine._registry)[:2]
    with pytest.raises(RuntimeError, match=r"sends the gradient of .* to the host is also run"):
        engine._registry.note_reuse(a, b)


def _square_model() -> torch.nn.Module:
    """Weights of the activations' shape (16 x 16 for a batch of 16): Inductor can give a weight
    gradient's buffer to a later input gradient of the backward."""
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def test_gradients_sent_from_inductor_graphs_are_copied_before_their_buffers_are_reused(group):
    """Inductor's generated code reuses a buffer as soon as its last reader has returned, and a
    `grad_to_host` op returns before its copy to the host has run (CUDA: on the d2h stream; the
    CPU copier defers such copies until they are waited for, as the stream would run them
    late): the op copies from a buffer of its own, or the next kernel's output reaches the
    host in the gradient's place. Every chunk's gradients on the host, two micro-steps (the
    second one's round trips too), Inductor: training is the same as without offloading."""
    import deepcompile
    from deepcompile.runtime import offload

    def engine_of(**config):
        with chunk_bytes(CHUNK * 4):
            return deepcompile.initialize(
                _square_model(), optimizer=ADAMW,
                config={"compiler": "inductor", "gradient_accumulation_steps": 2, **config})

    def train(engine, steps):
        for step in range(steps):
            for micro in range(2):
                x = torch.randn(1, 16, generator=torch.Generator().manual_seed(10 * step + micro))
                engine.backward(engine(x).square().mean())
            engine.step()

    plain = engine_of(passes=())
    train(plain, 5)
    probe = engine_of(passes=("offload_optimizer",), warmup_steps=1)
    train(probe, 3)
    budget = _decisions(probe)["lowest_peak_bytes"]   # all state and all gradients off
    engine = engine_of(passes=("offload_optimizer",), warmup_steps=1, memory_budget=budget,
                       measure_steps=0)
    train(engine, 5)
    d = _decisions(engine)
    assert not d["unattainable"], d["reason"]
    tier2 = [c for c in d["chunks"] if c["tier"] == offload.GRADS]
    assert len(tier2) > len(engine._flat.chunks) // 2, d["chunks"]
    assert engine._offload._copier.deferred > 0
    got, want = _weights(engine), _weights(plain)
    bad = {k: (got[k] - want[k]).abs().max().item() for k in want
           if not torch.equal(got[k], want[k])}
    assert not bad, bad


def test_a_parameter_two_graphs_use_is_sent_from_both_and_the_plan_counts_both(group):
    """`shared` is used before and after a graph break: each backward makes a gradient of it
    and sends it to the host (the second added there), so the plan's bytes sent a step count
    both, not the shard once; training stays bitwise the same."""
    import deepcompile
    from deepcompile.runtime import offload

    from _models import GraphBreakModel

    def engine_(**config):
        torch.manual_seed(0)
        with chunk_bytes(CHUNK):
            return deepcompile.initialize(GraphBreakModel(), optimizer=ADAMW, config={
                "compiler": "fx", "passes": (), "warmup_steps": 1, **config})

    def train(engine, steps):
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 13, generator=g), torch.randn(4, 7, generator=g)
            engine.backward(engine(x, y))
            engine.step()

    plain = engine_()
    train(plain, 4)
    probe = engine_(passes=("offload_optimizer",))
    train(probe, 2)
    d = _decisions(probe)
    budget = d["lowest_grads_peak_bytes"]
    engine = engine_(passes=("offload_optimizer",), memory_budget=budget, measure_steps=0)
    train(engine, 4)
    d = _decisions(engine)
    tier2 = {c["chunk"] for c in d["chunks"] if c["tier"] == offload.GRADS}
    shared = {c.index for c in engine._flat.chunks for e in c.entries
              if e.name.startswith("shared.")}
    assert shared <= tier2 and not d["unattainable"], d
    twice = sum(p.numel() * 4 for n, p in GraphBreakModel().named_parameters()
                if n.startswith("shared."))
    assert d["grad_sent_bytes"] == d["offloaded_grad_bytes"] + twice
    assert engine._offload.last_step["grad_d2h_bytes"] == d["grad_sent_bytes"]
    got, want = _weights(engine), _weights(plain)
    assert all(torch.equal(got[k], want[k]) for k in want), \
        [k for k in want if not torch.equal(got[k], want[k])]
