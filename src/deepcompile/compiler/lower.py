"""Lowering: a planned graph's communication nodes become functional collectives and aten ops.

The passes plan over the communication IR (`runtime/ops.py`: the insertion ops and the
scheduling markers). Before a graph runs — in warm-up, in profiling and in the steady state —
`lower` rewrites a copy of it so that every collective is a `_c10d_functional` C++ op (which
Inductor lowers and calls from its generated code, no Python in between) and every copy, cast,
pad and divide is an aten op Inductor can fuse. The lowered graph computes exactly what the
planned one describes; nothing in it calls back into Python.

| node | lowered to (world W > 1) | W == 1 |
| --- | --- | --- |
| `allgather_param` | cast, `all_gather_into_tensor`, `wait_tensor`, slice, view | cast / view of the shard |
| `allgather_start` / `_wait` | casts, one `cat`, one all-gather / wait, per member a column-block copy (a view for a group of one) | per member as above |
| `allgather_for_next` | the next graph's shards as inputs, cast, cat, all-gather, **returned unwaited** (with its input, when not an input) | nothing |
| `allgather_from_prev` | the parked buffer as an input, `wait_tensor`, split | per member as above |
| `kept_param` | an input: the runtime's kept tensor | same |
| `replica_wait` (ZeRO-1/2) | `wait_tensor` of the replica input: its deferred refresh | the replica |
| `reduce_grad` | flatten, cast, pad, `reduce_scatter_tensor("sum")`, wait, divide, cast | flatten, cast |
| `reduce_start` / `_wait` | per member flatten/cast/pad as [W, n], one `cat` along dim 1, one reduce-scatter; wait, divide, one slice copy per member | per member flatten, cast |
| accumulated (`accumulate_grad` / `accumulate_start` bucket, ZeRO-1's `reduce_grad` / bucket with shards) | variant "accum": `add_` into the accumulator input, zeros out; "last": reduce `accumulator + grad` (a bucket: one reduce-scatter), zero the accumulator | ZeRO-1: not deferred |
| `reload_state` (offload) | unchanged: the one Python op left, once per reload group | |
| `grad_to_host` (offload, tier 2) | unchanged (a Python op per gradient sent to the host); the gradient's output becomes None | |
| `activation_offload` / `_reload` / `_wait` (activation_budget) | unchanged (a Python op each per offloaded activation: runtime/activations.py) | |

Under a hierarchical layout ([Note: layouts] in runtime/mesh.py) "W" is the group a collective
runs in: `hsdp` gathers and reduce-scatters within the group and all-reduces each reduced slice
across the groups ([Note: hierarchical reduction]); `hpz` gathers over every rank in a forward
graph, copying each rank's secondary block out of the gathered buffer into a runtime buffer
(an extra input, written in place), and in a backward graph all-gathers those blocks within the
group ([Note: secondary shards] in runtime/secondary.py); `hsdp_zero` gathers every parameter,
forward and backward, within the group from its secondary shard, and reduce-scatters each
reduced slice across the groups.

This module is one job, longer than most: `_Lowering` has a method for each row of the table,
and they share one lowering's state (the new graph, its extra inputs and outputs, the counts).

[Note: runtime inputs] What the runtime holds (kept parameters, gradient accumulators, a
gather parked by the previous graph, the next graph's shards) becomes extra trailing inputs of
the lowered graph; gathers started for the next graph become extra trailing outputs. The slot
appends the inputs and strips the outputs around every call (`Lowered.extra_inputs`,
`Lowered.finish`): per call a fixed number of Python operations, none per parameter (tables are
looked up with `map` over the arguments). Tables keyed by a shard's data pointer make a graph
that Dynamo reuses for other parameters ([Note: graph reuse]) use the runtime tensors of the
parameters it is actually called with.

Every node the lowering creates carries `meta["dc_origin"]`: the name of the planned node it
stands for, so that a profile of the lowered graph folds back onto the planned graph
(`fold_profile`) and the passes keep planning over the nodes they placed.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Any, Callable

import torch
from torch import fx

from .. import _compat
from ..runtime import offload, ops
from ..runtime.registry import ParamEntry, lookup
from ..runtime.secondary import secondary_numel
from . import coverage
from .coverage import param_name
from .profiler import GraphProfile, NodeProfile

aten = torch.ops.aten
_CAST = torch.ops.prims.convert_element_type.default
_AG, _RS, _WAIT = _compat.funcol_ops()
_AR = _compat.funcol_all_reduce()


@dataclasses.dataclass
class Lowered:
    """A lowered graph and how to call it (see [Note: runtime inputs])."""
    gm: fx.GraphModule
    n_in: int                                 # the planned graph's inputs
    n_out: int                                # the planned graph's outputs
    extra_inputs: Callable[[list], list]      # args -> the extra inputs, in order
    uncounted: frozenset[int]                 # input positions held by the runtime (memory model)
    transient: frozenset[int]                 # input positions freed after their last use
    park_keys: list[tuple[int, ...] | None]   # per extra output: the group it gathers (None:
                                              # the input of the gather before, not parked)
    counts: tuple[tuple[str, int, int], ...]  # collectives launched per run: (kind, n, bytes)
    group_counts: tuple[tuple[str, str, int, int], ...]   # the same per group: (label, kind, n,
                                                          # bytes), what `finish` counts
    acc_positions: tuple[int, ...]            # positions of accumulators among the extra inputs
    last: bool                                # the variant of the window's last micro-step
    runtime: Any
    # called before each run (ZeRO-1/2): waits for the replicas' refresh, in a graph that does
    # not wait for them itself (`replica_wait`: [Note: deferred refresh] in
    # runtime/replicas.py); None where it does, at ZeRO-3 and at world size 1
    settle: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self._pick_accs = _picker(list(self.acc_positions))

    def prepare(self, args: list) -> tuple[list, tuple]:
        """The full argument list of a run (the planned graph's, then the extra inputs), and
        the accumulators among them."""
        if self.settle is not None:
            self.settle()
        extra = self.extra_inputs(args)
        accs = self._pick_accs(extra)
        return [*args, *extra], accs

    def finish(self, out, accs: tuple):
        """After a run: count its collectives, record the accumulators it touched, park the
        gathers it started for the next graph; returns the planned graph's outputs."""
        rt = self.runtime
        rt.comm.add_counts(self.group_counts)
        if accs:
            rt.accum.mark(self.last, accs)
        if self.park_keys:
            for key, buffer in zip(self.park_keys, out[self.n_out:]):
                # None: a gather's input, returned to keep it ([Note: an unwaited gather's input])
                if key is not None:
                    rt.parked.park(key, buffer)
            out = out[: self.n_out]
        return out


def _picker(indices: list[int]) -> Callable[[list], Any]:
    """args -> the arguments at `indices` (a sequence), in C: no Python frame per call."""
    if not indices:
        return operator.itemgetter(slice(0, 0))
    if len(indices) == 1:
        return operator.itemgetter(slice(indices[0], indices[0] + 1))
    return operator.itemgetter(*indices)


def needs_variants(gm: fx.GraphModule, runtime) -> bool:
    """Whether the graph accumulates gradients locally (two lowered variants: "accum", "last")."""
    if runtime.step.gradient_accumulation_steps == 1:
        return False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is ops.ACCUMULATE_GRAD or node.target is ops.ACCUMULATE_START:
            return True
        if runtime.defers_reduce and (
                (node.target is ops.REDUCE_GRAD and ops.reduce_grad_shard(node) is not None)
                or (node.target is ops.REDUCE_START and len(node.args) > 2 and node.args[2])):
            return True
    return False


class _Lowering:
    def __init__(self, gm: fx.GraphModule, runtime, last: bool, kind: str = "fw",
                 key: str = "") -> None:
        self.src = gm
        self.key = key or "?"
        self.rt = runtime
        lay = runtime.layout
        # [Note: layouts] in runtime/mesh.py. Gathers: over the ranks the primary shards span,
        # or (hpz, a backward graph) within the group, from the secondary shards the forward
        # keeps (`keeps_secondary`: [Note: secondary shards] in runtime/secondary.py).
        # hsdp_zero: every gather reads the secondary shards (refreshed after the step)
        self.secondary = lay.secondary is not None and (kind == "bw" or lay.refreshed_secondary)
        self.keeps_secondary = lay.secondary is not None and kind == "fw" and \
            not lay.refreshed_secondary
        gathers = lay.secondary if self.secondary else lay.shard
        self.world = gathers.world           # ranks one gather spans
        self.group = gathers.group_name
        self.label = gathers.label
        # reductions: a reduce-scatter over the shard group, then across the groups an
        # all-reduce (hsdp) or a reduce-scatter (hsdp_zero: `across_rs`); the mean divides by
        # every rank
        self.shard_comm, self.replicate = lay.shard, lay.replicate
        self.across_rs = lay.primary is not None and lay.replicate is not None
        self.ranks = lay.world.world
        self.local_reduce = lay.shard.world == 1 and lay.replicate is None
        self.last = last
        self.g = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.placeholders: list[fx.Node] = []       # the planned graph's, in order
        self.arg_index: dict[fx.Node, int] = {}      # planned placeholder -> argument position
        # extra inputs, by kind: (placeholder, payload)
        self.fixed: list[tuple[fx.Node, torch.Tensor]] = []
        self.by_kept: list[tuple[fx.Node, int]] = []     # payload: argument position of the shard
        self.by_acc: list[tuple[fx.Node, int]] = []
        self.by_sec: list[tuple[fx.Node, int]] = []
        self.sec_inputs: dict[int, fx.Node] = {}     # pid -> its secondary shard's extra input
        self.reducing: list[dict] = []               # started buckets, all-reduce not launched
        # (placeholder, key, shard positions, expected shards, entries, dtype, from the
        # secondary shards)
        self.parked: list[tuple] = []
        self.acc_fixed: list[fx.Node] = []           # fixed inputs that are accumulators
        self.outputs_extra: list[fx.Node] = []
        self.park_keys: list[tuple[int, ...]] = []
        self.counts: dict[tuple[str, str], list[int]] = {}   # (group label, kind) -> [n, bytes]
        self.origin = ""
        self.pending: dict[fx.Node, dict] = {}       # start marker -> what its wait needs
        self.to_host: set[fx.Node] = set()           # gradients sent to the host: None outputs
        self.copies: dict[int, fx.Node] = {}         # pid -> its tier-3 copy's extra input
        self.input_names: dict[str, int] = {}        # extra inputs made under each name
        # the parameters whose gathers and reductions became collectives (or local ops)
        self.gathered: list[int] = []
        self.reduced: list[int] = []

    # -- building blocks ------------------------------------------------------------------------
    def op(self, target, *args, **kwargs) -> fx.Node:
        node = self.g.call_function(target, args, kwargs)
        node.meta["dc_origin"] = self.origin
        return node

    def cast(self, x: fx.Node, have: torch.dtype, want: torch.dtype) -> fx.Node:
        return x if have == want else self.op(_CAST, x, want)

    def count(self, kind: str, nbytes: int, label: str) -> None:
        c = self.counts.setdefault((label, kind), [0, 0])
        c[0] += 1
        c[1] += nbytes

    def extra_input(self, name: str) -> fx.Node:
        # a placeholder's name is an argument of the generated code: unique, also where a
        # graph asks twice under one name (a group started for the next graph that holds a
        # parameter twice: a recompute's gather fused with the backward's own gather of it)
        n = self.input_names[name] = self.input_names.get(name, 0) + 1
        node = self.g.placeholder(f"rt_{name}" if n == 1 else f"rt_{name}_{n}")
        node.meta["dc_origin"] = ""
        return node

    def arg(self, node) -> Any:
        return fx.graph.map_arg(node, self.env.__getitem__)

    # -- gathers --------------------------------------------------------------------------------
    def source(self, shard: fx.Node, e: ParamEntry) -> fx.Node:
        """What a gather of `e` reads: its shard, or while its master is on the host (offload
        tier 3) the shard's device copy in the compute dtype, a fixed extra input ([Note:
        masters on the host] in runtime/offload/masters.py); a backward gather under hpz: its
        secondary shard."""
        if self.secondary:
            return self.secondary_input(shard, e)
        if e.lowp is None:
            return self.env[shard]
        ph = self.copies.get(e.pid)
        if ph is None:
            ph = self.copies[e.pid] = self.extra_input(f"lowp_{e.pid}")
            self.fixed.append((ph, e.lowp))
        return ph

    def have(self, e: ParamEntry) -> torch.dtype:
        """The dtype of what `source` gives for `e`."""
        if self.secondary:
            return e.compute_dtype
        return e.shard.dtype if e.lowp is None else e.lowp.dtype

    def local_numel(self, e: ParamEntry) -> int:
        """Elements of what each rank contributes to a gather of `e`."""
        return secondary_numel(e) if self.secondary else e.shard.numel()

    def secondary_input(self, shard: fx.Node | None, e: ParamEntry) -> fx.Node:
        """`e`'s secondary shard: an extra input, the runtime's buffer of the parameter the
        graph is called with (found by its shard's position) or, where the shard is not an
        argument, of `e` itself."""
        ph = self.sec_inputs.get(e.pid)
        if ph is None:
            ph = self.sec_inputs[e.pid] = self.extra_input(f"sec_{e.pid}")
            buf = self.rt.secondary.of(e)   # made now: the graph's own parameter's
            if shard is not None and shard in self.arg_index:
                self.by_sec.append((ph, self.arg_index[shard]))
            else:
                self.fixed.append((ph, buf))
        return ph

    def write_secondary(self, buffer: fx.Node, entries: list[ParamEntry],
                        shards: list[fx.Node | None]) -> None:
        """A forward gather under hpz: block l of G of each member (rows l*R .. (l+1)*R of
        the [W, sum(shard_numel)] buffer, its columns) into its secondary shard ([Note:
        secondary shards] in runtime/secondary.py)."""
        sec = self.rt.layout.secondary
        per = self.world // sec.world
        total = sum(e.shard.numel() for e in entries)
        rows = self.op(aten.view.default, buffer, [self.world, total])
        mine = self.op(aten.slice.Tensor, rows, 0, sec.rank * per, (sec.rank + 1) * per)
        off = 0
        for e, shard in zip(entries, shards):
            n = e.shard.numel()
            block = mine if len(entries) == 1 else \
                self.op(aten.slice.Tensor, mine, 1, off, off + n)
            self.op(aten.copy_.default, self.secondary_input(shard, e),
                    self.op(aten.reshape.default, block, [-1]))
            off += n

    def shard_full(self, shard: fx.Node, e: ParamEntry, dtype: torch.dtype) -> fx.Node:
        """W == 1: the parameter from its shard, no collective (a view when the dtypes agree)."""
        flat = self.cast(shard, self.have(e), dtype)
        if e.padded_numel != e.numel:
            flat = self.op(aten.slice.Tensor, flat, 0, 0, e.numel)
        return self.op(aten.view.default, flat, list(e.shape))

    def gather_launch(self, shards: list[fx.Node], entries: list[ParamEntry],
                      dtype: torch.dtype) -> fx.Node:
        flats = [self.cast(s, self.have(e), dtype) for s, e in zip(shards, entries)]
        src = flats[0] if len(flats) == 1 else self.op(aten.cat.default, flats)
        total = sum(self.local_numel(e) for e in entries)
        self.count("all_gather", total * self.world * dtype.itemsize, self.label)
        return self.op(_AG, src, self.world, self.group)

    def gather_split(self, buffer: fx.Node, entries: list[ParamEntry]) -> list[fx.Node]:
        """The members of a completed gather (`buffer`: [world * sum(shard_numel)])."""
        if len(entries) == 1:
            e = entries[0]
            flat = buffer if e.padded_numel == e.numel else \
                self.op(aten.slice.Tensor, buffer, 0, 0, e.numel)
            return [self.op(aten.view.default, flat, list(e.shape))]
        total = sum(self.local_numel(e) for e in entries)
        rows = self.op(aten.view.default, buffer, [self.world, total])
        out, off = [], 0
        for e in entries:
            n = self.local_numel(e)
            block = self.op(aten.slice.Tensor, rows, 1, off, off + n)
            flat = self.op(aten.reshape.default, block, [-1])   # the column block's copy
            if e.padded_numel != e.numel:
                flat = self.op(aten.slice.Tensor, flat, 0, 0, e.numel)
            out.append(self.op(aten.view.default, flat, list(e.shape)))
            off += n
        return out

    def gather_sync(self, node: fx.Node) -> fx.Node:
        shard, pid, _shape, dtype = node.args
        e = lookup(int(pid))
        self.gathered.append(e.pid)
        s = self.source(shard, e)
        if self.world == 1:
            return self.shard_full(s, e, dtype)
        buffer = self.op(_WAIT, self.gather_launch([s], [e], dtype))
        if self.keeps_secondary:
            self.write_secondary(buffer, [e], [shard])
        return self.gather_split(buffer, [e])[0]

    def gather_start(self, node: fx.Node) -> None:
        shards, pids, dtype = node.args
        entries = [lookup(int(p)) for p in pids]
        vals = [self.source(s, e) for s, e in zip(shards, entries)]
        if self.world == 1:
            self.pending[node] = {"local": vals, "entries": entries, "dtype": dtype}
        else:
            self.pending[node] = {"buffer": self.gather_launch(vals, entries, dtype),
                                  "entries": entries, "shards": list(shards)}

    def gather_wait(self, node: fx.Node) -> list[fx.Node]:
        started = self.pending.pop(node.args[0])
        entries = started["entries"]
        self.gathered += [e.pid for e in entries]
        if "local" in started:
            return [self.shard_full(s, e, started["dtype"])
                    for s, e in zip(started["local"], entries)]
        buffer = self.op(_WAIT, started["buffer"])
        if self.keeps_secondary:
            self.write_secondary(buffer, entries, started["shards"])
        return self.gather_split(buffer, entries)

    def gather_for_next(self, node: fx.Node) -> None:
        _after, pids, dtype = node.args
        if self.world == 1:
            return
        entries = [lookup(int(p)) for p in pids]
        shards = []
        for e in entries:
            if self.secondary:   # the next backward graph's: their secondary shards
                ph = self.secondary_input(None, e)
            elif e.lowp is None:
                ph = self.extra_input(f"next_{e.pid}")
                self.fixed.append((ph, e.shard))
            else:   # a tier-3 shard's copy (runtime memory, as `source`'s)
                ph = self.extra_input(f"lowp_next_{e.pid}")
                self.fixed.append((ph, e.lowp))
            shards.append(ph)
        buffer = self.gather_launch(shards, entries, dtype)
        self.outputs_extra.append(buffer)
        self.park_keys.append(tuple(int(p) for p in pids))
        src = buffer.args[0]
        if src.op != "placeholder":
            # [Note: an unwaited gather's input] Inductor keeps a collective's input from reuse
            # only until the wait that reads it: with the wait in the next graph, it would give
            # the input's memory (a cast, a cat) to a later buffer of this graph while the
            # all-gather may still read it (on CUDA, NCCL's stream). Returned, it is never
            # reused; the runtime drops it at once (`Lowered.finish`), and from then on the
            # allocator holds the block for the collective (c10d records it on NCCL's stream).
            self.outputs_extra.append(src)
            self.park_keys.append(None)

    def gather_from_prev(self, node: fx.Node) -> list[fx.Node]:
        shards, pids, dtype = node.args
        entries = [lookup(int(p)) for p in pids]
        self.gathered += [e.pid for e in entries]
        vals = [self.source(s, e) for s, e in zip(shards, entries)]
        if self.world == 1:
            return [self.shard_full(s, e, dtype) for s, e in zip(vals, entries)]
        positions = [self.arg_index[s] for s in shards]   # the shards B is called with
        ph = self.extra_input(f"prev_{entries[0].pid}")
        self.parked.append((ph, tuple(int(p) for p in pids), positions,
                            [e.shard for e in entries], entries, dtype, self.secondary))
        buffer = self.op(_WAIT, ph)
        if self.keeps_secondary:
            self.write_secondary(buffer, entries, list(shards))
        return self.gather_split(buffer, entries)

    def replica_wait(self, node: fx.Node) -> fx.Node:
        replica = self.env[node.args[0]]
        return replica if self.world == 1 else self.op(_WAIT, replica)

    def kept(self, node: fx.Node) -> fx.Node:
        shard, pid, _shape, _dtype = node.args
        e = lookup(int(pid))
        self.gathered.append(e.pid)
        if e.lowp is not None:   # its refresh would read a released master
            raise RuntimeError(f"deepcompile lower: {e.name} is kept gathered and its master is "
                               "on the host (offload tier 3): the plans disagree")
        ph = self.extra_input(f"kept_{e.pid}")
        if shard in self.arg_index:
            self.by_kept.append((ph, self.arg_index[shard]))
        else:
            self.fixed.append((ph, self.rt.kept.full[e.pid]))
        return ph

    # -- reductions -----------------------------------------------------------------------------
    def accumulator(self, e: ParamEntry, shard: fx.Node | None) -> fx.Node:
        self.rt.accum.enable([e])
        ph = self.extra_input(f"acc_{e.pid}")
        if shard is not None and shard in self.arg_index:
            self.by_acc.append((ph, self.arg_index[shard]))
        else:
            self.fixed.append((ph, self.rt.accum.of(e)))
            self.acc_fixed.append(ph)
        return ph

    def reduce_flat(self, grad: fx.Node, e: ParamEntry) -> fx.Node:
        """The gradient as the [S, shard_numel] rows of a reduce-scatter input (S: the ranks of
        the shard group); hsdp_zero: [G, R, piece numel], so that a bucket concatenated along
        the last dim leaves, after the reduce-scatter in the group, the [R, sum of pieces] rows
        the reduce-scatter across the groups takes ([Note: pieces in reduction order])."""
        val = grad.meta.get("val")
        flat = self.op(aten.reshape.default, grad, [-1])
        have = val.dtype if isinstance(val, torch.Tensor) else None
        if have != e.reduce_dtype:
            flat = self.op(_CAST, flat, e.reduce_dtype)
        if e.padded_numel != e.numel:
            flat = self.op(aten.constant_pad_nd.default, flat, [0, e.padded_numel - e.numel], 0.0)
        if self.across_rs:
            return self.op(aten.view.default, flat,
                           [self.shard_comm.world, self.replicate.world, e.shard.numel()])
        return self.op(aten.view.default, flat, [self.shard_comm.world, e.shard.numel()])

    # [Note: hierarchical reduction] Under hsdp a bucket's gradients are reduce-scattered
    # (summed) in the shard group and the slice is all-reduced (summed) across the groups, then
    # divided by every rank (hsdp_zero: reduce-scattered across the groups, each rank keeping
    # its piece). The all-reduce needs the reduce-scatter's result, so it is launched
    # after a wait for it: where the next bucket starts (the reduce-scatter has had that
    # bucket's compute to finish; the all-reduce then runs under the next bucket's), or at the
    # bucket's own wait if that comes first. The two collectives run on different groups (on
    # NCCL, different streams): the wait orders them.
    def reduce_launch(self, grads: list[fx.Node], entries: list[ParamEntry]) -> dict:
        """Start a bucket's reduction (its reduce-scatter in the shard group, where that group
        has more than one rank); returns what `reduce_split` finishes."""
        for started in list(self.reducing):   # [Note: hierarchical reduction]
            self.launch_all_reduce(started)
        rows = [self.reduce_flat(g, e) for g, e in zip(grads, entries)]
        bucket = rows[0] if len(rows) == 1 else self.op(aten.cat.default, rows, -1)
        bucket = self.op(aten.view.default, bucket, [-1])
        sc = self.shard_comm
        if sc.world == 1:
            started = {"summed": bucket, "entries": entries}
        else:
            self.count("reduce_scatter",
                       sum(e.padded_numel for e in entries) * entries[0].reduce_dtype.itemsize,
                       sc.label)
            started = {"scattered": self.op(_RS, bucket, "sum", sc.world, sc.group_name),
                       "entries": entries}
        if self.replicate is not None:
            self.reducing.append(started)
        return started

    def launch_all_reduce(self, started: dict) -> None:
        """hsdp: the all-reduce across the groups of a started bucket's slice (hsdp_zero: its
        reduce-scatter)."""
        summed = started.pop("summed", None)
        if summed is None:
            summed = self.op(_WAIT, started.pop("scattered"))
        entries, rep = started["entries"], self.replicate
        if self.across_rs:
            self.count("reduce_scatter", sum(e.shard.numel() for e in entries) * rep.world
                       * entries[0].reduce_dtype.itemsize, rep.label)
            started["all_reduced"] = self.op(_RS, summed, "sum", rep.world, rep.group_name)
        else:
            self.count("all_reduce",
                       sum(e.shard.numel() for e in entries) * entries[0].reduce_dtype.itemsize,
                       rep.label)
            started["all_reduced"] = self.op(_AR, summed, "sum", rep.group_name)
        self.reducing.remove(started)

    def reduce_split(self, started: dict, zero: list[fx.Node] = ()) -> list[fx.Node]:
        entries = started["entries"]
        if self.replicate is not None and "all_reduced" not in started:
            self.launch_all_reduce(started)
        if "all_reduced" in started:
            done = self.op(_WAIT, started["all_reduced"])
        else:
            done = self.op(_WAIT, started["scattered"])
        self.zero_after(zero)   # accumulators the reduction read
        mean = self.op(aten.div.Tensor, done, self.ranks)
        if len(entries) == 1:
            e = entries[0]
            return [self.cast(mean, e.reduce_dtype, e.shard.dtype)]
        out, off = [], 0
        for e in entries:   # one new tensor per member: outputs never alias each other
            n = e.shard.numel()
            part = self.op(aten.slice.Tensor, mean, 0, off, off + n)
            out.append(self.op(aten._to_copy.default, part, dtype=e.shard.dtype))
            off += n
        return out

    def local_grad(self, grad: fx.Node, e: ParamEntry) -> fx.Node:
        """One rank: the shard gradient is the gradient (flat, master dtype)."""
        val = grad.meta.get("val")
        have = val.dtype if isinstance(val, torch.Tensor) else None
        flat = self.op(aten.reshape.default, grad, [-1])
        return flat if have == e.shard.dtype else self.op(_CAST, flat, e.shard.dtype)

    def accumulate(self, grad: fx.Node, e: ParamEntry, acc: fx.Node) -> fx.Node | None:
        """Add the gradient into its accumulator, in place. Variant "accum": returns None (the
        shard gradient is zeros). Variant "last": returns the accumulator, to be reduced and
        then zeroed (`zero_after`) once the reduction no longer reads it."""
        self.op(aten.add_.Tensor, acc, self.op(aten.reshape.default, grad, [-1]))
        if not self.last:
            return None
        acc.meta["val"] = torch.empty(0, dtype=e.shard.dtype, device="meta")
        return acc

    def zero_after(self, accs: list[fx.Node]) -> None:
        for acc in accs:
            self.op(aten.zero_.default, acc)

    def zeros(self, e: ParamEntry) -> fx.Node:
        return self.op(aten.zeros.default, [e.shard.numel()], dtype=e.shard.dtype,
                       device=e.shard.device)

    def reduce_sync(self, node: fx.Node, accumulated: bool) -> fx.Node:
        grad, pid = node.args[0], int(node.args[1])
        e = lookup(pid)
        self.reduced.append(e.pid)
        g = self.env[grad]
        g.meta.setdefault("val", grad.meta.get("val"))
        shard = ops.reduce_grad_shard(node) if node.target is ops.REDUCE_GRAD else None
        zero = []
        if accumulated:
            total = self.accumulate(g, e, self.accumulator(e, shard))
            if total is None:
                return self.zeros(e)
            g, zero = total, [total]
        if self.local_reduce:
            out = self.local_grad(g, e)
            if zero:   # the accumulator is zeroed next: hand out a copy of it
                out = self.op(aten.clone.default, out)
            self.zero_after(zero)
            return out
        return self.reduce_split(self.reduce_launch([g], [e]), zero)[0]

    def reduce_start(self, node: fx.Node, accumulated: bool) -> None:
        grads, pids = node.args[0], node.args[1]
        shards = node.args[2] if len(node.args) > 2 and node.args[2] else [None] * len(pids)
        entries = [lookup(int(p)) for p in pids]
        self.reduced += [e.pid for e in entries]
        vals = []
        for g, e, sh in zip(grads, entries, shards):
            v = self.env[g]
            v.meta.setdefault("val", g.meta.get("val"))
            if accumulated:
                v = self.accumulate(v, e, self.accumulator(e, sh))
            vals.append(v)
        zero = vals if accumulated else []
        if accumulated and not self.last:
            self.pending[node] = {"zeros": entries}
        elif self.local_reduce:
            self.pending[node] = {"local": vals, "entries": entries, "zero": zero}
        else:
            self.pending[node] = {"reduced": self.reduce_launch(vals, entries), "zero": zero}

    def reduce_wait(self, node: fx.Node) -> list[fx.Node]:
        started = self.pending.pop(node.args[0])
        if "zeros" in started:
            return [self.zeros(e) for e in started["zeros"]]
        if "local" in started:
            out = [self.local_grad(v, e) for v, e in zip(started["local"], started["entries"])]
            if started["zero"]:
                out = [self.op(aten.clone.default, o) for o in out]
            self.zero_after(started["zero"])
            return out
        return self.reduce_split(started["reduced"], started["zero"])

    # -- the whole graph ------------------------------------------------------------------------
    def run(self) -> fx.Graph:
        defer = self.rt.defers_reduce
        gas1 = self.rt.step.gradient_accumulation_steps == 1
        for node in self.src.graph.nodes:
            self.origin = node.name
            if node.op == "placeholder":
                new = self.g.placeholder(node.name)
                new.meta = dict(node.meta)
                new.meta["dc_origin"] = node.name
                self.arg_index[node] = len(self.placeholders)
                self.placeholders.append(node)
                self.env[node] = new
                continue
            if node.op == "output":
                outs = self.arg(node.args[0])
                # autograd accumulates nothing for these ([Note: gradients on the host])
                if self.to_host:
                    outs = type(outs)(None if o in self.to_host else o for o in outs)
                if self.outputs_extra:
                    outs = tuple(outs) + tuple(self.outputs_extra)
                self.g.output(outs)
                continue
            t = node.target if node.op == "call_function" else None
            if t is ops.ALLGATHER:
                self.env[node] = self.gather_sync(node)
            elif t is ops.ALLGATHER_START:
                self.gather_start(node)
                self.env[node] = None
            elif t is ops.ALLGATHER_WAIT:
                self.env[node] = self.gather_wait(node)
            elif t is ops.ALLGATHER_FOR_NEXT:
                self.gather_for_next(node)
                self.env[node] = None
            elif t is ops.ALLGATHER_FROM_PREV:
                self.env[node] = self.gather_from_prev(node)
            elif t is ops.KEPT_PARAM:
                self.env[node] = self.kept(node)
            elif t is ops.REPLICA_WAIT:
                self.env[node] = self.replica_wait(node)
            elif t is ops.REDUCE_GRAD:
                self.env[node] = self.reduce_sync(
                    node, defer and ops.reduce_grad_shard(node) is not None)
            elif t is ops.ACCUMULATE_GRAD:
                self.env[node] = self.reduce_sync(node, not gas1)
            elif t is ops.REDUCE_START:
                self.reduce_start(node, defer and len(node.args) > 2 and bool(node.args[2]))
                self.env[node] = None
            elif t is ops.ACCUMULATE_START:
                self.reduce_start(node, not gas1)
                self.env[node] = None
            elif t is ops.REDUCE_WAIT:
                self.env[node] = self.reduce_wait(node)
            elif t is operator.getitem and isinstance(self.env.get(node.args[0]), list):
                self.env[node] = self.env[node.args[0]][node.args[1]]
            else:
                new = self.g.node_copy(node, self.env.__getitem__)
                new.meta["dc_origin"] = node.name
                self.env[node] = new
                if t is offload.GRAD_TO_HOST:
                    self.to_host.add(self.env[node.args[0]])
        if self.pending:
            raise RuntimeError("deepcompile lower: a start without its wait in "
                               f"{sorted(n.name for n in self.pending)}")
        self._check_coverage()
        self._order_placeholders()
        return self.g

    def _check_coverage(self) -> None:
        """[Note: gradient coverage] in compiler/coverage.py: every gather and every reduction
        of the planned graph became collectives (or local ops) of the same parameters, and no
        insertion op or marker is left to run."""
        gathers: list[int] = []
        for n in self.src.graph.nodes:
            if n.op == "call_function" and n.target in (ops.ALLGATHER, ops.KEPT_PARAM):
                gathers.append(int(n.args[1]))
            elif n.op == "call_function" and n.target in (ops.ALLGATHER_WAIT,
                                                          ops.ALLGATHER_FROM_PREV):
                gathers += [int(p) for p in n.args[1]]
        reduces = [pid for pid, _grad in coverage.reductions(self.src)]
        left = [n.name for n in self.g.nodes if n.op == "call_function" and (
            n.target in (ops.ALLGATHER, ops.REDUCE_GRAD) or n.target in ops.MARKERS)]
        for what, want, got in (("gathers", gathers, self.gathered),
                                ("reductions", reduces, self.reduced)):
            lost = collections.Counter(want) - collections.Counter(got)
            extra = collections.Counter(got) - collections.Counter(want)
            if lost or extra or left:
                pid = min(lost or extra) if lost or extra else None
                raise coverage.CoverageError(
                    f"deepcompile: the lowering broke graph {self.key}: its {what} "
                    + (f"of {param_name(pid)} ({'lost' if lost else 'added'})" if pid is not None
                       else f"left {', '.join(left)} unlowered")
                    + ". This is a bug in deepcompile's lowering; please report it.")

    def _order_placeholders(self) -> None:
        """Extra inputs after the planned graph's, in the order `extra_inputs` builds them."""
        extra = [ph for ph, _ in self.fixed] + [ph for ph, _ in self.by_kept] + \
            [ph for ph, _ in self.by_acc] + [ph for ph, _ in self.by_sec] + \
            [p[0] for p in self.parked]
        last = self.env[self.placeholders[-1]] if self.placeholders else None
        for ph in extra:
            if last is None:
                first = next(iter(self.g.nodes))
                if first is not ph:
                    first.prepend(ph)
            else:
                last.append(ph)
            last = ph


def lower(gm: fx.GraphModule, runtime, *, last: bool = True, kind: str = "fw",
          key: str = "") -> Lowered:
    """The lowered graph of the planned graph `gm` (graph `key`), for the window's last
    micro-step (`last`) or an earlier one (graphs that accumulate gradients locally differ;
    others do not). `kind`: the graph's slot kind ("fw", "bw", "inference"; hpz gathers
    differ in each)."""
    lw = _Lowering(gm, runtime, last, kind, key)
    graph = lw.run()
    graph.lint()
    lowered_gm = fx.GraphModule(gm, graph)
    n_in = len(lw.placeholders)
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    n_out = len(out_node.args[0]) if isinstance(out_node.args[0], (list, tuple)) else 1

    fixed = [t for _, t in lw.fixed]
    kept_get = runtime.kept.table.__getitem__
    acc_get = runtime.accum.table.__getitem__
    ptr = torch.Tensor.data_ptr
    pick_kept = _picker([i for _, i in lw.by_kept])
    pick_acc = _picker([i for _, i in lw.by_acc])
    pick_sec = _picker([i for _, i in lw.by_sec])
    sec_get = runtime.secondary.table.__getitem__ if lw.by_sec else None
    has_kept, has_acc, has_sec = bool(lw.by_kept), bool(lw.by_acc), bool(lw.by_sec)
    parked = [(key, _picker(positions), expected,
               _fallback_gather(entries, dtype, runtime.secondary if secondary else None))
              for _ph, key, positions, expected, entries, dtype, secondary in lw.parked]
    take = runtime.parked.take

    def extra_inputs(args: list) -> list:
        out = list(fixed)
        if has_kept:
            out += map(kept_get, map(ptr, pick_kept(args)))
        if has_acc:
            out += map(acc_get, map(ptr, pick_acc(args)))
        if has_sec:
            out += map(sec_get, map(ptr, pick_sec(args)))
        for key, pick, expected, gather in parked:
            out.append(take(key, pick(args), expected, gather))
        return out

    # positions among the extra inputs; which of them the memory model leaves to the runtime
    order = [ph for ph, _ in lw.fixed] + [ph for ph, _ in lw.by_kept] + \
        [ph for ph, _ in lw.by_acc] + [ph for ph, _ in lw.by_sec] + [p[0] for p in lw.parked]
    accs = {id(ph) for ph in lw.acc_fixed} | {id(ph) for ph, _ in lw.by_acc}
    held = accs | {id(ph) for ph, _ in lw.by_kept} | {id(ph) for ph, _ in lw.by_sec} | \
        {id(ph) for ph, t in lw.fixed if ph.name.startswith(("rt_kept", "rt_lowp", "rt_sec"))}
    acc_positions = tuple(i for i, ph in enumerate(order) if id(ph) in accs)
    uncounted = frozenset(n_in + i for i, ph in enumerate(order) if id(ph) in held)
    parked_ids = {id(p[0]) for p in lw.parked}
    transient = frozenset(n_in + i for i, ph in enumerate(order) if id(ph) in parked_ids)
    replicas = getattr(runtime, "replicas", None)
    settle = replicas.wait if replicas is not None and runtime.comm.world > 1 \
        and not waits_for_replicas(gm) else None
    return Lowered(gm=lowered_gm, n_in=n_in, n_out=n_out, extra_inputs=extra_inputs,
                   uncounted=uncounted, transient=transient, park_keys=lw.park_keys,
                   counts=_by_kind(lw.counts),
                   group_counts=tuple((g, k, n, b) for (g, k), (n, b) in sorted(lw.counts.items())),
                   acc_positions=acc_positions, last=last, runtime=runtime, settle=settle)


def waits_for_replicas(gm: fx.GraphModule) -> bool:
    """Whether a graph waits by itself for every trainable ZeRO-1/2 replica it reads: it has
    `replica_wait`s, and no placeholder marked `dc_replica` (compiler/replicated.py) is read
    but through one. (An inference graph has no marks, and no waits: it waits before it runs.)"""
    waits = False
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.meta.get("dc_replica") is not None:
            if any(u.op != "output" and u.target is not ops.REPLICA_WAIT for u in node.users):
                return False
        waits |= node.op == "call_function" and node.target is ops.REPLICA_WAIT
    return waits


def _by_kind(counts: dict[tuple[str, str], list[int]]) -> tuple[tuple[str, int, int], ...]:
    out: dict[str, list[int]] = {}
    for (_label, kind), (n, nbytes) in counts.items():
        c = out.setdefault(kind, [0, 0])
        c[0] += n
        c[1] += nbytes
    return tuple((k, n, b) for k, (n, b) in sorted(out.items()))


def _fallback_gather(entries: list[ParamEntry], dtype: torch.dtype, secondary=None):
    """A gather of `shards` (B's own) in the layout of the parked buffer, done now (`secondary`:
    a backward's under hpz, from the secondary shards of the parameters they belong to)."""
    if secondary is not None:
        def gather_secondary(shards) -> torch.Tensor:
            return secondary.gather([secondary.entry_by_ptr[s.data_ptr()] for s in shards],
                                    dtype)
        return gather_secondary

    def gather(shards) -> torch.Tensor:   # a tier-3 shard's own storage is released: its copy
        flat = [(s if e.lowp is None else e.lowp).detach().to(dtype)
                for s, e in zip(shards, entries)]
        src = flat[0] if len(flat) == 1 else torch.cat(flat)
        return entries[0].comm.all_gather(src)
    return gather


# -- profiles of the lowered graph, folded onto the planned one ----------------------------------
def fold_profile(prof: GraphProfile, lowered: fx.GraphModule, planned: fx.GraphModule,
                 name_of: Callable[[int], str]) -> GraphProfile:
    """The profile of a lowered graph as a profile of the planned graph: per planned node, the
    time of every lowered node made from it, and the live bytes after the last of them (a
    planned node that lowered to nothing costs nothing, and leaves memory as it was)."""
    origin = {n.name: n.meta.get("dc_origin", n.name) for n in lowered.graph.nodes}
    acc: dict[str, list] = {}
    for rec in prof.nodes:
        key = origin.get(rec.name, rec.name)
        a = acc.get(key)
        if a is None:
            acc[key] = [rec.time_s, rec.start_s, rec.out_bytes, rec.live_bytes]
        else:
            a[0] += rec.time_s
            a[2] = rec.out_bytes
            a[3] = rec.live_bytes
    nodes, live, clock = [], 0, 0.0
    for node in planned.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        a = acc.get(node.name)
        if a is not None:
            live, clock = a[3], a[1]
        kind = ops.COMM_KINDS.get(node.target, "compute") if node.op == "call_function" else "compute"
        nodes.append(NodeProfile(
            name=node.name, op=_target_name(node), kind=kind,
            param=_param_of(node, name_of) if kind != "compute" else None,
            time_s=a[0] if a else 0.0, start_s=clock, out_bytes=a[2] if a else 0,
            live_bytes=live))
    return GraphProfile(slot=prof.slot, version=prof.version, nodes=nodes, total_s=prof.total_s,
                        launched=prof.launched)


def _target_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", None) or str(t)


def _param_of(node: fx.Node, name_of: Callable[[int], str]) -> str | None:
    pids = node.args[1] if len(node.args) > 1 else None
    if isinstance(pids, (list, tuple)):
        return ",".join(name_of(int(p)) for p in pids)
    return name_of(int(pids)) if isinstance(pids, int) else None
