"""One steady optimizer step under `torch.profiler`, with real timestamps (`engine.trace_next_step()`).

The steady graphs hold no Python op: their collectives are `_c10d_functional` C++ ops, called
from Inductor's (or FX's) generated code, so the profiler sees them with their real timestamps
but without any label of ours. The labels come from the plan: while tracing, each graph call
runs inside a `deepcompile:<graph>` range (one `record_function` per graph call, only in the
traced step), and the k-th collective launched inside a graph's range is the k-th collective
of the lowered graph it ran — whose nodes carry `meta["dc_origin"]`, the planned node they
stand for, and through it the parameters moved and their modules.

What is kept (a few events per collective, not the ~2,400 aten events of a step):

* lane "graphs": each graph call (`g0.fw`, ...), the optimizer step and the refreshes after it;
* lane "launch": each collective's launch on the host, labelled with its modules;
* lane "exposed": each wait in which the host was blocked on a collective (`wait_tensor`): the
  exposed communication, labelled with the collective it waited for;
* lane "transport": what gloo's worker threads (or NCCL kernels on a GPU) spent moving data;
* lane "device" (GPU only): when the GPU ran compute kernels (merged busy periods).

`exposed_s` is the step's total blocked time (on a GPU, where waits block the compute stream
and not the host: the time NCCL's kernels ran and no compute kernel did); `step_s` the traced
step's wall time.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from .. import _compat
from ..runtime import ops

_LAUNCH = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional::reduce_scatter_tensor")
_WAIT = "_c10d_functional::wait_tensor"
_HOST_SPANS = {"deepcompile.refresh_kept": "refresh kept parameters",
               "deepcompile.refresh_replicas": "refresh replicas"}


def module_path(meta: dict) -> str | None:
    """The module a node belongs to, from Dynamo's `nn_module_stack` (forward) or
    `fwd_nn_module_stack` (backward), as a dotted path (`model.layers.0.mlp`)."""
    stack = meta.get("nn_module_stack") or meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = path.replace("L['self'].", "").replace("L['self']", "")
    for a, b in (("._modules['", "."), ("['", "."), ("']", ""), ("[", "."), ("]", "")):
        path = path.replace(a, b)
    return path.strip(".") or None


def collective_labels(lowered: torch.fx.GraphModule, planned: torch.fx.GraphModule) -> tuple[list[str], list[str]]:
    """(labels of the collectives a lowered graph launches, labels of its waits), in graph
    order: the modules whose parameters each one moves."""
    from ..passes._common import module_of
    from ..runtime.registry import lookup

    by_name = {n.name: n for n in planned.graph.nodes}
    ag, rs, wait = _compat.funcol_ops()
    launches, waits, label_of = [], [], {}
    for node in lowered.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in (ag, rs):
            origin = by_name.get(node.meta.get("dc_origin", ""))
            label = "?"
            if origin is not None and origin.op == "call_function" and origin.target in ops.COMM_KINDS:
                pids = origin.args[1]
                pids = pids if isinstance(pids, (list, tuple)) else [pids]
                try:
                    label = module_of([lookup(int(p)).name for p in pids])
                except (RuntimeError, KeyError):
                    label = origin.name
            kind = "all_gather" if node.target is ag else "reduce_scatter"
            label_of[node] = f"{kind} {label}"
            launches.append(label_of[node])
        elif node.target is wait:
            src = node.args[0]
            waits.append(label_of.get(src, "collective from the previous graph"))
    return launches, waits


class StepTracer:
    """Traces the next optimizer step of one engine (started by `start`, stopped by the
    pipeline at the end of that step)."""

    def __init__(self, pipeline, device: torch.device) -> None:
        self.pipeline = pipeline
        self.device = device
        self._prof = None
        self.result: dict[str, Any] | None = None

    def start(self) -> bool:
        if self._prof is not None or _compat.profiler_active():
            return False   # another profiler records (a second one cannot start)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self.pipeline.runner.tracing = []
        return True

    def stop(self, phase: str, step_s: float) -> None:
        if self._prof is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._prof.__exit__(None, None, None)
        runner = self.pipeline.runner
        runs, runner.tracing = runner.tracing, None
        events = _compat.profiler_events(self._prof)
        self._prof = None
        self.result = self._digest(events, runs, phase, step_s)

    def _digest(self, events, runs: list[tuple[str, bool, int]], phase: str,
                step_s: float) -> dict[str, Any]:
        pipe = self.pipeline
        evs = sorted(events, key=lambda e: e.start_ns())
        t0 = min((e.start_ns() for e in evs), default=0)
        # the threads that ran graphs: the caller's, and on a GPU autograd's device thread,
        # which runs the backward graphs (collectives launched elsewhere are not the step's)
        threads = set()
        spans = []       # (start, end, key): graph calls do not overlap in time
        out: list[dict[str, Any]] = []
        for e in evs:
            name = e.name()
            if name.startswith("deepcompile:"):
                threads.add(e.start_thread_id())
                spans.append((e.start_ns(), e.end_ns(), name.split(":", 1)[1]))
        labels = []
        for key, last, version in runs:
            slot = pipe.slots.get(key)
            low = slot.lowered.get((last, version)) if slot is not None else None
            labels.append(collective_labels(low.gm, slot.gm) if low is not None else ([], []))

        def ev(lane, name, e, **extra):
            out.append({"lane": lane, "name": name, "ts_s": (e.start_ns() - t0) / 1e9,
                        "dur_s": max(e.duration_ns(), 0) / 1e9, **extra})

        span_i = -1
        busy: list[tuple[int, int]] = []
        nccl: list[tuple[int, int]] = []
        counters = [0, 0]
        exposed = 0.0
        for e in evs:
            name = e.name()
            s = e.start_ns()
            while span_i + 1 < len(spans) and spans[span_i + 1][0] <= s:
                span_i += 1
                counters = [0, 0]
            inside = span_i >= 0 and s < spans[span_i][1]
            key = spans[span_i][2] if inside else None
            launches, waits = labels[span_i] if inside and span_i < len(labels) else ([], [])
            if name.startswith("deepcompile:"):
                ev("graphs", key or name, e, graph=key)
            elif name.startswith("Optimizer.step"):
                ev("graphs", "optimizer step", e)
            elif name in _HOST_SPANS:
                ev("graphs", _HOST_SPANS[name], e)
            elif name.startswith(_LAUNCH) and (not threads or e.start_thread_id() in threads):
                label = launches[counters[0]] if counters[0] < len(launches) else name.split("::")[1]
                counters[0] += 1
                ev("launch", label, e, graph=key)
            elif name.startswith(_WAIT) and (not threads or e.start_thread_id() in threads):
                label = waits[counters[1]] if counters[1] < len(waits) else "wait"
                counters[1] += 1
                ev("exposed", label, e, graph=key)
                exposed += e.duration_ns() / 1e9
            elif name.startswith(("gloo:", "nccl:")):
                ev("transport", name, e)
            elif e.device_type() == torch.autograd.DeviceType.CUDA:
                # GPU kernels: NCCL's are the transport; the others are the device's compute,
                # merged into busy periods (gaps under 5 us), not one event per kernel
                if "nccl" in name.lower():
                    ev("transport", name, e)
                    nccl.append((e.start_ns(), e.end_ns()))
                else:
                    busy.append((e.start_ns(), e.end_ns()))
        compute = _merge(busy, gap_ns=5000)
        for start, end in compute:
            out.append({"lane": "device", "name": "GPU kernels", "ts_s": (start - t0) / 1e9,
                        "dur_s": (end - start) / 1e9})
        if self.device.type == "cuda":
            # a wait on a GPU blocks the compute stream, not the host: the exposed time is when
            # NCCL's kernels ran and no compute kernel did
            exposed = _uncovered(_merge(nccl, gap_ns=0), compute) / 1e9
        out.sort(key=operator.itemgetter("ts_s"))
        return {"phase": phase, "step_s": step_s, "exposed_s": exposed, "events": out,
                "t0_ns": t0,
                "graph_runs": [list(r[:2]) for r in runs]}


def _uncovered(intervals: list[tuple[int, int]], cover: list[tuple[int, int]]) -> int:
    """Nanoseconds of `intervals` outside `cover` (both sorted, disjoint)."""
    total, j = 0, 0
    for start, end in intervals:
        t = start
        while j < len(cover) and cover[j][1] <= t:
            j += 1
        k = j
        while t < end:
            if k >= len(cover) or cover[k][0] >= end:
                total += end - t
                break
            if cover[k][0] > t:
                total += cover[k][0] - t
            t = max(t, cover[k][1])
            k += 1
    return total


def _merge(intervals: list[tuple[int, int]], gap_ns: int) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start - out[-1][1] <= gap_ns:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]
