"""Pass `offload_optimizer`: keep on the device only what fits the budget, from the profile.

The unit is a chunk of the flat layout (runtime/flat.py); what moves is its optimizer state
(tier 1, runtime/offload/). The plan reads one memory curve over the optimizer step:

* the profiled graphs in their recorded execution order (every micro-step of the accumulation
  window), each node's live bytes with all state on the device: the measured bytes plus the
  state the profiled steps kept off the device ([Note: provisional offload]);
* the optimizer step: what the device holds when it starts (measured on CUDA, modelled on the
  CPU: `step_start`), plus one chunk's flat gradient while the shards' gradients are folded,
  plus the state of the chunks that are on the device, plus room for the chunks streamed
  through it (at most `LOOKAHEAD + 1` at a time).

[Note: the device's memory model] On CUDA a profile's live bytes are `memory_allocated()`:
everything the process holds on the device — this engine's masters, gradients and state, the
runtime's buffers, and what is not this engine's at all (another engine, the caller's tensors,
cuBLAS workspaces) — each block rounded up to 512 bytes. The CPU model counts the graph's
storages and the runtime's buffers exactly, and nothing else. The plan is made in the
device's own terms: the step starts from a *measured* figure on CUDA (the same allocator count
as the graphs', taken before each profiled step), never from a sum of this engine's tensors,
and every byte the plan moves is counted as the device counts it (`offload.device_bytes`).

The plan itself is pure (passes/_offload_plan.py, which says what it decides and how); this
module reads its inputs from the context (`timeline`, `items_of`, `grad_items`, `master_items`)
and rewrites the graphs (`apply`).

Re-planning: a re-plan runs the pass again on the graphs as compiled ([Note: a re-plan starts
over] in compiler/pass_manager.py), so `apply` never meets a previous plan's ops.

Order with other passes: passes before this one see the curve with the state off the device
(provisional) and may spend that memory; this plan then keeps on the device only the state
that still fits. Passes after it see the plan's curve and spend only what the plan left. When
its plan takes off the device what a lower peak would keep, it plans after a queued pass that
frees memory (`waits_for_memory`: activation_budget), which frees activations so that state
stays on the device where that pays ([Note: a memory trade] in passes/activation_budget.py).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable

import torch
from torch import fx

from ..runtime import offload, ops
from ._common import mib
from ._offload_plan import (GradItem, HostStep, Item, MasterItem, Point,  # noqa: F401
                            _all_state_off, offers, plan_step, select, staging_bytes)
from .context import Facts, PassContext, register_pass

log = logging.getLogger("deepcompile")


def grad_outputs(graph: fx.Graph) -> list[tuple[fx.Node, int]]:
    """The shard gradients a backward graph returns, with their parameters: its outputs made by
    a reduction (`reduce_grad`, `accumulate_grad`, a part of a bucket's `reduce_wait`)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    found = []
    vals = out.args[0] if out.args else ()
    for v in vals if isinstance(vals, (list, tuple)) else [vals]:
        if not isinstance(v, fx.Node) or v.op != "call_function":
            continue
        if v.target in (ops.REDUCE_GRAD, ops.ACCUMULATE_GRAD):
            found.append((v, int(v.args[1])))
        elif (v.target is operator.getitem and isinstance(v.args[0], fx.Node)
              and v.args[0].target is ops.REDUCE_WAIT):
            found.append((v, int(v.args[0].args[1][v.args[1]])))
    return found


def grad_items(ctx: PassContext, points: list[Point]) -> list[GradItem]:
    """Per chunk: its shard gradients, the point after which the backward graphs have made
    all of them (the first micro-step's), where each is made first (`parts`) and made again
    (`again`: later micro-steps, a second graph). Not a chunk with a parameter whose graph
    Dynamo reuses for another ([Note: graph reuse] in compiler/backend.py): the op names its
    parameter by the compile-time id, and would send one parameter's gradient to another's
    place (a reuse that appears after planning is an error: Engine._check_reuse)."""
    store = ctx.runtime.offload
    reused = {pid for pair in ctx.registry.reuses for pid in pair}
    index: dict[tuple[str, str], list[int]] = {}
    for j, p in enumerate(points):
        index.setdefault((p.slot, p.name), []).append(j)
    made: dict[int, list[int]] = {}
    for key in dict.fromkeys(ctx.order):
        slot = ctx.slots.get(key)
        if slot is None or slot.kind != "bw":
            continue
        for node, pid in grad_outputs(slot.gm.graph):
            made.setdefault(pid, []).extend(index.get((key, node.name), ()))
    n = len(points)
    out = []
    for s in store.slots:
        if any(e.pid in reused for e in s.chunk.entries):
            continue
        parts, again = [], []
        for e, sh in zip(s.chunk.entries, s.chunk.shards):
            nbytes = offload.device_bytes(sh.numel() * sh.element_size(), store.device)
            first, *later = sorted(made.get(e.pid, ())) or [n]
            parts.append((first, nbytes))
            again += [(j, nbytes) for j in later]
        out.append(GradItem(s.chunk.index, store.grad_bytes(s),
                            offload.device_bytes(s.chunk.nbytes, store.device),
                            max((at for at, _ in parts), default=n), s.chunk.entries[0].name,
                            parts, sorted(again)))
    return out


def timeline(ctx: PassContext, offset: int = 0) -> list[Point]:
    """The profiled nodes of one optimizer step in execution order, `offset` bytes added to
    each (state the profiled steps kept off the device). Reloads may start in the first run,
    within the last micro-step, of each backward graph (the op acts only in the last
    micro-step, and the first of its runs there brings the state back)."""
    gas = ctx.runtime.step.gradient_accumulation_steps
    order = [k for k in ctx.order if k in ctx.profiles]
    last_from = len(order) - len(order) // gas if len(order) % gas == 0 else len(order)
    points, seen = [], set()
    for i, key in enumerate(order):
        in_last = i >= last_from
        placeable = in_last and key not in seen and ctx.slots[key].kind == "bw"
        if in_last:
            seen.add(key)
        points += [Point(key, n.name, n.live_bytes + offset, n.time_s, placeable)
                   for n in ctx.profiles[key].nodes]
    return points


def master_items(ctx: PassContext, points: list[Point]) -> list[MasterItem]:
    """Per chunk whose master may live on the host ([Note: masters on the host] in
    runtime/offload/): what that saves the device. Not a chunk with a parameter kept gathered
    or accumulated locally (`selective_unshard`: their refresh and tables read the shard), or
    whose graph Dynamo reuses (the gathers read the copy as a fixed input); none under
    hsdp_zero.

    On CUDA every master is on the device all the time ([Note: the device's memory model]): the
    saving is the same at every point. The CPU model counts a shard only in the graphs that
    take it as an input (`compiler/profiler.py`), and the copy at every point (a runtime
    buffer): there the saving at a point is the chunk's shards that its graph takes, less the
    copy, and may be negative."""
    store = ctx.runtime.offload
    if ctx.runtime.layout.refreshed_secondary:
        return []   # hsdp_zero: the secondary shards' refresh after the step reads every master
    held = {e.pid for e in ctx.runtime.kept.entries}
    reused = {pid for pair in ctx.registry.reuses for pid in pair}
    cpu = store.device.type != "cuda"
    inputs = {key: _shard_inputs(slot.gm.graph) for key, slot in ctx.slots.items()} if cpu else {}
    out = []
    for s in store.slots:
        c = s.chunk
        saving = store.master_saving(s)
        if not saving or any(e.pid in held or e.pid in reused or ctx.runtime.accum.accumulates(e)
                             for e in c.entries):
            continue
        per_point = None
        if cpu:
            copy = c.numel * c.entries[0].compute_dtype.itemsize
            shard = {e.pid: e.shard.numel() * e.shard.element_size() for e in c.entries}
            by_slot = {key: sum(n for pid, n in shard.items() if pid in pids)
                       for key, pids in inputs.items()}
            per_point = [by_slot.get(p.slot, 0) - copy for p in points]
        out.append(MasterItem(c.index, saving, offload.device_bytes(c.nbytes, store.device),
                              c.entries[0].name, per_point, c.numel,
                              c.numel * c.entries[0].compute_dtype.itemsize))
    return out


def _shard_inputs(graph: fx.Graph) -> set[int]:
    """The parameters whose shard the graph takes as an input: what its gathers (and a
    prefetch for the next graph) read."""
    out: set[int] = set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in (ops.ALLGATHER, ops.KEPT_PARAM):
            out.add(int(n.args[1]))
        elif n.target in (ops.ALLGATHER_START, ops.ALLGATHER_FROM_PREV, ops.ALLGATHER_FOR_NEXT):
            out.update(int(p) for p in n.args[1])
    return out


def host_capacity(ctx: PassContext) -> float:
    """Host bytes this plan may keep: the engine's (`PassContext.host_capacity`, measured at
    start-up, before any host buffer was made) less what the activations on the host hold
    (`activation_budget`'s buffers, there when this pass plans again after it)."""
    acts = ctx.runtime.activations
    return ctx.host_capacity - (acts.held_host_bytes() if acts is not None else 0)


def items_of(store) -> list[Item]:
    return [Item(s.chunk.index, store.state_bytes(s), s.chunk.entries[0].name)
            for s in store.slots if store.state_bytes(s) > 0]


def _planner(ctx: PassContext) -> tuple[list[Point], Callable[[list[Point]], dict[str, Any]]]:
    """The step's curve with all state on the device, and the plan of a curve (`plan_step`
    with this context's items, step, copy times, budget and host)."""
    store = ctx.runtime.offload
    # the profiles were measured with every chunk's state off the device ([Note: provisional
    # offload] in runtime/offload/__init__.py): add it back
    points = timeline(ctx, store.profile_offset())
    rate = ctx.host_step_rate
    host = None if rate is None else HostStep(
        rate, rate if store.device.type != "cuda" else 0.0, store.host_step)   # Config.host_step
    items, base, grads = items_of(store), store.step_base(), grad_items(ctx, points)
    masters, capacity = master_items(ctx, points), host_capacity(ctx)

    def plan_at(curve: list[Point]) -> dict[str, Any]:
        return plan_step(curve, items, base, ctx.cost.copy_s, ctx.memory_budget, grads,
                         masters, host, capacity)
    return points, plan_at


def plan(ctx: PassContext) -> dict[str, Any]:
    store = ctx.runtime.offload
    points, plan_at = _planner(ctx)
    decision = plan_at(points)
    decision["profiled_offloaded_bytes"] = store.profile_offset()
    decision["layout"] = store.layout_signature()
    if decision["unattainable"]:
        log.warning("deepcompile offload_optimizer: memory budget %.2f MiB is unattainable: %s",
                    ctx.memory_budget / 2**20, decision["reason"])
    else:
        log.info("deepcompile offload_optimizer: %s", summary(decision)[0])
    return decision


def apply(ctx: PassContext, decisions: dict[str, Any]) -> list[str]:
    store = ctx.runtime.offload
    if decisions.get("layout") not in (None, store.layout_signature()):
        raise RuntimeError("deepcompile offload_optimizer: the plan was made for another flat "
                           "layout (other parameters or optimizer groups); clear the plan cache")
    changed: set[str] = set()
    store.set_plan({c["chunk"]: c["tier"] for c in decisions["chunks"]},
                   ctx.memory_budget)
    any_pid, engine = next(iter(ctx.registry)).pid, ctx.runtime.handle
    for r in decisions["reloads"]:
        graph = ctx.slots[r["slot"]].gm.graph
        node = next(n for n in graph.nodes if n.name == r["after"])
        group = store.add_reload_group(r["chunks"])
        with graph.inserting_after(node):
            op = graph.call_function(offload.RELOAD_STATE,
                                     (_order_input(graph, node), [any_pid], group, engine))
        op.meta["val"] = None
        graph.lint()
        changed.add(r["slot"])
    to_host = {c["chunk"] for c in decisions["chunks"] if c["tier"] >= offload.GRADS}
    if to_host:   # tier 2: each of their gradients leaves where it is made
        chunk_of = store.flat.chunk_of
        for key, slot in ctx.slots.items():
            if slot.kind != "bw":
                continue
            graph = slot.gm.graph
            for node, pid in grad_outputs(graph):
                if chunk_of[pid].index in to_host:
                    with graph.inserting_after(node):
                        op = graph.call_function(offload.GRAD_TO_HOST, (node, pid, engine))
                    op.meta["val"] = None
                    changed.add(key)
            graph.lint()
    if decisions["chunks"] or decisions.get("profiled_offloaded_bytes"):
        # every graph's memory curve changes (the state is off the device, or back on it)
        changed |= {k for k in set(ctx.order) if k in ctx.slots}
    return sorted(changed)


def _order_input(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """The op's first input: `node` itself when it is a tensor computed here (the op runs after
    it), else a graph input (alive to the end anyway: using it changes no value's lifetime).
    Never a communication node: a later pass may replace it by one further down (bucket_reduce
    waits a reduction at the end of the graph), and the op would use a value defined after it."""
    if (isinstance(node.meta.get("val"), torch.Tensor) and node.target not in ops.MARKERS
            and not ops.communicates(node)):
        return node
    return next(n for n in graph.nodes if n.op == "placeholder"
                and isinstance(n.meta.get("val"), torch.Tensor))


def _mib(n) -> str:
    return "unbounded" if n is None else f"{n / 2**20:.2f} MiB"


def summary(d: dict[str, Any]) -> list[str]:
    if d["unattainable"]:
        return [f"unattainable (budget {_mib(d['budget_bytes'])}): {d['reason']}"]
    if not d["chunks"]:
        return [f"nothing offloaded: the step fits the budget ({_mib(d['peak_before'])} <= "
                f"{_mib(d['budget_bytes'])}); optimizer state {_mib(d['state_bytes'])}"]
    streamed = [c for c in d["chunks"] if c["streamed"]]
    shown = ", ".join(c["label"] for c in d["chunks"][:3])
    more = len(d["chunks"]) - 3
    with_grads = [c for c in d["chunks"] if c.get("grad_bytes")]
    grads = [f"gradients of {len(with_grads)} chunks off the device too, "
             f"{_mib(d['offloaded_grad_bytes'])}: each sent to the host where a backward makes "
             f"it ({_mib(d['grad_sent_bytes'])} a step, predicted "
             f"{d['predicted_grad_copy_s'] * 1e3:.3f} ms of copies), streamed back at the step"
             ] if with_grads else []
    with_masters = [c for c in d["chunks"] if c.get("master_bytes")]
    if with_masters:
        h = d.get("host_step") or {}
        how = ("they step on the host" if h.get("chosen")
               else "the step streams each master in and out")
        if "predicted_host_s" in h:
            how += (f"; host step {h['predicted_host_s'] * 1e3:.3f} ms against "
                    f"{h['predicted_streamed_s'] * 1e3:.3f} ms streamed, {h['why']}")
        grads.append(f"masters of {len(with_masters)} chunks on the host too, saving "
                     f"{_mib(d['offloaded_master_bytes'])} (the gathers read copies in the "
                     f"compute dtype; {how})")
    return [
        f"optimizer state of {len(d['chunks'])} chunks off the device, "
        f"{_mib(d['offloaded_bytes'])} of {_mib(d['state_bytes'])} (excess over budget "
        f"{_mib(d['need_bytes'])}): chunks from {shown}{f' and {more} more' if more > 0 else ''}",
        f"moved per step: {_mib(d['offloaded_bytes'])} to the host after the step, the same "
        f"back; {len(d['reloads'])} reload points in backward graphs, {len(streamed)} chunks "
        f"streamed through the step",
        f"predicted copies back in graphs {d['predicted_copy_s'] * 1e3:.3f} ms: hidden "
        f"{d['predicted_hidden_s'] * 1e3:.3f} ms, exposed {d['predicted_exposed_s'] * 1e3:.3f} ms; "
        f"streamed at the step {d['predicted_streamed_s'] * 1e3:.3f} ms",
        *grads,
        f"peak {_mib(d['peak_before'])} -> {_mib(d['peak_after'])} (budget "
        f"{_mib(d['budget_bytes'])}; optimizer step with all state {_mib(d['step_bytes'])})",
    ]


def auto(f: Facts) -> tuple[bool, str]:
    """`passes="auto"`: first, when the budget is bounded and the step with all optimizer state
    on the device (the profiled peak, or the optimizer step itself) exceeds it; asked again
    once the chosen passes ran (`f.late`: the step grew while they were planned)."""
    budget = f.memory_budget
    if budget == float("inf"):
        return False, "memory budget unbounded: all optimizer state stays"
    if f.step_bytes is None:
        return False, f.unmovable
    if f.warmup_steps == 0:
        return False, "warmup_steps is 0: the state it plans for does not exist when profiling starts"
    need = max(f.peak_bytes, f.step_bytes)
    if need <= budget:
        return False, (f"the step needs {mib(need)} with all optimizer state on the device, "
                       f"within the budget {mib(budget)}")
    return True, (f"the step needs {mib(need)} with all optimizer state on the device, over the "
                  f"budget {mib(budget)}: "
                  + ("its profiles grew after the passes were chosen: offload last" if f.late else
                     "offload first, later passes plan in what is left"))


def memory_value(ctx: PassContext) -> list[tuple[int, float]]:
    """What the plan would keep on the device with the graphs' peak lower than the profiles
    show ([Note: a memory trade] in passes/activation_budget.py): `offers` of the chunks it
    takes off the device now."""
    if ctx.memory_budget == float("inf") or ctx.cost is None:
        return []
    points, plan_at = _planner(ctx)
    return offers(points, plan_at, plan_at(points))


def waits_for_memory(ctx: PassContext) -> bool:
    """Whether to plan after the pass queued after it that frees memory (`Pass.frees_memory`),
    so that the memory freed can keep optimizer state on the device: when this plan takes
    something off the device that a lower peak would keep (that pass then frees memory only
    where what this plan saves with it pays for what it adds, and changes nothing otherwise;
    [Note: a memory trade] in passes/activation_budget.py)."""
    return bool(memory_value(ctx))


register_pass("offload_optimizer", plan, apply, __doc__.splitlines()[0], summary=summary,
              order=0, choose=auto, choose_late=True,
              needs={"elementwise_optimizer", "warmup_steps", "host_step", "host_memory"},
              replans_on_drift=True, memory_value=memory_value, waits_for_memory=waits_for_memory,
              memory_buys="optimizer state kept on the device",
              deepspeed="zero_optimization.offload_optimizer")
