"""GPU checks (NCCL, CUDA events, memory_allocated); skipped without CUDA.

Run on a machine with one GPU:  python -m pytest tests/test_gpu.py -q -s
At world size 1 nothing is communicated: a gather is the local shard (a view, or a cast under
param_dtype) and a reduction the local gradient; the comm counters stay at 0.
"""

from __future__ import annotations

import functools
import os
import socket

import pytest
import torch
import torch.distributed as dist

import _models

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def nccl():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    yield
    dist.destroy_process_group()


def _train(config, steps=8, dtype=None):
    import deepcompile

    torch._dynamo.reset()
    model = _models.build_model("llama").cuda()
    engine = deepcompile.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-3),
                                    config={**config, "param_dtype": dtype})
    losses = []
    for step in range(steps):
        batch = {k: v.cuda() for k, v in _models.local_batch("llama", step, 0, 1).items()}
        loss = _models.loss_of(engine(**batch))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def _reference(steps=8):
    model = _models.build_model("llama").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        batch = {k: v.cuda() for k, v in _models.local_batch("llama", step, 0, 1).items()}
        loss = _models.loss_of(model(**batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("passes", [("prefetch", "bucket_reduce"),
                                    ("prefetch", "bucket_reduce", "selective_unshard")])
@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_parity_on_one_gpu(nccl, compiler, passes):
    torch.backends.cuda.matmul.allow_tf32 = False
    engine, losses = _train({"compiler": compiler, "passes": passes, "warmup_steps": 1})
    ref, ref_losses = _reference()
    print(f"{compiler}: max |dloss| {max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e}")
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-4
    state = engine.full_state_dict()
    for name, p in ref.named_parameters():
        assert (state[name] - p.detach().cpu()).abs().max().item() < 1e-4, name
    stats = engine.comm_stats()   # world size 1: no collective at all
    assert stats["all_gather"]["count"] == stats["reduce_scatter"]["count"] == 0, stats


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_zero12_parity_on_one_gpu(nccl, compiler, stage):
    """ZeRO-1/2 (bucket_reduce by default): parity; at world size 1 no collective (the replica
    refresh is a local copy of the shard)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    engine, losses = _train({"compiler": compiler, "zero_stage": stage, "warmup_steps": 1})
    ref, ref_losses = _reference()
    print(f"ZeRO-{stage} {compiler}: max |dloss| "
          f"{max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e}")
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-4
    assert engine.comm_stats()["all_gather"]["count"] == 0
    assert engine.comm_stats()["reduce_scatter"]["count"] == 0
    state = engine.full_state_dict()
    for name, p in ref.named_parameters():
        assert (state[name] - p.detach().cpu()).abs().max().item() < 1e-4, name


def test_bf16_profile_memory_against_the_allocator(nccl):
    engine, losses = _train({"compiler": "fx", "warmup_steps": 1, "profile_steps": 1},
                            steps=4, dtype=torch.bfloat16)
    assert all(l == l for l in losses)   # no NaN
    rep = engine.report().to_dict()
    peak = rep["step_summary"]["peak_bytes"]
    print(f"bf16 profile peak {peak / 2**20:.2f} MiB; allocator max "
          f"{torch.cuda.max_memory_allocated() / 2**20:.2f} MiB")
    assert 0 < peak <= torch.cuda.max_memory_allocated()


def test_offload_optimizer_parity_and_budget(nccl):
    """Offloading half the Adam state (a budget below the all-resident peak) trains exactly as
    without offloading; the measured CUDA profile after planning stays within the budget; the
    reloads ran on the copy stream and the step waited for them."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = {"compiler": "fx", "warmup_steps": 1, "passes": ("offload_optimizer",),
            "measure_steps": 0}
    plain, plain_losses = _train({"compiler": "fx", "warmup_steps": 1})
    unbounded, _ = _train(base)
    d = next(p for p in unbounded.report().to_dict()["passes"]
             if p["pass"] == "offload_optimizer")["decisions"]
    assert d["fragments"] == []
    budget = int(d["peak_before"] - d["state_bytes"] // 2)
    engine, losses = _train({**base, "memory_budget": budget})
    rep = engine.report().to_dict()
    d = next(p for p in rep["passes"] if p["pass"] == "offload_optimizer")["decisions"]
    print(f"offloaded {d['offloaded_bytes']} of {d['state_bytes']} bytes; budget {budget}; "
          f"peak {d['peak_before']} -> {d['peak_after']}; offload {rep['offload']}")
    assert d["fragments"] and d["peak_after"] <= budget
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) <= 1e-6
    state, ref = engine.full_state_dict(), plain.full_state_dict()
    assert max((state[k] - ref[k]).abs().max().item() for k in ref) <= 1e-6
    # the plan counts exact bytes; the caching allocator rounds each block up to 512 bytes
    slack = 512 * len(d["fragments"])
    for g in rep["graphs"]:
        for s in g["slots"]:
            assert s["profiles"][-1]["peak_bytes"] <= budget + slack, s["slot"]
    last = rep["offload"]["last_step"]
    assert last["h2d_bytes"] == last["d2h_bytes"] == d["offloaded_bytes"]
