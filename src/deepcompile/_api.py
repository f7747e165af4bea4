"""`deepcompile.initialize` (re-exported by the package)."""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch
from torch import nn

from .config import Config
from .engine import Engine, OptimizerFactory


def initialize(model: nn.Module, optimizer: OptimizerFactory | None = None,
               config: Config | Mapping[str, Any] | None = None, mesh: Any = None) -> Engine:
    """Shard `model` over the default process group and return a training engine.

    optimizer: a callable taking an iterable of parameters and returning a
        torch.optim.Optimizer (e.g. functools.partial(torch.optim.AdamW, lr=1e-3)); default AdamW.
    config: a `Config` or an equivalent dict.
    mesh: a `torch.distributed.DeviceMesh` over the default group's ranks: 1-D (shard over
        it) or 2-D (dim 0 replicates, dim 1 shards: the groups of `Config.layout` "hsdp" and
        "hpz"); None: the groups are made from `Config.shard_group_size` / LOCAL_WORLD_SIZE.
    The default process group is used; if there is none, it is initialized from torchrun's
    environment (nccl for CUDA models, gloo otherwise).
    """
    from ._assemble import _ensure_process_group, _model_device

    if not isinstance(model, nn.Module):
        raise TypeError(f"deepcompile.initialize: model must be an nn.Module, got {type(model).__name__}")
    from .guard import check_not_initialized

    check_not_initialized(model)
    cfg = Config.coerce(config)
    if optimizer is None:
        optimizer = torch.optim.AdamW
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("deepcompile.initialize: pass a callable that builds the optimizer "
                        "(e.g. functools.partial(torch.optim.AdamW, lr=1e-3)), not an optimizer "
                        "instance: deepcompile builds it over the parameter shards")
    if not callable(optimizer):
        raise TypeError("deepcompile.initialize: optimizer must be a callable taking an iterable of "
                        "parameters and returning a torch.optim.Optimizer (e.g. "
                        f"functools.partial(torch.optim.AdamW, lr=1e-3)), got {type(optimizer).__name__}")
    device = _model_device(model)
    if device.type == "cpu" and torch.cuda.is_available():
        warnings.warn(
            "deepcompile.initialize: CUDA is available but the model is on the CPU: it will train "
            "on the CPU, over gloo. To train on the GPUs, call "
            "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) and move the model to "
            "f'cuda:{LOCAL_RANK}' before initialize (README: Launching).", UserWarning,
            stacklevel=2)
    low = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                  if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)})
    if low and cfg.param_dtype is None:
        warnings.warn(
            f"deepcompile.initialize: the model's trainable parameters are {' and '.join(low)} "
            "and Config.param_dtype is None: the optimizer's master weights will be "
            f"{' and '.join(low)} too (updates smaller than their precision are lost). For "
            f"{low[0]} compute with float32 masters, leave the model in float32 (no "
            f"model.to(torch.{low[0]})) and set deepcompile.Config(param_dtype=torch.{low[0]}).",
            UserWarning, stacklevel=2)
    _ensure_process_group(device)
    return Engine(model, optimizer, cfg, mesh=mesh)
