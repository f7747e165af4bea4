"""The Accelerate route: an `accelerate.Accelerator` for launching, devices and data; a
deepcompile engine for the model, the backward and the optimizer step.

    accelerator = Accelerator()              # accelerate launch --multi_gpu ... / torchrun
    engine = deepcompile.integrations.accelerate.initialize(
        accelerator, model, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
        config=deepcompile.Config(zero_stage=3, gradient_accumulation_steps=4))
    loader = accelerator.prepare(loader)     # data only: never the model or the optimizer
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)                # not accelerator.backward
        engine.step()                        # at the accumulation boundary
    engine.save_checkpoint(path)             # and engine.save_pretrained(dir)

`initialize` checks what the Accelerator would otherwise do to the model: DeepSpeed, FSDP or
Megatron plugins are refused (they shard the model themselves), Accelerate's gradient
accumulation must be 1 (the engine accumulates: `Config.gradient_accumulation_steps`), and
its mixed precision becomes the engine's compute dtype (`bf16` -> param_dtype bfloat16 with
fp32 masters, `fp16` -> float16 with deepcompile's dynamic loss scaling; Accelerate's autocast
and GradScaler are not used). The model must be on `accelerator.device`. On the CPU (gloo),
launch with torchrun and `Accelerator(cpu=True)`: `accelerate launch --cpu` starts several CPU
processes only through MPI.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from ..config import Config

try:
    import accelerate
except ImportError:   # pragma: no cover
    raise ImportError("deepcompile.integrations.accelerate needs accelerate: "
                      "pip install -c constraints.txt -e '.[hf]'") from None


def initialize(accelerator: "accelerate.Accelerator", model: nn.Module, optimizer=None,
               config: "Config | Mapping[str, Any] | None" = None):
    """`deepcompile.initialize` for a model trained next to an Accelerator (module docstring)."""
    import deepcompile
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM):
        raise ValueError(f"deepcompile.integrations.accelerate: the Accelerator is configured for "
                         f"{kind.value}, which shards the model itself; launch without it")
    if accelerator.gradient_accumulation_steps != 1:
        raise ValueError("deepcompile.integrations.accelerate: Accelerator("
                         f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps}) "
                         "would scale the loss again; accumulate with "
                         "deepcompile.Config(gradient_accumulation_steps=...) instead")
    cfg = Config.coerce(config)
    precision = str(accelerator.mixed_precision)
    if precision in ("bf16", "fp16"):
        wanted = "bfloat16" if precision == "bf16" else "float16"
        values = cfg.to_dict()
        if values["param_dtype"] not in (None, wanted):
            raise ValueError(f"deepcompile.integrations.accelerate: the Accelerator's mixed "
                             f"precision is {precision} but the Config has "
                             f"param_dtype={values['param_dtype']}")
        values["param_dtype"] = wanted
        cfg = Config.from_dict(values)
    elif precision not in ("no", "None"):
        raise ValueError(f"deepcompile.integrations.accelerate: mixed precision {precision!r} is "
                         "not supported; use 'no', 'bf16' or 'fp16'")
    devices = {p.device for p in model.parameters()}
    if devices and devices != {accelerator.device} and \
            {d.type for d in devices} != {accelerator.device.type}:
        raise ValueError(f"deepcompile.integrations.accelerate: the model is on "
                         f"{', '.join(map(str, devices))}; move it to accelerator.device "
                         f"({accelerator.device}) before initialize")
    return deepcompile.initialize(model, optimizer=optimizer, config=cfg)
