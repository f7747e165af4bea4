"""Every rank runs the same collectives: the divergence check at each optimizer-step boundary,
and the agreements on new graphs, on a graph's structure at each call and on eager gathers. The
`DivergenceChecks` part of `Guardrails` (runtime/guardrails.py makes the state it reads: the
store, the checks' groups, `trace`, `window`).
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat
from .errors import DistributedError, DivergenceError, brief, place, store_has

FP_MUL = 0x100000001B3         # the graph-call fingerprint: fp = (fp * FP_MUL + digest) & FP_MASK
FP_MASK = (1 << 62) - 1        # 62 bits: the negation fits an int64


def digest(text: str) -> int:
    """A stable 62-bit digest (the same in every process: never Python's salted `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & FP_MASK


class Trace:
    """What this rank ran since the last optimizer step: the fingerprint of its graph calls and
    the calls themselves (their lowered graphs: `graph_key`, `digest`, `describe`)."""

    __slots__ = ("fp", "calls")

    def __init__(self) -> None:
        self.fp = 0
        self.calls: list = []


class DivergenceChecks:
    """The divergence check and the agreements, for `Guardrails`."""

    # [Note: new graphs are agreed] A rank that compiles a graph the others do not compile (a branch
    # taken on some ranks only, an evaluation run on one rank) would issue collectives the others
    # never issue. Each new graph a rank compiles -- the first graph of a kind (forward, backward,
    # inference) for a piece of code and parameter set (`compiler/families.py`) -- is agreed through
    # the store before it runs: the ranks compare its description (kind and parameters in order) and
    # wait for each other; a rank that never arrives leaves the others with a report after the
    # timeout. A new *shape* of a graph every rank has is not a new graph: it is planned like its
    # family's first graph (compiler/families.py) and needs no agreement (ragged inputs are the
    # normal case).
    def agree_graph(self, description: str, where: dict) -> None:
        """Every rank compiles this graph as its next new graph ([Note: new graphs are agreed])."""
        if not self.active:
            return
        index, self._graphs = self._graphs, self._graphs + 1
        key = f"graph/{index}"
        mine = f"{where.get('graph')}: {description}"
        try:
            first = self.store.compare_set(key, "", mine).decode()
            if first != mine:
                self.store.set(f"{key}/bad/{self.rank}", mine)
                self.store.add(f"{key}/bad", 1)
            self.store.set(f"{key}/at/{self.rank}", "1")
            if self.store.add(f"{key}/n", 1) == self.world:
                self.store.set(f"{key}/done", "1")
        except Exception as e:  # noqa: BLE001
            raise self._graph_failure(where, description, f"the store failed: {brief(e)}") from e
        try:
            self.store.wait([f"{key}/done"], timedelta(seconds=self._wait_s()))
        except Exception as e:  # noqa: BLE001 -- a timeout: some rank did not compile it
            raise self._graph_failure(where, description, self._absent(key)) from e
        if int(self.store.add(f"{key}/bad", 0)):
            first = self.store.get(key).decode()
            lines = [f"  {first}   <- the first rank to arrive"]
            for r in range(self.world):
                if store_has(self.store, f"{key}/bad/{r}"):
                    lines.append(f"  rank {r}: {self.store.get(f'{key}/bad/{r}').decode()}")
            err = DivergenceError(
                f"deepcompile: the ranks compiled different graphs as their new graph #{index} "
                f"(this rank {self.rank} at {place(where)}: {mine}):\n" + "\n".join(lines) +
                "\nEvery rank must run the same code with the same parameters (a branch taken on "
                "some ranks only, an evaluation run on some ranks only?).")
            self.stopped = err
            raise err

    def _absent(self, key: str) -> str:
        """Which other ranks did not arrive at the agreement `key`, as far as the store says (it
        lives with rank 0's process, and may be gone with it)."""
        within = f"within {self._wait_s():g} s"
        try:
            absent = [r for r in range(self.world)
                      if r != self.rank and not self.store.check([f"{key}/at/{r}"])]
        except Exception as e:  # noqa: BLE001
            return (f"some rank did not compile it {within} (which, the store cannot say: "
                    f"{brief(e)}; it lives with rank 0's process, which probably exited)")
        return f"ranks {absent} did not compile it {within}"

    def _graph_failure(self, where: dict, description: str, why: str) -> DistributedError:
        self.report("new_graph", where, f"waits at the agreement on its new graph "
                    f"{where.get('graph')} ({description}): {why}")
        err = DistributedError("\n".join(
            [f"deepcompile: rank {self.rank} compiled a new graph {where.get('graph')} at "
             f"{place(where)} ({description}) and the other ranks did not: {why}. A graph that "
             "runs on some ranks only issues collectives the others never issue (a branch taken "
             "on some ranks only? an evaluation run on some ranks only?).",
             "What the other ranks reported:", *self._others(), self._closing()]))
        self.stopped = err
        return err

    # [Note: structures are agreed at each call] Code whose graph depends on data (a loop count or a
    # branch read with `int()` / `.item()` after a graph break: [Note: graph structure] in
    # compiler/families.py) compiles to one graph per structure, each planned on its own, so each
    # issues its own collectives. Where the data take the ranks down different paths in one step, a
    # rank running one structure would pair its collectives with another structure's on the other
    # ranks: a hang, a crash in gloo (sizes differ), or silently wrong gradients (sizes alike). So
    # once the ranks agreed on a second structure of one piece of code (its first graph is agreed as
    # a new graph, above), every call of a forward graph of that code (and of an inference graph, at
    # ZeRO-3: at ZeRO-1/2 it issues no collective) first all-reduces its structure's digest (MAX of
    # it and of its negation: two integers) on a gloo group of its own (`structure_group`, opened
    # then, on every rank); where they differ, every rank all-gathers which graph each one called
    # and raises the same `DivergenceError` naming them, before any of the graphs' collectives. A
    # further structure needs no agreement when compiled: its first call is checked. One all-reduce
    # per call of such graphs only, and none at world size 1. Not covered: a rank compiling a piece
    # of code's *second* structure while the others run its first (nothing tells them the code has
    # another): the new graph's agreement waits for them and times out, naming the graph on every
    # rank, as for any graph compiled on some ranks only.
    def open_structure_checks(self) -> None:
        """Open the checks' group, once (every rank calls this at the same point: the agreement
        on a second structure; [Note: structures are agreed at each call])."""
        if not self.active or self.structure_group is not None:
            return
        group = self.comm.group if self.comm.group is not None else dist.group.WORLD
        self.structure_group = dist.new_group(dist.get_process_group_ranks(group),
                                              backend="gloo", use_local_synchronization=True)
        if self.timeout_s is not None:
            _compat.set_pg_timeout(self.structure_group, self.timeout_s)

    def agree_structure(self, graph: str, structure: int, step: int, micro: int) -> None:
        """Every rank calls a graph of this structure now, or every rank raises the same
        DivergenceError ([Note: structures are agreed at each call])."""
        if not self.active:
            return
        vec = torch.tensor([structure, -structure], dtype=torch.int64)
        self.failed_graph = graph   # named in the report where a rank never comes
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.structure_group)
        self.failed_graph = None
        hi, neg_lo = vec.tolist()
        if hi == -neg_lo:
            return
        calls: list[Any] = [None] * self.world
        dist.all_gather_object(calls, (self.rank, graph, structure), group=self.structure_group)
        groups: dict[tuple[str, int], list[int]] = {}
        for rank, key, digest_ in calls:
            groups.setdefault((key, digest_), []).append(rank)
        ran = "; ".join(f"ranks {ranks}: {key} (structure {d:x})"
                        for (key, d), ranks in sorted(groups.items(), key=lambda kv: kv[1]))
        err = DivergenceError(
            f"deepcompile: the ranks ran different structures of one piece of code in optimizer "
            f"step {step} (micro-step {micro}): {ran}. The code reads data to decide what it "
            "computes (a loop count or a branch taken on a value read with int(), .item() or "
            "bool() of a tensor), and the ranks' data took different paths in the same step: each "
            "path is a graph of its own with its own collectives. Take the same path on every "
            "rank in each step (decide from data every rank shares, or all-reduce the value "
            "first). The engine stops on every rank; restart from the last checkpoint.")
        self.stopped = err
        raise err

    # [Note: divergence check] Mismatched collectives do not always fail: the same sizes in another
    # order, or another parameter's gather of the same size, complete and train on wrong data; and
    # gloo aborts the process (in C++, no Python error) when a collective's size does not match the
    # peer's. So the ranks compare what they ran: every graph call folds the digest of the graph's
    # collective sequence (kind, parameters and so sizes, order, accumulation variant:
    # `compiler/families.py`; a graph Dynamo reuses for other parameters folds those too) into a
    # per-step fingerprint (two integer operations per graph call), and every
    # `Config.divergence_check_every` optimizer steps, first thing in `engine.step()`, before the
    # step's own collectives, the ranks all-reduce (MAX) eight integers: step, micro-steps,
    # fingerprint and graph calls, each with its negation, so one reduction yields the maximum and
    # minimum of each (a ninth carries the ranks' re-plan agreement: [Note: agreed re-planning] in
    # compiler/drift.py; a tenth whether some rank holds gradients of eager code: [Note: eager
    # gradients are agreed] in runtime/eager.py, which the other steps agree by the same reduction
    # with the step alone compared). Any difference, and every rank all-gathers the per-call details
    # of the window and raises the same `DivergenceError` naming the first step, graph call and
    # ranks that differ.
    # The check runs on a gloo group of its own that carries nothing else: a rank that is behind or
    # ahead can never pair the check with a training collective (it waits, and times out with a
    # report, instead). A rank that ran one micro-step more than the others is caught this way,
    # before the optimizer step pairs anything with its extra forward. Measured cost: see
    # `benchmarks/guardrails_cost.py` and the README.
    def end_step(self, step: int, micro: int, request: bool | None = None,
                 held: bool = False) -> bool:
        """First thing at an optimizer-step boundary, on every rank ([Note: divergence check]).

        `request`: whether this rank asks the others for a re-plan ([Note: agreed re-planning]
        in compiler/drift.py); None where no re-plan can be asked for this step (the same on
        every rank). Returns whether some rank asked, once every rank knows it: with the check,
        or where there is no check this step, never (the request waits for the next check), or
        with no checks at all, at once. `held`: whether this rank holds gradients of eager code
        ([Note: eager gradients are agreed] in runtime/eager.py); whether any rank does is
        `held_anywhere` after the call. Both ride one reduction at every step, the check's
        where one is due (the step number always compared: ranks a step apart stop here)."""
        tr = self.trace
        self.window.append((step, micro, tr.fp, tr.calls))
        tr.fp, tr.calls = 0, []
        self._eager_seq = 0
        self._at = (step, micro)
        every = self.config.divergence_check_every
        if not self.active:
            self.window.clear()
            self.held_anywhere = held
            return bool(request)
        due = bool(every) and len(self.window) >= every
        fp, micros, calls = 0, 0, 0
        if due:
            for _s, m, f, c in self.window:
                fp = (fp * FP_MUL + f) & FP_MASK
                micros += m
                calls += len(c)
            self.checks += 1
        ask = request is not None and (due or not every)
        vec = torch.tensor([step, -step, micros, -micros, fp, -fp, calls, -calls,
                            int(bool(request)) if ask else 0, int(held)], dtype=torch.int64)
        self._reduce_for_check(vec, step, micro)
        v = vec.tolist()
        self.held_anywhere = bool(v[9])
        if all(v[i] == -v[i + 1] for i in range(0, 8, 2)):
            if due or not every:
                self.window.clear()
            return bool(v[8])
        details: list[Any] = [None] * self.world
        dist.all_gather_object(details, self._details(), group=self.check_group)
        err = DivergenceError(divergence_message(details))
        self.stopped = err
        raise err

    def _reduce_for_check(self, vec: torch.Tensor, step: int, micro: int) -> None:
        """All-reduce (MAX) `vec` on the check's group; a rank that never comes is reported."""
        try:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.check_group)
        except Exception as e:  # noqa: BLE001 -- some rank never came to the check
            where = {"phase": "step", "step": step, "micro": micro, "graph": None}
            calls = len(self.window[-1][3]) if self.window else 0
            self.report("check", where, f"waited at the cross-rank check after {micro} "
                        f"micro-steps and {calls} graph calls in this step: {brief(e)}")
            err = DistributedError("\n".join(
                [f"deepcompile: rank {self.rank} ended {place(where)} after {micro} "
                 "micro-steps and waited for the other ranks at the cross-rank check, which not "
                 f"all of them reached: {brief(e)}", "What the other ranks reported:",
                 *self._others(), self._closing()]))
            err.__cause__ = e
            self.stopped = err
            raise err

    def agree_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of the integer CPU tensor `mask` over the ranks (at an
        optimizer-step boundary, on every rank: [Note: eager gradients are agreed])."""
        if self.active:
            self._reduce_for_check(mask, *self._at)
        return mask

    def agree_eager(self, what: str, where: str, entries: list) -> None:
        """[Note: eager gathers are agreed] in runtime/eager.py: every rank is about to gather
        the same parameters (`entries`, for module `where`: `what` it gathers them for), or every
        rank raises the same DivergenceError."""
        if self.eager_group is None:
            return
        seq, self._eager_seq = self._eager_seq, self._eager_seq + 1
        mine = torch.tensor([seq, digest(repr([e.name for e in entries]))], dtype=torch.int64)
        every = torch.empty(self.world * 2, dtype=torch.int64)
        _compat.all_gather_flat(every, mine, self.eager_group)
        if all(torch.equal(mine, row) for row in every.view(self.world, 2)):
            return
        names = [e.name for e in entries]
        text = f"module {where} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
        seen: list[Any] = [None] * self.world
        dist.all_gather_object(seen, text, group=self.eager_group)
        err = DivergenceError(
            f"deepcompile: at ZeRO-3 the ranks ran different modules eagerly (outside the "
            f"compiled graphs): at the eager gather #{seq} of this optimizer step\n" +
            "\n".join(f"  rank {r}: {t}" for r, t in enumerate(seen)) +
            "\nA module run on some ranks only cannot gather its parameters (every rank takes "
            "part in each gather): run it on every rank (an expert with no token: call it on an "
            "empty batch), or train at ZeRO-1/2, where such a module trains as under DDP. The "
            "engine stops on every rank.")
        self.stopped = err
        raise err

    def _details(self) -> dict:
        return {"rank": self.rank,
                "steps": [{"step": s, "micro": m, "fp": f,
                           "calls": [(getattr(c, "graph_key", "?"), c.digest,
                                      getattr(c, "describe", "")) for c in calls]}
                          for s, m, f, calls in self.window]}


def divergence_message(details: list[dict]) -> str:
    """The first step, and graph call within it, where the ranks' collectives differ (the same
    text on every rank: it is made from everyone's details)."""
    n = min(len(d["steps"]) for d in details)
    for i in range(n):
        rows = [d["steps"][i] for d in details]
        keys = [(r["step"], r["micro"], r["fp"], len(r["calls"])) for r in rows]
        if len(set(keys)) == 1:
            continue
        head = (f"deepcompile: the ranks ran different collectives in optimizer step "
                f"{min(r['step'] for r in rows)}:")
        lines = [head]
        groups: dict[tuple, list[int]] = {}
        for d, k in zip(details, keys):
            groups.setdefault(k, []).append(d["rank"])
        for (step, micro, _fp, ncalls), ranks in groups.items():
            r = details[ranks[0]]["steps"][i]
            graphs = " ".join(c[0] for c in r["calls"][:12]) + (" ..." if ncalls > 12 else "")
            lines.append(f"  ranks {ranks}: step {step}, {micro} micro-steps, {ncalls} graph "
                         f"calls ({graphs})")
        calls = [d["steps"][i]["calls"] for d in details]
        j = next((j for j in range(max(map(len, calls)))
                  if len({c[j][1] if j < len(c) else None for c in calls}) > 1), None)
        if j is not None:
            lines.append(f"  first difference at graph call {j} of the step:")
            for d, c in zip(details, calls):
                what = f"{c[j][0]}: {c[j][2]}" if j < len(c) else "(no more graph calls)"
                lines.append(f"    rank {d['rank']}: {what}")
        lines.append("Every rank must run the same graphs on the same parameters, the same "
                     "number of micro-steps per optimizer step. The engine stops on every rank; "
                     "restart from the last checkpoint.")
        return "\n".join(lines)
    return ("deepcompile: the ranks' collective fingerprints differ, but no step of the compared "
            "window does (" + ", ".join(str(len(d["steps"])) for d in details) + " steps)")
