"""Activations and layouts on 32 and 128 H100s, predicted by `deepcompile plan`.

    python benchmarks/plan_activations_layouts.py [--parts activations layouts] [--out DIR]

activations: Llama-3-70B and Mixtral-8x7B on 4 x 8 H100, batch 1 per GPU, seq 1024 and 4096,
GAS 1: ZeRO-3 with every decoder layer checkpointed (`--activation-checkpointing`, insertion
only, and with every pass), ZeRO-3 with nothing, ZeRO-3 + `activation_budget`, and every pass
with `activation_budget` (in `auto`'s order, `Pass.order`: after `offload_optimizer`, before
the others; and first of all); then the micro-batch doubled while the peak of every pass + the
activation pass fits in the GPU's memory, and every pass + checkpointing at the largest
micro-batch that fits.

layouts: the same models on 4 x 8 (seq 1024, GAS 1, 4, 16) and 16 x 8 (GAS 1), passes="auto",
every layout (shard, hsdp, hpz) and the one `Config.layout="auto"` picks.

A model, not a measurement: the figures depend on the assumed figures only (printed with each
plan; `net.host_step_ns` is set here, not measured). Writes activations.{json,md} and
layouts.{json,md} under --out (default benchmarks/results/<today>-plan-activations-layouts/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

MODELS = ("llama-3-70b", "mixtral-8x7b")
EVERY = ("prefetch", "bucket_reduce", "selective_unshard", "offload_optimizer")
ACTS = ("activation_budget",)
ASSUME = {"net.host_step_ns": 2.0}   # the target host's optimizer step (not this machine's)
MAX_BATCH = 8
SEQS = (1024, 4096)
RUNS = tuple((nodes, gas, MODELS) for nodes, gas in ((4, 1), (4, 4), (4, 16), (16, 1)))
GiB = 2**30


def _auto_order(names: tuple[str, ...]) -> tuple[str, ...]:
    """`names` in the order `passes="auto"` runs them (`Pass.order`)."""
    from deepcompile.passes import get_pass

    return tuple(sorted(names, key=lambda n: get_pass(n).order))


def _cli(args) -> str:
    """The `deepcompile plan` command line that makes the same plan."""
    words = ["deepcompile", "plan", "--model", args.model, "--nodes", str(args.nodes),
             "--gpus-per-node", str(args.gpus_per_node), "--seq", str(args.seq), "--batch",
             str(args.batch), "--gas", str(args.gas)]
    for ps in args.passes:
        words += ["--passes", ps if isinstance(ps, str) else ",".join(ps)]
    words += ["--peers", ",".join(args.peers)]
    if args.layouts is not None:
        words += ["--layouts", ",".join(args.layouts)]
    if args.ac:
        words.append("--activation-checkpointing")
    for k, v in args.assume.items():
        words += ["--assume", f"{k}={v:g}"]
    return shlex.join(words)


def _plan(**kw):
    from deepcompile.tools.plan import plan as P

    args = P.PlanArgs(gpu="h100", peers=(), assume=dict(ASSUME), **kw)
    t0 = time.perf_counter()
    plan = P.make_plan(args)
    print(f"[{time.perf_counter() - t0:.0f} s] {_cli(args)}", flush=True)
    return plan, _cli(args)


def _row(plan, r: dict, what: str, command: str) -> dict:
    return {"what": what, "model": plan.args.model, "seq": plan.args.seq, "batch": plan.args.batch,
            "gas": plan.args.gas, "nodes": plan.args.nodes, "ac": plan.args.ac,
            "system": r["system"], "layout": r["layout"], "step_s": r["step_s"],
            "tokens_per_s": r["tokens_per_s"], "peak_gib": r["peak_bytes"] / GiB,
            "fits": r["fits"], "exposed_comm_s": r["exposed_comm_s"],
            "decisions": r["decisions"], "command": command}


def activations(out: Path, seqs=SEQS, models=MODELS, max_batch=MAX_BATCH) -> list[dict]:
    from deepcompile.tools.plan.plan import PlanError

    rows: list[dict] = []

    def add(*new):
        rows.extend(new)
        _write(out, "activations", rows, _activations_md(rows))

    for seq in seqs:
        for model in models:
            base = dict(model=model, nodes=4, gpus_per_node=8, seq=seq, gas=1, layouts=("shard",))
            plan, cmd = _plan(batch=1, ac=True, passes=[(), EVERY], **base)
            rs = plan.rows()
            add(_row(plan, rs[0], "ZeRO-3 + full checkpointing", cmd),
                _row(plan, rs[1], "every pass + full checkpointing", cmd))
            every = _auto_order(EVERY + ACTS)
            plan, cmd = _plan(batch=1, passes=[(), ACTS, every, ACTS + EVERY], **base)
            rs = plan.rows()
            add(_row(plan, rs[0], "ZeRO-3", cmd),
                _row(plan, rs[1], "ZeRO-3 + activation pass", cmd),
                _row(plan, rs[2], "every pass + activation pass", cmd),
                _row(plan, rs[3], "activation pass, then every pass", cmd))
            batch, fits = 2, 1
            while batch <= max_batch:   # the micro-batch doubled while the peak fits
                plan, cmd = _plan(batch=batch, passes=[every], **base)
                r = plan.rows()[0]
                add(_row(plan, r, "every pass + activation pass", cmd))
                if not r["fits"]:
                    break
                batch, fits = batch * 2, batch
            if fits > 1:   # full checkpointing at the same micro-batch
                try:
                    plan, cmd = _plan(batch=fits, ac=True, passes=[EVERY], **base)
                    add(_row(plan, plan.rows()[0], "every pass + full checkpointing", cmd))
                except PlanError as e:   # the fit check refuses it
                    print(f"  batch {fits}: {e}", flush=True)
    return rows


def _activations_md(rows: list[dict]) -> str:
    lines = ["| model | seq | what | batch | step s | tokens/s | peak GiB | fits | "
             "activation pass |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r["decisions"].get("activation_budget") or {}
        act = "-"
        if "recomputed" in d:
            act = (f"{d['recomputed']} recomputed ({d['recomputed_bytes'] / GiB:.1f} GiB, "
                   f"{d['recompute_flops'] / 1e12:.1f} TFLOP), {d['offloaded']} offloaded "
                   f"({d['offloaded_bytes'] / GiB:.1f} GiB)"
                   + (", unattainable" if d["unattainable"] else ""))
        lines.append(f"| {r['model']} | {r['seq']} | {r['what']} | {r['batch']} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} | "
                     f"{'yes' if r['fits'] else 'NO'} | {act} |")
    return "\n".join(lines)


def layouts(out: Path, runs=RUNS) -> list[dict]:
    rows = []
    for nodes, gas, models in runs:
        for model in models:
            if True:
                plan, cmd = _plan(model=model, nodes=nodes, gpus_per_node=8, seq=1024, batch=1,
                                  gas=gas, passes=["auto"])
                for r in plan.rows():
                    row = _row(plan, r, "passes=auto", cmd)
                    row["auto_picks"] = plan.layout_choice["layout"]
                    row["auto_why"] = plan.layout_choice["why"]
                    row["auto_figures"] = plan.layout_choice.get("figures")
                    row["across_gib"] = r["across_nodes_bytes"] / GiB
                    rows.append(row)
                _write(out, "layouts", rows, _layouts_md(rows))
    return rows


def _layouts_md(rows: list[dict]) -> str:
    lines = ["| model | nodes x 8 | GAS | shard | hsdp | hpz | auto picks | fastest that fits |",
             "|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["model"], r["nodes"], r["gas"]) for r in rows},
                  key=lambda k: (k[1], k[0], k[2]))
    for key in keys:
        rs = {r["layout"]: r for r in rows if (r["model"], r["nodes"], r["gas"]) == key}
        cell = lambda r: (f"{r['step_s']:.3f} s, {r['tokens_per_s']:,.0f} tok/s, "  # noqa: E731
                          f"{r['peak_gib']:.1f} GiB" + ("" if r["fits"] else " (NO fit)"))
        fits = [n for n, r in rs.items() if r["fits"]]
        best = min(fits, key=lambda n: rs[n]["step_s"]) if fits else "-"
        pick = next(iter(rs.values()))["auto_picks"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | "
                     + " | ".join(cell(rs[n]) if n in rs else "-" for n in ("shard", "hsdp", "hpz"))
                     + f" | {pick} | {best} |")
    return "\n".join(lines)


def _write(out: Path, name: str, rows: list[dict], table: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(
        {"assumed": ASSUME, "rows": rows}, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(table + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["activations", "layouts"],
                    choices=["activations", "layouts"])
    ap.add_argument("--runs", nargs="+", default=None, metavar="NODES:GAS[:MODEL]",
                    help="layouts: these (nodes, GAS[, model]) only (default: all)")
    ap.add_argument("--seqs", nargs="+", type=int, default=SEQS, help="activations: sequences")
    ap.add_argument("--models", nargs="+", default=MODELS, help="activations: models")
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH, help="activations: the largest "
                    "micro-batch tried (default: %(default)s)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = RUNS if args.runs is None else tuple(
        (int(r.split(":")[0]), int(r.split(":")[1]),
         tuple(r.split(":")[2:]) or MODELS) for r in args.runs)
    out = Path(args.out or Path(__file__).parent / "results" /
               f"{datetime.date.today().isoformat()}-plan-activations-layouts")
    for part in args.parts:
        if part == "activations":
            rows = activations(out, args.seqs, args.models, args.max_batch)
        else:
            rows = layouts(out, runs)
        print((_activations_md if part == "activations" else _layouts_md)(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
