"""The optimizer step of one model's parameters, per parameter against the flat layout (issue 16,
item 4: "the step is a few fused kernels instead of a foreach over hundreds of tensors ... at
world size 1 ours steps faster than plain torch.compile because of it"). On the GPU machine:

    python benchmarks/opt_step.py                       # llama-1b's shapes, AdamW, on cuda

Every way steps AdamW (the bench's hyperparameters) over fp32 parameters of the workload's
shapes (built on the meta device, then allocated; values random, gradients fresh each step):

  torch          `torch.optim.AdamW(params)`, torch's default implementation: what plain
                 `torch.compile` + AdamW runs (foreach on CUDA; the for-loop on the CPU)
  torch-foreach  the same with foreach=True (multi-tensor kernels, ~8 passes per tensor list)
  torch-fused    the same with fused=True (one fused kernel per tensor list)
  flat           deepcompile's flat step (runtime/flat.py: the same `FlatState` the engine
                 builds): the per-parameter gradients folded into each chunk's flat gradient,
                 then the inner optimizer (fused where torch has it) over the chunks
  flat-step      the flat step without the fold (what remains once gradients are written
                 into the flat buffers directly: not built; journal/gpu-readiness.md)

Each way has its own parameters and runs alone (built, warmed up by two steps, timed over
`--rounds` steps, freed); each figure is the median of its rounds.
Bytes per parameter of an fp32 AdamW step: 16 read (master, gradient, 2 moments), 12 written;
the fold adds 8 (gradient read, flat gradient written). Writes JSON (`--out`, default
benchmarks/results/<date>-opt-step-<machine>/opt_step.json, never overwriting).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

from _results import write_json  # benchmarks/_results.py (this script's folder)

WAYS = ("torch", "torch-foreach", "torch-fused", "flat", "flat-step")


def _shapes(workload: str) -> list[tuple]:
    """The workload's parameter shapes (the model built on the meta device)."""
    import torch

    from deepcompile.tools import workloads

    with torch.device("meta"):
        model = workloads.build_model(workloads.get(workload), "meta")
    return [tuple(p.shape) for p in model.parameters()]


class _Way:
    """One way of stepping: its parameters, their gradients (kept, set before each step) and
    the optimizer."""

    def __init__(self, way: str, shapes: list[tuple], device, seed: int) -> None:
        import torch

        from deepcompile.tools.workloads import ADAMW

        self.name = way
        g = torch.Generator(device=device).manual_seed(seed)
        if way.startswith("flat"):   # the engine's shards are flat (1-D), whatever the shape
            shapes = [(torch.Size(s).numel(),) for s in shapes]
        self.params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02)
                       for s in shapes]
        self.grads = [torch.randn(s, device=device, generator=g) * 1e-3 for s in shapes]
        self.flat = None
        if way.startswith("flat"):
            from deepcompile.runtime.flat import FlatState

            facade = torch.optim.AdamW(self.params, **ADAMW)
            self.flat = FlatState.of_parameters(facade, device)
            self.fused = self.flat.fused
        else:
            impl = {"torch": {}, "torch-foreach": {"foreach": True},
                    "torch-fused": {"fused": True}}[way]
            self.opt = torch.optim.AdamW(self.params, **ADAMW, **impl)
            self.fused = bool(impl.get("fused"))

    def __call__(self) -> None:
        if self.flat is None:
            for p, g in zip(self.params, self.grads):
                p.grad = g
            self.opt.step()
            for p in self.params:
                p.grad = None
            return
        flat = self.flat
        if self.name == "flat-step":
            for c in flat.chunks:   # the flat gradient as the backward would leave it
                if not c.grad_allocated:
                    c.grad.untyped_storage().resize_(c.nbytes)
                    c.grad.normal_(0, 1e-3)
            flat.sync_hyperparameters()
            flat.step(flat.chunks)
            return   # the flat gradients stay (not part of this way's step)
        for p, g in zip(self.params, self.grads):
            p.grad = g
        flat.fold_grads()
        flat.sync_hyperparameters()
        flat.step(flat.chunks)
        flat.release_grads()


def measure(shapes: list[tuple], ways: list[str], device: str, rounds: int,
            log=print) -> dict:
    """Each way in turn: built, warmed up, stepped `rounds` times, freed (all five at once
    would not fit one 80 GB GPU at 1 B parameters)."""
    import gc

    import torch

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    out = {}
    for way in ways:
        t0 = time.perf_counter()
        w = _Way(way, shapes, device, seed=0)
        w()            # warm-up: the optimizer state, kernels, the flat gradient's storage
        w()
        sync()
        built_s = time.perf_counter() - t0
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            w()
            sync()
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        moved = 28 + (8 if way == "flat" else 0)
        out[way] = {"median_s": s, "times_s": times, "fused": w.fused,
                    "tensors": len(w.flat.chunks) if w.flat is not None else len(shapes),
                    "gb_per_s": moved * n / s / 1e9,
                    "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
        log(f"[opt_step] {way}: built and warmed in {built_s:.1f} s, median "
            f"{s * 1e3:.2f} ms over {rounds}")
        del w
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="llama-1b",
                   help="the bench workload whose parameter shapes are stepped (default llama-1b)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--out", default=None)
    return p


def main() -> None:
    args = parser().parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    shapes = _shapes(args.workload)
    n = sum(int(torch.Size(s).numel()) for s in shapes)
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.node()
    print(f"[opt_step] {args.workload}: {n:,} parameters in {len(shapes)} tensors, AdamW fp32, "
          f"on {device} ({name}); {args.rounds} rounds", flush=True)
    ways = measure(shapes, args.ways, device, args.rounds,
                   log=lambda s: print(s, flush=True))
    base = ways.get("torch", {}).get("median_s")
    for way, r in ways.items():
        vs = f", {base / r['median_s']:.2f}x torch's default" if base else ""
        print(f"  {way:14s} {r['median_s'] * 1e3:9.2f} ms  {r['gb_per_s']:7.1f} GB/s  "
              f"{r['tensors']:4d} tensors{' fused' if r['fused'] else ''}{vs}")
    record = {
        "command": " ".join([sys.executable] + sys.argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.node(), "device": name, "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "workload": args.workload, "params": n, "tensors": len(shapes), "rounds": args.rounds,
        "ways": ways,
    }
    write_json(record, "opt_step", args.out, f"opt-step-{name}")


if __name__ == "__main__":
    main()
