"""The bench's files: JSON (everything), a markdown table, a PNG chart (matplotlib, optional).

All three go to one directory, by default `benchmarks/results/<date>-<machine>/` (machine:
`cpu<N>` or the GPU's name); an existing result is never overwritten (`bench-2.json`, ...).
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

MIB = 2 ** 20


def default_dir(result: dict[str, Any], root: Path | None = None) -> Path:
    meta = result["meta"]
    if meta["device"] == "cuda":
        gpu = meta["hardware"].get("gpu") or "gpu"
        machine = re.sub(r"[^a-z0-9]+", "-", gpu.lower().removeprefix("nvidia ")).strip("-")
    else:
        machine = f"cpu{meta['hardware']['cpus']}"
    root = root or (Path("benchmarks/results") if Path("benchmarks").is_dir()
                    else Path("bench-results"))
    return root / f"{meta['date']}-{machine}"


def _free_stem(directory: Path) -> str:
    n = 1
    while True:
        stem = "bench" if n == 1 else f"bench-{n}"
        if not any((directory / f"{stem}.{ext}").exists() for ext in ("json", "md", "png")):
            return stem
        n += 1


def write(result: dict[str, Any], directory: Path, log=print) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    stem = _free_stem(directory)
    paths = {"json": directory / f"{stem}.json", "md": directory / f"{stem}.md"}
    paths["json"].write_text(json.dumps(result, indent=1, default=str) + "\n")
    paths["md"].write_text(markdown(result))
    png = directory / f"{stem}.png"
    reason = chart(result, png)
    if reason is None:
        paths["png"] = png
    else:
        log(f"[bench] no chart: {reason}")
    return paths


# ---- markdown -----------------------------------------------------------------------------------

def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def _mib(b: float | None) -> str:
    return "—" if not b else f"{b / MIB:.1f}"


_ABBREV = {"all_gather": "ag", "all_reduce": "ar", "reduce_scatter": "rs", "broadcast": "bc",
           "all_to_all": "a2a"}


def _collectives(c: dict[str, Any]) -> str:
    parts = [f"{v['count']} {_ABBREV.get(k, k)}" for k, v in c["transport"].items()]
    return f"{c['count']} ({', '.join(parts)})" if parts else "0"


def _header(meta: dict[str, Any]) -> list[str]:
    hw, v, a = meta["hardware"], meta["versions"], meta["args"]
    lines = [
        f"# deepcompile bench, {meta['date']}, {meta['device']}",
        "",
        f"- command: `{meta['command']}`",
        f"- hardware: {hw.get('cpu_model') or '?'}, {hw['cpus']} CPUs, "
        f"{hw.get('memory_gib', '?')} GiB" + (f"; GPU {hw['gpu']} ({hw['gpu_memory_gib']} GiB)"
                                             if hw.get("gpu") else ""),
        f"- versions: torch {v['torch']}, transformers {v['transformers']}, deepspeed "
        f"{v['deepspeed'] or 'not installed'}, deepcompile {v['deepcompile']} "
        f"(commit {meta.get('commit') or '?'}), Python {v['python']}",
        f"- {a['launches']} launch(es) per system, interleaved; {a['steps']} timed steps per "
        f"launch after >= {a['warmup']} warm-up steps (ours: until its passes are planned and "
        f"its final graphs compiled); ours compiles with `{a['compiler']}`; {a['nproc']} "
        f"{'gloo' if meta['device'] == 'cpu' else 'NCCL'} rank(s)",
        f"- machine load (1/5/15 min) before {meta['load_before']}, after "
        f"{meta.get('load_after')}; wall {meta.get('wall_s')} s; Inductor cache "
        f"{'warm' if meta['inductor_cache']['existed'] else 'cold'} at start",
    ]
    return lines


_NOTES = """\
How to read this (details in `deepcompile bench --help` and src/deepcompile/tools/bench/):
- step ms: median over launches of each launch's median step time (a step = one optimizer step,
  all micro-steps; the slowest rank's time), [min, max] over launches. Depends on the machine's
  load; the columns after it do not.
- × bound: step time over the single-process `torch.compile` run on one rank's batch (no
  communication): 1.0 would be perfect data-parallel scaling on these ranks.
- collectives/step: collectives the transport ran in one optimizer step after warm-up
  (ag all-gather, ar all-reduce, rs reduce-scatter, bc broadcast), counted below every system by
  the profiler; MiB/step: their full-tensor bytes. On gloo a reduce-scatter runs as an
  all-reduce of the full tensor and is counted as one.
- steady RSS: the resident-set high-water mark per rank during the timed steps (reset after
  warm-up), MiB; it includes Python, torch and, for compiled systems, the compiler. base: the
  RSS before the model was built.
- peak GPU (GPU mode): `torch.cuda.max_memory_allocated` over the timed steps, MiB.
- optimizer state: the bytes of the tensors in one rank's optimizer state (AdamW's two moments
  and its step counts; ours and DeepSpeed ZeRO-1: of this rank's 1/N of the parameters; DDP: of
  all of them), each storage once; masters and gradients not included.
- step alloc: peak of tensor memory allocated within one step and not yet freed (activations,
  gathered parameters, gradient and communication buffers), MiB, from the profiler; counted at
  the size asked for, so a buffer reserved but never written (DeepSpeed ZeRO-1/2's reduce
  bucket) counts here and not in RSS.
- first step / one-time: seconds, launch 1 / median over launches. first step: the first
  optimizer step (compilation included); one-time: warm-up time in excess of steady steps
  (compilation, ours' profiling and planning, its final compile). Launch 1 starts with this
  run's caches empty for ours' plans, and with whatever Inductor cache the header says.
- Δloss: largest |loss - reference| over all steps and launches; reference: plain eager
  PyTorch, one process, the global batch (the compute bound: its own rank-0 batch).
"""


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    cuda = meta["device"] == "cuda"
    out = _header(meta) + [""]
    notes: dict[str, int] = {}  # footnote text -> number

    def note(text: str) -> int:
        return notes.setdefault(text, len(notes) + 1)

    for wname, wd in meta["workloads"].items():
        mc = wd["model_config"]
        rows = [e for e in result["results"] if e["workload"] == wname]
        nparams = next((e["info"]["num_params"] for e in rows if e.get("info")), None)
        out += [f"## {wname}", "",
                f"{mc['arch']}: {mc['num_hidden_layers']} layers, hidden {mc['hidden_size']}, "
                f"vocab {mc['vocab_size']}" + (f", {nparams:,} parameters" if nparams else "")
                + f"; {wd['batch']} x {wd['seq']} tokens per rank per micro-step, "
                f"{wd['gas']} micro-step(s) per optimizer step, {wd['dtype']}, AdamW", "",
                "| system | step ms [min, max] | tokens/s | × bound | collectives/step | "
                "MiB/step | " + ("peak GPU MiB" if cuda else "steady RSS MiB (base)") +
                " | step alloc MiB | optimizer state MiB/rank | first step s | one-time s | "
                "Δloss |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in rows:
            if e["status"] != "ok":
                label = {"unavailable": "not available", "same": "not run",
                         "failed": "FAILED"}[e["status"]]
                n = note(f"{e['system']}: {e['reason'].splitlines()[0]}")
                out.append(f"| {e['system']} | {label} [{n}] |" + " |" * 10)
                continue
            s, m = e["step_ms"], e["memory"]
            memory = _mib(m["cuda_max_allocated"]) if cuda else \
                f"{_mib(m['steady_peak_rss'])} ({_mib(m['base_rss'])})"
            name = e["system"]
            if e["failed_launches"]:
                bad = next(r for r in e["launches"] if not r["ok"])
                text = (f"{name}: {e['failed_launches']} launch(es) failed: "
                        f"{bad['reason'].splitlines()[0]}")
                name += f" [{note(text)}]"
            out.append(
                f"| {name} | {s['median']:.1f} [{s['min']:.1f}, {s['max']:.1f}] | "
                f"{e['tokens_per_s']:,.0f} | {_fmt(e['vs_compute_bound'], '.2f')} | "
                f"{_collectives(e['collectives'])} | {_mib(e['collectives']['bytes'])} | "
                f"{memory} | {_mib(m['step_alloc_peak'])} | "
                f"{_state_mib(m.get('optimizer_state'))} | "
                f"{_pair(e['first_step_s'])} | {_pair(e['one_time_s'])} | "
                f"{_fmt(e['loss']['max_abs_diff'], '.1e')} |")
        out.append("")
    if notes:
        out += ["Notes:", ""] + [f"{n}. {text}" for text, n in notes.items()] + [""]
    systems = {e["system"]: e["description"] for e in result["results"]}
    out += ["Systems:", ""] + [f"- `{k}`: {v}" for k, v in systems.items()] + ["", _NOTES]
    return "\n".join(out)


def _state_mib(b: float | None) -> str:
    return "—" if b is None else f"{b / MIB:.2f}"


def _pair(d: dict[str, float]) -> str:
    """launch 1 (cold caches) / median over launches"""
    return f"{d['first_launch']:.2f} / {d['median']:.2f}"


# ---- chart --------------------------------------------------------------------------------------

def supersede(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several bench results as one (`deepcompile bench --replot a.json b.json`): a later run's
    (workload, system) replaces an earlier one's, which stays in the chart marked superseded."""
    merged = {"meta": dict(results[-1]["meta"]), "results": []}
    workloads: dict[str, Any] = {}
    for i, res in enumerate(results):
        workloads.update(res["meta"]["workloads"])
        later = {(e["workload"], e["system"]) for r in results[i + 1:] for e in r["results"]
                 if e["status"] == "ok"}
        for e in res["results"]:
            e = dict(e)
            if (e["workload"], e["system"]) in later:
                e["superseded"] = "by a later run"
            merged["results"].append(e)
    merged["meta"]["workloads"] = workloads
    merged["meta"]["command"] = " + ".join(r["meta"]["command"] for r in results)
    return merged


_PANELS = (
    ("step time, ms (median of launches; min-max)", lambda e: e["step_ms"]["median"], "{:.1f}"),
    ("collectives per optimizer step", lambda e: e["collectives"]["count"], "{:.0f}"),
    ("memory per rank, MiB",
     lambda e: (e["memory"].get("cuda_max_allocated") or e["memory"].get("steady_peak_rss") or 0)
     / MIB, "{:.0f}"),
    ("one-time cost, s (launch 1)",
     lambda e: e["one_time_s"]["first_launch"], "{:.1f}"),
)


def chart(result: dict[str, Any], path: Path) -> str | None:
    """Per workload, one row of panels: step time (with [min, max] whiskers), collectives per
    optimizer step, memory per rank and one-time cost, every bar with its value; a superseded
    entry is hatched and says so. None when written, else why not (matplotlib missing,
    nothing ran)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -c constraints.txt -e '.[bench]')"
    meta = result["meta"]
    rows_of = {w: [e for e in result["results"] if e["workload"] == w and e["status"] == "ok"]
               for w in meta["workloads"]}
    rows_of = {w: r for w, r in rows_of.items() if r}
    if not rows_of:
        return "no system ran"
    bar_h = 0.3
    heights = [0.9 + bar_h * len(r) for r in rows_of.values()]
    fig, axes = plt.subplots(len(rows_of), len(_PANELS), squeeze=False,
                             figsize=(18, 1.3 + sum(heights)),
                             gridspec_kw={"height_ratios": heights, "width_ratios": [3, 2, 2, 2]})
    for axrow, (wname, rows) in zip(axes, rows_of.items()):
        colors = ["tab:blue" if e["kind"] == "ours" else "tab:gray" if e["kind"] == "compile"
                  else "tab:orange" for e in rows]
        hatch = ["//" if e.get("superseded") else "" for e in rows]
        labels = [e["system"] + (" (superseded)" if e.get("superseded") else "") for e in rows]
        ys = range(len(rows))
        for k, (ax, (title, get, fmt)) in enumerate(zip(axrow, _PANELS)):
            vals = [get(e) for e in rows]
            kw = {}
            if k == 0:
                kw["xerr"] = [[v - e["step_ms"]["min"] for v, e in zip(vals, rows)],
                              [e["step_ms"]["max"] - v for v, e in zip(vals, rows)]]
                kw["capsize"] = 2
            bars = ax.barh(ys, vals, color=colors, hatch=hatch, alpha=0.9, **kw)
            for b, v, e in zip(bars, vals, rows):
                x = e["step_ms"]["max"] if k == 0 else v
                ax.text(x, b.get_y() + b.get_height() / 2, " " + fmt.format(v), va="center",
                        fontsize=7)
            ax.set_yticks(list(ys), labels if k == 0 else [""] * len(rows), fontsize=8)
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.margins(x=0.18)
            ax.tick_params(axis="x", labelsize=7)
            ax.set_title((f"{wname}: " if k == 0 else "") + title, fontsize=8.5)
    hw, v = meta["hardware"], meta["versions"]
    where = hw.get("gpu") or f"{hw['cpus']} CPUs ({hw.get('cpu_model') or '?'})"
    title = (f"deepcompile bench {meta['date']}: {where}, torch {v['torch']}, deepspeed "
             f"{v['deepspeed'] or '-'}; blue: ours, orange: peers, gray: compute bound; hatched: "
             "superseded; memory: steady RSS on the CPU, peak allocated on a GPU; one-time: "
             "compile, profiling and planning of launch 1 (cold caches)\n" + textwrap.fill(meta["command"], 180))
    fig.suptitle(title, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
