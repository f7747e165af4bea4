"""How often a rank dies with N functional all-gathers in flight on a gloo group.

    python benchmarks/validation/gloo_inflight.py --launches 10 --rounds 300 --inflight 16 [--out DIR]

Each launch starts 2 ranks (gloo, 127.0.0.1) that run `rounds` rounds of `inflight`
back-to-back `_c10d_functional.all_gather_into_tensor` launches followed by their waits, on
either the default gloo group (two worker threads) or the group the engine makes
(`_compat.serial_gloo_group`, one worker thread). A launch "died" when a rank exited with a
signal or an error. The figure behind the engine's own gloo group: see _compat.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, group_kind: str, rounds: int, inflight: int):
    import faulthandler

    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from deepcompile import _compat

    group = _compat.serial_gloo_group(None) if group_kind == "engine" else dist.group.WORLD
    ag, _, wait = _compat.funcol_ops()
    name = _compat.group_name(group)
    shard = torch.zeros(256)
    with _compat.below_autograd():
        for _ in range(rounds):
            pending = [ag(shard.clone(), world, name) for _ in range(inflight)]
            for t in pending:
                wait(t)
    dist.destroy_process_group()


def _launch(group_kind: str, rounds: int, inflight: int) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, port, group_kind, rounds, inflight))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.is_alive():
            p.kill()
            p.join()
    return [p.exitcode for p in procs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--launches", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--inflight", type=int, default=16)
    ap.add_argument("--groups", nargs="+", default=["default", "engine"])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    result = {"torch": torch.__version__, "python": platform.python_version(),
              "machine": f"{platform.machine()} {os.cpu_count()} cpus",
              "command": "python " + " ".join(sys.argv), "rounds": a.rounds,
              "inflight": a.inflight, "groups": {}}
    for kind in a.groups:
        codes = []
        for i in range(a.launches):
            t0 = time.perf_counter()
            codes.append(_launch(kind, a.rounds, a.inflight))
            print(f"{kind} launch {i}: exit codes {codes[-1]} ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
        died = sum(any(c != 0 for c in cs) for cs in codes)
        result["groups"][kind] = {"launches": a.launches, "died": died, "exit_codes": codes}
        print(f"{kind}: {died} of {a.launches} launches lost a rank", flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
