"""What the guardrails cost per steady optimizer step (runtime/guardrails.py), on CPU ranks
(gloo), for a tiny Llama of each depth:

    python benchmarks/guardrails_cost.py [--layers 2 8] [--stage 3] [--passes ...] [--nproc 2]

* check_s: the host time of the divergence check at the step boundary (`Guardrails.end_step`:
  fold the step's fingerprint, all-reduce 8 integers on the check group), median over the
  timed steps, against the median steady step (`step_s`), with `divergence_check_every=1`;
* guard_calls: deepcompile Python calls per step made in runtime/guardrails.py and in the
  non-finite check (runtime/loss_scale.py) (sys.setprofile), against the number of
  parameters: the check's host work depends on the number of graph calls, not of parameters;
* step_s_off: the median steady step with `divergence_check_every=0` and `on_nonfinite="off"`
  (the same load: the two runs alternate step by step in one job would be fairer; here they
  run one after the other, so compare only as a ratio on a quiet machine).

Results: JSON on stdout (and `--out FILE`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runtime_figures as rf  # noqa: E402


def _worker(rank: int, world: int, port: int, a, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        queue.put((rank, {"on": _measure(rank, a, True), "off": _measure(rank, a, False)}))
    except BaseException:   # noqa: BLE001 -- reported by the parent
        import traceback
        queue.put((rank, {"error": traceback.format_exc()}))
    finally:
        dist.destroy_process_group()


def _measure(rank: int, a, on: bool) -> dict:
    import deepcompile

    torch._dynamo.reset()
    root = os.path.dirname(deepcompile.__file__)
    engine = deepcompile.initialize(
        rf._model(a.layers_now), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        config={"zero_stage": a.stage, "compiler": "fx", "passes": tuple(a.passes),
                "warmup_steps": 1, "measure_steps": 0, "divergence_check_every": 1 if on else 0,
                "on_nonfinite": "raise" if on else "off"})
    rails = engine._rails
    check_s: list[float] = []
    inner = rails.end_step

    def timed_end_step(*args):
        t0 = time.perf_counter()
        try:
            return inner(*args)
        finally:
            check_s.append(time.perf_counter() - t0)

    rails.end_step = timed_end_step
    step_no = 0

    def step():
        nonlocal step_no
        out = engine(**rf._batch(step_no, rank))
        engine.backward(out.loss)
        engine.step()
        step_no += 1

    for _ in range(a.settle):
        step()
    check_s.clear()
    times = []
    for _ in range(a.timed):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    counts: dict[str, int] = {}
    files = (os.path.join(root, "runtime", "guardrails.py"), os.path.join(root, "runtime", "loss_scale.py"))

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in files:
            key = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
            counts[key] = counts.get(key, 0) + 1

    sys.setprofile(prof)
    try:
        step()
    finally:
        sys.setprofile(None)
    return {"params": sum(1 for _ in engine.module.parameters()),
            "phase": engine.report().phase, "checks": rails.checks,
            "step_s": statistics.median(times),
            "check_s": statistics.median(check_s) if check_s else None,
            "guard_calls": sum(counts.values()), "guard_calls_by_function": counts}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--passes", nargs="*", default=["prefetch", "bucket_reduce"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--settle", type=int, default=6)
    p.add_argument("--timed", type=int, default=10)
    p.add_argument("--out")
    a = p.parse_args(argv)
    results = []
    ctx = mp.get_context("spawn")
    for layers in a.layers:
        a.layers_now = layers
        queue = ctx.Queue()
        port = rf._free_port()
        procs = [ctx.Process(target=_worker, args=(r, a.nproc, port, a, queue))
                 for r in range(a.nproc)]
        for pr in procs:
            pr.start()
        got = dict(queue.get(timeout=1800) for _ in procs)
        for pr in procs:
            pr.join()
        errors = [r["error"] for r in got.values() if "error" in r]
        if errors:
            raise SystemExit(errors[0])
        on, off = got[0]["on"], got[0]["off"]
        results.append({"layers": layers, **on, "step_s_off": off["step_s"],
                        "check_share_of_step": on["check_s"] / on["step_s"]})
    doc = {"torch": torch.__version__, "stage": a.stage, "passes": a.passes,
           "nproc": a.nproc, "command": " ".join(sys.argv), "results": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
