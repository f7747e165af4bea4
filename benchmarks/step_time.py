"""Steady-state step time of deepcompile configurations on a tiny Llama, interleaved launches.

    python benchmarks/step_time.py --launches 5 --steps 14 --configs insertion prefetch prefetch+bucket_reduce
    python benchmarks/step_time.py --launches 5 --steps 14 --batch 1 --seq 64 --configs zero1 zero2

Each launch spawns `--nproc` gloo ranks on this machine and trains for `--steps` optimizer
steps; the configurations are interleaved launch by launch (the machine's load drifts). Per
launch: the median steady-state step time (after warm-up, profiling and passes), the median
profiled step time, all-gathers per optimizer step, every collective's count and bytes in the
last optimizer step, and the profile's exposed communication.
Reports the median of launch medians with min and max, and writes JSON under
benchmarks/results/<date>-<machine>/.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = {
    "insertion": {"passes": ()},
    "prefetch": {"passes": ("prefetch",)},
    "prefetch+bucket_reduce": {"passes": ("prefetch", "bucket_reduce")},
    # ZeRO-1/2 with their default pass (bucket_reduce)
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
        attn_implementation="eager", use_cache=False))


def _rank(rank, world, port, name, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import deepcompile

    engine = deepcompile.initialize(
        _model(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        config={"compiler": args.compiler, "gradient_accumulation_steps": args.gas,
                **CONFIGS[name]})
    g = torch.Generator().manual_seed(rank)
    per_step = []   # {kind: (count, bytes)} of each optimizer step
    for _ in range(args.steps):
        before = engine.comm_stats()
        for _ in range(args.gas):
            ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        after = engine.comm_stats()
        per_step.append({k: (after[k]["count"] - before.get(k, {}).get("count", 0),
                             after[k]["bytes"] - before.get(k, {}).get("bytes", 0))
                         for k in ("all_gather", "reduce_scatter", "all_reduce")})
    rep = engine.report().to_dict()
    t = rep["timings"]
    if rank == 0:
        queue.put({"config": name, "steady_step_s": statistics.median(t["steady_steps_s"]),
                   "profiled_step_s": statistics.median(t["profiled_steps_s"]),
                   "all_gathers_per_step": per_step[-1]["all_gather"][0],
                   "reduce_scatters_per_step": per_step[-1]["reduce_scatter"][0],
                   "comm_per_step": per_step[-1],   # kind -> [count, bytes], last step
                   "exposed_comm_s": rep["step_summary"]["exposed_comm_s"],
                   "peak_bytes": rep["step_summary"]["peak_bytes"]})
    dist.destroy_process_group()


def _launch(name, args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.nproc, port, name, args, queue))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=1800)
        if p.exitcode != 0:
            raise SystemExit(f"{name}: a rank failed (exit {p.exitcode})")
    return queue.get()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--gas", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--compiler", default="fx", choices=("fx", "inductor"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    runs = {c: [] for c in args.configs}
    for i in range(args.launches):
        for c in args.configs:
            r = _launch(c, args)
            runs[c].append(r)
            print(f"launch {i + 1}/{args.launches} {c}: steady {r['steady_step_s'] * 1e3:.1f} ms, "
                  f"profiled {r['profiled_step_s'] * 1e3:.1f} ms, all-gathers/step "
                  f"{r['all_gathers_per_step']}, reduce-scatters/step "
                  f"{r['reduce_scatters_per_step']}, exposed comm {r['exposed_comm_s'] * 1e3:.1f} ms; "
                  "per step " + ", ".join(f"{k} {c} ({b / 2**20:.3f} MiB)"
                                          for k, (c, b) in r["comm_per_step"].items()),
                  flush=True)
    summary = {}
    for c, rs in runs.items():
        steady = [r["steady_step_s"] for r in rs]
        summary[c] = {"steady_step_ms": {"median": statistics.median(steady) * 1e3,
                                         "min": min(steady) * 1e3, "max": max(steady) * 1e3},
                      "profiled_over_steady": statistics.median(
                          r["profiled_step_s"] / r["steady_step_s"] for r in rs),
                      "all_gathers_per_step": rs[-1]["all_gathers_per_step"],
                      "reduce_scatters_per_step": rs[-1]["reduce_scatters_per_step"],
                      "comm_per_step": rs[-1]["comm_per_step"],
                      "exposed_comm_ms": statistics.median(r["exposed_comm_s"] for r in rs) * 1e3,
                      "peak_bytes": rs[-1]["peak_bytes"]}
        print(f"{c:>22}: steady step median {summary[c]['steady_step_ms']['median']:.1f} ms "
              f"(min {summary[c]['steady_step_ms']['min']:.1f}, max "
              f"{summary[c]['steady_step_ms']['max']:.1f}); profiled/steady "
              f"{summary[c]['profiled_over_steady']:.2f}; all-gathers/step "
              f"{summary[c]['all_gathers_per_step']}; reduce-scatters/step "
              f"{summary[c]['reduce_scatters_per_step']}; exposed comm {summary[c]['exposed_comm_ms']:.1f} ms")
    meta = {"date": datetime.date.today().isoformat(), "machine": platform.node(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
            "load_avg": os.getloadavg(), "args": vars(args)}
    out = Path(args.out or Path(__file__).parent / "results" /
               f"{meta['date']}-cpu{os.cpu_count()}" / f"step_time-{args.compiler}.json")
    if args.out is None:   # never overwrite an earlier result of the same day
        n = 1
        while out.exists():
            n += 1
            out = out.with_name(f"step_time-{args.compiler}-{n}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "launches": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
