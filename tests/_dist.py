"""Run a function on N ranks as separate processes (gloo on CPU) and collect what each returns.

    results = run_distributed(fn, world_size, *args, timeout=600)

`fn(rank, world_size, *args)` must be a picklable top-level function (it is imported by name
in each child).  Each child is forked from a fork server started once per test session with
torch, transformers and deepcompile already imported (`_context`), and:
  * gets the tools' rank environment (deepcompile.tools.spawn.rank_env: MASTER_ADDR /
    MASTER_PORT (a free port) / RANK / WORLD_SIZE / LOCAL_RANK, OMP_NUM_THREADS=1, ...),
    torch.set_num_threads(1) and a private TORCHINDUCTOR_CACHE_DIR under
    <repo>/build/inductor-cache;
  * runs SCHED_BATCH (deepcompile.tools.cpu_sched, as the bench's ranks: gloo's device
    thread otherwise spins for a scheduler tick in some collectives on a machine with no core
    to spare), calls dist.init_process_group("gloo") itself, runs fn, and destroys the group;
  * sends its result back as bytes written by torch.save (CPU tensors, floats, dicts, ...).

The parent returns [result of rank 0, ..., rank N-1].  An exception in any child is re-raised
in the parent as `DistributedTestError` with every failing rank's traceback.  A hard timeout
terminates (then kills) every child and fails -- it never hangs.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import shutil
import signal
import tempfile
import os
import queue as queue_mod
import time
import traceback
from datetime import timedelta
from pathlib import Path

from deepcompile.tools import cpu_sched, spawn

REPO_ROOT = Path(__file__).resolve().parents[1]
INDUCTOR_CACHE = REPO_ROOT / "build" / "inductor-cache"

# After the first failure, wait this long for the other ranks to report theirs (they are
# usually stuck in a collective with the failed rank) before terminating everything.
_GRACE_S = 5.0


class DistributedTestError(AssertionError):
    """A rank raised, died, or the job ran past its timeout."""


# what every rank's process has in its environment before it imports torch (the tools' CPU
# ranks', with the suite's Inductor cache)
_COMMON_ENV = {**spawn.base_env(cpu=True), "TORCHINDUCTOR_CACHE_DIR": str(INDUCTOR_CACHE)}
# imported once by the fork server, so that a rank starts without importing them: torch, Dynamo,
# AOTAutograd, Inductor, transformers' models, deepcompile, the test helpers (~3.7 s of CPU per
# rank on the 2-core machine, and ~1.4 s more, under cProfile, first imported when a graph
# compiles); last, `_warmup` compiles once so that no rank pays a process's first compile
# ([Note: a warm fork server] in tests/_warmup.py)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd",
            "torch._functorch.partitioners", "torch._inductor.compile_fx", "networkx",
            "transformers", "transformers.models.llama.modeling_llama",
            "transformers.models.mixtral.modeling_mixtral",
            "deepcompile", "deepcompile.engine", "deepcompile.passes", "deepcompile.report",
            "deepcompile.compiler.pipeline", "deepcompile.runtime.runtime", "_models", "_train",
            "_warmup"]


def child_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {**spawn.rank_env(rank, world_size, port, cpu=True), **_COMMON_ENV}


def _free_port() -> int:
    """A free port for a job's rendezvous. Under pytest-xdist each worker takes its ports in
    turn from a range of its own below the kernel's ephemeral ports (32768-60999), so that a
    port one worker found free is not taken by the other worker's job before its ranks bind it."""
    import itertools
    import socket

    global _PORTS
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return spawn.free_port()
    if _PORTS is None:
        lo = 20000 + 1000 * (int(worker[2:]) % 12)
        _PORTS = itertools.cycle(range(lo, lo + 1000))
    for port in itertools.islice(_PORTS, 1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return spawn.free_port()


_PORTS = None   # this xdist worker's ports, in turn
_CTX = None
LAYERS = ("unit", "engine", "tools", "distributed", "gpu")   # tests/<layer>/, in the order they run


def _context():
    """Ranks are forked from one server process per test session that has already imported
    torch and the helpers ("forkserver"): the same fresh state as a spawned process (nothing
    compiled, no process group, no threads started), without paying the imports per rank. The
    server is started with `_COMMON_ENV` in its environment (read when torch is imported) and
    tests/ on its PYTHONPATH (Python 3.11's fork server ignores the parent's sys.path); the
    rank's own variables are set by `_child`."""
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        saved = dict(os.environ)
        try:
            os.environ.update(_COMMON_ENV)
            here = Path(__file__).resolve().parent   # the helpers, and each layer's tests
            layers = [str(p) for p in sorted(here.iterdir()) if p.is_dir() and p.name in LAYERS]
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(here), *layers] + [p for p in saved.get("PYTHONPATH", "").split(os.pathsep) if p])
            from multiprocessing import forkserver
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _CTX = ctx
    return _CTX


def _child(fn, rank: int, world_size: int, port: int, args: tuple, results, pg_timeout_s: float,
           fault_log: str):
    # a rank killed by a signal (SIGABRT from a C++ check in gloo, SIGSEGV) reports nothing
    # through the queue: Python's stacks at that moment go to `fault_log`, which the parent
    # attaches to the error
    faulthandler.enable(open(fault_log, "w"), all_threads=True)
    os.environ.update(child_env(rank, world_size, port))
    payload: tuple
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        cpu_sched.apply()  # before gloo starts its threads: [Note: gloo's spinning loop]
        dist.init_process_group("gloo", timeout=timedelta(seconds=pg_timeout_s))
        try:
            out = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(out, buf)
        payload = (rank, "ok", buf.getvalue())
    except BaseException:  # noqa: BLE001 -- everything goes back to the parent
        payload = (rank, "error", f"rank {rank}:\n{traceback.format_exc()}")
    results.put(payload)
    results.close()
    results.join_thread()


def _died(rank: int, code: int | None, fault_log: str) -> str:
    """What is known of a rank that exited without a result: its exit code or signal, and the
    Python stacks faulthandler wrote when a signal killed it."""
    how = f"exited with code {code}"
    if code is not None and code < 0:
        try:
            how += f" ({signal.Signals(-code).name})"
        except ValueError:
            pass
    try:
        with open(fault_log) as f:
            stacks = f.read().strip()
    except OSError:
        stacks = ""
    tail = "\n".join(stacks.splitlines()[-60:])
    return (f"rank {rank}: {how} without reporting a result"
            + (f"; its Python stacks when it died:\n{tail}" if tail else ""))


def run_distributed(fn, world_size: int, *args, timeout: float = 600.0,
                    failures_ok: bool = False, grace: float = _GRACE_S,
                    pg_timeout: float | None = None):
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return the list of results.

    `failures_ok` (fault-injection tests): a rank that raised or died does not fail the job;
    its entry in the returned list is a `DistributedTestError` describing it. `grace`: how long
    the other ranks may take to report once one rank failed. `pg_timeout`: the `timeout` the
    ranks give `init_process_group` (default: `timeout`)."""
    import torch

    INDUCTOR_CACHE.mkdir(parents=True, exist_ok=True)
    ctx = _context()
    results = ctx.Queue()
    port = _free_port()
    logs = tempfile.mkdtemp(prefix="dist-", dir=INDUCTOR_CACHE.parent)
    fault_logs = [os.path.join(logs, f"rank{r}-faults.txt") for r in range(world_size)]
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, results,
                                              pg_timeout or timeout, fault_logs[r]),
                         name=f"rank{r}", daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()

    deadline = time.monotonic() + timeout
    got: dict[int, bytes] = {}
    errors: dict[int, str] = {}
    first_error_at: float | None = None
    timed_out = False

    def record(item) -> None:
        nonlocal first_error_at
        rank, status, data = item
        if status == "ok":
            got[rank] = data
        else:
            errors[rank] = data
            first_error_at = first_error_at or time.monotonic()

    try:
        while len(got) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            if first_error_at is not None and now - first_error_at > grace:
                break
            try:
                record(results.get(timeout=0.5))
                continue
            except queue_mod.Empty:
                pass
            # a child that exited without reporting (segfault, os._exit, killed for memory)
            dead = [r for r, p in enumerate(procs)
                    if r not in got and r not in errors and not p.is_alive()]
            if dead:
                try:  # its message may have arrived just now
                    record(results.get(timeout=1.0))
                    continue
                except queue_mod.Empty:
                    pass
                for r in dead:
                    errors[r] = _died(r, procs[r].exitcode, fault_logs[r])
                first_error_at = first_error_at or time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=0 if (errors or timed_out) else 10)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        shutil.rmtree(logs, ignore_errors=True)

    if failures_ok and errors and not timed_out and len(got) + len(errors) == world_size:
        return [DistributedTestError(errors[r]) if r in errors
                else torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(world_size)]
    if errors or timed_out:
        msg = []
        if timed_out:
            missing = sorted(set(range(world_size)) - set(got) - set(errors))
            msg.append(f"distributed job {getattr(fn, '__name__', fn)} on {world_size} ranks "
                       f"timed out after {timeout:.0f}s; ranks without a result: {missing}")
        for r in sorted(errors):
            msg.append(errors[r])
        raise DistributedTestError("\n".join(msg))

    out = []
    for r in range(world_size):
        out.append(torch.load(io.BytesIO(got[r]), weights_only=False))
    return out

