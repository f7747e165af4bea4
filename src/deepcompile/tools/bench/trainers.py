"""How each system trains the workload, on one rank. Runs in the bench's worker processes only.

A trainer exposes the same three calls for every system, so the timing loop is one piece of code:

    loss = trainer.micro(ids, last)   # forward + backward of one micro-step; returns the loss
    trainer.step()                    # after the last micro-step of the window: optimizer step
    trainer.steady()                  # after each warm-up step: True once the system runs its
                                      # final code (ours: passes planned, final graphs compiled)

Every system gets the same fp32 model (same seed), the same AdamW hyper-parameters (built over
whatever parameters the system hands its optimizer: shards, DTensors or flat partitions), the
same rank slice of the same data, and scales the loss by 1/gas (DeepSpeed's `engine.backward`
does that itself). Gradient clipping is off everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

from .. import workloads
from .systems import System, ours_config


class Trainer:
    num_params: int = 0  # of the model before wrapping

    def micro(self, ids: torch.Tensor, last: bool) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def steady(self) -> bool:
        return True

    def info(self) -> dict[str, Any]:
        return {}

    def own_comm_stats(self) -> dict[str, dict[str, int]] | None:
        """The system's own collective counters, where it keeps some (ours), to check the
        profiler's counts against."""
        return None

    def optimizer(self):
        """The optimizer whose state this rank holds."""
        return getattr(self, "_optimizer", None)

    def optimizer_state_bytes(self) -> int:
        """Bytes of the tensors in this rank's optimizer state (AdamW's moments and steps),
        each storage once (ours' per-parameter state are views of its flat chunks)."""
        opt = self.optimizer()
        if opt is None:
            return 0
        seen: dict[int, int] = {}
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.device.type != "meta":
                    seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        return sum(seen.values())


def _autocast(device: torch.device, dtype: str):
    """bf16 compute with fp32 parameters, for the systems without their own mixed precision."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


class _Plain(Trainer):
    """A module and a torch optimizer over its parameters (FSDP2, DDP, torch.compile)."""

    def __init__(self, module, model, w: workloads.Workload, device, sync=None,
                 autocast: bool = True) -> None:
        self.module, self.w, self.device = module, w, device
        self._optimizer = workloads.make_optimizer(model.parameters())
        self._sync = sync  # callable(last) -> context manager (DDP's no_sync)
        self._autocast = autocast

    def micro(self, ids, last):
        amp = _autocast(self.device, self.w.dtype) if self._autocast else contextlib.nullcontext()
        with self._sync(last) if self._sync else contextlib.nullcontext():
            with amp:
                loss = self.module(input_ids=ids, labels=ids).loss
            (loss / self.w.gas).backward()
        return loss.detach()

    def step(self):
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)


def _fsdp2(system: System, model, w, device, world: int) -> Trainer:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy() if w.dtype == "float32" else \
        MixedPrecisionPolicy(param_dtype=getattr(torch, w.dtype), reduce_dtype=torch.float32)
    layers = workloads.decoder_layers(model)
    for i, layer in enumerate(layers):
        if system.compile:  # torchtitan: compile each block, then shard it
            layer = torch.compile(layer, fullgraph=True)
            layers[i] = layer
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return _Plain(model, model, w, device, autocast=False)  # bf16: FSDP2's own policy


def _ddp(system: System, model, w, device, world: int) -> Trainer:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
    module = torch.compile(ddp) if system.compile else ddp
    return _Plain(module, model, w, device,
                  sync=lambda last: contextlib.nullcontext() if last else ddp.no_sync())


def _compile(system: System, model, w, device, world: int) -> Trainer:
    return _Plain(torch.compile(model), model, w, device)


class _Ours(Trainer):
    def __init__(self, system: System, model, w, device, compiler: str,
                 plan_cache: str | None) -> None:
        import functools

        import deepcompile

        self.config = ours_config(system, compiler=compiler, gas=w.gas, dtype=w.dtype)
        if plan_cache:  # [Note: plans in the bench] in run.py
            self.config["cache_dir"] = plan_cache
        self.engine = deepcompile.initialize(
            model, optimizer=functools.partial(torch.optim.AdamW, **workloads.ADAMW),
            config=deepcompile.Config(**self.config))
        self._steady_steps = 0

    def micro(self, ids, last):
        out = self.engine(input_ids=ids, labels=ids)
        self.engine.backward(out.loss)
        return out.loss.detach()

    def step(self):
        self.engine.step()

    def steady(self):
        # the first steady step compiles the final graphs (Inductor): warm-up includes it
        if self.engine.report().phase == "steady":
            self._steady_steps += 1
        return self._steady_steps >= 2

    def own_comm_stats(self):
        return self.engine.comm_stats()

    def optimizer(self):
        return self.engine.optimizer

    def info(self):
        rep = self.engine.report().to_dict()
        passes = self.config["passes"]
        return {"config": {**self.config, "passes": passes if isinstance(passes, str)
                           else list(passes)},
                "phase": rep["phase"],
                # the plan's structure (what a launch planned, timings aside): compared
                # between launches
                "plan": {"passes": [{"pass": p["pass"], "kept": p["kept"],
                                     "changed": p["changed"]} for p in rep["passes"]],
                         "chosen": (rep.get("auto") or {}).get("chosen"),
                         "collectives": {s["slot"]: [s["all_gathers"], s["reduce_scatters"]]
                                         for g in rep["graphs"] for s in g["slots"]}}}


class _DeepSpeed(Trainer):
    """DeepSpeed wants `engine.backward` and `engine.step` after every micro-step (it knows the
    accumulation boundary itself)."""

    def __init__(self, system: System, model, w, device, world: int) -> None:
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo" if device.type == "cpu" else "nccl")
        zero: dict[str, Any] = {"stage": system.stage}
        if system.stage == 3:
            zero["stage3_param_persistence_threshold"] = 0  # its default keeps small weights whole
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": w.batch,
            "gradient_accumulation_steps": w.gas,
            "train_batch_size": w.batch * w.gas * world,
            "gradient_clipping": 0.0,  # its default is 1.0
            "zero_allow_untested_optimizer": True,  # a torch.optim.AdamW
            "zero_optimization": zero,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        if w.dtype == "bfloat16":
            config["bf16"] = {"enabled": True}
        if system.deepcompile:
            config["compile"] = {"deepcompile": True}
        self.config = config
        self.engine, *_ = deepspeed.initialize(
            model=model, optimizer=workloads.make_optimizer(model.parameters()), config=config)
        if system.compile:
            self.engine.compile()

    def micro(self, ids, last):
        loss = self.engine(input_ids=ids, labels=ids).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def step(self):
        pass

    def optimizer(self):
        return self.engine.optimizer   # its ZeRO optimizer: the state of this rank's partition

    def info(self):
        return {"config": self.config}


def build(system: System, w: workloads.Workload, device: torch.device, world: int,
          compiler: str, plan_cache: str | None = None) -> Trainer:
    """The workload's model (seeded) wrapped by `system`, on `device`."""
    if system.kind == "deepspeed" and device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = workloads.build_model(w, device)
    n = workloads.num_params(model)
    peers = {"fsdp2": _fsdp2, "ddp": _ddp, "compile": _compile, "deepspeed": _DeepSpeed}
    if system.kind == "ours":
        trainer: Trainer = _Ours(system, model, w, device, compiler, plan_cache)
    elif system.kind in peers:
        trainer = peers[system.kind](system, model, w, device, world)
    else:
        raise ValueError(f"unknown system kind {system.kind!r}")
    trainer.num_params = n
    return trainer
