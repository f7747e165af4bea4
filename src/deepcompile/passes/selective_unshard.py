"""Pass `selective_unshard`: keep parameters gathered with the memory left under the budget.

A kept parameter is gathered once per optimizer step (after the update, `KeptParams.refresh`)
and every graph and micro-step uses a copy of it instead of gathering it again (forward,
backward re-gathers, inference; [Note: kept parameters are graph inputs] in runtime/kept.py).
A kept parameter's gradient may also be accumulated locally over the micro-steps of an
accumulation window and reduce-scattered once, on the last one, instead of every micro-step.

Plan (from the agreed profiles, the recorded execution order, the cost model and the registry
only, so every rank decides the same):

* usage: every collective of every graph (a synchronous gather or reduce, or a fused group of
  `prefetch` / `bucket_reduce`, cross-graph groups counted where they are taken), times the
  graph's runs in the profiled optimizer step (`ctx.order`: with gradient accumulation it holds
  each graph once per micro-step);
* value, in predicted communication seconds saved per optimizer step (cost model): keeping a
  parameter saves each of its gathers (all of a collective of its own; its bytes' share of a
  fused one) and costs its bytes' share of the refresh; accumulating saves each reduce-scatter
  of its gradient but the ones of the last micro-step;
* weight, in bytes held by the runtime: the full parameter (compute dtype), plus the padded
  full gradient (master dtype) when accumulated;
* choice: per parameter one of {not kept, kept, kept + accumulated}, the most value with the
  total weight within `memory_budget − peak` (peak: the largest live-bytes figure of the latest
  agreed profiles): a multiple-choice 0/1 knapsack, solved exactly by dynamic programming on a
  grid of at most `GRID_CELLS` byte cells (weights rounded up to whole cells: a choice never
  exceeds the capacity). Unbounded budget: every option that saves something, the most
  valuable per parameter. A parameter involved in graph reuse is not chosen (a reused graph
  names another parameter's id, and an accumulator is found by the id). At ZeRO-1/2 nothing is chosen: the parameters are
  replicated, and ZeRO-1 already reduces once per optimizer step. At world size 1 a gather is a
  view of the local shard (nothing to keep) or, when the compute dtype differs from the
  master's (`param_dtype`), a cast of it: every use of the parameter casts it again (its
  forward and its backward, each micro-step), where a kept copy is cast once per optimizer step
  by the refresh. So at world size 1 only casting gathers are candidates, valued by the same
  cost model (its all-gather at world size 1 is a copy of the bytes: it counts a cast's write,
  not its wider read, so it under-values keeping).

Apply (passes only schedule: inputs and outputs of graphs never change): in every graph, a
kept parameter's `allgather_param` becomes `kept_param` (same arguments), and it is pulled out
of the fused groups `prefetch` made (`allgather_start`/`wait`, `allgather_for_next`/`from_prev`:
each group is rebuilt with the remaining members, or erased when none remain); an accumulated
gradient's `reduce_grad` becomes `accumulate_grad`, and a `bucket_reduce` bucket's accumulated
members, two or more, leave it together as a bucket of their own (`accumulate_start`: one
reduce-scatter on the last micro-step; a bucket whose members are all accumulated is retargeted
whole), one alone as an `accumulate_grad` (`accumulated_together`). So the pass works with or
after `prefetch` and `bucket_reduce`, in any order. The kept parameters are gathered at once
(apply runs at an optimizer-step boundary, after the update), also when the plan comes from the
plan cache.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from typing import Any, Callable

import torch
from torch import fx

from ..runtime import kept as _kept, ops
from ..runtime.accumulators import accumulator_bytes
from ..runtime.registry import lookup
from .context import Facts, PassContext, SpareMemory, register_pass
from ._common import mib

log = logging.getLogger("deepcompile")

GRID_CELLS = 4096

# consumers of gathers and reduces: (op, the argument holding its input tensors or None)
_GATHER_SYNC, _REDUCE_SYNC = ops.ALLGATHER, ops.REDUCE_GRAD
_GATHER_GROUPS = (ops.ALLGATHER_WAIT, ops.ALLGATHER_FROM_PREV)
_REDUCE_GROUPS = (ops.REDUCE_WAIT,)


# ------------------------------------------------------------------------------- planning
@dataclasses.dataclass
class Collective:
    """One collective of one graph run, as this planner sees it."""
    kind: str                      # "all_gather" or "reduce_scatter"
    runs: int                      # runs per optimizer step (of the graph that takes it)
    members: list[tuple[int, int]]  # (pid, bytes on the wire)
    figure: str = ""               # the cost model's figure for it ("": `kind`; a backward
                                   # gather's: "all_gather_bw", [Note: a figure per group])

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.members)


@dataclasses.dataclass
class Candidate:
    """A parameter that could be kept: its sizes and options."""
    pid: int
    name: str
    keep_bytes: int        # held by the runtime when kept
    accum_bytes: int       # held by the runtime when its gradient is accumulated
    refresh_bytes: int     # its bytes in the refresh collective


def collectives_of(graphs: dict[str, fx.GraphModule], order: list[str],
                   backward: frozenset[str] = frozenset()) -> list[Collective]:
    """Every gather and reduce collective of `graphs` with its runs per optimizer step
    (`backward`: the keys of the backward graphs)."""
    out = []
    for key in sorted(graphs):
        runs = order.count(key)
        for node in graphs[key].graph.nodes:
            if node.op != "call_function":
                continue
            t = node.target
            if t is _GATHER_SYNC or t is _REDUCE_SYNC:
                kind, pids = ("all_gather" if t is _GATHER_SYNC else "reduce_scatter"), [node.args[1]]
            elif t in _REDUCE_GROUPS and node.args[0].target is ops.ACCUMULATE_START:
                continue   # accumulated already (as `accumulate_grad`s are: not counted)
            elif t in _GATHER_GROUPS or t in _REDUCE_GROUPS:
                kind, pids = ("all_gather" if t in _GATHER_GROUPS else "reduce_scatter"), node.args[1]
            else:
                continue
            figure = "all_gather_bw" if kind == "all_gather" and key in backward else ""
            out.append(Collective(kind, runs, [(int(p), _wire_bytes(kind, int(p))) for p in pids],
                                  figure))
    return out


def _wire_bytes(kind: str, pid: int) -> int:
    e = lookup(pid)
    return e.padded_numel * (e.compute_dtype if kind == "all_gather" else e.reduce_dtype).itemsize


def _saving(cost, c: Collective, nbytes: int) -> float:
    """Seconds saved by taking `nbytes` out of one run of collective `c` (all of it when it is
    that member's own collective; its bytes' share when fused with others)."""
    figure = c.figure or c.kind
    if len(c.members) == 1:
        return cost.collective_s(figure, nbytes)
    return cost.collective_s(figure, c.nbytes) - cost.collective_s(figure, c.nbytes - nbytes)


def options_of(cands: list[Candidate], colls: list[Collective], cost, gas: int,
               excluded: set[int]) -> list[dict[str, Any]]:
    """Per candidate: the value (seconds saved per optimizer step) and weight (bytes) of
    keeping it, and of keeping it with its gradient accumulated locally."""
    uses: dict[tuple[str, int], list[tuple[Collective, int]]] = {}
    for c in colls:
        for p, b in c.members:
            uses.setdefault((c.kind, p), []).append((c, b))
    out = []
    for cand in cands:
        gathers = uses.get(("all_gather", cand.pid), [])
        reduces = uses.get(("reduce_scatter", cand.pid), [])
        refresh = cost.collective_s("all_gather", cand.refresh_bytes) - cost.collective_s("all_gather", 0)
        keep_s = sum(c.runs * _saving(cost, c, b) for c, b in gathers) - refresh
        accum_s = sum(c.runs * (1 - 1 / gas) * _saving(cost, c, b) for c, b in reduces)
        out.append({"pid": cand.pid, "name": cand.name, "excluded": cand.pid in excluded,
                    "gathers_per_step": sum(c.runs for c, _ in gathers),
                    "reduces_per_step": sum(c.runs for c, _ in reduces),
                    "keep": (cand.keep_bytes, keep_s),
                    "keep_accumulate": (cand.keep_bytes + cand.accum_bytes, keep_s + accum_s)
                    if gas > 1 and reduces else None})
    return out


def choose(options: list[list[tuple[int, float]]], capacity: float,
           cells: int = GRID_CELLS) -> list[int | None]:
    """Multiple-choice 0/1 knapsack: per item at most one of its (weight, value) options, the
    most total value with total weight <= capacity. Exact on a grid of at most `cells` cells of
    ceil(capacity / cells) bytes (weights rounded up to whole cells, so the true total never
    exceeds the capacity). Returns the chosen option's index per item, or None. Options of
    value <= 0 are never chosen. Deterministic: ties keep the earlier (lighter) decision."""
    useful = [[(k, w, v) for k, (w, v) in enumerate(opts) if v > 0] for opts in options]
    best = [max(u, key=lambda o: (o[2], -o[1]), default=None) for u in useful]
    if sum(o[1] for o in best if o is not None) <= capacity:   # everything useful fits
        return [None if o is None else o[0] for o in best]
    if capacity <= 0:
        return [None] * len(options)
    unit = max(1, math.ceil(capacity / cells))
    n_cells = int(capacity // unit)
    dp = torch.zeros(n_cells + 1, dtype=torch.float64)          # best value within c cells
    picks = torch.full((len(options), n_cells + 1), -1, dtype=torch.int16)
    for i, opts in enumerate(useful):
        new = dp.clone()
        for k, w, v in opts:
            wc = math.ceil(w / unit)
            if wc > n_cells:
                continue
            cand = torch.full_like(dp, -math.inf)
            cand[wc:] = dp[: n_cells + 1 - wc] + v
            better = cand > new
            new = torch.where(better, cand, new)
            picks[i][better] = k
        dp = new
    out: list[int | None] = [None] * len(options)
    c = n_cells
    for i in range(len(options) - 1, -1, -1):
        k = int(picks[i][c])
        if k >= 0:
            out[i] = k
            c -= math.ceil(options[i][k][0] / unit)
    return out


def accumulated_together(pids: list[int], accumulate: set[int]) -> list[int]:
    """The members of a gradient bucket (ZeRO-3) whose accumulated gradients stay together as
    one bucket (`accumulate_start`: one reduce-scatter on the window's last micro-step): the
    accumulated ones, when there are two or more (all of them: the bucket itself); one alone
    becomes an `accumulate_grad`. The others stay in the bucket."""
    acc = [p for p in pids if p in accumulate]
    return acc if len(acc) > 1 else []


def predict_counts(colls: list[Collective], keep: set[int], accumulate: set[int], gas: int,
                   refresh: list[int]) -> dict[str, dict[str, dict[str, int]]]:
    """Collectives and bytes per optimizer step, before and after (`refresh`: the bytes of
    each refresh collective)."""
    out = {k: {"before": {"count": 0, "bytes": 0}, "after": {"count": 0, "bytes": 0}}
           for k in ("all_gather", "reduce_scatter")}
    for c in colls:
        before, after = out[c.kind]["before"], out[c.kind]["after"]
        before["count"] += c.runs
        before["bytes"] += c.runs * c.nbytes
        gone = keep if c.kind == "all_gather" else accumulate
        left = [b for p, b in c.members if p not in gone]
        if left:
            after["count"] += c.runs
            after["bytes"] += c.runs * sum(left)
        if c.kind == "reduce_scatter":   # accumulated: reduced on the last micro-step only,
            once = [b for p, b in c.members if p in accumulate]   # together, or one alone
            together = accumulated_together([p for p, _ in c.members], accumulate)
            after["count"] += c.runs // gas * (1 if together else len(once))
            after["bytes"] += c.runs // gas * sum(once)
    out["all_gather"]["after"]["count"] += len(refresh)
    out["all_gather"]["after"]["bytes"] += sum(refresh)
    return out


def candidate(e, world_size: int) -> bool:
    """Whether keeping `e` gathered can save anything: a ZeRO-3 parameter, and at world size 1
    only one whose gather casts its shard (a compute dtype other than the master's). Not one
    whose master is on the host (offload tier 3): its refresh after the step would read the
    master after it left."""
    return e.zero_stage == 3 and (world_size > 1 or e.compute_dtype != e.shard.dtype) \
        and e.lowp is None


def _planned(ctx: PassContext) -> tuple[list[Collective], list[dict[str, Any]], int, float]:
    """(the collectives, every candidate's options, the peak — the graphs' profiled peaks and
    the optimizer step's — and the room the budget leaves: budget − peak)."""
    graphs = {k: s.gm for k, s in ctx.slots.items()}
    colls = collectives_of(graphs, ctx.order,
                           frozenset(k for k, s in ctx.slots.items() if s.kind == "bw"))
    gas = ctx.runtime.step.gradient_accumulation_steps
    used = {p for c in colls for p, _ in c.members}
    # ZeRO-1/2: parameters are replicated (nothing to keep gathered) and ZeRO-1 already
    # accumulates gradients locally; the pass is a ZeRO-3 pass and keeps nothing there.
    cands = [Candidate(e.pid, e.name, _kept.kept_bytes(e), accumulator_bytes(e),
                       e.padded_numel * e.compute_dtype.itemsize)
             for e in ctx.registry if e.pid in used and candidate(e, ctx.world_size)]
    excluded = {p for pair in ctx.registry.reuses for p in pair}
    opts = options_of(cands, colls, ctx.cost, gas, excluded)
    # a kept copy and its accumulator stay on the device through the optimizer step too
    peak = max([p.peak_bytes for p in ctx.profiles.values()] + [ctx.step_bytes()])
    return colls, opts, peak, ctx.memory_budget - peak


def _choices(o: dict[str, Any]) -> list[tuple[int, float]]:
    return [] if o["excluded"] else \
        [o["keep"]] + ([o["keep_accumulate"]] if o["keep_accumulate"] else [])


def plan(ctx: PassContext) -> dict[str, Any]:
    colls, opts, peak, capacity = _planned(ctx)
    gas = ctx.runtime.step.gradient_accumulation_steps
    choice = choose([_choices(o) for o in opts], capacity)
    chosen = [(o, k) for o, k in zip(opts, choice) if k is not None]
    keep, accumulate = [], []
    for o, k in chosen:
        w, v = o["keep_accumulate"] if k == 1 else o["keep"]
        item = {"param": o["name"], "bytes": w, "saved_s": v,
                "gathers_per_step": o["gathers_per_step"]}
        if k == 1:
            item["accumulator_bytes"] = w - o["keep"][0]
            item["reduces_per_step"] = o["reduces_per_step"]
            accumulate.append(o["name"])
        keep.append(item)
    by_pid = {e.pid: e for e in ctx.registry}
    refresh = [sum(e.padded_numel * e.compute_dtype.itemsize for e in g)
               for g in _kept.refresh_groups([by_pid[o["pid"]] for o, _ in chosen])]
    decisions = {
        "budget_bytes": None if ctx.memory_budget == float("inf") else ctx.memory_budget,
        "peak_bytes": peak,
        "capacity_bytes": None if capacity == float("inf") else capacity,
        "gradient_accumulation_steps": gas,
        "keep": keep, "accumulate": accumulate,
        "kept_bytes": sum(o["keep"][0] for o, _ in chosen),
        "accumulator_bytes": sum(i.get("accumulator_bytes", 0) for i in keep),
        "saved_s": sum(i["saved_s"] for i in keep),
        "refresh_bytes": refresh,
        "excluded_reuse": sorted(o["name"] for o in opts if o["excluded"]),
        "per_step": predict_counts(colls, {o["pid"] for o, _ in chosen},
                                   {o["pid"] for o, k in chosen if k == 1}, gas, refresh),
    }
    log.info("deepcompile pass selective_unshard: %s", summary(decisions)[0])
    return decisions


def summary(decisions: dict[str, Any]) -> list[str]:
    d, size = decisions, _size
    ag, rs = d["per_step"]["all_gather"], d["per_step"]["reduce_scatter"]
    room = "unbounded" if d["capacity_bytes"] is None else size(max(d["capacity_bytes"], 0))
    lines = [
        f"kept {len(d['keep'])} parameters ({size(d['kept_bytes'])}) and {len(d['accumulate'])} "
        f"gradient accumulators ({size(d['accumulator_bytes'])}) in {room} (budget − peak); "
        f"per optimizer step: all-gathers {ag['before']['count']} -> {ag['after']['count']} "
        f"({size(ag['before']['bytes'])} -> {size(ag['after']['bytes'])}), reduce-scatters "
        f"{rs['before']['count']} -> {rs['after']['count']} ({size(rs['before']['bytes'])} -> "
        f"{size(rs['after']['bytes'])}); predicted comm saved {d['saved_s'] * 1e3:.2f} ms",
    ]
    ranked = sorted(d["keep"], key=lambda i: (-i["saved_s"], i["param"]))
    for i in ranked[:5]:
        acc = (f", gradient accumulated ({size(i['accumulator_bytes'])}, "
               f"{i['reduces_per_step']} reduce-scatters/step -> once)") if "accumulator_bytes" in i else ""
        lines.append(f"top: {i['param']}: {size(i['bytes'])}, {i['gathers_per_step']} gathers/step "
                     f"-> refresh{acc}; saves {i['saved_s'] * 1e3:.3f} ms/step")
    if len(ranked) > 5:
        rest = ranked[5:]
        lines.append(f"and {len(rest)} more parameters ({size(sum(i['bytes'] for i in rest))}, "
                     f"{sum(i['saved_s'] for i in rest) * 1e3:.3f} ms/step)")
    if d["excluded_reuse"]:
        lines.append(f"not considered (graph reuse): {len(d['excluded_reuse'])} parameters, e.g. "
                     f"{', '.join(d['excluded_reuse'][:3])}")
    return lines


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


# -------------------------------------------------------------------------------- rewrite
def apply(ctx: PassContext, decisions: dict[str, Any]) -> list[str]:
    by_name = {e.name: e for e in ctx.registry}
    keep = {by_name[i["param"]].pid for i in decisions["keep"]}
    accumulate = {by_name[n].pid for n in decisions["accumulate"]}
    if not keep:
        return []
    changed = [key for key, slot in sorted(ctx.slots.items())
               if rewrite(slot.gm.graph, keep, accumulate)]
    ctx.runtime.kept.configure([e for e in ctx.registry if e.pid in keep])
    ctx.runtime.accum.enable([e for e in ctx.registry if e.pid in accumulate])
    return changed


def rewrite(graph: fx.Graph, keep: set[int], accumulate: set[int]) -> bool:
    """Replace the gathers of `keep` and the reduces of `accumulate` in one graph; whether it
    changed."""
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        t = node.target
        if t is ops.ALLGATHER and node.args[1] in keep:
            node.target = ops.KEPT_PARAM          # same arguments
            changed = True
        elif t is ops.REDUCE_GRAD and node.args[1] in accumulate:
            node.target = ops.ACCUMULATE_GRAD     # same arguments
            changed = True
        elif t is ops.ALLGATHER_WAIT:
            start = node.args[0]
            changed |= _pull(graph, node, start, keep, _kept_from(start.args[0], start.args[2]))
        elif t is ops.ALLGATHER_FROM_PREV:
            changed |= _pull(graph, node, node, keep, _kept_from(node.args[0], node.args[2]))
        elif t is ops.REDUCE_WAIT and node.args[0].target is ops.REDUCE_START:
            # (a bucket of `accumulate_start` holds gradients accumulated already)
            start = node.args[0]
            together = accumulated_together(node.args[1], accumulate) \
                if len(start.args) < 3 else []   # 3: ZeRO-1 (nothing is accumulated there)
            if together == list(node.args[1]):
                # every member accumulated: the bucket stays, reduced on the last micro-step
                start.target = ops.ACCUMULATE_START
                changed = True
            elif together:
                # the accumulated members leave as one bucket of their own, the others stay
                changed |= _pull(graph, node, start, set(together),
                                 _accumulated_bucket(graph, start, node, together))
            else:
                changed |= _pull(graph, node, start, accumulate, _accumulated_from(start.args[0]))
        elif t is ops.ALLGATHER_FOR_NEXT:
            pids = node.args[1]
            left = [p for p in pids if p not in keep]
            if len(left) < len(pids):
                changed = True
                if left:
                    node.args = (node.args[0], left, node.args[2])
                else:
                    graph.erase_node(node)
    if changed:
        graph.lint()
    return changed


def _kept_from(shards: list[fx.Node], dtype) -> Callable[[fx.Graph, int, int], fx.Node]:
    def make(graph: fx.Graph, i: int, pid: int) -> fx.Node:
        e = lookup(pid)
        return graph.call_function(ops.KEPT_PARAM, (shards[i], pid, list(e.shape), dtype))
    return make


def _accumulated_from(grads: list[fx.Node]) -> Callable[[fx.Graph, int, int], fx.Node]:
    def make(graph: fx.Graph, i: int, pid: int) -> fx.Node:
        e = lookup(pid)
        return graph.call_function(ops.ACCUMULATE_GRAD,
                                   (grads[i], pid, e.shard.numel(), e.shard.dtype))
    return make


def _accumulated_bucket(graph: fx.Graph, start: fx.Node, wait: fx.Node,
                        together: list[int]) -> Callable[[fx.Graph, int, int], fx.Node]:
    """A new `accumulate_start` / `reduce_wait` pair for the members `together` of the bucket
    (`start`, `wait`): the start right before `start` (every member's gradient exists there),
    the wait right before `wait`; `_pull` then takes the members out of the old bucket and
    hands out this wait's values in their place."""
    pids = list(wait.args[1])
    idx = [pids.index(p) for p in together]
    with graph.inserting_before(start):
        new_start = graph.call_function(ops.ACCUMULATE_START,
                                        ([start.args[0][i] for i in idx], list(together)))
    new_start.meta["val"] = _in_flight(start, list(together))
    with graph.inserting_before(wait):
        new_wait = graph.call_function(ops.REDUCE_WAIT, (new_start, list(together)))
    vals = wait.meta.get("val") or [None] * len(pids)
    new_wait.meta["val"] = [vals[i] for i in idx]
    slot = {p: k for k, p in enumerate(together)}

    def make(graph: fx.Graph, i: int, pid: int) -> fx.Node:
        return graph.call_function(operator.getitem, (new_wait, slot[pid]))
    return make


def _pull(graph: fx.Graph, wait: fx.Node, start: fx.Node, pids_out: set[int],
          make: Callable[[fx.Graph, int, int], fx.Node]) -> bool:
    """Take the members in `pids_out` out of a fused group: `start` launches it (its args:
    inputs list, pids, ...), `wait` hands out one value per member through getitem nodes (it
    may be `start` itself: `allgather_from_prev`). Each member taken out gets its own node
    from `make` right before `wait`; the group is rebuilt with the others, or erased."""
    pids = list(wait.args[1])
    out = [i for i, p in enumerate(pids) if p in pids_out]
    if not out:
        return False
    parts = {}
    for user in list(wait.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise RuntimeError(f"deepcompile selective_unshard: {wait.name} has a user that is "
                               f"not a getitem ({user.format_node()})")
        parts[user.args[1]] = user
    vals = wait.meta.get("val") or [None] * len(pids)
    for i in out:
        with graph.inserting_before(wait):
            node = make(graph, i, pids[i])
        node.meta["val"] = vals[i]
        if i in parts:
            parts[i].replace_all_uses_with(node)
            graph.erase_node(parts[i])
    keep = [i for i in range(len(pids)) if i not in out]
    if not keep:
        graph.erase_node(wait)
        if start is not wait:
            graph.erase_node(start)
        return True
    for new, i in enumerate(keep):
        if i in parts:
            parts[i].args = (wait, new)
    start.args = ([start.args[0][i] for i in keep], [pids[i] for i in keep], *start.args[2:])
    if start is not wait:
        wait.args = (start, [pids[i] for i in keep])
        start.meta["val"] = _in_flight(start, [pids[i] for i in keep])
    wait.meta["val"] = [vals[i] for i in keep]
    return True


def _in_flight(start: fx.Node, pids: list[int]):
    """The static model's stand-in for what a rebuilt group holds in flight (as `prefetch` and
    `bucket_reduce` describe it: the gathered buffer; the padded gradients in the reduce dtype
    and this rank's reduced slice)."""
    val = start.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return val
    entries = [lookup(p) for p in pids]
    if start.target is ops.REDUCE_START or start.target is ops.ACCUMULATE_START:
        return val.new_empty((sum(e.padded_numel + e.shard.numel() for e in entries),))
    return val.new_empty((sum(e.padded_numel for e in entries),))


def auto(f: Facts) -> tuple[bool, str]:
    """`passes="auto"`: ZeRO-3 with memory left under the budget, before `prefetch` (keeping a
    parameter gathered removes whole collectives, and planned first it values every gather at
    its own collective's cost, not a share of a fused one); at world size 1 only where a gather
    casts the shard at every use (a kept copy is cast once per optimizer step)."""
    room = f.memory_budget - f.peak_bytes
    left = "memory budget unbounded" if room == float("inf") else f"{mib(room)} under the budget"
    if f.world_size == 1 and not f.casts:
        return False, "world size 1, compute in the masters' dtype: a gather is a view of the local shard"
    if f.zero_stage < 3:
        return False, f"ZeRO-{f.zero_stage}: parameters are replicated"
    if not f.gathers:
        return False, "no parameter gathers in the graphs"
    if room <= 0:
        return False, (f"no memory left: profiled peak {mib(f.peak_bytes)} >= "
                       f"budget {mib(f.memory_budget)}")
    if f.world_size == 1:
        return True, (f"{left}: world size 1, {f.casts} parameters cast to their compute dtype at "
                      "every use; a kept copy is cast once per optimizer step")
    return True, (f"{left}: keeping parameters gathered removes whole collectives (before "
                  "prefetch, so that each gather is valued at its own collective's cost)")


def spare_memory(m: SpareMemory) -> tuple[float, float]:
    """`Config.layout="auto"`, before anything is profiled: the parameters kept gathered in the
    memory a layout leaves, most communication saved per byte first (a greedy fill, where `plan`
    solves the knapsack from profiles); each saves its gathers of every micro-step and costs
    its refresh. Accumulating gradients locally is left out (it needs the gradients' memory
    too). (seconds saved per optimizer step, bytes kept)."""
    if m.zero_stage < 3 or m.spare_bytes <= 0:
        return 0.0, 0.0
    options = sorted(((k.gather_s * m.gas - k.refresh_s, k.nbytes) for k in m.params),
                     key=lambda o: o[0] / max(o[1], 1), reverse=True)
    saved = used = 0.0
    for value, nbytes in options:
        if value <= 0:
            break
        if used + nbytes <= m.spare_bytes:
            saved, used = saved + value, used + nbytes
    return saved, used


def memory_value(ctx: PassContext) -> list[tuple[int, float]]:
    """What the pass would keep with memory beyond `budget − peak` ([Note: a memory trade] in
    passes/activation_budget.py): `offers` of its options."""
    if ctx.memory_budget == float("inf") or ctx.cost is None:
        return []
    _, opts, _, capacity = _planned(ctx)
    return offers(opts, capacity)


def offers(opts: list[dict[str, Any]], capacity: float) -> list[tuple[int, float]]:
    """Each parameter's most valuable option, most saved per byte first (the order a greedy
    fill takes them), less those that fit in `capacity` bytes: (bytes, predicted seconds saved
    per optimizer step) each."""
    best = [max(c, key=lambda o: (o[1], -o[0])) for c in map(_choices, opts) if c]
    ranked = sorted((o for o in best if o[1] > 0), key=lambda o: (-o[1] / max(o[0], 1), o[0]))
    used, out = 0, []
    for nbytes, saved in ranked:
        if used + nbytes <= max(capacity, 0):
            used += nbytes
        else:
            out.append((nbytes, saved))
    return out


register_pass("selective_unshard", plan, apply, __doc__.splitlines()[0], summary=summary,
              order=10, choose=auto, spare_memory=spare_memory, memory_value=memory_value,
              memory_buys="parameters kept gathered")
