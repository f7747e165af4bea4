"""The training engine: forward through the compiled model, backward, sharded optimizer step."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from . import _compat
from .compiler.backend import Backend, WeakBackend
from .compiler.layouts import auto as choose_layout
from .compiler.pipeline import Phase, Pipeline
from .config import Config
from .guard import ModelGuard
from .report import Report
from .runtime.comm import Comm
from .runtime.eager import EagerFallback
from .runtime.flat import FlatState, _grad_of, _is_not_none
from .runtime.guardrails import Guardrails, NonFiniteError, UsageError
from .runtime.loss_scale import GradCheck, grad_norms, nonfinite_ranks
from .runtime.mesh import build as build_layout
from .runtime.offload import Offloader
from .runtime.registry import ParamEntry, ParamRegistry
from .runtime.runtime import EngineRuntime
from .runtime.state import StepState

log = logging.getLogger("deepcompile")

# what torch says when eager code reads a parameter whose storage is freed (an op on it; a
# view of it, such as indexing a 3-D expert weight)
_FREED_STORAGE = ("data is not allocated yet", "out of bounds for storage of size 0")
_EAGER_PARAMETER_READ = (
    "deepcompile: code that ran eagerly inside the compiled model read a sharded parameter "
    "directly (eager code that no module hook of its module saw run). Wrap the forward of the "
    "module that owns it with torch.compiler.disable before deepcompile.initialize "
    "(`module.forward = torch.compiler.disable(module.forward)`): it then runs eagerly, and the "
    "eager fallback gathers its parameters for its forward (runtime/eager.py)")

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


class Engine:
    """Trains `module` sharded over the process group. Create with `deepcompile.initialize`."""

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, config: Config,
                 group: dist.ProcessGroup | None = None, mesh: Any = None) -> None:
        self.config = config
        self.module = module
        self.device = _model_device(module)
        _check_backend(self.device, dist.get_backend(group))
        self._comm = Comm(group)
        # failures, timeouts and cross-rank checks (runtime/guardrails.py): before anything that
        # communicates, so that the startup timeout bounds it
        self._rails = Guardrails(self._comm, config)
        # the data-parallel layout and its groups, made once, before anything is sharded
        # ([Note: layouts] in runtime/mesh.py; "auto": [Note: choosing the layout])
        self._layout = build_layout(config, self._comm, self.device, mesh,
                                    choose=lambda candidates: choose_layout(
                                        candidates, module, config, self.device))
        self._state = StepState(gradient_accumulation_steps=config.gradient_accumulation_steps)
        self._registry = ParamRegistry(module, self._layout, param_dtype=config.param_dtype,
                                       reduce_dtype=config.reduce_dtype,
                                       zero_stage=config.zero_stage)
        self._trainable = self._registry.trainable_shards()
        self.optimizer = optimizer(self._trainable)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"deepcompile.initialize: optimizer(params) must return a "
                            f"torch.optim.Optimizer, got {type(self.optimizer).__name__}")
        # the shards move into flat chunks (their data pointers are fixed from here on: the
        # runtime's tables are built after) and, for elementwise optimizers, an inner optimizer
        # steps the chunks ([Note: flat layout] in runtime/flat.py)
        self._flat = FlatState(self.optimizer, self._registry.entries, self.device)
        self._runtime = EngineRuntime(self._registry, self._comm, self._state, self.device)
        self._runtime.flat_masters = [c.param for c in self._flat.chunks]
        self._registry.reuse_listeners.append(self._check_reuse)
        self._offload = Offloader(self._flat, self.device, self._runtime, config.compiler)
        self._runtime.offload = self._offload
        self._fallback = EagerFallback(module, self._runtime, gather=config.zero_stage == 3)
        self._pipeline = Pipeline(runtime=self._runtime, config=config, device=self.device,
                                  engine_fingerprint=self._fingerprint(), guard=self._rails)
        if "offload_optimizer" in config.pass_list:
            if self._flat.inner is None:
                raise ValueError(
                    f"deepcompile.initialize: the pass offload_optimizer needs an optimizer whose "
                    f"update is elementwise (torch.optim's SGD, Adam, AdamW, ...), which steps "
                    f"flat chunks; {type(self.optimizer).__name__} steps parameter by parameter")
            # the CPU memory model counts the state (and held gradients) where the pass is on:
            # its plan and every pass before or after it read one budget for all of it
            self._runtime.count_offload_bytes = True
            if self._pipeline.memory_budget != float("inf"):
                # until planned, the state of every chunk leaves ([Note: provisional offload]);
                # unbounded, nothing is ever offloaded: the pass plans nothing, changes no graph
                self._offload.provisional = True
        elif config.auto_passes and self._pipeline.memory_budget != float("inf"):
            # auto may choose offload_optimizer from the profile: the state is in the budget
            # (profiled on the device: name the pass to profile with it offloaded)
            self._runtime.count_offload_bytes = True
        if self._runtime.count_offload_bytes and self._pipeline.memory_budget != float("inf"):
            # the step changed under the plan (a new shape, larger sizes): re-plan instead of
            # running out of memory (compiler/drift.py). Unbounded, no step runs out of the
            # budget: nothing to re-plan (each re-plan runs every kept pass again), and no
            # agreement to reach at each step boundary
            self._pipeline.on_drift.append(self._replan_offload)
        self._backend = Backend(self._registry, config.compiler, self._pipeline)
        # Dynamo keeps its backend for the life of the process: it gets a weak handle ([Note:
        # what Dynamo holds] in compiler/backend.py), so that a released engine is freed
        self._compiled = _compat.compile_module(module, WeakBackend(self._backend))
        self._warned_uncompiled = False
        # the user's model object stays safe to touch ([Note: the guarded model] in guard.py)
        self._guard = ModelGuard(module, self._registry, config.zero_stage)
        self._compiled = self._guard.wrap(self._compiled)
        self._scaler = self._make_loss_scaler()   # float16: runtime/loss_scale.py
        self._grad_check = GradCheck(self._trainable, self.device)   # [Note: overflow agreement]
        # Config.on_nonfinite: losses are checked on the device (no sync) at each backward and
        # the flag joins the gradients' at the step (dynamic loss scaling decides by itself)
        self._check_losses = config.on_nonfinite != "off" and not (
            self._scaler is not None and self._scaler.dynamic)
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        self.nonfinite_skipped = 0
        from .metrics import StepMetrics
        from .report.steptrace import StepTracer

        self._metrics = StepMetrics(self)
        self._tracer = StepTracer(self._pipeline, self.device)
        self._micro_steps = 0
        self._forwards = 0          # forwards with grad since the last backward
        self._optimizer_steps = 0
        self._comm.reset_stats()  # the initial broadcast of weights is not training traffic

    # -- training loop ---------------------------------------------------------------------
    # [Note: the training loop's guardrails] Every entry point is O(1) Python around the work:
    # a stopped engine refuses (runtime/guardrails.py), misuse raises UsageError before anything
    # runs, and an exception escaping the work is reported to the other ranks and stops the
    # engine (its collectives no longer match theirs).
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._rails.stopped is not None:
            raise self._rails.stopped_error()
        if torch.is_grad_enabled():
            gas = self.config.gradient_accumulation_steps
            if gas > 1 and self._micro_steps >= gas:
                raise self._usage("forward", f"a training forward for micro-step "
                                  f"{self._micro_steps + 1} of an accumulation window of {gas} "
                                  "(Config.gradient_accumulation_steps) without engine.step(): "
                                  "call engine.step() after every micro-step or after the last")
            self._forwards += 1
        self._state.micro_step = self._micro_steps   # this forward's micro-step (and backward's)
        if torch.is_grad_enabled():
            self._metrics.count_tokens(args, kwargs)
        try:
            out = self._compiled(*args, **kwargs)
        except BaseException as e:
            if isinstance(e, RuntimeError) and any(m in str(e) for m in _FREED_STORAGE):
                e.add_note(_EAGER_PARAMETER_READ)
            raise self._rails.on_exception(e, "forward", self._optimizer_steps, self._micro_steps)
        if not self._backend.records and not self._warned_uncompiled and torch.is_grad_enabled():
            self._warned_uncompiled = True
            log.warning(
                "deepcompile: the training forward compiled no graph: the model runs uncompiled "
                "(the eager fallback: correct, slow). Dynamo's warnings say why (or "
                "TORCH_LOGS=recompiles); with torch < 2.13 the cache entries of engines released "
                "earlier in this process count against torch._dynamo.config.recompile_limit: "
                "call torch._dynamo.reset() between engines")
        return out

    def backward(self, loss: torch.Tensor) -> None:
        if self._rails.stopped is not None:
            raise self._rails.stopped_error()
        if self._forwards == 0:
            raise self._usage("backward", "engine.backward() without a training forward since "
                              "the last backward() (called twice for one forward?): run "
                              "engine(...) and then engine.backward(loss) once per micro-step")
        gas = self.config.gradient_accumulation_steps
        if self._check_losses:
            self._loss_bad |= ~torch.isfinite(loss.detach()).all()
        if self._scaler is not None:
            loss = self._scaler.scale_loss(loss)
        try:
            (loss / gas if gas > 1 else loss).backward()
        except BaseException as e:
            raise self._rails.on_exception(e, "backward", self._optimizer_steps, self._micro_steps)
        self._forwards = 0
        self._micro_steps += 1

    def step(self) -> bool:
        """At the accumulation boundary: clip, optimizer step, zero grads; returns whether it
        stepped."""
        if self._rails.stopped is not None:
            raise self._rails.stopped_error()
        if self._micro_steps == 0:
            raise self._usage("step", "engine.step() without engine.backward() since the last "
                              "optimizer step: nothing to step (the optimizer would silently not "
                              "train)")
        if self._micro_steps % self.config.gradient_accumulation_steps:
            return False
        step, micro = self._optimizer_steps, self._micro_steps
        try:
            return self._step(step, micro)
        except BaseException as e:
            raise self._rails.on_exception(e, "step", step, micro)

    def _step(self, step: int, micro: int) -> bool:
        t0 = time.perf_counter()
        steady = self._pipeline.phase is Phase.STEADY
        # [Note: divergence check] first: before this step's own collectives; it carries the
        # ranks' re-plan agreement ([Note: agreed re-planning] in compiler/drift.py)
        self._pipeline.agree_replan(
            self._rails.end_step(step, micro, self._pipeline.replan_request()))
        self._runtime.before_optimizer_step()   # parked gathers dropped, local gradients reduced
        flat = self._flat
        if flat.inner is not None:   # the flat step ([Note: flat step] in runtime/flat.py)
            self._offload.begin_step()
            flat.fold_grads(self._offload.device_grad_chunks())
            grads = flat.grads()
            # gradients on the host (offload tier 2) are checked by their norms, and scaled as
            # they come back for the step ([Note: gradients on the host] in runtime/offload.py):
            # by the inverse loss scale (read before the check updates the scale) and the
            # clipping coefficient
            host_sq = self._offload.host_grad_sumsq()
            host_scale = None
            if host_sq is not None and self._scaler is not None:
                host_scale = self._scaler.inv_scale()
            # on every rank alike ([Note: overflow agreement] in runtime/loss_scale.py)
            clip = self.config.max_grad_norm
            norms = self._shared_norms(grads)
            finite, bad = self._grads_finite(grads, host_sq, norms)
            if finite and clip is not None:
                coef = self._clip_grad_norm(clip, grads, host_sq, host_scale, norms)
                if host_sq is not None:
                    host_scale = coef if host_scale is None else host_scale * coef
            if finite:
                self._offload.grad_scale = host_scale
                pre, post = _compat.optimizer_step_hooks(self.optimizer)
                for hook in pre:   # the user's hooks on engine.optimizer, as its step would
                    hook(self.optimizer, (), {})
                flat.sync_hyperparameters()
                self._offload.run_step()   # offloaded state streamed in and out (runtime/offload.py)
                for hook in post:
                    hook(self.optimizer, (), {})
                # what the LR scheduler's wrapper of `optimizer.step` records (it is not called)
                self.optimizer._opt_called = True
            flat.release_grads()
        else:                        # an optimizer that steps parameter by parameter
            grads = list(filter(_is_not_none, map(_grad_of, self._trainable)))
            norms = self._shared_norms(grads)
            finite, bad = self._grads_finite(norms=norms)
            if finite and self.config.max_grad_norm is not None:
                self._clip_grad_norm(self.config.max_grad_norm, grads, norms=norms)
            if finite:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._shards_changed()
        self._micro_steps = 0
        self._optimizer_steps += 1
        self._state.optimizer_steps = self._optimizer_steps
        self._pipeline.end_step(time.perf_counter() - t0)
        self._metrics.end_step()
        if self._pipeline.tracing is not None:   # engine.trace_next_step()
            self._tracer.stop(self._pipeline.last_step["phase"], self._pipeline.last_step["seconds"])
        self._offload.after_step()    # planned chunks' state leaves the device until the next step
        if steady:
            self._rails.enter_steady()   # the final compiles are done: Config.collective_timeout_s
        if bad is not None:
            raise NonFiniteError(
                f"deepcompile: inf/NaN at optimizer step {step} ({bad}): the optimizer step was "
                "not taken, on every rank "
                "(Config.on_nonfinite='raise'; 'skip' skips such steps with a warning)")
        return True

    def _usage(self, phase: str, what: str) -> UsageError:
        err = UsageError(f"deepcompile: {what} (rank {self._comm.rank}, optimizer step "
                         f"{self._optimizer_steps}, micro-step {self._micro_steps}).")
        return self._rails.on_exception(err, phase, self._optimizer_steps, self._micro_steps)

    def _shared_norms(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """`grads`' 2-norms where one read of them serves both the inf/NaN check and the clip
        (no loss scale: under one the check unscales first), else None ([Note: the check reads
        2-norms] in runtime/loss_scale.py)."""
        if not grads or self._scaler is not None:
            return None
        if self.config.max_grad_norm is None and self.config.on_nonfinite == "off":
            return None
        return grad_norms(grads)

    def _grads_finite(self, flat_grads: list[torch.Tensor] | None = None,
                      host_sq: torch.Tensor | None = None,
                      norms: list[torch.Tensor] | None = None) -> tuple[bool, str | None]:
        """Whether to take the step (the shards' gradients checked and unscaled, or the flat
        step's `flat_grads`), and (Config.on_nonfinite="raise") what to say in the
        NonFiniteError; the same on every rank ([Note: overflow agreement] in
        runtime/loss_scale.py: one fused check per dtype, one all-reduce of one-hot vectors);
        `norms`: the gradients' 2-norms (`_shared_norms`), read instead of them."""
        policy, scaler = self.config.on_nonfinite, self._scaler
        if scaler is None and policy == "off":
            return True, None
        inv = scaler.inv_scale() if scaler is not None else None
        found = self._grad_check(inv, flat_grads, host_sq, norms)
        if self._check_losses:   # a loss names the rank it came from; its gradient reaches all
            grads, losses = nonfinite_ranks(self._comm, found, self._loss_bad)
            self._loss_bad.zero_()
        else:
            (grads,), losses = nonfinite_ranks(self._comm, found), []
        if scaler is not None:
            scaler.update(bool(grads))   # skips (and logs) on overflow, lowers a dynamic scale
            if not grads or scaler.dynamic or policy != "raise":
                return not grads, None
        elif not grads and not losses:
            return True, None
        what = (f"loss on rank(s) {losses}, " if losses else "") + f"gradients on rank(s) {grads}"
        if scaler is None and policy == "skip":
            self.nonfinite_skipped += 1
            log.warning("deepcompile: inf/NaN %s at optimizer step %d: the step is skipped on "
                        "every rank (Config.on_nonfinite='skip'; %d skipped so far)", what,
                        self._optimizer_steps, self.nonfinite_skipped)
            return False, None
        return False, what

    MAX_REPLANS = 4

    def _replan_offload(self, reason: str) -> None:
        """The offload plan no longer describes the step: every chunk's state leaves the device
        at once (the least memory this engine can hold), and the pass plans again on new
        profiles from the next step on. At most MAX_REPLANS times; then the offloader's run-time
        check (CUDA) keeps deferring the reloads that do not fit. Called on the rank whose step
        drifted (ragged data: often one rank only), then on every other rank when the ranks
        agree to re-plan, before the optimizer step ([Note: agreed re-planning] in
        compiler/drift.py); what it decides from is the same on every rank."""
        pipe = self._pipeline
        planned = any(e["pass"] == "offload_optimizer" and e.get("kept", True)
                      for e in pipe.pass_log)
        # passes="auto" left it out (the step fitted) or reverted it: the new step may not fit,
        # so it plans now if it can ([Note: choosing passes] in compiler/autoplan.py: the same
        # conditions; the budget is bounded, or this listener is not registered)
        may = planned or (self.config.auto_passes and self._offload.movable()
                          and self.config.warmup_steps > 0)
        if not may or pipe.replans >= self.MAX_REPLANS or pipe.phase.value != "steady":
            return
        if not self._offload.provisional:   # (it is after a re-plan that was reverted)
            self._offload.go_provisional()
        self._pipeline.request_replan(["offload_optimizer"], reason)

    def _shards_changed(self, frozen_too: bool = False) -> None:
        """What is derived from the shards follows them (runtime/runtime.py)."""
        self._runtime.shards_changed(frozen_too)

    def _make_loss_scaler(self):
        mode = self.config.loss_scaling
        if mode is None:
            return None
        from .runtime.loss_scale import LossScaler

        return LossScaler(self._comm, self.device, dynamic=mode == "dynamic",
                          scale=self.config.initial_loss_scale if mode == "dynamic"
                          else self.config.loss_scale, window=self.config.loss_scale_window)

    def _drop_unused_prefetches(self) -> None:
        """Gathers a graph started for a next graph that did not run are waited for and dropped
        before the shards change ([Note: cross-graph prefetch])."""
        self._runtime.parked.drop_unused()

    def _check_reuse(self, compiled_for: ParamEntry, actual: ParamEntry) -> None:
        """A graph reused for another parameter after planning: a gradient accumulated (or sent
        to the host) by the compile-time parameter's id would mix two parameters' gradients."""
        if self.config.zero_stage == 3 and self._runtime.accum.accumulates(compiled_for):
            raise RuntimeError(
                f"deepcompile: the graph that accumulates the gradient of {compiled_for.name!r} "
                f"locally is also run for {actual.name!r} (graph reuse appeared after planning); "
                "their gradients cannot be told apart. Leave out the pass `selective_unshard`.")
        if self._offload.sends_grad(compiled_for.pid):
            raise RuntimeError(
                f"deepcompile: the graph that sends the gradient of {compiled_for.name!r} to the "
                f"host is also run for {actual.name!r} (graph reuse appeared after planning); "
                "their gradients cannot be told apart. Raise Config.memory_budget so that "
                "offload_optimizer keeps gradients on the device, or leave the pass out.")

    @torch.no_grad()
    def _clip_grad_norm(self, max_norm: float, grads: list[torch.Tensor],
                        host_sq: torch.Tensor | None = None,
                        host_scale: torch.Tensor | None = None,
                        norms: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Clips `grads` in place to a global norm of `max_norm`; the gradients on the host
        (offload tier 2) count by their squared norm `host_sq` times `host_scale` squared (the
        factor not yet applied to them; None: 1). `norms`: the 2-norms of `grads` if already
        computed. Returns the clipping coefficient (<= 1), for the caller to apply to the host
        gradients."""
        if grads:   # shards are disjoint; padding gradients and alignment gaps are 0
            if norms is None:
                norms = grad_norms(grads)
            local = torch.linalg.vector_norm(torch.stack(norms), 2.0).pow(2)
        else:
            local = torch.zeros((), dtype=torch.float32, device=self.device)
        if host_sq is not None:   # offload tier 2: the host gradients' squared norm, unscaled
            local = local + (host_sq if host_scale is None else host_sq * host_scale.square())
        # the shard group's shards hold every parameter once (hsdp: each group the same)
        total = self._layout.shard.all_reduce(local).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        return coef

    # -- state -----------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter fqn: full tensor on CPU} in master dtype, gathered; same on every rank."""
        out: dict[str, torch.Tensor] = {}
        with self._offload.masters_home():   # [Note: masters on the host] in runtime/offload.py
            for entry in self._registry:
                full = entry.comm.all_gather(entry.shard.detach())[: entry.numel]
                full = full.view(entry.shape).to("cpu", copy=True)
                for name in entry.names:
                    out[name] = full
        return out

    def save_checkpoint(self, path: str | os.PathLike, client_state: Any = None, *,
                        async_save: bool = False):
        """Save the shards, the optimizer state, the step counters and rank 0's `client_state`
        (anything `torch.load(weights_only=True)` reads back) under the directory `path`, on
        torch.distributed.checkpoint: loadable on any number of ranks and ZeRO stage, published
        atomically (collective; at an optimizer-step boundary). Returns `path`; with
        `async_save=True`, a Future of it (the data is copied first: training may go on).
        See checkpoint.py."""
        from . import checkpoint

        return checkpoint.save(self, path, client_state, async_save=async_save)

    def load_checkpoint(self, path: str | os.PathLike) -> Any:
        """Restore what `save_checkpoint` wrote (collective; any world size and ZeRO stage, the
        same model and optimizer groups); returns the saved `client_state` (or None)."""
        from . import checkpoint

        return checkpoint.load(self, path)

    def save_pretrained(self, directory: str | os.PathLike, dtype: torch.dtype | None = None,
                        max_shard_bytes: int | None = None) -> str:
        """Write the full model as a Hugging Face model directory (safetensors weights, and
        config.json when the model is a `transformers.PreTrainedModel`), in the master dtype
        unless `dtype` is given. Collective: call on every rank; rank 0 writes."""
        from . import export

        return export.save_pretrained(self, directory, dtype=dtype,
                                      max_shard_bytes=max_shard_bytes)

    def comm_stats(self, by_group: bool = False) -> dict[str, dict[str, Any]]:
        """Collectives since the engine was made: {kind: {"count", "bytes"}} (bytes: each
        collective's full tensor), summed over the layout's groups; `by_group=True`: {group:
        the same} for "world" (every rank) and, under a hierarchical layout, "intra" (within a
        group) and "inter" (across the groups). See [Note: layouts] in runtime/mesh.py."""
        return self._comm.stats(by_group)

    def report(self) -> Report:
        """What the compiler did: graphs, profiles, passes and their decisions, cache, comm."""
        return Report.build(self)

    def export_trace(self, path: str | os.PathLike) -> str:
        """Write a Chrome-trace JSON (Perfetto, chrome://tracing): every rank's lanes of the
        step traced by `trace_next_step()` (real timestamps, collectives labelled with their
        modules, exposed waits), or of the latest profiled step when none was traced, with a
        memory counter track. Collective: call it on every rank; rank 0 writes the file."""
        from .report.trace import export_trace

        return export_trace(self, path)

    @property
    def phase(self) -> str:
        """Where the engine is: "warmup", "profile", "measure" or "steady" (planning over)."""
        return self._pipeline.phase.value

    def metrics(self, peak_flops: float | None = None) -> dict[str, Any]:
        """Figures of the last optimizer step: step time, tokens/s, FLOPs and MFU (where the
        device's peak is known, or `peak_flops` is given), exposed communication, peak memory,
        collectives (metrics.py). Cheap: call it every step (e.g. for TensorBoard)."""
        return self._metrics.metrics(peak_flops)

    def trace_next_step(self) -> bool:
        """Record the next optimizer step (until `step()` returns) with torch.profiler, for
        `export_trace`, `plot` and the measured exposed communication in `metrics()`; call it
        on every rank, between steps. False when another profiler is recording."""
        return self._tracer.start()

    def save_report(self, path: str | os.PathLike) -> str:
        """Write `report()` as JSON with every rank's data for the pictures (memory curves,
        traced step, step times): `deepcompile report FILE --plot DIR` reads it. Collective:
        call it on every rank; rank 0 writes the file."""
        from .report.figures import gather_report

        report = gather_report(self)
        if self._comm.rank == 0:
            report.save(path)
        return str(path)

    def plot(self, directory: str | os.PathLike) -> list[str]:
        """Draw the pictures of this engine into `directory` (PNG, matplotlib: the `plot`
        extra): memory over the profiled step per rank with the budget, the traced step's
        compute/communication timeline (`trace_next_step()`), each pass before and after, step
        time through warm-up, profiling and the final compile; writes report.json and
        trace.json there too. Collective: call it on every rank; rank 0 writes."""
        from .report.figures import gather_report, plot_report

        report = gather_report(self)
        paths: list[str] = []
        if self._comm.rank == 0:
            os.makedirs(directory, exist_ok=True)
            paths.append(report.save(os.path.join(directory, "report.json")))
            paths += plot_report(report, directory)
        self.export_trace(os.path.join(directory, "trace.json"))
        return paths

    def _fingerprint(self) -> dict:
        """What determines a plan besides the graphs (the plan cache's key)."""
        from . import __version__
        cfg = self.config.to_dict()
        for key in ("cache_dir", "collective_timeout_s", "startup_timeout_s",
                    "divergence_check_every", "on_nonfinite"):
            cfg.pop(key, None)   # none of these changes a plan
        return {
            "world_size": self._comm.world,
            "layout": [self._layout.name, self._layout.group_size],
            "device": self.device.type,
            "torch": torch.__version__,
            "deepcompile": __version__,
            "config": cfg,
            "params": [(e.name, list(e.shape), str(e.compute_dtype), str(e.shard.dtype),
                        str(e.reduce_dtype)) for e in self._registry],
        }
