"""What a pass is and what it plans from: `Pass` (a pass and what the rest of the system needs to
know of it), the registry of passes, `PassContext` (what `plan` and `apply` read) and `Facts`
(what `passes="auto"` chooses from). The contract is in passes/__init__.py; the built-in passes
import this module, never the package, which imports them to register them.
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
    # what is measured of the host at start-up for the passes that need it (`Pass.needs`),
    # agreed over the ranks (compiler/host.py): seconds per element of the optimizer's step on
    # the host, the slowest rank's (None: not measured); host bytes this engine's plans may
    # keep, the smallest rank's (inf: unknown, or not measured)
    host_step_rate: float | None = None
    host_capacity: float = float("inf")
    # the passes that plan after this one, in order ([Note: a memory trade] in
    # passes/activation_budget.py reads the next one's `Pass.memory_value`)
    queued: tuple[str, ...] = ()

    def step_bytes(self) -> int:
        """Device bytes of the optimizer step with the state placed as it is now, where the
        memory model counts the optimizer state (an offload pass on, or open to auto under a
        budget; always on CUDA, whose allocator counts it); 0 elsewhere. Memory a pass holds
        through the step (a kept parameter, an accumulator) adds to it as to the graphs' peaks;
        memory freed in the graphs below it buys nothing."""
        rt = self.runtime
        store = getattr(rt, "offload", None)
        if store is None or not (rt.count_offload_bytes or store.device.type == "cuda"):
            return 0
        return store.step_peak()


@dataclasses.dataclass(frozen=True)
class Facts:
    """What `passes="auto"` chooses from ([Note: choosing passes] in compiler/autoplan.py): the
    same on every rank (the first agreed profile, the graphs, the configuration), and what
    `deepcompile plan` computes for the model it simulates — one rule serves both."""
    world_size: int
    zero_stage: int
    memory_budget: float          # bytes; inf when unbounded
    peak_bytes: float             # the largest profiled peak of the step's graphs
    gathers: int                  # parameter gathers in the training graphs
    reduces: int                  # gradient reductions in the training graphs
    casts: int = 0                # world size 1: parameters whose gather casts their shard
    replica_bytes: float = 0      # ZeRO-1/2, several ranks: the trainable replicas' bytes (what
                                  # the refresh after each optimizer step all-gathers)
    keep_all_bytes: float = 0     # ZeRO-3: what keeping every parameter gathered takes (its
                                  # bytes in the compute dtype, with gradient accumulation its
                                  # full-size accumulator too)
    step_bytes: float | None = None   # the optimizer step with all its state on the device;
                                      # None: no state can move (`unmovable` says why)
    unmovable: str = "no movable optimizer state"
    warmup_steps: int = 1
    late: bool = False            # asked again once the chosen passes ran (the step grew)


@dataclasses.dataclass(frozen=True)
class Keepable:
    """A parameter as `Config.layout="auto"` sees it before anything is profiled (`SpareMemory`)."""
    nbytes: int         # its gathered copy, in the compute dtype
    gather_s: float     # its gathers in one micro-step under the layout (forward and backward)
    refresh_s: float    # one gather of it after the optimizer step


@dataclasses.dataclass(frozen=True)
class SpareMemory:
    """The memory a data-parallel layout leaves free, and what could use it: what
    `Pass.spare_memory` values when `Config.layout="auto"` chooses ([Note: choosing the
    layout] in compiler/layouts.py)."""
    zero_stage: int
    gas: int
    spare_bytes: float              # inf when the budget is unbounded
    params: tuple[Keepable, ...]


@dataclasses.dataclass(frozen=True)
class Pass:
    """A pass and what the rest of the system needs to know of it."""
    name: str
    plan: Callable[[PassContext], dict]
    apply: Callable[[PassContext, dict], list[str]]
    description: str = ""
    # decisions -> lines for the report (what was decided, what it costs and saves); optional
    summary: Callable[[dict], list[str]] | None = None
    # where `passes="auto"` runs it among the chosen ones (lower first)
    order: int = 1000
    # `passes="auto"`: (run it?, why) from the facts; None: auto never chooses it
    choose: Callable[[Facts], tuple[bool, str]] | None = None
    # asked again, last, when the step grew while the chosen passes ran (`Facts.late`)
    choose_late: bool = False
    # its collectives run asynchronously (the planner models the framework's async overhead)
    asynchronous: bool = False
    # what it requires: "elementwise_optimizer" (the flat step over chunks), "warmup_steps"
    # (state that exists after the first optimizer step), "host_step" and "host_memory" (the
    # host's step rate and its memory, measured at start-up: `PassContext.host_step_rate`,
    # `host_capacity`)
    needs: frozenset[str] = frozenset()
    # it holds the optimizer state under the memory budget: the engine re-plans it when the
    # step drifts in steady state (compiler/drift.py), and counts that state in the budget
    replans_on_drift: bool = False
    # ZeRO-1/2: the optimizer step may leave the replicas' refresh in flight ([Note: deferred
    # refresh] in runtime/replicas.py): the eager fallback and the guarded model wait for it
    defers_refresh: bool = False
    # what it makes of the memory a layout leaves free, before anything is profiled: (predicted
    # communication seconds it saves per optimizer step, bytes it uses) -- `Config.layout="auto"`
    # weighs the memory a layout takes by it ([Note: choosing the layout])
    spare_memory: Callable[[SpareMemory], tuple[float, float]] | None = None
    # what it would make of memory beyond the room the budget leaves it now, from the agreed
    # profiles: the options it would add, as (bytes, predicted seconds saved per optimizer
    # step), most saved per byte first -- a pass planning before it may free that memory for
    # it ([Note: a memory trade] in passes/activation_budget.py)
    memory_value: Callable[[PassContext], list[tuple[int, float]]] | None = None
    # what its `memory_value` offers buy, for a trade's report line (e.g. "parameters kept
    # gathered")
    memory_buys: str = ""
    # it frees memory for the pass that plans right after it, where that pays ([Note: a memory
    # trade] in passes/activation_budget.py)
    frees_memory: bool = False
    # asked once, before it plans, when a pass that frees memory is queued after it: whether
    # to plan right after that pass instead, so that the memory freed may go to it
    waits_for_memory: Callable[[PassContext], bool] | None = None
    # the DeepSpeed setting it stands for in a DeepSpeed config (_config_io.py), e.g.
    # "zero_optimization.offload_optimizer"
    deepspeed: str | None = None


_REGISTRY: dict[str, Pass] = {}


def register_pass(name: str, plan: Callable[[PassContext], dict],
                  apply: Callable[[PassContext, dict], list[str]], description: str = "",
                  summary: Callable[[dict], list[str]] | None = None, **describe: Any) -> Pass:
    """Register an optimization pass under `name` (then usable in `Config(passes=(name,))`).

    `summary(decisions)`, if given, returns the lines `engine.report()` prints for the pass;
    `describe` sets the other fields of `Pass` (order, choose, ...)."""
    if not isinstance(name, str) or not name:
        raise ValueError("register_pass: name must be a non-empty string")
    if name in _REGISTRY:
        raise ValueError(f"register_pass: a pass named {name!r} is already registered")
    if not callable(plan) or not callable(apply):
        raise TypeError("register_pass: plan and apply must be callables")
    if summary is not None and not callable(summary):
        raise TypeError("register_pass: summary must be a callable or None")
    fields = {f.name for f in dataclasses.fields(Pass)} - {"name", "plan", "apply",
                                                            "description", "summary"}
    unknown = sorted(set(describe) - fields)
    if unknown:
        raise TypeError(f"register_pass: unknown field {unknown[0]!r} (known: {', '.join(sorted(fields))})")
    if "needs" in describe:
        describe["needs"] = frozenset(describe["needs"])
    _REGISTRY[name] = Pass(name, plan, apply, description, summary, **describe)
    return _REGISTRY[name]


def get_pass(name: str) -> Pass:
    return _REGISTRY[name]


def known_passes() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def passes_with(**fields: Any) -> tuple[str, ...]:
    """Names of the registered passes whose fields have these values (e.g. `asynchronous=True`)."""
    return tuple(n for n, p in _REGISTRY.items()
                 if all(getattr(p, k) == v for k, v in fields.items()))


def needs_of(names) -> dict[str, list[str]]:
    """{need: [the passes of `names` that need it]}."""
    out: dict[str, list[str]] = {}
    for n in names:
        for need in sorted(_REGISTRY[n].needs):
            out.setdefault(need, []).append(n)
    return out
