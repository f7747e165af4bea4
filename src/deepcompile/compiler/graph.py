"""Small FX helpers shared by the backend and the passes."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import fx

from ..runtime import ops


def call_nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def output_values(gm: fx.GraphModule) -> Iterator[fx.Node]:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    for arg in torch.utils._pytree.tree_leaves(out.args[0]):
        if isinstance(arg, fx.Node):
            yield arg


def gathered_source(node: fx.Node) -> fx.Node | None:
    """The allgather_param node whose output `node` is, or aliases through view ops."""
    while True:
        if node.op != "call_function":
            return None
        if node.target is ops.ALLGATHER:
            return node
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and target.is_view and node.args \
                and isinstance(node.args[0], fx.Node):
            node = node.args[0]
            continue
        return None


def first_user(node: fx.Node) -> fx.Node | None:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return min(node.users, key=order.__getitem__, default=None)
