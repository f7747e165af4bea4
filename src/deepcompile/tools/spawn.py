"""Start N local ranks, collect what each returns, stop them all.

    results = launch(target, world, *args, timeout_s=600)

`target(rank, world, *args)` is a picklable top-level function; it runs in a spawned process
with the rendezvous variables (`rank_env`) in its environment and sets up its own process group
(gloo or NCCL, with the timeout it wants). What it returns comes back (through `torch.save`, so
tensors are fine), one entry per rank. The first rank that raises, dies or runs past
`timeout_s` stops the launch: every rank is terminated and `LaunchError` says what happened.
The demo, the bench and benchmarks/validation launch with it; tests/_dist.py forks its ranks
from a server of its own and takes their environment from here.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable


class LaunchError(RuntimeError):
    """A rank raised (its traceback is in the message), died, or the launch timed out."""


def free_port() -> int:
    """A TCP port free on this machine now, for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(cpu: bool) -> dict[str, str]:
    """What a rank's process has in its environment before it imports torch: no tokenizer or
    Inductor compile workers competing for the cores, and on the CPU one intra-op thread (the
    ranks share the cores)."""
    env = {"TOKENIZERS_PARALLELISM": "false", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    if cpu:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def rank_env(rank: int, world: int, port: int, cpu: bool = True) -> dict[str, str]:
    """Rank `rank`'s environment: the rendezvous (`init_process_group`'s env:// variables, and
    torchrun's LOCAL_*), plus `base_env`."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            **base_env(cpu)}


def terminate(processes) -> None:
    """Stop every process still alive: terminate, then kill what ignores it."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _rank_main(target: Callable, rank: int, world: int, args: tuple, cpu: bool, sched: bool,
               log_path: str | None, results) -> None:
    if log_path is not None:   # the rank's output goes to its log, not the parent's terminal
        log = open(log_path, "a", buffering=1)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        import torch

        if cpu:
            torch.set_num_threads(1)
        if sched:
            from . import cpu_sched

            cpu_sched.apply()   # before gloo starts its threads: [Note: gloo's spinning loop]
        out = target(rank, world, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        payload = (rank, "ok", buf.getvalue())
    except BaseException:  # noqa: BLE001 -- everything goes back to the parent
        if log_path is not None:
            traceback.print_exc()
        payload = (rank, "error", f"rank {rank}: {traceback.format_exc()}")
    finally:
        sys.stdout.flush()
    results.put(payload)
    results.close()
    results.join_thread()


def launch(target: Callable, world: int, *args: Any, timeout_s: float, cpu: bool = True,
           sched: bool = False, env: dict[str, str] | None = None,
           log_path: str | None = None) -> list[Any]:
    """Run `target(rank, world, *args)` on `world` spawned ranks; their results, by rank.

    `cpu`: CPU ranks (one thread each, `base_env`); `sched`: they run SCHED_BATCH
    (`cpu_sched.apply`, before `target` starts); `env`: more variables for every rank (set in
    this process while the ranks start: a spawned process copies the environment then);
    `log_path`: the ranks' stdout and stderr, appended. Raises `LaunchError`."""
    import multiprocessing as mp

    import torch

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = []
    saved = dict(os.environ)
    try:
        try:
            for r in range(world):
                os.environ.update(rank_env(r, world, port, cpu), **(env or {}))
                p = ctx.Process(target=_rank_main, name=f"rank{r}", daemon=True,
                                args=(target, r, world, args, cpu, sched, log_path, results))
                p.start()
                procs.append(p)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(got))
                raise LaunchError(f"timed out after {timeout_s:.0f} s; ranks without a result: "
                                  f"{missing}")
            try:
                rank, status, data = results.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive()]
                if not dead:
                    continue
                try:   # its result may have arrived just now
                    rank, status, data = results.get(timeout=2.0)
                except queue_mod.Empty:
                    raise LaunchError(f"rank {dead[0]} exited with code "
                                      f"{procs[dead[0]].exitcode} without a result") from None
            if status != "ok":
                raise LaunchError(data)
            got[rank] = data
        for p in procs:
            p.join(timeout=30)
        return [torch.load(io.BytesIO(got[r]), weights_only=False) for r in range(world)]
    finally:
        terminate(procs)
        results.close()
