"""The activation pass's planner core (pure): for each saved value of a forward/backward pair
the options (keep, recompute, offload), the memory curves they change, the copies' stall on the
copy lanes, and `plan_pair`, the greedy choice under the budget (passes/activation_budget.py
describes the pass; tools/plan/ calls this core at scale)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import numpy as np

from ._common import Step

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
