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


# Ops whose schema says "new tensor" but whose output shares the input's storage at run time.
_ALIASING = {torch.ops.aten._unsafe_view.default}


def is_alias_of_input(node: fx.Node) -> bool:
    """`node` is a view (by schema, or `_unsafe_view`) of its first argument."""
    t = node.target
    return (node.op == "call_function" and isinstance(t, torch._ops.OpOverload)
            and (t.is_view or t in _ALIASING)
            and bool(node.args) and isinstance(node.args[0], fx.Node))


def gathered_source(node: fx.Node) -> fx.Node | None:
    """The allgather_param node whose output `node` is, or aliases through view ops."""
    while node.op == "call_function":
        if node.target is ops.ALLGATHER:
            return node
        if not is_alias_of_input(node):
            return None
        node = node.args[0]
    return None


def first_user(node: fx.Node) -> fx.Node | None:
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return min(node.users, key=order.__getitem__, default=None)
