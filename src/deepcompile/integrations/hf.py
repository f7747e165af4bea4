"""`DeepCompileTrainer`: the Hugging Face Trainer, training through a deepcompile engine.

    from deepcompile.integrations.hf import DeepCompileTrainer
    trainer = DeepCompileTrainer(model=model, args=TrainingArguments(..., bf16=True),
                                 train_dataset=ds, deepcompile_config=deepcompile.Config(zero_stage=3))
    trainer.train()                       # torchrun --nproc-per-node N train.py
    trainer.train(resume_from_checkpoint=True)

[Note: the Trainer route] Everything the Trainer does is kept (data loading and sharding over
the ranks, loss normalisation over the accumulation window and the ranks, gradient
accumulation, LR schedule, logging, evaluation, callbacks, checkpoint rotation, resume); four
pieces are deepcompile's:
* the engine is built where the Trainer builds its optimizer (`create_optimizer`): the optimizer
  the TrainingArguments name (`optim`, `learning_rate`, `weight_decay` with the Trainer's own
  decay/no-decay split, betas, eps) over the engine's shards; the training forward runs the
  compiled engine (`_wrap_model` returns a thin module calling it, so Accelerate wraps nothing
  in DDP), the backward is `engine.backward`, and the Trainer's `optimizer.step()` is
  `engine.step()` (clipping to `max_grad_norm` inside; the logged grad_norm is the step's
  global gradient norm before clipping, `engine.grad_norm()`: the Trainer asks for it before
  its optimizer step, and gets a tensor that the engine's step fills);
* `TrainingArguments.bf16` / `fp16` select `Config.param_dtype` (bf16 compute with fp32 masters;
  fp16 with deepcompile's dynamic loss scaling); Accelerate's autocast and GradScaler are not
  used;
* the Trainer accumulates gradients itself, and its last window of an epoch may be short, so
  the engine runs with `gradient_accumulation_steps=1` (at ZeRO-1 each micro-step then
  reduce-scatters its gradients, as ZeRO-2 does);
* a checkpoint's optimizer part is an engine checkpoint (`checkpoint-N/deepcompile/`, DCP,
  loadable on another number of ranks), which also holds the exact fp32 master weights that a
  resume restores; the model part (`save_model`, `checkpoint-N/model.safetensors`) is written
  by `engine.save_pretrained` (collective, rank 0 writes), loadable with `from_pretrained`.
Evaluation (`evaluate`, `predict`) runs the model object itself, eagerly (at ZeRO-3 its module
hooks gather each layer's parameters; every rank runs the same batches, as the Trainer's
distributed evaluation does).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch
from torch import nn

try:
    import transformers
except ImportError:   # pragma: no cover -- exercised by a test with transformers hidden
    raise ImportError("deepcompile.integrations.hf needs transformers and accelerate: "
                      "pip install -c constraints.txt -e '.[hf]'") from None

from ..config import Config

ENGINE_CHECKPOINT = "deepcompile"   # the engine checkpoint inside a Trainer checkpoint directory
SCHEDULER_NAME = "scheduler.pt"


class _EngineModule(nn.Module):
    """What the Trainer calls for the training forward: the compiled engine. Holds no
    parameters of its own (the engine's module is not registered as a child)."""

    def __init__(self, engine) -> None:
        super().__init__()
        object.__setattr__(self, "engine", engine)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def train(self, mode: bool = True) -> "_EngineModule":
        super().train(mode)
        self.engine.module.train(mode)
        return self


class _EngineOptimizer(torch.optim.Optimizer):
    """The Trainer's `optimizer`: `step()` is `engine.step()`; param_groups and state are the
    engine optimizer's (the LR scheduler drives them)."""

    def __init__(self, engine) -> None:   # no super().__init__: a view of engine.optimizer
        self.engine = engine
        self.grad_norm: torch.Tensor | None = None   # filled by the next step (_grad_norm)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    @property
    def state(self):
        return self.engine.optimizer.state

    @property
    def defaults(self):
        return self.engine.optimizer.defaults

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DeepCompileTrainer: optimizer.step(closure) is not supported")
        scaler = self.engine._scaler
        skipped = scaler.skipped_steps if scaler is not None else 0
        if not self.engine.step():
            raise RuntimeError(
                "DeepCompileTrainer: the engine did not step at the Trainer's optimizer step "
                f"({self.engine._micro_steps} micro-steps since the last one)")
        if self.grad_norm is not None:
            self.grad_norm.copy_(self.engine.grad_norm())
            self.grad_norm = None
        accelerated = getattr(self, "accelerated", None)
        if accelerated is not None:   # a loss-scaling skip: the Trainer keeps the LR schedule
            accelerated._is_overflow = scaler is not None and scaler.skipped_steps > skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass   # engine.step() zeroes the shards' gradients

    def state_dict(self):
        """This rank's shard state (the Trainer's checkpoints save the engine checkpoint)."""
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.engine.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DeepCompile({self.engine.optimizer!r})"


class DeepCompileTrainer(transformers.Trainer):
    """A `transformers.Trainer` whose training runs through `deepcompile.initialize`
    ([Note: the Trainer route]). `deepcompile_config`: a `Config`, a dict, or a config file
    path (JSON/YAML/TOML, or a DeepSpeed config); the TrainingArguments supply the dtype
    (`bf16`/`fp16`) and `max_grad_norm`."""

    def __init__(self, *args: Any, deepcompile_config: "Config | Mapping[str, Any] | str | os.PathLike | None" = None,
                 **kwargs: Any) -> None:
        optimizers = kwargs.get("optimizers")
        if optimizers is not None and any(o is not None for o in optimizers):
            raise ValueError("DeepCompileTrainer: optimizers=(...) cannot be used: deepcompile "
                             "builds the optimizer over the parameter shards. Choose it with "
                             "TrainingArguments (optim, learning_rate, weight_decay, "
                             "lr_scheduler_type, ...)")
        super().__init__(*args, **kwargs)
        if isinstance(deepcompile_config, (str, os.PathLike)):
            deepcompile_config = Config.from_file(deepcompile_config)
        self.deepcompile_config = self._engine_config(Config.coerce(deepcompile_config))
        self.engine = None

    # -- configuration -------------------------------------------------------------------------
    def _engine_config(self, cfg: Config) -> Config:
        args = self.args
        if cfg.gradient_accumulation_steps != 1:
            raise ValueError("DeepCompileTrainer: set the accumulation in TrainingArguments("
                             "gradient_accumulation_steps=...), not in the deepcompile Config "
                             "(the Trainer accumulates)")
        if cfg.max_grad_norm is not None:
            raise ValueError("DeepCompileTrainer: set clipping in TrainingArguments("
                             "max_grad_norm=...), not in the deepcompile Config")
        values = cfg.to_dict()
        if args.bf16 or args.fp16:
            wanted = "bfloat16" if args.bf16 else "float16"
            if values["param_dtype"] not in (None, wanted):
                raise ValueError(f"DeepCompileTrainer: TrainingArguments asks for {wanted} but "
                                 f"the deepcompile Config has param_dtype={values['param_dtype']}")
            values["param_dtype"] = wanted
        values["max_grad_norm"] = args.max_grad_norm if args.max_grad_norm and \
            args.max_grad_norm > 0 else None
        return Config.from_dict(values)

    # -- the engine ----------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.engine is None:
            import deepcompile

            args = self.args
            opt_cls, opt_kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, self.model)
            decay = set(self.get_decay_parameter_names(self.model))
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]

            def build(shards):
                shards = list(shards)
                if len(shards) != len(names):
                    raise RuntimeError("DeepCompileTrainer: the engine's trainable shards do not "
                                       "match the model's trainable parameters")
                groups = [{"params": [s for n, s in zip(names, shards) if n in decay],
                           "weight_decay": args.weight_decay},
                          {"params": [s for n, s in zip(names, shards) if n not in decay],
                           "weight_decay": 0.0}]
                return opt_cls([g for g in groups if g["params"]], **opt_kwargs)

            self.engine = deepcompile.initialize(self.model, optimizer=build,
                                                 config=self.deepcompile_config)
        self.optimizer = self._engine_optimizer = _EngineOptimizer(self.engine)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return super().create_scheduler(num_training_steps, optimizer=optimizer or self.optimizer)

    def _prepare_for_training(self, *args: Any, **kwargs: Any):
        out = super()._prepare_for_training(*args, **kwargs)
        # Accelerate wrapped our optimizer (AcceleratedOptimizer; the LR scheduler tracks its
        # steps). Its GradScaler (fp16) must not unscale the engine's gradients: the engine
        # scales the loss itself; its overflow flag follows the engine's skipped steps.
        inner = getattr(self.optimizer, "optimizer", None)
        if self.engine is not None and isinstance(inner, _EngineOptimizer):
            self.optimizer.scaler = None
            inner.accelerated = self.optimizer
        return out

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if training and self.engine is not None:
            if isinstance(model, _EngineModule):
                return model
            return _EngineModule(self.engine)
        if not training:
            return self.model   # evaluation: the model object itself, eagerly
        return super()._wrap_model(model, training, dataloader)

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        if self.engine is None or not isinstance(model, _EngineModule):
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.args.n_gpu > 1:
            loss = loss.mean()
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        else:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        self.engine.backward(loss)   # the engine's gradient_accumulation_steps is 1: no rescale
        return loss.detach()

    def _grad_norm(self) -> torch.Tensor:
        """The norm the Trainer logs for this optimizer step, asked for before the step: a
        tensor that the engine's step fills with `engine.grad_norm()` (the Trainer reads it
        when it logs, after the step)."""
        pending = self._engine_optimizer.grad_norm
        if pending is None:
            pending = torch.full((), float("nan"), device=self.engine.device)
            self._engine_optimizer.grad_norm = pending
        return pending

    def _clip_grad_norm(self, model):
        if self.engine is None:
            return super()._clip_grad_norm(model)
        return self._grad_norm()   # engine.step() clips to max_grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        if self.engine is None:
            return super()._get_grad_norm(model, grad_norm)
        return self._grad_norm() if grad_norm is None else grad_norm

    # -- saving and loading ----------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self.engine is None:
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.save_pretrained(output_dir)   # collective; rank 0 writes
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.engine is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.engine.load_checkpoint(os.path.join(checkpoint, ENGINE_CHECKPOINT))
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.engine is None:   # not sharded yet: the Trainer loads the weights as usual
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # the engine checkpoint (loaded with the optimizer) holds the master weights

    def _load_best_model(self) -> None:
        if self.engine is None:
            return super()._load_best_model()
        self.engine.load_checkpoint(os.path.join(self.state.best_model_checkpoint,
                                                 ENGINE_CHECKPOINT))
