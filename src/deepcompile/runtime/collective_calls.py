"""Collective engine methods are called on every rank: the `CollectiveCalls` part of
`Guardrails` (runtime/guardrails.py makes the state it reads: the store, `calls`, `forwards`).

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
skipped the call), or released its engine (or exited: `gone`). Counts, not step numbers: a
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

import time

from .errors import CollectiveCallError, store_has


class CollectiveCalls:
    """[Note: collective calls], for `Guardrails`."""

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
                          if not store_has(self.store, f"{key}/at/{r}")]
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
            if not store_has(self.store, f"{key}/at/{r}"):
                out.append(why)
        return out

    def _callers(self, key: str) -> list[int]:
        return [r for r in range(self.world) if store_has(self.store, f"{key}/at/{r}")]

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


def _point(step: int, micro: int, forwards: int) -> str:
    """A position of the training loop ([Note: collective calls]), in words."""
    if micro == 0 and forwards == 0:
        return f"the start of step {step}"
    return (f"step {step}, micro-step {micro}" +
            (f" (after {forwards} training forward{'s' * (forwards > 1)})" if forwards else ""))


def gone(store, rank: int) -> None:
    """This rank's engine is released (or the process exits): a rank waiting at a collective
    call for it fails at once ([Note: collective calls])."""
    try:
        store.set(f"pos/{rank}", "gone")
    except Exception:  # noqa: BLE001 -- the store may be gone with rank 0
        pass
