"""Checkpoints on torch.distributed.checkpoint (DCP): any world size, any ZeRO stage, async, with
the user's client state, published atomically.

[Note: checkpoint layout] `engine.save_checkpoint(path)` makes `path` a directory holding one
complete checkpoint version and a pointer to it:

    path/deepcompile-checkpoint.json   {"format": 2, "current": "v00000012-1a2b3c4d"}
    path/v00000012-1a2b3c4d/
        __0_0.distcp, __1_0.distcp     DCP data: every rank's slice of every tensor
        dcp_metadata.json              DCP metadata, as JSON (_dcp.py: nothing loads with pickle)
        state.json                     format, world size, ZeRO stage, step counters, parameter
                                       names and shapes, optimizer hyperparameters (JSON)
        client_state.pt                rank 0's `client_state` (torch.save; read back with
                                       torch.load(weights_only=True)), when given
        plan.json                      the plan in force, once final ([Note: the plan in a
                                       checkpoint] in compiler/pipeline.py)
        rng-00000.pt, rng-00001.pt     each rank's random number generators ([Note: random
                                       state in a checkpoint])
        hf_config.json, ...            a Hugging Face model's config (for `consolidate`)
        commit.json                    every file above with its size, written last

Each parameter is stored as one flat tensor of `numel` elements, and every rank writes the part its
shard covers ([r*s, (r+1)*s) of the flattened parameter, s = ceil(numel / S), r its place among the
S ranks the layout shards over: a DTensor with a Shard(0) placement over a gloo copy of that group,
which chunks exactly like the registry's shards; under "hsdp" every group holds the same chunks,
and DCP's planner keeps one writer of each; under "hsdp_zero" the ranks trade pieces first so that
rank r writes piece r, as under "shard": `_in_world_order`). The optimizer state follows the same
rule: a state tensor shaped like the shard is stored flat per parameter (Adam's moments), any other
tensor once (Adam's `step`), any other value in state.json. Loading builds this rank's slices for
the *current* world size and layout, and DCP reads whatever saved chunks overlap them: a checkpoint
of N ranks loads on M, under another layout (runtime/mesh.py) or ZeRO stage (which do not change
what is stored).

[Note: atomic checkpoints] A save writes a new version directory `.tmp-<version>` beside the
published one. Once every rank's data is written (inside DCP's final collective, on rank 0:
`_publish`), rank 0 writes `commit.json`, renames the directory to `<version>`, fsyncs, and only
then replaces the pointer file (a temporary file renamed over it): that rename is the commit.
Older versions are deleted after it. A save killed on any rank at any point therefore leaves
the pointer on the previous complete version (or on the new, complete one), and never anything
mixed; an unpublished `.tmp-*` directory is removed by the next successful save. Loading checks,
on every rank, that the pointed-to version has every file of its `commit.json` with the recorded
size, and the ranks agree on the first error found, so a damaged checkpoint fails on every rank
with the same message, before anything in the engine is changed (the data is read into new
tensors and copied into the shards and the optimizer only when every rank has read it).

[Note: random state in a checkpoint] Every rank writes the state of its random number
generators (torch's CPU generator, the CUDA generator of its device, Python's `random`, numpy's
global one where numpy is installed) to a file of its own, so that dropout and any other random
op of a resumed run draw what the unbroken run drew. They are restored only at the world size
they were saved at: rank r's stream belongs to rank r, and on another number of ranks there is
no rank to give each one to (a warning says they were not restored).

Checkpoint collectives run on a gloo process group of their own (created at the first save or
load), so that an asynchronous save's background thread never interleaves with training's
collectives.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import shutil
import uuid
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import _dcp
from ._ckpt_format import (CLIENT, COMMIT, FORMAT, HF_CONFIG, HF_GENERATION, PLAN, POINTER,
                           STATE, TMP_PREFIX, CheckpointError, hf_config_dicts, persistent_buffers,
                           resolve, rng_file, validate)
from ._files import write_json_atomic

log = logging.getLogger("deepcompile")


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """What a failed DCP call raises (its CheckpointException is a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


# ---- per-engine checkpoint state (the gloo group, a pending asynchronous save) --------------------
class _EngineCheckpointState:
    def __init__(self) -> None:
        self.group = None
        self.mesh = None
        self.pending: Future | None = None


_STATES: "weakref.WeakKeyDictionary[Any, _EngineCheckpointState]" = weakref.WeakKeyDictionary()


def _state(engine) -> _EngineCheckpointState:
    st = _STATES.get(engine)
    if st is None:
        st = _STATES[engine] = _EngineCheckpointState()
    if st.group is None:
        from torch.distributed.device_mesh import DeviceMesh

        group = engine._comm.group
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        st.group = dist.new_group(ranks=ranks, backend="gloo")
        shard = engine._layout.shard
        if shard is engine._layout.world or engine._layout.primary is not None:
            st.mesh = DeviceMesh.from_group(st.group, "cpu")
        else:   # the shard group's ranks (one mesh per group: made by its members only)
            st.mesh = DeviceMesh.from_group(dist.new_group(
                ranks=dist.get_process_group_ranks(shard.group) if shard.world > 1
                else [dist.get_rank()], backend="gloo", use_local_synchronization=True), "cpu")
    return st


def wait(engine) -> None:
    """Wait for this engine's asynchronous save, if one is running; re-raises its error."""
    st = _STATES.get(engine)
    if st is None or st.pending is None:
        return
    pending, st.pending = st.pending, None
    pending.result()


# ---- helpers -------------------------------------------------------------------------------------
def _describe(e: BaseException) -> str:
    """One line: the first underlying error of a DCP CheckpointException (per-rank failures)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = sorted(failures.items())[0]
        if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
            inner = inner[0]   # DCP wraps each exception with its traceback summary
        return f"rank {rank}: {_describe(inner)}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _agree(comm, error: str | None) -> None:
    """Every rank raises the same error if any rank found one (the lowest rank's)."""
    errors = comm.all_gather_object(error)
    first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if first is not None:
        rank, text = first
        raise CheckpointError(text if comm.world == 1 else f"{text} [found by rank {rank}]")


def _rank(engine) -> int:
    """This rank's place among the ranks the checkpoint's chunks span (the layout's shard
    group; hsdp_zero: every rank, `_in_world_order`)."""
    lay = engine._layout
    return lay.world.rank if lay.primary is not None else lay.shard.rank


def _in_world_order(engine, group, pieces: list[torch.Tensor], back: bool = False
                    ) -> list[torch.Tensor]:
    """hsdp_zero's pieces ([Note: pieces in reduction order] in runtime/comm.py) as the
    checkpoint stores them: rank r's chunk is piece r, as "shard" holds it, so that a checkpoint
    loads under every layout. Each rank sends its pieces (one flat buffer) to the rank whose
    chunk they are and receives its chunk from the rank holding it; `back`: the other way, after
    a load. Each tensor is a whole piece (`shard_numel` elements), on the CPU. Other layouts:
    `pieces` as they are."""
    lay = engine._layout
    if lay.primary is None or not pieces:
        return pieces
    me, held = lay.world.rank, lay.primary.rank
    holds = [None] * lay.world.world
    dist.all_gather_object(holds, held, group=group)   # world rank -> the piece it holds
    holder = {piece: rank for rank, piece in enumerate(holds)}
    send_to, recv_from = (held, holder[me]) if not back else (holder[me], held)
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in pieces])
    out = torch.empty_like(flat)
    if send_to == me:
        out.copy_(flat)
    else:
        works = [dist.isend(flat, dist.get_global_rank(group, send_to), group=group),
                 dist.irecv(out, dist.get_global_rank(group, recv_from), group=group)]
        for w in works:
            w.wait()
    sizes = [t.numel() * t.element_size() for t in pieces]
    # each in a storage of its own (DCP's staging copies a tensor's whole storage: `_host`)
    return [part.view(t.dtype).view(t.shape).clone()
            for part, t in zip(torch.split(out, sizes), pieces)]


def _valid(entry, rank: int) -> int:
    """Elements of the flattened parameter that this rank's shard covers (no padding)."""
    s = entry.shard.numel()
    return max(0, min(s, entry.numel - rank * s))


def _dtensor(local: torch.Tensor, numel: int, mesh):
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


def _host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU in a storage of its own: the shards and their optimizer state are views
    of flat buffers (runtime/flat.py), and DCP's staging copies a tensor's whole storage."""
    t = t.detach().to("cpu")
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _params(engine) -> list[list]:
    return [[list(e.names), list(e.shape)] for e in engine._registry]


def _optimizer_index(engine) -> list:
    """Registry entry of every parameter of `optimizer.state_dict()`, in its index order."""
    by_shard = {id(e.shard): e for e in engine._registry}
    return [by_shard.get(id(p)) for g in engine.optimizer.param_groups for p in g["params"]]


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _rng_state(device: torch.device) -> dict:
    """This process's random number generators ([Note: random state in a checkpoint]), as
    what torch.load(weights_only=True) reads back."""
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": [version, torch.tensor(words, dtype=torch.int64), gauss]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words.tolist()), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


# ---- save ----------------------------------------------------------------------------------------
def _collect(engine, ck: _EngineCheckpointState) -> tuple[dict[str, Any], dict]:
    """(the DCP state dict of this rank, the JSON description of the optimizer)."""
    rank, mesh = _rank(engine), ck.mesh
    sd: dict[str, Any] = {}
    chunks: dict[str, tuple[Any, torch.Tensor]] = {}   # key -> (entry, its whole piece)
    for e in engine._registry:
        local = _host(e.shard)
        if e.lowp is not None and local.untyped_storage().data_ptr() == \
                e.shard.untyped_storage().data_ptr():   # a master about to leave (tier 3)
            local = local.clone()
        chunks[f"model/{e.name}"] = (e, local)
    if engine._comm.rank == 0:
        for name, b in persistent_buffers(engine.module).items():
            sd[f"buffer/{name}"] = b.detach().to("cpu")
    osd = engine.optimizer.state_dict()
    index = _optimizer_index(engine)
    groups = []
    for g in osd["param_groups"]:
        hyper, tuples = {}, []
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, tuple):
                tuples.append(k)
                v = list(v)
            if not _jsonable(v):
                raise CheckpointError(f"save_checkpoint: the optimizer's param_groups[{k!r}] holds "
                                      f"a {type(v).__name__}; a checkpoint keeps numbers, strings, "
                                      "booleans, None and lists there")
            hyper[k] = v
        names = [index[i].name if index[i] is not None else None for i in g["params"]]
        if None in names:
            raise CheckpointError("save_checkpoint: the optimizer holds a tensor that is not one "
                                  "of the engine's parameter shards")
        groups.append({"hyper": hyper, "tuples": tuples, "params": names})
    state_spec: dict[str, dict] = {}
    for i, st in osd["state"].items():
        e = index[i]
        spec = state_spec.setdefault(e.name, {})
        for k, v in st.items():
            key = f"optim/{e.name}/{k}"
            if isinstance(v, torch.Tensor) and v.shape == e.shard.shape:
                chunks[key] = (e, _host(v))
                spec[k] = {"kind": "sharded", "dtype": str(v.dtype).removeprefix("torch.")}
            elif isinstance(v, torch.Tensor):
                sd[key] = _host(v)
                spec[k] = {"kind": "replicated", "dtype": str(v.dtype).removeprefix("torch."),
                           "shape": list(v.shape)}
            elif _jsonable(v):
                spec[k] = {"kind": "value", "value": v}
            else:
                raise CheckpointError(f"save_checkpoint: optimizer state {k!r} of {e.name} is a "
                                      f"{type(v).__name__}, which a checkpoint cannot hold")
    ordered = _in_world_order(engine, ck.group, [t for _, t in chunks.values()])
    for (key, (e, _)), t in zip(chunks.items(), ordered):
        sd[key] = _dtensor(_host(t[: _valid(e, rank)]), e.numel, mesh)
    return sd, {"param_groups": groups, "state": state_spec}


def _client_bytes(client_state: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(client_state, buf)
    data = buf.getvalue()
    try:   # what cannot be read back safely is refused now, not at resume time
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            "save_checkpoint: client_state must load with torch.load(weights_only=True) "
            "(tensors, numbers, strings, lists, tuples, dicts...); it does not: "
            f"{str(e).splitlines()[0]}") from None
    return data


def _write_rank0_files(tmp: Path, state: dict, client: bytes | None, module,
                       plan: dict | None) -> None:
    tmp.mkdir(parents=True, exist_ok=False)
    write_json_atomic(tmp / STATE, state)
    if plan is not None:
        write_json_atomic(tmp / PLAN, plan)
    if client is not None:
        with open(tmp / CLIENT, "wb") as f:
            f.write(client)
            f.flush()
            os.fsync(f.fileno())
    config, generation = hf_config_dicts(module)
    if config is not None:
        write_json_atomic(tmp / HF_CONFIG, config)
    if generation is not None:
        write_json_atomic(tmp / HF_GENERATION, generation)


def _publish(root: Path, version: str) -> None:
    """Rank 0, once every rank's data is on disk: commit marker, rename, pointer (the commit),
    then the older versions go ([Note: atomic checkpoints])."""
    tmp = root / f"{TMP_PREFIX}{version}"
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    write_json_atomic(tmp / COMMIT, {"format": FORMAT, "version": version, "files": files})
    _fsync_dir(tmp)
    os.rename(tmp, root / version)
    _fsync_dir(root)
    write_json_atomic(root / POINTER, {"format": FORMAT, "current": version})
    _fsync_dir(root)
    _cleanup(root, keep=version)


def _cleanup(root: Path, keep: str) -> None:
    for p in root.iterdir():
        if p.name != keep and p.is_dir() and (p.name.startswith("v") or
                                              p.name.startswith(TMP_PREFIX)) \
                and ((p / COMMIT).exists() or (p / STATE).exists() or p.name.startswith(TMP_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


def save(engine, path: str | os.PathLike, client_state: Any = None,
         async_save: bool = False) -> str | Future:
    import torch.distributed.checkpoint as dcp

    comm = engine._comm
    wait(engine)
    st = _state(engine)
    root = Path(path)
    error, client = None, None
    if engine._micro_steps:
        error = (f"save_checkpoint: {engine._micro_steps} micro-steps are accumulated; save at an "
                 "optimizer-step boundary (after engine.step() returned True)")
    elif comm.rank == 0 and client_state is not None:
        try:
            client = _client_bytes(client_state)
        except CheckpointError as e:
            error = str(e)
    _agree(comm, error)
    version = comm.broadcast_object(f"v{engine._optimizer_steps:08d}-{uuid.uuid4().hex[:8]}"
                                    if comm.rank == 0 else None)
    tmp = root / f"{TMP_PREFIX}{version}"
    error, sd, optim = None, None, None
    rng = _rng_state(engine.device)   # [Note: random state in a checkpoint]
    try:
        with engine._offload.masters_home():   # [Note: masters on the host]: read them
            sd, optim = _collect(engine, st)
        if comm.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if root.exists() and not root.is_dir():
                raise CheckpointError(f"save_checkpoint: {root} exists and is not a directory")
            # [Note: the plan in a checkpoint] in compiler/pipeline.py (JSON as the cache's)
            plan = engine._pipeline.checkpoint_plan()
            plan = None if plan is None else json.loads(json.dumps(plan, default=str))
            state = {"format": FORMAT, "world_size": comm.world,
                     "layout": engine._layout.name, "group_size": engine._layout.group_size,
                     "zero_stage": engine.config.zero_stage,
                     "optimizer_steps": engine._optimizer_steps, "params": _params(engine),
                     "dtypes": {e.name: str(e.shard.dtype).removeprefix("torch.")
                                for e in engine._registry},
                     "buffers": sorted(persistent_buffers(engine.module)),
                     "optimizer": optim, "client_state": client is not None,
                     "loss_scaler": engine._scaler.state_dict() if engine._scaler else None,
                     "config": engine.config.to_dict(), "plan": plan is not None, "rng": True}
            _write_rank0_files(tmp, state, client, engine.module, plan)
    except (CheckpointError, OSError) as e:
        error = str(e) if isinstance(e, CheckpointError) else f"save_checkpoint: {root}: {e}"
    _agree(comm, error)
    try:   # every rank's own file, in the directory rank 0 made
        with open(tmp / rng_file(comm.rank), "wb") as f:
            torch.save(rng, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        error = f"save_checkpoint: {root}: {e}"
    _agree(comm, error)
    writer = _dcp.JsonWriter(tmp, on_finish=lambda: _publish(root, version))
    if not async_save:
        try:
            dcp.save(sd, storage_writer=writer, process_group=st.group)
        except _dcp_errors() as e:  # DCP raises the same on every rank
            raise CheckpointError(f"save_checkpoint: writing {root} failed (the previous "
                                  f"checkpoint there, if any, is intact): {e}") from e
        return str(root)
    inner = dcp.async_save(sd, storage_writer=writer, process_group=st.group)
    inner = getattr(inner, "upload_completion", inner)
    done: Future = Future()

    def finished(f: Future) -> None:
        try:
            f.result()
        except _dcp_errors() as e:
            done.set_exception(CheckpointError(
                f"save_checkpoint(async_save=True): writing {root} failed (the previous "
                f"checkpoint there, if any, is intact): {e}"))
        else:
            done.set_result(str(root))
    inner.add_done_callback(finished)
    st.pending = done
    return done


# ---- load ----------------------------------------------------------------------------------------
def _check_matches(engine, state: dict, version: Path) -> None:
    saved, mine = state["params"], _params(engine)
    if saved != mine:
        diff = next(((a, b) for a, b in zip(saved, mine) if a != b),
                    (f"{len(saved)} parameters", f"{len(mine)}"))
        raise CheckpointError(f"load_checkpoint: {version} holds other parameters than this "
                              f"model (saved {diff[0]}, model {diff[1]})")
    groups = state["optimizer"]["param_groups"]
    index = _optimizer_index(engine)
    mine_groups, i = [], 0
    for g in engine.optimizer.param_groups:
        mine_groups.append([index[i + j].name for j in range(len(g["params"]))])
        i += len(g["params"])
    if [g["params"] for g in groups] != mine_groups:
        raise CheckpointError(f"load_checkpoint: {version} was saved with other optimizer "
                              "parameter groups than this engine's optimizer")
    if engine._micro_steps:
        raise CheckpointError(f"load_checkpoint: {engine._micro_steps} micro-steps are "
                              "accumulated; load at an optimizer-step boundary")


def _targets(engine, state: dict, mesh) -> dict[str, Any]:
    rank = _rank(engine)
    targets: dict[str, Any] = {}
    for e in engine._registry:
        targets[f"model/{e.name}"] = _dtensor(
            torch.empty(_valid(e, rank), dtype=e.shard.dtype), e.numel, mesh)
    for name in state.get("buffers", []):
        targets[f"buffer/{name}"] = None   # filled below from the module's buffer
    buffers = persistent_buffers(engine.module)
    for name in state.get("buffers", []):
        if name not in buffers:
            raise CheckpointError(f"load_checkpoint: the checkpoint has buffer {name}, which this "
                                  "model does not")
        targets[f"buffer/{name}"] = torch.empty_like(buffers[name], device="cpu")
    entries = {e.name: e for e in engine._registry}
    for name, spec in state["optimizer"]["state"].items():
        e = entries[name]
        for k, s in spec.items():
            dtype = _dcp._dtype(s.get("dtype", "float32"))
            if s["kind"] == "sharded":
                targets[f"optim/{name}/{k}"] = _dtensor(torch.empty(_valid(e, rank), dtype=dtype),
                                                        e.numel, mesh)
            elif s["kind"] == "replicated":
                targets[f"optim/{name}/{k}"] = torch.empty(s["shape"], dtype=dtype)
    return targets


def _apply(engine, state: dict, targets: dict[str, Any], group) -> None:
    engine._drop_unused_prefetches()   # a parked gather read the shards about to be replaced
    entries = {e.name: e for e in engine._registry}
    # every sharded tensor read, as whole pieces (zero past the parameter's end), in this
    # rank's order (hsdp_zero: `_in_world_order`, back)
    keys = [(f"model/{e.name}", e) for e in engine._registry] + [
        (f"optim/{name}/{k}", entries[name]) for name, spec in state["optimizer"]["state"].items()
        for k, s in spec.items() if s["kind"] == "sharded"]
    whole = []
    for key, e in keys:
        local = targets[key].to_local()
        full = torch.zeros(e.shard.numel(), dtype=local.dtype)
        full[: local.numel()] = local
        whole.append(full)
    pieces = dict(zip([k for k, _ in keys], _in_world_order(engine, group, whole, back=True)))
    with torch.no_grad():
        for e in engine._registry:
            e.shard.copy_(pieces[f"model/{e.name}"])
        buffers = persistent_buffers(engine.module)
        for name in state.get("buffers", []):
            buffers[name].copy_(targets[f"buffer/{name}"])
    engine._shards_changed(frozen_too=True)
    positions = {e.name: i for i, e in enumerate(_optimizer_index(engine)) if e is not None}
    opt_state = {}
    for name, spec in state["optimizer"]["state"].items():
        e = entries[name]
        st = {}
        for k, s in spec.items():
            if s["kind"] == "sharded":
                st[k] = pieces[f"optim/{name}/{k}"]
            elif s["kind"] == "replicated":
                st[k] = targets[f"optim/{name}/{k}"]
            else:
                st[k] = s["value"]
        opt_state[positions[name]] = st
    current = engine.optimizer.state_dict()["param_groups"]
    groups = []
    for g, saved in zip(current, state["optimizer"]["param_groups"]):
        new = {k: tuple(v) if k in saved["tuples"] else v for k, v in saved["hyper"].items()}
        new["params"] = g["params"]
        groups.append(new)
    engine.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    engine._optimizer_steps = state["optimizer_steps"]
    engine._state.optimizer_steps = state["optimizer_steps"]
    if engine._scaler is not None and state.get("loss_scaler"):
        engine._scaler.load_state_dict(state["loss_scaler"])


def load(engine, path: str | os.PathLike) -> Any:
    import torch.distributed.checkpoint as dcp

    comm = engine._comm
    wait(engine)
    engine._runtime.settle()   # nothing may still read the shards this load overwrites
    st = _state(engine)
    root = Path(path)
    found = None
    if comm.rank == 0:   # one rank picks the version: every rank reads the same one
        try:
            resolved = resolve(root)
            found = ("ok", "" if resolved == root else resolved.name)
        except CheckpointError as e:
            found = ("error", str(e))
    found = comm.broadcast_object(found)
    if found[0] == "error":
        raise CheckpointError(found[1])
    version = root / found[1] if found[1] else root
    error, state, targets, client = None, None, None, None
    try:   # every rank checks the files it sees
        state = validate(version)
        _check_matches(engine, state, version)
        targets = _targets(engine, state, st.mesh)
    except CheckpointError as e:
        error = str(e)
    _agree(comm, error)
    same_world = state["world_size"] == comm.world
    rng, plan = None, None
    try:
        dcp.load(targets, storage_reader=_dcp.JsonReader(version), process_group=st.group)
        if state.get("client_state"):
            client = torch.load(version / CLIENT, map_location="cpu", weights_only=True)
        if state.get("rng") and same_world:   # [Note: random state in a checkpoint]
            rng = torch.load(version / rng_file(comm.rank), map_location="cpu",
                             weights_only=True)
        if state.get("plan") and same_world:   # another world plans afresh in any case
            plan = json.loads((version / PLAN).read_text())
    except _dcp_errors() as e:  # reported the same on every rank below
        error = f"load_checkpoint: {version} is damaged: reading it failed ({_describe(e)})"
    _agree(comm, error)
    with engine._offload.masters_home():   # written, then their device copies made anew
        # nothing was changed before every rank had read everything
        _apply(engine, state, targets, st.group)
    if rng is not None:
        _set_rng_state(rng, engine.device)
    elif state.get("rng") and comm.rank == 0:
        log.warning("deepcompile: load_checkpoint: the random number generators' states were "
                    "saved by %d ranks and are not restored on %d (each rank's stream is its "
                    "own); random ops (dropout) go on from this process's states",
                    state["world_size"], comm.world)
    # [Note: the plan in a checkpoint] in compiler/pipeline.py
    if state.get("plan") and not same_world and comm.rank == 0:
        log.info("deepcompile: load_checkpoint: the plan in the checkpoint was made on %d ranks; "
                 "on %d the engine plans afresh", state["world_size"], comm.world)
    if plan is not None and not engine._pipeline.adopt_plan(plan) and comm.rank == 0:
        log.info("deepcompile: load_checkpoint: this engine has trained already: it keeps its "
                 "own plan, not the checkpoint's")
    comm.all_gather_object(None)
    return client
