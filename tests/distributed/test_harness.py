"""The test infrastructure itself: the multi-process harness, the model builders and the
reference loop (none of this needs deepcompile)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import _models
from _dist import INDUCTOR_CACHE, DistributedTestError, run_distributed
from _train import FULL, reference_training, scenario


def _all_reduce_job(rank, world, value):
    import threading

    from torch._dynamo.utils import counters

    from tqdm import tqdm

    # as fresh as a spawned process ([Note: a warm fork server] in tests/_warmup.py): only the
    # main thread (gloo's are not Python's), nothing counted by Dynamo, and no tqdm monitor
    # left from the server's compile (its thread did not come through the fork: tqdm would
    # take it for running and never start another)
    fresh = {"threads": sorted(t.name for t in threading.enumerate()),
             "counters": {k: dict(v) for k, v in counters.items() if v},
             "stale_monitor": tqdm.monitor is not None and not tqdm.monitor.is_alive()}
    t = torch.tensor([float(rank + value)])
    dist.all_reduce(t)
    return {"fresh": fresh, "sum": t, "rank": dist.get_rank(), "world": dist.get_world_size(),
            "backend": dist.get_backend(), "threads": torch.get_num_threads(),
            "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                               "MASTER_ADDR", "OMP_NUM_THREADS",
                                               "TORCHINDUCTOR_CACHE_DIR")}}


def _failing_job(rank, world):
    if rank == 1:
        raise KeyError("boom-from-rank-1")
    dist.barrier()  # rank 0 is stuck here until the harness terminates it
    return rank


def _aborting_job(rank, world):
    if rank == 1:
        os.abort()   # as gloo does when a peer's collective does not match (a C++ check)
    dist.barrier()


def _sleeping_job(rank, world):
    time.sleep(600)


def test_harness_all_reduce_two_ranks():
    out = run_distributed(_all_reduce_job, 2, 10)
    assert [o["rank"] for o in out] == [0, 1]
    for r, o in enumerate(out):
        assert o["sum"].item() == 10 + 11
        assert o["world"] == 2 and o["backend"] == "gloo" and o["threads"] == 1
        assert o["env"]["RANK"] == o["env"]["LOCAL_RANK"] == str(r)
        assert o["env"]["WORLD_SIZE"] == "2" and o["env"]["OMP_NUM_THREADS"] == "1"
        assert o["env"]["TORCHINDUCTOR_CACHE_DIR"] == str(INDUCTOR_CACHE)
        assert o["fresh"]["threads"] == ["MainThread"], o["fresh"]["threads"]
        assert o["fresh"]["counters"] == {}, o["fresh"]["counters"]
        assert not o["fresh"]["stale_monitor"]


def test_harness_reraises_child_exception_with_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_failing_job, 2, timeout=120)
    msg = str(info.value)
    assert "rank 1" in msg and "KeyError" in msg and "boom-from-rank-1" in msg
    assert "_failing_job" in msg  # the child's traceback
    assert time.monotonic() - t0 < 60


def test_harness_reports_the_stacks_of_a_rank_killed_by_a_signal():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_aborting_job, 2, timeout=120)
    msg = str(info.value)
    assert "rank 1: exited with code -6 (SIGABRT)" in msg, msg
    assert "_aborting_job" in msg, msg   # faulthandler's stack of the rank that died


def test_harness_timeout_terminates_children():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError, match="timed out"):
        run_distributed(_sleeping_job, 2, timeout=4)
    assert time.monotonic() - t0 < 40


# one graph, two, several; the tiny Llama's in the full suite (the default run's parity tests
# on it compare its compiled training with eager's)
TRACED = ("mlp", "graph_break", "nested_break")


@pytest.mark.parametrize("name", _models.MODEL_NAMES)
def test_model_builders_deterministic_and_dynamo_traceable(name):
    a, b = _models.build_model(name), _models.build_model(name)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    # ranks' slices concatenate to the global batch
    full = _models.global_batch(name, 3)
    for world in (2, 4):
        parts = [_models.local_batch(name, 3, r, world) for r in range(world)]
        for k, v in full.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(torch.cat([p[k] for p in parts]), v)
            else:   # a flag every rank shares
                assert all(p[k] == v for p in parts)
    # Dynamo captures the model; the compiled loss and gradients equal eager (the core matrix:
    # one model of each kind of graph; the ranks of every job compile the others)
    if not FULL and name not in TRACED:
        return
    from torch._dynamo.utils import counters

    batch = _models.local_batch(name, 0, 0, 2)
    torch.manual_seed(0)   # the same random stream for both calls (dropout)
    ref = _models.loss_of(a(**batch))
    ref.backward()
    torch._dynamo.reset()
    counters.clear()
    try:
        torch.manual_seed(0)
        out = _models.loss_of(torch.compile(b, backend="aot_eager")(**batch))
        out.backward()
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-5, atol=1e-6)
    if name in ("mlp", "mlp_nobias", "llama", "llama_tied", "mixtral"):
        assert graphs == 1
    elif name == "graph_break":
        assert graphs == 2
    elif name in ("mixtral_eager", "nested_break"):
        assert graphs >= 2
    elif name == "disabled":
        assert graphs >= 1
    elif name == "disabled_forward":
        assert graphs == 2   # before and after the disabled call


def test_reference_clipping_is_active():
    sc = scenario("ref-clip", "mlp", "sgd", 0.1, gas=2, clip=0.1, steps=3)
    ref = reference_training(sc)
    assert len(ref["losses"]) == 6 and len(ref["grad_norms"]) == 3
    assert all(n > 0.1 for n in ref["grad_norms"])
    assert reference_training(sc) is ref  # cached
