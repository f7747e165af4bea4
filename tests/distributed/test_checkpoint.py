"""Checkpoints on torch.distributed.checkpoint (src/deepcompile/checkpoint.py): saved on 2 ranks
and resumed on 1 and 2 ranks (and 4 in the full suite) and at another ZeRO stage with the
losses of uninterrupted training; an asynchronous save holds the values of the moment it was
called; `client_state` comes back; nothing loads with pickle; `engine.save_pretrained` and
`deepcompile consolidate` write Hugging Face directories that `from_pretrained` loads to the
trained weights; a truncated, missing or planted file fails on every rank with the same error
and changes nothing."""

from __future__ import annotations

import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _models
from _dist import DistributedTestError, run_distributed
from _train import FULL

MODEL = "llama_tied"
# its decoder layers: one in the default run (an engine compiled in 70% of the time of two), two
# in the full suite ([Note: the core matrix] in tests/_train.py)
LAYERS = 2 if FULL else 1
TOTAL = 6      # optimizer steps of the uninterrupted run
SAVE_AT = 3


def _build(model: str):
    if model == MODEL:
        torch.manual_seed(_models.SEED)
        return _models._llama(tie=True, layers=LAYERS).float().train()
    return _models.build_model(model)


def _engine(stage: int, world_model: str = MODEL):
    import deepcompile

    torch._dynamo.reset()
    model = _build(world_model)
    return deepcompile.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-2,
                                                           weight_decay=0.1),
                                  deepcompile.Config(compiler="fx", zero_stage=stage))


def _steps(engine, rank, world, first, last, model=MODEL):
    losses = []
    for step in range(first, last):
        loss = _models.loss_of(engine(**_models.local_batch(model, step, rank, world)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _full_optimizer(engine) -> dict:
    """Adam's moments of every parameter, gathered (full, flat), and the steps."""
    out = {}
    by_shard = {id(e.shard): e for e in engine._registry}
    for p, st in engine.optimizer.state.items():
        e = by_shard[id(p)]
        for k, v in st.items():
            if v.dim() == 1:
                out[f"{e.name}/{k}"] = engine._comm.all_gather(v.detach(), count=False)[: e.numel].clone()
            else:
                out[f"{e.name}/{k}"] = v.detach().clone()
    return out


def _save_job(rank, world, tmp):
    engine = _engine(3)
    losses = _steps(engine, rank, world, 0, SAVE_AT)
    saved = {"state": engine.full_state_dict(), "optim": _full_optimizer(engine)}
    client = {"epoch": 1, "position": 1234, "rng": torch.arange(4), "name": "run-a"}
    out = {"returned": engine.save_checkpoint(f"{tmp}/ckpt", client_state=client)}
    future = engine.save_checkpoint(f"{tmp}/ckpt_async", client_state={"k": rank}, async_save=True)
    losses += _steps(engine, rank, world, SAVE_AT, SAVE_AT + 1)   # changes every shard meanwhile
    out["async_result"] = future.result(timeout=300)
    losses += _steps(engine, rank, world, SAVE_AT + 1, TOTAL)
    engine.save_pretrained(f"{tmp}/pretrained")
    out.update(losses=losses, saved=saved, final=engine.full_state_dict(),
               files=sorted(os.listdir(f"{tmp}/ckpt")))
    return out


def _resume_job(rank, world, tmp, stage, name):
    import unittest.mock as mock

    engine = _engine(stage)
    forbidden = mock.patch.multiple(pickle, load=_no_pickle, loads=_no_pickle,
                                    Unpickler=_NoUnpickler)
    with forbidden:
        client = engine.load_checkpoint(f"{tmp}/{name}")
    out = {"client": client, "steps": engine._optimizer_steps,
           "state": engine.full_state_dict(), "optim": _full_optimizer(engine)}
    out["losses"] = _steps(engine, rank, world, SAVE_AT, TOTAL)
    return out


def _no_pickle(*args, **kwargs):
    raise AssertionError("a checkpoint was loaded with pickle")


class _NoUnpickler:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a checkpoint was loaded with pickle")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    per_rank = run_distributed(_save_job, 2, str(tmp), timeout=600)
    return tmp, per_rank


def _max_dev(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# resuming on more ranks than saved (4) is the full suite's: the core loads a checkpoint of
# 2-way shards (HSDP 2x2) into 4 shards in test_layouts.py ([Note: the core matrix] in
# tests/_train.py)
@pytest.mark.parametrize("world,stage,name", [
    (1, 3, "ckpt"), pytest.param(4, 1, "ckpt", marks=pytest.mark.extended), (2, 2, "ckpt_async")],
    ids=["2to1-zero3", "2to4-zero1", "async-2to2-zero2"])
def test_resume_on_another_world_size_and_stage(saved, world, stage, name):
    tmp, first = saved
    per_rank = run_distributed(_resume_job, world, str(tmp), stage, name, timeout=600)
    whole = [sum(v) / len(v) for v in zip(*(r["losses"] for r in first))]
    for r in per_rank:
        assert r["steps"] == SAVE_AT
        # bitwise: the checkpoint holds the values of the moment save_checkpoint was called
        assert _max_dev(r["state"], first[0]["saved"]["state"]) == 0.0
        assert _max_dev(r["optim"], first[0]["saved"]["optim"]) == 0.0
        if name == "ckpt":
            assert r["client"]["position"] == 1234 and r["client"]["name"] == "run-a"
            assert torch.equal(r["client"]["rng"], torch.arange(4))
        else:
            assert r["client"] == {"k": 0}   # rank 0's
    resumed = [sum(v) / len(v) for v in zip(*(r["losses"] for r in per_rank))]
    dev = max(abs(a - b) for a, b in zip(resumed, whole[SAVE_AT:]))
    print(f"\n[checkpoint 2->{world} zero{stage} {name}] loss deviation from uninterrupted: {dev:.3g}")
    assert len(resumed) == TOTAL - SAVE_AT
    assert dev <= 1e-5, (resumed, whole[SAVE_AT:])


def test_layout_and_returned_paths(saved):
    tmp, per_rank = saved
    for r in per_rank:
        assert r["returned"] == f"{tmp}/ckpt" and r["async_result"] == f"{tmp}/ckpt_async"
        files = r["files"]
        assert "deepcompile-checkpoint.json" in files
        versions = [f for f in files if f.startswith("v")]
        assert len(versions) == 1 and not [f for f in files if f.startswith(".tmp-")], files
    version = Path(tmp, "ckpt", json.loads(Path(tmp, "ckpt", "deepcompile-checkpoint.json")
                                           .read_text())["current"])
    names = sorted(p.name for p in version.iterdir())
    # each rank's random number generators; no plan: saved during the setup (test_resume.py)
    assert names == ["__0_0.distcp", "__1_0.distcp", "client_state.pt", "commit.json",
                     "dcp_metadata.json", "hf_config.json", "hf_generation_config.json",
                     "rng-00000.pt", "rng-00001.pt", "state.json"], names
    assert not list(version.glob(".metadata"))   # DCP's pickled metadata is never written


def _from_pretrained(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}


def test_engine_save_pretrained(saved):
    tmp, per_rank = saved
    loaded = _from_pretrained(tmp / "pretrained")
    assert _max_dev(loaded, per_rank[0]["final"]) == 0.0
    assert loaded["lm_head.weight"].data_ptr() == loaded["model.embed_tokens.weight"].data_ptr()


def test_consolidate_command(saved, tmp_path, capsys):
    """The console entry point once (`python -m deepcompile consolidate`); its options and its
    error through `cli.main` in this process."""
    from deepcompile.tools import cli

    tmp, per_rank = saved
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    r = subprocess.run([sys.executable, "-m", "deepcompile", "consolidate", str(tmp / "ckpt"),
                        str(tmp_path / "hf")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert _max_dev(_from_pretrained(tmp_path / "hf"), per_rank[0]["saved"]["state"]) == 0.0
    rc = cli.main(["consolidate", str(tmp / "ckpt"), str(tmp_path / "hf16"),
                   "--dtype", "bfloat16", "--max-shard-size", "20KB"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "hf16" / "model.safetensors.index.json").exists()
    loaded = _from_pretrained(tmp_path / "hf16")
    assert all(v.dtype == torch.bfloat16 for v in loaded.values())
    assert _max_dev(loaded, {k: v.to(torch.bfloat16) for k, v in
                             per_rank[0]["saved"]["state"].items()}) == 0.0
    capsys.readouterr()
    rc = cli.main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "x")])
    assert rc == 1 and "no checkpoint at" in capsys.readouterr().err


# ---- damaged checkpoints ---------------------------------------------------------------------------
# what is damaged is the checkpoint's files: the default run damages a checkpoint of the MLP (an
# engine compiled in ~1 s), the full suite that of `saved` (the tiny Llama's)
DAMAGED_MODEL = MODEL if FULL else "mlp"


def _save_two_steps_job(rank, world, path, model):
    engine = _engine(3, model)
    _steps(engine, rank, world, 0, 2, model=model)   # one step past the damage job's state
    engine.save_checkpoint(path, client_state={"epoch": 1, "position": 1234,
                                               "rng": torch.arange(4), "name": "run-a"})


def _damage_job(rank, world, cases, model=MODEL):
    engine = _engine(3, model)
    _steps(engine, rank, world, 0, 1, model=model)
    before = engine.full_state_dict()
    opt_before = _full_optimizer(engine)
    out = {}
    for case, path in cases:
        try:
            engine.load_checkpoint(path)
            out[case] = ("loaded", None)
        except Exception as e:  # noqa: BLE001
            out[case] = (type(e).__name__, str(e))
    out["unchanged"] = (_max_dev(engine.full_state_dict(), before) == 0.0 and
                        _max_dev(_full_optimizer(engine), opt_before) == 0.0 and
                        engine._optimizer_steps == 1)
    out["trains"] = _steps(engine, rank, world, 1, 2, model=model)
    return out


class _Planted:
    def __reduce__(self):
        return (os.system, ("echo planted",))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst / json.loads((dst / "deepcompile-checkpoint.json").read_text())["current"]


def test_damaged_checkpoints_fail_on_every_rank_and_change_nothing(saved, tmp_path):
    tmp, _ = saved
    source = tmp / "ckpt"
    if DAMAGED_MODEL != MODEL:
        source = tmp_path / "source"
        run_distributed(_save_two_steps_job, 2, str(source), DAMAGED_MODEL, timeout=600)
    cases = {}
    v = _copy(source, tmp_path / "truncated")
    data = v / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    cases["truncated"] = (tmp_path / "truncated", "__1_0.distcp has", "the save wrote")
    v = _copy(source, tmp_path / "missing")
    (v / "__0_0.distcp").unlink()
    cases["missing"] = (tmp_path / "missing", "__0_0.distcp is missing", "damaged")
    _copy(source, tmp_path / "pointer")
    (tmp_path / "pointer" / "deepcompile-checkpoint.json").write_text("{not json")
    cases["pointer"] = (tmp_path / "pointer", "deepcompile-checkpoint.json is unreadable", "damaged")
    v = _copy(source, tmp_path / "uncommitted")
    (v / "commit.json").unlink()
    cases["uncommitted"] = (tmp_path / "uncommitted", "not a complete checkpoint", "commit.json")
    # a planted pickle in place of client_state.pt, with the size commit.json records
    v = _copy(source, tmp_path / "planted")
    planted = pickle.dumps(_Planted())
    size = (v / "client_state.pt").stat().st_size
    (v / "client_state.pt").write_bytes(planted + b"\0" * (size - len(planted)))
    cases["planted"] = (tmp_path / "planted", "is damaged: reading it failed", "")
    # bytes flipped inside a tensor record (sizes intact)
    v = _copy(source, tmp_path / "corrupt")
    raw = bytearray((v / "__0_0.distcp").read_bytes())
    raw[:64] = b"\xff" * 64
    (v / "__0_0.distcp").write_bytes(bytes(raw))
    cases["corrupt"] = (tmp_path / "corrupt", "is damaged: reading it failed", "")
    cases["nothing"] = (tmp_path / "does-not-exist", "no checkpoint at", "")
    per_rank = run_distributed(_damage_job, 2, [(k, str(c[0])) for k, c in cases.items()],
                               DAMAGED_MODEL, timeout=600)
    for case, (_path, *fragments) in cases.items():
        results = [r[case] for r in per_rank]
        assert results[0][0] == "CheckpointError", (case, results[0])
        assert results[0] == results[1], (case, results)   # the same error on every rank
        for f in fragments:
            assert f in results[0][1], (case, f, results[0][1])
        print(f"\n[damaged {case}] {results[0][1][:160]}")
    for r in per_rank:
        assert r["unchanged"] and len(r["trains"]) == 1


# ---- a save killed on a rank (issue 17): never a mixed checkpoint ----------------------------------
KILL_POINTS = {
    # point: (rank killed, the version a load must then find)
    "rank1-writing-data": (1, 1),
    "rank0-writing-state": (0, 1),
    "rank0-before-commit": (0, 1),
    "rank0-before-pointer": (0, 1),
    "rank0-after-pointer": (0, 2),
}


def _kill():
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _kill_job(rank, world, path, expected, point):
    import unittest.mock as mock

    from deepcompile import _dcp, checkpoint

    engine = _engine(3, "mlp")
    _steps(engine, rank, world, 0, 1, model="mlp")
    engine.save_checkpoint(path)
    v1 = engine.full_state_dict()
    _steps(engine, rank, world, 1, 2, model="mlp")   # still warming up: nothing profiled
    v2 = engine.full_state_dict()
    if rank == 0:
        torch.save({1: v1, 2: v2}, expected)
    engine._comm.all_gather_object(None)
    killed_rank, _ = KILL_POINTS[point]
    patches = []
    if rank == killed_rank:
        if point == "rank1-writing-data":
            real = _dcp.JsonWriter.write_data

            def write_data(self, plan, planner):
                real(self, plan, planner)   # this rank's file is written, then it dies
                _kill()
            patches.append(mock.patch.object(_dcp.JsonWriter, "write_data", write_data))
        elif point == "rank0-writing-state":
            patches.append(mock.patch.object(checkpoint, "_write_rank0_files",
                                             lambda *a, **k: _kill()))
        elif point == "rank0-before-commit":
            patches.append(mock.patch.object(checkpoint, "_publish", lambda *a, **k: _kill()))
        elif point == "rank0-before-pointer":
            real_json = checkpoint.write_json_atomic

            def write_json(p, obj, **kw):
                if Path(p).name == checkpoint.POINTER:
                    _kill()
                return real_json(p, obj, **kw)
            patches.append(mock.patch.object(checkpoint, "write_json_atomic", write_json))
        elif point == "rank0-after-pointer":
            patches.append(mock.patch.object(checkpoint, "_cleanup", lambda *a, **k: _kill()))
    for p in patches:
        p.start()
    engine.save_checkpoint(path)
    return "survived"


def _verify_job(rank, world, cases):
    engine = _engine(3, "mlp")
    out = {}
    for point, path, expected in cases:
        try:
            engine.load_checkpoint(path)
        except Exception as e:  # noqa: BLE001
            out[point] = ("error", str(e))
            continue
        state = engine.full_state_dict()
        want = torch.load(expected, weights_only=True)
        matches = [v for v, s in want.items() if _max_dev(state, s) == 0.0]
        out[point] = ("loaded", engine._optimizer_steps, matches)
    return out


def test_a_save_killed_on_any_rank_never_leaves_a_mixed_checkpoint(tmp_path):
    cases = []
    for point in KILL_POINTS:
        path, expected = tmp_path / point, tmp_path / f"{point}.pt"
        with pytest.raises(DistributedTestError) as info:
            run_distributed(_kill_job, 2, str(path), str(expected), point, timeout=120)
        assert "exited with code -9" in str(info.value), str(info.value)[-2000:]
        cases.append((point, str(path), str(expected)))
    per_rank = run_distributed(_verify_job, 2, cases, timeout=300)
    for point, (_killed, version) in KILL_POINTS.items():
        results = [r[point] for r in per_rank]
        print(f"\n[killed {point}] {results[0]}")
        assert results[0] == results[1], results
        assert results[0] == ("loaded", version, [version]), (point, results[0])
