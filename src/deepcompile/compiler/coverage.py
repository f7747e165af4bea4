"""Coverage: every parameter a graph reads is gathered where it is read, and every gradient it
makes is reduced once, as its own parameter's.

[Note: gradient coverage] Passes rewrite a graph's communication (they move, fuse, bucket,
keep or offload gathers and reductions), never what it computes. A pass that loses a reduction
(a gradient never reaches its shard), reduces one twice, or reduces a gradient as another
parameter's trains wrong without an error: every shape still fits. So each graph is checked
against the graph as compiled, where every gather and every reduction is an explicit
insertion op of its parameter (`Coverage.of`):
  * every compute node that read a gathered parameter still reads it from a node that provides
    that parameter's full value (a gather, a member of a fused group's wait, a gather handed
    over by the previous graph, a kept parameter), gathered from that parameter's own shard;
  * every gradient the compiled graph reduced is reduced exactly once, as the same parameter's
    (a reduction, a member of a bucket, an accumulator), and the graph's output that held the
    parameter's shard gradient holds that reduction's (a gradient sent to the host is the
    reduction's of its own parameter too);
after every pass that changed the graph (compiler/pass_manager.py), for every plan transplanted
onto another shape of a graph (compiler/runner.py), and at lowering, where every gather and
reduction of the planned graph must have become collectives of the same parameters
(compiler/lower.py). A violation raises `CoverageError` naming the pass (or the lowering), the
graph and the parameter, on every rank alike (the passes' decisions are agreed). Cost: one walk
over the graph's nodes per check, per graph and pass (never per step).
"""

from __future__ import annotations

import collections
import dataclasses
import operator

from torch import fx

from ..runtime import ops
from ..runtime.registry import lookup


class CoverageError(RuntimeError):
    """A pass (or the lowering) left a parameter ungathered where it is read, or a gradient
    unreduced, reduced twice, or reduced as another parameter's."""


def param_name(pid: int) -> str:
    try:
        return lookup(pid).name
    except RuntimeError:
        return f"parameter id {pid}"


def _call(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def provided(node: fx.Node) -> tuple[int, fx.Node | None] | None:
    """(pid, the shard it is gathered from, or None where the graph does not name it) when
    `node` is a parameter's full value, else None."""
    if _call(node, ops.ALLGATHER, ops.KEPT_PARAM):
        return int(node.args[1]), node.args[0]
    if _call(node, operator.getitem):
        src, j = node.args
        if _call(src, ops.ALLGATHER_WAIT):
            start = src.args[0]
            shards = start.args[0] if _call(start, ops.ALLGATHER_START) else None
            if start.args[1][j] != src.args[1][j]:
                return None   # the wait hands out another member than its start gathered
            return int(src.args[1][j]), shards[j] if shards is not None else None
        if _call(src, ops.ALLGATHER_FROM_PREV):
            return int(src.args[1][j]), src.args[0][j]
    return None


def reductions(gm: fx.GraphModule) -> list[tuple[int, str]]:
    """(pid, name of the node whose value is reduced) of every reduction role in the graph."""
    out = []
    for n in gm.graph.nodes:
        if _call(n, ops.REDUCE_GRAD, ops.ACCUMULATE_GRAD):
            out.append((int(n.args[1]), n.args[0].name))
        elif _call(n, ops.REDUCE_START, ops.ACCUMULATE_START):
            out += [(int(p), g.name) for g, p in zip(n.args[0], n.args[1])]
    return out


def reduced(node) -> int | None:
    """The pid whose reduced shard gradient `node` is, else None."""
    if _call(node, ops.REDUCE_GRAD, ops.ACCUMULATE_GRAD):
        return int(node.args[1])
    if _call(node, operator.getitem) and _call(node.args[0], ops.REDUCE_WAIT):
        wait, j = node.args
        start = wait.args[0]
        if _call(start, ops.REDUCE_START, ops.ACCUMULATE_START) and \
                int(start.args[1][j]) == int(wait.args[1][j]):
            return int(wait.args[1][j])
    return None


def _outputs(gm: fx.GraphModule) -> list:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return list(out) if isinstance(out, (list, tuple)) else [out]


@dataclasses.dataclass
class Coverage:
    """What a graph must keep of the graph as compiled."""
    reads: dict[str, set[int]]                      # compute node -> parameters it reads
    shards: dict[int, str]                          # pid -> the placeholder of its shard
    reduces: collections.Counter                    # (pid, gradient node) -> reductions
    outputs: dict[int, int]                         # output position -> pid of its shard grad

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "Coverage":
        reads: dict[str, set[int]] = {}
        shards: dict[int, str] = {}
        for n in gm.graph.nodes:
            got = provided(n)
            if got is None:
                continue
            pid, shard = got
            if isinstance(shard, fx.Node):
                shards[pid] = shard.name
            for u in n.users:
                if not ops.communicates(u) and u.op != "output":
                    reads.setdefault(u.name, set()).add(pid)
        outputs = {i: p for i, v in enumerate(_outputs(gm)) if (p := reduced(v)) is not None}
        return cls(reads, shards, collections.Counter(reductions(gm)), outputs)

    def check(self, gm: fx.GraphModule, where: str, graph: str) -> None:
        """Raise `CoverageError` if `gm` breaks what this coverage says ([Note: gradient
        coverage]); `where` names what made `gm` (a pass), `graph` the graph."""
        def fail(what: str) -> CoverageError:
            return CoverageError(
                f"deepcompile: {where} broke graph {graph}: {what}. Training on would be wrong "
                "without an error, so the engine stops here. A pass may move, group, keep or "
                "offload gathers and reductions, never drop, repeat or swap them "
                "([Note: gradient coverage] in compiler/coverage.py); leave the pass out "
                "(Config.passes) and report it.")

        nodes = {n.name: n for n in gm.graph.nodes}
        for name, pids in self.reads.items():
            node = nodes.get(name)
            if node is None:
                raise fail(f"node {name}, which reads {param_name(min(pids))}, is gone")
            got = set()
            for arg in node.all_input_nodes:
                have = provided(arg)
                if have is not None:
                    got.add(have[0])
            missing = sorted(pids - got)
            if missing:
                raise fail(f"node {name} reads {param_name(missing[0])} without its gather")
        for n in gm.graph.nodes:
            have = provided(n)
            if have is not None and isinstance(have[1], fx.Node) and \
                    self.shards.get(have[0], have[1].name) != have[1].name:
                raise fail(f"{param_name(have[0])} is gathered from another parameter's shard "
                           f"({have[1].name})")
        got = collections.Counter(reductions(gm))
        extra, lost = sorted(got - self.reduces), sorted(self.reduces - got)
        if extra:
            pid, grad = extra[0]
            raise fail(f"the gradient of {param_name(pid)} is reduced twice"
                       if (pid, grad) in self.reduces else
                       f"node {grad} is reduced as the gradient of {param_name(pid)}")
        if lost:
            pid, grad = lost[0]
            raise fail(f"the gradient of {param_name(pid)} (node {grad}) is no longer reduced")
        outs = _outputs(gm)
        for i, pid in sorted(self.outputs.items()):
            if i >= len(outs) or reduced(outs[i]) != pid:
                raise fail(f"its output {i}, the shard gradient of {param_name(pid)}, is not that "
                           "parameter's reduction")
        for n in gm.graph.nodes:   # ops on a reduced gradient (offload's grad_to_host)
            if n.op == "call_function" and n.target in ops.FOLLOWERS and len(n.args) > 1 \
                    and isinstance(n.args[1], int) and reduced(n.args[0]) != n.args[1]:
                raise fail(f"{n.name} handles a value that is not the reduction of "
                           f"{param_name(n.args[1])}'s gradient as that gradient")
