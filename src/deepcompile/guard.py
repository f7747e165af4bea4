"""The user's model object after `initialize`: safe to touch, or a clear error.

[Note: the guarded model] `initialize` takes over the module's parameters: the optimizer steps
the engine's flat shards, and at ZeRO-3 the module's own parameters keep their shape, stride
and dtype (Dynamo traces full-size math with them, and the backend finds them by object
identity) while their storage is freed between uses. Reading such a parameter in eager code
would read freed memory (a segfault, or garbage), and `model.state_dict()`,
`model.save_pretrained()`, `torch.save(model.state_dict())`, `model.to(...)` all read it. So:

* At ZeRO-3 each parameter object changes class, in place (`p.__class__`, identity kept), to
  `ShardedParameter`, an `nn.Parameter` subclass whose `__torch_function__` lets metadata
  through (shape, dtype, device, grad, hooks, ...) and every op when the parameter is
  materialized (the eager fallback's module hooks gather it before a module's forward), and
  otherwise raises `ShardedParameterError` naming the parameter and what to call instead;
  `repr()` describes it without reading it. Around every call of the compiled module the
  parameters are plain `nn.Parameter`s again (`ModelGuard.unguarded`), so Dynamo never sees
  the subclass: tracing, guards and graphs are what they were. Measured: a `__torch_function__`
  subclass *is* traced by Dynamo without a graph break when it is a pass-through, but this one
  has to test the storage, which Dynamo would trace; the class switch is two C loops per forward
  (`_set_class`), no Python per parameter.
* The module itself gets a per-instance class (a subclass of its own class with the same name,
  as FSDP2's `fully_shard` does; no process-wide patch) whose `state_dict`, `save_pretrained`,
  `load_state_dict` and `_apply` (`to`, `cuda`, `half`, ...) are checked: at ZeRO-1/2 the
  module's parameters are complete replicas (refreshed after every optimizer step), so
  `state_dict` and `save_pretrained` work as before; at ZeRO-3 they raise one clear error
  before reading or writing anything (a gather there would be a collective, and these are
  usually called on rank 0 only: it would hang). `to(...)` to where the model already is (what
  the HF Trainer does) is a no-op; any real move or cast raises. `load_state_dict` raises at
  every stage (it would change the module's copy and not the optimizer's shards).
* `model(...)` called directly (evaluation, generation) runs eagerly: at ZeRO-1/2 on the
  replicas, at ZeRO-3 through the eager fallback's hooks, which gather each module's parameters
  for its forward (collective: every rank must make the same calls).
* The module's parameters never hold gradients (the engine's shards do), so the habits of a
  plain loop would silently do nothing: `torch.nn.utils.clip_grad_norm_(model.parameters(), 1)`
  returned 0 and clipped nothing. At every stage each parameter object is a `GuardedParameter`
  between compiled calls (ZeRO-3: `ShardedParameter`, its subclass), whose `.grad` warns when
  read (`clip_grad_norm_` reads nothing else), naming Config.max_grad_norm and
  `engine.grad_norm()`; `model.zero_grad()` does nothing (`engine.step()` zeroes the
  gradients).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import deque
from itertools import repeat
import weakref
from typing import Any, Callable

import torch
from torch import nn

from . import _compat

_METADATA_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "element_size", "is_floating_point", "is_complex", "is_signed", "untyped_storage",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
    "get_device", "_is_view", "is_pinned", "is_shared", "has_names", "__len__",
})
_METADATA_ATTRIBUTES = frozenset({
    "shape", "dtype", "device", "grad", "requires_grad", "is_leaf", "grad_fn", "ndim",
    "layout", "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
    "is_mkldnn", "is_nested", "itemsize", "nbytes", "_grad", "_grad_fn", "_backward_hooks",
    "_post_accumulate_grad_hooks", "retains_grad", "output_nr", "_version", "_base",
    "is_xla", "is_mps", "is_xpu", "is_ipu", "is_vulkan", "is_mtia", "is_maia",
})

GUIDANCE = ("engine.full_state_dict() (every rank: full CPU tensors), engine.save_pretrained(dir) "
            "(every rank; a Hugging Face / safetensors directory) or engine.save_checkpoint(dir)")


class ShardedParameterError(RuntimeError):
    """Something read a parameter that deepcompile holds sharded over the ranks (ZeRO-3)."""


@functools.lru_cache(maxsize=None)
def _allowed(func: Callable) -> bool:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        attr = getattr(getattr(func, "__self__", None), "__name__", "")
        return name != "__get__" or attr in _METADATA_ATTRIBUTES   # setters: .data=, .grad=
    return name in _METADATA_METHODS


def _op_name(func: Callable) -> str:
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):
        return "." + getattr(getattr(func, "__self__", None), "__name__", "?")
    return name


_TENSOR_GRAD = torch.Tensor.grad   # the tensor's own `.grad` (a C descriptor)
GRAD_READ = ("deepcompile: {name}.grad was read after deepcompile.initialize, but the model's "
             "parameters hold no gradients (the engine's shards do): "
             "torch.nn.utils.clip_grad_norm_(model.parameters(), ...) clips nothing and returns "
             "0. Clip with deepcompile.Config(max_grad_norm=...); the step's gradient norm is "
             "engine.grad_norm() (or engine.metrics()['grad_norm']).")


class GuardedParameter(nn.Parameter):
    """A module parameter after `initialize`, between compiled calls (see [Note: the guarded
    model]): reading its `.grad`, which is always None, warns. Never constructed: existing
    `nn.Parameter` objects are switched to this class in place."""

    _deepcompile_info: tuple[str, int]   # (name, world size)

    @property
    def grad(self):
        grad = _TENSOR_GRAD.__get__(self)
        if grad is None:
            warnings.warn(GRAD_READ.format(name=self._deepcompile_info[0]), UserWarning,
                          stacklevel=2)
        return grad

    @grad.setter
    def grad(self, value):
        _TENSOR_GRAD.__set__(self, value)

    @grad.deleter
    def grad(self):
        _TENSOR_GRAD.__delete__(self)

    def __deepcopy__(self, memo):
        """A copy is the user's own parameter: a plain one (ZeRO-3: reading the data raises)."""
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.data.clone(memory_format=torch.preserve_format),
                                          self.requires_grad)
        return memo[id(self)]


class ShardedParameter(GuardedParameter):
    """A ZeRO-3 module parameter between uses (see [Note: the guarded model]). Never
    constructed: existing `nn.Parameter` objects are switched to this class in place."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _allowed(func):
            for a in args:
                if isinstance(a, ShardedParameter) and not _materialized(a):
                    if getattr(func, "__name__", "") in ("__repr__", "__str__", "__format__"):
                        return _describe(a)
                    name, world = a._deepcompile_info
                    raise ShardedParameterError(
                        f"deepcompile: {name} is sharded over {world} ranks by "
                        f"deepcompile.initialize (ZeRO-3): this rank holds 1/{world} of it, and "
                        f"the parameter's own memory is freed between uses, so `{_op_name(func)}` "
                        f"cannot read it. Use {GUIDANCE}; model(...) gathers what it needs "
                        "(called on every rank).")
        with _compat.disable_torch_function_subclass():
            return func(*args, **kwargs)


    def __repr__(self, *args, **kwargs) -> str:
        if not _materialized(self):
            return _describe(self)
        return super().__repr__(*args, **kwargs)


def _materialized(p: torch.Tensor) -> bool:
    with _compat.disable_torch_function_subclass():
        return p.untyped_storage().nbytes() > 0


def _describe(p: ShardedParameter) -> str:
    name, world = p._deepcompile_info
    with _compat.disable_torch_function_subclass():
        shape, dtype = tuple(p.shape), p.dtype
    return (f"ShardedParameter({name}, shape={shape}, dtype={dtype}: sharded over {world} ranks "
            f"by deepcompile (ZeRO-3); read it with engine.full_state_dict())")


class ModelGuard:
    """Installs the guards on one engine's module and switches the parameter guard off around
    each compiled call."""

    def __init__(self, module: nn.Module, registry, zero_stage: int) -> None:
        check_not_initialized(module)
        self.zero_stage = zero_stage
        self.world = registry.comm.world
        self._depth = 0
        self.params: list[nn.Parameter] = []
        for entry in registry:
            p = entry.param
            if type(p) is nn.Parameter:   # a foreign Parameter subclass keeps its class
                p._deepcompile_info = (" = ".join(entry.names), self.world)  # tied: all
                self.params.append(p)
        self._guarded = ShardedParameter if zero_stage == 3 else GuardedParameter
        module.__class__ = _guarded_class(type(module))
        module._deepcompile_guard = weakref.ref(self)
        self._guard()

    def _guard(self) -> None:
        _set_class(self.params, self._guarded)

    def _unguard(self) -> None:
        _set_class(self.params, nn.Parameter)

    @contextlib.contextmanager
    def unguarded(self):
        """Plain parameters inside (the compiled call: Dynamo traces and guards on them)."""
        if self._depth == 0:
            self._unguard()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._guard()

    def wrap(self, fn: Callable) -> Callable:
        if not self.params:
            return fn

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with self.unguarded():
                return fn(*args, **kwargs)
        return call


def _set_class(params: list[nn.Parameter], cls: type) -> None:
    """Every parameter's class switched in place, in C (`map`): no Python frame per parameter
    on the per-forward path (host work must not grow with the model)."""
    deque(map(object.__setattr__, params, repeat("__class__"), repeat(cls)), maxlen=0)


def check_not_initialized(module: nn.Module) -> None:
    if getattr(type(module), "_deepcompile_guarded", False):
        raise RuntimeError(
            "deepcompile.initialize: this model was already given to deepcompile.initialize (its "
            "parameters belong to that engine); build a new model, or keep using the first engine")


class _GuardedModule:
    """Mixed in front of the model's own class (see [Note: the guarded model])."""

    _deepcompile_guarded = True

    def _deepcompile_stage(self) -> int:
        guard = self.__dict__.get("_deepcompile_guard")
        guard = guard() if guard is not None else None
        return 3 if guard is None else guard.zero_stage   # engine gone: nothing is safe

    def state_dict(self, *args: Any, **kwargs: Any):
        if self._deepcompile_stage() == 3:
            raise ShardedParameterError(
                "deepcompile: model.state_dict() after deepcompile.initialize(zero_stage=3): the "
                "parameters are sharded over the ranks and the model holds none of their values. "
                f"Use {GUIDANCE}.")
        return super().state_dict(*args, **kwargs)

    def save_pretrained(self, *args: Any, **kwargs: Any):
        if self._deepcompile_stage() == 3 and kwargs.get("state_dict") is None:
            raise ShardedParameterError(
                "deepcompile: model.save_pretrained() after deepcompile.initialize(zero_stage=3): "
                "the parameters are sharded over the ranks and the model holds none of their "
                "values (nothing was written). Call engine.save_pretrained(dir) on every rank "
                "instead (rank 0 writes the directory).")
        return super().save_pretrained(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to zero: the parameters hold no gradients (engine.step() zeroes the shards')."""

    def load_state_dict(self, *args: Any, **kwargs: Any):
        raise RuntimeError(
            "deepcompile: model.load_state_dict() after deepcompile.initialize: the optimizer's "
            "sharded copy of the parameters (what training updates) would not change. Load the "
            "weights into the model before deepcompile.initialize, or resume with "
            "engine.load_checkpoint(dir).")

    def _apply(self, fn, *args: Any, **kwargs: Any):
        if _changes_nothing(self, fn):
            return self   # e.g. model.to(its own device), as the HF Trainer does
        raise RuntimeError(
            "deepcompile: the model cannot be moved or cast (model.to / cuda / half / float / "
            "...) after deepcompile.initialize: its parameters are owned by the engine. Move "
            "the model to its device before initialize (model.to(f'cuda:{LOCAL_RANK}')), and "
            "choose a compute dtype with deepcompile.Config(param_dtype=torch.bfloat16).")


def _changes_nothing(module: nn.Module, fn: Callable) -> bool:
    """Whether `fn` (what Module._apply maps over the tensors) keeps every parameter and buffer
    where it is, in its dtype: tried on an empty tensor of each (device, dtype)."""
    seen = set()
    with _compat.disable_torch_function_subclass():
        tensors = [*module.parameters(), *module.buffers()]
        for t in tensors:
            key = (t.device, t.dtype)
            if key in seen:
                continue
            seen.add(key)
            probe = torch.empty(0, dtype=t.dtype, device=t.device)
            try:
                out = fn(probe)
            except Exception:   # noqa: BLE001 -- a conversion that cannot apply changes something
                return False
            if not isinstance(out, torch.Tensor) or out.device != t.device or out.dtype != t.dtype:
                return False
    return True


@functools.lru_cache(maxsize=None)
def _guarded_class(cls: type) -> type:
    attrs = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
             "__doc__": cls.__doc__}
    if not hasattr(cls, "save_pretrained"):
        attrs["save_pretrained"] = property(lambda self: _no_attribute(self, "save_pretrained"))
    return type(cls.__name__, (_GuardedModule, cls), attrs)


def _no_attribute(obj, name):
    raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
