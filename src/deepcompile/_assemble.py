"""An engine's start-up: the checks of the model, its device and the process group, and the
assembly of the engine's parts in dependency order (`assemble`).

Each part gets what it depends on as constructor arguments. Two things are set after the
parts they change are made: the runtime's link to the offloader (each holds the other: the
offloader steps the runtime's chunks, and the graphs' ops reach it through the runtime), and
what the passes decide about the optimizer state (counted in the budget, provisionally offloaded,
re-planned on drift), which reads the memory budget the pipeline agrees when it is made.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import weakref
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from . import _compat
from ._version import __version__
from .compiler.backend import Backend, WeakBackend
from .compiler.layouts import auto as choose_layout
from .compiler.pipeline import Pipeline
from .config import Config
from .guard import ModelGuard
from .metrics import StepMetrics
from .passes import needs_of, passes_with
from .report.steptrace import StepTracer
from .runtime.comm import Comm
from .runtime.eager import EagerFallback
from .runtime.flat import FlatState
from .runtime.guardrails import Guardrails
from .runtime.loss_scale import GradCheck, LossScaler
from .runtime.mesh import build as build_layout
from .runtime.offload import Offloader
from .runtime.registry import ParamRegistry
from .runtime.runtime import EngineRuntime
from .runtime.state import StepState

log = logging.getLogger("deepcompile")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _model_device(model: nn.Module) -> torch.device:
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if not devices:
        raise ValueError("deepcompile.initialize: the model has no parameters or buffers")
    if len(devices) > 1:
        raise ValueError(f"deepcompile.initialize: the model's tensors are on several devices "
                         f"({', '.join(sorted(map(str, devices)))}); put it on one device first")
    device = devices.pop()
    if device.type == "meta":
        raise ValueError("deepcompile.initialize: the model is on the meta device; materialize "
                         "its parameters (e.g. model.to_empty(device=...) and initialize) first")
    _check_current_device(device)
    return device


def _check_current_device(device: torch.device) -> None:
    """CUDA events, memory_allocated, synchronize and NCCL's object collectives act on the
    current device: with another one current, the profiles would time and measure nothing."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        raise ValueError(
            f"deepcompile.initialize: the model is on {device} but the current CUDA device is "
            f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device({device.index}) "
            "(under torchrun: int(os.environ['LOCAL_RANK'])) before initialize")


def _ensure_process_group(device: torch.device) -> None:
    if dist.is_initialized():
        return
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            "deepcompile.initialize: no default process group and no torchrun environment "
            f"({', '.join(missing)} unset). Launch with `torchrun --nproc-per-node N script.py`, "
            "or call torch.distributed.init_process_group(...) before initialize().")
    backend = "nccl" if device.type == "cuda" else "gloo"
    log.info("deepcompile: initializing the default process group (%s) from the environment", backend)
    # bound to this rank's GPU: NCCL's communicator is made now, on the right device
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)


def _check_backend(device: torch.device, backend: str) -> None:
    backends = str(backend).lower()
    if device.type == "cuda":
        if "nccl" not in backends:   # gloo: the lowered graphs' collectives need NCCL on CUDA
            raise ValueError(f"deepcompile.initialize: the model is on {device} but the process "
                             f"group's backend is {backend!r}; CUDA training needs 'nccl' "
                             "(torch.distributed.init_process_group('nccl'))")
    elif device.type == "cpu":
        if "gloo" not in backends and "mpi" not in backends:
            raise ValueError(f"deepcompile.initialize: the model is on the CPU but the process "
                             f"group's backend is {backend!r}; use 'gloo' for CPU training, or "
                             "move the model to the GPU of this rank")
    else:
        raise ValueError(f"deepcompile.initialize: device type {device.type!r} is not supported "
                         "(supported: cpu with gloo, cuda with nccl)")


def _passes_with(config: Config, **fields: Any) -> tuple[list[str], bool]:
    """(the passes named in `config` whose fields have these values, whether passes="auto" may
    choose such a pass)."""
    having = passes_with(**fields)
    return [p for p in config.pass_list if p in having], config.auto_passes and bool(having)


def assemble(engine: Any, optimizer: OptimizerFactory, group: dist.ProcessGroup | None,
             mesh: Any) -> None:
    """Builds the parts of `engine` (an `Engine` holding `config` and `module`), each after
    what it depends on, and sets them as the engine's attributes."""
    config, module = engine.config, engine.module
    engine.device = device = _model_device(module)
    _check_backend(device, dist.get_backend(group))
    engine._comm = comm = Comm(group)
    # failures, timeouts and cross-rank checks (runtime/guardrails.py): before anything that
    # communicates, so that the startup timeout bounds it
    engine._rails = rails = Guardrails(comm, config)
    # the data-parallel layout and its groups, made once, before anything is sharded
    # ([Note: layouts] in runtime/mesh.py; "auto": [Note: choosing the layout])
    engine._layout = layout = build_layout(config, comm, device, mesh,
                                           choose=lambda candidates: choose_layout(
                                               candidates, module, config, device))
    engine._state = state = StepState(
        gradient_accumulation_steps=config.gradient_accumulation_steps)
    engine._registry = registry = ParamRegistry(
        module, layout, param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype,
        zero_stage=config.zero_stage, on_reuse=engine._check_reuse)
    engine._trainable = registry.trainable_shards()
    engine.optimizer = opt = optimizer(engine._trainable)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"deepcompile.initialize: optimizer(params) must return a "
                        f"torch.optim.Optimizer, got {type(opt).__name__}")
    # the shards move into flat chunks (their data pointers are fixed from here on: the
    # runtime's tables are built after) and, for elementwise optimizers, an inner optimizer
    # steps the chunks ([Note: flat layout] in runtime/flat.py)
    engine._flat = flat = FlatState(opt, registry.entries, device)
    engine._runtime = runtime = EngineRuntime(registry, comm, state, device,
                                              flat_masters=[c.param for c in flat.chunks])
    engine._offload = offload = Offloader(flat, device, runtime, config.compiler,
                                          host_step=config.host_step)
    runtime.offload = offload
    # ZeRO-1/2: the optimizer step may leave the replicas' refresh in flight ([Note: deferred
    # refresh] in runtime/replicas.py); eager readers then wait for it
    named, auto = _passes_with(config, defers_refresh=True)
    defers = config.zero_stage < 3 and bool(named or auto)
    engine._fallback = EagerFallback(
        module, runtime, gather=config.zero_stage == 3, settle=defers,
        agree=rails.agree_eager if rails.eager_group is not None else None,
        agree_mask=rails.agree_mask)
    engine._pipeline = pipeline = Pipeline(
        runtime=runtime, config=config, device=device, guard=rails,
        engine_fingerprint=fingerprint(config, comm, layout, device, registry))
    elementwise = needs_of(config.pass_list).get("elementwise_optimizer")
    if elementwise and flat.inner is None:
        raise ValueError(
            f"deepcompile.initialize: the pass {elementwise[0]} needs an optimizer whose "
            f"update is elementwise (torch.optim's SGD, Adam, AdamW, ...), which steps "
            f"flat chunks; {type(opt).__name__} steps parameter by parameter")
    # the passes that hold the optimizer state under the budget, named or open to auto
    engine._drift_passes = passes_with(replans_on_drift=True)
    named, auto = _passes_with(config, replans_on_drift=True)
    bounded = pipeline.memory_budget != float("inf")
    # the CPU memory model counts the state (and held gradients) where such a pass is on: its
    # plan and every pass before or after it read one budget for all of it; where auto may
    # choose one from the profile, the state is in the budget too (profiled on the device:
    # name the pass to profile with it offloaded)
    runtime.count_offload_bytes = bool(named) or (auto and bounded)
    # until planned, the state of every chunk leaves ([Note: provisional offload]); unbounded,
    # nothing is ever offloaded: the pass plans nothing, changes no graph
    offload.provisional = bool(named) and bounded
    if runtime.count_offload_bytes and bounded:
        # the step changed under the plan (a new shape, larger sizes): re-plan instead of
        # running out of memory (compiler/drift.py). Unbounded, no step runs out of the
        # budget: nothing to re-plan (each re-plan runs every kept pass again), and no
        # agreement to reach at each step boundary
        pipeline.on_drift.append(engine._replan_on_drift)
    engine._backend = backend = Backend(registry, config.compiler, pipeline)
    # Dynamo keeps its backend for the life of the process: it gets a weak handle ([Note:
    # what Dynamo holds] in compiler/backend.py), so that a released engine is freed
    compiled = _compat.compile_module(module, WeakBackend(backend))
    # a frame of this model Dynamo stops compiling (while this engine's forward runs) runs
    # eagerly: one warning each. Held weakly, removed with the engine (Dynamo's logger
    # lives as long as the process)
    hit = weakref.WeakMethod(engine._recompile_limit_hit)
    weakref.finalize(engine, _compat.on_recompile_limit(
        lambda *a: None if (m := hit()) is None else m(*a)))
    # the user's model object stays safe to touch ([Note: the guarded model] in guard.py)
    engine._guard = guard = ModelGuard(module, registry, config.zero_stage,
                                       runtime.replicas if defers else None)
    engine._compiled = guard.wrap(compiled)
    engine._scaler = _loss_scaler(config, comm, device)   # float16: runtime/loss_scale.py
    engine._grad_check = GradCheck(engine._trainable, device)   # [Note: overflow agreement]
    engine._metrics = StepMetrics(engine)
    engine._tracer = StepTracer(pipeline, device)


# [Note: engines freed before finalization] An engine is a cycle of objects: one its user no
# longer references (a local of a script's `main`) is freed by the garbage collector, and with no
# collection before the script ends, that is during the interpreter's finalization. Its own gloo
# groups (the collectives', the check's, the eager gathers') would be destroyed there, their
# worker threads joined by an interpreter that is being torn down: where torch documents
# destroying every process group before exit, because groups destroyed in finalization can abort
# the process ("terminate called without an active exception") after a run that finished.
# `dist.destroy_process_group()` unregisters the engine's groups but cannot free them while the
# engine holds them. One collection at exit, registered when this module is imported, before any
# engine exists (so it runs after every engine's own exit work, e.g. the wait for a pending
# refresh), frees such engines while the interpreter is whole. An engine still referenced then (a
# module global) is freed as before. The default group:
# [Note: the default group kept by an import] in __init__.py.
atexit.register(gc.collect)


def _loss_scaler(config: Config, comm: Comm, device: torch.device) -> LossScaler | None:
    mode = config.loss_scaling
    if mode is None:
        return None
    return LossScaler(comm, device, dynamic=mode == "dynamic",
                      scale=config.initial_loss_scale if mode == "dynamic"
                      else config.loss_scale, window=config.loss_scale_window)


def fingerprint(config: Config, comm: Comm, layout: Any, device: torch.device,
                registry: ParamRegistry) -> dict:
    """What determines a plan besides the graphs (the plan cache's key)."""
    cfg = config.to_dict()
    for key in ("cache_dir", "collective_timeout_s", "startup_timeout_s",
                "divergence_check_every", "on_nonfinite"):
        cfg.pop(key, None)   # none of these changes a plan
    return {
        "world_size": comm.world,
        "layout": [layout.name, layout.group_size],
        "device": device.type,
        "torch": torch.__version__,
        "deepcompile": __version__,
        "config": cfg,
        "params": [(e.name, list(e.shape), str(e.compute_dtype), str(e.shard.dtype),
                    str(e.reduce_dtype)) for e in registry],
    }
