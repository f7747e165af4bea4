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


# the calls by which Dynamo records a change of the gradient mode in a graph
_GRAD_MODE = ("_set_grad_enabled", "_enter_inference_mode", "_exit_inference_mode")


def grad_disabled_regions(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Every node of a Dynamo graph that runs with gradients disabled (under `no_grad`,
    `set_grad_enabled(False)` or `inference_mode`) -> the node that disabled them (Dynamo
    records the mode changes as calls in the graph). The graph runs with gradients enabled
    where it starts: one that starts disabled (traced under no_grad) has no gradients to keep,
    and nothing before its first enabling node is listed."""
    out: dict[fx.Node, fx.Node] = {}
    enabled, start, entered = True, None, []
    for n in graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name in _GRAD_MODE:
            if name == "_set_grad_enabled":
                now = bool(n.args[0])
            elif name == "_enter_inference_mode":
                entered.append(enabled)
                now = enabled and not (n.args[0] if n.args else True)
            else:
                now = entered.pop() if entered else True
            if enabled and not now:
                start = n
            enabled = now
        elif not enabled and start is not None:
            out[n] = start
    return out

