"""The training engine: forward through the compiled model, backward, sharded optimizer step."""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from . import _compat
from ._assemble import OptimizerFactory, assemble
from .compiler.pipeline import Phase
from .config import Config
from .report import Report
from .runtime.flat import _grad_of, _is_not_none
from .runtime.errors import DistributedError, NonFiniteError, UsageError, is_comm_error
from .runtime.loss_scale import grad_norms, nonfinite_ranks
from .runtime.registry import ParamEntry

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


def _collective(method: Callable) -> Callable:
    """An engine method that communicates outside the training step: on every rank, or a
    CollectiveCallError on the ranks that called it ([Note: collective calls] in
    runtime/collective_calls.py); a collective failing inside it is a DistributedError naming what the
    other ranks reported. One entry for nested calls (plot writes the trace)."""
    name = method.__name__

    @functools.wraps(method)
    def call(self: "Engine", *args: Any, **kwargs: Any) -> Any:
        if self._in_collective:
            return method(self, *args, **kwargs)
        if self._rails.stopped is not None:
            raise self._rails.stopped_error()
        step, micro = self._optimizer_steps, self._micro_steps
        self._in_collective = True
        try:
            self._rails.enter_collective(name, step, micro, self._forwards)
            return method(self, *args, **kwargs)
        except BaseException as e:
            if is_comm_error(e) and not isinstance(e, DistributedError):
                raise self._rails.on_exception(e, name, step, micro)
            raise
        finally:
            self._in_collective = False
    return call


class Engine:
    """Trains `module` sharded over the process group. Create with `deepcompile.initialize`."""

    def __init__(self, module: nn.Module, optimizer: OptimizerFactory, config: Config,
                 group: dist.ProcessGroup | None = None, mesh: Any = None) -> None:
        self.config = config
        self.module = module
        # the parts, each after what it depends on (_assemble.py)
        assemble(self, optimizer, group, mesh)
        self._warned_uncompiled = False
        # frames of this model Dynamo stopped compiling while this engine's forward ran (one
        # warning each: `_recompile_limit_hit`)
        self._fell_back: set[str] = set()
        self._in_forward = False
        # Config.on_nonfinite: losses are checked on the device (no sync) at each backward and
        # the flag joins the gradients' at the step (dynamic loss scaling decides by itself)
        self._check_losses = config.on_nonfinite != "off" and not (
            self._scaler is not None and self._scaler.dynamic)
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        self.nonfinite_skipped = 0
        self._grad_norm: torch.Tensor | None = None   # [Note: the step's gradient norm]
        self._micro_steps = 0
        self._in_collective = False   # inside a collective method (_collective)
        self._forwards = 0          # forwards with grad since the last backward
        self._optimizer_steps = 0
        # [Note: the engine's step time] A step's time is the time spent inside the engine's
        # calls that train it: every training forward (`engine(...)` with grad enabled),
        # backward and the step itself, each from entry to return, summed. What the user does
        # between them (evaluation, including the inference graphs an eval forward compiles;
        # logging, data loading, a checkpoint save) is not in it: not in metrics()["step_s"],
        # the report's step log, the step-time picture, nor the passes' timed trials. Before
        # the steady state each call returns only once the device's work is done
        # (`Pipeline.wait_device`), so that the device's time is in the call that launched it;
        # in the steady state the device's work left when a call returns is counted where the
        # engine next waits for it (the inf/NaN check reads the gradients' flags at each step).
        # `_clock` is what the times are read from (tests inject time there).
        self._clock: Callable[[], float] = time.perf_counter
        self._work_s = 0.0          # this optimizer step's time in forwards and backwards so far
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
            try:   # [Note: collective calls]; the store fails where its host (rank 0) exited
                self._rails.at_forward(self._optimizer_steps, self._micro_steps, self._forwards)
            except BaseException as e:
                raise self._rails.on_exception(e, "forward", self._optimizer_steps,
                                               self._micro_steps)
            self._forwards += 1
        self._state.micro_step = self._micro_steps   # this forward's micro-step (and backward's)
        training = torch.is_grad_enabled()
        if training:
            t0 = self._clock()   # [Note: the engine's step time]: an eval forward is not timed
            self._metrics.count_tokens(args, kwargs)
        self._in_forward = True   # Dynamo compiles this model's frames now
        try:
            out = self._compiled(*args, **kwargs)
        except BaseException as e:
            if isinstance(e, RuntimeError) and any(m in str(e) for m in _FREED_STORAGE):
                e.add_note(_EAGER_PARAMETER_READ)
            raise self._rails.on_exception(e, "forward", self._optimizer_steps, self._micro_steps)
        finally:
            self._in_forward = False
        if training:
            self._pipeline.wait_device()
            self._work_s += self._clock() - t0
        if not self._backend.records and not self._warned_uncompiled and torch.is_grad_enabled():
            self._warned_uncompiled = True
            log.warning(
                "deepcompile: the training forward compiled no graph: the model runs uncompiled "
                "(the eager fallback: correct, slow). Dynamo's warnings say why (or "
                "TORCH_LOGS=recompiles); with torch < 2.13 the cache entries of engines released "
                "earlier in this process count against torch._dynamo.config.recompile_limit: "
                "call torch._dynamo.reset() between engines")
        return out

    def _recompile_limit_hit(self, limit_type: str, function: str) -> None:
        if not self._in_forward or function in self._fell_back:
            return
        self._fell_back.add(function)
        log.warning(
            "deepcompile: Dynamo stopped compiling %s (%s): it reached %s. Calls it has no "
            "graph for run eagerly from now on: trained correctly (the eager fallback gathers "
            "the parameters each module uses), but not compiled nor planned, and slower. Code "
            "whose graph depends on data (a loop count, or a branch, read with int() or "
            ".item()) is compiled once per value: raise the limit before the first step (e.g. "
            "torch._dynamo.config.%s = 64) to compile every value",
            _compat.describe_frame(function), function, _compat.recompile_limit_name(limit_type),
            limit_type)

    def backward(self, loss: torch.Tensor) -> None:
        if self._rails.stopped is not None:
            raise self._rails.stopped_error()
        if self._forwards == 0:
            raise self._usage("backward", "engine.backward() without a training forward since "
                              "the last backward() (called twice for one forward?): run "
                              "engine(...) and then engine.backward(loss) once per micro-step")
        t0 = self._clock()
        gas = self.config.gradient_accumulation_steps
        if self._check_losses:
            self._loss_bad |= ~torch.isfinite(loss.detach()).all()
        if self._scaler is not None:
            loss = self._scaler.scale_loss(loss)
        try:
            (loss / gas if gas > 1 else loss).backward()
        except BaseException as e:
            raise self._rails.on_exception(e, "backward", self._optimizer_steps, self._micro_steps)
        self._pipeline.wait_device()
        self._work_s += self._clock() - t0
        self._forwards = 0
        self._micro_steps += 1

    def step(self) -> bool:
        """Ends a micro-step. Inside an accumulation window (fewer than
        Config.gradient_accumulation_steps backwards since the last optimizer step) it does
        nothing and returns False; at the window's end it checks the gradients for inf/NaN,
        computes their global norm (`grad_norm()`), clips (Config.max_grad_norm), steps the
        optimizer, zeroes the gradients and returns True -- also when the optimizer step was
        skipped for inf/NaN gradients (Config.on_nonfinite="skip", or a loss scale's overflow).
        Call it on every rank after every `backward`, or once after the window's last."""
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
        t0 = self._clock()
        steady = self._pipeline.phase is Phase.STEADY
        # [Note: divergence check] first: before this step's own collectives; it carries the
        # ranks' re-plan agreement ([Note: agreed re-planning] in compiler/drift.py)
        self._pipeline.agree_replan(self._rails.end_step(
            step, micro, self._pipeline.replan_request(), held=bool(self._fallback.held)))
        self._runtime.before_optimizer_step()   # parked gathers dropped, local gradients reduced
        # eager code's gradients, by agreement ([Note: eager gradients are agreed])
        self._fallback.flush(self._rails.held_anywhere)
        flat = self._flat
        if flat.inner is not None:   # the flat step ([Note: flat step] in runtime/flat.py)
            self._offload.begin_step()
            flat.fold_grads(self._offload.device_grad_chunks())
            grads = flat.grads()
            # gradients on the host (offload tier 2) are checked by their norms, and scaled as
            # they come back for the step ([Note: gradients on the host] in offload/grads.py):
            # by the inverse loss scale (read before the check updates the scale) and the
            # clipping coefficient
            host_sq = self._offload.host_grad_sumsq()
            host_scale = None
            if host_sq is not None and self._scaler is not None:
                host_scale = self._scaler.inv_scale()
            # on every rank alike ([Note: overflow agreement] in runtime/loss_scale.py)
            clip = self.config.max_grad_norm
            finite, bad = self._check_grads(grads, host_sq, host_scale, flat=True)
            if finite and clip is not None:
                coef = self._clip_grads(clip, grads)
                if host_sq is not None:
                    host_scale = coef if host_scale is None else host_scale * coef
            if finite:
                self._offload.grad_scale = host_scale
                pre, post = _compat.optimizer_step_hooks(self.optimizer)
                for hook in pre:   # the user's hooks on engine.optimizer, as its step would
                    hook(self.optimizer, (), {})
                flat.sync_hyperparameters()
                self._offload.run_step()   # offloaded state streamed in and out (runtime/offload/)
                for hook in post:
                    hook(self.optimizer, (), {})
                # what the LR scheduler's wrapper of `optimizer.step` records (it is not called)
                self.optimizer._opt_called = True
            flat.release_grads()
        else:                        # an optimizer that steps parameter by parameter
            grads = list(filter(_is_not_none, map(_grad_of, self._trainable)))
            finite, bad = self._check_grads(grads)
            if finite and self.config.max_grad_norm is not None:
                self._clip_grads(self.config.max_grad_norm, grads)
            if finite:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._shards_changed()
        self._micro_steps = 0
        self._optimizer_steps += 1
        self._state.optimizer_steps = self._optimizer_steps
        outside = self._clock() - t0   # [Note: outside the graphs] in compiler/pipeline.py
        self._pipeline.wait_device()
        seconds, self._work_s = self._work_s + self._clock() - t0, 0.0
        self._pipeline.end_step(seconds, outside)
        self._metrics.end_step()
        if self._pipeline.runner.tracing is not None:   # engine.trace_next_step()
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

    # [Note: the step's gradient norm] Every optimizer step leaves the global 2-norm of the
    # gradients it applies (`grad_norm()`, `metrics()["grad_norm"]`): all ranks' shards (under
    # "hsdp" the first group's: each group holds every gradient), and the gradients on the host
    # (offload tier 2) by their squared norm, unscaled (a loss scale divided out), before
    # clipping -- what torch.nn.utils.clip_grad_norm_ returns on the whole model in one process; inf/NaN when a gradient is not. It is one all-reduced sum, so the
    # same on every rank. Without a loss scale, each gradient's float32 2-norm is read once (one
    # fused kernel), for the inf/NaN check too ([Note: the check reads 2-norms] in
    # runtime/loss_scale.py), and the squared sum rides in the check's all-reduce as one more
    # float: no collective of its own, and clipping reuses it (no all-reduce of its own either).
    # Under a loss scale the check unscales the gradients first, and with on_nonfinite="off"
    # there is no check: then one more fused read and one all-reduce of a scalar, which clipping
    # needed anyway. Computed at every step, never lazily: the gradients are freed by the step,
    # and a reduction when metrics() is read would make metrics() a collective call. Neither
    # reduction is counted in comm_stats() (bookkeeping, as the check).
    def _check_grads(self, grads: list[torch.Tensor], host_sq: torch.Tensor | None = None,
                     host_scale: torch.Tensor | None = None,
                     flat: bool = False) -> tuple[bool, str | None]:
        """`_grads_finite` for `grads` (`flat`: the flat step's, else the shards' own), and the
        step's global gradient norm ([Note: the step's gradient norm]); `host_sq`: the host
        gradients' squared norm, `host_scale` the factor not yet applied to them."""
        scaled = self._scaler is not None
        norms = grad_norms(grads) if grads and not scaled else None
        local = None if scaled else self._local_sq(norms, host_sq)
        finite, bad, total = self._grads_finite(grads if flat else None, host_sq, norms, local)
        if total is None:   # no check, or it unscaled the gradients in place: read them now
            if scaled and grads:
                norms = grad_norms(grads)
            local = self._local_sq(norms, host_sq, host_scale)
            total = self._comm.all_reduce(local, count=False)
        self._grad_norm = total.sqrt()
        return finite, bad

    def _local_sq(self, norms: list[torch.Tensor] | None, host_sq: torch.Tensor | None,
                  host_scale: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's squared gradient norm from its gradients' 2-norms (shards are disjoint;
        padding and alignment gaps are 0) and the host gradients' squared norm times
        `host_scale` squared."""
        if norms:
            local = torch.linalg.vector_norm(torch.stack(norms), 2.0).pow(2)
        else:
            local = torch.zeros((), dtype=torch.float32, device=self.device)
        if host_sq is not None:
            local = local + (host_sq if host_scale is None else host_sq * host_scale.square())
        if self._layout.replicated and self._layout.replicate.rank != 0:
            # hsdp: every group holds each gradient once ([Note: layouts] in runtime/mesh.py);
            # the sum over every rank counts the first group's (times 0 keeps an inf/NaN)
            local = local * 0.0
        return local

    def _grads_finite(self, flat_grads: list[torch.Tensor] | None = None,
                      host_sq: torch.Tensor | None = None,
                      norms: list[torch.Tensor] | None = None,
                      local_sq: torch.Tensor | None = None,
                      ) -> tuple[bool, str | None, torch.Tensor | None]:
        """Whether to take the step (the shards' gradients checked and unscaled, or the flat
        step's `flat_grads`), and (Config.on_nonfinite="raise") what to say in the
        NonFiniteError; the same on every rank ([Note: overflow agreement] in
        runtime/loss_scale.py: one fused check per dtype, one all-reduce of one-hot vectors);
        `norms`: the gradients' 2-norms, read instead of them. `local_sq` (this rank's squared
        gradient norm) is summed over the ranks in the check's all-reduce: the sum is returned
        (None where no check ran)."""
        policy, scaler = self.config.on_nonfinite, self._scaler
        if scaler is None and policy == "off":
            return True, None, None
        inv = scaler.inv_scale() if scaler is not None else None
        found = self._grad_check(inv, flat_grads, host_sq, norms)
        if self._check_losses:   # a loss names the rank it came from; its gradient reaches all
            (grads, losses), total = nonfinite_ranks(self._comm, found, self._loss_bad,
                                                     sq=local_sq)
            self._loss_bad.zero_()
        else:
            ((grads,), total), losses = nonfinite_ranks(self._comm, found, sq=local_sq), []
        if scaler is not None:
            scaler.update(bool(grads))   # skips (and logs) on overflow, lowers a dynamic scale
            if not grads or scaler.dynamic or policy != "raise":
                return not grads, None, total
        elif not grads and not losses:
            return True, None, total
        what = (f"loss on rank(s) {losses}, " if losses else "") + f"gradients on rank(s) {grads}"
        if scaler is None and policy == "skip":
            self.nonfinite_skipped += 1
            log.warning("deepcompile: inf/NaN %s at optimizer step %d: the step is skipped on "
                        "every rank (Config.on_nonfinite='skip'; %d skipped so far)", what,
                        self._optimizer_steps, self.nonfinite_skipped)
            return False, None, total
        return False, what, total

    MAX_REPLANS = 4

    def _replan_on_drift(self, reason: str) -> None:
        """The offload plan no longer describes the step: every chunk's state leaves the device
        at once (the least memory this engine can hold), and the pass plans again on new
        profiles from the next step on. At most MAX_REPLANS times; then the offloader's run-time
        check (CUDA) keeps deferring the reloads that do not fit. Called on the rank whose step
        drifted (ragged data: often one rank only), then on every other rank when the ranks
        agree to re-plan, before the optimizer step ([Note: agreed re-planning] in
        compiler/drift.py); what it decides from is the same on every rank."""
        pipe = self._pipeline
        planned = any(e["pass"] in self._drift_passes and e.get("kept", True)
                      for e in pipe.pass_log)
        # passes="auto" left them out (the step fitted) or reverted them: the new step may not
        # fit, so they plan now if they can ([Note: choosing passes] in compiler/autoplan.py:
        # the same conditions; the budget is bounded, or this listener is not registered)
        may = planned or (self.config.auto_passes and self._offload.movable()
                          and self.config.warmup_steps > 0)
        if not may or pipe.replans >= self.MAX_REPLANS or pipe.phase.value != "steady":
            return
        if not self._offload.provisional:   # (it is after a re-plan that was reverted)
            self._offload.go_provisional()
        self._pipeline.request_replan(list(self._drift_passes), reason)

    def _shards_changed(self, frozen_too: bool = False) -> None:
        """What is derived from the shards follows them (runtime/runtime.py)."""
        self._runtime.shards_changed(frozen_too)

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
    def _clip_grads(self, max_norm: float, grads: list[torch.Tensor]) -> torch.Tensor:
        """Clips `grads` in place to a global norm of `max_norm`, from the step's gradient norm
        ([Note: the step's gradient norm]: the host gradients counted). Returns the clipping
        coefficient (<= 1), for the caller to apply to the host gradients."""
        coef = (max_norm / (self._grad_norm + 1e-6)).clamp(max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        return coef

    # -- state -----------------------------------------------------------------------------
    @_collective
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{parameter fqn: full tensor on CPU} in master dtype, gathered; the same on every rank.
        Collective: call it on every rank (docs/guide/collectives.md)."""
        out: dict[str, torch.Tensor] = {}
        with self._offload.masters_home():   # [Note: masters on the host] in offload/masters.py
            for entry in self._registry:
                full = entry.comm.all_gather(entry.shard.detach())[: entry.numel]
                full = full.view(entry.shape).to("cpu", copy=True)
                for name in entry.names:
                    out[name] = full
        return out

    @_collective
    def save_checkpoint(self, path: str | os.PathLike, client_state: Any = None, *,
                        async_save: bool = False):
        """Save the shards, the optimizer state, the step counters and rank 0's `client_state`
        (anything `torch.load(weights_only=True)` reads back) under the directory `path`, on
        torch.distributed.checkpoint: loadable on any number of ranks and ZeRO stage, published
        atomically (at an optimizer-step boundary). Returns `path`; with `async_save=True`, a
        Future of it (the data is copied first: training may go on). See checkpoint.py.
        Collective: call it on every rank, with the same `path` (docs/guide/collectives.md)."""
        from . import checkpoint

        return checkpoint.save(self, path, client_state, async_save=async_save)

    @_collective
    def load_checkpoint(self, path: str | os.PathLike) -> Any:
        """Restore what `save_checkpoint` wrote (any world size and ZeRO stage, the same model
        and optimizer groups); returns the saved `client_state` (or None) on every rank.
        Collective: call it on every rank (docs/guide/collectives.md)."""
        from . import checkpoint

        return checkpoint.load(self, path)

    @_collective
    def save_pretrained(self, directory: str | os.PathLike, dtype: torch.dtype | None = None,
                        max_shard_bytes: int | None = None) -> str:
        """Write the full model as a Hugging Face model directory (safetensors weights, and
        config.json when the model is a `transformers.PreTrainedModel`), in the master dtype
        unless `dtype` is given. Collective: call it on every rank; rank 0 writes
        (docs/guide/collectives.md)."""
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
        """What the compiler did: graphs, profiles, passes and their decisions, cache, comm.
        Local: no communication (call it on any rank)."""
        return Report.build(self)

    @_collective
    def export_trace(self, path: str | os.PathLike) -> str:
        """Write a Chrome-trace JSON (Perfetto, chrome://tracing): every rank's lanes of the
        step traced by `trace_next_step()` (real timestamps, collectives labelled with their
        modules, exposed waits), or of the latest profiled step when none was traced, with a
        memory counter track. Collective: call it on every rank; rank 0 writes the file
        (docs/guide/collectives.md)."""
        from .report.trace import export_trace

        return export_trace(self, path)

    @property
    def phase(self) -> str:
        """Where the engine is: "warmup", "profile", "measure" or "steady" (planning over)."""
        return self._pipeline.phase.value

    @property
    def setup_steps(self) -> int | None:
        """How many optimizer steps the setup took (warm-up, profiling, the passes' trials)
        before the plan became final; None while it runs. Steps after it run the final code:
        time a benchmark from there (docs/guide/setup.md)."""
        return self._pipeline.setup_steps

    def metrics(self, peak_flops: float | None = None) -> dict[str, Any]:
        """Figures of the last optimizer step: step time, tokens/s, FLOPs and MFU (where the
        device's peak is known, or `peak_flops` is given), exposed communication, peak memory,
        collectives, the gradient norm (metrics.py). Cheap: call it every step (e.g. for
        TensorBoard). Local: no communication (call it on any rank)."""
        return self._metrics.metrics(peak_flops)

    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last optimizer step, before clipping: the 2-norm of
        every rank's gradients as the optimizer step applies them (accumulated, averaged over
        the ranks, a loss scale divided out), as torch.nn.utils.clip_grad_norm_ returns it in
        one process; inf/NaN when a gradient was not finite (Config.on_nonfinite then raised or
        skipped the step). The same on every rank: a 0-dim float32 tensor on the device
        (`float()` of it waits for the device; `metrics()["grad_norm"]` is that float). None
        before the first optimizer step. Local: no communication."""
        return self._grad_norm

    def trace_next_step(self) -> bool:
        """Record the next optimizer step (until `step()` returns) with torch.profiler, for
        `export_trace`, `plot` and the measured exposed communication in `metrics()`; call it
        on every rank, between steps. False when another profiler is recording."""
        return self._tracer.start()

    @_collective
    def save_report(self, path: str | os.PathLike) -> str:
        """Write `report()` as JSON with every rank's data for the pictures (memory curves,
        traced step, step times): `deepcompile report FILE --plot DIR` reads it. Collective:
        call it on every rank; rank 0 writes the file (docs/guide/collectives.md)."""
        from .report.figures import gather_report

        report = gather_report(self)
        if self._comm.rank == 0:
            report.save(path)
        return str(path)

    @_collective
    def plot(self, directory: str | os.PathLike) -> list[str]:
        """Draw the pictures of this engine into `directory` (PNG, matplotlib: the `plot`
        extra): memory over the profiled step per rank with the budget, the traced step's
        compute/communication timeline (`trace_next_step()`), each pass before and after, step
        time through warm-up, profiling and the final compile; writes report.json and
        trace.json there too. Collective: call it on every rank; rank 0 writes
        (docs/guide/collectives.md)."""
        from .report.figures import gather_report, plot_report

        report = gather_report(self)
        # the collectives first: the others do not wait in one while rank 0 draws
        self.export_trace(os.path.join(directory, "trace.json"))
        paths: list[str] = []
        if self._comm.rank == 0:
            os.makedirs(directory, exist_ok=True)
            paths.append(report.save(os.path.join(directory, "report.json")))
            paths += plot_report(report, directory)
        return paths
