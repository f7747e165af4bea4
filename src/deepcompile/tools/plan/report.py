"""A plan as a table, as JSON, and as a picture (one step's timeline and memory; matplotlib is
optional: `pip install -c constraints.txt matplotlib`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...passes import activation_budget

GiB = 2**30


def _ratio(a: float | None, b: float | None) -> str:
    return f"{b / a:.2f}x" if a and b else "-"


def _colls(c: dict[str, dict[str, int]]) -> str:
    short = {"all_gather": "ag", "reduce_scatter": "rs", "all_reduce": "ar"}
    return " ".join(f"{v['count']} {short.get(k, k)}" for k, v in sorted(c.items()) if v["count"])


def table(plan) -> str:
    a = plan.args
    rows = plan.rows()
    ref = {r["system"]: r["step_s"] for r in rows}
    ds = "ds-z3" if a.stage == 3 else "ds-z1"   # the DeepSpeed peer of the stage
    base_ds = ref.get(ds)
    base_z3 = ref.get(f"ours-z{a.stage}")
    where = "this machine (measured)" if a.gpu == "cpu" else f"{a.gpu}"
    lines = [
        f"deepcompile plan: {plan.shape.name} ({plan.params / 1e9:.2f} B parameters) on "
        f"{a.nodes} x {a.gpus_per_node} {where}, ZeRO-{a.stage}, batch {a.batch} x seq {a.seq} per "
        f"GPU, {a.gas} micro-step(s) per optimizer step"
        + (", activation checkpointing" if a.ac else ""),
        "",
        "| system | layout | step s | tokens/s | TFLOPs/GPU | exposed comm s | peak GiB | fits | "
        f"collectives/step | across nodes GiB/step | vs {ds} | vs ours-z{a.stage} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r.get('layout', 'shard')} | {r['step_s']:.4g} | "
            f"{r['tokens_per_s']:,.0f} | "
            f"{r['tflops_per_gpu']:.1f} | {r['exposed_comm_s']:.4g} | "
            f"{r['peak_bytes'] / GiB:.2f} | {'yes' if r['fits'] else 'NO'} | "
            f"{_colls(r['collectives'])} | {r.get('across_nodes_bytes', 0) / GiB:.1f} | "
            f"{_ratio(r['step_s'], base_ds)} | {_ratio(r['step_s'], base_z3)} |")
    choice = getattr(plan, "layout_choice", None)
    if choice:
        lines += ["", f"layout='auto' (the runtime's rule when the engine is made, "
                      f"compiler/layouts.py) picks {choice['layout']}: {choice['why']}"]
    lines += ["", "What the passes decided:"]
    for r in rows:
        for name, d in r["decisions"].items():
            lines.append(f"- {r['system']} / {name}: {summarize_decision(name, d)}")
    lines += ["", "Assumed figures (override with --assume key=value):"]
    s = plan.setting
    if "roofline" in s:
        lines.append(f"- gpu: {s['roofline']}")
    lines.append(f"- network: {s['network']}")
    lines.append(f"- peers' host costs: FSDP2 {s['peer']['fsdp_hook_s'] * 1e6:.0f} us per "
                 f"collective, DeepSpeed {s['peer']['ds_hook_s'] * 1e6:.0f} us per module fetch")
    b = s.get("memory_budget_bytes")
    lines.append(f"- memory budget: {'unbounded' if b == float('inf') else f'{b / GiB:.1f} GiB'}")
    m = plan.memory
    if m["device_bytes"] != float("inf"):
        lines.append(f"- fit check: state {m['state_bytes_per_gpu'] / GiB:.1f} GiB + activations "
                     f"{m['activation_peak_bytes'] / GiB:.1f} GiB per GPU; at least "
                     f"{m['min_gpus']} GPUs ({m['min_gpus_with_offload']} with offloading)")
    return "\n".join(lines)


def summarize_decision(name: str, d: dict[str, Any]) -> str:
    gb = lambda b: f"{b / GiB:.2f} GiB" if b is not None else "-"  # noqa: E731
    if isinstance(d, dict) and d.get("skipped"):
        return d["skipped"]
    if name == "auto":
        return ("; ".join(f"{p} {v}" for p, v in d["verdicts"].items()) or "no pass chosen") + \
            (f"; left out: {', '.join(d['left_out'])}" if d["left_out"] else "")
    if name == "prefetch":
        parts = []
        for key in ("fw", "bw"):
            x = d.get(key, {})
            if x.get("unattainable"):
                parts.append(f"{key}: budget unattainable")
                continue
            ahead = x.get("for_next") or []
            parts.append(f"{key}: {x.get('gathers', 0)} gathers in {x.get('groups', 0)} groups, "
                         f"{x.get('hidden_s', 0) * 1e3:.1f} of {x.get('predicted_s', 0) * 1e3:.1f} "
                         f"ms hidden, peak {gb(x.get('peak_before'))} -> {gb(x.get('peak_after'))}"
                         + (f"; {gb(ahead[0]['bytes'])} started for the backward" if ahead else ""))
        return "; ".join(parts)
    if name == "bucket_reduce":
        if d.get("unattainable"):
            return "budget unattainable"
        return (f"{d['reduces']} reduce-scatters in {d['buckets']} buckets, "
                f"{d['hidden_s'] * 1e3:.1f} of {d['predicted_s'] * 1e3:.1f} ms hidden, peak "
                f"{gb(d.get('peak_before'))} -> {gb(d.get('peak_after'))}")
    if name == "overlap_refresh":
        return (f"the replicas' refresh, {d['groups']} all-gathers ({gb(d['bytes'])}), launched "
                f"in the step and waited for in the next forward: "
                f"{d['exposed_s'] * 1e3:.1f} of {d['refresh_s'] * 1e3:.1f} ms exposed behind a "
                f"{d['forward_s'] * 1e3:.1f} ms forward")
    if name == "state_bytes_per_rank":
        return f"optimizer state and masters {gb(d)} per GPU"
    if name == "selective_unshard":
        ag = d["per_step"]["all_gather"]
        rs = d["per_step"]["reduce_scatter"]
        return (f"kept {d['kept']} parameters ({gb(d['kept_bytes'])}), {d['accumulated']} "
                f"accumulated ({gb(d['accumulator_bytes'])}) in {gb(max(d['capacity_bytes'], 0))}"
                f"; all-gathers/step {ag['before']['count']} -> {ag['after']['count']}, "
                f"reduce-scatters {rs['before']['count']} -> {rs['after']['count']}; "
                f"predicted comm saved {d['saved_s'] * 1e3:.1f} ms")
    if name == "offload_optimizer":
        if d.get("unattainable"):
            return f"unattainable: {d.get('reason')}"
        if not d.get("offloaded_bytes"):
            return "nothing offloaded (fits)"
        grads = (f"; gradients on the host {gb(d['offloaded_grad_bytes'])} (copied out "
                 f"{d['predicted_grad_copy_s'] * 1e3:.1f} ms)"
                 if d.get("offloaded_grad_bytes") else "")
        if d.get("offloaded_master_bytes"):
            grads += (f"; masters on the host, saving {gb(d['offloaded_master_bytes'])} (copies "
                      "in the compute dtype stay)")
        h = d.get("host_step") or {}
        if "predicted_host_s" in h:
            grads += (f"; {'stepped on the host' if h['chosen'] else 'streamed'}: "
                      f"{h['chunks']} chunks, host step {h['predicted_host_s'] * 1e3:.0f} ms "
                      f"against {h['predicted_streamed_s'] * 1e3:.0f} ms streamed ({h['why']})")
        if d.get("host_bytes"):
            grads += f"; host memory {gb(d['host_bytes'])} per GPU (pinned)"
        return (f"offloaded {gb(d['offloaded_bytes'])} of {gb(d['state_bytes'])}; copied back "
                f"in the backward {d['predicted_copy_s'] * 1e3:.1f} ms (exposed "
                f"{d['predicted_exposed_s'] * 1e3:.1f} ms), streamed through the step "
                f"{d.get('predicted_streamed_s', 0.0) * 1e3:.1f} ms (in and out){grads}")
    if name == "activation_budget":
        if d["peak_before"] <= d["budget_bytes"]:
            return (f"nothing moved: peak {gb(d['peak_before'])} within the budget"
                    + (f"; {activation_budget.declined_line(d['declined'])}"
                       if "declined" in d else ""))
        t = d.get("trade")
        traded = (f"traded: freed {gb(t['freed_bytes'])} below the peak for {t['for']} "
                  f"(+{t['added_s'] * 1e3:.1f} ms a step predicted, for {t['value_s'] * 1e3:.1f} "
                  "ms it saves with it); ") if t else ""
        return (traded + f"peak {gb(d['peak_before'])} -> {gb(d['peak_after'])}"
                + (" (unattainable: the lowest the pass reaches)" if d["unattainable"] else "")
                + f"; of {d['candidates']} saved values ({gb(d['candidate_bytes'])}) "
                f"{d['recomputed']} recomputed ({gb(d['recomputed_bytes'])}, "
                f"{d['recompute_flops'] / 1e12:.1f} TFLOP, {d['recompute_s'] * 1e3:.1f} ms), "
                f"{d['offloaded']} offloaded ({gb(d['offloaded_bytes'])}); predicted "
                f"+{d['added_s'] * 1e3:.1f} ms a step"
                + (f" ({d['copy_wait_s'] * 1e3:.1f} ms waiting for copies)"
                   if d.get("copy_wait_s", 0.0) >= 1e-6 else ""))
    return json.dumps(d)[:200]


def write_json(plan, path: Path) -> Path:
    path.write_text(json.dumps(plan.to_dict(), indent=1, default=_default) + "\n")
    return path


def _default(x):
    if x == float("inf"):
        return None
    return str(x)


# ------------------------------------------------------------------------------ picture
# one hue per legend entry, no two alike (one blue, one purple)
_COLORS = {"fw": "#4C72B0", "bw": "#55A868", "optimizer": "#8172B2", "wait": "#DDDDDD",
           "all_gather": "#17BECF", "reduce_scatter": "#FF7F0E", "refresh": "#E377C2",
           "all_reduce": "#D62728",
           "offload": "#8C564B", "host": "#7F7F7F", "other": "#BBBBBB"}


def _color(lane: str, label: str) -> str:
    if lane == "host":
        return _COLORS["host"]
    if label.endswith(" fw"):
        return _COLORS["fw"]
    if label.endswith(" bw"):
        return _COLORS["bw"]
    return _COLORS.get(label, _COLORS["other"])


def _merged(segments, lane: str, tol: float):
    """Adjacent segments of one lane and color merged (a picture of 10^5 kernels is unreadable)."""
    out = []
    for s in segments:
        if s.lane != lane:
            continue
        c = _color(lane, s.label)
        if out and out[-1][2] == c and s.t0 - out[-1][1] <= tol:
            out[-1][1] = max(out[-1][1], s.t1)
        else:
            out.append([s.t0, s.t1, c])
    return out


def default_systems(plan) -> list[str]:
    """Ours with insertion only, the fastest of ours, the fastest FSDP2 or DDP, DeepSpeed (a
    picture of every system is too tall to read)."""
    res = {r.system: r.result.step_s for r in plan.results}
    ours = [n for n in res if n.startswith("ours")]
    torch_peers = [n for n in res if n.startswith(("fsdp2", "ddp"))]
    pick = ours[:1] + ([min(ours, key=res.get)] if ours else []) + \
        ([min(torch_peers, key=res.get)] if torch_peers else []) + \
        [n for n in res if n.startswith("ds")]
    return list(dict.fromkeys(pick))


def picture(plan, path: Path, systems: list[str] | None = None) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    systems = default_systems(plan) if systems is None else systems
    results = [r for r in plan.results if r.system in systems]
    if not results:
        return None
    t_max = max(r.result.step_s for r in results)
    fig, axes = plt.subplots(2 * len(results), 1, figsize=(13, 2.6 * len(results) + 1.2),
                             gridspec_kw={"height_ratios": [1.2, 1] * len(results)},
                             sharex=True)
    lanes = ["host", "compute", "comm", "h2d", "d2h"]
    for k, r in enumerate(results):
        ax, axm = axes[2 * k], axes[2 * k + 1]
        used = [ln for ln in lanes if any(s.lane == ln for s in r.result.segments)]
        for y, lane in enumerate(reversed(used)):
            bars = _merged(r.result.segments, lane, t_max * 2e-4)
            ax.broken_barh([(b[0], b[1] - b[0]) for b in bars], (y - 0.4, 0.8),
                           facecolors=[b[2] for b in bars], linewidth=0)
        ax.set_yticks(range(len(used)))
        ax.set_yticklabels(list(reversed(used)), fontsize=8)
        res = r.result
        ax.set_title(f"{r.system}: step {res.step_s:.3g} s, exposed comm "
                     f"{res.exposed_comm_s:.3g} s, peak {res.peak_bytes / GiB:.1f} GiB",
                     fontsize=9, loc="left")
        ts = [t for t, _ in res.memory]
        ms = [b / GiB for _, b in res.memory]
        axm.step(ts, ms, where="post", color="#C44E52", linewidth=1)
        axm.fill_between(ts, ms, step="post", alpha=0.2, color="#C44E52")
        dev = plan.memory["device_bytes"]
        # the lines' labels sit on the right, above the line (GPU memory) and below it
        # (budget), inside the axes: none is crossed by a line or by the frame
        if dev != float("inf"):
            axm.axhline(dev / GiB, color="black", linewidth=0.8, linestyle="--")
            axm.annotate("GPU memory", (0.995, dev / GiB), xycoords=axm.get_yaxis_transform(),
                         xytext=(0, 1.5), textcoords="offset points", fontsize=7, va="bottom",
                         ha="right")
        budget = plan.setting.get("memory_budget_bytes")
        if budget and budget != float("inf"):
            axm.axhline(budget / GiB, color="gray", linewidth=0.8, linestyle=":")
            axm.annotate("budget", (0.995, budget / GiB), xycoords=axm.get_yaxis_transform(),
                         xytext=(0, -2), textcoords="offset points", fontsize=7, va="top",
                         ha="right", color="gray")
        axm.set_ylabel("GiB", fontsize=8)
        axm.set_ylim(0, max(max(ms, default=1) * 1.15,
                            (dev / GiB * 1.3) if dev != float("inf") else 0))
        axm.tick_params(labelsize=8)
    axes[-1].set_xlabel("seconds into the optimizer step", fontsize=9)
    axes[-1].set_xlim(0, t_max * 1.02)
    a = plan.args
    fig.suptitle(f"{plan.shape.name} on {a.nodes}x{a.gpus_per_node} {a.gpu}, batch {a.batch} x "
                 f"seq {a.seq}, GAS {a.gas}: one step (lanes) and live memory per GPU",
                 fontsize=11)
    handles = [Patch(color=_COLORS[k], label=lab) for k, lab in (
        ("fw", "forward"), ("bw", "backward"), ("all_gather", "all-gather"),
        ("reduce_scatter", "reduce-scatter"), ("all_reduce", "all-reduce"), ("wait", "waiting"),
        ("optimizer", "optimizer"), ("refresh", "refresh copy-out"), ("offload", "offload copies"), ("host", "host"))]
    fig.legend(handles=handles, loc="lower center", ncol=9, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
