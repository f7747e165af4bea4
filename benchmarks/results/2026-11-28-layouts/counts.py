"""Bytes per optimizer step per group, from comm_stats(by_group=True), under each layout, on 4
gloo CPU ranks laid out as 2 x 2 and 4 x 1 (LOCAL_WORLD_SIZE), with the formula's figures
beside them (docs/design/layouts.md, "What crosses the groups").

    cd tests && PYTHONPATH=../src python ../benchmarks/results/2026-11-28-layouts/counts.py

Writes counts.json next to this file and prints a table (markdown)."""

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, ".")
import _models  # noqa: E402
from _dist import run_distributed  # noqa: E402
from _train import run_training, scenario  # noqa: E402

K = 2   # micro-steps per optimizer step
NODES = {"2x2": "2", "4x1": "1"}


def _sc(nodes, layout, model):
    return scenario(f"{nodes}-{layout}-{model}", model, "sgd", 0.1, gas=K, clip=None, steps=2,
                    env={"LOCAL_WORLD_SIZE": NODES[nodes]}, layout=layout, zero_stage=3,
                    passes=(), record=("comm_groups",))


def padded(model, s):
    return sum(math.ceil(p.numel() / s) * s for p in _models.build_model(model).parameters())


def formula(nodes, layout, model, back):
    """Bytes crossing the groups ("world" + "inter") per step and rank, fp32 (c = r = 4),
    F = every parameter, B = `back` (the backward's re-gathered bytes, measured)."""
    w, g = 4, int(NODES[nodes])
    pw, pg = 4 * padded(model, w), 4 * padded(model, g)
    if layout == "shard":
        return K * 2 * pw + back
    if layout == "hsdp":
        return K * pg // g
    return K * 2 * pw   # hpz: the backward's gathers stay in the group


if __name__ == "__main__":
    scs = [_sc(n, lay, m) for n in ("2x2", "4x1") for m in ("mlp", "llama")
           for lay in ("shard", "hsdp", "hpz")]
    res = run_distributed(run_training, 4, scs, timeout=1800)
    out = {}
    for i, sc in enumerate(scs):
        if "error" in res[0][i]:
            raise SystemExit(res[0][i]["error"])
        step = res[0][i]["comm_groups_step"][-1]
        assert all(r[i]["comm_groups_step"][-1] == step for r in res), sc["id"]
        out[sc["id"]] = step
    Path(__file__).with_name("counts.json").write_text(json.dumps(out, indent=1))
    print("| scenario | bytes across the groups per step (comm_stats) | formula | bytes within a "
          "group |")
    print("|---|---|---|---|")
    for sid, step in out.items():
        nodes, layout, model = sid.split("-")
        crossing = sum(b for grp, kinds in step.items() if grp in ("world", "inter")
                       for _, b in kinds.values())
        intra = sum(b for grp, kinds in step.items() if grp == "intra" for _, b in kinds.values())
        # B: the backward's re-gathered bytes, the same parameters under every layout: hpz's
        # gathers within the group at 2 x 2 (at 4 x 1 its secondary shard is the whole parameter)
        back = out[f"2x2-hpz-{model}"]["intra"]["all_gather"][1]
        print(f"| {sid} | {crossing:,} | {formula(nodes, layout, model, back):,} | {intra:,} |")
