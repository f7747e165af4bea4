"""The pictures of a report (`engine.plot(dir)`, `deepcompile report FILE --plot DIR`).

* memory.png: live memory over the profiled step, one line per rank, the budget as a line,
  each graph's span shaded and named;
* timeline.png: the traced steady step (`engine.trace_next_step()`), per rank, from real
  timestamps: graph calls, collective launches (labelled with their modules), waits in which
  the host was blocked (the exposed communication, red) and the transport's own work;
* passes.png: each pass's before and after (collectives per step, exposed communication, peak
  memory, measured step time), kept or reverted;
* steps.png: the time of every optimizer step through warm-up, profiling, measuring and the
  final compile, coloured by phase.

Drawn with matplotlib, an optional dependency (`pip install -c constraints.txt -e '.[plot]'`):
without it, `MissingPlotting` names the extra. Everything is read from the report's JSON, so a
saved report draws the same pictures in another process.
"""

from __future__ import annotations

import os
from typing import Any

from .report import Report

PHASE_COLORS = {"warmup": "tab:gray", "profile": "tab:orange", "measure": "tab:purple",
                "steady": "tab:blue"}
LANES = ("graphs", "launch", "exposed", "transport", "device")
LANE_COLORS = {"graphs": "tab:blue", "launch": "tab:green", "exposed": "tab:red",
               "transport": "tab:orange", "device": "tab:purple"}
LANE_NAMES = {"graphs": "graph calls", "launch": "launches", "exposed": "exposed (blocked)",
              "transport": "transport", "device": "GPU compute"}


class MissingPlotting(ImportError):
    pass


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingPlotting("deepcompile: drawing needs matplotlib, an optional extra: "
                              "pip install -c constraints.txt -e '.[plot]' (or pip install "
                              "matplotlib)") from e
    return plt


# -- data -------------------------------------------------------------------------------------
def rank_data(engine) -> dict[str, Any]:
    """This rank's part of the pictures: its own profiled step (memory), its traced step."""
    pipe = engine._pipeline
    order = pipe.order or sorted(pipe.slots)
    points, spans, t = [], [], 0.0
    for key in order:
        slot = pipe.slots.get(key)
        prof = slot.local if slot is not None else None
        if prof is None:
            continue
        spans.append([key, t, prof.total_s])
        points += [[t + n.start_s + n.time_s, n.live_bytes] for n in prof.nodes]
        t += prof.total_s
    label = next((s.history[-1][0] for s in pipe.slots.values() if s.history), None)
    return {"rank": engine._comm.rank, "memory": {"points": points, "graphs": spans,
                                                  "profile": label},
            "trace": engine._tracer.result}


def gather_report(engine) -> Report:
    """`engine.report()` with every rank's `rank_data` (collective)."""
    report = engine.report()
    report.ranks = engine._comm.all_gather_object(rank_data(engine))
    return report


# -- pictures ---------------------------------------------------------------------------------
def plot_report(report: Report | dict, directory: str | os.PathLike) -> list[str]:
    """Write the PNGs of `report` into `directory`; returns their paths (a picture whose data
    the report lacks is left out: no traced step, no passes)."""
    if isinstance(report, dict):
        report = Report.from_dict(report)
    plt = _plt()
    os.makedirs(directory, exist_ok=True)
    out = []
    for name, draw in (("memory.png", _memory), ("timeline.png", _timeline),
                       ("passes.png", _passes), ("steps.png", _steps)):
        fig = draw(plt, report)
        if fig is None:
            continue
        path = os.path.join(directory, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out


def _title(report: Report) -> str:
    c = report.config
    passes = c["passes"] if isinstance(c["passes"], str) else ",".join(c["passes"]) or "none"
    kept = [p["pass"] for p in report.passes if p.get("kept", True) and p.get("changed")]
    return (f"ZeRO-{c['zero_stage']}, {report.world_size} ranks, compiler {c['compiler']}, "
            f"passes={passes}" + (f" (kept: {', '.join(kept)})" if kept else ""))


def _memory(plt, report: Report):
    ranks = [r for r in (report.ranks or []) if r["memory"]["points"]]
    if not ranks:
        return None
    fig, ax = plt.subplots(figsize=(11, 4.5))
    top = 0.0
    for r in ranks:
        pts = r["memory"]["points"]
        xs = [p[0] * 1e3 for p in pts]
        ys = [p[1] / 2**20 for p in pts]
        top = max(top, max(ys))
        ax.step(xs, ys, where="post", label=f"rank {r['rank']} (peak {max(ys):.2f} MiB)", lw=1.2)
    spans = ranks[0]["memory"]["graphs"]
    for i, (key, t, dur) in enumerate(spans):
        ax.axvspan(t * 1e3, (t + dur) * 1e3, color="0.92" if i % 2 else "0.97", zorder=0)
    budget = report.memory_budget_bytes
    if budget is not None:
        ax.axhline(budget / 2**20, color="tab:red", ls="--", lw=1.2,
                   label=f"budget {budget / 2**20:.2f} MiB")
        top = max(top, budget / 2**20)
    else:
        ax.text(0.99, 0.97, "memory budget: unbounded", transform=ax.transAxes, ha="right",
                va="top", fontsize=8, color="tab:red")
    ax.set_ylim(0, top * 1.12 or 1)
    ax.set_xlabel("time within the profiled step, ms (node-by-node profile)")
    ax.set_ylabel("live memory, MiB")
    ax.set_title(f"Memory over the step, per rank — profile '{ranks[0]['memory']['profile']}'\n"
                 + _title(report), fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    _span_labels(fig, ax, spans)
    return fig


def _span_labels(fig, ax, spans: list) -> None:
    """Each graph's name under its span, in the lowest of a few rows where it overlaps no
    other name (short graphs side by side would print over each other); a name with no room
    in any row is left out (its span is still shaded)."""
    renderer = fig.canvas.get_renderer()
    to_data = ax.transData.inverted()
    rows: list[float] = []   # the right end of the last name in each row, ms
    for key, t, dur in spans:
        mid = (t + dur / 2) * 1e3
        text = ax.text(mid, 0.02, key, transform=ax.get_xaxis_transform(), ha="center",
                       fontsize=8, color="0.3")
        box = text.get_window_extent(renderer)
        (x0, _), (x1, _) = to_data.transform([(box.x0, box.y0), (box.x1, box.y1)])
        row = next((i for i, end in enumerate(rows) if x0 > end), len(rows))
        if row >= 4:
            text.remove()
            continue
        if row == len(rows):
            rows.append(x1)
        rows[row] = x1
        text.set_y(0.02 + 0.055 * row)


def _timeline(plt, report: Report):
    ranks = [r for r in (report.ranks or []) if r.get("trace")]
    if not ranks:
        return None
    fig, axes = plt.subplots(len(ranks), 1, figsize=(13, 2.4 + 1.9 * len(ranks)), squeeze=False,
                             sharex=True)
    # one time axis for all ranks where their clocks agree (one machine: the same clock)
    t0s = [r["trace"].get("t0_ns") for r in ranks]
    aligned = None not in t0s and max(t0s) - min(t0s) < 10e9
    for ax, r in zip(axes[:, 0], ranks):
        tr = r["trace"]
        if aligned:
            shift = (tr["t0_ns"] - min(t0s)) / 1e9
            tr = {**tr, "events": [{**e, "ts_s": e["ts_s"] + shift} for e in tr["events"]]}
        lanes = [lane for lane in LANES if lane != "device"
                 or any(e["lane"] == "device" for e in tr["events"])]
        for lane_i, lane in enumerate(lanes):
            evs = [e for e in tr["events"] if e["lane"] == lane]
            ax.broken_barh([(e["ts_s"] * 1e3, max(e["dur_s"] * 1e3, 0.002)) for e in evs],
                           (lane_i - 0.4, 0.8), color=LANE_COLORS[lane], alpha=0.85)
            if lane in ("graphs",):
                for e in evs:
                    if e["dur_s"] * 1e3 > tr["step_s"] * 1e3 * 0.04:
                        ax.text((e["ts_s"] + e["dur_s"] / 2) * 1e3, lane_i, e["name"],
                                ha="center", va="center", fontsize=7, color="white")
        # the longest exposed waits, named by the collective they waited for
        waits = sorted((e for e in tr["events"] if e["lane"] == "exposed"),
                       key=lambda e: -e["dur_s"])[:4]
        for e in waits:
            ax.annotate(f"{e['name']} ({e['dur_s'] * 1e3:.2f} ms)",
                        ((e["ts_s"] + e["dur_s"] / 2) * 1e3, lanes.index("exposed") + 0.4),
                        xytext=(0, 10), textcoords="offset points", ha="center", fontsize=6.5,
                        color="tab:red", arrowprops={"arrowstyle": "-", "color": "tab:red", "lw": 0.6})
        ax.set_yticks(range(len(lanes)), [LANE_NAMES[lane] for lane in lanes], fontsize=8)
        ax.set_ylim(-0.6, len(lanes) + 0.2)
        ax.invert_yaxis()
        # the title's figures are those of the axis: the traced span (the step's time also
        # counts what ran between the previous step and the trace's start)
        span = max((e["ts_s"] + e["dur_s"] for e in tr["events"]), default=0.0) - \
            min((e["ts_s"] for e in tr["events"]), default=0.0)
        ax.set_title(f"rank {r['rank']}: {tr['phase']} step, {span * 1e3:.2f} ms traced (step "
                     f"time {tr['step_s'] * 1e3:.2f} ms); exposed communication "
                     f"{tr['exposed_s'] * 1e3:.2f} ms "
                     f"({100 * tr['exposed_s'] / max(span, 1e-12):.0f}% of the traced span)",
                     fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time from the start of the traced step, ms (torch.profiler"
                           + ("; one clock for all ranks)" if aligned else "; per rank)"))
    fig.suptitle("Compute and communication of a steady step — " + _title(report), fontsize=9)
    fig.tight_layout()
    return fig


def _passes(plt, report: Report):
    entries = [e for e in report.passes if e.get("after")]
    if not entries:
        return None
    metrics = [("collectives / step", lambda s: s["collectives"], "{:.0f}"),
               ("exposed comm, ms (profile)", lambda s: s["exposed_comm_s"] * 1e3, "{:.2f}"),
               ("peak memory, MiB", lambda s: s["peak_bytes"] / 2**20, "{:.2f}"),
               ("measured step, ms", lambda s: (sorted(s["measured_s"])[len(s["measured_s"]) // 2]
                                                * 1e3) if s.get("measured_s") else None, "{:.1f}")]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 1.6 + 0.55 * len(entries)),
                             squeeze=False)
    names = [f"{e['pass']}\n{'kept' if e.get('kept', True) else 'REVERTED'}" for e in entries]
    for ax, (title, get, fmt) in zip(axes[0], metrics):
        for i, e in enumerate(entries):
            for j, (which, color) in enumerate((("before", "0.65"), ("after", "tab:blue" if
                                                e.get("kept", True) else "tab:red"))):
                v = get(e[which])
                if v is None:
                    continue
                y = i + (j - 0.5) * 0.38
                ax.barh(y, v, height=0.36, color=color)
                ax.text(v, y, " " + fmt.format(v), va="center", fontsize=7)
        ax.set_yticks(range(len(entries)), names if ax is axes[0][0] else [""] * len(entries),
                      fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9)
        ax.margins(x=0.25)
    axes[0][0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color="0.65"),
                               plt.Rectangle((0, 0), 1, 1, color="tab:blue"),
                               plt.Rectangle((0, 0), 1, 1, color="tab:red")],
                      labels=["before", "after (kept)", "after (reverted)"], fontsize=7,
                      loc="lower right")
    fig.suptitle("Each pass, before and after (in the order they ran) — " + _title(report),
                 fontsize=9)
    fig.tight_layout()
    return fig


def _steps(plt, report: Report):
    log = report.step_log
    if not log:
        return None
    fig, ax = plt.subplots(figsize=(11, 4))
    xs = list(range(1, len(log) + 1))
    ys = [s * 1e3 for _, s in log]
    colors = [PHASE_COLORS.get(ph, "k") for ph, _ in log]
    ax.bar(xs, ys, color=colors, width=0.8)
    ax.set_yscale("log")
    for x, y in zip(xs, ys):
        if len(log) <= 40:
            ax.text(x, y, f"{y:.0f}" if y >= 10 else f"{y:.1f}", ha="center", va="bottom",
                    fontsize=6.5)
    seen = []
    for ph, _ in log:
        if ph not in seen:
            seen.append(ph)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=PHASE_COLORS.get(p, "k")) for p in seen],
              labels=seen, fontsize=8, loc="upper right")
    ax.set_xlabel("optimizer step (step 1 compiles; the first steady step runs the final compile)")
    ax.set_ylabel("step time, ms (log)")
    ax.set_title("Step time through warm-up, profiling, measuring and the final compile — "
                 + _title(report), fontsize=9)
    fig.tight_layout()
    return fig
