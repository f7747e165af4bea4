"""The latency distribution of small gloo collectives on this machine (issue 15, stop 36).

    python benchmarks/validation/gloo_latency.py --world 2 --calls 200 [--pin] \
        [--sched normal|batch] [--out DIR]

`world` ranks (gloo, 127.0.0.1, one thread each) run, `calls` times each: a barrier, then one
timed collective: an all-reduce of 9 floats (the size of the engine's step checks) and the
lowered graphs' all-gather (`_c10d_functional`, launched and waited at once) of 64 KiB. Prints
and writes (JSON) each rank's quantiles and mean per kind. `--pin`: rank r runs on core
r mod cores only (all its threads). `--sched`: the ranks' scheduling policy, set before gloo
starts its threads (`deepcompile.tools.cpu_sched`; "normal" is Linux's default, "batch" what
the bench's and the planner's CPU ranks run under). Each call also records, per thread of the
rank, the CPU time it ran and the time it waited on the run queue (/proc schedstat), and the
output compares the slow calls (over 2 ms) with the others: what [Note: gloo's spinning loop]
is based on.

Why: on the 2-core VM of stops 31-36 a step's time at 2 ranks varied more than its parts
explain, and one step's timeline had a tiny all-reduce of the step take 2.35 ms and an
all-gather of 427 KB 3.5 ms, against 0.25 ms and ~1 ms otherwise. The median of a
collective hides such stalls; the mean (what a step adds up) does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

QUANTILES = (0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


def _by_name(before, after) -> dict[str, tuple[float, float]]:
    """ms run and ms waited per thread name between two `cpu_sched.threads()` readings."""
    from deepcompile.tools import cpu_sched

    return {k: (run * 1e3, wait * 1e3)
            for k, (run, wait) in cpu_sched.threads_between(before, after).items()}


def _rank(rank: int, world: int, port: int, calls: int, pin: bool, sched: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DEEPCOMPILE_CPU_SCHED=sched)
    torch.set_num_threads(1)
    if pin:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch.distributed as dist

    from deepcompile.tools import cpu_sched

    cpu_sched.apply()

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from deepcompile import _compat

    ag, _, wait = _compat.funcol_ops()
    name = _compat.group_name(dist.group.WORLD)
    vec = torch.zeros(9)
    shard = torch.zeros((1 << 14) // world)
    kinds = {"all_reduce 36 B": lambda: dist.all_reduce(vec),
             "all_gather 64 KiB": lambda: wait(ag(shard, world, name))}
    out = {}
    with _compat.below_autograd():
        for kind, fn in kinds.items():
            fn()
            ts, threads = [], []
            for _ in range(calls):
                dist.barrier()
                before = cpu_sched.threads()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
                threads.append(_by_name(before, cpu_sched.threads()))
            slow = [th for t, th in zip(ts, threads) if t > 2e-3]
            fast = [th for t, th in zip(ts, threads) if t <= 2e-3]
            ts.sort()
            out[kind] = {"quantiles_ms": {str(q): round(ts[round(q * (len(ts) - 1))] * 1e3, 3)
                                          for q in QUANTILES},
                         "mean_ms": round(statistics.fmean(ts) * 1e3, 3),
                         "over_2ms": sum(t > 2e-3 for t in ts) / len(ts),
                         "threads_ms": {"slow": _mean_threads(slow), "other": _mean_threads(fast)}}
    queue.put((rank, out))
    dist.destroy_process_group()


def _mean_threads(calls: list[dict]) -> dict[str, dict[str, float]]:
    """Per thread name, the mean ms run and waited over `calls` (empty: none)."""
    names = sorted({n for c in calls for n in c})
    return {n: {"run": round(statistics.fmean(c.get(n, (0, 0))[0] for c in calls), 3),
                "wait": round(statistics.fmean(c.get(n, (0, 0))[1] for c in calls), 3)}
            for n in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--pin", action="store_true")
    ap.add_argument("--sched", choices=("normal", "batch"), default="normal")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args.calls, args.pin, args.sched,
                                                queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    ranks = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    for r in sorted(ranks):
        for kind, d in ranks[r].items():
            print(f"rank {r} {kind}: quantiles {list(d['quantiles_ms'].values())} ms "
                  f"(at {list(QUANTILES)}), mean {d['mean_ms']} ms, over 2 ms: "
                  f"{d['over_2ms']:.0%}")
            for part, th in d["threads_ms"].items():
                print(f"    {part} calls, per thread ms run/waited: " + ", ".join(
                    f"{n} {v['run']:.2f}/{v['wait']:.2f}" for n, v in th.items()))
    out = Path(args.out or f"benchmarks/results/{time.strftime('%Y-%m-%d')}-cpu"
               f"{os.cpu_count()}-gloo-latency")
    out.mkdir(parents=True, exist_ok=True)
    path = out / (f"gloo_latency_w{args.world}{'_pin' if args.pin else ''}"
                  f"{'_batch' if args.sched == 'batch' else ''}.json")
    path.write_text(json.dumps({
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "machine": {"node": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "kernel": platform.release()},
        "sched": args.sched, "load": os.getloadavg(), "ranks": ranks}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
