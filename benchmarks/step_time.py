"""Steady-state step time of deepcompile configurations on a tiny Llama, interleaved launches.

    python benchmarks/step_time.py --launches 5 --steps 14 --configs insertion prefetch prefetch+bucket_reduce
    python benchmarks/step_time.py --launches 5 --steps 14 --gas 1 2 4 8 \
        --configs insertion selective_unshard prefetch prefetch+selective_unshard

Each launch spawns `--nproc` gloo ranks on this machine and trains for `--steps` optimizer
steps; the configurations (and gradient-accumulation settings, `--gas`) are interleaved launch
by launch (the machine's load drifts). Per launch: the median steady-state step time (after
warm-up, profiling and passes), the median profiled step time, all-gathers and reduce-scatters
per optimizer step with their bytes (the last step, from comm_stats()), and the profile's
exposed communication. Reports the median of launch medians with min and max, and writes JSON
under benchmarks/results/<date>-<machine>/.
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
    "selective_unshard": {"passes": ("selective_unshard",)},
    "prefetch+selective_unshard": {"passes": ("prefetch", "selective_unshard")},
    "prefetch+bucket_reduce+selective_unshard": {
        "passes": ("prefetch", "bucket_reduce", "selective_unshard")},
}


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
        attn_implementation="eager", use_cache=False))


def _rank(rank, world, port, name, gas, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import deepcompile

    engine = deepcompile.initialize(
        _model(), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        config={"compiler": args.compiler, "gradient_accumulation_steps": gas,
                "memory_budget": args.budget, **CONFIGS[name]})
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        before = engine.comm_stats()
        for _ in range(gas):
            ids = torch.randint(0, 256, (args.batch, args.seq), generator=g)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    after = engine.comm_stats()   # the last optimizer step (steady state)
    per_step = {k: {"count": after[k]["count"] - before[k]["count"],
                    "bytes": after[k]["bytes"] - before[k]["bytes"]}
                for k in ("all_gather", "reduce_scatter")}
    rep = engine.report().to_dict()
    t = rep["timings"]
    if rank == 0:
        queue.put({"config": name, "gas": gas,
                   "steady_step_s": statistics.median(t["steady_steps_s"]),
                   "profiled_step_s": statistics.median(t["profiled_steps_s"]),
                   "all_gathers_per_step": per_step["all_gather"]["count"],
                   "all_gather_bytes_per_step": per_step["all_gather"]["bytes"],
                   "reduce_scatters_per_step": per_step["reduce_scatter"]["count"],
                   "reduce_scatter_bytes_per_step": per_step["reduce_scatter"]["bytes"],
                   "exposed_comm_s": rep["step_summary"]["exposed_comm_s"],
                   "peak_bytes": rep["step_summary"]["peak_bytes"]})
    dist.destroy_process_group()


def _launch(name, gas, args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, args.nproc, port, name, gas, args, queue))
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
    ap.add_argument("--gas", type=int, nargs="+", default=[1],
                    help="gradient accumulation steps; several values: a sweep")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--compiler", default="fx", choices=("fx", "inductor"))
    ap.add_argument("--budget", type=int, default=None, help="memory budget in bytes (CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cells = [(c, gas) for gas in args.gas for c in args.configs]
    runs = {cell: [] for cell in cells}
    for i in range(args.launches):
        for c, gas in cells:
            r = _launch(c, gas, args)
            runs[(c, gas)].append(r)
            print(f"launch {i + 1}/{args.launches} {c} gas {gas}: steady "
                  f"{r['steady_step_s'] * 1e3:.1f} ms, profiled {r['profiled_step_s'] * 1e3:.1f} ms, "
                  f"all-gathers/step {r['all_gathers_per_step']} ({r['all_gather_bytes_per_step']} B), "
                  f"reduce-scatters/step {r['reduce_scatters_per_step']} "
                  f"({r['reduce_scatter_bytes_per_step']} B), exposed comm "
                  f"{r['exposed_comm_s'] * 1e3:.1f} ms", flush=True)
    summary = {}
    for (c, gas), rs in runs.items():
        steady = [r["steady_step_s"] for r in rs]
        last = rs[-1]
        s = summary[f"{c} gas{gas}"] = {
            "config": c, "gas": gas,
            "steady_step_ms": {"median": statistics.median(steady) * 1e3,
                               "min": min(steady) * 1e3, "max": max(steady) * 1e3},
            "profiled_over_steady": statistics.median(
                r["profiled_step_s"] / r["steady_step_s"] for r in rs),
            **{k: last[k] for k in ("all_gathers_per_step", "all_gather_bytes_per_step",
                                    "reduce_scatters_per_step", "reduce_scatter_bytes_per_step",
                                    "peak_bytes")},
            "exposed_comm_ms": statistics.median(r["exposed_comm_s"] for r in rs) * 1e3}
        print(f"{c:>40} gas {gas}: steady step median {s['steady_step_ms']['median']:.1f} ms "
              f"(min {s['steady_step_ms']['min']:.1f}, max {s['steady_step_ms']['max']:.1f}); "
              f"profiled/steady {s['profiled_over_steady']:.2f}; all-gathers/step "
              f"{s['all_gathers_per_step']} ({s['all_gather_bytes_per_step'] / 2**20:.3f} MiB); "
              f"reduce-scatters/step {s['reduce_scatters_per_step']} "
              f"({s['reduce_scatter_bytes_per_step'] / 2**20:.3f} MiB); exposed comm "
              f"{s['exposed_comm_ms']:.1f} ms; peak {s['peak_bytes'] / 2**20:.2f} MiB")
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
    out.write_text(json.dumps({"meta": meta, "summary": summary,
                               "launches": {f"{c} gas{gas}": rs for (c, gas), rs in runs.items()}},
                              indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
