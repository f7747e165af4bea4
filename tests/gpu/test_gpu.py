"""GPU checks (NCCL, CUDA events, memory_allocated); skipped without CUDA.

Run on a machine with one GPU:  python -m pytest tests/gpu/test_gpu.py -q -s
At world size 1 nothing is communicated: a gather is the local shard (a view, or a cast under
param_dtype) and a reduction the local gradient; the comm counters stay at 0.
"""

from __future__ import annotations

import functools
import gc
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


def _train(config, steps=8, dtype=None, chunk=None):
    """Train the tiny Llama; returns (engine, losses, bytes the device held before the engine
    was built: earlier tests' tensors, cuBLAS workspaces — not this engine's)."""
    import deepcompile
    from _train import chunk_bytes

    torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    model = _models.build_model("llama").cuda()
    base = torch.cuda.memory_allocated()
    with chunk_bytes(chunk):
        engine = deepcompile.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-3),
                                        config={**config, "param_dtype": dtype})
    losses = []
    for step in range(steps):
        batch = {k: v.cuda() for k, v in _models.local_batch("llama", step, 0, 1).items()}
        loss = _models.loss_of(engine(**batch))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses, base


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
    engine, losses, _ = _train({"compiler": compiler, "passes": passes, "warmup_steps": 1})
    ref, ref_losses = _reference()
    print(f"{compiler}: max |dloss| {max(abs(a - b) for a, b in zip(losses, ref_losses)):.2e}")
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-4
    stats = engine.comm_stats()   # world size 1: training gathers and reduces nothing
    assert stats["all_gather"]["count"] == stats["reduce_scatter"]["count"] == 0, stats
    state = engine.full_state_dict()   # (which counts its own gathers: tests/distributed/test_counts.py)
    for name, p in ref.named_parameters():
        assert (state[name] - p.detach().cpu()).abs().max().item() < 1e-4, name


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_zero12_parity_on_one_gpu(nccl, compiler, stage):
    """ZeRO-1/2 (bucket_reduce by default): parity; at world size 1 no collective (the replica
    refresh is a local copy of the shard)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    engine, losses, _ = _train({"compiler": compiler, "zero_stage": stage, "warmup_steps": 1})
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
    engine, losses, _ = _train({"compiler": "fx", "warmup_steps": 1, "profile_steps": 1},
                               steps=4, dtype=torch.bfloat16)
    assert all(l == l for l in losses)   # no NaN
    rep = engine.report().to_dict()
    peak = rep["step_summary"]["peak_bytes"]
    print(f"bf16 profile peak {peak / 2**20:.2f} MiB; allocator max "
          f"{torch.cuda.max_memory_allocated() / 2**20:.2f} MiB")
    assert 0 < peak <= torch.cuda.max_memory_allocated()


def test_bf16_kept_copies_at_world_size_1(nccl):
    """At world size 1 in bf16 `selective_unshard` keeps the cast copies (cast once per
    optimizer step by the refresh, on the device): fx trains bitwise as without it."""
    plain, plain_losses, _ = _train({"compiler": "fx", "passes": (), "warmup_steps": 1},
                                    dtype=torch.bfloat16)
    kept, kept_losses, _ = _train({"compiler": "fx", "passes": ("selective_unshard",),
                                   "warmup_steps": 1, "measure_steps": 0}, dtype=torch.bfloat16)
    (entry,) = [p for p in kept.report().to_dict()["passes"] if p["pass"] == "selective_unshard"]
    assert entry["kept"] and entry["decisions"]["keep"], entry
    assert kept_losses == plain_losses
    a, b = plain.full_state_dict(), kept.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


CHUNK = 4096   # the tiny Llama in ~16 chunks: offloading moves whole chunks


def _offload_decisions(engine, last=False):
    plans = [p for p in engine.report().to_dict()["passes"] if p["pass"] == "offload_optimizer"]
    return plans[-1 if last else 0]["decisions"]


def _offload_under(compiler, own_budget, dtype=None, exact=True, host_step="auto"):
    """Train without the pass, unbounded with it, then under the budget `own_budget(decisions of
    the unbounded run)` (in that run's terms) read in this process's terms: `memory_allocated`
    counts everything the process holds (the first GPU run derived a budget from an earlier
    engine's figures while that engine, and the one before, were still alive: unattainable,
    nothing offloaded). Checks the plan holds, training is bitwise the same, and the measured
    profiles after planning stay within the budget; returns (decisions, report's offload).
    `exact=False`: training within rounding (the host step runs torch's CPU kernel);
    `host_step`: Config.host_step of the runs with the pass."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = {"compiler": compiler, "warmup_steps": 1, "passes": ("offload_optimizer",),
            "measure_steps": 0, "host_step": host_step}
    plain, plain_losses, _ = _train({"compiler": compiler, "warmup_steps": 1, "passes": ()},
                                    chunk=CHUNK, dtype=dtype)
    ref = plain.full_state_dict()
    del plain
    unbounded, _, held0 = _train(base, chunk=CHUNK, dtype=dtype)
    d = _offload_decisions(unbounded)
    assert d["chunks"] == []
    own = own_budget(d) - held0
    del unbounded
    gc.collect()
    budget = int(torch.cuda.memory_allocated() + own)
    engine, losses, _ = _train({**base, "memory_budget": budget}, chunk=CHUNK, dtype=dtype)
    rep = engine.report().to_dict()
    d = _offload_decisions(engine)
    print(f"offloaded {d['offloaded_bytes']} of {d['state_bytes']} bytes of state, "
          f"{d['offloaded_grad_bytes']} of gradients; budget {budget}; peak {d['peak_before']} "
          f"-> {d['peak_after']}; offload {rep['offload']}")
    assert not d["unattainable"], d["reason"]
    assert d["chunks"] and d["peak_after"] <= budget
    state_now = engine.full_state_dict()
    if exact:
        assert losses == plain_losses
        assert all(torch.equal(state_now[k], ref[k]) for k in ref)
    else:
        assert losses == pytest.approx(plain_losses, rel=1e-3)
        for k in ref:
            torch.testing.assert_close(state_now[k], ref[k], rtol=1e-4, atol=1e-5)
    for g in rep["graphs"]:
        for s in g["slots"]:
            prof = s["profiles"][-1]
            if prof["label"] == "after offload_optimizer":
                assert prof["peak_bytes"] <= budget, s["slot"]
    assert rep["offload"]["pinned"]
    return d, rep["offload"]


@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_offload_optimizer_parity_and_budget(nccl, compiler):
    """Offloading half the optimizer state (a budget below the all-resident peak) trains
    bitwise as without offloading, within the budget; the copies ran on the copy streams from
    pinned memory."""
    d, off = _offload_under(compiler, lambda d: d["peak_before"] - d["state_bytes"] // 2)
    assert off["measured_copy_s"] > 0
    last = off["last_step"]
    assert last["h2d_bytes"] == last["d2h_bytes"] == d["offloaded_bytes"]


@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_gradients_on_the_host_parity_and_budget(nccl, compiler):
    """Offload tier 2 on CUDA ([Note: gradients on the host] in runtime/offload/grads.py): a budget
    below what all the state off the device reaches (halfway to all state and all gradients
    off) sends gradients to the host, from pinned memory on the copy streams, and trains
    bitwise the same within the budget."""
    from deepcompile.runtime import offload

    d, off = _offload_under(compiler, lambda d: (d["lowest_state_peak_bytes"]
                                                 + d["lowest_grads_peak_bytes"]) // 2)
    assert any(c["tier"] == offload.GRADS for c in d["chunks"])
    # bytes copied, against the device's count of them (rounded up to 512 per block)
    assert 0 < off["last_step"]["grad_d2h_bytes"] <= d["offloaded_grad_bytes"]


@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_masters_on_the_host_parity_and_budget(nccl, compiler):
    """Offload tier 3 on CUDA ([Note: masters on the host] in offload/masters.py), bf16 compute:
    at the lowest peak the pass can reach, masters go to the host (pinned, on the copy streams),
    the gathers read their bf16 copies, and training is bitwise the same within the budget
    (streamed through the device's step: Config.host_step="never")."""
    from deepcompile.runtime import offload

    d, off = _offload_under(compiler, lambda d: d["lowest_peak_bytes"], dtype=torch.bfloat16,
                            host_step="never")
    assert any(c["tier"] == offload.MASTERS for c in d["chunks"])
    assert off["offloaded_master_bytes"] == d["offloaded_master_bytes"] > 0
    last = off["last_step"]
    assert last["master_d2h_bytes"] == last["master_h2d_bytes"] > 0


@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_the_host_step_parity_and_budget(nccl, compiler):
    """Offload tier 4 on CUDA ([Note: the host step] in offload/host_step.py): the chunks whose
    masters are on the host step there (torch's CPU kernel, from the pinned buffers after their
    events), their bf16 copies go up on the copy stream; within the budget, training within
    rounding of the device's step."""
    from deepcompile.runtime import offload

    d, off = _offload_under(compiler, lambda d: d["lowest_peak_bytes"], dtype=torch.bfloat16,
                            exact=False, host_step="always")
    host = [c for c in d["chunks"] if c["tier"] == offload.HOST]
    assert host and d["host_step"]["chosen"], d["host_step"]
    last = off["last_step"]
    assert last["stepped_on_host"] == len(host) and last["lowp_h2d_bytes"] > 0
    assert last["master_h2d_bytes"] == 0 and off["measured_host_step_s"] > 0


def test_a_released_engine_gives_its_device_memory_back(nccl):
    """tests/distributed/test_release.py on the GPU: dropping the engine frees its device memory (at least
    its flat masters and AdamW's two moments), without torch._dynamo.reset()."""
    engine, _, _ = _train({"compiler": "inductor", "warmup_steps": 1}, steps=4)
    own = 3 * sum(c.nbytes for c in engine._flat.chunks)
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    del engine
    gc.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    print(f"device bytes: with the engine {held}, after releasing it {after}; masters + "
          f"moments {own}")
    assert held - after >= own, (held, after, own)


def test_profiled_node_times_are_the_device_s_behind_a_lead():
    """[Note: profiling ahead of the device] in compiler/profiler.py: a chain of tiny kernels
    issued one by one is host-bound; each node's CUDA events then time the host. With the
    device kept busy longer than the host takes to issue the chain, they time the kernels:
    the sum of node times falls well below the host's time (no NCCL needed)."""
    from torch import fx

    from deepcompile.compiler.profiler import profile_run

    g = fx.Graph()
    x = g.placeholder("x")
    for _ in range(2000):
        x = g.call_function(torch.ops.aten.add.Tensor, (x, 1.0))
    g.output(x)
    gm = fx.GraphModule(torch.nn.Module(), g)
    t = torch.zeros(16, device="cuda")

    def run(lead):
        out, prof = profile_run(gm, [t], slot="chain", version=0, name_of=str, lead_s=lead)
        assert out.item() == 2000
        return prof

    run(0.0)   # warm
    bare = run(0.0)
    ahead = run(2.0 * bare.host_s)
    nodes = sum(n.time_s for n in ahead.nodes)
    print(f"host {ahead.host_s * 1e3:.1f} ms to issue; node times: "
          f"bare {sum(n.time_s for n in bare.nodes) * 1e3:.1f} ms, ahead {nodes * 1e3:.1f} ms")
    assert ahead.lead_s > ahead.host_s
    assert nodes < 0.5 * ahead.host_s
    assert ahead.total_s == pytest.approx(nodes, rel=0.5)


def _steps(engine, start, n):
    losses = []
    for step in range(start, start + n):
        batch = {k: v.cuda() for k, v in _models.local_batch("llama", step, 0, 1).items()}
        loss = _models.loss_of(engine(**batch))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_a_checkpoint_resumes_on_the_gpu(nccl, tmp_path):
    """tests/distributed/test_checkpoint.py on the GPU: saved after 4 steps, loaded into a fresh engine,
    the next 4 steps give the losses and weights of the run that went on (fx, no passes; within
    the parity tests' tolerance: attention's backward may use atomics on a GPU), and the
    optimizer state comes back onto the device."""
    config = {"compiler": "fx", "warmup_steps": 1, "passes": ()}
    engine, _, _ = _train(config, steps=4)
    engine.save_checkpoint(tmp_path / "ckpt")
    went_on = _steps(engine, 4, 4)
    weights = engine.full_state_dict()
    del engine
    resumed, _, _ = _train(config, steps=0)
    resumed.load_checkpoint(tmp_path / "ckpt")
    state = [t for st in resumed.optimizer.state.values() for t in st.values()
             if torch.is_tensor(t) and t.dim() > 0]
    assert state and all(t.is_cuda for t in state)
    again = _steps(resumed, 4, 4)
    assert max(abs(a - b) for a, b in zip(again, went_on)) < 1e-4, (again, went_on)
    for name, w in resumed.full_state_dict().items():
        assert (w - weights[name]).abs().max().item() < 1e-4, name


@pytest.mark.parametrize("compiler", ["fx", "inductor"])
def test_activation_budget_parity_and_budget(nccl, compiler):
    """Saved activations recomputed or offloaded under a budget 25% below what the step's own
    tensors peak at: the re-profiled peak (memory_allocated) is within it, training matches the
    run without the pass (offloaded values come back bit for bit; recomputed ones are the same
    kernels), the copies ran on the copy streams from pinned buffers made once and reused."""
    torch.backends.cuda.matmul.allow_tf32 = False
    plain, plain_losses, base = _train({"compiler": compiler, "warmup_steps": 1, "passes": ()})
    ref = plain.full_state_dict()
    own = max(p.peak_bytes for p in plain._pipeline.latest_profiles().values()) - base
    del plain
    gc.collect()
    budget = int(torch.cuda.memory_allocated() + 0.75 * own)
    engine, losses, _ = _train({"compiler": compiler, "warmup_steps": 1, "measure_steps": 0,
                                "passes": ("activation_budget",), "memory_budget": budget})
    rep = engine.report().to_dict()
    (entry,) = [p for p in rep["passes"] if p["pass"] == "activation_budget"]
    (d,) = entry["decisions"].values()
    print("\n".join(entry["summary"]))
    assert d["choices"] and not d["unattainable"] and entry["kept"]
    for g in rep["graphs"]:
        for s in g["slots"]:
            prof = s["profiles"][-1]
            if prof["label"] == "after activation_budget":
                assert prof["peak_bytes"] <= budget, (s["slot"], prof["peak_bytes"], budget)
    state = engine.full_state_dict()
    print(f"bitwise: losses {losses == plain_losses}, parameters "
          f"{all(torch.equal(state[k], ref[k]) for k in ref)}")
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for k in ref:
        torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6)
    store = engine._runtime.activations
    offloaded = sum(c["action"] == "offload" for c in d["choices"])
    if offloaded:
        assert store.copier.cuda and all(f.is_pinned() for f in store._flat.values())
        assert store.stats["buffers"] == offloaded and store.stats["offloads"] > 3 * offloaded
        store.copier.collect(block=True)
        assert store.copier.seconds["d2h"] > 0 and store.copier.seconds["h2d"] > 0
