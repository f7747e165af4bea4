"""Optimization passes, registered by name.

A pass has two halves so that a cached plan can be re-applied without profiling:
  plan(ctx)  -> decisions: a JSON-serializable dict, computed from the agreed profiles; it must
                depend only on what `ctx` holds (the same on every rank), never on local timing;
  apply(ctx, decisions) -> the keys of the graph slots it changed (empty: nothing to do).
A re-plan (the step drifted: compiler/drift.py) runs the kept passes again on the graphs as
compiled ([Note: a re-plan starts over] in compiler/planner.py): a pass never sees its own
previous rewrite.
Passes only schedule: they never change a graph's inputs or outputs (DESIGN §2.3). A pass is a
no-op when its pattern is absent. Built-in passes register here as they land; users register
their own with `deepcompile.register_pass`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..compiler.cost import CostModel
    from ..compiler.profiler import GraphProfile
    from ..compiler.slots import GraphSlot
    from ..runtime.registry import ParamRegistry


@dataclasses.dataclass
class PassContext:
    slots: dict[str, "GraphSlot"]          # slot key ("g0.fw", "g0.bw", ...) -> graph slot
    profiles: dict[str, "GraphProfile"]    # latest agreed profile of every slot
    order: list[str]                       # slot keys in execution order over one step
    registry: "ParamRegistry"
    runtime: Any                           # the engine's runtime state (runtime/runtime.py)
    cost: "CostModel"
    memory_budget: float                   # bytes; inf when unbounded
    world_size: int
    decisions: dict[str, Any]              # pass name -> decisions already taken
    fusion: str = "overlap"                # "overlap" or "cap" ([Note: fusion policy] in
                                           # compiler/autoplan.py)
    layout: Any = None                     # the data-parallel layout (runtime/mesh.py); None:
                                           # "shard"


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    plan: Callable[[PassContext], dict]
    apply: Callable[[PassContext, dict], list[str]]
    description: str = ""
    # decisions -> lines for the report (what was decided, what it costs and saves); optional
    summary: Callable[[dict], list[str]] | None = None


_REGISTRY: dict[str, Pass] = {}


def register_pass(name: str, plan: Callable[[PassContext], dict],
                  apply: Callable[[PassContext, dict], list[str]], description: str = "",
                  summary: Callable[[dict], list[str]] | None = None) -> Pass:
    """Register an optimization pass under `name` (then usable in `Config(passes=(name,))`).

    `summary(decisions)`, if given, returns the lines `engine.report()` prints for the pass."""
    if not isinstance(name, str) or not name:
        raise ValueError("register_pass: name must be a non-empty string")
    if name in _REGISTRY:
        raise ValueError(f"register_pass: a pass named {name!r} is already registered")
    if not callable(plan) or not callable(apply):
        raise TypeError("register_pass: plan and apply must be callables")
    if summary is not None and not callable(summary):
        raise TypeError("register_pass: summary must be a callable or None")
    _REGISTRY[name] = Pass(name, plan, apply, description, summary)
    return _REGISTRY[name]


def get_pass(name: str) -> Pass:
    return _REGISTRY[name]


def known_passes() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _register_builtin() -> None:
    from . import bucket_reduce, offload_optimizer, prefetch, selective_unshard  # noqa: F401


_register_builtin()
