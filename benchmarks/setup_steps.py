"""How many optimizer steps the setup takes (warm-up, profiling, the passes' trials: until the
plan is final) with the default Config at ZeRO-1, 2 and 3, on the bench's CPU workloads, and
what the passes decided (docs/guide/setup.md):

    OMP_NUM_THREADS=1 python benchmarks/setup_steps.py            # 2 gloo ranks, fx, every CPU workload
    python benchmarks/setup_steps.py --workloads tiny-llama --stages 3 --launches 3

Each case trains a fresh engine (`passes="auto"`, the bench's model, data and AdamW) until its
phase is "steady" and records the steps of each phase, each pass (kept, graphs changed) and
each trial's timed steps a side. Runs on any deepcompile (PYTHONPATH=... for another checkout):
it reads only `engine.phase` and the pipeline's step log and pass log. Writes JSON (`--out`, or
benchmarks/results/<date>-setup-steps/setup_steps.json, never overwriting) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys

from _results import write_json  # benchmarks/_results.py (this script's folder)

WORKLOADS = ("tiny-llama", "tiny-llama-gas4", "small-llama", "tiny-mixtral", "tiny-llama-b1")


def _case(rank: int, world: int, wname: str, stage: int) -> dict:
    import torch

    import deepcompile
    from deepcompile.tools import workloads
    from deepcompile.tools.bench import systems

    w = workloads.get(wname)
    system = systems.System("auto", "ours", "", stage=stage, passes=systems.AUTO)
    config = systems.ours_config(system, compiler="fx", gas=w.gas, dtype=w.dtype)
    engine = deepcompile.initialize(workloads.build_model(w), optimizer=workloads.make_optimizer,
                                    config=config)
    micro = steps = 0
    while engine.phase != "steady" and steps < 60:
        for _ in range(w.gas):
            ids = workloads.local_batch(w, micro, rank, world)
            micro += 1
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        steps += 1
    pipe = engine._pipeline
    phases: dict[str, int] = {}
    for phase, _ in pipe.step_log:
        if phase != "steady":
            phases[phase] = phases.get(phase, 0) + 1

    def timed(entry, side):
        return len((entry.get(side) or {}).get("measured_s") or [])

    out = {"workload": wname, "stage": stage, "setup_steps": sum(phases.values()),
           "phases": phases,
           "passes": [{"pass": e["pass"], "kept": e["kept"], "changed": len(e["changed"]),
                       "timed_after": timed(e, "after"), "timed_before": timed(e, "before")}
                      for e in pipe.pass_log]}
    del engine
    torch._dynamo.reset()
    return out


def _rank(rank: int, world: int, cases: list) -> list[dict]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return [_case(rank, world, w, s) for w, s in cases]
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--launches", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch

    import deepcompile
    from deepcompile.tools import spawn

    cases = [(w, s) for w in a.workloads for s in a.stages]
    results = []
    for _ in range(a.launches):
        results += spawn.launch(_rank, a.nproc, cases, timeout_s=3600)[0]

    write_json({"torch": torch.__version__, "deepcompile": os.path.dirname(deepcompile.__file__),
                "nproc": a.nproc, "command": " ".join(sys.argv), "results": results},
               "setup_steps", a.out, "setup-steps")
    print(f"{'workload':<16} {'stage':>5} {'steps':>5}  phases; passes (kept, graphs changed, "
          "timed steps after/before)")
    for r in results:
        passes = ", ".join(f"{x['pass']} {'kept' if x['kept'] else 'REVERTED'} {x['changed']} "
                           f"{x['timed_after']}/{x['timed_before']}" for x in r["passes"])
        phases = " ".join(f"{k} {v}" for k, v in r["phases"].items())
        print(f"{r['workload']:<16} {r['stage']:>5} {r['setup_steps']:>5}  {phases}; {passes}")


if __name__ == "__main__":
    main()
