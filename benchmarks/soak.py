"""Soak (issue 17): a long run of the tiny Llama on CPU ranks (gloo) with every pass, and the same
run without passes, in the same processes one after the other.

    python benchmarks/soak.py [--steps 1000] [--nproc 2] [--trim] [--out FILE]

Per run and rank: the loss of every step; resident memory (RSS) and the number of Python objects
the garbage collector tracks, sampled every `--every` steps after the warm-up; the RSS slope over
the steady steps (least squares, bytes per step), the growth of the object count, the
functional-collective works launched and not yet waited (c10d's work registry), and glibc's
own account of the heap (bytes in use, bytes free but kept: tells a leak from fragmentation).
Between the two runs: the largest loss difference (the passes change where collectives run, not
the arithmetic, so with the fx compiler the losses should agree to float rounding). JSON on
stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime_figures import _batch, _free_port, _model  # noqa: E402


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _libc():
    """glibc, with mallinfo2's return type set; None where it is not glibc >= 2.33."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return libc


def _trim() -> None:
    """Hand the free memory malloc keeps back to the system (glibc's malloc_trim(0))."""
    if _libc() is not None:
        _libc().malloc_trim(0)


def _malloc() -> tuple[int, int]:
    """glibc's own account, over every arena: (bytes the program holds -- in use in the arenas
    plus mmapped blocks --, bytes free inside the arenas that malloc keeps). (-1, -1) without
    glibc. RSS minus the first is memory the allocator retains, not the program: a rise in RSS
    with the first flat is fragmentation, not a leak."""
    if _libc() is None:
        return -1, -1
    m = _libc().mallinfo2()
    return m.uordblks + m.hblkhd, m.fordblks


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def _run(rank: int, passes, a) -> dict:
    import deepcompile

    torch._dynamo.reset()
    engine = deepcompile.initialize(
        _model(a.layers), optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        config={"zero_stage": 3, "compiler": "fx", "passes": passes})
    losses, samples, works, heap = [], [], [], []
    registry = getattr(torch._C._distributed_c10d, "_get_work_registry_size", lambda: -1)
    t0 = time.perf_counter()
    for step in range(a.steps):
        out = engine(**_batch(step, rank))
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
        if step >= a.warmup and (step - a.warmup) % a.every == 0:
            gc.collect()
            if a.trim:
                _trim()
            samples.append((step, _rss(), len(gc.get_objects())))
            works.append(registry())   # functional-collective works launched, not yet waited
            heap.append(_malloc())
    seconds = time.perf_counter() - t0
    steps = [s for s, _, _ in samples]
    rep = engine.report().to_dict()
    kept = [p["pass"] for p in rep["passes"] if p.get("kept", True)]
    del engine
    gc.collect()
    return {"passes": list(passes), "kept": kept, "phase": rep["phase"], "seconds": seconds,
            "losses": losses, "samples": samples,
            "rss_slope_bytes_per_step": _slope(steps, [r for _, r, _ in samples]),
            "rss_first_last": [samples[0][1], samples[-1][1]],
            "objects_first_last": [samples[0][2], samples[-1][2]],
            "objects_slope_per_step": _slope(steps, [o for _, _, o in samples]),
            "unwaited_works_first_last": [works[0], works[-1]],
            "malloc_in_use": [u for u, _ in heap], "malloc_free_kept": [f for _, f in heap],
            "malloc_in_use_slope_bytes_per_step": _slope(steps, [u for u, _ in heap]),
            "malloc_in_use_first_last": [heap[0][0], heap[-1][0]]}


def _worker(rank: int, world: int, port: int, a, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        from deepcompile.passes import known_passes

        every = tuple(p for p in ("offload_optimizer", "selective_unshard", "prefetch",
                                  "bucket_reduce") if p in known_passes())
        queue.put((rank, {"all": _run(rank, every, a), "none": _run(rank, (), a)}))
    except BaseException:   # noqa: BLE001 -- reported by the parent
        import traceback
        queue.put((rank, {"error": traceback.format_exc()}))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=50, help="steps before sampling starts")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--trim", action="store_true",
                   help="malloc_trim(0) before each sample: RSS without the free memory that "
                        "malloc keeps")
    p.add_argument("--out")
    a = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, a.nproc, port, a, queue))
             for r in range(a.nproc)]
    for pr in procs:
        pr.start()
    got = dict(queue.get(timeout=7200) for _ in procs)
    for pr in procs:
        pr.join()
    errors = [r["error"] for r in got.values() if "error" in r]
    if errors:
        raise SystemExit(errors[0])
    summary = []
    for rank in sorted(got):
        r = got[rank]
        dev = max(abs(x - y) for x, y in zip(r["all"]["losses"], r["none"]["losses"]))
        summary.append({"rank": rank, "max_loss_diff_all_vs_none": dev, **{
            f"{k}_{f}": r[k][f] for k in ("all", "none")
            for f in ("kept", "phase", "seconds", "rss_slope_bytes_per_step", "rss_first_last",
                      "objects_first_last", "objects_slope_per_step",
                      "unwaited_works_first_last", "malloc_in_use_slope_bytes_per_step",
                      "malloc_in_use_first_last")}})
    doc = {"command": " ".join(sys.argv), "torch": torch.__version__, "steps": a.steps,
           "nproc": a.nproc, "layers": a.layers, "summary": summary,
           "per_rank": {str(k): v for k, v in got.items()}}
    text = json.dumps(doc, indent=1)
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
