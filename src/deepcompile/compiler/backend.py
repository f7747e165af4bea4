"""The deepcompile torch.compile backend.

For each Dynamo graph:
  1. map graph inputs to registered parameters by object identity (never by position);
  2. insertion (ZeRO-3): swap each parameter input for its shard and follow it with
     `allgather_param`, placed just before the parameter's first use and tagged MUST_RECOMPUTE,
     so the partitioner re-gathers in the backward instead of saving the full parameter;
     (ZeRO-1/2): the replicated parameters stay inputs; each trainable one gets its shard as
     an extra input, which receives the reduced gradient ([Note: gradients to shards] in
     compiler/replicated.py);
  3. AOTAutograd partitions the joint graph (min-cut; honours the recompute tags; with Inductor's
     decompositions when the final compiler is Inductor); every partitioned forward graph is
     checked: no gathered parameter may be saved for backward;
  4. each partitioned graph becomes a pipeline slot (compiler/slots.py): profiled, rewritten by
     the passes, and finally compiled by Inductor or run as FX code ("fx").
The returned callable swaps each parameter argument for its shard at run time (ZeRO-1/2:
appends the shards).

[Note: what Dynamo holds] Dynamo keeps what a backend gives it for the life of the process:
the backend object itself (`torch._dynamo.eval_frame.cached_backends`, cleared only by
`torch._dynamo.reset()`) and every compiled callable (in the code object's cache, which the
garbage collector cannot see into). Held strongly, they would keep a released engine — its flat
masters, optimizer state, kept parameters, accumulators: on a GPU, its memory — alive until the
process ends: a notebook that builds a second engine would run out of memory. So what Dynamo
and AOTAutograd get holds the engine's objects through one weak reference each (`WeakBackend`,
the argument swap's `_Swap`, `_WeakSlot`), dereferenced once per call; the engine owns them
(`Backend.keep`, `SlotRunner.slots`). A graph of a released engine that runs again says so.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import operator
import weakref
from typing import Any, Callable

import torch
from torch import fx

from .. import _compat
from ..runtime import ops
from ..runtime.registry import ParamEntry, ParamRegistry, lookup
from . import families
from . import graph as G
from . import replicated
from .pipeline import Pipeline
from .slots import alive

log = logging.getLogger("deepcompile")


class GatheredParameterSavedError(RuntimeError):
    """The partitioner chose to save a gathered (full) parameter for the backward."""


@dataclasses.dataclass
class GraphRecord:
    """One Dynamo graph as the backend received it; its partitioned pieces are pipeline slots."""

    index: int
    dynamo_nodes: int
    params: list[str]
    family: int = 0     # the family index ([Note: shape families] in compiler/families.py)
    slots: list[str] = dataclasses.field(default_factory=list)


class WeakBackend:
    """What `torch.compile` gets: the engine's backend through a weak reference ([Note: what
    Dynamo holds])."""

    def __init__(self, backend: "Backend") -> None:
        self._ref = weakref.ref(backend)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return alive(self._ref)(gm, example_inputs)


class _WeakSlot:
    """What AOTAutograd gets for a partitioned graph: the pipeline's slot, weakly."""

    _boxed_call = True

    def __init__(self, slot) -> None:
        self._ref = weakref.ref(slot)

    def __call__(self, args: list[Any]) -> Any:
        slot = self._ref()
        if slot is None:
            alive(self._ref)
        return slot(args)


class Backend:
    def __init__(self, registry: ParamRegistry, compiler: str, pipeline: Pipeline) -> None:
        self.registry = registry
        self.compiler = compiler
        self.pipeline = pipeline
        self.records: list[GraphRecord] = []
        self.keep: list = []   # what the compiled callables hold weakly ([Note: what Dynamo holds])

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(example_inputs):
            raise RuntimeError(f"deepcompile: graph has {len(placeholders)} inputs but Dynamo gave "
                               f"{len(example_inputs)} example inputs")
        params: list[tuple[int, ParamEntry]] = []
        for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
            entry = self.registry.entry_for(value)
            if entry is None and "grapharg" in node.meta:
                entry = self.registry.entry_for(getattr(node.meta["grapharg"], "example", None))
            if entry is not None:
                params.append((i, entry))

        # [Note: shape families] in compiler/families.py: a recompilation of a frame with the
        # same parameters and structure (a new input shape) joins its family and runs the
        # family's plan; another structure ([Note: graph structure]) is a family of its own
        family = self.pipeline.runner.family_of(_compat.dynamo_frame_id(gm),
                                         tuple(e.pid for _, e in params),
                                         families.structure_digest(gm))
        record = GraphRecord(index=len(self.records), dynamo_nodes=len(gm.graph.nodes),
                             params=[e.name for _, e in params], family=family)
        self.records.append(record)

        fake_mode = _compat.detect_fake_mode(example_inputs)
        if self.registry.zero_stage == 3:
            inputs = list(example_inputs)
            for i, entry in params:
                inputs[i] = _compat.static_fake(fake_mode, entry.shard) if fake_mode else entry.shard
            _insert_gathers(gm, [(placeholders[i], entry, inputs[i]) for i, entry in params],
                            fake_mode)
            partition_fn = _partition
        else:
            gm, inputs, links = replicated.add_shard_inputs(gm, example_inputs, params, fake_mode)
            partition_fn = functools.partial(_partition, links=links, n_inputs=len(inputs))

        backend = weakref.ref(self)   # AOTAutograd keeps the backward's compiler: held weakly

        def make_slot(kind: str):
            def compile_piece(piece: fx.GraphModule, _example_inputs):
                if kind == "fw":
                    check_no_gathered_param_saved(piece)
                # The recompute tags did their job in the partitioner; left on the pieces they
                # would make Inductor's final (inference) compile look for backward regions.
                for node in piece.graph.nodes:
                    node.meta.pop("recompute", None)
                    node.meta.pop("ac_graph_id", None)
                slot = alive(backend).pipeline.runner.add_slot(record.family, kind, piece,
                                                                 record.params)
                record.slots.append(slot.key)
                return _WeakSlot(slot)
            return compile_piece

        with _compat.no_autograd_cache():
            compiled = _compat.aot_module_simplified(
                gm, inputs, fw_compiler=make_slot("fw"), bw_compiler=make_slot("bw"),
                inference_compiler=make_slot("inference"), partition_fn=partition_fn,
                decompositions=_compat.inductor_decompositions() if self.compiler == "inductor" else None,
                # a plan from a checkpoint applies once it has every graph ([Note: the plan
                # in a checkpoint] in compiler/pipeline.py)
                eager_backward=self.pipeline.adopting)
        log.info("deepcompile: graph %d: %d parameters %s (%s)", record.index, len(params),
                 "gathered" if self.registry.zero_stage == 3 else "replicated", self.compiler)
        if self.registry.zero_stage == 3:
            return _swap_params(compiled, params, self.registry, self.keep)
        return replicated.append_shards(compiled, links, self.registry, _reused_entry, self.keep)


def _insert_gathers(gm: fx.GraphModule, params, fake_mode) -> None:
    """Insertion pass (ZeRO-3): `shard -> allgather_param -> uses`, just in time.

    [Note: gathers with gradients] Every use of a parameter reads the one gather, so the gather
    runs with gradients enabled, or no use sends a gradient to the shard: a parameter first read
    under `no_grad` or `inference_mode` (a weight statistic, a codebook's distances, a teacher's
    forward) and then used with gradients would never train. Where the first use is in a
    region with gradients disabled, the gather goes before the node that disabled them."""
    graph = gm.graph
    disabled = G.grad_disabled_regions(graph)
    for node, entry, shard_value in params:
        user = G.first_user(node)
        if user is None:
            continue  # unused parameter: nothing to gather
        with graph.inserting_before(disabled.get(user, user)):
            gathered = graph.call_function(
                ops.ALLGATHER, (node, entry.pid, list(entry.shape), entry.compute_dtype))
        node.replace_all_uses_with(gathered, delete_user_cb=lambda u: u is not gathered)
        gathered.meta["recompute"] = _compat.must_recompute_policy()
        if isinstance(shard_value, torch.Tensor):
            node.meta["example_value"] = shard_value
            if fake_mode is not None:
                with fake_mode:
                    gathered.meta["example_value"] = torch.empty(
                        entry.shape, dtype=entry.compute_dtype, device=entry.shard.device)
    graph.lint()
    gm.recompile()


def _partition(joint: fx.GraphModule, joint_inputs, links=None, n_inputs: int = 0, **kwargs):
    """Min-cut partitioning, with every alias of a gathered parameter recomputed too.

    The gather is tagged MUST_RECOMPUTE, but the min-cut partitioner may still save a *view*
    of it (a transpose of a grouped-GEMM expert weight, for instance), which keeps the whole
    gathered parameter alive until the backward. Views (and `_unsafe_view`) of gathered values
    inherit the tag, so the backward re-gathers and re-derives them.

    ZeRO-1/2 (`links`): the replicas' gradients are routed to the shards first."""
    if links is not None:
        replicated.route_grads_to_shards(joint, joint_inputs, links, n_inputs,
                                         kwargs["num_fwd_outputs"])
    policy = _compat.must_recompute_policy()
    stack = G.call_nodes(joint, ops.ALLGATHER)
    while stack:
        for user in stack.pop().users:
            if G.is_alias_of_input(user) and user.meta.get("recompute") is None:
                user.meta["recompute"] = policy
                stack.append(user)
    return _compat.min_cut_partition(joint, joint_inputs, **kwargs)


def check_no_gathered_param_saved(fw: fx.GraphModule) -> None:
    """No gathered parameter is saved for backward (or escapes the forward)."""
    bad = sorted({str(src.args[1]) for v in G.output_values(fw)
                  if (src := G.gathered_source(v)) is not None})
    if bad:
        names = ", ".join(_param_name(int(pid)) for pid in bad)
        raise GatheredParameterSavedError(
            f"deepcompile: the partitioned forward graph keeps gathered parameters alive past "
            f"the forward ({names}); ZeRO-3 would hold full parameters between forward and "
            "backward. This is a bug in deepcompile's partitioning; please report it.")


def _param_name(pid: int) -> str:
    try:
        return lookup(pid).name
    except RuntimeError:
        return f"pid {pid}"


def _swap_params(compiled: Callable, params: list[tuple[int, ParamEntry]],
                 registry: ParamRegistry, keep: list) -> Callable:
    """At run time each parameter argument is replaced by its shard.

    [Note: graph reuse] Dynamo may run one compiled graph with *different* parameters of the
    same shape: a resume function of a loop over an `nn.ModuleList` is compiled once and called
    for every layer, because modules are not identity-guarded. So the shard is looked up from
    the parameter actually passed, never from the one seen at compile time. The `pid` baked into
    the graph's ops then names the compile-time parameter: its layout (shape, dtypes, padding) is
    guaranteed identical by Dynamo's guards and checked here; gradients still flow to the right
    shard through autograd, and the runtime's tables are keyed by the shard the graph is called
    with ([Note: runtime inputs] in compiler/lower.py). The registry notes the reuse, for passes
    that plan by `pid`.

    The common case (the parameters seen at compile time) costs a fixed number of Python
    operations per call, none per parameter: the check and the swap run in C (`map`). The
    parameters and shards are held by the engine (`keep`), the returned callable holds them
    weakly ([Note: what Dynamo holds]).
    """
    if not params:
        return compiled
    sw = _Swap(tuple(e.param for _, e in params), tuple(e.shard for _, e in params),
               params, registry)
    keep.append(sw)
    return _swap_runner(compiled, weakref.ref(sw), [i for i, _ in params])


def _swap_runner(compiled: Callable, ref: weakref.ref, positions: list[int]) -> Callable:
    """`_swap_params`' run-time callable; it holds the `_Swap` only through `ref`."""
    pick = _picker(positions)
    index: list[int] = []

    def run(*args):
        sw = ref()
        if sw is None:
            alive(ref)
        if not index:   # argument i of the call, or shard k (after the arguments)
            at = {i: len(args) + k for k, i in enumerate(positions)}
            index.extend(at.get(i, i) for i in range(len(args)))
        if all(map(operator.is_, pick(args), sw.expected)):
            src = args + sw.shards
        else:
            src = args + tuple(e.shard if arg is e.param else
                               _reused_entry(sw.registry, arg, e).shard
                               for (_, e), arg in zip(sw.params, pick(args)))
        return compiled(*map(src.__getitem__, index))

    return run


@dataclasses.dataclass(eq=False)
class _Swap:
    """What a compiled graph's argument swap needs; owned by the engine's backend."""
    expected: tuple
    shards: tuple
    params: list
    registry: ParamRegistry


def _picker(indices: list[int]) -> Callable[[tuple], tuple]:
    """args -> the arguments at `indices`, in C (no Python frame per call)."""
    if len(indices) == 1:
        return operator.itemgetter(slice(indices[0], indices[0] + 1))
    return operator.itemgetter(*indices)


def _reused_entry(registry: ParamRegistry, arg: Any, compiled_for: ParamEntry) -> ParamEntry:
    entry = registry.entry_for(arg)
    if entry is None:
        raise RuntimeError(f"deepcompile: a compiled graph that gathers {compiled_for.name!r} was "
                           "called with a tensor that is not a parameter of this engine's model")
    if (entry.shape, entry.compute_dtype, entry.shard.dtype) != \
            (compiled_for.shape, compiled_for.compute_dtype, compiled_for.shard.dtype):
        raise RuntimeError(f"deepcompile: compiled graph for {compiled_for.name!r} reused for "
                           f"{entry.name!r} with a different layout")
    registry.note_reuse(compiled_for, entry)
    return entry
