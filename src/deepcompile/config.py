"""Typed, validated configuration.

`Config` is a frozen dataclass; `Config.from_dict` accepts the same keys as a dict.  Every
invalid key or value raises `ValueError` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import torch

_COMPILERS = ("inductor", "fx")
_SUPPORTED_STAGES = (1, 2, 3)
_NONFINITE = ("raise", "skip", "off")
_HOST_STEP = ("auto", "always", "never")
_LAYOUTS = ("auto", "shard", "hsdp", "hsdp_zero", "hpz")

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_ALLOWED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# keys that were settings once: what to do instead
_REMOVED = {
    "eager_modules": "a submodule that must run eagerly needs no setting: wrap its forward "
                     "with torch.compiler.disable before deepcompile.initialize (e.g. "
                     "`module.forward = torch.compiler.disable(module.forward)` for each such "
                     "submodule); the eager fallback gathers its parameters for its forward. "
                     "Modules that Dynamo skips or graph-breaks on need nothing",
}


def _check_removed(keys) -> None:
    for key in keys:
        if key in _REMOVED:
            raise ValueError(f"Config.{key} was removed; {_REMOVED[key]}")


def _dtype(key: str, value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, str):
        name = value.lower().removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            raise ValueError(f"Config.{key}: unknown dtype {value!r}; allowed: None, "
                             f"{', '.join(sorted(_DTYPE_NAMES))} or a torch floating dtype")
        return _DTYPE_NAMES[name]
    if value not in _ALLOWED_DTYPES:
        raise ValueError(f"Config.{key}: {value!r} is not allowed; allowed: None, "
                         "torch.float32, torch.bfloat16, torch.float16")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """How deepcompile shards, compiles and steps a model.

    zero_stage: 3 (parameters, gradients and optimizer state sharded); 2 (gradients and
        optimizer state sharded, parameters replicated; gradients reduce-scattered every
        micro-step); 1 (optimizer state sharded; gradients accumulated locally over the
        micro-steps and reduce-scattered once per optimizer step). Every stage keeps fp32
        masters (under param_dtype) in the sharded optimizer state.
    compiler: "inductor" (code generation) or "fx" (partitioned FX graphs run as Python;
        for debugging and fast CPU tests).
    gradient_accumulation_steps: micro-steps per optimizer step (>= 1).
    max_grad_norm: global-norm clipping over all shards when set (> 0).
    param_dtype: compute dtype of gathered parameters (masters stay fp32); None = as loaded.
    reduce_dtype: dtype of gradient reduction; None = param_dtype (or the master dtype).
    passes: "auto" (the default; None means the same): the pipeline chooses the passes and
        their order from the first profile and the memory budget, and says why in the report
        (compiler/autoplan.py); or optimization passes by name, applied in the order given (a
        sequence, or one comma-separated string: "prefetch,bucket_reduce"); () or "" =
        insertion only. Either way, a pass whose measured steps are slower than before
        (or whose re-profiled peak exceeds the budget) is reverted.
    warmup_steps: optimizer steps run before profiling (the first one compiles).
    profile_steps: optimizer steps profiled before the passes plan, and after each pass that
        changed a graph (0: no profiling; then no passes can run).
    measure_steps: after each pass that changed a graph, at most this many optimizer steps
        timed with the new graphs and as many with the graphs from before it, interleaved; the
        trial stops as soon as the pass is certain to be kept (one step of each side for a
        pass that clearly helps). A pass whose steps are all slower than before is reverted
        (compiler/autoplan.py). 0: passes are judged on memory only.
    memory_budget: bytes (int), or a fraction of device memory (float in (0, 1], CUDA only:
        of the memory PyTorch can use when the engine is made, its reserved plus the free
        memory, so not the CUDA context or NCCL's buffers); None: 0.9 on CUDA, unbounded on
        CPU.
    cache_dir: directory of the plan cache (profiles and decisions); None: no cache.
    loss_scale: None (the default: dynamic loss scaling when param_dtype is float16, none
        otherwise), "dynamic", or a static scale (> 0). Dynamic scaling multiplies the loss by
        the scale before the backward, divides the gradients by it before clipping and the
        optimizer step, and when any rank finds an inf/NaN gradient skips that optimizer step
        on every rank and halves the scale; after `loss_scale_window` steps without overflow it
        doubles the scale (as torch.amp.GradScaler).
    initial_loss_scale: the first dynamic scale (2**16).
    loss_scale_window: optimizer steps without overflow before the dynamic scale doubles (2000).
    collective_timeout_s: seconds a rank waits for the others in a collective (or at a
        cross-rank check) once training is in its steady state, before it stops with an error
        that names the ranks, the step and the graph; applied to the process group (gloo's
        timeout, NCCL's watchdog). None: the process group's own timeout. Default 600.
    startup_timeout_s: the same during warm-up, profiling and the first steady step (ranks
        compile, and Inductor compiles, at different speeds). None: the process group's own.
        Default 1800. A timeout given to the process group (init_process_group's `timeout`,
        anything but torch's default) that is shorter than either is kept in its phase.
    divergence_check_every: every this many optimizer steps (0: never), the ranks compare a
        fingerprint of the collectives each ran (which graphs, which parameters, in which order,
        how many micro-steps) and all stop with the first difference if they disagree.
        Default 1 (measured cost in runtime/divergence.py). The steps between checks still
        compare the step number and agree whether any rank holds gradients of eager code, in
        one reduction of a few integers (runtime/eager.py).
    on_nonfinite: what an optimizer step does when a loss or a gradient is inf/NaN on any
        rank: "raise" (every rank raises NonFiniteError; the step is not taken), "skip" (every
        rank skips the step, with a warning), or "off" (no check). With dynamic loss scaling
        (float16) an overflow always skips the step and lowers the scale. Default "raise".
    host_step: where `offload_optimizer` steps the chunks whose masters it moves to the host:
        "auto" (on the host where that is predicted faster than streaming them through the
        device's step), "always" (on the host), "never" (streamed). Default "auto".
    layout: how the ranks share the model, in groups of `shard_group_size` ranks (a node):
        "shard" (every parameter sharded over every rank), "hsdp" (sharded within each group,
        replicated across groups: gathers and reduce-scatters stay in the group, gradients
        are all-reduced across groups; 1/G of the model state per rank), "hsdp_zero" (hsdp's
        collectives with the masters, gradients and optimizer state sharded over every rank:
        gradients are reduce-scattered across groups, and each group's 1/G block of every
        parameter, kept in the compute dtype, is gathered across groups after each optimizer
        step; ZeRO-3 only), "hpz" (sharded over
        every rank; the forward keeps a secondary shard of 1/G of each gathered parameter so
        that the backward re-gathers within the group; ZeRO-3 only), or "auto" (the default:
        "shard" with one group; else chosen when the engine is made from the model's size,
        the memory budget and the collectives measured in and across the groups, and said in
        the report: compiler/layouts.py). See [Note: layouts] in runtime/mesh.py.
    shard_group_size: G, the ranks per group; None: LOCAL_WORLD_SIZE (torchrun's ranks per
        node), else every rank (one group). A 2-D DeviceMesh given to `initialize` sets it.
    """

    zero_stage: int = 3
    compiler: str = "inductor"
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    passes: tuple[str, ...] | str | None = "auto"
    warmup_steps: int = 2
    profile_steps: int = 1
    measure_steps: int = 3
    memory_budget: int | float | None = None
    cache_dir: str | None = None
    loss_scale: float | str | None = None
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 2000
    collective_timeout_s: float | None = 600.0
    startup_timeout_s: float | None = 1800.0
    divergence_check_every: int = 1
    on_nonfinite: str = "raise"
    host_step: str = "auto"
    layout: str = "auto"
    shard_group_size: int | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "Config":
        _check_removed(kwargs)   # before the dataclass __init__'s TypeError for an unknown key
        return super().__new__(cls)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if isinstance(self.zero_stage, bool) or not isinstance(self.zero_stage, int) \
                or self.zero_stage not in _SUPPORTED_STAGES:
            raise ValueError(f"Config.zero_stage: {self.zero_stage!r} is not supported; "
                             f"supported: {', '.join(map(str, _SUPPORTED_STAGES))}")
        if self.compiler not in _COMPILERS:
            raise ValueError(f"Config.compiler: {self.compiler!r} is not allowed; "
                             f"allowed: {', '.join(map(repr, _COMPILERS))}")
        gas = self.gradient_accumulation_steps
        if isinstance(gas, bool) or not isinstance(gas, int) or gas < 1:
            raise ValueError(f"Config.gradient_accumulation_steps: {gas!r} is not allowed; "
                             "allowed: an integer >= 1")
        norm = self.max_grad_norm
        if norm is not None:
            if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0:
                raise ValueError(f"Config.max_grad_norm: {norm!r} is not allowed; "
                                 "allowed: None or a number > 0")
            set_(self, "max_grad_norm", float(norm))
        set_(self, "param_dtype", _dtype("param_dtype", self.param_dtype))
        set_(self, "reduce_dtype", _dtype("reduce_dtype", self.reduce_dtype))
        passes = "auto" if self.passes is None else self.passes
        if isinstance(passes, str) and passes.strip() != "auto":
            # "prefetch,bucket_reduce", as the command line takes them ("": insertion only)
            passes = tuple(p.strip() for p in passes.split(",") if p.strip())
        if isinstance(passes, str):
            passes = "auto"
        elif not all(isinstance(p, str) for p in passes):
            raise ValueError(f"Config.passes: {passes!r} is not allowed; "
                             "allowed: 'auto' or a sequence of pass names")
        else:
            passes = tuple(passes)
            twice = sorted({p for p in passes if passes.count(p) > 1})
            if twice:   # a pass plans from the graphs before it, never over its own rewrite
                raise ValueError(f"Config.passes: {twice[0]!r} is named more than once; "
                                 "allowed: each pass once")
        set_(self, "passes", passes)
        for key in ("warmup_steps", "profile_steps", "measure_steps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Config.{key}: {v!r} is not allowed; allowed: an integer >= 0")
        if self.passes and not self.auto_passes and self.profile_steps == 0:
            raise ValueError("Config.profile_steps: 0 is not allowed with passes; the passes plan "
                             "from profiles (allowed: an integer >= 1, or passes=())")
        budget = self.memory_budget
        if budget is not None:
            ok = (isinstance(budget, int) and not isinstance(budget, bool) and budget > 0) or \
                 (isinstance(budget, float) and 0.0 < budget <= 1.0)
            if not ok:
                raise ValueError(f"Config.memory_budget: {budget!r} is not allowed; allowed: None, "
                                 "bytes as an int > 0, or a fraction of device memory in (0, 1]")
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)) or not str(self.cache_dir):
                raise ValueError(f"Config.cache_dir: {self.cache_dir!r} is not allowed; allowed: "
                                 "None or a directory path")
            set_(self, "cache_dir", os.fspath(self.cache_dir))
        scale = self.loss_scale
        if scale is not None and scale != "dynamic":
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
                raise ValueError(f"Config.loss_scale: {scale!r} is not allowed; allowed: None "
                                 "(dynamic when param_dtype is float16, else no scaling), "
                                 "'dynamic', or a static scale > 0")
            set_(self, "loss_scale", float(scale))
        init = self.initial_loss_scale
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not init >= 1:
            raise ValueError(f"Config.initial_loss_scale: {init!r} is not allowed; allowed: a "
                             "number >= 1")
        set_(self, "initial_loss_scale", float(init))
        window = self.loss_scale_window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"Config.loss_scale_window: {window!r} is not allowed; allowed: an "
                             "integer >= 1")
        for key in ("collective_timeout_s", "startup_timeout_s"):
            t = getattr(self, key)
            if t is not None:
                if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
                    raise ValueError(f"Config.{key}: {t!r} is not allowed; allowed: None (the "
                                     "process group's own timeout) or seconds > 0")
                set_(self, key, float(t))
        every = self.divergence_check_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"Config.divergence_check_every: {every!r} is not allowed; allowed: "
                             "an integer >= 0 (0: no check)")
        if self.host_step not in _HOST_STEP:
            raise ValueError(f"Config.host_step: {self.host_step!r} is not allowed; allowed: "
                             f"{', '.join(map(repr, _HOST_STEP))}")
        if self.on_nonfinite not in _NONFINITE:
            raise ValueError(f"Config.on_nonfinite: {self.on_nonfinite!r} is not allowed; "
                             f"allowed: {', '.join(map(repr, _NONFINITE))}")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"Config.layout: {self.layout!r} is not allowed; "
                             f"allowed: {', '.join(map(repr, _LAYOUTS))}")
        g = self.shard_group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"Config.shard_group_size: {g!r} is not allowed; allowed: None "
                             "(LOCAL_WORLD_SIZE) or an integer >= 1")
        if self.layout == "hpz" and self.zero_stage != 3:
            raise ValueError(f"Config.layout: 'hpz' is not allowed with zero_stage="
                             f"{self.zero_stage}; its secondary shards serve the backward's "
                             "re-gathers, which only ZeRO-3 has (allowed: 'shard', 'hsdp', "
                             "'auto')")
        if self.layout == "hsdp_zero" and self.zero_stage != 3:
            raise ValueError(f"Config.layout: 'hsdp_zero' is not allowed with zero_stage="
                             f"{self.zero_stage}; it keeps ZeRO-3's gathers within the group, "
                             "and ZeRO-1/2 already shard the optimizer state over every rank "
                             "under 'shard' (allowed: 'shard', 'hsdp', 'auto')")
        from .passes import known_passes  # late: passes may import config
        unknown = [p for p in self.pass_list if p not in known_passes()]
        if unknown:
            raise ValueError(f"Config.passes: unknown pass {unknown[0]!r}; "
                             f"known: {', '.join(known_passes()) or '(none registered)'}")
        from .passes import needs_of
        warm = needs_of(self.pass_list).get("warmup_steps")
        if warm and self.warmup_steps == 0:
            raise ValueError(f"Config.warmup_steps: 0 is not allowed with {warm[0]}; the "
                             "optimizer state it plans for exists after the first optimizer "
                             "step (allowed: an integer >= 1)")

    @property
    def auto_passes(self) -> bool:
        """The pipeline chooses the passes (`passes="auto"`)."""
        return self.passes == "auto"

    @property
    def pass_list(self) -> tuple[str, ...]:
        """The passes named in the config (none when they are chosen automatically)."""
        return () if self.auto_passes else self.passes

    @property
    def loss_scaling(self) -> str | None:
        """"dynamic", "static" or None (no loss scaling): dynamic by default with float16."""
        if self.loss_scale == "dynamic" or (self.loss_scale is None
                                            and self.param_dtype is torch.float16):
            return "dynamic"
        return None if self.loss_scale is None else "static"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Config":
        _check_removed(values)
        names = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in names:
                raise ValueError(f"Config: unknown key {key!r}; allowed: {', '.join(sorted(names))}")
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> "Config":
        """A Config from a JSON, YAML or TOML file of Config keys (at the top level or under a
        `deepcompile` table), or of a DeepSpeed config (read by `from_deepspeed`). Keyword
        arguments override the file."""
        from ._config_io import is_deepspeed, load_file

        data = load_file(path)
        if is_deepspeed(data):
            return cls.from_deepspeed(data, **overrides)
        if isinstance(data.get("deepcompile"), Mapping):
            data = data["deepcompile"]
        return cls.from_dict({**data, **overrides})

    @classmethod
    def from_deepspeed(cls, ds_config: "Mapping[str, Any] | str | os.PathLike",
                       **overrides: Any) -> "Config":
        """A Config from a DeepSpeed config (a dict or a JSON/YAML/TOML file): ZeRO stage,
        bf16/fp16 (with its loss scaling), gradient accumulation, clipping, optimizer-state
        offload, communication dtype, `compile.deepcompile`. Keys the compiler decides itself
        are accepted with a warning; keys that would change training and have no counterpart
        raise ValueError naming them. Keyword arguments (Config keys) fill DeepSpeed's "auto"
        values and override the rest."""
        from ._config_io import from_deepspeed, load_file

        if isinstance(ds_config, (str, os.PathLike)):
            ds_config = load_file(ds_config)
        return cls.from_dict(from_deepspeed(ds_config, dict(overrides)))

    @classmethod
    def coerce(cls, value: "Config | Mapping[str, Any] | None") -> "Config":
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls.from_dict(value)
        raise ValueError(f"config: expected deepcompile.Config or a dict, got {type(value).__name__}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("param_dtype", "reduce_dtype"):
            d[k] = None if d[k] is None else str(d[k]).removeprefix("torch.")
        d["passes"] = "auto" if self.auto_passes else list(self.passes)
        return d
