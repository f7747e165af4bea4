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
applied (it lowers a peak that is over the budget). With no budget it plans nothing; with the
peak within the budget, nothing but a trade with the pass after it ([Note: a memory trade]).

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

import itertools
import logging
from typing import Any, Callable

import torch
from torch import fx

from ..compiler import graph as G
from ..runtime import activations as act_ops
from ..runtime import ops
# the core's names the planner (tools/plan/) and the tests read through the pass
from ._activation_graph import _flops, _readers, _root, analyse, recompute_chain  # noqa: F401
from ._activation_plan import HOST_OP_S, Activation, lane_stall, options, plan_pair  # noqa: F401
from ._common import SPLIT_MARGIN, Step, mib, size, steps_of, top
from .context import Facts, PassContext, get_pass, known_passes, register_pass

log = logging.getLogger("deepcompile")


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
    if budget == float("inf") or ctx.cost is None or not len(ctx.registry.entries):
        return {}
    # a pass that waits for the memory this one frees (offload_optimizer: it waits where it has
    # offers) meets the budget itself, with or without the trade: only a trade for it
    buyer = get_pass(ctx.queued[0]) if ctx.queued else None
    if buyer is not None and buyer.waits_for_memory is not None:
        offers = buyer.memory_value(ctx)
        if offers:
            return _trade(ctx, offers, waiting=True)
    # over the budget: within it (or as low as it goes); within it: perhaps a trade
    return _plan_at(ctx, budget, warn=True) or _trade(ctx)


def _plan_at(ctx: PassContext, target: float, warn: bool = False) -> dict[str, Any]:
    """Every pair whose profiled peak exceeds `target` bytes, planned to bring it within."""
    decisions: dict[str, Any] = {}
    overlap = getattr(ctx.runtime, "device", torch.device("cpu")).type == "cuda"
    room = _host_room(ctx)
    gas = ctx.runtime.step.gradient_accumulation_steps
    for fw_key, bw_key in pairs(ctx):
        fw_steps, bw_steps = steps_of(ctx.profiles[fw_key]), steps_of(ctx.profiles[bw_key])
        if max((s.live_bytes for s in fw_steps + bw_steps), default=0) <= target:
            continue
        out_bytes = {n.name: n.out_bytes for n in ctx.profiles[fw_key].nodes}
        # graphs of other shapes of this code run the plan transplanted, which copies a
        # recompute's nodes with this graph's shapes ([Note: activations after partitioning])
        shapes = any(getattr(ctx.slots[k], "members", None) for k in (fw_key, bw_key))
        pair = analyse(fw_key, bw_key, ctx.slots[fw_key].gm, ctx.slots[bw_key].gm, fw_steps,
                       bw_steps, out_bytes, recompute=not shapes)
        d = plan_pair(fw_steps, bw_steps, pair.acts, target, ctx.cost.copy_s, overlap, room,
                      copies=max(1, ctx.order.count(fw_key) // gas),
                      lane_busy=_state_reloads(ctx, {"fw": fw_key, "bw": bw_key},
                                               {"fw": fw_steps, "bw": bw_steps}))
        if d["peak_before"] <= target:
            continue
        room -= d["host_bytes"]
        d.update(fw=fw_key, bw=bw_key, recompute_off=shapes,   # (an estimate: a float)
                 recompute_flops=float(sum(pair.flops.get(c["name"], 0) for c in d["choices"]
                                           if c["action"] == "recompute")))
        if d["unattainable"] and warn:
            log.warning("deepcompile activation_budget: %s/%s: memory budget %s is below what "
                        "recomputing or offloading the saved activations reaches: the lowest "
                        "peak is %s (from %s); applying that plan", fw_key, bw_key,
                        size(target), size(d["peak_after"]), size(d["peak_before"]))
        decisions[fw_key[:-3]] = d
    return decisions


# [Note: a memory trade] With the profiled peak within the budget the pass may still free memory,
# for the pass that plans next when that pass says what more memory is worth to it
# (`Pass.memory_value`: selective_unshard keeps more parameters gathered, prefetch starts gathers
# earlier, offload_optimizer keeps more optimizer state on the device): activations are
# recomputed or offloaded below the budget where the time the next
# pass predicts to save is at least `SPLIT_MARGIN` times the time they add (both predictions,
# each within ~±20%, cannot reverse that). The pass plans to a few lower targets
# (`TRADE_POINTS`: the next pass's options taken in its order, in equal counts), the peak each
# plan reaches sets the options the freed bytes buy, and the lowest target that still pays that
# margin is the plan: a threshold with a margin, not the largest net of two timed figures, so
# that launches whose profiled times differ a little plan alike. Its decisions say what was
# traded (`trade`), or, where the next pass offered something and no target paid, what each
# target would have freed, added and bought (`declined`; no graph changes). A trade is judged
# with the pass it frees memory for (compiler/pipeline.py): not on its own, where it only adds
# time, but the two together against the graphs from before the trade, kept or reverted
# together; the trade is reverted as well when that pass changes nothing, unless the trade
# alone brought the step within the budget. Over the budget, the pass plans to the budget and
# trades nothing; with an unbounded budget it plans nothing.
# offload_optimizer plans first (the state it leaves on the device is in every graph's peak),
# but when its plan takes off the device what a lower peak would keep, it waits for this pass
# (`Pass.waits_for_memory`; compiler/pass_manager.py `waits`), which then only trades, over
# the budget or within it: the offload plan meets the budget either way. Its offers are its
# plan made again on lower curves (passes/_offload_plan.py `offers`), and the optimizer step's
# bytes are no floor for them (they price the step themselves). Declined, the pass plans once
# more right after offload_optimizer (`PassManager.unchanged`), for the pass after that; traded,
# the memory freed is not also offered to selective_unshard or prefetch.
TRADE_POINTS = 6
ORDER = 5   # before the passes it may free memory for


def choose_trade(offers: list[tuple[int, float]], level: float,
                 plan_at: Callable[[float], tuple[float, float, Any]],
                 tried: list[tuple[int, float, float]] | None = None
                 ) -> tuple[Any, int, float, float] | None:
    """[Note: a memory trade], the rule alone (the runtime's pass and `deepcompile plan` both
    use it): `offers` the next pass's `memory_value`, `level` the peak now, `plan_at(target)` ->
    (the peak a plan to `target` reaches, the seconds it adds per optimizer step, the plan).
    Returns (the plan, bytes freed, seconds the next pass saves with them, seconds added) for the
    lowest target that pays, or None; `tried`, where given, collects (bytes freed, seconds
    saved, seconds added) of every target planned."""
    upto = list(itertools.accumulate(nbytes for nbytes, _ in offers))
    best = None
    for k in sorted({max(1, round(len(offers) * i / TRADE_POINTS))
                     for i in range(1, TRADE_POINTS + 1)}):
        target = level - upto[k - 1]
        if target <= 0:
            break
        reached, cost, planned = plan_at(target)
        freed = int(level - reached)
        value = sum(saved for (_, saved), total in zip(offers, upto) if total <= freed)
        if tried is not None:
            tried.append((freed, value, cost))
        if freed > 0 and value >= SPLIT_MARGIN * cost:
            best = (planned, freed, value, cost)
    return best


def _trade(ctx: PassContext, offers: list[tuple[int, float]] | None = None,
           waiting: bool = False) -> dict[str, Any]:
    """[Note: a memory trade] for the pass queued next; `offers`: its `memory_value`, where the
    caller has them."""
    buyer = ctx.queued[0] if ctx.queued else None
    if offers is None:
        value_of = get_pass(buyer).memory_value if buyer is not None else None
        offers = value_of(ctx) if value_of is not None else []
    if not offers:
        return {}
    peaks = {k: p.peak_bytes for k, p in ctx.profiles.items()}
    # the optimizer step's bytes are a floor no activation lowers (the buyer's memory stays
    # through the step): graph bytes freed below it buy nothing; a waiting buyer places the
    # optimizer state, which the step's bytes count, and its offers price the step themselves
    floor = 0 if waiting else ctx.step_bytes()
    level = max([floor, *peaks.values()])

    def plan_at(target: float) -> tuple[float, float, dict[str, Any]]:
        d = _plan_at(ctx, target)
        planned = {key for pd in d.values() for key in (pd["fw"], pd["bw"])}
        reached = max([floor] + [pd["peak_after"] for pd in d.values()]
                      + [p for key, p in peaks.items() if key not in planned])
        return reached, sum(pd["added_s"] * ctx.order.count(pd["fw"]) for pd in d.values()), d

    tried: list[tuple[int, float, float]] = []
    best = choose_trade(offers, level, plan_at, tried)
    if best is None:
        declined = declined_record(buyer, level, offers, tried)
        log.info("deepcompile activation_budget: %s", declined_line(declined))
        return {"declined": declined}
    decisions, freed, value, cost = best
    decisions["trade"] = trade_record(buyer, freed, level, cost, value, offers)
    log.info("deepcompile activation_budget: %s", _trade_line(decisions["trade"]))
    return decisions


def trade_record(buyer: str, freed: int, level: float, cost: float, value: float,
                 offers: list[tuple[int, float]]) -> dict[str, Any]:
    """What a trade's decisions say of it (the report prints `_trade_line`): `bought`, the
    buyer's first offers the freed bytes cover."""
    bought = sum(total <= freed for total in itertools.accumulate(b for b, _ in offers))
    return {"for": buyer, "freed_bytes": int(freed), "peak_before": int(level),
            "added_s": cost, "value_s": value, "offers": len(offers), "bought": bought}


def declined_record(buyer: str, level: float, offers: list[tuple[int, float]],
                    tried: list[tuple[int, float, float]]) -> dict[str, Any]:
    """What a declined trade's decisions say of it (the report prints `declined_line`): each
    target planned, as `choose_trade` collected it."""
    return {"for": buyer, "peak_before": int(level), "offers": len(offers),
            "tried": [{"freed_bytes": f, "value_s": v, "added_s": c} for f, v, c in tried]}


def _buys(buyer: str) -> str:
    return get_pass(buyer).memory_buys if buyer in known_passes() else ""


def _trade_line(t: dict[str, Any]) -> str:
    buys = _buys(t["for"])
    what = (f" ({buys}: {t['bought']} of its {t['offers']} offers)"
            if buys and "bought" in t else "")
    return (f"freed {size(t['freed_bytes'])} below the peak {size(t['peak_before'])} for "
            f"{t['for']}{what}: +{t['added_s'] * 1e3:.2f} ms a step predicted, for "
            f"{t['value_s'] * 1e3:.2f} ms it predicts to save with it")


def declined_line(t: dict[str, Any]) -> str:
    buys = _buys(t["for"])
    tried = "; ".join(f"freeing {size(max(p['freed_bytes'], 0))} below the peak "
                      f"{size(t['peak_before'])} adds +{p['added_s'] * 1e3:.2f} ms a step for "
                      f"{p['value_s'] * 1e3:.2f} ms" for p in t["tried"])
    return (f"not traded for {t['for']} ({buys + ': ' if buys else ''}{t['offers']} offers): "
            + (f"{tried}, less than {SPLIT_MARGIN:g}x" if tried else
               "its first offer needs more than the peak"))


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
    for key, d in sorted(decisions.items()):
        if key in ("trade", "declined") or not d["choices"]:
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
    lines = [f"traded: {_trade_line(decisions['trade'])}"] if "trade" in decisions else []
    if "declined" in decisions:
        lines.append(declined_line(decisions["declined"]))
    for key, d in sorted(decisions.items()):
        if not isinstance(d, dict) or "choices" not in d:
            continue
        rec = [c for c in d["choices"] if c["action"] == "recompute"]
        off = [c for c in d["choices"] if c["action"] == "offload"]
        lines.append(
            f"{key}: peak {size(d['peak_before'])} -> {size(d['peak_after'])} "
            f"({'target' if 'trade' in decisions else 'budget'} "
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
    """`passes="auto"`: when the budget is bounded and a profiled peak exceeds it (auto's
    profiles hold all optimizer state: `offload_optimizer`, chosen too where the state does not
    fit, may wait for this pass and buy the memory it frees, [Note: a memory trade]); within
    the budget, when the pass chosen to plan right after it says what more memory is worth to
    it (`Pass.memory_value`) and the room under the budget cannot keep every parameter gathered
    (with room for all of them, more memory is worth nothing: neither more parameters kept nor
    more gathered early): the pass then frees activations for it only where that pays."""
    if f.memory_budget == float("inf"):
        return False, "memory budget unbounded: every saved activation stays"
    if f.peak_bytes <= f.memory_budget:
        within = (f"profiled peak {mib(f.peak_bytes)} within the budget "
                  f"{mib(f.memory_budget)}")
        if f.memory_budget - f.peak_bytes >= f.keep_all_bytes:
            return False, (f"{within}, with room for every parameter gathered: every saved "
                           "activation stays")
        after = [p for p in sorted(map(get_pass, known_passes()), key=lambda p: p.order)
                 if p.order > ORDER and p.choose is not None and p.choose(f)[0]]
        if not after or after[0].memory_value is None:
            return False, f"{within}: every saved activation stays"
        return True, (f"{within}: activations are freed for {after[0].name}, which plans next, "
                      f"where the time it predicts to save with them is at least "
                      f"{SPLIT_MARGIN:g}x the time they add")
    return True, (f"profiled peak {mib(f.peak_bytes)} over the budget {mib(f.memory_budget)}: "
                  "the saved activations that are cheapest per byte are recomputed or offloaded")


register_pass("activation_budget", plan, apply, __doc__.splitlines()[0], summary=summary,
              order=ORDER, choose=auto, needs={"host_memory"}, frees_memory=True)
