"""What the scheduling passes (`prefetch`, `bucket_reduce`) share: the profiled steps they read,
the collectives they plan, the fusion rule and the greedy grouping over it, and the graph surgery
that splits a fused result."""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any, Callable, Iterator

from torch import fx

from ..runtime import ops
from .context import PassContext

log = logging.getLogger("deepcompile")

SPLIT_MARGIN = 2.0   # [Note: fusion policy] in compiler/autoplan.py


@dataclasses.dataclass
class Step:
    """One profiled node: what a planner needs of it."""
    name: str
    kind: str          # "compute" or a communication kind
    time_s: float
    live_bytes: int


@dataclasses.dataclass
class Collective:
    """One synchronous collective of a graph, as a planner sees it."""
    name: str
    index: int           # position of its node in the step sequence
    nbytes: int          # bytes on the wire (the padded full tensor)
    pid: int
    dtype: str | None = None   # one fused collective carries one dtype


def steps_of(prof) -> list[Step]:
    return [Step(n.name, n.kind, n.time_s, n.live_bytes) for n in prof.nodes]


def compute_times(steps: list[Step]) -> list[float]:
    """Per step, the compute time a collective in flight can hide behind (0 for comm nodes)."""
    return [s.time_s if s.kind == "compute" else 0.0 for s in steps]


def profiled_graphs(ctx: PassContext, target) -> Iterator[tuple[str, list[Step], list[tuple[int, fx.Node]]]]:
    """(slot key, its profiled steps, (step index, node) of every call of `target`, an op or a
    tuple of them) for each profiled graph that calls it, in key order."""
    targets = target if isinstance(target, tuple) else (target,)
    for key in sorted(ctx.slots):
        prof = ctx.profiles.get(key)
        if prof is None:
            continue
        by_name = {n.name: n for n in ctx.slots[key].gm.graph.nodes}
        calls = [(i, by_name[n.name]) for i, n in enumerate(prof.nodes)
                 if by_name[n.name].op == "call_function" and by_name[n.name].target in targets]
        if calls:
            yield key, steps_of(prof), calls


def fuses(cost_s: Callable[[int], float], members: list[Collective], nxt: Collective,
          between_s: float, max_bytes: int, launch_s: float = 0.0, policy: str = "overlap",
          split_margin: float = SPLIT_MARGIN) -> bool:
    """Whether `nxt` joins `members` in one collective, memory aside: same dtype, under the size
    cap, one collective of the summed bytes predicted cheaper than two (the latency and the
    host's launch of one collective saved), and, under the "overlap" policy, the compute
    between the group's first member and `nxt` not clearly longer (`split_margin` times) than
    what `nxt`'s own collective would cost on the device and on the host (no member is held
    back much longer than that). Under "cap" a group grows to the size cap ([Note: fusion
    policy] in compiler/autoplan.py)."""
    total = sum(m.nbytes for m in members)
    if nxt.dtype != members[0].dtype or total + nxt.nbytes > max_bytes:
        return False
    if not cost_s(total + nxt.nbytes) < cost_s(total) + cost_s(nxt.nbytes) + launch_s:
        return False
    return policy == "cap" or between_s < split_margin * (cost_s(nxt.nbytes) + launch_s)


def fused_groups(collectives: list[Collective], compute: list[float],
                 cost_s: Callable[[int], float], max_bytes: int, launch_s: float, policy: str,
                 fits: Callable[[list[Collective], Collective], bool],
                 ) -> Iterator[list[Collective]]:
    """The collectives, in their order, grouped greedily: a group takes the next collective
    while `fuses` says so (`between_s`: the profiled `compute` between the group's first member
    and the newcomer) and the pass's own condition `fits(members, newcomer)` (memory) holds;
    else the newcomer starts the next group. Lazy: the caller places each group (spending the
    memory `fits` reads) before the next one forms."""
    k = 0
    while k < len(collectives):
        members = [collectives[k]]
        k += 1
        while k < len(collectives):
            nxt, first = collectives[k], members[0]
            if not (fuses(cost_s, members, nxt, sum(compute[first.index:nxt.index]), max_bytes,
                          launch_s, policy) and fits(members, nxt)):
                break
            members.append(nxt)
            k += 1
        yield members


def launch_s(cost, kind: str) -> float:
    """The cost model's host time to launch one collective of `kind` (0 if it has none)."""
    f = getattr(cost, "launch_s", None)
    return float(f(kind)) if f is not None else 0.0


def unattainable(live: list[int], budget: float) -> dict[str, Any] | None:
    """The plan of a graph whose insertion-only peak is already over the budget, else None."""
    peak = max(live, default=0)
    if peak <= budget:
        return None
    return {"unattainable": True, "budget_bytes": budget, "insertion_peak_bytes": peak,
            "peak_before": peak, "peak_after": peak}


def warn_unattainable(pass_name: str, key: str, decision: dict[str, Any], consequence: str) -> None:
    log.warning("deepcompile %s: %s: memory budget %.2f MiB is below the graph's insertion-only "
                "peak %.2f MiB: unattainable, %s", pass_name, key,
                decision["budget_bytes"] / 2**20, decision["insertion_peak_bytes"] / 2**20,
                consequence)


@dataclasses.dataclass
class NodeIndex:
    """A graph's nodes by name and in their original order (taken before a rewrite erases any)."""
    by_name: dict[str, fx.Node]
    order: list[fx.Node]          # every node but placeholders and the output
    index: dict[str, int]         # name -> position in `order`
    output: fx.Node

    @classmethod
    def of(cls, graph: fx.Graph) -> "NodeIndex":
        order = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
        return cls({n.name: n for n in graph.nodes}, order,
                   {n.name: i for i, n in enumerate(order)},
                   next(n for n in graph.nodes if n.op == "output"))


def first_kept(order: list[fx.Node], start: int, erased: set[str], default: fx.Node) -> fx.Node:
    """The first node of `order` from `start` on that the rewrite does not erase."""
    return next((order[j] for j in range(start, len(order)) if order[j].name not in erased),
                default)


def replace_with_parts(graph: fx.Graph, fused: fx.Node, members: list[fx.Node]) -> None:
    """`fused` returns one value per member: route each member's users to its part (inserted
    right after `fused`, in member order) and erase the members; a member's followers
    (ops.FOLLOWERS) move right after the parts."""
    fused.meta["val"] = [m.meta.get("val") for m in members]
    parts = []
    with graph.inserting_before(fused.next):
        for i, m in enumerate(members):
            part = graph.call_function(operator.getitem, (fused, i))
            part.meta["val"] = m.meta.get("val")
            parts.append(part)
    for m, part in zip(members, parts):
        m.replace_all_uses_with(part)
        graph.erase_node(m)
    last = parts[-1] if parts else fused
    for part in parts:   # ops that follow a value where it is produced come along (ops.FOLLOWERS)
        for user in [u for u in part.users if u.target in ops.FOLLOWERS]:
            last.append(user)
            last = user


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


ONE_RANK = "world size 1: a gather is a view of the local shard, a reduction a cast"


def size(nbytes: float) -> str:
    """Bytes for a report line."""
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:.2f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes >= 2**10 else f"{int(nbytes)} B"


def top(items: list[str], n: int = 3) -> str:
    """The first `n` of `items`, and how many more."""
    shown = ", ".join(items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def module_of(params: list[str]) -> str:
    """The modules a group of parameters belongs to, short: their longest common module path
    (`model.layers.0.mlp`), or the first module and how many others."""
    mods = [p.rsplit(".", 1)[0] if "." in p else p for p in params]
    if not mods:
        return "?"
    parts = [m.split(".") for m in mods]
    common = []
    for bits in zip(*parts):
        if len(set(bits)) != 1:
            break
        common.append(bits[0])
    if common and len(common) > 1:
        return ".".join(common) + (f" ({len(params)} params)" if len(params) > 1 else "")
    uniq = list(dict.fromkeys(mods))
    return uniq[0] + (f" +{len(uniq) - 1} modules" if len(uniq) > 1 else "")


def group_summary(decisions: dict[str, Any], key: str, what: str) -> list[str]:
    """Report lines of a scheduling pass (`prefetch`: groups, `bucket_reduce`: buckets): per
    graph the collectives before and after, bytes, predicted time hidden; the largest groups."""
    lines, rows = [], []
    before = after = 0
    for slot, d in sorted(decisions.items()):
        if not isinstance(d, dict):
            continue
        if d.get("unattainable"):
            lines.append(f"{slot}: budget {size(d['budget_bytes'])} below the insertion-only peak "
                         f"{size(d['insertion_peak_bytes'])}: unattainable, unchanged")
            continue
        groups = d.get(key, [])
        n = sum(len(g["members"]) for g in groups)
        if not groups and not d.get("for_next"):
            continue
        before += n
        after += len(groups)
        pred = sum(g["predicted_s"] for g in groups)
        hidden = sum(min(g["hidden_s"], g["predicted_s"]) for g in groups)
        ahead = d.get("for_next", [])
        lines.append(f"{slot}: {n} {what} -> {len(groups)} "
                     f"({size(sum(g['bytes'] for g in groups))}); predicted {pred * 1e3:.2f} ms, "
                     f"hidden behind compute {hidden * 1e3:.2f} ms; peak {size(d['peak_before'])} "
                     f"-> {size(d['peak_after'])}"
                     + (f"; {len(ahead)} started at the tail for {ahead[0]['for']}" if ahead else ""))
        rows += [(g["bytes"], slot, g) for g in groups]
    rows.sort(key=lambda r: (-r[0], r[1]))
    for nbytes, slot, g in rows[:3]:
        params = g.get("params") or []
        lines.append(f"  largest: {slot} {module_of(params)}: {len(g['members'])} members, "
                     f"{size(nbytes)}")
    if before:
        lines.insert(0, f"{what} per graph run: {before} -> {after}")
    return lines
