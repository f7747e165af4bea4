"""The optimizer step of offloaded Adam state, measured two ways on this machine (issue 16,
item 3: "the step staying on the device where it can (or a host step for the part that lives
there, if that is faster: measure)"). Run on the GPU machine before building a host step:

    python benchmarks/host_step.py                       # 1 B parameters, 64 MiB chunks

Both ways run for real over `--params` fp32 parameters in chunks of `--chunk-mib` MiB of
masters (the flat layout's chunk, runtime/flat.py), AdamW with torch's fused kernels:

  streamed   what the runtime does (runtime/offload/, tier 2): per chunk, its Adam moments
             and its gradient copied from pinned host memory to the GPU on one copy stream,
             stepped there, the moments copied back on another; the next chunk's copy in runs
             while this one steps (LOOKAHEAD 1). Masters on the GPU.
  host       DeepSpeed ZeRO-Offload's way, with masters on the GPU: per chunk, the master
             copied down, stepped on the CPU (moments and gradient already there), copied back
             up; the copies of the next and previous chunks run while the CPU steps.
  host-only  the same with the masters on the host too: the CPU step, then the updated
             parameters cast to bf16 and copied up (what a GPU keeps to gather from).

Also measured: pinned H2D and D2H bandwidth (each alone, and both at once), the CPU step's and
the GPU step's time per parameter. Seconds per step are scaled to `--models` sizes (linear in
parameters: every way is per chunk). Without CUDA only the CPU step runs (the suite runs it
that way: tests/test_benchmarks.py). Writes JSON (`--out`, default
benchmarks/results/<date>-host-step-<machine>/host_step.json, never overwriting).
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

MODELS = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "llama-2-13b": 13.02e9}


def _adamw(params, fused: bool):
    import torch

    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=fused)


def _chunks(n: int, per: int) -> list[int]:
    sizes = [per] * (n // per)
    if n % per:
        sizes.append(n % per)
    return sizes


def _timed(fn, repeats: int, sync) -> float:
    fn()   # warm-up: allocations, kernels, the optimizer's state
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _pinned(n: int, dtype, cuda: bool):
    import torch

    t = torch.zeros(n, dtype=dtype)
    return t.pin_memory() if cuda else t


def _host_state(sizes: list[int], cuda: bool):
    """Per chunk: a master, its gradient, and an AdamW over it whose moments exist (pinned)."""
    import torch

    out = []
    for n in sizes:
        master = torch.nn.Parameter(_pinned(n, torch.float32, cuda))
        master.grad = _pinned(n, torch.float32, cuda).normal_()
        opt = _adamw([master], fused=True)
        opt.step()                                     # creates exp_avg, exp_avg_sq
        st = opt.state[master]
        if cuda:
            for k in ("exp_avg", "exp_avg_sq"):
                st[k] = st[k].pin_memory()
        out.append((master, opt))
    return out


def cpu_step(sizes: list[int], repeats: int) -> dict:
    """The CPU's fused AdamW over every chunk, one after another (no copies)."""
    chunks = _host_state(sizes, cuda=False)

    def run():
        for _, opt in chunks:
            opt.step()
    s = _timed(run, repeats, lambda: None)
    n = sum(sizes)
    import torch

    return {"seconds": s, "ns_per_param": s / n * 1e9, "threads": torch.get_num_threads(),
            "gb_per_s": 28 * n / s / 1e9}   # reads master, grad, 2 moments; writes 3


def cuda_figures(sizes: list[int], repeats: int) -> dict:
    import torch

    dev = torch.device("cuda")
    n, per = sum(sizes), max(sizes)
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    sync = torch.cuda.synchronize
    out: dict = {"gpu": torch.cuda.get_device_name(0)}

    # bandwidth from pinned memory, one chunk of `per` fp32 elements at a time
    host = _pinned(per * 4, torch.float32, True)
    devbuf = torch.empty(per * 4, dtype=torch.float32, device=dev)
    nbytes = host.numel() * 4
    for name, fn in (
            ("h2d", lambda: devbuf.copy_(host, non_blocking=True)),
            ("d2h", lambda: host.copy_(devbuf, non_blocking=True))):
        s = _timed(fn, repeats, sync)
        out[f"{name}_gb_per_s"] = nbytes / s / 1e9
    host2 = _pinned(per * 4, torch.float32, True)
    devbuf2 = torch.empty_like(devbuf)

    def both():
        with torch.cuda.stream(h2d):
            devbuf.copy_(host, non_blocking=True)
        with torch.cuda.stream(d2h):
            host2.copy_(devbuf2, non_blocking=True)
    s = _timed(both, repeats, sync)
    out["duplex_gb_per_s"] = 2 * nbytes / s / 1e9
    del host, host2, devbuf, devbuf2

    # the GPU's fused AdamW over `per` parameters, all on the device
    p = torch.nn.Parameter(torch.zeros(per, device=dev))
    p.grad = torch.randn(per, device=dev)
    opt = _adamw([p], fused=True)
    s = _timed(opt.step, repeats, sync)
    out["gpu_step_ns_per_param"] = s / per * 1e9
    del p, opt

    chunks = _host_state(sizes, cuda=True)
    masters = [torch.zeros(m.numel(), device=dev) for m, _ in chunks]
    # the device's optimizers (the runtime's inner one): their state tensors are swapped for
    # the chunk's staged ones before each step, as runtime/offload/ does
    placeholder = torch.empty(0, device=dev)
    device_opts = []
    for master in masters:
        p = torch.nn.Parameter(master)
        p.grad = torch.zeros_like(master)
        opt = _adamw([p], fused=True)
        opt.step()
        opt.state[p].update(exp_avg=placeholder, exp_avg_sq=placeholder)
        p.grad = None
        device_opts.append((p, opt))

    def streamed():
        # per chunk: moments + gradient in (h2d stream), step (compute), moments out (d2h)
        staged, loaded = {}, {}

        def copy_in(i):
            master, opt = chunks[i]
            st = opt.state[master]
            with torch.cuda.stream(h2d):
                staged[i] = [t.to(dev, non_blocking=True)
                             for t in (st["exp_avg"], st["exp_avg_sq"], master.grad)]
                loaded[i] = torch.cuda.Event()
                loaded[i].record(h2d)
        copy_in(0)
        for i in range(len(chunks)):
            if i + 1 < len(chunks):
                copy_in(i + 1)
            torch.cuda.current_stream().wait_event(loaded[i])
            m, v, g = staged.pop(i)
            for t in (m, v, g):
                t.record_stream(torch.cuda.current_stream())
            p, opt = device_opts[i]
            opt.state[p].update(exp_avg=m, exp_avg_sq=v)
            p.grad = g
            opt.step()
            opt.state[p].update(exp_avg=placeholder, exp_avg_sq=placeholder)
            p.grad = None
            d2h.wait_stream(torch.cuda.current_stream())
            master, opt = chunks[i]
            st = opt.state[master]
            with torch.cuda.stream(d2h):
                st["exp_avg"].copy_(m, non_blocking=True)
                st["exp_avg_sq"].copy_(v, non_blocking=True)
                m.record_stream(d2h)
                v.record_stream(d2h)
    out["streamed_s"] = _timed(streamed, repeats, sync)

    def host_step(masters_on_host: bool):
        # per chunk: master down (d2h), CPU step, master (or bf16 parameters) up (h2d)
        bf16 = [_pinned(m.numel(), torch.bfloat16, True) for m, _ in chunks] \
            if masters_on_host else None
        up = [torch.empty(m.numel(), dtype=torch.bfloat16 if masters_on_host else torch.float32,
                          device=dev) for m, _ in chunks]

        def run():
            down = []
            d2h.wait_stream(torch.cuda.current_stream())   # the masters as the GPU left them
            if not masters_on_host:
                for i, (master, _) in enumerate(chunks):   # queued at once: one copy stream
                    with torch.cuda.stream(d2h):
                        master.data.copy_(masters[i], non_blocking=True)
                        e = torch.cuda.Event()
                        e.record(d2h)
                    down.append(e)
            for i, (master, opt) in enumerate(chunks):
                if down:
                    down[i].synchronize()
                opt.step()
                src = master.data
                if masters_on_host:
                    bf16[i].copy_(master.data)
                    src = bf16[i]
                with torch.cuda.stream(h2d):
                    up[i].copy_(src, non_blocking=True)
        return run
    out["host_s"] = _timed(host_step(False), repeats, sync)
    out["host_only_s"] = _timed(host_step(True), repeats, sync)
    out["params"] = n
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=1e9, help="fp32 parameters (default 1e9)")
    p.add_argument("--chunk-mib", type=float, default=64.0,
                   help="master bytes per chunk (runtime/flat.py's CHUNK_BYTES: 64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU")
    p.add_argument("--out", default=None)
    return p


def main() -> None:
    args = parser().parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    n = int(args.params)
    per = max(1, int(args.chunk_mib * 2**20) // 4)
    if n < 1:
        sys.exit("--params must be at least 1")
    sizes = _chunks(n, per)
    cuda = torch.cuda.is_available()
    print(f"[host_step] {n:,} parameters in {len(sizes)} chunks of up to {per:,}; "
          f"CUDA: {cuda}; CPU threads {torch.get_num_threads()}", flush=True)
    record = {
        "command": " ".join([sys.executable] + sys.argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
        "params": n, "chunks": len(sizes), "chunk_params": per,
        "cpu_step": cpu_step(sizes, args.repeats),
        "cuda": cuda_figures(sizes, args.repeats) if cuda else None,
    }
    c = record["cpu_step"]
    print(f"CPU fused AdamW: {c['seconds']:.3f} s ({c['ns_per_param']:.2f} ns/param, "
          f"{c['gb_per_s']:.1f} GB/s, {c['threads']} threads)")
    scaled = {}
    g = record["cuda"]
    if g is not None:
        print(f"{g['gpu']}: pinned H2D {g['h2d_gb_per_s']:.1f} GB/s, D2H {g['d2h_gb_per_s']:.1f}, "
              f"both at once {g['duplex_gb_per_s']:.1f}; GPU fused AdamW "
              f"{g['gpu_step_ns_per_param']:.3f} ns/param")
        print(f"per step over {n:,} parameters: streamed {g['streamed_s']:.3f} s, host "
              f"{g['host_s']:.3f} s, host with masters on the host {g['host_only_s']:.3f} s")
        for model, size in MODELS.items():
            scaled[model] = {k: g[k] * size / n for k in ("streamed_s", "host_s", "host_only_s")}
            print(f"  {model} ({size / 1e9:.2f} B), all state off the device: " + ", ".join(
                f"{k.removesuffix('_s')} {v:.2f} s" for k, v in scaled[model].items()))
    record["scaled_to_models"] = scaled
    write_json(record, "host_step", args.out, f"host-step-{g['gpu'] if g else platform.node()}")


if __name__ == "__main__":
    main()
