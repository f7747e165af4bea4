"""Config files and DeepSpeed configs (`Config.from_file`, `Config.from_deepspeed`).

A config file is JSON (.json), YAML (.yaml/.yml; needs PyYAML) or TOML (.toml; Python 3.11's
tomllib, or tomli). It holds either `Config` keys (at the top level, or under a `deepcompile`
table), or a DeepSpeed config, recognised by its DeepSpeed-only keys, which is read by
`from_deepspeed`.

[Note: DeepSpeed keys] What maps is mapped (the README has the table); what the compiler decides
for itself (bucket sizes, prefetch depth, persistence thresholds...) and what is not the engine's
business (batch sizes, logging) is accepted and listed in one warning; what would change
training and has no counterpart (an `optimizer` or `scheduler` section, fp16 knobs we lack,
parameter offload, NVMe) is a clear error naming the key. DeepSpeed's "auto" values (filled by the
HF Trainer's integration) must be given as keyword overrides: `from_deepspeed(ds,
gradient_accumulation_steps=4)`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger("deepcompile")

_DS_ONLY_KEYS = {"zero_optimization", "bf16", "fp16", "compile", "gradient_clipping",
                 "train_batch_size", "train_micro_batch_size_per_gpu", "optimizer", "scheduler",
                 "steps_per_print", "zero_allow_untested_optimizer", "wall_clock_breakdown",
                 "amp", "communication_data_type", "data_types", "activation_checkpointing"}
# accepted and not used: the compiler plans these itself, or they are not the engine's business
_DS_IGNORED = {
    "train_batch_size": "batch sizes are the data loader's",
    "train_micro_batch_size_per_gpu": "batch sizes are the data loader's",
    "steps_per_print": "logging", "wall_clock_breakdown": "logging", "tensorboard": "logging",
    "wandb": "logging", "csv_monitor": "logging", "comet": "logging", "comms_logger": "logging",
    "flops_profiler": "logging", "dump_state": "logging", "memory_breakdown": "logging",
    "zero_allow_untested_optimizer": "any torch.optim optimizer works",
    "prescale_gradients": "gradients are averaged after the reduce-scatter",
    "gradient_predivide_factor": "gradients are averaged after the reduce-scatter",
    "checkpoint": "checkpoints are engine.save_checkpoint's",
    "seed": "the script seeds",
}
_ZERO_IGNORED = {
    "overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
    "allgather_partitions", "reduce_scatter", "stage3_prefetch_bucket_size",
    "stage3_param_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "sub_group_size", "round_robin_gradients",
    "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
    "elastic_checkpoint", "load_from_fp32_weights", "ignore_unused_parameters",
    "legacy_stage1", "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
    "log_trace_cache_warnings", "stage3_model_persistence_threshold", "zeropp_loco_param",
}
_DS_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
              "fp16": "float16", "float16": "float16"}


def load_file(path: str | os.PathLike) -> Mapping[str, Any]:
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"Config.from_file: cannot read {path}: {e}") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"Config.from_file: {path} is not valid JSON: {e}") from None
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ImportError("Config.from_file: YAML needs PyYAML: "
                              "pip install -c constraints.txt -e '.[yaml]'") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"Config.from_file: {path} is not valid YAML: {e}") from None
    elif suffix == ".toml":
        try:
            import tomllib
        except ImportError:   # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ImportError("Config.from_file: TOML on Python 3.10 needs tomli: "
                                  "pip install -c constraints.txt -e '.[yaml]'") from None
        try:
            data = tomllib.loads(text)
        except ValueError as e:
            raise ValueError(f"Config.from_file: {path} is not valid TOML: {e}") from None
    else:
        raise ValueError(f"Config.from_file: {path}: unknown file type {suffix!r}; allowed: "
                         ".json, .yaml, .yml, .toml")
    if not isinstance(data, Mapping):
        raise ValueError(f"Config.from_file: {path} must hold a mapping of keys, got "
                         f"{type(data).__name__}")
    return data


def is_deepspeed(data: Mapping[str, Any]) -> bool:
    return any(k in _DS_ONLY_KEYS for k in data)


def _get(section: Mapping, key: str, where: str, overrides: dict, target: str | None = None):
    value = section.get(key)
    if value == "auto":
        target = target or key
        if target not in overrides:
            raise ValueError(f"Config.from_deepspeed: {where}{key} is 'auto' (HF Trainer fills "
                             f"those); pass it: Config.from_deepspeed(ds, {target}=...)")
        return overrides[target]
    return value


def _enabled(section: Any) -> bool:
    if isinstance(section, Mapping):
        return bool(section.get("enabled", False))
    return bool(section)


def _add_pass_for(out: dict, setting: str) -> None:
    """The pass that stands for DeepSpeed's `setting` (`Pass.deepspeed`) in `out["passes"]`."""
    from .passes import passes_with

    out.setdefault("passes", [])
    for name in passes_with(deepspeed=setting):
        if name not in out["passes"]:
            out["passes"].append(name)


def from_deepspeed(ds: Mapping[str, Any], overrides: dict) -> dict:
    """Config keys for a DeepSpeed config ([Note: DeepSpeed keys])."""
    if not isinstance(ds, Mapping):
        raise ValueError(f"Config.from_deepspeed: expected a dict or a file path, got "
                         f"{type(ds).__name__}")
    out: dict[str, Any] = {}
    ignored: list[str] = []

    def error(key: str, why: str) -> ValueError:
        return ValueError(f"Config.from_deepspeed: {key}: {why}")

    for key, value in ds.items():
        if key == "zero_optimization":
            if not isinstance(value, Mapping):
                raise error(key, "expected a mapping")
            for zkey, zvalue in value.items():
                where = f"zero_optimization.{zkey}"
                if zkey == "stage":
                    stage = _get(value, "stage", "zero_optimization.", overrides, "zero_stage")
                    if stage not in (1, 2, 3):
                        raise error(where, f"{stage!r} is not supported (deepcompile runs ZeRO "
                                           "stages 1, 2 and 3; stage 0 is plain DDP)")
                    out["zero_stage"] = stage
                elif zkey in ("offload_optimizer", "offload_param"):
                    device = zvalue.get("device", "none") if isinstance(zvalue, Mapping) else zvalue
                    device = str(device).lower() if device is not None else "none"
                    if device == "none":
                        continue
                    if zkey == "offload_param":
                        raise error(where, "parameter offload is not supported (deepcompile "
                                           "offloads optimizer state only: offload_optimizer)")
                    if device != "cpu":
                        raise error(where, f"device {device!r} is not supported; allowed: "
                                           "'cpu' (the offload_optimizer pass), 'none'")
                    _add_pass_for(out, "zero_optimization.offload_optimizer")
                elif zkey in ("zero_hpz_partition_size", "mics_shard_size"):
                    # ZeRO++'s hpZ and MiCS: the layouts "hpz" and "hsdp" (runtime/mesh.py)
                    size = zvalue
                    if isinstance(size, bool) or not isinstance(size, int) or size < 1 and \
                            not (zkey == "mics_shard_size" and size == -1):
                        raise error(where, f"{size!r} is not allowed; allowed: an integer >= 1")
                    if size > 1:
                        out["layout"] = "hpz" if zkey == "zero_hpz_partition_size" else "hsdp"
                        out["shard_group_size"] = size
                elif zkey in _ZERO_IGNORED:
                    ignored.append(where)
                else:
                    raise error(where, "unknown or not supported by deepcompile")
        elif key in ("bf16", "bfloat16"):
            if _enabled(value):
                out["param_dtype"] = "bfloat16"
        elif key == "fp16":
            if _enabled(value):
                out["param_dtype"] = "float16"
                fp16 = value if isinstance(value, Mapping) else {}
                for fkey, fvalue in fp16.items():
                    if fkey == "loss_scale":
                        out["loss_scale"] = "dynamic" if fvalue in (0, 0.0) else fvalue
                    elif fkey == "initial_scale_power":
                        out["initial_loss_scale"] = 2.0 ** fvalue
                    elif fkey == "loss_scale_window":
                        out["loss_scale_window"] = fvalue
                    elif fkey in ("enabled", "auto_cast"):
                        if fkey == "auto_cast" and fvalue:
                            raise error("fp16.auto_cast", "not supported (the model computes in "
                                                          "param_dtype throughout)")
                    elif fkey == "min_loss_scale" and fvalue in (1, 1.0):
                        continue
                    elif fkey == "hysteresis":
                        ignored.append(f"fp16.{fkey}")
                    else:
                        raise error(f"fp16.{fkey}", "not supported by deepcompile's loss scaling")
        elif key == "amp":
            if _enabled(value):
                raise error(key, "apex AMP is not supported; use bf16 or fp16")
        elif key == "gradient_accumulation_steps":
            out["gradient_accumulation_steps"] = _get(ds, key, "", overrides)
        elif key == "gradient_clipping":
            clip = _get(ds, key, "", overrides, "max_grad_norm")
            out["max_grad_norm"] = None if clip in (None, 0, 0.0) else clip
        elif key == "communication_data_type":
            if value is not None:
                if str(value).lower() not in _DS_DTYPES:
                    raise error(key, f"{value!r} is not supported; allowed: fp32, bf16, fp16")
                out["reduce_dtype"] = _DS_DTYPES[str(value).lower()]
        elif key == "data_types":
            grad = (value or {}).get("grad_accum_dtype") if isinstance(value, Mapping) else None
            if grad is not None and _DS_DTYPES.get(str(grad).lower()) != "float32":
                raise error("data_types.grad_accum_dtype", f"{grad!r}: deepcompile accumulates "
                                                           "gradients in the fp32 master dtype")
        elif key == "compile":
            if not isinstance(value, Mapping):
                raise error(key, "expected a mapping")
            for ckey, cvalue in value.items():
                if ckey == "deepcompile":
                    if not cvalue:
                        raise error("compile.deepcompile", "is false; deepcompile always "
                                    "compiles (set it to true, or leave the key out)")
                elif ckey == "offload_opt_states":
                    if cvalue:
                        _add_pass_for(out, "zero_optimization.offload_optimizer")
                elif ckey in ("free_activation", "double_buffer", "symmetric_memory",
                              "keep_int_input_tensors", "keep_all_input_tensors",
                              "sync_before_reduce", "sync_after_reduce",
                              "sync_before_allgather", "sync_after_allgather"):
                    ignored.append(f"compile.{ckey}")
                else:
                    raise error(f"compile.{ckey}", "unknown or not supported by deepcompile")
        elif key == "optimizer":
            raise error(key, "deepcompile builds the optimizer you pass to initialize: "
                             "deepcompile.initialize(model, optimizer=functools.partial("
                             "torch.optim.AdamW, lr=...)); remove this section")
        elif key == "scheduler":
            raise error(key, "use a torch.optim.lr_scheduler on engine.optimizer (README: "
                             "Launching); remove this section")
        elif key == "activation_checkpointing":
            raise error(key, "use the model's own activation checkpointing (Hugging Face: "
                             "model.gradient_checkpointing_enable()) before initialize")
        elif key in _DS_IGNORED:
            ignored.append(key)
        else:
            raise error(key, "unknown or not supported by deepcompile")
    out.update(overrides)   # explicit keyword arguments win
    if ignored:
        log.warning("deepcompile: DeepSpeed keys accepted and not used (the compiler plans "
                    "these, or they are not the engine's business): %s", ", ".join(sorted(ignored)))
    return out
