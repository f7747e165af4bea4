"""GPU checks (NCCL, CUDA events, memory_allocated); skipped without CUDA.

Run on a machine with one GPU:  python -m pytest tests/test_gpu.py -q -s
World size 1 still gathers and reduces through NCCL. Not yet run (no GPU in the session that
wrote it).
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
    assert engine.comm_stats()["all_gather"]["count"] > 0


def test_bf16_profile_memory_against_the_allocator(nccl):
    engine, losses = _train({"compiler": "fx", "warmup_steps": 1, "profile_steps": 1},
                            steps=4, dtype=torch.bfloat16)
    assert all(l == l for l in losses)   # no NaN
    rep = engine.report().to_dict()
    peak = rep["step_summary"]["peak_bytes"]
    print(f"bf16 profile peak {peak / 2**20:.2f} MiB; allocator max "
          f"{torch.cuda.max_memory_allocated() / 2**20:.2f} MiB")
    assert 0 < peak <= torch.cuda.max_memory_allocated()
