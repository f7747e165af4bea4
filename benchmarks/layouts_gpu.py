"""The data-parallel layouts on 2 GPUs over NCCL (`gpu_acceptance.sh layouts`):

    torchrun --nproc-per-node 2 benchmarks/layouts_gpu.py [--out DIR]

Two GPUs are laid out as two "nodes" of one (Config.shard_group_size=1): "hsdp" shards over one
rank and all-reduces every gradient across the two (the inter-group NCCL communicator),
"hsdp_zero" shards the state over both, reduce-scatters every gradient across the two and
all-gathers the whole parameter into its secondary shard after each step (no gather in a
graph), "hpz" shards over both and keeps the whole parameter as its secondary shard (no
backward gather);
"shard" is ZeRO-3 over both. Each trains tiny-llama (fp32, 4 micro-steps per step, Inductor,
passes="auto") and is checked on every rank:

* its losses against plain eager training of the global batch on this GPU (rank 0);
* its collectives per group (comm_stats(by_group=True)): what the layout runs where;
* the process groups: the layout's NCCL sub-communicators exist once `initialize` returns, and
  training makes none (the number of groups c10d holds does not change).

Prints one JSON line per layout and a verdict; exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 6
TOL = 2e-3   # relative, per step's loss: Inductor's fused kernels against eager on the GPU


def _groups() -> int:
    """Process groups c10d holds (a private table: this script's check only)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    return len(getattr(world, "pg_map", {}) or {})


def _run(layout: str, rank: int, world: int, ref: list[float]) -> dict:
    import deepcompile
    from deepcompile.tools import workloads

    w = workloads.get("tiny-llama-gas4")
    torch._dynamo.reset()
    model = workloads.build_model(w, f"cuda:{rank}")
    config = deepcompile.Config(layout=layout, shard_group_size=1 if layout != "shard" else None,
                                gradient_accumulation_steps=w.gas)
    engine = deepcompile.initialize(model, workloads.make_optimizer, config)
    made = _groups()
    before = engine.comm_stats(by_group=True)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for m in range(w.gas):
            ids = workloads.local_batch(w, step * w.gas + m, rank, world).to(f"cuda:{rank}")
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            total += loss.item()
        engine.step()
        mean = torch.tensor([total / w.gas], device=f"cuda:{rank}")
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    after = engine.comm_stats(by_group=True)
    used = {g: {k: v["count"] - before.get(g, {}).get(k, {"count": 0})["count"]
                for k, v in kinds.items() if v["count"]} for g, kinds in after.items()}
    out = {"layout": layout, "as_run": engine._layout.name, "losses": losses, "groups_used": used,
           "sub_groups_at_initialize": made, "groups_after_training": _groups()}
    dev = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, ref))
    out["max_rel_loss_dev"] = dev
    fails = []
    if dev > TOL:
        fails.append(f"loss deviation {dev:.3g} > {TOL}")
    if out["groups_after_training"] != made:
        fails.append("training made process groups")
    # where the training collectives ran: groups of one rank run none
    ran = {g: set(k) for g, k in used.items() if k}
    want = {"shard": {"world": {"all_gather", "reduce_scatter"}},
            "hsdp": {"inter": {"all_reduce"}},
            "hsdp_zero": {"inter": {"reduce_scatter", "all_gather"}},
            "hpz": {"world": {"all_gather", "reduce_scatter"}}}[layout]
    if layout in ("hsdp", "hsdp_zero"):   # (the world group may carry the engine's checks)
        ran["world"] = ran.get("world", set()) - {"all_reduce"}
        ran = {g: k for g, k in ran.items() if k}
    if ran != want:
        fails.append(f"collectives ran in {ran}, expected {want}")
    out["fails"] = fails
    del engine, model
    torch._dynamo.reset()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != 2:
        print("layouts_gpu.py: run under torchrun --nproc-per-node 2", file=sys.stderr)
        return 2
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device(f"cuda:{rank}"))
    from deepcompile.tools import workloads

    w = workloads.get("tiny-llama-gas4")
    ref = workloads.reference_losses(w, world, STEPS, device=f"cuda:{rank}")
    results = [_run(layout, rank, world, ref)
               for layout in ("shard", "hsdp", "hsdp_zero", "hpz")]
    ok = all(not r["fails"] for r in results)
    if rank == 0:
        for r in results:
            print(json.dumps(r))
        print("layouts_gpu:", "ok" if ok else "FAILED")
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "layouts_gpu.json").write_text(
                json.dumps({"reference": ref, "results": results}, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
