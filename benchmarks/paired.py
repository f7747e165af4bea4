"""Several systems in the same processes, their steady steps alternated: paired step times.

    OMP_NUM_THREADS=1 python benchmarks/paired.py --workload tiny-llama \
        --systems ours-z3-auto ours-z3+overlap ours-z3-all --launches 3 --rounds 20 --out F

On the 2-core VM the same system's median step moves by 20-50% from one launch of
`deepcompile bench` to the next (which cores, what else the VM's host runs), so a 3% difference
between two pass lists cannot be seen in launch medians (issue 14, item 1;
`benchmarks/auto_vs_lists.py` prints the intervals). Here every system of the list is built
in the same ranks, on the same seeded model and data (`deepcompile bench`'s workloads and
trainers), warmed up one after the other until each is steady (ours: passes planned, final
graphs compiled), and then the timed rounds alternate them: in each round every system takes
one optimizer step, in an order rotated from round to round. The order in which the systems
are built rotates from launch to launch, so use a multiple of the number of systems as
`--launches`: in an A/A run (`--systems ours-z3-auto ours-z3-auto#2`, small-llama, 2 launches)
the copy built first was the slower one in both launches (264.8 vs 246.9 ms, 295.2 vs
255.9 ms; cause not found). Whatever slows the machine for a
while slows the systems of a round alike, so the per-round ratio of two systems' steps is
measured against the same conditions. Reported per system against the first one: the median
over all rounds of all launches of the per-round ratio, with a bootstrap 90% interval
(launches resampled, then rounds within each), and each system's median step.

The systems share the processes (their engines must not share state: one runtime per engine,
which this also exercises); DeepSpeed's systems cannot (they change the process: see `main`).
Writes JSON (`--out`: with rank 0's `engine.report()` of each system of ours, taken before the
rounds) and prints markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import timedelta

DRAWS = 10_000


def _rank(rank: int, world: int, args: dict) -> dict:
    import torch
    import torch.distributed as dist

    from deepcompile.tools import workloads
    from deepcompile.tools.bench import systems, trainers

    cuda = args["device"] == "cuda"
    if cuda:   # one GPU a rank, NCCL; a step ends when its kernels have run
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=900))
    w = workloads.get(args["workload"])
    out: dict[str, dict] = {}
    built = []
    for name in args["build_order"]:
        system = systems.get(name.split("#")[0])
        t = trainers.build(system, w, device, world, args["compiler"], None)

        def one_step(t=t, micro=[0]):   # each system its own batch counter: the same data
            start = time.perf_counter()
            for m in range(w.gas):
                ids = workloads.local_batch(w, micro[0] % 64, rank, world).to(device)
                micro[0] += 1
                t.micro(ids, last=m == w.gas - 1)
            t.step()
            if cuda:
                torch.cuda.synchronize(device)
            return time.perf_counter() - start

        warm = 0
        while True:
            one_step()
            warm += 1
            if warm >= args["warmup"] and t.steady():
                break
            if warm >= args["warmup"] + 80:
                raise RuntimeError(f"{name} not steady after {warm} steps")
        out[name] = {"warmup_steps": warm, "step_s": [],
                     "plan": (t.info().get("plan") or {}).get("passes")}
        if rank == 0 and system.kind == "ours":   # what the passes decided, and why
            out[name]["report"] = str(t.engine.report())
        built.append((name, one_step))
    n = len(built)
    for r in range(args["rounds"]):
        for k in range(n):
            name, one_step = built[(r + k) % n]
            out[name]["step_s"].append(one_step())
    dist.destroy_process_group()
    return out


def launch(args: dict, world: int, timeout_s: float) -> list[dict]:
    from deepcompile.tools import spawn

    return spawn.launch(_rank, world, args, timeout_s=timeout_s, cpu=args["device"] == "cpu",
                        env={"TORCHINDUCTOR_CACHE_DIR": args["inductor_cache"]})


def _per_round(ranks: list[dict], name: str) -> list[float]:
    """A system's step per round: the slowest rank's (the ranks wait for each other)."""
    return [max(v) for v in zip(*(r[name]["step_s"] for r in ranks))]


def summarize(launches: list[list[dict]], systems: list[str]) -> dict:
    ref = systems[0]
    steps = {s: [_per_round(L, s) for L in launches] for s in systems}
    rng = random.Random(0)
    rows = []
    for s in systems:
        ratios = [[a / b for a, b in zip(x, y)] for x, y in zip(steps[s], steps[ref])]
        flat = [q for L in ratios for q in L]
        draws = []
        for _ in range(DRAWS):
            sample = []
            for L in rng.choices(ratios, k=len(ratios)):
                sample += rng.choices(L, k=len(L))
            draws.append(statistics.median(sample))
        draws.sort()
        rows.append({"system": s, "step_ms": statistics.median(
                         [t for L in steps[s] for t in L]) * 1e3,
                     "launch_medians_ms": [statistics.median(L) * 1e3 for L in steps[s]],
                     f"ratio_to_{ref}": statistics.median(flat),
                     "interval_90": [draws[int(0.05 * DRAWS)], draws[int(0.95 * DRAWS) - 1]],
                     "plans": [L[0][s]["plan"] for L in launches],
                     "built_first": sum(next(iter(L[0])) == s for L in launches),
                     "warmup_steps": [L[0][s]["warmup_steps"] for L in launches]})
    return {"reference": ref, "rows": rows}


def pool(runs: list[dict], systems: list[str]) -> list[list[dict]]:
    """The launches of several saved runs (`--out` JSON) restricted to `systems`, which every
    run must have measured (`--pool`: more launches for a narrower interval, e.g. runs of
    one workload at commits that do not change its plans; the plans are in the JSON)."""
    out = []
    for run in runs:
        for L in run["launches"]:
            missing = [s for s in systems if s not in L[0]]
            if missing:
                raise ValueError(f"a run ({run['meta'].get('command')}) did not measure "
                                 f"{', '.join(missing)}")
            out.append([{s: r[s] for s in systems} for r in L])
    return out


def _print(s: dict, title: str) -> None:
    ref = s["reference"]
    print(f"{title}\n")
    print(f"| system | step ms (median) | launch medians ms | step / {ref}'s, per round "
          "(median) | 90% interval |")
    print("|---|---|---|---|---|")
    for r in s["rows"]:
        lo, hi = r["interval_90"]
        print(f"| {r['system']} | {r['step_ms']:.1f} | "
              f"{', '.join(f'{x:.1f}' for x in r['launch_medians_ms'])} | "
              f"{r[f'ratio_to_{ref}']:.3f} | [{lo:.3f}, {hi:.3f}] |")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload")
    ap.add_argument("--pool", nargs="+", metavar="JSON",
                    help="no run: summarize the launches of these saved runs together, for "
                         "--systems (which each of them measured)")
    ap.add_argument("--systems", nargs="+", required=True,
                    help="the first is the reference of the ratios; NAME#2 is a second copy "
                         "of NAME (an A/A check of the method)")
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo ranks of one thread each; cuda: one GPU a rank, NCCL")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out")
    return ap


def main() -> None:
    ap = parser()
    a = ap.parse_args()
    if a.pool:
        runs = [json.load(open(f)) for f in a.pool]
        launches = pool(runs, a.systems)
        _print(summarize(launches, a.systems),
               f"{len(launches)} launches pooled from {len(runs)} runs "
               f"(commits {', '.join(str(r['meta'].get('commit')) for r in runs)})")
        return
    if not a.workload:
        ap.error("--workload is required (unless --pool)")
    import torch

    from deepcompile.tools.bench import systems

    deepspeed = [n for n in a.systems if systems.get(n.split("#")[0]).kind == "deepspeed"]
    if deepspeed and len(a.systems) > 1:
        # seen: ours recompiled its graphs after DeepSpeed's engine was built beside it, and
        # the new graphs differed (its plan could not apply: the engine stopped, as it should)
        ap.error(f"{', '.join(deepspeed)} cannot share processes with other systems: DeepSpeed's "
                 "ZeRO-3 replaces torch.nn.functional.linear for the whole process ('This will "
                 "persist unless manually reset'), so the others would trace its linear")

    cache = tempfile.mkdtemp(prefix="paired-inductor-")
    args = {"workload": a.workload, "systems": a.systems, "rounds": a.rounds,
            "warmup": a.warmup, "compiler": a.compiler, "inductor_cache": cache,
            "device": a.device}
    launches = []
    for i in range(a.launches):
        t0 = time.perf_counter()
        k = i % len(a.systems)   # the engine built first ran slower in an A/A run: rotate
        args["build_order"] = a.systems[k:] + a.systems[:k]
        launches.append(launch(args, a.nproc, a.timeout))
        print(f"[paired] launch {i + 1}/{a.launches}: {time.perf_counter() - t0:.0f} s, load "
              f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    s = summarize(launches, a.systems)
    ranks = "gloo ranks" if a.device == "cpu" else "GPUs (NCCL)"
    _print(s, f"{a.workload}, {a.nproc} {ranks}, {a.launches} launches x {a.rounds} rounds "
              f"(every system one optimizer step per round, order rotated)")
    if a.out:
        from deepcompile.tools.bench.run import _git_commit

        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join(["python"] + sys.argv), "commit": _git_commit(),
                "torch": torch.__version__,
                "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
                "python": platform.python_version()}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "summary": s, "launches": launches}, f, indent=1)


if __name__ == "__main__":
    main()
