"""Eager fallback: code that Dynamo does not capture still sees real parameters.

A skipped frame, a submodule called outside the compiled region, or the eager remainder of a
frame with a graph break inside a loop run module code eagerly, where the parameters' storage is
freed.  Forward hooks on every module that owns parameters gather them into the module's own
parameter storage before its forward and free them after.  Tensors autograd saves that alias a
gathered parameter are packed as a reference and re-gathered when the backward unpacks the
first of them (once per module call and parameter, whatever the number of saved views:
`_Regather`), so nothing full-size outlives the forward.  Gradients that eager autograd accumulates into a
module parameter are reduce-scattered into the shard's gradient at once.

The hooks do nothing while Dynamo traces (the compiled graphs gather for themselves). Run
eagerly, they run with Dynamo off ([Note: eager hooks run eagerly]).

ZeRO-1/2 (`gather=False`): the module's parameters are materialized replicas, so eager code
reads them directly and nothing is gathered; the gradient hook reduces a gradient eager autograd
accumulates into a replica into its shard at once (ZeRO-1: kept local until the last
micro-step, in the same accumulator the compiled graphs use: [Note: local gradient
accumulation]) and no replicated `.grad` stays behind. Where the replicas' refresh may be left
in flight by the optimizer step (`settle`: [Note: deferred refresh] in runtime/replicas.py),
every module below the root also gets a forward pre-hook that, run eagerly, waits for it: eager
code inside the compiled model (a module Dynamo does not capture) reads updated replicas.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .. import _compat
from .registry import ParamEntry


class _Regather:
    """One materialization of a parameter, as the backward needs it again: gathered at the
    first unpack of any tensor saved from it, shared by the others, freed with the last of them.
    One gather per module call and parameter, not one per saved tensor: a module whose
    data-dependent code (an experts loop) saves a different number of views of a parameter on
    each rank still makes the same collectives on every rank, as long as it saves at least one
    on each (a rank that saves none gathers nothing; an experts loop over one stacked weight
    saves one wherever a token is routed)."""
    __slots__ = ("entry", "full")

    def __init__(self, entry: ParamEntry) -> None:
        self.entry, self.full = entry, None

    def get(self) -> torch.Tensor:
        if self.full is None:
            self.full = self.entry.gather()
        return self.full


class _SavedParamRef:
    __slots__ = ("regather", "size", "stride", "offset")

    def __init__(self, regather: _Regather, t: torch.Tensor) -> None:
        self.regather, self.size, self.stride, self.offset = \
            regather, t.size(), t.stride(), t.storage_offset()


class EagerFallback:
    def __init__(self, module: nn.Module, runtime, gather: bool = True,
                 settle: bool = False) -> None:
        self._runtime = runtime
        registry = runtime.registry
        self._depth: dict[int, int] = {}          # pid -> nesting count of live uses
        self._by_ptr: dict[int, _Regather] = {}   # data_ptr of materialized storage -> its regather
        self._handles = []
        # the hooks live on the user's module and parameters (the parameters' in C++, where the
        # garbage collector does not look): they hold this object weakly and name their entries
        # by index, so that they keep nothing of a released engine alive
        self._groups: list[list[ParamEntry]] = []
        for mod in module.modules() if gather else ():
            entries = [registry.entry_for(p) for p in mod._parameters.values() if p is not None]
            entries = [e for e in entries if e is not None]
            if not entries:
                continue
            self._groups.append(entries)
            k = len(self._groups) - 1
            self._handles.append(mod.register_forward_pre_hook(_weak_hook(self._pre_hook, k)))
            self._handles.append(mod.register_forward_hook(_weak_hook(self._post_hook, k),
                                                           always_call=True))
        if settle and runtime.replicas is not None and runtime.comm.world > 1:
            # one hook per module below the root, which waits for them all; not on the root,
            # whose call runs eagerly around the compiled forward, which waits by itself (a
            # direct `model(...)` waits at its first read of a PendingParameter: guard.py)
            self._settle = runtime.replicas.wait
            hook = _weak_hook(self._wait_hook, 0)
            self._handles += [mod.register_forward_pre_hook(hook) for mod in module.modules()
                              if mod is not module]
        self._grad_entries = [e for e in registry if e.param.requires_grad]
        for k, entry in enumerate(self._grad_entries):
            self._handles.append(entry.param.register_post_accumulate_grad_hook(
                _weak_hook(self._grad_hook, k)))
        self.materializations = 0  # how often eager code needed a gathered parameter
        # a released engine's hooks leave the module with it (the finalizer holds the handles,
        # not this object)
        weakref.finalize(self, _remove_all, self._handles)

    def _pre_hook(self, k: int, mod, args) -> None:
        for entry in self._groups[k]:
            depth = self._depth.get(entry.pid, 0)
            if depth == 0:
                entry.materialize()
                self.materializations += 1
                self._by_ptr[entry.param.untyped_storage().data_ptr()] = _Regather(entry)
            self._depth[entry.pid] = depth + 1
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_eagerly, self._unpack_eagerly)
        ctx.__enter__()
        mod._deepcompile_saved_hooks = getattr(mod, "_deepcompile_saved_hooks", []) + [ctx]

    def _wait_hook(self, _k: int, mod, args) -> None:
        self._settle()

    def _post_hook(self, k: int, mod, args, output) -> None:
        stack = getattr(mod, "_deepcompile_saved_hooks", None)
        if not stack:
            return
        stack.pop().__exit__(None, None, None)
        for entry in self._groups[k]:
            depth = self._depth[entry.pid] - 1
            self._depth[entry.pid] = depth
            if depth == 0:
                self._by_ptr.pop(entry.param.untyped_storage().data_ptr(), None)
                entry.release()

    def _pack(self, t: torch.Tensor):
        if self._by_ptr and isinstance(t, torch.Tensor) and t.device.type != "meta":
            regather = self._by_ptr.get(t.untyped_storage().data_ptr())
            if regather is not None:
                return _SavedParamRef(regather, t)
        return t

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, _SavedParamRef):
            return packed.regather.get().as_strided(packed.size, packed.stride, packed.offset)
        return packed

    def _pack_eagerly(self, t):   # [Note: eager hooks run eagerly]
        return _eagerly(self._pack, t)

    @staticmethod
    def _unpack_eagerly(packed):
        return _eagerly(EagerFallback._unpack, packed)

    def _grad_hook(self, k: int, param: torch.Tensor) -> None:
        entry = self._grad_entries[k]
        grad, param.grad = param.grad, None
        if grad is None:   # a compiled graph gave this replica no gradient (ZeRO-1/2)
            return
        rt = self._runtime
        if rt.defers_reduce:
            rt.accum.enable([entry])
            if not rt.step.last_micro_step:
                rt.accum.add(entry, grad)
                return
            grad = rt.accum.take(entry, grad)
        shard_grad = entry.reduce_grad(grad)
        if entry.shard.grad is None:
            entry.shard.grad = shard_grad
        else:
            entry.shard.grad.add_(shard_grad)


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
    handles.clear()


# [Note: eager hooks run eagerly] A module hook has two lives. Dynamo traces it inline into the
# module's graph: `torch.compiler.is_compiling()` is True there and the hook is a no-op (the
# compiled graph gathers by itself). Run by eager code, it must gather — but eager code inside a
# compiled model can still have Dynamo's frame callback on (torch 2.11 gives up on a frame with
# a graph break in a loop and runs it eagerly, compiling each frame it calls as a frame of its
# own): compiled as a frame, the hook's check is traced True and the hook became a no-op that
# never gathered (on torch 2.11 the loop_break scenarios of tests/test_models.py failed, and
# those with the since removed Config.eager_modules; on 2.13 the nested_break and mixtral_eager
# models, which then needed that setting). So the hook's code is never compiled as a frame
# (`never_a_dynamo_frame`), and what it runs runs with Dynamo off (`_eagerly`): the gathers, the
# saved-tensor hooks.
@torch.compiler.disable
def _eagerly(fn, *args):
    return fn(*args)


def _weak_hook(method, k: int):
    """A hook calling `method(k, *args)` while its object lives (a released engine's hooks do
    nothing). Dynamo traces module hooks: while compiling it returns at once (the compiled
    graphs gather by themselves), before the weak reference, which Dynamo cannot trace."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        if torch.compiler.is_compiling():
            return None
        m = ref()
        if m is not None:
            return _eagerly(m, k, *args)
        return None
    _compat.never_a_dynamo_frame(hook.__code__)
    return hook
