"""The activation pass's view of the graphs: which values the backward saves, how each can be
recomputed from what the backward holds (`recompute_chain`), and `analyse`, which lists a
forward/backward pair's candidates (passes/activation_budget.py describes the pass)."""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from ..compiler import graph as G
from ..runtime import activations as act_ops
from ..runtime import ops
from ._activation_plan import Activation
from ._common import Step

MAX_CHAIN = 256        # forward nodes a recompute may copy

# -- the graphs: what is saved, and how to recompute it -------------------------------------------
def _root(node: fx.Node) -> fx.Node:
    """The node whose storage `node`'s value is (through views; a part of a view op's list
    output is its base's)."""
    while node.op == "call_function":
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and G.is_alias_of_input(node.args[0]):
            node = node.args[0].args[0]
        elif G.is_alias_of_input(node):
            node = node.args[0]
        else:
            break
    return node


def _readers(graph: fx.Graph, index: dict[str, int]) -> dict[fx.Node, list[int]]:
    """Storage root -> step indices of the nodes that read it (through any alias), output
    aside."""
    out: dict[fx.Node, list[int]] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or node.name not in index:
            continue
        for r in {_root(a) for a in node.all_input_nodes}:
            out.setdefault(r, []).append(index[node.name])
    return out


def _dense(val: torch.Tensor) -> bool:
    """The value is its storage, exactly (what an offload copies is what it frees)."""
    return (val.storage_offset() == 0 and val.numel() > 0 and act_ops.dense_strides(val)
            and val.untyped_storage().nbytes() == val.numel() * val.element_size())


def _pure(node: fx.Node) -> bool:
    """A compute node a recompute may copy: no mutation, no randomness, no discrete decision."""
    t = node.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable:
        return False
    if torch.Tag.nondeterministic_seeded in t.tags:
        return False
    outs = node.meta.get("val")
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    ins = [a.meta.get("val") for a in node.all_input_nodes]
    floating = any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in ins)
    return not (floating and any(isinstance(v, torch.Tensor) and not v.is_floating_point()
                                 for v in outs))


@dataclasses.dataclass
class Chain:
    nodes: list[fx.Node]          # forward nodes to copy, in forward order
    leaves: list[fx.Node]         # saved values it reads (backward inputs of the same names)
    gathers: list[fx.Node]        # parameter gathers it reads, gathered again


def recompute_chain(s: fx.Node, saved: set[str], bw_inputs: set[str],
                    bw_computed: set[str]) -> Chain | None:
    """The forward nodes that recompute `s` from the values the backward receives, or None
    where none may ([Note: activations after partitioning])."""
    nodes: dict[fx.Node, None] = {}
    leaves: dict[fx.Node, None] = {}
    gathers: dict[fx.Node, None] = {}
    stack = [s]
    while stack:
        n = stack.pop()
        if n in nodes or n in leaves or n in gathers:
            continue
        if n is not s and n.name in saved:
            leaves[n] = None
            continue
        if n.op != "call_function":
            return None   # a forward input the backward does not receive, a constant
        if n.target in (ops.ALLGATHER, ops.KEPT_PARAM):
            if n.args[0].name not in bw_inputs:
                return None
            gathers[n] = None
            continue
        if n.target in ops.COMM_KINDS or n.target in ops.MARKERS or not _pure(n):
            return None
        if n.name in bw_computed and not G.is_alias_of_input(n):
            return None   # the backward recomputes it already: never twice
        nodes[n] = None
        if len(nodes) > MAX_CHAIN:
            return None
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(s.graph.nodes)}
    return Chain(sorted(nodes, key=order.__getitem__), list(leaves), list(gathers))


def _flops(nodes: list[fx.Node]) -> int:
    """Matrix-multiply FLOPs of `nodes` (torch's flop counter's formulas, on the fake values)."""
    from torch.utils.flop_counter import flop_registry

    total = 0
    for n in nodes:
        f = flop_registry.get(getattr(n.target, "overloadpacket", None))
        if f is None:
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        try:
            total += int(f(*args, **kwargs, out_val=n.meta.get("val")))
        except Exception:   # noqa: BLE001 -- a formula that wants other arguments: not counted
            continue
    return total


@dataclasses.dataclass
class Pair:
    """What the pass reads of one forward/backward pair."""
    fw_key: str
    bw_key: str
    acts: list[Activation]
    flops: dict[str, int]         # matrix-multiply FLOPs of each recomputable value's chain


def analyse(fw_key: str, bw_key: str, fw_gm: fx.GraphModule, bw_gm: fx.GraphModule,
            fw_steps: list[Step], bw_steps: list[Step], out_bytes: dict[str, int],
            recompute: bool = True) -> Pair:
    """The saved values of a pair that the pass may drop, with their positions in the profiled
    steps and their recompute chains (none where not `recompute`). Sizes are the agreed
    profile's (`out_bytes`: the forward nodes' output bytes), the same on every rank whatever
    shape each rank compiled its graphs for."""
    fw_index = {s.name: i for i, s in enumerate(fw_steps)}
    bw_index = {s.name: i for i, s in enumerate(bw_steps)}
    bw_inputs = {n.name: n for n in bw_gm.graph.nodes if n.op == "placeholder"}
    bw_computed = {n.name for n in bw_gm.graph.nodes if n.op == "call_function"}
    outs = list(G.output_values(fw_gm))
    saved = {n.name for n in outs if n.name in bw_inputs
             and isinstance(n.meta.get("val"), torch.Tensor)}
    by_root: dict[fx.Node, int] = {}
    for n in outs:
        r = _root(n)
        by_root[r] = by_root.get(r, 0) + 1
    fw_readers, bw_readers = _readers(fw_gm.graph, fw_index), _readers(bw_gm.graph, bw_index)
    acts, flops = [], {}
    for n in outs:
        val = n.meta.get("val")
        r = _root(n)
        if n.name not in saved or r.op == "placeholder" or by_root[r] != 1 or not _dense(val):
            continue
        if n.target in ops.COMM_KINDS or r.op != "call_function":
            continue
        bw_uses = bw_readers.get(bw_inputs[n.name], [])
        if not bw_uses or n.name not in fw_index or r.name not in fw_index:
            continue
        fw_free = max(fw_readers.get(r, []) + [fw_index[r.name], fw_index[n.name]])
        chain = recompute_chain(n, saved, set(bw_inputs), bw_computed) if recompute else None
        rec_s, rec_bytes, leaves = None, 0, ()
        if chain is not None:
            rec_s = sum(fw_steps[fw_index[c.name]].time_s for c in chain.nodes + chain.gathers
                        if c.name in fw_index)
            rec_bytes = _chain_peak(chain, n, out_bytes)
            leaves = tuple(sorted(leaf.name for leaf in chain.leaves))
            flops[n.name] = _flops(chain.nodes)
        acts.append(Activation(n.name, out_bytes.get(r.name, 0), fw_free, min(bw_uses),
                               max(bw_uses), rec_s, rec_bytes, leaves))
    return Pair(fw_key, bw_key, acts, flops)


def _chain_peak(chain: Chain, s: fx.Node, out_bytes: dict[str, int]) -> int:
    """The most a recompute holds at once beyond the value it makes: its gathers and
    intermediates, each freed after its last use within the chain (the profiler's model)."""
    nodes = chain.gathers + chain.nodes
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[_root(a)] = i
    live = peak = 0
    held: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        if not G.is_alias_of_input(n) and n.target is not operator.getitem:
            held[n] = out_bytes.get(n.name, 0)
            live += held[n]
        peak = max(peak, live)
        for r in [r for r in held if last.get(r, -1) <= i and r is not _root(s)]:
            live -= held.pop(r)
    return max(0, peak - out_bytes.get(_root(s).name, 0))
