"""One launch: spawn the ranks of one system on one workload, train, measure, return figures.

Per rank, in order:

1. warm-up steps: at least `warmup`, and for ours until its passes are planned and its final
   graphs compiled (`Trainer.steady`), at most `warmup + MAX_EXTRA_WARMUP`; the first step's
   time (`first_step_s`, compilation included) and the warm-up's excess over steady steps
   (`one_time_s`: compilation, profiling, passes) are kept;
2. `steps` timed steps (never asserted on: the machine's load moves them);
3. one counted step under the profiler: collectives and step allocations (`measure.py`).

The RSS high-water mark is reset between 1 and 2, so `steady_peak_rss` excludes compilation.
The per-step losses of every step come back for the comparison with the eager reference. A rank
that raises reports its traceback; the parent records the failure and goes on with the next
launch. Children write their output to a log file; its tail goes into the failure's reason.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from datetime import timedelta
from typing import Any

from .. import spawn

# ours: profile, measure and judge each pass; every pass is 4 x (1 profiled + 2 x (1 settling +
# 3 timed)) = 36 steps at the default Config, then the final compile (30 was too few for it)
MAX_EXTRA_WARMUP = 60


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    system: str
    workload: str
    nproc: int          # ranks of the distributed systems (the data is cut for this many)
    device: str         # cpu | cuda
    warmup: int
    steps: int
    compiler: str       # ours' compiler
    log_path: str
    inductor_cache: str  # TORCHINDUCTOR_CACHE_DIR of the ranks: shared by the launches
    plan_cache: str      # ours' Config.cache_dir: the first launch plans, the others reuse it
    pg_timeout_s: float = 900.0


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(rank: int, world: int, spec: LaunchSpec) -> dict[str, Any]:
    import torch

    from .. import cpu_sched, workloads
    from . import measure, systems, trainers

    system = systems.get(spec.system)
    w = workloads.get(spec.workload)
    device = torch.device("cuda", rank) if spec.device == "cuda" else torch.device("cpu")
    import transformers  # noqa: F401  (in the baseline: what every system needs anyway)
    base_rss = measure.rss()["rss"]
    t0 = time.perf_counter()
    trainer = trainers.build(system, w, device, world, spec.compiler, spec.plan_cache)
    setup_s = time.perf_counter() - t0
    data_rank = rank  # the compute bound (one process) trains on rank 0's slice
    micro = 0

    cpu_s: list[float] = []   # the main thread's CPU time per step (the machine's share of it)
    batch_s: list[float] = []  # per step, making the micro-steps' token ids (the bench's own work)

    def one_step() -> tuple[float, float]:
        nonlocal micro
        _sync(device)
        c = time.thread_time()
        t = time.perf_counter()
        total = made = 0.0
        for m in range(w.gas):
            t_ids = time.perf_counter()
            ids = workloads.local_batch(w, micro, data_rank, spec.nproc).to(device)
            made += time.perf_counter() - t_ids
            micro += 1
            total += float(trainer.micro(ids, last=m == w.gas - 1))
        trainer.step()
        _sync(device)
        dt = time.perf_counter() - t
        cpu_s.append(time.thread_time() - c)
        batch_s.append(made)
        return dt, total / w.gas

    losses, warm_s, times = [], [], []
    while True:
        dt, loss = one_step()
        warm_s.append(dt)
        losses.append(loss)
        ready = trainer.steady()
        if len(warm_s) >= spec.warmup and ready:
            break
        if len(warm_s) >= spec.warmup + MAX_EXTRA_WARMUP:
            raise RuntimeError(f"{spec.system} not in its steady state after {len(warm_s)} "
                               "warm-up steps")
    warm_rss = measure.rss()
    measure.reset_rss_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steady_start = measure.rss()["rss"]
    cpu_s.clear()
    batch_s.clear()
    # the timed steps' core time, this rank's threads and the machine's ([Note: where a
    # step's core time goes] in cpu_sched.py)
    threads0, machine0, process0 = cpu_sched.threads(), cpu_sched.machine(), cpu_sched.process()
    window = [time.time()]   # when the timed steps ran (benchmarks/validation/speed.py)
    for _ in range(spec.steps):
        dt, loss = one_step()
        times.append(dt)
        losses.append(loss)
    window.append(time.time())
    core_time = {"threads_s": cpu_sched.threads_between(threads0, cpu_sched.threads()),
                 "machine_s": cpu_sched.between(machine0, cpu_sched.machine()),
                 "process": cpu_sched.between(process0, cpu_sched.process())}
    steady_rss = measure.rss()
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    own_before = trainer.own_comm_stats()
    with measure.StepProbe(world, cuda=device.type == "cuda") as probe:
        _, loss = one_step()
    losses.append(loss)
    counted = probe.summary()
    own_after = trainer.own_comm_stats()
    if own_after is not None:  # the system's own counters over the same step, to cross-check
        counted["own_counters"] = {k: {f: v[f] - own_before.get(k, {}).get(f, 0) for f in v}
                                   for k, v in own_after.items()}
    median = statistics.median(times)
    return {
        "rank": rank, "losses": losses, "warmup_steps": len(warm_s), "step_s": times,
        "step_cpu_s": cpu_s[:len(times)], "step_batch_s": batch_s[:len(times)],
        "core_time": core_time, "timed_window": window,
        "first_step_s": warm_s[0], "setup_s": setup_s,
        "one_time_s": max(0.0, sum(warm_s) - len(warm_s) * median),
        "memory": {"base_rss": base_rss, "launch_peak_rss": max(warm_rss["hwm"] or 0,
                                                                steady_rss["hwm"] or 0) or None,
                   "steady_start_rss": steady_start, "steady_peak_rss": steady_rss["hwm"],
                   "cuda_max_allocated": cuda_peak,
                   "optimizer_state": trainer.optimizer_state_bytes()},
        "counted_step": counted,
        "info": {"num_params": trainer.num_params, **trainer.info()},
    }


def _child(rank: int, world: int, spec: LaunchSpec) -> dict[str, Any]:
    """One rank of a launch (`spawn.launch`: CPU ranks under SCHED_BATCH, [Note: gloo's
    spinning loop] in cpu_sched.py)."""
    import torch
    import torch.distributed as dist

    from .. import cpu_sched
    from . import systems

    if not systems.get(spec.system).single_process:
        backend = "nccl" if spec.device == "cuda" else "gloo"
        if spec.device == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=spec.pg_timeout_s))
    try:
        out = _train(rank, world, spec)
        out["cpu_sched"] = cpu_sched.policy()
        return out
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(spec: LaunchSpec, world: int, timeout_s: float) -> list[dict] | str:
    """Run one launch; the ranks' results, or a string saying why it failed."""
    cpu = spec.device == "cpu"
    env = {"TORCHINDUCTOR_CACHE_DIR": spec.inductor_cache}
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    try:
        return spawn.launch(_child, world, spec, timeout_s=timeout_s, cpu=cpu, sched=cpu,
                            env=env, log_path=spec.log_path)
    except spawn.LaunchError as e:
        return _reason(str(e), spec.log_path)


def _reason(error: str, log_path: str) -> str:
    """The last line of the traceback (the exception), plus the log's tail for the JSON."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else error
    try:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
    except OSError:
        tail = ""
    return f"{last}\n--- log tail ---\n{tail}" if tail else last
