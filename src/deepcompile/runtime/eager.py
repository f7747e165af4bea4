"""Eager fallback: code that Dynamo does not capture still sees real parameters.

A skipped frame, a submodule called outside the compiled region, or the eager remainder of a
frame with a graph break inside a loop run module code eagerly, where the parameters' storage is
freed.  Forward hooks on every module that owns parameters gather them into the module's own
parameter storage before its forward and free them after.  Tensors autograd saves that alias a
gathered parameter are packed as a reference and re-gathered when the backward unpacks the
first of them (once per module call and parameter, whatever the number of saved views:
`_Regather`), so nothing full-size outlives the forward.  Gradients that eager autograd
accumulates into a module parameter are held until the optimizer step ([Note: eager gradients
are agreed]).

The hooks do nothing while Dynamo traces (the compiled graphs gather for themselves). Run
eagerly, they run with Dynamo off ([Note: eager hooks run eagerly]).

ZeRO-1/2 (`gather=False`): the module's parameters are materialized replicas, so eager code
reads them directly and no forward hooks are installed; only the gradient hook is, so that a
gradient eager autograd accumulates into a replica is held for its shard and no replicated
`.grad` stays behind.

[Note: eager gradients are agreed] Eager code can run differently on each rank: the classic
experts loop skips an expert no token of this rank is routed to. A gradient reduced the moment
eager autograd makes it would pair its reduce-scatter with whatever the other ranks reduce at
that moment (another expert's gradient of the same size: a silently wrong sum). So each one is
held (full size, master dtype; later micro-steps add to it) until the optimizer step, where the
ranks first agree whether any of them holds one (one integer in the divergence check's
reduction: `Guardrails.end_step`), and if so which (a mask over the parameters, `flush`); then
every rank reduces each of those, in registry order, contributing zeros where it holds none, as
DDP does for a parameter unused on some ranks. Such a module trains exactly as it would
unsharded. At ZeRO-3 its forward needs its parameters gathered, which every rank must take part
in: each gather of the eager fallback is first agreed ([Note: eager gathers are agreed]).

[Note: eager gathers are agreed] At ZeRO-3 the fallback's gathers (a module's forward, a
re-gather in its backward) are collectives started by eager code, which may run on some ranks
only: two ranks that gather different modules of the same size would each compute with a
parameter assembled from both. Before each such gather the ranks exchange what they are about
to gather (on a gloo group of their own that carries nothing else: `Guardrails.agree_eager`),
and on any difference every rank raises the same DivergenceError naming the modules. A rank
that gathers where another gathers nothing waits for it there until the collective timeout,
and both then stop with reports naming where each was.
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
    __slots__ = ("entry", "full", "agree")

    def __init__(self, entry: ParamEntry, agree) -> None:
        self.entry, self.full, self.agree = entry, None, agree

    def get(self) -> torch.Tensor:
        if self.full is None:
            if self.agree is not None:   # [Note: eager gathers are agreed]
                self.agree("re-gathers for its backward", self.entry.name, [self.entry])
            self.full = self.entry.gather()
        return self.full


class _SavedParamRef:
    __slots__ = ("regather", "size", "stride", "offset")

    def __init__(self, regather: _Regather, t: torch.Tensor) -> None:
        self.regather, self.size, self.stride, self.offset = \
            regather, t.size(), t.stride(), t.storage_offset()


class EagerFallback:
    """`agree(what, where, entries)`: the ranks agree on a gather before it starts ([Note:
    eager gathers are agreed]; ZeRO-3 over several ranks, else None); `agree_mask(mask)`: the
    element-wise maximum of an integer tensor over the ranks (the identity on one rank)."""

    def __init__(self, module: nn.Module, runtime, gather: bool = True, agree=None,
                 agree_mask=None) -> None:
        self._runtime = runtime
        registry = runtime.registry
        self._agree = agree
        self._agree_mask = agree_mask
        self._depth: dict[int, int] = {}          # pid -> nesting count of live uses
        self._by_ptr: dict[int, _Regather] = {}   # data_ptr of materialized storage -> its regather
        self._handles = []
        # the hooks live on the user's module and parameters (the parameters' in C++, where the
        # garbage collector does not look): they hold this object weakly and name their entries
        # by index, so that they keep nothing of a released engine alive
        self._groups: list[list[ParamEntry]] = []
        self._names: list[str] = []               # per group: its module's name
        for name, mod in module.named_modules() if gather else ():
            entries = [registry.entry_for(p) for p in mod._parameters.values() if p is not None]
            entries = [e for e in entries if e is not None]
            if not entries:
                continue
            self._groups.append(entries)
            self._names.append(name or type(mod).__name__)
            k = len(self._groups) - 1
            self._handles.append(mod.register_forward_pre_hook(_weak_hook(self._pre_hook, k)))
            self._handles.append(mod.register_forward_hook(_weak_hook(self._post_hook, k),
                                                           always_call=True))
        self._grad_entries = [e for e in registry if e.param.requires_grad]
        for k, entry in enumerate(self._grad_entries):
            self._handles.append(entry.param.register_post_accumulate_grad_hook(
                _weak_hook(self._grad_hook, k)))
        self.materializations = 0  # how often eager code needed a gathered parameter
        # gradients eager autograd made, held for the optimizer step ([Note: eager gradients
        # are agreed]): pid -> flat full-size gradient in the master dtype (the runtime's: the
        # memory model counts them)
        self.held: dict[int, torch.Tensor] = runtime.eager_grads
        # a released engine's hooks leave the module with it (the finalizer holds the handles,
        # not this object)
        weakref.finalize(self, _remove_all, self._handles)

    def _pre_hook(self, k: int, mod, args) -> None:
        group = self._groups[k]
        if self._agree is not None:   # [Note: eager gathers are agreed]
            todo = [e for e in group if not self._depth.get(e.pid, 0)]
            if todo:
                self._agree("gathers for its forward", self._names[k], todo)
        for entry in group:
            depth = self._depth.get(entry.pid, 0)
            if depth == 0:
                entry.materialize()
                self.materializations += 1
                self._by_ptr[entry.param.untyped_storage().data_ptr()] = _Regather(entry,
                                                                                    self._agree)
            self._depth[entry.pid] = depth + 1
        ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_eagerly, self._unpack_eagerly)
        ctx.__enter__()
        mod._deepcompile_saved_hooks = getattr(mod, "_deepcompile_saved_hooks", []) + [ctx]

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
        # (the tensor's own .grad: the guarded parameter's warns when it is None, guard.py)
        grad, param.grad = torch.Tensor.grad.__get__(param), None
        if grad is None:   # a compiled graph gave this replica no gradient (ZeRO-1/2)
            return
        # held for the step ([Note: eager gradients are agreed]); the accumulated `.grad` is
        # autograd's no more, so the first is held as it is (in the master dtype)
        flat = grad.detach().reshape(-1)
        held = self.held.get(entry.pid)
        if held is None:
            self.held[entry.pid] = flat.to(entry.shard.dtype)
        else:
            held.add_(flat)

    @torch.no_grad()
    def flush(self, anywhere: bool) -> int:
        """At the optimizer step, on every rank: `anywhere`, whether some rank holds eager
        gradients (agreed); if so the ranks agree which parameters' and reduce each of them
        into its shard's gradient, in registry order, zeros where a rank holds none ([Note:
        eager gradients are agreed]). Returns how many were reduced."""
        if not anywhere:
            return 0
        entries = self._grad_entries
        mask = torch.tensor([e.pid in self.held for e in entries], dtype=torch.uint8)
        if self._agree_mask is not None:
            mask = self._agree_mask(mask)
        n = 0
        for e, on in zip(entries, mask.tolist()):
            if not on:
                continue
            grad = self.held.pop(e.pid, None)
            if grad is None:   # none on this rank: it contributes zeros, as DDP's
                grad = torch.zeros(e.numel, dtype=e.shard.dtype, device=e.shard.device)
            shard_grad = e.reduce_grad(grad)
            if e.shard.grad is None:
                e.shard.grad = shard_grad
            else:
                e.shard.grad.add_(shard_grad)
            n += 1
        return n


class EagerCalls:
    """How often each module that owns parameters ran its forward eagerly (outside every compiled
    graph), by module name: a forward pre-hook on each, a no-op while Dynamo traces ([Note: eager
    hooks run eagerly]). Made before `deepcompile.initialize` (the hooks are then part of what
    Dynamo traces); `deepcompile verify` reports it per step. The hooks leave the model with
    this object."""

    def __init__(self, module: nn.Module) -> None:
        self.names: list[str] = []
        self.counts: dict[str, int] = {}
        handles = []
        for name, mod in module.named_modules():
            if any(p is not None for p in mod._parameters.values()):
                self.names.append(name or type(module).__name__)
                handles.append(mod.register_forward_pre_hook(
                    _weak_hook(self._count, len(self.names) - 1)))
        weakref.finalize(self, _remove_all, handles)

    def _count(self, k: int, mod, args) -> None:
        name = self.names[k]
        self.counts[name] = self.counts.get(name, 0) + 1

    def take(self) -> dict[str, int]:
        """The counts since the last `take`."""
        out, self.counts = self.counts, {}
        return out


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
