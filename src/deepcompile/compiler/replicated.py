"""Insertion for ZeRO-1 and ZeRO-2: replicated parameters in, reduced shard gradients out.

[Note: gradients to shards] At stages 1 and 2 the module's parameters are materialized
replicas (compute dtype) and stay plain graph inputs: the forward needs no gather. What the
backward must produce is each parameter's gradient reduce-scattered into its shard, without a
replicated `param.grad` ever existing (ZeRO-2: gradient memory 1/N) and without copying
parameters. So:

1. the backend gives each Dynamo graph one extra trailing input per trainable parameter: its
   shard (a leaf that requires grad; static-shape fake), in a copy of Dynamo's graph module;
   the forward does not use it; the run-time wrapper passes the shard of the parameter
   actually given (graph reuse: [Note: graph reuse] in backend.py);
2. AOTAutograd traces the joint graph, where the replica's gradient is an output and the
   unused shard's is None; our partition function (before min-cut) maps the joint graph's
   primals to (replica, shard) pairs by position — Dynamo's inputs follow any inputs AOT
   prepends — with a loud check of shapes and dtypes, then rewires: the replica's gradient
   output becomes None and the shard's becomes `reduce_grad(grad, pid, ...)`, placed right
   after the node that completes the gradient (so `bucket_reduce` can start it early). The
   replica's placeholder is marked `meta["dc_replica"] = pid` (the partitioned graphs
   share it): `overlap_refresh` finds the replicas a forward reads by it ([Note: deferred
   refresh] in runtime/replicas.py);
3. from then on everything is by `pid`: the reduced shard gradient reaches `shard.grad`
   through ordinary autograd, as at ZeRO-3; accumulation across micro-steps, tied weights and
   graph breaks need nothing else. ZeRO-1 also hands the shard to the op, which keeps the
   gradient local before the last micro-step ([Note: local gradient accumulation] in runtime/accumulators.py).

Bucketing and overlap are the `bucket_reduce` pass's job (the default for these stages: see
config.py): it finds these `reduce_grad` nodes like ZeRO-3's.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from typing import Any, Callable

import torch
from torch import fx

from .. import _compat
from ..runtime import ops
from ..runtime.registry import ParamEntry, ParamRegistry
from .slots import alive


@dataclasses.dataclass(frozen=True)
class Link:
    """A replicated parameter input and the shard input added for its gradient."""
    param_pos: int     # position among the Dynamo graph's inputs
    shard_pos: int     # position of the added shard input (after Dynamo's inputs)
    entry: ParamEntry


def add_shard_inputs(gm: fx.GraphModule, example_inputs: list[Any],
                     params: list[tuple[int, ParamEntry]], fake_mode):
    """(graph module with the shard inputs, its example inputs, links); see step 1 above."""
    trainable = [(i, e) for i, e in params if e.shard.requires_grad]
    n = len(example_inputs)
    shards = [_compat.static_fake(fake_mode, e.shard) if fake_mode else e.shard
              for _, e in trainable]
    new_gm, _ = _compat.extend_graph_inputs(gm, [f"shard_{e.pid}" for _, e in trainable], shards)
    links = [Link(i, n + k, e) for k, (i, e) in enumerate(trainable)]
    return new_gm, list(example_inputs) + shards, links


def route_grads_to_shards(joint: fx.GraphModule, joint_inputs, links: list[Link],
                          n_inputs: int, num_fwd_outputs: int) -> int:
    """Step 2 above, on the joint graph; returns the number of reduces inserted."""
    primals = joint_inputs[0] if isinstance(joint_inputs, tuple) else joint_inputs
    graph = joint.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    grads = outs[num_fwd_outputs:]
    offset = len(primals) - n_inputs
    if offset < 0 or len(grads) != len(primals):
        raise RuntimeError(f"deepcompile: unexpected joint graph layout ({len(primals)} primals, "
                           f"{n_inputs} graph inputs, {len(grads)} gradient outputs)")
    inserted = 0
    for link in links:
        e = link.entry
        pi, si = offset + link.param_pos, offset + link.shard_pos
        _check(primals[pi], tuple(e.shape), e.compute_dtype, e, "parameter")
        _check(primals[si], (e.shard.numel(),), e.shard.dtype, e, "shard")
        placeholders[pi].meta["dc_replica"] = e.pid
        if grads[si] is not None:
            raise RuntimeError(f"deepcompile: the shard of {e.name!r} already has a gradient "
                               "in the joint graph")
        grad = grads[pi]
        grads[pi] = None
        if grad is None:      # no gradient flows to this parameter in this graph
            continue
        args = (grad, e.pid, e.shard.numel(), e.shard.dtype)
        if e.zero_stage == 1:
            args += (placeholders[si],)
        anchor = grad if grad.op != "placeholder" else placeholders[-1]
        with graph.inserting_after(anchor):
            reduce = graph.call_function(ops.REDUCE_GRAD, args)
        val = grad.meta.get("val")
        if isinstance(val, torch.Tensor):
            reduce.meta["val"] = val.new_empty((e.shard.numel(),), dtype=e.shard.dtype)
        grads[si] = reduce
        inserted += 1
    out.args = (type(out.args[0])(outs[:num_fwd_outputs] + grads),)
    graph.lint()
    joint.recompile()
    return inserted


def _check(value: Any, shape: tuple, dtype: torch.dtype, entry: ParamEntry, what: str) -> None:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
        got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value
        raise RuntimeError(f"deepcompile: joint graph input for the {what} of {entry.name!r} is "
                           f"{got}, expected {(shape, dtype)}; the joint graph's inputs are not "
                           "laid out as expected (a torch version change?)")


def append_shards(compiled: Callable, links: list[Link], registry: ParamRegistry,
                  resolve: Callable, keep: list) -> Callable:
    """At run time the shards of the parameters actually passed follow Dynamo's arguments, and
    each replicated parameter is passed as its detached alias (`ParamEntry.replica`): the
    graph routes the gradient to the shard, so autograd needs no edge to the replica (no
    accumulation, no gradient hook run per parameter and micro-step). A fixed number of Python
    operations per call when the parameters are the compile-time ones. The tensors are held
    by the engine (`keep`), the returned callable holds them weakly ([Note: what Dynamo holds]
    in compiler/backend.py)."""
    if not links:
        return compiled
    held = _Appended(tuple(link.entry.param for link in links),
                     tuple(link.entry.replica for link in links) +
                     tuple(link.entry.shard for link in links), links, registry, resolve)
    keep.append(held)
    return _append_runner(compiled, weakref.ref(held), [link.param_pos for link in links])


def _append_runner(compiled: Callable, ref: weakref.ref, positions: list[int]) -> Callable:
    """`append_shards`' run-time callable; it holds the `_Appended` only through `ref`."""
    pick = operator.itemgetter(*positions) if len(positions) > 1 else \
        operator.itemgetter(slice(positions[0], positions[0] + 1))
    n_links = len(positions)
    index: list[int] = []

    def run(*args):
        h = ref()
        if h is None:
            alive(ref)
        if not index:   # argument i, its replica's alias, then the shards
            n = len(args)
            at = {i: n + k for k, i in enumerate(positions)}
            index.extend(at.get(i, i) for i in range(n))
            index.extend(range(n + n_links, n + 2 * n_links))
        got = pick(args)
        if all(map(operator.is_, got, h.expected)):
            src = args + h.fixed
        else:
            entries = [link.entry if arg is link.entry.param else
                       h.resolve(h.registry, arg, link.entry) for link, arg in zip(h.links, got)]
            src = args + tuple(e.replica for e in entries) + tuple(e.shard for e in entries)
        return compiled(*map(src.__getitem__, index))

    return run


@dataclasses.dataclass(eq=False)
class _Appended:
    """What a compiled graph's argument list needs (ZeRO-1/2); owned by the engine's backend."""
    expected: tuple
    fixed: tuple
    links: list
    registry: ParamRegistry
    resolve: Callable
