"""Static liveness: the live-bytes curve of a graph computed from shapes alone.

Mirrors the CPU memory model of `profiler.py` (distinct storages of live values, inputs alive
for the whole graph, values freed after their last use) from the fake values AOTAutograd leaves
in `node.meta["val"]`. A parameter shard counts its own extent (the shards are views of the
runtime's flat buffers: runtime/flat.py). Aliasing comes from the op schemas: the output of a
view op (and a `getitem` of one) shares its base's storage. Used to check the measured curve,
and by passes to simulate the memory effect of a rewrite before running it.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..runtime import ops
from .graph import is_alias_of_input
from .profiler import RefCountedBytes, last_uses


def _roots(node: fx.Node) -> list[tuple[tuple[fx.Node, int | None], int]]:
    """(storage root, bytes) of each tensor a node's value holds."""
    if node.op == "call_function":
        target = node.target
        if target is operator.getitem and isinstance(node.args[0], fx.Node):
            base = node.args[0]
            if is_alias_of_input(base):
                return _roots(base.args[0])
            val = node.meta.get("val")
            return [((base, node.args[1]), _nbytes(val))] if isinstance(val, torch.Tensor) else []
        if is_alias_of_input(node):
            return _roots(node.args[0])
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        if node.op == "placeholder" and _is_shard_input(node):
            return [((node, None), val.numel() * val.element_size())]
        return [((node, None), _nbytes(val))]
    if isinstance(val, (list, tuple)):
        return [((node, i), _nbytes(v)) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []


_SHARD_TAKERS = (ops.ALLGATHER, ops.ALLGATHER_START, ops.ALLGATHER_FROM_PREV, ops.KEPT_PARAM)


def _is_shard_input(node: fx.Node) -> bool:
    """A parameter shard: an input a gather takes. Shards are views of the runtime's flat
    buffers, counted by their own extent, as the profiler counts them (`split`)."""
    return any(u.target in _SHARD_TAKERS for u in node.users)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def static_live_bytes(gm: fx.GraphModule, runtime_bytes: int = 0) -> list[int]:
    """Live bytes after each non-placeholder, non-output node, in graph order."""
    free_after = last_uses(gm.graph)
    live = RefCountedBytes()
    curve: list[int] = []
    for node in gm.graph.nodes:
        if node.op == "output":
            break
        for key, nbytes in _roots(node):
            live.add(key, nbytes)
        if node.op == "placeholder":
            continue
        for dead in free_after.get(node, ()):
            for key, _ in _roots(dead):
                live.remove(key)
        curve.append(live.bytes + runtime_bytes)
    return curve
