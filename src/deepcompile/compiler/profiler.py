"""Profiling a partitioned graph on its real inputs, in one pass.

The profile run executes the graph's nodes once, in graph order, freeing each value after its
last use exactly as the generated FX code does — no per-node replay, no extra copies, so it
allocates what the graph itself allocates. Per node it records the time (wall clock on CPU;
CUDA events on GPU), the output bytes, and the live bytes after the node: on CUDA
`torch.cuda.memory_allocated()`, on CPU the bytes of distinct storages alive in the graph
(inputs count as alive for the whole graph, as they are in the caller's argument list) plus
the bytes the runtime holds outside the graph.

[Note: CPU memory model] Storages are keyed by data pointer with reference counts over live
values, so views cost nothing and a value freed while a view survives stays counted. The
parameter shards are views of a few flat buffers (runtime/flat.py): a tensor in one of those
(`split`) is counted by its own extent, keyed by (storage, offset), so a graph holds the
shards it takes, not their whole buffers. Host buffers that graphs pass around (activations
kept on the host between forward and backward: runtime/activations.py) are not device memory
and are not counted (`host_memory`). The static model in `liveness.py` computes the same curve from
shapes alone; tests compare them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch
from torch import fx

from .. import _compat
from ..runtime import ops

COMM_KINDS = ops.COMM_KINDS   # op -> kind ([Note: communication op kinds] in runtime/ops.py)


@dataclasses.dataclass
class NodeProfile:
    name: str
    op: str            # target name
    kind: str          # "compute" or a collective kind
    param: str | None  # parameter name for communication nodes
    time_s: float
    start_s: float     # offset from the start of the graph run
    out_bytes: int
    live_bytes: int


@dataclasses.dataclass
class GraphProfile:
    slot: str
    version: int               # graph version (bumped by every pass that changes it)
    nodes: list[NodeProfile]
    total_s: float             # wall time of the whole run (CUDA: the device's, first node
                               # to last)
    # collectives one run launched, as the lowered code that ran counts them: kind -> [count,
    # bytes], the mean over the profiled runs (a graph that accumulates gradients locally
    # reduces in the window's last micro-step only; at world size 1 nothing is launched).
    # None: not measured (count the graph's nodes)
    launched: dict[str, list[float]] | None = None
    # [Note: profiling ahead of the device] the host's time to issue the run (CUDA: before
    # waiting for the device), and how long the device was kept busy before the first node
    host_s: float = 0.0
    lead_s: float = 0.0

    @property
    def peak_bytes(self) -> int:
        return max((n.live_bytes for n in self.nodes), default=0)

    def comm_s(self) -> float:
        return sum(n.time_s for n in self.nodes if n.kind != "compute")

    def exposed_comm_s(self) -> float:
        """Time the graph spends blocked on communication (sync collectives and waits)."""
        return sum(n.time_s for n in self.nodes if n.kind in ops.BLOCKING)

    def compute_s(self) -> float:
        return sum(n.time_s for n in self.nodes if n.kind == "compute")

    def collectives(self) -> float:
        """Collectives launched per run (`launched` where the run measured it)."""
        if self.launched is not None:
            return sum(n for n, _ in self.launched.values())
        return sum(1 for n in self.nodes if n.kind in ops.LAUNCHES)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def collectives_launched(gm: fx.GraphModule) -> dict[str, int]:
    """How many all-gathers and reduce-scatters a graph launches per run (synchronous ones and
    starts; a start for the next graph counts here, where it runs)."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    for node in gm.graph.nodes:
        kind = COMM_KINDS.get(node.target) if node.op == "call_function" else None
        if kind in ops.LAUNCHES:
            launched = ops.LAUNCHES[kind]
            counts[launched] = counts.get(launched, 0) + 1
    return counts


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for t in value if isinstance(t, torch.Tensor)]
    if value is None or isinstance(value, (int, float, bool)):
        return []
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def last_uses(graph: fx.Graph, keep_inputs: bool = True) -> dict[fx.Node, list[fx.Node]]:
    """node -> values whose last use is that node (placeholders excluded, kept to the end,
    unless not `keep_inputs`)."""
    last: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for inp in node.all_input_nodes:
            last[inp] = node
    out: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last.items():
        if value.op != "placeholder" or not keep_inputs:
            out.setdefault(user, []).append(value)
    return out


class RefCountedBytes:
    """Bytes of distinct storages, each counted once while any live value refers to it.

    Shared by the measured CPU memory model (keys: storage data pointers) and the static one in
    `liveness.py` (keys: alias roots from the op schemas)."""

    def __init__(self) -> None:
        self._refs: dict[Any, list[int]] = {}
        self.bytes = 0

    def add(self, key: Any, nbytes: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [nbytes, 1]
            self.bytes += nbytes
        else:
            entry[1] += 1

    def remove(self, key: Any) -> None:
        entry = self._refs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self._refs[key]


def _storages(value: Any, split: frozenset[int] = frozenset()) -> tuple[list[tuple[Any, int]], int]:
    """(key, bytes) of each real storage in `value`, and its output bytes (a tensor in a
    storage of `split` counts its own extent: [Note: CPU memory model])."""
    out, out_bytes = [], 0
    for t in tensors_in(value):
        nbytes = t.numel() * t.element_size()
        out_bytes += nbytes
        if t.device.type == "meta":
            continue
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr in split:
            out.append(((ptr, t.storage_offset()), nbytes))
        elif ptr:
            out.append((ptr, s.nbytes()))
    return out, out_bytes


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "__name__", None) or str(t)


def _param_of(node: fx.Node, name_of: Callable[[int], str]) -> str | None:
    if node.op == "call_function" and node.target in COMM_KINDS:
        pids = node.args[1]
        return ",".join(name_of(int(p)) for p in pids) if isinstance(pids, (list, tuple)) \
            else name_of(int(pids))
    return None


def profile_run(gm: fx.GraphModule, args: list[Any], *, slot: str, version: int,
                name_of: Callable[[int], str],
                runtime_bytes: Callable[[], int] = lambda: 0,
                uncounted: frozenset[int] = frozenset(),
                transient: frozenset[int] = frozenset(),
                split: frozenset[int] = frozenset(),
                host_memory: set[int] | frozenset[int] = frozenset(),
                lead_s: float = 0.0) -> tuple[Any, GraphProfile]:
    """Run `gm` on `args` once, node by node; return its outputs and its profile. Inputs at
    the positions in `uncounted` are the runtime's (counted by `runtime_bytes`, not here);
    inputs at the positions in `transient` are freed after their last use (`args` is
    consumed: the caller hands them over); the others stay alive to the end, as the caller's
    arguments do. Storages at the addresses in `host_memory` are host memory, not counted ([Note: CPU
    memory model]). `lead_s` (CUDA): [Note: profiling ahead of the device]."""
    graph = gm.graph
    cuda = any(t.is_cuda for t in tensors_in(args))
    free_after = last_uses(graph, keep_inputs=not transient)
    env: dict[fx.Node, Any] = {}
    held: dict[fx.Node, list[int]] = {}   # storage keys each live value holds
    live = RefCountedBytes()
    records: list[tuple[fx.Node, Any, Any, int, int]] = []  # node, start, end, out, live
    inputs: set[fx.Node] = set()          # placeholders alive to the end
    external: set[Any] = set()            # storages of the runtime's inputs
    arg_iter = iter(enumerate(args))
    clock = time.perf_counter
    if cuda:
        torch.cuda.synchronize()
        if lead_s > 0:
            # [Note: profiling ahead of the device] A node's CUDA events time the device
            # between them: when the host issues the nodes one by one (tens of microseconds
            # each, more with this bookkeeping) slower than the device runs them, they time the
            # host, not the kernel — small nodes by far the most, which compiled code fuses.
            # Kept busy first for longer than the host takes to issue the graph, the device
            # finds every node already queued and the events time it alone. The pipeline
            # sizes the lead from the last run's host time (SlotRunner._profile_lead).
            _compat.cuda_spin(lead_s, next(t.device for t in tensors_in(args) if t.is_cuda))
    t_begin = clock()
    result = None
    for node in graph.nodes:
        if node.op == "placeholder":
            i, value = next(arg_iter)
            env[node] = value
            counted = [(key, nbytes) for key, nbytes in _storages(value, split)[0]
                       if key not in host_memory]
            if i in transient:
                args[i] = None
                held[node] = [key for key, _ in counted]
                for key, nbytes in counted:
                    live.add(key, nbytes)
            else:
                inputs.add(node)
                if i in uncounted:   # the runtime's: its views and in-place results neither
                    external.update(key for key, _ in counted)
                else:
                    for key, nbytes in counted:  # inputs stay alive to the end
                        live.add(key, nbytes)
            continue
        if node.op == "output":
            result = fx.graph.map_arg(node.args[0], env.__getitem__)
            break
        a, kw = fx.graph.map_arg((node.args, node.kwargs), env.__getitem__)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            start = clock()
        if node.op == "call_function":
            value = node.target(*a, **kw)
        elif node.op == "call_method":
            value = getattr(a[0], node.target)(*a[1:], **kw)
        elif node.op == "get_attr":
            value = _fetch_attr(gm, node.target)
        elif node.op == "call_module":
            value = gm.get_submodule(node.target)(*a, **kw)
        else:
            raise RuntimeError(f"deepcompile profiler: unexpected node op {node.op!r}")
        if cuda:
            end.record()
        else:
            end = clock()
        env[node] = value
        storages, out_bytes = _storages(value, split)
        if external or host_memory:   # (it grows while the graph runs: buffers made on first use)
            storages = [(key, nbytes) for key, nbytes in storages
                        if key not in external and key not in host_memory]
        for key, nbytes in storages:
            live.add(key, nbytes)
        held[node] = [key for key, _ in storages]
        for dead in free_after.get(node, ()):
            if dead in inputs:
                continue
            del env[dead]
            for key in held.pop(dead):
                live.remove(key)
        used = torch.cuda.memory_allocated() if cuda else live.bytes + runtime_bytes()
        records.append((node, start, end, out_bytes, used))
    host = clock() - t_begin
    if cuda:
        torch.cuda.synchronize()
    total = clock() - t_begin
    if cuda and records:
        total = records[0][1].elapsed_time(records[-1][2]) / 1e3
    nodes = []
    for node, start, end, out_bytes, used in records:
        if cuda:
            t, s = start.elapsed_time(end) / 1e3, 0.0
        else:
            t, s = end - start, start - t_begin
        nodes.append(NodeProfile(name=node.name, op=_target_name(node),
                                 kind=COMM_KINDS.get(node.target, "compute")
                                 if node.op == "call_function" else "compute",
                                 param=_param_of(node, name_of), time_s=t, start_s=s,
                                 out_bytes=out_bytes, live_bytes=used))
    if cuda:  # event offsets need a common origin: cumulative times are a faithful ordering
        acc = 0.0
        for n in nodes:
            n.start_s, acc = acc, acc + n.time_s
    return result, GraphProfile(slot=slot, version=version, nodes=nodes, total_s=total,
                                host_s=host, lead_s=lead_s if cuda else 0.0)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
