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

The ranks' other checks are parts of `Guardrails`, each in its module: the divergence check and
the agreements on graphs, structures and eager gathers (runtime/divergence.py), collective
engine methods called on every rank (runtime/collective_calls.py). The errors they raise are
in runtime/errors.py, and importable from here.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import weakref

import torch.distributed as dist

from .. import _compat
from .collective_calls import CollectiveCalls, gone
from .divergence import DivergenceChecks, Trace
from .errors import (CollectiveCallError, DistributedError, DivergenceError, EngineStoppedError,
                     NonFiniteError, UsageError, brief, is_comm_error, place)

__all__ = ["Guardrails", "DistributedError", "DivergenceError", "EngineStoppedError",
           "CollectiveCallError", "UsageError", "NonFiniteError", "is_comm_error"]

log = logging.getLogger("deepcompile")

_ENGINES = itertools.count()   # one store namespace per engine (created in the same order on every rank)
REPORT_WAIT_S = 10.0           # the longest a failing rank waits for the others' reports


class Guardrails(DivergenceChecks, CollectiveCalls):
    """One engine's failure handling and cross-rank checks (see the Notes in this module and in
    the modules of its parts)."""

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
        weakref.finalize(self, gone, self.store, self.rank)
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
                [f"deepcompile: rank {self.rank} stopped at {place(where)}: a collective "
                 f"failed: {brief(exc)}", "What the other ranks reported:", *self._others(),
                 self._closing()]))
            err.__cause__ = exc
            self.stopped = err
            return err
        self.report("raised", where, brief(exc))
        exc.add_note(f"deepcompile: raised on rank {self.rank} at {place(where)}; this rank's "
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
    kind, where = rep.get("kind"), place(rep)
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
