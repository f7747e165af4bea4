"""Static liveness: the live-bytes curve of a graph computed from shapes alone.

Mirrors the CPU memory model of `profiler.py` (distinct storages of live values, inputs alive
for the whole graph, values freed after their last use) using the fake tensors AOTAutograd
leaves in `node.meta["val"]`. Views share their base's storage. Used to check the measured
curve, and by passes to simulate the memory effect of a rewrite before running it.
"""

from __future__ import annotations

import torch
from torch import fx

from .profiler import last_uses


def _storage_bytes(node: fx.Node) -> list[tuple[int, int]]:
    """(storage key, bytes) of each tensor in node's value, from its fake value."""
    val = node.meta.get("val")
    out = []
    for t in torch.utils._pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            out.append((id(s) if not hasattr(s, "_cdata") else s._cdata, s.nbytes()))
    return out


def static_live_bytes(gm: fx.GraphModule, runtime_bytes: int = 0) -> list[int]:
    """Live bytes after each non-placeholder, non-output node, in graph order."""
    free_after = last_uses(gm.graph)
    refs: dict[int, list[int]] = {}
    total = 0
    curve: list[int] = []

    def add(node):
        nonlocal total
        for key, nbytes in _storage_bytes(node):
            if key in refs:
                refs[key][1] += 1
            else:
                refs[key] = [nbytes, 1]
                total += nbytes

    def remove(node):
        nonlocal total
        for key, _ in _storage_bytes(node):
            entry = refs.get(key)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] == 0:
                total -= entry[0]
                del refs[key]

    for node in gm.graph.nodes:
        if node.op == "output":
            break
        add(node)
        if node.op == "placeholder":
            continue
        for dead in free_after.get(node, ()):
            remove(dead)
        curve.append(total + runtime_bytes)
    return curve
