"""The bench's parent process: which systems run, in what order, and what the launches add up to.

Timing discipline (on a shared machine the same configuration's step time moves by tens of
percent between launches): every system is launched `launches` times in fresh processes,
interleaved round by round (the order of systems rotates every round, so none is always first
after a quiet spell), warm-up steps are excluded, each launch gives the median of its timed steps
(a step's time is the slowest rank's), and a system's figure is the median of its launch medians,
with their min and max. The machine's load average is recorded before and after every launch.

Load-independent figures (collectives, memory, loss difference) come from every launch too;
collective counts must agree between launches and ranks, which the JSON records. `cpu_s` per
launch (the ranks' CPU time, from the kernel) tells what a launch costs on a quiet machine.

[Note: plans in the bench]
Every launch of ours profiles and plans afresh (no shared plan cache), as separate runs of a
user's program do: the launches show whether the same program on the same machine plans the
same way (`plan_same_in_every_launch` in the JSON, from each launch's kept passes and per-graph
collectives; `collectives.same_in_every_launch` from the counted step). Identical plans give
identical final graphs, which hit the Inductor cache (`TORCHINDUCTOR_CACHE_DIR`, default
`build/inductor-cache`, shared with the peers' `torch.compile` and kept between runs: the
JSON says whether it existed at the start); launch 1's one-time figures are reported apart.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ..._proc import kib_field
from . import systems as S
from .. import workloads as W
from .worker import MAX_EXTRA_WARMUP, LaunchSpec, launch


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    matrix: dict[str, tuple[str, ...]]   # workload -> systems (systems.matrix)
    launches: int = 5
    steps: int = 5
    warmup: int = 2
    nproc: int = 2
    device: str = "cpu"
    compiler: str = "inductor"   # ours' compiler (peers that compile use Inductor)
    out: str | None = None
    timeout_s: float = 1200.0
    command: str = ""


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _median_of(values: list[float]) -> dict[str, float] | None:
    return None if not values else {"median": statistics.median(values), "min": min(values),
                                     "max": max(values)}


def plan(args: BenchArgs) -> list[dict[str, Any]]:
    """One entry per (workload, system): runnable, or why not (unavailable / same as another)."""
    entries = []
    for wname, snames in args.matrix.items():
        chosen: list[S.System] = []
        for sname in snames:
            system = S.get(sname)
            reason = S.unavailable(system, args.device, args.compiler)
            status = "unavailable" if reason else "ok"
            if reason is None:
                twin = S.same_as(system, chosen, args.compiler)
                if twin is not None:
                    status, reason = "same", f"same configuration as {twin} in this build"
            if status == "ok":
                chosen.append(system)
            entries.append({"workload": wname, "system": sname, "status": status,
                            "reason": reason, "world": 1 if system.single_process else args.nproc,
                            "description": system.description, "kind": system.kind,
                            "launches": []})
    return entries


def _core_time(ranks: list[dict], step_s: list[float]) -> dict[str, Any] | None:
    """Per timed step, where the cores' time went ([Note: where a step's core time goes] in
    cpu_sched.py): every rank's threads' CPU time and run-queue wait, summed over the ranks
    (per thread name too), and the machine's busy, idle and stolen core time as rank 0 read it
    over its timed steps; None where the ranks did not record it (no /proc)."""
    if not all(r.get("core_time") and r["core_time"]["threads_s"] for r in ranks):
        return None
    n = len(step_s)
    names: dict[str, list[float]] = {}
    for r in ranks:
        for name, (run, wait) in r["core_time"]["threads_s"].items():
            acc = names.setdefault(name, [0.0, 0.0])
            acc[0] += run / n
            acc[1] += wait / n
    machine = ranks[0]["core_time"].get("machine_s")
    out = {"step_s": sum(step_s) / n,
           "ranks_run_s": sum(v[0] for v in names.values()),
           "ranks_wait_s": sum(v[1] for v in names.values()),
           "threads": {k: {"run_s": v[0], "wait_s": v[1]} for k, v in sorted(names.items())},
           "machine": None, "process": None}
    if all(r["core_time"].get("process") for r in ranks):  # the ranks' sum, per step
        out["process"] = {k: sum(r["core_time"]["process"][k] for r in ranks) / n
                          for k in ranks[0]["core_time"]["process"]}
    if machine:
        total = sum(machine.values())
        out["machine"] = {**{f"{k}_s": v / n for k, v in machine.items()},
                          **{f"{k}_share": v / total if total else None
                             for k, v in machine.items()}}
    return out


def _launch_record(ranks: list[dict] | str, wall_s: float, load: list) -> dict[str, Any]:
    if isinstance(ranks, str):
        return {"ok": False, "reason": ranks, "wall_s": wall_s, "load": load}
    nsteps = len(ranks[0]["step_s"])
    step_s = [max(r["step_s"][i] for r in ranks) for i in range(nsteps)]
    losses = [statistics.fmean(r["losses"][i] for r in ranks)
              for i in range(len(ranks[0]["losses"]))]
    counted = [r["counted_step"] for r in ranks]
    keys = ("requested", "transport", "own_counters")
    return {
        "ok": True, "wall_s": wall_s, "load": load,
        "warmup_steps": ranks[0]["warmup_steps"],
        "cpu_sched": ranks[0].get("cpu_sched"),  # the CPU ranks' policy: cpu_sched.py
        "step_s": step_s, "step_s_median": statistics.median(step_s),
        # per step, the ranks' mean time making token ids (the bench's work, not the system's)
        "batch_s_median": statistics.median(
            statistics.fmean(r["step_batch_s"][i] for r in ranks) for i in range(nsteps))
        if all(r.get("step_batch_s") for r in ranks) else None,
        "core_time": _core_time(ranks, step_s),
        # when the ranks' timed steps ran (time.time()): benchmarks/validation/speed.py
        "timed_window": [min(r["timed_window"][0] for r in ranks),
                         max(r["timed_window"][1] for r in ranks)]
        if all(r.get("timed_window") for r in ranks) else None,
        "first_step_s": max(r["first_step_s"] for r in ranks),
        "one_time_s": max(r["one_time_s"] for r in ranks),
        "setup_s": max(r["setup_s"] for r in ranks),
        "losses": losses,
        "collectives": {k: counted[0][k] for k in keys if k in counted[0]},
        "collectives_agree_across_ranks": all({k: c.get(k) for k in keys} ==
                                              {k: counted[0].get(k) for k in keys}
                                              for c in counted),
        "step_alloc_peak_bytes": max(c["step_alloc_peak_bytes"] for c in counted),
        "memory": {k: max((r["memory"][k] or 0) for r in ranks) or None
                   for k in ranks[0]["memory"]},
        "info": ranks[0]["info"],
    }


def _summarize(entry: dict, reference: list[float] | None, bound_ms: float | None,
               tokens: int) -> None:
    ok = [rec for rec in entry["launches"] if rec["ok"]]
    if entry["status"] != "ok":
        return
    if not ok:
        entry["status"] = "failed"
        entry["reason"] = entry["launches"][0]["reason"] if entry["launches"] else "not run"
        return
    medians = [rec["step_s_median"] * 1e3 for rec in ok]
    step_ms = _median_of(medians)
    coll = ok[0]["collectives"]
    transport = coll["transport"]
    mem = {k: statistics.median([rec["memory"][k] or 0 for rec in ok]) or None
           for k in ok[0]["memory"]}
    mem["step_alloc_peak"] = statistics.median(rec["step_alloc_peak_bytes"] for rec in ok)
    diffs = []
    if reference is not None:
        for rec in ok:
            n = min(len(rec["losses"]), len(reference))
            diffs.append(max(abs(a - b) for a, b in zip(rec["losses"][:n], reference[:n])))
    entry.update({
        "failed_launches": len(entry["launches"]) - len(ok),
        "step_ms": step_ms,
        "tokens_per_s": tokens / (step_ms["median"] / 1e3),
        "vs_compute_bound": None if not bound_ms else step_ms["median"] / bound_ms,
        "collectives": {**coll,
                        "count": sum(v["count"] for v in transport.values()),
                        "bytes": sum(v["bytes"] for v in transport.values()),
                        "same_in_every_launch": all(rec["collectives"] == coll for rec in ok) and
                        all(rec["collectives_agree_across_ranks"] for rec in ok)},
        "memory": mem,
        "first_step_s": {"first_launch": ok[0]["first_step_s"],
                         "median": statistics.median(rec["first_step_s"] for rec in ok)},
        "one_time_s": {"first_launch": ok[0]["one_time_s"],
                       "median": statistics.median(rec["one_time_s"] for rec in ok)},
        "cpu_s": statistics.median(rec["cpu_s"] for rec in ok),
        "warmup_steps": ok[0]["warmup_steps"],
        "loss": {"max_abs_diff": max(diffs) if diffs else None,
                 "final": ok[0]["losses"][-1],
                 "reference_final": reference[len(ok[0]["losses"]) - 1] if reference else None},
        "info": ok[0]["info"],
        "plan_same_in_every_launch": all(rec["info"].get("plan") == ok[0]["info"].get("plan")
                                         for rec in ok) if "plan" in ok[0]["info"] else None,
    })


def _hardware(device: str) -> dict[str, Any]:
    hw: dict[str, Any] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        hw["cpu_model"] = names[0] if names else None
    except OSError:
        pass
    total = kib_field("/proc/meminfo", "MemTotal")
    if total is not None:
        hw["memory_gib"] = round(total / 2**30, 1)
    if device == "cuda":
        import torch

        hw["gpu"] = torch.cuda.get_device_name(0)
        hw["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return hw


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    import torch
    from ... import __version__

    out["torch"], out["deepcompile"] = torch.__version__, __version__
    for pkg in ("transformers", "deepspeed"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _git_commit() -> str | None:
    import subprocess

    try:
        here = Path(__file__).resolve().parent
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                           capture_output=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, text=True, capture_output=True, timeout=10)
        return (r.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(args: BenchArgs, log=print) -> dict[str, Any]:
    """Run the bench; returns the result dict (what `output.write` stores)."""
    started = time.time()
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or \
        str(Path("build", "inductor-cache").resolve())
    meta = {
        "date": datetime.date.today().isoformat(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.node(), "device": args.device,
        "hardware": _hardware(args.device), "versions": _versions(), "commit": _git_commit(),
        "command": args.command, "args": dataclasses.asdict(args),
        "inductor_cache": {"dir": cache, "existed": Path(cache).is_dir()},
        "load_before": _load(),
    }
    entries = plan(args)
    runnable = [e for e in entries if e["status"] == "ok"]
    for e in entries:
        if e["status"] != "ok":
            log(f"[bench] {e['workload']} {e['system']}: {e['reason']}")

    # references first (cheap on the CPU), so every launch line can show its loss difference
    total_steps = args.warmup + MAX_EXTRA_WARMUP + args.steps + 1
    refs: dict[tuple[str, str], list[float]] = {}
    for wname in args.matrix:
        w = W.get(wname)
        if any(e["workload"] == wname for e in runnable):
            t0 = time.perf_counter()
            refs[(wname, "global")] = W.reference_losses(w, args.nproc, total_steps,
                                                         device=args.device)
            if any(e["workload"] == wname and e["system"] == "compile-1proc" for e in runnable):
                refs[(wname, "rank0")] = W.reference_losses(w, args.nproc, total_steps, rank=0,
                                                            device=args.device)
            log(f"[bench] {wname}: eager reference, {total_steps} steps, "
                f"{time.perf_counter() - t0:.1f} s")
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()

    def ref_of(e):
        return refs.get((e["workload"], "rank0" if e["system"] == "compile-1proc" else "global"))

    tmp = Path(tempfile.mkdtemp(prefix="deepcompile-bench-"))
    n, total = 0, len(runnable) * args.launches
    for round_ in range(args.launches):
        for wname in args.matrix:
            todo = [e for e in runnable if e["workload"] == wname]
            k = round_ % len(todo) if todo else 0
            for e in todo[k:] + todo[:k]:
                n += 1
                spec = LaunchSpec(e["system"], wname, args.nproc, args.device, args.warmup,
                                  args.steps, args.compiler,
                                  log_path=str(tmp / f"{round_}-{wname}-{e['system']}.log"),
                                  inductor_cache=cache, plan_cache=None)
                load = _load()
                t0, cpu0 = time.perf_counter(), _children_cpu_s()
                ranks = launch(spec, e["world"], args.timeout_s)
                rec = _launch_record(ranks, time.perf_counter() - t0, [load, _load()])
                rec["cpu_s"] = round(_children_cpu_s() - cpu0, 2)
                e["launches"].append(rec)
                log(_launch_line(n, total, e, rec, ref_of(e)))
    bound = {e["workload"]: None for e in entries}
    for e in runnable:
        if e["system"] == "compile-1proc":
            ok = [r["step_s_median"] * 1e3 for r in e["launches"] if r["ok"]]
            bound[e["workload"]] = statistics.median(ok) if ok else None
    for e in entries:
        w = W.get(e["workload"])
        tokens = w.tokens_per_step(e["world"])
        _summarize(e, ref_of(e), None if e["system"] == "compile-1proc" else bound[e["workload"]],
                   tokens)
    meta["load_after"] = _load()
    meta["wall_s"] = round(time.time() - started, 1)
    meta["workloads"] = {wname: W.get(wname).to_dict() for wname in args.matrix}
    if all(rec["ok"] for e in entries for rec in e["launches"]):
        shutil.rmtree(tmp, ignore_errors=True)
    else:  # keep the ranks' logs of a run where a launch failed
        meta["launch_logs"] = str(tmp)
    return {"meta": meta, "results": entries}


def _children_cpu_s() -> float:
    """CPU seconds of the finished (joined) child processes so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _launch_line(n: int, total: int, e: dict, rec: dict, ref: list[float] | None) -> str:
    head = f"[bench] {n}/{total} {e['workload']} {e['system']}:"
    if not rec["ok"]:
        return f"{head} FAILED ({rec['reason'].splitlines()[0]}) [{rec['wall_s']:.0f} s]"
    t = rec["collectives"]["transport"]
    coll = sum(v["count"] for v in t.values())
    diff = ""
    if ref:
        m = min(len(ref), len(rec["losses"]))
        diff = f", max |dloss| {max(abs(a - b) for a, b in zip(rec['losses'][:m], ref[:m])):.1e}"
    return (f"{head} step {rec['step_s_median'] * 1e3:.1f} ms, first step "
            f"{rec['first_step_s']:.1f} s, {coll} collectives/step{diff} "
            f"[{rec['wall_s']:.0f} s, load {rec['load'][0][0] if rec['load'][0] else '?'}]")

