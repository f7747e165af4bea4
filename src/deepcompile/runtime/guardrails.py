"""Guardrails: no rank hangs, and no rank goes on when the ranks are no longer in step.

Data-parallel training is correct only while every rank issues the same collectives in the same
order. This module is where the engine finds out that they do not, and makes every rank stop
with the same account of it.

[Note: failures across ranks] A rank that fails cannot tell the others through the process group
(the collectives are what no longer line up), so it tells them through the process group's
key-value store (the rendezvous store), which answers whatever the collectives do:

* an exception escaping the engine's forward, backward or step on one rank (the user's code, an
  OOM, a loop error) is re-raised there as it was, with a note, after the rank posts a *report*
  (`report/<rank>`: what, where: optimizer step, micro-step, phase, graph). The engine then stops
  on that rank: every later call raises `EngineStoppedError` (its collectives no longer match the
  others', and a user loop that catches the exception and carries on would pair its next
  collectives with the others' earlier ones);
* the other ranks wait in their next collective until `Config.collective_timeout_s` (gloo: the
  operation's timeout; NCCL: c10d's watchdog), or fail at once when the peer's process died
  (gloo: "connection closed"); the failed collective is caught where it escapes (the graph it ran
  in is recorded by the pipeline), the rank posts its own report, reads the others' (waiting up
  to `min(10 s, timeout)` for those that have not written yet), and raises `DistributedError`
  naming this rank, the step, the graph, and what every other rank reported -- or that it
  reported nothing (it exited, was killed, or is blocked outside deepcompile). If rank 0 died,
  the store went with it: the message says so.

[Note: divergence check] Mismatched collectives do not always fail: the same sizes in another
order, or another parameter's gather of the same size, complete and train on wrong data; and
gloo aborts the process (in C++, no Python error) when a collective's size does not match the
peer's. So the ranks compare what they ran: every graph call folds the digest of the graph's
collective sequence (kind, parameters and so sizes, order, accumulation variant:
`compiler/families.py`; a graph Dynamo reuses for other parameters folds those too) into a
per-step fingerprint (two integer operations per graph call), and every
`Config.divergence_check_every` optimizer steps, first thing in `engine.step()`, before the
step's own collectives, the ranks all-reduce (MAX) eight integers: step, micro-steps,
fingerprint and graph calls, each with its negation, so one reduction yields the maximum and
minimum of each (a ninth carries the ranks' re-plan agreement: [Note: agreed re-planning] in
compiler/drift.py; a tenth whether some rank holds gradients of eager code: [Note: eager
gradients are agreed] in runtime/eager.py, which the other steps agree by the same reduction
with the step alone compared). Any difference, and every rank all-gathers the per-call details
of the window and raises the same `DivergenceError` naming the first step, graph call and ranks
that differ.
The check runs on a gloo group of its own that carries nothing else: a rank that is behind or
ahead can never pair the check with a training collective (it waits, and times out with a
report, instead). A rank that ran one micro-step more than the others is caught this way,
before the optimizer step pairs anything with its extra forward. Measured cost: see
`benchmarks/guardrails_cost.py` and the README.

[Note: new graphs are agreed] A rank that compiles a graph the others do not compile (a branch
taken on some ranks only, an evaluation run on one rank) would issue collectives the others never
issue. Each new graph a rank compiles -- the first graph of a kind (forward, backward, inference)
for a piece of code and parameter set (`compiler/families.py`) -- is agreed through the store
before it runs: the ranks compare its description (kind and parameters in order) and wait for
each other; a rank that never arrives leaves the others with a report after the timeout. A new
*shape* of a graph every rank has is not a new graph: it is planned like its family's first
graph (compiler/families.py) and needs no agreement (ragged inputs are the normal case).

[Note: structures are agreed at each call] Code whose graph depends on data (a loop count or a
branch read with `int()` / `.item()` after a graph break: [Note: graph structure] in
compiler/families.py) compiles to one graph per structure, each planned on its own, so each
issues its own collectives. Where the data take the ranks down different paths in one step, a
rank running one structure would pair its collectives with another structure's on the other
ranks: a hang, a crash in gloo (sizes differ), or silently wrong gradients (sizes alike). So
once the ranks agreed on a second structure of one piece of code (its first graph is agreed as
a new graph, above), every call of a forward graph of that code (and of an inference graph, at
ZeRO-3: at ZeRO-1/2 it issues no collective) first all-reduces its structure's digest (MAX of
it and of its negation: two integers) on a gloo group of its own (`structure_group`, opened
then, on every rank); where they differ, every rank all-gathers which graph each one called
and raises the same `DivergenceError` naming them, before any of the graphs' collectives. A
further structure needs no agreement when compiled: its first call is checked. One all-reduce
per call of such graphs only, and none at world size 1. Not covered: a rank compiling a piece
of code's *second* structure while the others run its first (nothing tells them the code has
another): the new graph's agreement waits for them and times out, naming the graph on every
rank, as for any graph compiled on some ranks only.

[Note: collective calls] The engine's methods that communicate outside the training step
(`save_checkpoint`, `load_checkpoint`, `save_pretrained`, `full_state_dict`, `export_trace`,
`save_report`, `plot`) must be called on every rank, at the same point of the training loop.
Called under `if rank == 0:`, the caller would wait in the method's first collective and the
others in their next step's, until the timeout, with a transport error that names neither. So
each call first meets the other ranks' through the store (`enter_collective`): the k-th
collective call of an engine is "call/k" on every rank; a rank records there its method and how
many training forwards it ran before it, and waits for every rank. Every training forward posts
this rank's progress (`at_forward`: training forwards and collective calls so far, the step and
micro-step for the messages; one store write, which TCPStore does not answer). Every rank runs
the same forwards and calls in the same order, so a rank waiting at call k fails at once when
another one ran more training forwards than it did before call k without entering call k (it
skipped the call), or released its engine (or exited: `_gone`). Counts, not step numbers: a
load moves the step counter back, a count never does, and a rank's last post is never ahead of
it. The other way round, the first training forward of each accumulation window (one store
read) finds a call k another rank entered after fewer forwards than this rank has now run:
this rank skipped it, and fails there, before its forward's collectives. What cannot be seen
is waited for, up to the collective timeout: a slow rank has not skipped the call, and an eval
forward (no grad) posts nothing (at ZeRO-1/2 it may run on some ranks only). Either error stops
the engine on that rank (its call count no longer matches the others') and is posted as a
report for the ranks blocked in a collective ([Note: failures across ranks]).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import time
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat

log = logging.getLogger("deepcompile")

_ENGINES = itertools.count()   # one store namespace per engine (created in the same order on every rank)
FP_MUL = 0x100000001B3         # the graph-call fingerprint: fp = (fp * FP_MUL + digest) & FP_MASK
FP_MASK = (1 << 62) - 1        # 62 bits: the negation fits an int64
REPORT_WAIT_S = 10.0           # the longest a failing rank waits for the others' reports


class DistributedError(RuntimeError):
    """The ranks are no longer in step (a rank failed, timed out, or ran something else): the
    engine stops. Restart from the last checkpoint."""


class DivergenceError(DistributedError):
    """The ranks ran different collectives, graphs or plans."""


class EngineStoppedError(DistributedError):
    """The engine was called after it stopped (see its __cause__)."""


class CollectiveCallError(DistributedError):
    """A collective engine method (save_checkpoint, save_pretrained, full_state_dict, ...) was
    called on some ranks only, or the ranks called different ones ([Note: collective calls])."""


class UsageError(RuntimeError):
    """The training loop called the engine out of order (nothing was run)."""


class NonFiniteError(FloatingPointError):
    """A loss or a gradient was inf/NaN on some rank (Config.on_nonfinite="raise"); raised on
    every rank, the optimizer step not taken."""


_COMM_ERROR = re.compile(r"timed out|timeout|connection (closed|reset|refused)|broken pipe|nccl|"
                         r"gloo|pair\.cc|unbound_buffer|processgroup|socket|peer", re.IGNORECASE)


def is_comm_error(exc: BaseException) -> bool:
    """A collective (or the transport under it) failed: a timeout, a dead peer."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM_ERROR.search(str(exc)))


def digest(text: str) -> int:
    """A stable 62-bit digest (the same in every process: never Python's salted `hash`)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & FP_MASK


def brief(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    if len(line) > limit:
        line = line[:limit] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


class Trace:
    """What this rank ran since the last optimizer step: the fingerprint of its graph calls and
    the calls themselves (their lowered graphs: `graph_key`, `digest`, `describe`)."""

    __slots__ = ("fp", "calls")

    def __init__(self) -> None:
        self.fp = 0
        self.calls: list = []


def _where(w: dict) -> str:
    graph = f", graph {w['graph']}" if w.get("graph") else ""
    return f"step {w['step']} (micro-step {w['micro']}, {w['phase']}{graph})"


class Guardrails:
    """One engine's failure handling and cross-rank checks (see the Notes above)."""

    def __init__(self, comm, config) -> None:
        self.comm = comm
        self.config = config
        self.rank, self.world = comm.rank, comm.world
        self.active = comm.world > 1
        self.trace = Trace()
        self.window: list[tuple[int, int, int, list]] = []   # per step since the last check
        self.stopped: BaseException | None = None
        self.failed_graph: str | None = None    # the graph an exception escaped from
        self.timeout_s: float | None = None
        self.steady = False
        self._graphs = 0                        # new graphs agreed so far
        self.checks = 0
        self.calls = 0                          # collective calls entered ([Note: collective calls])
        self.forwards = 0                       # training forwards started (the same)
        self.store = None
        self.check_group = None
        self.structure_group = None   # [Note: structures are agreed at each call]
        self.eager_group = None
        self.held_anywhere = False   # some rank holds eager gradients (the last `end_step`)
        self._eager_seq = 0          # eager gathers agreed in this step
        self._at = (0, 0)            # the step and micro-steps of the last `end_step`
        seq = next(_ENGINES)
        if not self.active:
            return
        self.store = dist.PrefixStore(f"deepcompile/{comm.group_name}/{seq}/",
                                      _compat.default_store())
        # every rank's progress exists before any rank can read it: the engine's first
        # collective (the weights' broadcast) comes after this on every rank
        self._post((0, 0, 0))
        weakref.finalize(self, _gone, self.store, self.rank)
        # the check's group (also where the ranks agree a re-plan, checks or not: [Note: agreed
        # re-planning] in compiler/drift.py)
        group = comm.group if comm.group is not None else dist.group.WORLD
        self.check_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo",
                                          use_local_synchronization=True)
        self.own_timeout = own_timeout(comm.user_group)
        if config.zero_stage == 3:   # [Note: eager gathers are agreed] in runtime/eager.py
            self.eager_group = dist.new_group(dist.get_process_group_ranks(group),
                                              backend="gloo", use_local_synchronization=True)
        self.set_timeout(config.startup_timeout_s)

    # -- timeouts -------------------------------------------------------------------------------
    def set_timeout(self, seconds: float | None) -> None:
        """The process group's (and the check group's) collective timeout, and the store waits':
        `seconds` (a Config timeout; None: the process group's own), never longer than a timeout
        the user gave the process group ([Note: the user's timeout])."""
        if not self.active:
            return
        own, given = self.own_timeout
        if own is None:       # a backend that does not say (neither gloo nor NCCL)
            if seconds is None:
                self.timeout_s = None
                return
        else:
            seconds = own if seconds is None else min(seconds, own) if given else seconds
        self.timeout_s = seconds
        _compat.set_pg_timeout(self.comm.group, seconds)
        for group in (self.check_group, self.structure_group, self.eager_group):
            if group is not None:
                _compat.set_pg_timeout(group, seconds)

    def enter_steady(self) -> None:
        """After the first steady optimizer step (the final compiles are done)."""
        if not self.steady:
            self.steady = True
            self.set_timeout(self.config.collective_timeout_s)

    def _wait_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return _store_timeout(self.store)

    # -- reports --------------------------------------------------------------------------------
    def report(self, kind: str, where: dict, error: str) -> None:
        """Post what happened on this rank (see [Note: failures across ranks])."""
        if self.store is None:
            return
        calls = self.trace.calls
        rec = {"rank": self.rank, "kind": kind, **where, "error": error, "time": time.time(),
               "calls": len(calls), "last_graph": getattr(calls[-1], "graph_key", None)
               if calls else None}
        try:
            self.store.set(f"report/{self.rank}", json.dumps(rec))
        except Exception as e:  # noqa: BLE001 -- the store may be gone with rank 0
            log.warning("deepcompile: could not post this rank's failure report: %s", brief(e))

    def collect(self, wait_s: float | None = None) -> tuple[dict[int, dict], list[int], str | None]:
        """The other ranks' reports, waiting up to `wait_s` for the missing ones; (reports,
        ranks without one, why the store could not be read)."""
        wait_s = min(REPORT_WAIT_S, self._wait_s()) if wait_s is None else wait_s
        deadline = time.monotonic() + wait_s
        missing = [r for r in range(self.world) if r != self.rank]
        got: dict[int, dict] = {}
        try:
            while True:
                for r in list(missing):
                    key = f"report/{r}"
                    if self.store.check([key]):
                        got[r] = json.loads(self.store.get(key))
                        missing.remove(r)
                if not missing or time.monotonic() >= deadline:
                    return got, missing, None
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001
            return got, missing, brief(e)

    def _others(self, wait_s: float | None = None) -> list[str]:
        got, missing, store_error = self.collect(wait_s)
        lines = [f"  rank {r}: {_describe(rep)}" for r, rep in sorted(got.items())]
        waited = min(REPORT_WAIT_S, self._wait_s()) if wait_s is None else wait_s
        lines += [f"  rank {r}: nothing reported within {waited:.0f} s: it exited (killed or "
                  "crashed), or is blocked outside deepcompile" for r in missing
                  if store_error is None]
        if store_error is not None:
            lines.append(f"  (the other ranks' reports could not be read: {store_error}; the "
                         "store lives with rank 0's process, which probably exited)")
        return lines

    def _closing(self) -> str:
        t = self.timeout_s
        bound = f"{t:g} s" if t is not None else "the process group's timeout"
        return ("The ranks are no longer in step, so this engine stops here (every later call "
                "raises). Restart from the last checkpoint. A rank waits at most "
                f"{bound} for the others (Config.collective_timeout_s, "
                "Config.startup_timeout_s, or a shorter timeout given to the process group).")

    # -- exceptions escaping the engine ------------------------------------------------------------
    def on_exception(self, exc: BaseException, phase: str, step: int, micro: int) -> BaseException:
        """An exception escaped the engine's `phase` on this rank; returns what to raise."""
        graph, self.failed_graph = self.failed_graph, None
        if not self.active or isinstance(exc, NonFiniteError):
            return exc
        if isinstance(exc, UsageError):   # nothing ran: the engine goes on, the others are told
            self.report("usage", {"phase": phase, "step": step, "micro": micro, "graph": None},
                        brief(exc))
            return exc
        inner = _distributed_cause(exc)   # Dynamo wraps what the backend raised
        if inner is not None:
            self.stopped = inner
            return inner
        where = {"phase": phase, "step": step, "micro": micro, "graph": graph}
        if is_comm_error(exc):
            self.report("comm", where, brief(exc))
            err = DistributedError("\n".join(
                [f"deepcompile: rank {self.rank} stopped at {_where(where)}: a collective "
                 f"failed: {brief(exc)}", "What the other ranks reported:", *self._others(),
                 self._closing()]))
            err.__cause__ = exc
            self.stopped = err
            return err
        self.report("raised", where, brief(exc))
        exc.add_note(f"deepcompile: raised on rank {self.rank} at {_where(where)}; this rank's "
                     "engine stops (its collectives no longer match the other ranks'), and the "
                     "other ranks stop with a DistributedError naming this rank.")
        self.stopped = exc
        return exc

    def stopped_error(self) -> EngineStoppedError:
        err = EngineStoppedError(
            f"deepcompile: this engine stopped after {brief(self.stopped)} on rank {self.rank}; "
            "its collectives no longer match the other ranks'. Restart from the last checkpoint.")
        err.__cause__ = self.stopped
        return err

    # -- new graphs -----------------------------------------------------------------------------
    def agree_graph(self, description: str, where: dict) -> None:
        """[Note: new graphs are agreed] Every rank compiles this graph as its next new graph."""
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
            absent = [r for r in range(self.world) if not _safe_check(self.store, f"{key}/at/{r}")]
            raise self._graph_failure(
                where, description, f"ranks {absent} did not compile it within "
                f"{self._wait_s():g} s") from e
        if int(self.store.add(f"{key}/bad", 0)):
            first = self.store.get(key).decode()
            lines = [f"  {first}   <- the first rank to arrive"]
            for r in range(self.world):
                if _safe_check(self.store, f"{key}/bad/{r}"):
                    lines.append(f"  rank {r}: {self.store.get(f'{key}/bad/{r}').decode()}")
            err = DivergenceError(
                f"deepcompile: the ranks compiled different graphs as their new graph #{index} "
                f"(this rank {self.rank} at {_where(where)}: {mine}):\n" + "\n".join(lines) +
                "\nEvery rank must run the same code with the same parameters (a branch taken on "
                "some ranks only, an evaluation run on some ranks only?).")
            self.stopped = err
            raise err

    def _graph_failure(self, where: dict, description: str, why: str) -> DistributedError:
        self.report("new_graph", where, f"waits at the agreement on its new graph "
                    f"{where.get('graph')} ({description}): {why}")
        err = DistributedError("\n".join(
            [f"deepcompile: rank {self.rank} compiled a new graph {where.get('graph')} at "
             f"{_where(where)} ({description}) and the other ranks did not: {why}. A graph that "
             "runs on some ranks only issues collectives the others never issue (a branch taken "
             "on some ranks only? an evaluation run on some ranks only?).",
             "What the other ranks reported:", *self._others(), self._closing()]))
        self.stopped = err
        return err

    # -- structures ------------------------------------------------------------------------------
    def open_structure_checks(self) -> None:
        """[Note: structures are agreed at each call] Open the checks' group, once (every rank
        calls this at the same point: the agreement on a second structure)."""
        if not self.active or self.structure_group is not None:
            return
        group = self.comm.group if self.comm.group is not None else dist.group.WORLD
        self.structure_group = dist.new_group(dist.get_process_group_ranks(group),
                                              backend="gloo", use_local_synchronization=True)
        if self.timeout_s is not None:
            _compat.set_pg_timeout(self.structure_group, self.timeout_s)

    def agree_structure(self, graph: str, structure: int, step: int, micro: int) -> None:
        """[Note: structures are agreed at each call] Every rank calls a graph of this structure
        now, or every rank raises the same DivergenceError."""
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

    # -- collective calls ([Note: collective calls]) ----------------------------------------------
    def _post(self, pos: tuple[int, int, int]) -> None:
        """How far this rank has got: its training forwards and collective calls so far, and
        where the last forward was (for the messages)."""
        self.store.set(f"pos/{self.rank}", "%d %d %d %d %d" % (self.forwards, self.calls, *pos))

    def at_forward(self, step: int, micro: int, forwards: int) -> None:
        """A training forward starts at this position: post it; at the first forward of an
        accumulation window, fail if another rank entered a collective call that this rank
        went past."""
        if self.store is None:
            return
        pos = (step, micro, forwards)
        self.forwards += 1
        self._post(pos)
        if micro or forwards:
            return
        key = f"call/{self.calls}"
        if not self.store.check([key]):
            return
        method, done, *first, by = self.store.get(key).decode().split()
        if self.forwards <= int(done):
            return   # this forward comes before that call in the loop: not skipped
        where = {"phase": "forward", "step": step, "micro": micro, "graph": None}
        what = (f"rank(s) {self._callers(key) or [int(by)]} called it at "
                f"{_point(*map(int, first))}, and this rank did not: it went on to a training "
                f"forward at {_point(*pos)}")
        raise self._call_failure(where, method, what, f"skipped engine.{method}(): {what}")

    def enter_collective(self, method: str, step: int, micro: int, forwards: int) -> None:
        """Before the collective method `method` communicates: every rank is in it, or this
        rank raises CollectiveCallError ([Note: collective calls])."""
        if self.store is None:
            return
        pos = (step, micro, forwards)
        k, self.calls = self.calls, self.calls + 1
        key = f"call/{k}"
        mine = "%s %d %d %d %d %d" % (method, self.forwards, *pos, self.rank)
        where = {"phase": method, "step": step, "micro": micro, "graph": None}
        first = self.store.compare_set(key, "", mine).decode().split()
        if first[0] != method:
            self.store.set(f"{key}/bad", f"{self.rank} {method}")
            raise self._mismatch(where, pos, method, first[0], [int(first[-1])])
        self.store.set(f"{key}/at/{self.rank}", mine)
        if self.store.add(f"{key}/n", 1) == self.world:
            self.store.set(f"{key}/done", "1")
            return
        wait_s = self._wait_s()
        deadline = time.monotonic() + wait_s
        delay = 0.001
        while not self.store.check([f"{key}/done"]):
            if self.store.check([f"{key}/bad"]):
                rank, other = self.store.get(f"{key}/bad").decode().split()
                raise self._mismatch(where, pos, method, other, [int(rank)])
            skipped = self._skipped(key, k)
            if skipped or time.monotonic() >= deadline:
                absent = [r for r in range(self.world)
                          if not _safe_check(self.store, f"{key}/at/{r}")]
                why = "; ".join(skipped) if skipped else (
                    f"not within {wait_s:g} s (Config.collective_timeout_s)")
                what = f"this rank called it at {_point(*pos)}, and rank(s) {absent} did not: {why}"
                raise self._call_failure(where, method, what, f"called engine.{method}() at "
                                         f"{_point(*pos)}; rank(s) {absent} did not: {why}")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _mismatch(self, where: dict, pos: tuple[int, int, int], method: str, other: str,
                  ranks: list[int]) -> CollectiveCallError:
        what = (f"this rank called it at {_point(*pos)} as its collective call "
                f"#{self.calls - 1}, and rank(s) {ranks} called engine.{other}() there")
        return self._call_failure(where, method, what, f"called engine.{method}() where rank(s) "
                                  f"{ranks} called engine.{other}()")

    def _skipped(self, key: str, k: int) -> list[str]:
        """The ranks that ran more training forwards than this one before call `k` without
        entering it (or released their engine), as sentences; one read of every rank's
        progress. What a rank posted is never ahead of it: an old post cannot accuse it."""
        others = [r for r in range(self.world) if r != self.rank]
        got = self.store.multi_get([f"pos/{r}" for r in others])
        out = []
        for r, raw in zip(others, got):
            text = raw.decode()
            if text == "gone":
                why = f"rank {r} released its engine (or exited)"
            else:
                forwards, calls, *where = map(int, text.split())
                if calls > k or forwards <= self.forwards:
                    continue
                why = f"rank {r} went on to a training forward at {_point(*where)}"
            if not _safe_check(self.store, f"{key}/at/{r}"):
                out.append(why)
        return out

    def _callers(self, key: str) -> list[int]:
        return [r for r in range(self.world) if _safe_check(self.store, f"{key}/at/{r}")]

    def _call_failure(self, where: dict, method: str, what: str,
                      report: str) -> CollectiveCallError:
        self.report("collective", where, report)
        err = CollectiveCallError(
            f"deepcompile: engine.{method}() on rank {self.rank}: {what}. engine.{method}() is "
            "a collective call: call it on every rank, at the same point of the training loop "
            "(not under `if rank == 0:`; where it writes files, rank 0 alone writes). "
            + self._closing())
        self.stopped = err
        return err

    # -- the divergence check ---------------------------------------------------------------------
    def end_step(self, step: int, micro: int, request: bool | None = None,
                 held: bool = False) -> bool:
        """[Note: divergence check] First thing at an optimizer-step boundary, on every rank.

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
                [f"deepcompile: rank {self.rank} ended {_where(where)} after {micro} "
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


def _distributed_cause(exc: BaseException) -> DistributedError | None:
    """`exc`, or the DistributedError it wraps (Dynamo's BackendCompilerFailed around an
    agreement that failed while a graph compiled)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, DistributedError):
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__
        seen += 1
    return None


def _describe(rep: dict) -> str:
    kind, where = rep.get("kind"), _where(rep)
    if kind == "raised":
        return f"raised {rep['error']} at {where}"
    if kind == "comm":
        return f"a collective failed at {where}: {rep['error']}"
    if kind == "usage":
        return f"{rep['error']} (at {where})"
    if kind == "check":
        return f"at the end of {where}: {rep['error']}"
    if kind in ("new_graph", "collective"):
        return f"at {where}: {rep['error']}"
    return f"{kind} at {where}: {rep.get('error')}"


def _point(step: int, micro: int, forwards: int) -> str:
    """A position of the training loop ([Note: collective calls]), in words."""
    if micro == 0 and forwards == 0:
        return f"the start of step {step}"
    return (f"step {step}, micro-step {micro}" +
            (f" (after {forwards} training forward{'s' * (forwards > 1)})" if forwards else ""))


def _gone(store, rank: int) -> None:
    """This rank's engine is released (or the process exits): a rank waiting at a collective
    call for it fails at once ([Note: collective calls])."""
    try:
        store.set(f"pos/{rank}", "gone")
    except Exception:  # noqa: BLE001 -- the store may be gone with rank 0
        pass


def _safe_check(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


# [Note: the user's timeout] A timeout the user gave the process group (init_process_group's or
# new_group's `timeout`, anything but torch's default for the backend) bounds every wait of the
# engine: each phase's timeout is Config's or the user's, whichever is shorter; a Config timeout
# of None means the process group's own. The groups the engine makes for itself (the check
# group; on gloo the serial copy its collectives run on) start with torch's default and are set
# to the same timeout. The group's timeout is read the first time an engine is made on it and
# remembered by group object: engines made later in the process (a sweep, a test's scenarios)
# see what the user set, not what an earlier engine set.
_OWN_TIMEOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def own_timeout(group) -> tuple[float | None, bool]:
    """(`group`'s own timeout in seconds, whether the user gave it) before any engine set one;
    (None, False) where the backend does not say."""
    if group not in _OWN_TIMEOUTS:
        read = _compat.pg_timeout(group)
        _OWN_TIMEOUTS[group] = (None, False) if read is None else (read[0], read[0] != read[1])
    return _OWN_TIMEOUTS[group]


def _store_timeout(store) -> float:
    try:
        return store.timeout.total_seconds()
    except Exception:  # noqa: BLE001
        return 300.0
