"""Pass `overlap_refresh` (ZeRO-1/2): the replicas' refresh after the optimizer step is left in
flight and waited for where the next forward first reads each parameter ([Note: deferred
refresh] in runtime/replicas.py).

Every multi-rank run here makes the deferred gathers *lazy* (`_lazy_refresh`): a launched
group's member is gathered only when something waits for that member, so a reader that does
not wait for what it reads sees the values of the step before, deterministically (a real
gather may have finished by then, or been waited for through another member of its group, and
hide the bug). Against that:
  * parity with single-process eager (tolerances of tests/test_parity.py) and *bitwise* the
    same parameters, replicas and losses as the same run with the pass off: ZeRO-1 and ZeRO-2,
    fx, 2 ranks {tiny Llama AdamW gas 2 clip, MLP SGD gas 4, MLP AdamW clip}, a submodule run
    eagerly (its forward's hook waits), a graph break with a parameter read by both graphs,
    tied embeddings, the pass timed against the graphs before it (`measure_steps`: the side
    before refreshes synchronously); 4 ranks {MLP ZeRO-1 AdamW gas 2 clip (with the pass only),
    Llama ZeRO-1 AdamW gas 2 clip, MLP ZeRO-2 SGD}; 1 rank, MLP (nothing to defer: the pass
    plans nothing); Inductor, 2 ranks, ZeRO-1 MLP, and Llama with and without the pass (the
    run with the pass off warms up one step longer, so that both compile their final graphs at
    the same step: the pass adds a profiled step);
  * what waits: after `engine.step()` the replicas are pending and the parameters are
    `PendingParameter`s; reading one (an op on it, `model.state_dict()`), running the model
    eagerly, an evaluation forward through the engine (an inference graph: it waits before it
    runs), a checkpoint load while pending, each sees the updated values; the forward graph waits inside
    (one `wait_tensor` per parameter it reads), and nothing is pending after the forward;
  * counts: the same collectives as without the pass (one all-gather of the model per step,
    launched in the step); the plan's groups, waits and predictions; the pure model of what
    the forward hides.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import traceback

import pytest
import torch

import _models
from _dist import run_distributed
from _train import FULL, compare_to_reference, run_training, scenario

SGD_LR, ADAMW_LR, CLIP = 0.1, 1e-2, 0.1
ON = ("bucket_reduce", "overlap_refresh")
OFF = ("bucket_reduce",)


class _LazyWork(torch.distributed.Work):
    """A gather that runs when first waited for (see the module docstring)."""

    def __init__(self, gather) -> None:
        super().__init__()
        self._gather = gather

    def wait(self, timeout=None) -> bool:
        gather, self._gather = self._gather, None
        if gather is not None:
            gather()
            # who waited: the runtime's Python (`Replicas.wait`), or a graph's wait_tensor
            by = "runtime" if any(f.filename.endswith("runtime/replicas.py")
                                  for f in traceback.extract_stack()) else "graph"
            GATHERED[by] += 1
        return True


GATHERED = {"graph": 0, "runtime": 0}   # this process's lazy gathers, by who waited


class _LazyGroup:
    """A launched group: each member is gathered when something waits for *that* member (its
    registered work), so that a reader that waits for another member reads stale values."""

    def __init__(self, comm, outputs, inputs) -> None:
        from deepcompile import _compat

        inputs = [i.clone() for i in inputs]   # the values at launch, as a real gather reads
        self.works = {o.untyped_storage().data_ptr(): _LazyWork(functools.partial(
            _compat.all_gather_flat, o, i, comm.group)) for o, i in zip(outputs, inputs)}


@contextlib.contextmanager
def _lazy_refresh():
    from deepcompile import _compat
    from deepcompile.runtime.comm import Comm

    real_launch, real_register = Comm.all_gather_coalesced_async, _compat.register_work

    def launch(self, outputs, inputs, nbytes):
        self._count("all_gather", nbytes)
        return _LazyGroup(self, outputs, inputs)

    def register(tensors, group):
        for t in tensors:
            real_register([t], group.works[t.untyped_storage().data_ptr()])

    Comm.all_gather_coalesced_async, _compat.register_work = launch, register
    try:
        yield
    finally:
        Comm.all_gather_coalesced_async, _compat.register_work = real_launch, real_register


def _lazy_training(rank, world, scenarios):
    with _lazy_refresh():
        return run_training(rank, world, scenarios)


def _sc(stage, model, optim, gas=1, clip=None, *, on=True, compiler="fx", tag="", **kw):
    cid = f"z{stage}-{model}-{optim}-gas{gas}{'-clip' if clip else ''}{tag}-{'on' if on else 'off'}"
    return scenario(cid, model, optim, SGD_LR if optim == "sgd" else ADAMW_LR, gas=gas,
                    clip=clip, compiler=compiler, zero_stage=stage, passes=ON if on else OFF,
                    record=("report", "replicas", "comm"), **kw)


def _pairs(*args, off=True, **kw):
    """The run with the pass and, where `off`, the run without it."""
    return [_sc(*args, on=True, **kw)] + ([_sc(*args, on=False, **kw)] if off else [])


# the core matrix ([Note: the core matrix] in tests/_train.py) has of fx on 2 ranks the odd
# models with the pass (ZeRO-1's a submodule run eagerly, ZeRO-2's a graph break) and the
# measured MLP with and without it (the bitwise pair); the full one the Llama pairs, the MLP
# pairs, tied embeddings and the runs without the pass of the others. On an HF model the pass
# is the full suite's: its waits go where a graph first reads each parameter, as in the odd
# models' graphs
_FX2 = [s for stage in (1, 2) for s in (
    *(_pairs(stage, "llama", "adamw", 2, CLIP) if FULL else ()),
    *(_pairs(stage, "mlp", "sgd", 4) if FULL else ()),
    *(_pairs(stage, "mlp", "adamw", 1, CLIP) if FULL else ()),
)] + [
    *_pairs(1, "disabled", "sgd", 2, CLIP, off=FULL),
    *_pairs(2, "graph_break", "sgd", 2, off=FULL),
    *(_pairs(1, "llama_tied", "adamw", 1) if FULL else ()),
    # timed against the graphs before it (both passes: 2 + 2 x 2 steps each), then steady
    *_pairs(2, "mlp", "adamw", 2, tag="-measured", measure_steps=2, steps=20),
]
# 4 ranks are the full suite's: the MLP with the pass (its odd sizes pad every shard, as on 2),
# the Llama and the MLP at ZeRO-2 with and without it (bitwise the same)
_FX4 = [_sc(1, "mlp", "adamw", 2, CLIP),
        *(_pairs(1, "llama", "adamw", 2, CLIP) + _pairs(2, "mlp", "sgd", 1))] if FULL else []
_FX1 = [_sc(1, "mlp", "adamw", 2, CLIP)]
# Inductor's code of the refresh (its waits inside the compiled forward): the core has the MLP
# with the pass (against eager); the full one the Llama with and without it. The pass adds a
# profiled step: the Llama's run without it warms up one step longer, so that both run their
# final (Inductor) graphs from the same step on
_INDUCTOR = [_sc(1, "mlp", "adamw", 2, CLIP, compiler="inductor"),
             *([_sc(1, "llama", "adamw", 2, CLIP, compiler="inductor", steps=7),
                _sc(1, "llama", "adamw", 2, CLIP, on=False, compiler="inductor", steps=7,
                    warmup_steps=3)] if FULL else ())]
JOBS = {name: (world, scs) for name, (world, scs) in {
    "fx2": (2, _FX2), "fx4": (4, _FX4), "fx1": (1, _FX1), "inductor2": (2, _INDUCTOR)}.items()
    if scs}
_DONE: dict = {}


def _results(job):
    if job not in _DONE:
        world, scs = JOBS[job]
        per_rank = run_distributed(_lazy_training, world, scs, timeout=1500)
        _DONE[job] = {sc["id"]: [r[i] for r in per_rank] for i, sc in enumerate(scs)}
    return _DONE[job]


def _params(on_only=False):
    return [pytest.param(job, sc, id=f"{job}-{sc['id']}",
                         marks=(pytest.mark.inductor,) if job.startswith("inductor") else ())
            for job, (_w, scs) in JOBS.items() for sc in scs
            if not on_only or sc["id"].endswith("-on")]


def _get(job, sid):
    per_rank = _results(job)[sid]
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, errors[0]
    return per_rank


def _pass_entry(result):
    return next(e for e in result["report"]["passes"] if e["pass"] == "overlap_refresh")


@pytest.mark.parametrize("job, sc", _params())
def test_parity_with_eager_reference(job, sc):
    compare_to_reference(sc, _get(job, sc["id"]), kind=f"overlap_refresh-{job}")


@pytest.mark.parametrize("job, sc", _params(on_only=True))
def test_bitwise_the_same_as_without_the_pass(job, sc):
    on = _get(job, sc["id"])
    off_id = sc["id"][: -len("-on")] + "-off"
    if off_id not in _results(job):
        pytest.skip("no run without the pass (world size 1: the pass plans nothing; on 4 ranks, "
                    "with Inductor and for most models: the full suite's)")
    off = _get(job, off_id)
    for a, b in zip(on, off):
        assert a["losses"] == b["losses"]
        for what in ("state", "replicas"):
            bad = [k for k in a[what] if not torch.equal(a[what][k], b[what][k])]
            assert not bad, (what, bad)
    # and the replicas are the masters, on every rank
    for r in on:
        for name, value in r["replicas"].items():
            assert torch.equal(value, r["state"][name]), name


@pytest.mark.parametrize("job, sc", _params(on_only=True))
def test_the_pass_defers_the_refresh(job, sc):
    results = _get(job, sc["id"])
    entry = _pass_entry(results[0])
    world = results[0]["world"]
    if "measured" in sc["id"] and not entry["kept"]:   # slower on this machine now: reverted,
        assert results[0]["report"]["phase"] == "steady"   # and the refresh is synchronous
        return
    if world == 1:
        assert entry["decisions"] == {"skipped": "world size 1: the refresh is a local copy"}
        assert entry["changed"] == []
        return
    assert entry["kept"], entry["verdict"]
    d = entry["decisions"]
    trainable = {n for n, p in _models.build_model(sc["model"]).named_parameters()}
    assert {p for g in d["groups"] for p in g["params"]} <= trainable
    assert d["segments"] == 1                        # CPU: the step stays one call
    assert set(d["waits"]) == set(entry["changed"])  # every forward that reads one waits
    assert d["exposed_s"] <= d["refresh_s"]
    # the step launches the refresh (counted there): one all-gather of the model's replicas
    # per optimizer step, as without the pass; nothing in the forward
    off_id = sc["id"][: -len("-on")] + "-off"
    if off_id in _results(job):
        off = _get(job, off_id)[0]
        assert results[0]["comm_step"][-1] == off["comm_step"][-1]
    assert all(c["all_gather"] == (0, 0) for c in results[0]["comm_fwd"])


# ---------------------------------------------------------------------- what waits, and where
# the model of `_reads` and the parameter it reads first (its last layer's weight)
_READ = {"llama": "lm_head.weight", "mlp": "fc3.weight"}


def _reads(rank, world, compiler, name, ckpt):
    import deepcompile
    from deepcompile.guard import PendingParameter

    read = _READ[name]
    torch._dynamo.reset()
    model = _models.build_model(name)
    engine = deepcompile.initialize(
        model, optimizer=functools.partial(torch.optim.AdamW, lr=ADAMW_LR),
        config=deepcompile.Config(zero_stage=1, compiler=compiler, passes=ON, measure_steps=0))
    rt = engine._runtime
    micro = 0

    def train_step():
        nonlocal micro
        loss = _models.loss_of(engine(**_models.local_batch(name, micro, rank, world)))
        engine.backward(loss)
        micro += 1
        engine.step()

    def masters():
        return {k: v for k, v in engine.full_state_dict().items()}

    def same(replicas, full):
        return all(torch.equal(replicas[k].detach().cpu(), full[k]) for k in full)

    while engine.phase != "steady":
        train_step()
    train_step()
    out = {}
    pending = rt.replicas.pending
    param = operator.attrgetter(read)   # the module's attribute, as it is at each call
    cls = type(param(model)).__name__
    full = masters()   # reads the shards: no wait
    out["pending_after_step"] = (pending, cls, rt.replicas.pending)
    out["op_on_a_parameter"] = torch.equal(param(model).detach().clone(), full[read])
    out["guarded_after_read"] = (rt.replicas.pending, type(param(model)).__name__)

    train_step()
    full = masters()
    out["state_dict"] = same(model.state_dict(), full)

    train_step()
    full = masters()
    batch = _models.local_batch(name, 0, rank, world)
    with torch.no_grad():
        eager = _models.loss_of(model(**batch))   # the module's own forward, eagerly
    out["eager_forward"] = (same(dict(model.named_parameters()), full), not rt.replicas.pending)
    with torch.no_grad():
        again = _models.loss_of(model(**batch))
    out["eager_forward_value"] = torch.equal(eager, again)

    train_step()
    with torch.no_grad():   # through the engine: an inference graph, which waits before it runs
        first = _models.loss_of(engine(**batch))
        second = _models.loss_of(engine(**batch))
    out["eval_through_engine"] = torch.equal(first, second)

    engine.save_checkpoint(ckpt)
    train_step()
    train_step()
    engine.load_checkpoint(ckpt)   # while the refresh is pending: waited for, then redone
    out["load"] = same(dict(model.named_parameters()), masters())

    train_step()
    # the next training forward waits inside its graph, and nothing is pending after it
    slot = engine._pipeline.slots["g0.fw"]
    low = slot.lowered[(True, slot.version)]
    wait = torch.ops._c10d_functional.wait_tensor.default
    out["waits_in_forward"] = sum(1 for n in low.gm.graph.nodes if n.target is wait)
    out["forward_settles_itself"] = low.settle is None
    GATHERED.update(graph=0, runtime=0)
    loss = _models.loss_of(engine(**_models.local_batch(name, micro, rank, world)))
    out["gathered_by"] = dict(GATHERED)   # each replica waited for by the graph, where read
    out["pending_after_forward"] = rt.replicas.pending
    engine.backward(loss)
    micro += 1
    engine.step()
    out["pending_after_last_step"] = rt.replicas.pending
    out["n_params"] = len(list(model.parameters()))
    out["pending_class_exists"] = PendingParameter.__name__
    return out


# the same readers on the tiny Llama: the full suite's ([Note: the core matrix] in tests/_train.py)
@pytest.mark.parametrize("model", ["mlp", pytest.param("llama", marks=pytest.mark.extended)])
@pytest.mark.parametrize("compiler", ["fx"])
def test_every_reader_waits(compiler, model, tmp_path):
    results = run_distributed(_lazy_reads, 2, compiler, model, str(tmp_path / "ckpt"),
                              timeout=900)
    for r in results:
        assert r["pending_after_step"] == (True, "PendingParameter", True)
        assert r["op_on_a_parameter"]
        assert r["guarded_after_read"] == (False, "GuardedParameter")
        assert r["state_dict"]
        assert r["eager_forward"] == (True, True) and r["eager_forward_value"]
        assert r["eval_through_engine"]
        assert r["load"]
        assert r["waits_in_forward"] == r["n_params"] and r["forward_settles_itself"]
        assert r["pending_after_forward"] is False
        assert r["gathered_by"] == {"graph": r["n_params"], "runtime": 0}
        assert r["pending_after_last_step"] is True


def _lazy_reads(rank, world, compiler, model, ckpt):
    with _lazy_refresh():
        return _reads(rank, world, compiler, model, ckpt)


# ------------------------------------------------------------------------------- pure: plan
def test_exposed_time_model():
    from deepcompile.passes.overlap_refresh import exposed

    g = lambda t, at: {"predicted_s": t, "read_at_s": at}  # noqa: E731
    # one group, read at once: all of it waits; read late enough: nothing
    assert exposed([g(2.0, 0.0)], 5.0) == 2.0
    assert exposed([g(2.0, 3.0)], 5.0) == 0.0
    # two groups in one queue: the second completes at 3, read at 1 (+ the first's stall of 1)
    assert exposed([g(2.0, 1.0), g(1.0, 1.0)], 5.0) == pytest.approx(2.0)
    # a group no graph reads is waited for after the forward
    assert exposed([g(2.0, None)], 1.0) == 1.0
