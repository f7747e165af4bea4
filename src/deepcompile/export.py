"""Full-model export: a Hugging Face model directory with safetensors weights.

Used by `engine.save_pretrained(dir)` (live, gathered from the shards) and by `deepcompile
consolidate CKPT OUT` (offline, from a checkpoint). Tied parameters (one tensor under several
names) are written once, under their first name, as Hugging Face's `save_pretrained` does; the
config (when the model is a `transformers.PreTrainedModel`) records the written dtype.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ._ckpt_format import (HF_CONFIG, HF_GENERATION, hf_config_dicts, persistent_buffers,
                           resolve, validate)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024 ** 3   # as transformers' save_pretrained ("5GB")
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def require_safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise ImportError("deepcompile: writing safetensors needs the safetensors package: "
                          "pip install -c constraints.txt -e '.[hf]'") from None
    return st


def write_hf_dir(out: str | os.PathLike, tensors: list[tuple[list[str], torch.Tensor]], *,
                 config: dict | None, generation_config: dict | None = None,
                 dtype: torch.dtype | None = None,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Write `tensors` ([(names, full tensor)], the first name is written) and the configs into
    `out` (created); every file is written under a temporary name and renamed. Returns the files."""
    st = require_safetensors()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights: dict[str, torch.Tensor] = {}
    for names, t in tensors:
        t = t.detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        weights[names[0]] = t.contiguous()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in weights.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    written = []
    if len(shards) == 1:
        names = [WEIGHTS]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        tmp = out / f".{fname}.tmp"
        st.save_file(shard, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / fname)
        written.append(out / fname)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size()
                                                for t in weights.values())},
                 "weight_map": {n: f for f, s in zip(names, shards) for n in s}}
        written.append(_write_json(out / INDEX, index))
    if config is not None:
        config = dict(config)
        written_dtype = next((t.dtype for t in weights.values() if t.is_floating_point()), None)
        if written_dtype is not None:
            key = "dtype" if "dtype" in config or "torch_dtype" not in config else "torch_dtype"
            config[key] = str(written_dtype).removeprefix("torch.")
        written.append(_write_json(out / "config.json", config))
    if generation_config is not None:
        written.append(_write_json(out / "generation_config.json", generation_config))
    return written


def _write_json(path: Path, obj: dict) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def save_pretrained(engine, directory: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    max_shard_bytes: int | None = None) -> str:
    """`engine.save_pretrained`: gather on every rank, rank 0 writes, every rank returns (or
    raises the same error)."""
    comm = engine._comm
    error = None
    try:
        require_safetensors()
    except ImportError as e:
        error = str(e)
    errors = comm.all_gather_object(error)
    if any(errors):
        raise ImportError(next(e for e in errors if e))
    full = engine.full_state_dict()   # collective
    error = None
    if comm.rank == 0:
        tensors = [(list(e.names), full[e.name]) for e in engine._registry]
        tensors += [([name], b) for name, b in persistent_buffers(engine.module).items()]
        config, generation = hf_config_dicts(engine.module)
        try:
            write_hf_dir(directory, tensors, config=config, generation_config=generation,
                         dtype=dtype, max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        except OSError as e:
            error = f"save_pretrained: writing {directory} failed: {e}"
    errors = comm.all_gather_object(error)
    if any(errors):
        raise RuntimeError(next(e for e in errors if e))
    return str(directory)


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                dtype: torch.dtype | None = None,
                max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Offline (one process, no process group): the full model of a deepcompile checkpoint as a
    Hugging Face model directory. Returns the files written."""
    import torch.distributed.checkpoint as dcp

    from . import _dcp

    require_safetensors()
    version = resolve(Path(checkpoint))
    state = validate(version)
    targets: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[list[str], list[int]]] = {}
    for names, shape in state["params"]:
        numel = 1
        for d in shape:
            numel *= d
        targets[f"model/{names[0]}"] = torch.empty(numel, dtype=_dcp._dtype(state["dtypes"][names[0]]))
        shapes[names[0]] = (names, shape)
    md = _dcp.JsonReader(version).read_metadata()
    for name in state.get("buffers", []):
        t = md.state_dict_metadata[f"buffer/{name}"]
        targets[f"buffer/{name}"] = torch.empty(t.size, dtype=t.properties.dtype)
    dcp.load(targets, storage_reader=_dcp.JsonReader(version), no_dist=True)
    tensors = [(names, targets[f"model/{first}"].view(shape))
               for first, (names, shape) in shapes.items()]
    tensors += [([name], targets[f"buffer/{name}"]) for name in state.get("buffers", [])]
    config = generation = None
    if (version / HF_CONFIG).exists():
        config = json.loads((version / HF_CONFIG).read_text())
    if (version / HF_GENERATION).exists():
        generation = json.loads((version / HF_GENERATION).read_text())
    return write_hf_dir(out, tensors, config=config, generation_config=generation, dtype=dtype,
                        max_shard_bytes=max_shard_bytes)
