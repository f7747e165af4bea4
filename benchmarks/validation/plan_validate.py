"""`deepcompile plan`'s predictions against measured step times on this machine (CPU, gloo).

    python benchmarks/validation/plan_validate.py --workloads tiny-llama tiny-llama-gas4 \
        --worlds 1 2 4 --systems ours-z3 ours-z3+overlap ours-z3-auto --launches 3
    # on a machine with one H100 (the bench's GPU workload, world size 1):
    python benchmarks/validation/plan_validate.py --device cuda --gpu h100 --workloads llama-1b \
        --worlds 1 --systems ours-z3 fsdp2 ds-z3 --launches 3

For every round, world size and workload, interleaved (the machine's load drifts): the
planner's profiles of this machine (a host profile, host_profile.py: the pieces profiled, the
runtime's ops, the optimizer and the framework's overhead timed, at that many gloo ranks), then
per system one launch of the bench (`deepcompile bench`'s own worker, compiler "fx": the
graphs the plan profiled, run as FX code) and the plan of that system. The passes in the plan
are given the cost model that launch's runtime calibrated and planned with (read from its plan
cache): both plan with the same figures, the rest of the prediction is the planner's own.
The bench's own per-micro-step work (making the next token ids, ~0.4 ms on an idle core
here) is timed in the launch itself (per step, the ranks' mean: with more ranks than cores it
takes what they leave it) and added to each prediction (reported apart: it is not
deepcompile's; `harness_idle_s` is the same work timed here, on an idle core). Reports, per
cell, the median predicted step time, the median of the launches' median step times, and the
error; writes JSON (every launch) and markdown under benchmarks/results/<date>-cpu<cores>/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path


# At world size 1 nothing is communicated and the collective passes plan nothing (the runtime's
# and the planner's alike): every ours-z3 system is insertion only there, measured once.
WORLD1 = ("ours-z3",)


def _predict(workload, world: int, system: str, host, plan_cost: dict | None,
             gpu: str = "cpu", replay: dict | None = None) -> dict:
    """The plan of one cell: from `host` (a host profile; None with a GPU), its passes planning
    with `plan_cost` (the launch's runtime's, from its plan cache) where given."""
    import dataclasses

    from deepcompile.compiler.cost import LinearCostModel
    from deepcompile.tools.bench import systems as S
    from deepcompile.tools.plan import plan as P

    peer = not system.startswith("ours")
    pa = P.PlanArgs(model=workload.model, nodes=1, gpus_per_node=world, gpu=gpu,
                    seq=workload.seq, batch=workload.batch, gas=workload.gas,
                    passes=[] if peer else [tuple(replay["passes"]) if replay
                                            else S.resolved_passes(S.get(system))],
                    peers=(system,) if peer else ())
    if host is not None and plan_cost is not None:
        host = dataclasses.replace(host, plan_cost=LinearCostModel.from_dict(plan_cost))
    pl = P.make_plan(pa, host=host, replay=replay)
    r = pl.results[0]
    # at N ranks: the asynchronous collectives checked in a step (host_profile.py)
    checked = (host.record.get("in_step") or {}) if host is not None else {}
    return {"step_s": r.result.step_s, "exposed_comm_s": r.result.exposed_comm_s,
            "collectives": r.schedule.collectives, "plan_cost": plan_cost is not None,
            "async_check": checked.get("async")}


def replay_of(cached: dict) -> dict:
    """The decisions of a run (its plan cache's JSON) in the form the planner replays
    (`make_plan(replay=...)`, `Setting.replay`): the passes the run kept, in its order
    (`passes`), prefetch groups per graph, bucket_reduce buckets, selective_unshard's choice,
    by name."""
    out: dict = {"passes": [e["pass"] for e in cached.get("passes", [])
                            if e.get("kept", True) is not False]}
    for entry in cached.get("passes", []):
        if entry.get("kept", True) is False:   # reverted by the run: not in its graphs
            continue
        d = entry["decisions"]
        if entry["pass"] == "prefetch":
            out["prefetch"] = {key.rsplit(".", 1)[1]: [g["params"] for g in v.get("groups", [])]
                               for key, v in d.items()}
        elif entry["pass"] == "bucket_reduce":
            out["bucket_reduce"] = [b["params"] for v in d.values() for b in v.get("buckets", [])]
        elif entry["pass"] == "selective_unshard":
            out["selective_unshard"] = {"keep": [i["param"] for i in d["keep"]],
                                        "accumulate": list(d["accumulate"])}
    return out


_FRESH = [10_000_000]


def _harness_s(workload, world: int) -> float:
    """The bench's own time per micro-step outside training: making the token ids of a new
    micro-step (a Python loop over the sequence), timed here on an idle core, as its step loop
    runs it. Not deepcompile's work, so not in the plan. The launches time it themselves
    (`_measure`'s `harness_s`); this stands in where a launch did not."""
    import torch

    from deepcompile.tools import workloads as W

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ts = []
    for _ in range(9):
        _FRESH[0] += 1
        t0 = time.perf_counter()
        W.local_batch(workload, _FRESH[0], 0, world)   # a micro-step never made before
        ts.append(time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return statistics.median(ts)


def _run_plan(cache_dir: Path) -> dict | None:
    """The measured run's plan cache: the cost model its passes planned with, their decisions."""
    for path in sorted(cache_dir.glob("plan-*.json")):
        return json.loads(path.read_text())
    return None


def _measure(workload, world: int, system: str, steps: int, tmp: Path, n: int,
             device: str = "cpu", probe=None) -> dict:
    from deepcompile.tools.bench.run import _launch_record
    from deepcompile.tools.bench.worker import LaunchSpec, launch

    spec = LaunchSpec(system, workload.name, world, device, 2, steps,
                      "fx" if device == "cpu" else "inductor",
                      log_path=str(tmp / f"{n}-{workload.name}-{world}-{system}.log"),
                      inductor_cache=str(tmp / "inductor"), plan_cache=str(tmp / f"cache-{n}"))
    # a cache of its own per launch: each run plans (and records its cost model)
    load = list(os.getloadavg())
    t0 = time.perf_counter()
    ranks = launch(spec, world, 1200.0)
    rec = _launch_record(ranks, time.perf_counter() - t0, [load, list(os.getloadavg())])
    cached = _run_plan(Path(spec.plan_cache)) or {}
    # the main thread's CPU time per step, and its share of the step's wall time (rank 0's
    # median): on a machine shared with other work, a step's wall time includes the time
    # other processes held the cores, which the planner's per-node medians do not
    cpu = share = None
    if rec["ok"] and isinstance(ranks, list) and ranks[0].get("step_cpu_s"):
        r0 = ranks[0]
        cpu = statistics.median(r0["step_cpu_s"])
        share = statistics.median(c / t for c, t in zip(r0["step_cpu_s"], r0["step_s"]))
    # the plan predicts a step's expected time (every collective's mean, stalls included:
    # [Note: gloo's stalls] in host_profile.py); the bench's figure is the median step
    steps = rec.get("step_s") if rec["ok"] else None
    return {"ok": rec["ok"], "step_s": rec.get("step_s_median"), "load": load,
            "step_s_mean": statistics.fmean(steps) if steps else None, "steps_s": steps,
            "cpu_s": cpu, "cpu_share": share, "harness_s": rec.get("batch_s_median"),
            "core_time": rec.get("core_time"),
            # the machine's speed while the timed steps ran, +-1 s ([Note: the machine's speed])
            "speed_s": probe.over(*rec["timed_window"], pad_s=1.0)
            if probe is not None and rec.get("timed_window") else None,
            "plan_cost": cached.get("cost"), "plan": cached,
            "error": None if rec["ok"] else str(rec.get("reason"))[:2000],
            "collectives": rec.get("collectives")}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["tiny-llama", "tiny-llama-gas4"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--systems", nargs="+",
                    default=["ours-z3", "ours-z3+overlap", "ours-z3-auto"])
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7, help="profile repeats per plan")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: predictions from the roofline of --gpu and the network model, "
                         "measured by the bench on this machine's GPUs (bf16, Inductor)")
    ap.add_argument("--gpu", default="h100", help="with --device cuda: the GPU to predict for")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the planner's compute profiles in CPU time (measure_host), to "
                         "compare with the launches' CPU time per step on a loaded machine")
    ap.add_argument("--summarize", action="store_true",
                    help="only write the summary of the rounds already in --out's "
                         "plan_validation.jsonl (a run stopped early)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.summarize:
        out_dir = Path(args.out)
        rows = [json.loads(x) for x in (out_dir / "plan_validation.jsonl").read_text().splitlines()
                if x.strip()]
        done = sorted({(r["round"], r["world"], r["workload"]) for r in rows})
        write_summary(rows, args, out_dir, datetime.date.today().isoformat(), argv,
                      note=f"summarized from the rounds that finished ({len(done)} cells: "
                           + ", ".join(f"round {a + 1} world {b} {c}" for a, b, c in done) + ")")
        return 0
    from deepcompile.tools import workloads as W
    from speed import SpeedProbe
    from host_profile import measure_host

    date = datetime.date.today().isoformat()
    out_dir = Path(args.out or Path(__file__).parents[1] / "results" / f"{date}-cpu{os.cpu_count()}")
    out_dir.mkdir(parents=True, exist_ok=True)
    raw_path = out_dir / "plan_validation.jsonl"
    tmp = Path(tempfile.mkdtemp(prefix="deepcompile-planval-"))
    rows: list = []
    with SpeedProbe() as probe:
        _rounds(args, W, measure_host, probe, tmp, raw_path, rows)
    write_summary(rows, args, out_dir, date, argv)
    return 0


def _rounds(args, W, measure_host, probe, tmp: Path, raw_path: Path, rows: list) -> None:
    n = 0
    for round_ in range(args.launches):
        for world in args.worlds:
            for wname in args.workloads:
                w = W.get(wname)
                t0, w0 = time.perf_counter(), time.time()
                host = None if args.device == "cuda" else measure_host(
                    w.model, world=world, batch=w.batch, seq=w.seq, repeats=args.repeats,
                    clock=args.clock)
                pred = {"wall_s": round(time.perf_counter() - t0, 1),
                        # the machine's speed while the plan measured it
                        "speed_s": None if host is None else probe.over(w0, time.time()),
                        "load": list(os.getloadavg()) if host is None else host.record["load"],
                        "host": None if host is None else host.summary(),
                        "network": None if host is None else host.network.describe(),
                        "systems": {}}
                rec = {"round": round_, "world": world, "workload": wname, "prediction": pred,
                       "measured": {}}
                systems = [s for s in args.systems if world > 1 or s in WORLD1
                           or not s.startswith("ours")]
                for system in systems[round_ % len(systems):] + systems[:round_ % len(systems)]:
                    n += 1
                    m = rec["measured"][system] = _measure(w, world, system, args.steps, tmp, n,
                                                           args.device, probe)
                    p = pred["systems"][system] = _predict(
                        w, world, system, host, m["plan_cost"] if host else None,
                        "cpu" if host else args.gpu)
                    p["plan_step_s"] = p["step_s"]
                    p["harness_idle_s"] = w.gas * _harness_s(w, world)
                    p["harness_s"] = m.get("harness_s") or p["harness_idle_s"]
                    p["step_s"] = p["plan_step_s"] + p["harness_s"]
                    # the plan at the machine's speed of the launch's timed steps ([Note: the
                    # machine's speed]); the harness's time was measured in the launch
                    if pred["speed_s"] and m.get("speed_s"):
                        p["speed_ratio"] = m["speed_s"] / pred["speed_s"]
                        p["at_launch_speed_s"] = (p["plan_step_s"] * p["speed_ratio"]
                                                  + p["harness_s"])
                    if host and m.get("plan") and system != "ours-z3":
                        r = _predict(w, world, system, host, m["plan_cost"],
                                     replay=replay_of(m["plan"]))
                        p["replayed_step_s"] = r["step_s"] + p["harness_s"]
                        p["replayed_collectives"] = r["collectives"]
                    m.pop("plan", None)
                rows.append(rec)
                with raw_path.open("a") as f:
                    f.write(json.dumps(rec, default=str) + "\n")
                print(f"round {round_ + 1}/{args.launches} world {world} {wname}: " + "; ".join(
                    f"{s} predicted {pred['systems'][s]['step_s'] * 1e3:.1f} ms, measured "
                    f"{(rec['measured'][s]['step_s'] or float('nan')) * 1e3:.1f} ms"
                    + (f" (machine x{pred['systems'][s]['speed_ratio']:.2f} of the plan's)"
                       if pred["systems"][s].get("speed_ratio") else "")
                    for s in systems), flush=True)


def _med(xs: list, scale: float = 1.0) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) * scale if xs else None


def _cell(cell: list, s: str) -> dict | None:
    """One cell's figures: medians over its rounds (launches)."""
    p = [r["prediction"]["systems"][s]["step_s"] for r in cell]
    ok = [r for r in cell if r["measured"][s]["ok"]]
    if not ok:
        return None
    pm, mm = statistics.median(p), statistics.median(r["measured"][s]["step_s"] for r in ok)
    meas = [r["measured"][s] for r in ok]
    ct = [x["core_time"] for x in meas if x.get("core_time")]
    mach = [c["machine"] for c in ct if c.get("machine")]
    proc = [c["process"] for c in ct if c.get("process")]
    mmean, mc = _med([x.get("step_s_mean") for x in meas]), _med([x.get("cpu_s") for x in meas])
    rp = _med([r["prediction"]["systems"][s].get("replayed_step_s") for r in cell])
    # [Note: the machine's speed]: the prediction at the speed the launch's steps ran at
    ats = _med([r["prediction"]["systems"][s].get("at_launch_speed_s") for r in ok])
    faults = [c["minor_faults"] for c in proc]
    return {"predicted_ms": pm * 1e3, "measured_ms": mm * 1e3, "error": pm / mm - 1,
            "measured_mean_ms": mmean * 1e3 if mmean else None,
            "error_vs_mean": pm / mmean - 1 if mmean else None,
            "measured_cpu_ms": mc * 1e3 if mc else None,
            "error_vs_cpu": pm / mc - 1 if mc else None,
            "cpu_share": _med([x.get("cpu_share") for x in meas]),
            "ranks_cpu_ms": _med([c["ranks_run_s"] for c in ct], 1e3),
            "cores_idle": _med([c["idle_share"] for c in mach]),
            "steal": _med([c["steal_share"] for c in mach]),
            "steal_max": max((c["steal_share"] for c in mach), default=None),
            "faults_per_step": _med(faults),
            "faults_range": [min(faults), max(faults)] if faults else None,
            "ranks_sys_ms": _med([c["sys"] for c in proc], 1e3),
            "speed_ratios": [r["prediction"]["systems"][s].get("speed_ratio") for r in ok],
            "at_launch_speed_ms": ats * 1e3 if ats else None,
            "error_at_launch_speed": ats / mm - 1 if ats else None,
            "replayed_ms": rp * 1e3 if rp else None,
            "replayed_error": rp / mm - 1 if rp else None,
            "predicted_range_ms": [min(p) * 1e3, max(p) * 1e3],
            "measured_range_ms": [min(x["step_s"] for x in meas) * 1e3,
                                  max(x["step_s"] for x in meas) * 1e3]}


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x, sign: str = "+") -> str:
    return "-" if x is None else f"{int(round(x * 100)):{sign}d}%"   # never "-0%"


def write_summary(rows: list, args, out_dir: Path, date: str, argv, note: str = "") -> None:
    """The per-cell medians (JSON and markdown) of `rows` (every round's record)."""
    import torch

    summary = []
    for world in args.worlds:
        for wname in args.workloads:
            cell = [r for r in rows if r["world"] == world and r["workload"] == wname]
            for s in args.systems:
                if cell and s in cell[0]["measured"] and (c := _cell(cell, s)):
                    summary.append({"workload": wname, "world": world, "system": s, **c})
    meta = {"date": date, "machine": platform.node(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "python": platform.python_version(),
            "command": shlex.join(["python", "benchmarks/validation/plan_validate.py",
                                   *(argv or sys.argv[1:])]),
            "load_end": list(os.getloadavg())}
    (out_dir / "plan_validation.json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "rounds": rows}, indent=1, default=str))
    lines = [f"# deepcompile plan: predicted vs measured step time, {date}", "",
             "Predicted: `deepcompile plan --gpu cpu` at that many ranks (plus the bench's "
             "input-making time per micro-step, measured); measured: `deepcompile bench` "
             "launches (compiler fx), median of launch medians.", "",
             f"- command: `{meta['command']}`",
             f"- machine: {meta['machine']}, {meta['cpus']} CPUs; torch {meta['torch']}",
             "- the planner's compute profiles (nodes, optimizer, framework) timed in "
             + ("thread CPU time (`--clock cpu`)" if getattr(args, "clock", "wall") == "cpu"
                else "wall time"),
             *([f"- {note}"] if note else []),
             "- load average (1 min) when each launch started: "
             + ", ".join(f"{m['load'][0]:.1f}" for r in rows for m in r["measured"].values())
             + f"; at the end {meta['load_end'][0]:.1f} ({meta['cpus']} cores; the load "
             "counts the bench's own ranks and the planner's)",
             f"- {args.launches} interleaved rounds; per round, world size and workload: one plan "
             "(profiles taken at that many ranks) and one bench launch per system (compiler fx, "
             f"{args.steps} timed steps)", "",
             "- measured mean ms: the median over the launches of each launch's mean step "
             "(the bench's figure is the median step): the plan predicts a step's expected "
             "time, and a launch's steps are skewed where a gloo collective stalls for a "
             "scheduler tick (stop 36; rare since the ranks run SCHED_BATCH: [Note: gloo's "
             "spinning loop] in deepcompile/tools/cpu_sched.py).",
             "- machine speed ([Note: the machine's speed] in speed.py): per launch, a "
             "fixed reference's CPU time while its timed steps ran, over the same while the "
             "plan measured (x1.20: the machine ran the steps 20% slower than it ran the "
             "plan's measurements); \"at the launch's speed\": each round's prediction (less "
             "the harness's time, measured in the launch) times that ratio. The plain error is "
             "the verdict; this one says how much of it the machine's speed explains.", "",
             "| workload | ranks | system | predicted ms [min, max] | measured ms [min, max] | "
             "error | measured mean ms | error vs mean | with the run's decisions | error "
             "| machine speed, launch / plan | at the launch's speed | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        ratios = ", ".join(f"x{x:.2f}" for x in r["speed_ratios"] if x) or "-"
        lines.append(f"| {r['workload']} | {r['world']} | {r['system']} | "
                     f"{r['predicted_ms']:.1f} [{r['predicted_range_ms'][0]:.1f}, "
                     f"{r['predicted_range_ms'][1]:.1f}] | {r['measured_ms']:.1f} "
                     f"[{r['measured_range_ms'][0]:.1f}, {r['measured_range_ms'][1]:.1f}] | "
                     f"{_pct(r['error'])} | {_f(r['measured_mean_ms'], '.1f')} | "
                     f"{_pct(r['error_vs_mean'])} | "
                     f"{_f(r['replayed_ms'], '.1f')} | "
                     f"{_pct(r['replayed_error'])} | "
                     f"{ratios} | {_f(r['at_launch_speed_ms'], '.1f')} | "
                     f"{_pct(r['error_at_launch_speed'])} |")
    lines += ["", "Where the timed steps' core time went ([Note: where a step's core time "
              "goes] in deepcompile/tools/cpu_sched.py), per step, median over the launches: "
              "rank 0's main-thread CPU ms (`time.thread_time`) and its share of the step's "
              "wall time (at one rank nothing waits on communication, so it is the step an idle core would "
              "take; at 2 and 4 ranks it leaves out the waits for peers); every thread of "
              "every rank (/proc schedstat); the share of the machine's core time that was idle "
              "and that the hypervisor stole (/proc/stat, 10 ms ticks, over rank 0's timed "
              "steps); the ranks' minor page faults [min, max over the launches].", "",
              "| workload | ranks | system | rank 0 main thread CPU ms (share) | error vs it "
              "| all ranks' CPU ms | cores idle | stolen | faults |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        lines.append(f"| {r['workload']} | {r['world']} | {r['system']} | "
                     + (f"{r['measured_cpu_ms']:.1f} ({r['cpu_share']:.2f}) | "
                        f"{_pct(r['error_vs_cpu'])} | " if r["measured_cpu_ms"]
                        else "- | - | ")
                     + f"{_f(r['ranks_cpu_ms'], '.1f')} | "
                     + f"{_pct(r['cores_idle'], '')} | "
                     + (f"{r['steal'] * 100:.1f}% (max {r['steal_max'] * 100:.1f}%) | "
                        if r["steal"] is not None else "- | ")
                     + (f"{r['faults_per_step']:.0f} [{r['faults_range'][0]:.0f}, "
                        f"{r['faults_range'][1]:.0f}] |" if r["faults_per_step"] is not None
                        else "- |"))
    (out_dir / "plan_validation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
