"""A released engine is freed ([Note: what Dynamo holds] in compiler/backend.py).

Dynamo keeps the backend `torch.compile` was given (`cached_backends`, for the life of the
process) and every compiled callable (in the code object's cache); the eager fallback's hooks
live on the user's parameters (in C++, where the garbage collector does not look). Before the
fix each of them held the engine: an engine dropped by its user stayed alive with its flat
masters, optimizer state, kept parameters and accumulators — on a GPU, its memory — and a
notebook that built a second engine ran out of memory. Here an engine trains (every stage, fx
and Inductor, with offloading, at world size 1 and 2), is dropped while its user keeps the
model, and must be gone after one garbage collection, its hooks off the model: the engine, its runtime, a flat master chunk, the optimizer
and the offloader's host buffers; then a second engine trains in the same processes.
"""

from __future__ import annotations

import functools

import pytest

from _dist import run_distributed

STEPS = 4

CASES = {
    "zero3-auto-fx": {"compiler": "fx"},
    "zero3-offload-fx": {"compiler": "fx", "passes": ("prefetch", "offload_optimizer"),
                         "memory_budget": 1 << 30},
    "zero1-fx": {"compiler": "fx", "zero_stage": 1, "gradient_accumulation_steps": 2},
    "zero3-auto-inductor": {"compiler": "inductor"},
}


def _train(rank, world, config, steps):
    import torch

    import _models
    import deepcompile

    model = _models.build_model("llama")
    engine = deepcompile.initialize(model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                    config={"warmup_steps": 1, **config})
    gas = engine.config.gradient_accumulation_steps
    for i in range(steps * gas):
        batch = _models.local_batch("llama", i, rank, world)
        engine.backward(_models.loss_of(engine(**batch)))
        engine.step()
    return engine


def _job(rank, world, names):
    import gc
    import weakref

    out = {}
    for name in names:
        engine = _train(rank, world, CASES[name], STEPS)
        refs = {"engine": engine, "runtime": engine._runtime, "optimizer": engine.optimizer,
                "flat master": engine._flat.chunks[0].param, "offloader": engine._offload}
        refs.update({f"host buffer {k}": t for s in engine._offload.slots
                     for k, t in list(s.host.items())[:1]})
        refs = {k: weakref.ref(v) for k, v in refs.items()}
        host_buffers = sum(k.startswith("host buffer") for k in refs)
        model = engine.module   # the user keeps the model: it must not keep the engine

        def hooks():
            n = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
            return n + sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
                           for p in model.parameters())
        hooks_before = hooks()
        del engine
        gc.collect()
        alive = sorted(k for k, r in refs.items() if r() is not None)
        hooks_left = hooks()
        del model
        # a second engine, on a new model, in the same processes
        second = _train(rank, world, CASES[name], 2)
        out[name] = {"alive": alive, "host_buffers": host_buffers, "hooks": (hooks_before, hooks_left),
                     "second_steps": second._optimizer_steps}
        del second
        gc.collect()
    return out


@pytest.fixture(scope="module")
def released():
    return {1: run_distributed(_job, 1, ["zero3-auto-fx", "zero3-auto-inductor"], timeout=900),
            2: run_distributed(_job, 2, ["zero3-auto-fx", "zero3-offload-fx", "zero1-fx"],
                               timeout=900)}


@pytest.mark.parametrize("world, name", [(1, "zero3-auto-fx"), (1, "zero3-auto-inductor"),
                                         (2, "zero3-auto-fx"), (2, "zero3-offload-fx"),
                                         (2, "zero1-fx")])
def test_a_released_engine_is_freed(released, world, name):
    for rank in released[world]:
        r = rank[name]
        assert r["alive"] == [], f"{name}: still alive after the engine was dropped: {r['alive']}"
        before, left = r["hooks"]
        assert before > 0 and left == 0   # the engine's hooks left the model with it
        assert r["second_steps"] == 2   # the second engine trained
    if name == "zero3-offload-fx":   # the offloader had host buffers to free
        assert released[world][0][name]["host_buffers"] > 0


def test_code_of_a_released_engine_says_so():
    """What Dynamo holds of a released engine refuses to run, with a message (it would have
    run on freed memory)."""
    from deepcompile.compiler.backend import WeakBackend, _WeakSlot

    class _Slot:
        def __call__(self, args):
            return args

    slot = _Slot()
    weak = _WeakSlot(slot)
    assert weak([1]) == [1] and weak._boxed_call
    del slot
    with pytest.raises(RuntimeError, match="engine that no longer exists"):
        weak([1])

    class _Backend:
        def __call__(self, gm, example_inputs):
            return "compiled"

    backend = _Backend()
    handle = WeakBackend(backend)
    assert handle(None, []) == "compiled"
    del backend
    with pytest.raises(RuntimeError, match="engine that no longer exists"):
        handle(None, [])
