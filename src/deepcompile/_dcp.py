"""torch.distributed.checkpoint storage with JSON metadata: nothing in a checkpoint loads with
pickle.

DCP's FileSystemWriter pickles the checkpoint's `Metadata` into `.metadata`, which its reader
loads with `pickle.load`, and non-tensor values would be written as pickled bytes loaded with
`torch.load(weights_only=False)`. Here the metadata goes to `dcp_metadata.json` instead
(`JsonWriter.finish` / `JsonReader.read_metadata`), and deepcompile's checkpoint state dicts
hold tensors only (everything else is in its own JSON files). The tensor data stays DCP's: each
tensor `torch.save`d into the rank's `.distcp` file, read back with
`torch.load(weights_only=True)`.

`JsonWriter(path, on_finish=...)` calls `on_finish()` on the coordinator rank after the metadata
is on disk, inside DCP's final collective, so that every rank's `save` returns (or raises) after
it: deepcompile publishes the checkpoint there ([Note: atomic checkpoints] in checkpoint.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)

from . import _compat
from ._files import write_json_atomic

METADATA_FILE = "dcp_metadata.json"


class CheckpointFormatError(ValueError):
    """A checkpoint's files are not what deepcompile writes."""


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointFormatError(f"unknown dtype {name!r}")
    return value


def metadata_to_json(md: Metadata) -> dict:
    tensors = {}
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointFormatError(f"{fqn}: only tensors are written to a deepcompile "
                                        f"checkpoint's DCP files, got {type(item).__name__}")
        tensors[fqn] = {"dtype": str(item.properties.dtype).removeprefix("torch."),
                        "requires_grad": bool(item.properties.requires_grad),
                        "size": list(item.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in item.chunks]}
    storage = []
    for index, info in (md.storage_data or {}).items():
        storage.append({"fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
                        "index": index.index, "file": info.relative_path, "file_offset": info.offset,
                        "length": info.length,
                        "transforms": None if info.transform_descriptors is None
                        else list(info.transform_descriptors)})
    planner = md.planner_data
    if isinstance(planner, dict):
        planner = {k: list(v) for k, v in planner.items()}
    meta = md.storage_meta
    return {"version": md.version, "tensors": tensors, "storage": storage,
            "planner_data": planner,
            "storage_meta": None if meta is None else {
                "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
                "save_id": meta.save_id}}


def metadata_from_json(d: dict) -> Metadata:
    try:
        sd_md: dict[str, Any] = {}
        for fqn, t in d["tensors"].items():
            props = TensorProperties(dtype=_dtype(t["dtype"]), requires_grad=t["requires_grad"])
            sd_md[fqn] = TensorStorageMetadata(
                properties=props, size=torch.Size(t["size"]),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                        for o, s in t["chunks"]])
        storage = {}
        for s in d["storage"]:
            index = MetadataIndex(s["fqn"], s["offset"], s["index"])
            storage[index] = _compat.dcp_storage_info(s["file"], s["file_offset"], s["length"],
                                                      s["transforms"])
        planner = d.get("planner_data")
        if isinstance(planner, dict):
            planner = {k: tuple(v) for k, v in planner.items()}
        meta = d.get("storage_meta")
        return Metadata(state_dict_metadata=sd_md, planner_data=planner, storage_data=storage,
                        storage_meta=StorageMeta(checkpoint_id=meta.get("checkpoint_id"),
                                                 save_id=meta.get("save_id")) if meta else None,
                        version=d.get("version"))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointFormatError(f"{METADATA_FILE} is malformed ({type(e).__name__}: {e})") from e


class JsonWriter(FileSystemWriter):
    """FileSystemWriter whose metadata is JSON; `on_finish()` runs on the coordinator after it."""

    def __init__(self, path: str | os.PathLike, on_finish: Callable[[], None] | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1,
                         overwrite=True)
        self._on_finish = on_finish

    def finish(self, metadata: Metadata, results) -> None:
        storage = {}
        for rank_results in results:
            storage.update({wr.index: wr.storage_data for wr in rank_results})
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        metadata.version = metadata.version or "deepcompile-json-1"
        write_json_atomic(Path(self.path) / METADATA_FILE, metadata_to_json(metadata))
        if self._on_finish is not None:
            self._on_finish()


class JsonReader(FileSystemReader):
    """FileSystemReader that reads `JsonWriter`'s metadata (never a pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / METADATA_FILE
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise CheckpointFormatError(f"{path} is missing") from None
        except json.JSONDecodeError as e:
            raise CheckpointFormatError(f"{path} is not valid JSON ({e})") from None
        md = metadata_from_json(data)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


def is_bytes_item(item) -> bool:
    return isinstance(item, BytesStorageMetadata)
