"""Pass `activation_budget`: what the backward saves — kept, recomputed or offloaded — under the budget.

The values a forward graph saves for its backward are its extra outputs, which AOTAutograd hands
to the backward graph as inputs of the same names. When the profiled peak of a forward/backward
pair exceeds the memory budget, the pass chooses for each saved value one of:

* keep: as partitioned;
* recompute: the forward returns an empty tensor in its place, and the backward recomputes it
  right before its first use from values it still receives (the forward nodes that compute it,
  copied; a parameter they read is gathered again), at the profiled time of those nodes;
* offload: the forward copies it to pinned host memory right after its last forward use and
  returns the host buffer in its place; the backward copies it back ahead of its first use
  (runtime/activations.py, [Note: activation copies]).

The choice is greedy by cost per byte (`plan_pair`): over-budget memory, summed over the nodes
of both graphs, is removed at the least predicted time per byte, one value at a time (values of
about the same cost per byte by size: [Note: stable choices]), until the peak is within the
budget; then choices the budget no longer needs are undone, dearest first; on a GPU, offloads
whose copies queue past their readers on the copy streams are recomputed where that is cheaper
([Note: one copy lane each way]). A
budget the pass cannot reach is reported with the lowest peak it reaches, and that plan is
applied (it lowers a peak that is over the budget). With the peak within the budget (or no
budget) it plans nothing.

[Note: activations after partitioning] The pass rewrites the partitioned graphs rather than
asking torch's partitioner to partition again (recompute tags, `activation_memory_budget`):
the partition fixes the interface between the forward and the backward that AOTAutograd's
run-time wrapper and Dynamo's cache hold, the decisions need the profile of the graphs as
partitioned, and every other pass plans over node names of that partition. So the number and
order of the saved values stay; only what the forward hands over in a saved value's place
changes (an empty tensor, a host buffer), which AOTAutograd saves and passes on as it is.
Saved-tensor hooks cannot lower the peak either: they run after the forward graph returned,
when every saved value is already alive at once. torch's own activation offloading ops
(`torch._functorch._activation_offloading`) use a stream of their own, without the CPU
imitation that tests the copies' ordering here, and are not in every supported torch.
A recompute never redoes work the backward already does (the user's activation checkpointing,
the partitioner's own recompute): a chain that meets a compute node the backward recomputes is
not recomputed (the value can still be offloaded); views and parameter gathers are copied
freely. Chains with random ops, mutations, constants, collectives other than a gather, or a
discrete decision (an integer or boolean result of floating-point inputs: a router's top-k,
which a rounding difference could flip) are never recomputed. A value that a recompute reads
stays saved. Graphs of another shape of the same code (compiler/families.py) run the
representative's plan transplanted: an offload carries over (the copy back takes the host
buffer's shape), a recompute does not (its copied nodes have the representative's shapes): the
pass recomputes nothing in a family that has graphs of other shapes when it plans, and a later
one fails its transplant loudly.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
from typing import Any, Callable

import numpy as np
import torch
from torch import fx

from ..compiler import graph as G
from ..runtime import activations as act_ops
from ..runtime import ops
from .context import Facts, PassContext, register_pass
from ._common import Step, mib, size, steps_of, top

log = logging.getLogger("deepcompile")

MAX_CHAIN = 256        # forward nodes a recompute may copy
# [Note: stable choices] Profiled times and the copy model are measurements: from one launch to
# the next each moves by ±20% and more on a shared machine, and one cost against another by up
# to 1.2 / 0.8 = 1.5x. A greedy that always took the cheapest would plan differently from launch
# to launch between options of about the same cost. So a value is recomputed where that costs
# within TIE_MARGIN of offloading it (a recompute holds no host memory and needs no copy
# stream), and among the values within TIE_MARGIN of the cheapest cost per byte the one that
# removes the most over-budget memory goes first (bytes and positions: the same in every
# launch), then by name. Costs that differ by more than TIE_MARGIN x 1.5 keep their order; only
# those near the margin can still change places.
TIE_MARGIN = 2.0
HOST_OP_S = 30e-6      # host time of one Python op (an offload costs three per graph run)


# -- the planner core (pure) ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Activation:
    """A value the forward saves for the backward, as the planner sees it. Indices are
    positions in the graphs' profiled steps."""
    name: str
    nbytes: int
    fw_free: int                  # the forward step after which the forward no longer reads it
    bw_first: int                 # the first backward step that reads it
    bw_last: int                  # the last backward step that reads it
    recompute_s: float | None     # the profiled time of its recompute; None: not recomputable
    recompute_bytes: int = 0      # what the recompute holds beyond the value itself, at most
    leaves: tuple[str, ...] = ()  # the saved values its recompute reads (they stay saved)
    offload: bool = True


@dataclasses.dataclass(frozen=True)
class Option:
    action: str          # "recompute" or "offload"
    cost_s: float        # predicted time added to the step
    start: int           # first backward step at which the value is held again
    extra: int = 0       # bytes held beyond the value at `start` (a recompute's intermediates)
    reload_after: int | None = None   # offload: the backward step after which the copy starts


def options(a: Activation, fw: list[Step], bw: list[Step], copy_s: Callable[[int], float],
            overlap: bool) -> list[Option]:
    """What can be done with `a`, and at what predicted time. A recompute runs right before the
    first use. An offload's copies run on copy streams where `overlap` (CUDA): exposed only
    where the compute they can hide behind is shorter than they are; its copy back starts as
    late as that allows (from the top of the backward at the earliest). Without overlap (the
    CPU's imitation runs each copy when it is waited for, out of a snapshot of the value) its
    three copies are exposed, and the copy back starts right before the first use."""
    out = []
    if a.recompute_s is not None:
        out.append(Option("recompute", a.recompute_s, max(a.bw_first - 1, 0), a.recompute_bytes))
    if a.offload:
        t = copy_s(a.nbytes)
        if not overlap:
            r = a.bw_first - 1 if a.bw_first > 0 else None
            out.append(Option("offload", 3 * t + 3 * HOST_OP_S, max(a.bw_first - 1, 0),
                              reload_after=r))
        else:
            lead, r = 0.0, a.bw_first - 1
            while r >= 0 and lead < t:
                lead += bw[r].time_s if bw[r].kind == "compute" else 0.0
                r -= 1
            reload_after = r if r >= 0 else None
            start = max(r, 0)
            window = sum(s.time_s for s in fw[a.fw_free + 1:] if s.kind == "compute") + \
                sum(s.time_s for s in bw[:start] if s.kind == "compute")
            out.append(Option("offload", max(0.0, t - window) + max(0.0, t - lead)
                              + 3 * HOST_OP_S, start, reload_after=reload_after))
    return out


def _pick(avail: list[Option]) -> Option:
    """A value's option: the cheapest, a recompute where it is within TIE_MARGIN of it ([Note:
    stable choices])."""
    cheapest = min(o.cost_s for o in avail)
    return min((o for o in avail if o.cost_s <= TIE_MARGIN * cheapest),
               key=lambda o: (o.action != "recompute", o.cost_s))


def curves(fw_live: np.ndarray, bw_live: np.ndarray, acts: dict[str, Activation],
           choice: dict[str, Option]) -> tuple[np.ndarray, np.ndarray]:
    """The live bytes after each forward and backward step under `choice` (the profiler's
    memory model: a value that is not saved is freed after its last forward use; in the
    backward, what comes back is held from its option's `start` to its last use)."""
    fw, bw = fw_live.astype(np.int64), bw_live.astype(np.int64)
    for name, opt in choice.items():
        _shift(fw, bw, acts[name], opt, -1)
    return fw, bw


def _shift(fw: np.ndarray, bw: np.ndarray, a: Activation, opt: Option, sign: int) -> None:
    fw[a.fw_free + 1:] += sign * -a.nbytes
    bw += sign * -a.nbytes
    bw[opt.start:a.bw_last + 1] += sign * a.nbytes
    bw[opt.start] += sign * opt.extra


# [Note: one copy lane each way] `options` prices an offload alone: its copies hidden behind the
# compute around them. On a GPU every activation copy out runs on one device-to-host stream and
# every copy back on one host-to-device stream (the optimizer offload's copier, whose state reloads
# share the latter), each copy after the one issued before it; so copies that each hide alone can
# queue past their readers together. `lane_stall` replays the chosen offloads on the two lanes over
# the profiled compute, forward then backward (as `options`: the passes after it hide collectives'
# time behind compute, so a copy cannot count on it; the forward never waits for a copy out): a
# copy out is issued after its value's last forward reader, a copy back after its `reload_after`
# step, no earlier than its own copy out ends, and the backward waits before the first reader for
# what has not arrived (a wait delays every later step, and the copies issued after it). The greedy
# (`plan_pair`) picks values by the alone prices, which are cheap to compare; then `_lane_swaps`
# prices each chosen offload by what the replay's total wait loses without it, and recomputes
# instead the offload whose recompute is the cheapest against that, while one is cheaper than it
# and the memory curve allows (a recompute holds its value from right before its first reader, not
# from its copy back's start, plus its intermediates); prices are computed again after each swap.
# No TIE_MARGIN here: what it stands for in `_pick` (a recompute needs no copy stream) is what the
# replay prices, and a swap near a ratio of 1 changes the step little either way. Each offload left
# is charged its share (what the wait loses without it); the plan's added time counts the replay's
# whole wait. Not modelled: the optimizer offload's gradient copies (issued in the backward, after
# every activation copy out), copies between graphs of different pairs, and the time a recompute
# adds to the backward (which would hide more copies).
def lane_stall(fw: list[Step], bw: list[Step], offloads: list[tuple[Activation, Option]],
               copy_s: Callable[[int], float],
               busy: tuple[tuple[str, int, float], ...] = ()) -> float:
    """Seconds the backward waits for copies back ([Note: one copy lane each way]). `busy`: the
    other copies on the host-to-device lane, (graph "fw" or "bw", the step after which each is
    issued, -1: the top; seconds)."""
    fw_end = list(itertools.accumulate(s.time_s if s.kind == "compute" else 0.0 for s in fw))
    bw_start = [0.0, *itertools.accumulate(s.time_s if s.kind == "compute" else 0.0
                                           for s in bw)]
    fw_total = fw_end[-1] if fw_end else 0.0
    free, out_end = 0.0, {}
    for a, _ in sorted(offloads, key=lambda o: (o[0].fw_free, o[0].name)):
        free = out_end[a.name] = max(fw_end[a.fw_free], free) + copy_s(a.nbytes)
    back = 0.0   # the host-to-device lane: other copies issued in the forward first
    for g, after, sec in sorted(b for b in busy if b[0] == "fw"):
        back = max(back, fw_end[after] if after >= 0 else 0.0) + sec
    events = [(after + 1, 0, 0, str(k), sec) for k, (g, after, sec) in enumerate(busy)
              if g == "bw"]
    for a, o in offloads:
        r = o.reload_after if o.reload_after is not None else -1
        events += [(r + 1, 0, 1, a.name, copy_s(a.nbytes)), (a.bw_first, 1, 1, a.name, 0.0)]
    stall, in_end = 0.0, {}
    for pos, wait, act, name, sec in sorted(events):
        now = fw_total + bw_start[pos] + stall
        if wait:
            stall += max(0.0, in_end[name] - now)
        else:
            back = max(now, back, out_end.get(name, 0.0) if act else 0.0) + sec
            if act:
                in_end[name] = back
    return stall


def _lane_swaps(choice: dict[str, Option], opts: dict[str, list[Option]],
                by_name: dict[str, Activation], stall: Callable[[set[str]], float],
                fits: Callable[[Activation, Option, Option], bool]) -> None:
    """Offloads recomputed instead, in place, where the lanes make them dear ([Note: one copy
    lane each way]): every price is computed again after each swap (a copy that leaves the
    lane can move the wait onto another)."""
    offl = {n for n, o in choice.items() if o.action == "offload"}
    rec = {n: next((o for o in opts[n] if o.action == "recompute"), None) for n in offl}
    stay: set[str] = set()   # recomputing it would break the budget
    while True:
        base = stall(offl)
        pinned = {leaf for m, o in choice.items() if o.action == "recompute"
                  for leaf in by_name[m].leaves}
        ratios = [(rec[n].cost_s / (base - stall(offl - {n}) + 3 * HOST_OP_S), n)
                  for n in sorted(offl - stay - pinned)
                  if rec[n] is not None and not set(by_name[n].leaves) & set(choice)]
        ratios = [r for r in ratios if r[0] < 1.0]
        if not ratios:
            return
        _, n = min(ratios)
        if fits(by_name[n], choice[n], rec[n]):
            choice[n] = rec[n]
            offl.discard(n)
        else:
            stay.add(n)


def plan_pair(fw: list[Step], bw: list[Step], acts: list[Activation], budget: float,
              copy_s: Callable[[int], float], overlap: bool, host_room: float = float("inf"),
              copies: int = 1, lane_busy: tuple[tuple[str, int, float], ...] = ()
              ) -> dict[str, Any]:
    """The plan of one forward/backward pair (see the module docstring); pure. What it offloads
    is held in pinned host memory `copies` times (the forward runs that often before its
    backwards), within `host_room` bytes. Where `overlap`, the copies queue on one lane each
    way with the other copies `lane_busy` ([Note: one copy lane each way])."""
    fw_live = np.array([s.live_bytes for s in fw] or [0], dtype=np.int64)
    bw_live = np.array([s.live_bytes for s in bw] or [0], dtype=np.int64)
    before = int(max(fw_live.max(), bw_live.max()))
    out: dict[str, Any] = {"budget_bytes": budget, "peak_before": before, "peak_after": before,
                           "fw_peak_before": int(fw_live.max()), "bw_peak_before": int(bw_live.max()),
                           "candidates": len(acts), "candidate_bytes": sum(a.nbytes for a in acts),
                           "unattainable": False, "choices": []}
    if before <= budget:
        return out
    by_name = {a.name: a for a in acts}
    opts = {a.name: options(a, fw, bw, copy_s, overlap) for a in acts}
    choice: dict[str, Option] = {}

    def over(f: np.ndarray, b: np.ndarray) -> float:
        return float(np.maximum(f - budget, 0).sum() + np.maximum(b - budget, 0).sum())

    def pinned() -> set[str]:
        return {leaf for n, o in choice.items() if o.action == "recompute"
                for leaf in by_name[n].leaves}

    f_cur, b_cur = curves(fw_live, bw_live, by_name, choice)
    o_cur = over(f_cur, b_cur)
    while o_cur > 0:
        found, held = [], pinned()
        for a in acts:
            if a.name in choice or a.name in held:
                continue
            host = copies * sum(by_name[n].nbytes for n, o in choice.items()
                                if o.action == "offload")
            avail = [o for o in opts[a.name]
                     if (o.action == "offload" and host + copies * a.nbytes <= host_room)
                     or (o.action == "recompute" and not any(leaf in choice for leaf in a.leaves))]
            if not avail:
                continue
            opt = _pick(avail)
            f2, b2 = f_cur.copy(), b_cur.copy()
            _shift(f2, b2, a, opt, +1)
            gain = o_cur - over(f2, b2)
            if gain > 0:
                found.append((opt.cost_s / gain, gain, a, opt, f2, b2))
        if not found:
            break
        # [Note: stable choices] among the values within TIE_MARGIN per byte of the cheapest,
        # the one that removes the most over-budget memory (a fact of the graphs, not of timing)
        cheapest = min(f[0] for f in found)
        _, _, a, opt, f_cur, b_cur = min(
            (f for f in found if f[0] <= TIE_MARGIN * cheapest),
            key=lambda f: (-f[1], f[2].name))
        choice[a.name] = opt
        o_cur = over(f_cur, b_cur)
    if o_cur == 0:   # undo what the budget no longer needs, dearest first
        for name in sorted(choice, key=lambda n: (-choice[n].cost_s, n)):
            if name in pinned():
                continue
            f2, b2 = f_cur.copy(), b_cur.copy()
            _shift(f2, b2, by_name[name], choice[name], -1)
            if over(f2, b2) == 0:
                del choice[name]
                f_cur, b_cur = f2, b2
    stall = 0.0
    if overlap and any(o.action == "offload" for o in choice.values()):
        def lanes(names: set[str]) -> float:
            return lane_stall(fw, bw, [(by_name[n], choice[n]) for n in sorted(names)], copy_s,
                              lane_busy)

        def fits(a: Activation, old: Option, new: Option) -> bool:
            nonlocal f_cur, b_cur, o_cur
            f2, b2 = f_cur.copy(), b_cur.copy()
            _shift(f2, b2, a, old, -1)
            _shift(f2, b2, a, new, +1)
            if over(f2, b2) > o_cur:
                return False
            f_cur, b_cur, o_cur = f2, b2, over(f2, b2)
            return True

        _lane_swaps(choice, opts, by_name, lanes, fits)
        offl = {n for n, o in choice.items() if o.action == "offload"}
        stall = lanes(offl)
        for n in offl:   # each offload's share: what the wait loses without it
            choice[n] = dataclasses.replace(choice[n], cost_s=stall - lanes(offl - {n})
                                            + 3 * HOST_OP_S)
    out.update(peak_after=int(max(f_cur.max(), b_cur.max())), fw_peak_after=int(f_cur.max()),
               bw_peak_after=int(b_cur.max()), unattainable=o_cur > 0,
               added_s=(stall + sum(3 * HOST_OP_S if o.action == "offload" else o.cost_s
                                    for o in choice.values())) if overlap
               else sum(o.cost_s for o in choice.values()),
               copy_wait_s=stall,
               recompute_s=sum(o.cost_s for o in choice.values() if o.action == "recompute"),
               host_bytes=copies * sum(by_name[n].nbytes for n, o in choice.items()
                                       if o.action == "offload"),
               choices=[{"name": n, "action": o.action, "bytes": by_name[n].nbytes,
                         "cost_s": o.cost_s,
                         "reload_after": (bw[o.reload_after].name
                                          if o.action == "offload" and o.reload_after is not None
                                          else None)}
                        for n, o in sorted(choice.items())])
    return out


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


def pairs(ctx: PassContext) -> list[tuple[str, str]]:
    """(forward, backward) slot keys of the profiled pairs, in key order."""
    out = []
    for key in sorted(ctx.slots):
        if key.endswith(".fw"):
            bw = key[:-3] + ".bw"
            if bw in ctx.slots and key in ctx.profiles and bw in ctx.profiles:
                out.append((key, bw))
    return out


# -- the pass -------------------------------------------------------------------------------------
def plan(ctx: PassContext) -> dict[str, Any]:
    budget = ctx.memory_budget
    decisions: dict[str, Any] = {}
    if budget == float("inf") or ctx.cost is None or not len(ctx.registry.entries):
        return decisions
    overlap = getattr(ctx.runtime, "device", torch.device("cpu")).type == "cuda"
    room = _host_room(ctx)
    gas = ctx.runtime.step.gradient_accumulation_steps
    for fw_key, bw_key in pairs(ctx):
        fw_steps, bw_steps = steps_of(ctx.profiles[fw_key]), steps_of(ctx.profiles[bw_key])
        out_bytes = {n.name: n.out_bytes for n in ctx.profiles[fw_key].nodes}
        # graphs of other shapes of this code run the plan transplanted, which copies a
        # recompute's nodes with this graph's shapes ([Note: activations after partitioning])
        shapes = any(getattr(ctx.slots[k], "members", None) for k in (fw_key, bw_key))
        pair = analyse(fw_key, bw_key, ctx.slots[fw_key].gm, ctx.slots[bw_key].gm, fw_steps,
                       bw_steps, out_bytes, recompute=not shapes)
        d = plan_pair(fw_steps, bw_steps, pair.acts, budget, ctx.cost.copy_s, overlap, room,
                      copies=max(1, ctx.order.count(fw_key) // gas),
                      lane_busy=_state_reloads(ctx, {"fw": fw_key, "bw": bw_key},
                                               {"fw": fw_steps, "bw": bw_steps}))
        if d["peak_before"] <= budget:
            continue
        room -= d["host_bytes"]
        d.update(fw=fw_key, bw=bw_key, recompute_off=shapes,   # (an estimate: a float)
                 recompute_flops=float(sum(pair.flops.get(c["name"], 0) for c in d["choices"]
                                           if c["action"] == "recompute")))
        if d["unattainable"]:
            log.warning("deepcompile activation_budget: %s/%s: memory budget %s is below what "
                        "recomputing or offloading the saved activations reaches: the lowest "
                        "peak is %s (from %s); applying that plan", fw_key, bw_key,
                        size(budget), size(d["peak_after"]), size(d["peak_before"]))
        decisions[fw_key[:-3]] = d
    return decisions


def _state_reloads(ctx: PassContext, keys: dict[str, str],
                   steps: dict[str, list[Step]]) -> tuple[tuple[str, int, float], ...]:
    """The optimizer offload's state reloads planned in the pair's graphs, on the
    host-to-device lane the copies back share ([Note: one copy lane each way]): (graph, the
    step after which each is issued, its copy time)."""
    out = []
    for r in (ctx.decisions.get("offload_optimizer") or {}).get("reloads", []):
        for g, key in keys.items():
            at = [i for i, s in enumerate(steps[g]) if s.name == r["after"]]
            if r["slot"] == key and at:
                out.append((g, at[0], ctx.cost.copy_s(r["bytes"])))
    return tuple(sorted(out))


def _host_room(ctx: PassContext) -> float:
    """Pinned host bytes the activations may take on every rank: the engine's host memory
    (`PassContext.host_capacity`, measured at start-up before any host buffer was made, so this
    engine's activation buffers already made count as room: a plan reuses them) less the
    optimizer offload's host buffers."""
    return ctx.host_capacity - ctx.runtime.offload.host_buffer_bytes()


def apply(ctx: PassContext, decisions: dict[str, Any]) -> list[str]:
    changed: list[str] = []
    if not decisions:
        return changed
    store = act_ops.store_of(ctx.runtime)   # before the re-profile: its buffers are host memory
    engine = ctx.runtime.handle   # what the ops find the runtime by
    for _, d in sorted(decisions.items()):
        if not d["choices"]:
            continue
        fw_gm, bw_gm = ctx.slots[d["fw"]].gm, ctx.slots[d["bw"]].gm
        _rewrite(fw_gm, bw_gm, d["choices"], engine, store.device)
        changed += [d["fw"], d["bw"]]
    return changed


def _rewrite(fw_gm: fx.GraphModule, bw_gm: fx.GraphModule, choices: list[dict], engine: int,
             device: torch.device) -> None:
    """Rewrite the pair for `choices` (the module docstring). Every position is read from the
    graphs as they are before the rewrite starts."""
    fw, bw = fw_gm.graph, bw_gm.graph
    fw_by = {n.name: n for n in fw.nodes}
    bw_by = {n.name: n for n in bw.nodes}
    fw_order = [n for n in fw.nodes if n.op not in ("placeholder", "output")]
    fw_index = {n.name: i for i, n in enumerate(fw_order)}
    bw_order = [n for n in bw.nodes if n.op not in ("placeholder", "output")]
    bw_index = {n.name: i for i, n in enumerate(bw_order)}
    fw_readers = _readers(fw, fw_index)
    bw_inputs = {n.name for n in bw.nodes if n.op == "placeholder"}
    bw_computed = {n.name for n in bw.nodes if n.op == "call_function"}
    out_node = next(n for n in reversed(fw.nodes) if n.op == "output")
    saved = {n.name for n in G.output_values(fw_gm) if n.name in bw_inputs}
    dropped = {c["name"] for c in choices}
    work = []
    for c in choices:
        s, p = fw_by.get(c["name"]), bw_by.get(c["name"])
        if s is None or p is None or p.op != "placeholder" or not p.users:
            raise RuntimeError(f"deepcompile activation_budget: the plan drops {c['name']!r}, "
                               "which these graphs do not save (a plan made for other graphs)")
        r = _root(s)
        free_at = fw_order[max(fw_readers.get(r, []) + [fw_index[r.name], fw_index[s.name]])]
        first = min(p.users, key=lambda u: bw_index[u.name])
        chain = None
        if c["action"] == "recompute":
            chain = recompute_chain(s, saved, bw_inputs, bw_computed)
            if chain is None or any(leaf.name in dropped for leaf in chain.leaves):
                raise RuntimeError(f"deepcompile activation_budget: {c['name']!r} cannot be "
                                   "recomputed from what the backward keeps (a plan made for "
                                   "other graphs)")
        after = p
        if c["action"] == "offload" and c["reload_after"]:
            after = _tensor_at(bw_by[c["reload_after"]], p)
        work.append((c, s, p, free_at, first, chain, after))
    for c, s, p, free_at, first, chain, after in work:
        val = s.meta["val"]
        if c["action"] == "offload":
            with fw.inserting_after(free_at):
                host = fw.call_function(act_ops.OFFLOAD, (s, engine))
            host.meta["val"] = _like(val, device=torch.device("cpu"))
            out_node.args = fx.node.map_arg(out_node.args, lambda a: host if a is s else a)
            anchor = after.next if after is not p else _after_inputs(bw)
            with bw.inserting_before(anchor):
                dst = bw.call_function(act_ops.RELOAD, (after, p, engine, val.device))
            dst.meta["val"] = val
            with bw.inserting_before(first):
                wait = bw.call_function(act_ops.WAIT, (dst, engine))
            wait.meta["val"] = None
            p.replace_all_uses_with(dst, delete_user_cb=lambda u: u is not dst)
            p.meta["val"] = host.meta["val"]
        else:
            with fw.inserting_before(out_node):
                empty = fw.call_function(torch.ops.aten.empty.memory_format, ([0],),
                                         {"dtype": val.dtype, "device": val.device})
            empty.meta["val"] = _like(val, shape=(0,))
            out_node.args = fx.node.map_arg(out_node.args, lambda a: empty if a is s else a)
            env: dict[fx.Node, fx.Node] = {leaf: bw_by[leaf.name] for leaf in chain.leaves}
            with bw.inserting_before(first):
                for g in chain.gathers:   # a parameter gathered again (a view at world size 1)
                    env[g] = bw.node_copy(g, lambda a: bw_by[a.name])
                    env[g].meta = dict(g.meta, dc_recompute=s.name, dc_shape_bound=True)
                for n in chain.nodes:
                    env[n] = bw.node_copy(n, env.__getitem__)
                    env[n].meta = dict(n.meta, dc_recompute=s.name, dc_shape_bound=True)
            p.replace_all_uses_with(env[s])
            p.meta["val"] = empty.meta["val"]
    for gm in (fw_gm, bw_gm):
        gm.graph.lint()
        gm.recompile()


def _tensor_at(node: fx.Node, default: fx.Node) -> fx.Node:
    """`node`, or the last tensor-valued non-communication node before it (the value that
    orders a copy there: a later pass may replace a collective by a node further down)."""
    while node.op != "root" and node is not default:
        if node.op != "placeholder" and isinstance(node.meta.get("val"), torch.Tensor) \
                and not ops.communicates(node):
            return node
        node = node.prev
    return default


def _after_inputs(graph: fx.Graph) -> fx.Node:
    return next(n for n in graph.nodes if n.op != "placeholder")


def _like(val: torch.Tensor, *, device: torch.device | None = None, shape=None) -> torch.Tensor:
    """A fake value like `val` (in its fake mode, where it has one) on `device`, of `shape`."""
    from .. import _compat

    mode = _compat.detect_fake_mode([val])
    size, stride = (val.size(), val.stride()) if shape is None else (shape, (1,))
    make = lambda: torch.empty_strided(size, stride, dtype=val.dtype,   # noqa: E731
                                       device=device or val.device)
    if mode is None:
        return make().to("meta") if device is None else make()
    with mode:
        return make()


def summary(decisions: dict[str, Any]) -> list[str]:
    lines = []
    for key, d in sorted(decisions.items()):
        if not isinstance(d, dict) or "choices" not in d:
            continue
        rec = [c for c in d["choices"] if c["action"] == "recompute"]
        off = [c for c in d["choices"] if c["action"] == "offload"]
        lines.append(
            f"{key}: peak {size(d['peak_before'])} -> {size(d['peak_after'])} (budget "
            f"{size(d['budget_bytes'])}{', unattainable: the lowest the pass reaches' if d['unattainable'] else ''}); "
            f"of {d['candidates']} saved values ({size(d['candidate_bytes'])}) "
            f"{len(rec)} recomputed ({size(sum(c['bytes'] for c in rec))}, "
            f"{d.get('recompute_s', 0.0) * 1e3:.2f} ms, {d.get('recompute_flops', 0) / 1e6:.2f} "
            f"MFLOP), {len(off)} offloaded ({size(sum(c['bytes'] for c in off))}); predicted "
            f"+{d.get('added_s', 0.0) * 1e3:.2f} ms a step"
            + (f" ({d['copy_wait_s'] * 1e3:.2f} ms waiting for copies)"
               if d.get("copy_wait_s", 0.0) >= 1e-6 else ""))
        priced = sorted(d["choices"], key=lambda c: -c["bytes"])
        if priced:
            lines.append("  largest: " + top([f"{c['name']} {c['action']} {size(c['bytes'])} "
                                              f"({c['cost_s'] / max(c['bytes'], 1) * 1e9:.2f} "
                                              "ns/B)" for c in priced]))
    return lines


def auto(f: Facts) -> tuple[bool, str]:
    """`passes="auto"`: after `offload_optimizer` (which plans on a step whose peak activations
    it leaves alone), when the budget is bounded and a profiled peak still exceeds it."""
    if f.memory_budget == float("inf"):
        return False, "memory budget unbounded: every saved activation stays"
    if f.peak_bytes <= f.memory_budget:
        return False, (f"profiled peak {mib(f.peak_bytes)} within the budget "
                       f"{mib(f.memory_budget)}: every saved activation stays")
    return True, (f"profiled peak {mib(f.peak_bytes)} over the budget {mib(f.memory_budget)}: "
                  "the saved activations that are cheapest per byte are recomputed or offloaded")


register_pass("activation_budget", plan, apply, __doc__.splitlines()[0], summary=summary,
              order=5, choose=auto, needs={"host_memory"})
