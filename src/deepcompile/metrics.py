"""Per-step figures (`engine.metrics()`): step time, tokens/s, FLOP/s and MFU, exposed
communication, peak memory, collectives.

Per optimizer step the engine does a fixed amount of work here, whatever the model's size
(`end_step`: a copy of a few counters per collective kind); per forward, one dictionary lookup
and one `numel` (`count_tokens`). Everything else is computed when `metrics()` is called:

* `step_s`: time of the last optimizer step, the engine's own work in it (its training
  forwards, backwards and the step: [Note: the engine's step time] in engine.py; not what the
  loop does between them), and its phase (steady once planning is over);
* `tokens_per_s`: tokens of this rank's forwards in that step (the `input_ids` keyword, or the
  first integer tensor argument) times the world size, over `step_s`;
* `flops_per_step`: this rank's model FLOPs per optimizer step, counted from the partitioned
  graphs (forward and backward; torch's own per-op formulas in `torch.utils.flop_counter`, from
  the shapes the graphs record: matmuls, convolutions, attention), times each graph's runs per
  step; `mfu`: achieved FLOP/s over the device's peak, where the peak is known (`PEAK_FLOPS`
  by GPU name and dtype, or `peak_flops=`); None on the CPU;
* `exposed_comm_s`: time blocked on communication per step, from the latest agreed profile
  (the estimate the passes planned with) and, when a step was traced
  (`engine.trace_next_step()`), as measured in that step;
* `peak_memory_bytes`: CUDA: `max_memory_allocated` since the previous `metrics()` call; CPU:
  the process's resident-set high-water mark;
* `collectives`: counts and bytes per kind in the last optimizer step (`engine.comm_stats()`
  counters: the graphs' collectives and the runtime's, the refreshes after the step included).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _compat
from ._proc import kib_field

# dense peak FLOP/s by GPU name (substring) and compute dtype; fp32 is TF32 tensor-core peak
PEAK_FLOPS = {
    "H200": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},
    "H100": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
}


def graph_flops(gm: torch.fx.GraphModule) -> int:
    """FLOPs of one run of `gm`, from the shapes in its nodes' metadata (`val`)."""
    from torch.utils.flop_counter import flop_registry

    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _compat.is_op_overload(node.target):
            continue
        formula = flop_registry.get(node.target.overloadpacket)
        if formula is None:
            continue
        args, kwargs = torch.fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda a: a.meta.get("val") if isinstance(a, torch.fx.Node) else a)
        try:
            total += int(formula(*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:   # noqa: BLE001 -- an op whose metadata the formula cannot read
            continue
    return total


class StepMetrics:
    def __init__(self, engine) -> None:
        self._engine = engine
        self._comm = engine._comm
        self._prev: dict[str, tuple[int, int]] = {}
        self._last_comm: dict[str, dict[str, int]] = {}
        self.tokens = 0            # this rank's tokens since the last optimizer step
        self._step_tokens = 0
        self._flops: dict[str, tuple[int, int]] = {}   # slot -> (version, flops)

    def count_tokens(self, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor):
            ids = args[0]
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
            self.tokens += ids.numel()

    def end_step(self) -> None:
        now: dict[str, tuple[int, int]] = {}
        for (_group, kind), (c, b) in self._comm._stats.items():   # summed over the groups
            c0, b0 = now.get(kind, (0, 0))
            now[kind] = (c0 + c, b0 + b)
        self._last_comm = {k: {"count": c - self._prev.get(k, (0, 0))[0],
                               "bytes": b - self._prev.get(k, (0, 0))[1]}
                           for k, (c, b) in now.items()}
        self._prev = now
        self._step_tokens, self.tokens = self.tokens, 0

    def last_step_record(self) -> dict[str, Any] | None:
        last = self._engine._pipeline.last_step
        if last.get("seconds") is None:
            return None
        return {**last, "collectives": {k: v for k, v in self._last_comm.items() if v["count"]}}

    def flops_per_step(self) -> int | None:
        pipe = self._engine._pipeline
        order = pipe.order or [k for k, s in pipe.slots.items() if getattr(s, "training", True)]
        total = 0
        for key in set(order):
            slot = pipe.slots[key]
            have = self._flops.get(key)
            if have is None or have[0] != slot.version:
                have = self._flops[key] = (slot.version, graph_flops(slot.gm))
            total += have[1] * max(order.count(key), 1)
        return total or None

    def peak_flops(self) -> float | None:
        dev = self._engine.device
        if dev.type != "cuda":
            return None
        name = torch.cuda.get_device_name(dev)
        dtype = str(self._engine.config.param_dtype or torch.float32).removeprefix("torch.")
        for key, table in PEAK_FLOPS.items():
            if key in name:
                return table.get(dtype)
        return None

    def metrics(self, peak_flops: float | None = None) -> dict[str, Any]:
        eng = self._engine
        pipe = eng._pipeline
        last = pipe.last_step
        step_s = last.get("seconds")
        world = self._comm.world
        flops = self.flops_per_step()
        peak = peak_flops or self.peak_flops()
        achieved = flops / step_s if flops and step_s else None
        summary = pipe.step_summary()
        traced = getattr(eng, "_tracer", None)
        measured_exposed = traced.result["exposed_s"] if traced is not None and traced.result \
            else None
        if eng.device.type == "cuda":
            peak_mem = torch.cuda.max_memory_allocated(eng.device)
            torch.cuda.reset_peak_memory_stats(eng.device)
        else:
            peak_mem = kib_field("/proc/self/status", "VmHWM")
        norm = eng._grad_norm   # [Note: the step's gradient norm] in engine.py
        return {
            "step": pipe.steps, "phase": last.get("phase"), "step_s": step_s,
            "grad_norm": None if norm is None else float(norm),
            "tokens_per_step": self._step_tokens * world or None,
            "tokens_per_s": self._step_tokens * world / step_s if step_s and self._step_tokens
            else None,
            "flops_per_step": flops, "flops_per_s": achieved,
            "mfu": achieved / peak if achieved and peak else None,
            "exposed_comm_s": summary["exposed_comm_s"] if summary else None,
            "exposed_comm_s_measured": measured_exposed,
            "peak_memory_bytes": peak_mem,
            "collectives": {k: v for k, v in self._last_comm.items() if v["count"]},
            "collectives_per_step": sum(v["count"] for v in self._last_comm.values()),
        }
