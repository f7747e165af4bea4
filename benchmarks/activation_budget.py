"""`activation_budget` against Hugging Face's full gradient checkpointing and torch's
`activation_memory_budget`, at the same memory, paired (benchmarks/paired.py).

    OMP_NUM_THREADS=1 python benchmarks/activation_budget.py --workload tiny-llama --seq 512 \
        --calibrate                           # profiled peaks: none, hf-ckpt, torch's budgets
    OMP_NUM_THREADS=1 python benchmarks/activation_budget.py --workload tiny-llama --seq 512 \
        --torch-budget 0.1 --launches 2 --rounds 10 --out F.json

Every system is a deepcompile ZeRO-3 engine (no other pass) on the same seeded model and data,
built in the same ranks; their steady steps alternate round by round (paired.py's method and
statistics):

  none          nothing recomputed (the fastest step, the highest peak)
  hf-ckpt       `model.gradient_checkpointing_enable()`: every decoder layer recomputed
  torch-budget  torch's min-cut partitioner with `activation_memory_budget` (--torch-budget,
                patched around this system's compilation), set by hand to the fraction whose
                profiled peak is closest to hf-ckpt's from below (--calibrate lists them)
  ours          `activation_budget` with `Config.memory_budget` = hf-ckpt's profiled peak
  ours@F        `activation_budget` with the budget F of the way from hf-ckpt's peak to none's
                (--between F ...): the memory ours saves where it costs (almost) no time

The peaks are the engines' profiled peaks (the CPU memory model on the CPU: the same for every
launch; on CUDA `memory_allocated` less what the process held before the engine was built), the
largest over the graphs; hf-ckpt's is measured first in each launch (ours' budget is read from
it). The systems are built in this order in every launch (paired.py rotates its order). Recomputed FLOPs per step: the matrix-multiply
FLOPs of the backward graphs' nodes that recompute forward work (the partitioner's recompute,
the checkpointed layers', ours' copies), per run times runs per step. Prints markdown; --out
writes JSON with every launch's steps, each system's report (rank 0) and the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired  # noqa: E402


def _workload(name: str, seq: int | None, batch: int | None):
    from deepcompile.tools import workloads

    w = workloads.get(name)
    if seq:
        w = dataclasses.replace(w, name=f"{w.name}-seq{seq}", seq=seq)
    if batch:
        w = dataclasses.replace(w, name=f"{w.name}-b{batch}", batch=batch)
    return w


def _recompute_flops(engine) -> float:
    """Matrix-multiply FLOPs per optimizer step of the backward nodes that recompute forward
    work (see the module docstring)."""
    from deepcompile.compiler import graph as G
    from deepcompile.passes.activation_budget import _flops

    pipe = engine._pipeline
    total = 0.0
    for key, slot in pipe.runner.planning().items():
        if not key.endswith(".bw"):
            continue
        fw = pipe.slots.get(key[:-3] + ".fw")
        names = {n.name for n in fw.gm.graph.nodes} if fw is not None else set()
        again = [n for n in slot.gm.graph.nodes if n.op == "call_function"
                 and (n.name in names or n.meta.get("dc_recompute")) and not G.is_alias_of_input(n)]
        total += _flops(again) * max(pipe.order.count(key), 1)
    return total


def _peak(engine) -> int:
    return max(p.peak_bytes for p in engine._pipeline.latest_profiles().values())


def _build(spec: dict, w, device, compiler: str, budget: int | None):
    import functools

    import torch

    import deepcompile
    from deepcompile.tools import workloads

    model = workloads.build_model(w, device)
    if spec.get("ckpt"):
        model.gradient_checkpointing_enable()
    cfg = {"zero_stage": 3, "compiler": compiler, "gradient_accumulation_steps": w.gas,
           "passes": tuple(spec.get("passes", ())), "measure_steps": 0}
    if budget is not None:
        cfg["memory_budget"] = budget
    if w.dtype != "float32":
        cfg["param_dtype"] = w.dtype
    return deepcompile.initialize(model, optimizer=functools.partial(torch.optim.AdamW,
                                                                      **workloads.ADAMW),
                                  config=deepcompile.Config(**cfg))


def _rank(rank: int, world: int, args: dict) -> dict:
    import contextlib

    import torch
    import torch._functorch.config as functorch_config
    import torch.distributed as dist

    from deepcompile.tools import workloads

    torch.set_num_threads(1)
    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if device.type == "cpu" else "nccl",
                            timeout=timedelta(seconds=900))
    w = _workload(args["workload"], args["seq"], args["batch"])
    out: dict[str, dict] = {}
    built, peaks = [], {}
    held = (lambda: torch.cuda.memory_allocated(device)) if device.type == "cuda" else \
        (lambda: 0)
    for spec in args["specs"]:   # hf-ckpt before ours (its peak is ours' budget)
        # each engine's own peak: on CUDA `memory_allocated` counts the engines built before
        # (the CPU memory model counts an engine's own storages)
        base = held()
        budget = spec.get("budget")
        if isinstance(budget, str):   # "ckpt" or "ckpt+F": from the measured peaks
            lo, hi = peaks["hf-ckpt"], peaks.get("none", peaks["hf-ckpt"])
            budget = base + int(lo + float(budget.partition("+")[2] or 0) * (hi - lo))
        engine = _build(spec, w, device, args["compiler"], budget)
        patch = (functorch_config.patch(activation_memory_budget=spec["torch_budget"])
                 if spec.get("torch_budget") is not None else contextlib.nullcontext())

        def one_step(engine=engine, patch=patch, micro=[0]):
            start = time.perf_counter()
            for _ in range(w.gas):
                ids = workloads.local_batch(w, micro[0] % 64, rank, world).to(device)
                micro[0] += 1
                with patch:   # (re-entered: a patch restores the config when it exits)
                    loss = engine(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        warm, steady = 0, 0
        while steady < 2:
            one_step()
            warm += 1
            steady += engine.report().phase == "steady"
            if warm > 40:
                raise RuntimeError(f"{spec['name']} not steady after {warm} steps")
        peaks[spec["name"]] = _peak(engine) - base
        rep = engine.report().to_dict()
        out[spec["name"]] = {
            "warmup_steps": warm, "step_s": [], "budget": None if budget is None
            else budget - base,
            "peak_bytes": peaks[spec["name"]], "recompute_flops": _recompute_flops(engine),
            "plan": [{"pass": p["pass"], "kept": p["kept"], "changed": p["changed"]}
                     for p in rep["passes"]],
            "summary": [line for p in rep["passes"] for line in p["summary"]]}
        if args["calibrate"]:
            del engine
            continue
        built.append((spec["name"], one_step))
    n = len(built)
    for r in range(args["rounds"]):
        for k in range(n):
            name, one_step = built[(r + k) % n]
            out[name]["step_s"].append(one_step())
    dist.destroy_process_group()
    return out


def specs(a) -> list[dict]:
    out = [{"name": "none"}, {"name": "hf-ckpt", "ckpt": True}]
    if a.calibrate:
        return out + [{"name": f"torch-budget={f}", "torch_budget": f}
                      for f in a.torch_budgets]
    out.append({"name": "torch-budget", "torch_budget": a.torch_budget})
    out.append({"name": "ours", "passes": ["activation_budget"], "budget": "ckpt"})
    out += [{"name": f"ours@{f}", "passes": ["activation_budget"], "budget": f"ckpt+{f}"}
            for f in a.between]
    keep = set(a.systems or [s["name"] for s in out]) | {"none", "hf-ckpt"}
    return [s for s in out if s["name"] in keep]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="tiny-llama")
    ap.add_argument("--seq", type=int, help="tokens per sequence (the workload's otherwise)")
    ap.add_argument("--batch", type=int, help="sequences per rank (the workload's otherwise)")
    ap.add_argument("--calibrate", action="store_true",
                    help="no rounds: the profiled peaks of none, hf-ckpt and torch's budgets")
    ap.add_argument("--torch-budgets", type=float, nargs="+",
                    default=[0.02, 0.05, 0.1, 0.2, 0.3, 0.5])
    ap.add_argument("--torch-budget", type=float, default=0.1)
    ap.add_argument("--between", type=float, nargs="*", default=[0.5])
    ap.add_argument("--systems", nargs="+", help="a subset of the systems (none and hf-ckpt "
                                                 "always run: the others' budgets are theirs)")
    ap.add_argument("--launches", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compiler", default="inductor")
    ap.add_argument("--timeout", type=float, default=3000)
    ap.add_argument("--out")
    return ap


def main() -> None:
    from deepcompile.tools import spawn

    a = parser().parse_args()
    sp = specs(a)
    names = [s["name"] for s in sp]
    cache = tempfile.mkdtemp(prefix="activation-budget-inductor-")
    args = {"workload": a.workload, "seq": a.seq, "batch": a.batch, "specs": sp,
            "rounds": 0 if a.calibrate else a.rounds, "compiler": a.compiler,
            "device": a.device, "calibrate": a.calibrate, "inductor_cache": cache}
    launches = []
    for i in range(1 if a.calibrate else a.launches):
        t0 = time.perf_counter()
        launches.append(spawn.launch(_rank, a.nproc, args, timeout_s=a.timeout,
                                     cpu=a.device == "cpu",
                                     env={"TORCHINDUCTOR_CACHE_DIR": cache}))
        print(f"[activation_budget] launch {i + 1}: {time.perf_counter() - t0:.0f} s, load "
              f"{os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    w = _workload(a.workload, a.seq, a.batch)
    first = launches[0][0]
    print(f"\n{w.name} ({w.seq} tokens x {w.batch} sequences per rank, gas {w.gas}), "
          f"{a.nproc} ranks, {a.compiler}\n")
    print("| system | profiled peak (MiB) | budget (MiB) | recomputed GFLOP / step |")
    print("|---|---|---|---|")
    for n in names:
        r = first[n]
        budget = "" if r["budget"] is None else f"{r['budget'] / 2**20:.2f}"
        print(f"| {n} | {r['peak_bytes'] / 2**20:.2f} | {budget} | "
              f"{r['recompute_flops'] / 1e9:.3f} |")
    for n in names:
        for line in first[n]["summary"]:
            print(f"    {n}: {line}")
    summary = None
    if not a.calibrate:
        for ref in ("hf-ckpt", "none"):
            order = [ref] + [n for n in names if n != ref]
            s = paired.summarize(launches, order)
            paired._print(s, f"\nsteps against {ref}, {a.launches} launches x {a.rounds} "
                             "rounds (every system one optimizer step per round, order rotated)")
            if ref == "hf-ckpt":
                summary = s
    if a.out:
        from deepcompile.tools.bench.run import _git_commit

        import torch

        meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join(["python"] + sys.argv), "commit": _git_commit(),
                "torch": torch.__version__, "workload": dataclasses.asdict(w),
                "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
                "median_step_ms": {n: statistics.median(
                    [t for L in launches for t in L[0][n]["step_s"]] or [0.0]) * 1e3
                    for n in names}}
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "summary": summary, "launches": launches}, f, indent=1)


if __name__ == "__main__":
    main()
