"""Flat buffers: the trainable shards live in a few large buffers, and the optimizer steps those.

[Note: flat layout] After the user's optimizer is built over the shards (the *facade*: the
object `engine.optimizer` is, with the user's parameter groups, hooks and LR scheduler), every
trainable shard is moved into a *chunk*: one flat buffer per run of shards of one optimizer
group and one dtype, at most `chunk_bytes` (a larger shard gets a chunk of its own). Each shard
becomes a view of its chunk (`shard.data = chunk[off:off + n]`), so the shard objects — graph
inputs, the facade's parameters, the checkpoint's names — stay the same, and their data
pointers are fixed from then on: the runtime's tables keyed by them ([Note: runtime inputs] in
compiler/lower.py) are built after the relocation. Offsets are aligned to 64 bytes (Inductor
assumes 16-byte aligned inputs and copies misaligned ones); the gaps are zero.

[Note: flat step] For optimizers whose update is elementwise (`ELEMENTWISE`: torch.optim's
SGD, Adam, AdamW, ...), a second instance of the user's class (the *inner* optimizer) is
built over the chunks, one parameter group per facade group with the facade group's
hyperparameters (weight-decay groups keep their meaning: a chunk never mixes groups). The
update of every element depends only on that element and on per-group scalars, so stepping a
chunk is stepping its shards: bitwise the same for the same implementation where it rounds an
element alike wherever the element sits in its tensor (torch's Adam and AdamW, single-tensor,
foreach and fused; on the CPU fused SGD with momentum rounds a tensor's last few elements its
own way). Where the user left the implementation open (`foreach`
and `fused` unset) and the class has one, the inner optimizer uses torch's fused kernel: one
pass over each chunk's master, gradient and state (the multi-tensor default makes ~8 passes
over hundreds of tensors; on the CPU torch's default is the single-tensor loop, so the fused
kernel rounds differently from an eager run there). An implementation the user chose
(`foreach=False`, `foreach=True` or `fused=...`) is the inner optimizer's. Per step the engine:
  * folds the shards' gradients (accumulated by autograd, one tensor per shard) into each
    chunk's flat gradient (`fold_grads`: one `_foreach_copy_` per chunk; the shards'
    `.grad` are dropped in C, `map(setattr, ...)`), whose storage exists only during the step;
  * copies the facade's hyperparameters into the inner groups (`sync_hyperparameters`: the LR
    scheduler drives the facade);
  * steps chunks (`step(chunks)`): the inner optimizer steps exactly the chunks whose flat
    parameter has a gradient, so the offloader can step resident chunks in one call and
    stream the others in (runtime/offload.py).
Python runs per chunk and per group, never per parameter.

[Note: per-parameter state] The facade's `state[shard]` holds views of the inner state
(`exp_avg[off:off + n]`) and the chunk's scalars (`step`: the same tensor object), so
`engine.optimizer.state_dict()` is per parameter, as checkpoints (checkpoint.py) and users
expect. `engine.optimizer.load_state_dict()` installs per-parameter tensors; a post-hook copies
them into the inner flat state (`_after_load`) and points the facade at views again.
`engine.optimizer.step()` itself is not called by the engine (it would step the shards one by
one through the views: the same values, but the shared `step` counters would advance once per
shard).

Other optimizers (Adafactor's factored moments, LBFGS, a user's class, a subclass that may
override `step`) keep the facade stepping the shards directly; the shards still live in
chunks, but the step is per parameter and `offload_optimizer` refuses them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import operator
from typing import Iterable

import torch
from torch import nn

from .registry import ParamEntry

log = logging.getLogger("deepcompile")

CHUNK_BYTES = 64 << 20     # master bytes per chunk (at least; see `chunk_bytes_for`)
MAX_CHUNKS = 256           # more parameters than this many chunks of CHUNK_BYTES: larger chunks
ALIGN_BYTES = 64

ELEMENTWISE = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
    "Rprop", "ASGD") if hasattr(torch.optim, n))
_IMPL_KEYS = ("foreach", "fused", "capturable", "differentiable")

_grad_of = operator.attrgetter("grad")
_is_not_none = functools.partial(operator.is_not, None)


def chunk_bytes_for(total_bytes: int) -> int:
    """Chunk size for `total_bytes` of masters: CHUNK_BYTES, or larger so that there are at most
    about MAX_CHUNKS chunks (the per-step Python work is per chunk)."""
    return max(CHUNK_BYTES, -(-total_bytes // MAX_CHUNKS))


@dataclasses.dataclass(eq=False)
class Chunk:
    index: int
    group: int                       # the facade's parameter group
    entries: list[ParamEntry]
    offsets: list[int]               # element offset of each shard in the chunk
    numel: int                       # elements, alignment gaps included
    param: nn.Parameter              # the flat master (the inner optimizer's parameter)
    # the flat gradient; storage allocated during the step only (not in the repr: printing a
    # view of a released storage crashes the process)
    grad: torch.Tensor = dataclasses.field(repr=False)
    grad_views: list[torch.Tensor] = dataclasses.field(repr=False)   # per shard: its slice
    gaps: list[torch.Tensor] = dataclasses.field(repr=False)   # `grad`'s alignment gaps (zeroed)
    shards: list[nn.Parameter]

    @property
    def dtype(self) -> torch.dtype:
        return self.param.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * self.param.element_size()

    @property
    def grad_allocated(self) -> bool:
        return self.grad.untyped_storage().nbytes() > 0

    def state_tensors(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """The chunk's flat state tensors (same size as the chunk), by key."""
        st = optimizer.state.get(self.param, {})
        return {k: v for k, v in st.items()
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == self.numel}


def _align(n: int, itemsize: int) -> int:
    step = max(ALIGN_BYTES // itemsize, 1)
    return -(-n // step) * step


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer) in ELEMENTWISE


def implementation_open(optimizer: torch.optim.Optimizer) -> bool:
    """The user left the implementation to torch (`foreach` and `fused` unset, not
    differentiable) and the class has a fused kernel: the flat step may take it ([Note: flat
    step]). An implementation the user chose is kept."""
    d = optimizer.defaults
    return ("fused" in inspect.signature(type(optimizer).__init__).parameters
            and d.get("fused") is None and d.get("foreach") is None
            and not d.get("differentiable"))


def same_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict],
                   **implementation) -> torch.optim.Optimizer:
    """A new optimizer of `optimizer`'s class over `groups` (dicts with "params" and the
    group's hyperparameters) with `optimizer`'s defaults: the same update rule; the
    implementation keys (`_IMPL_KEYS`) are `optimizer`'s own defaults, or `implementation`."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{k: v for k, v in g.items() if k not in _IMPL_KEYS} for g in groups]
    return cls(groups, **{**kwargs, **implementation})


@dataclasses.dataclass
class _Standalone:     # what FlatState reads of a registry entry, for a bare parameter
    pid: int
    shard: torch.Tensor
    name: str


class FlatState:
    """The chunks of one engine and, for elementwise optimizers, the inner optimizer."""

    def __init__(self, facade: torch.optim.Optimizer, entries: Iterable[ParamEntry],
                 device: torch.device, chunk_bytes: int | None = None) -> None:
        self.facade = facade
        self.device = device
        by_shard = {id(e.shard): e for e in entries}
        groups: list[list[ParamEntry]] = []
        for g in facade.param_groups:
            members = []
            for p in g["params"]:
                e = by_shard.get(id(p))
                if e is None:
                    raise ValueError("deepcompile.initialize: the optimizer holds a tensor that "
                                     "is not one of the engine's parameter shards (build it "
                                     "from the parameters initialize passes to the factory)")
                members.append(e)
            groups.append(members)
        total = sum(e.shard.numel() * e.shard.element_size() for m in groups for e in m)
        self.chunk_bytes = chunk_bytes or chunk_bytes_for(total)
        self.chunks: list[Chunk] = []
        for gi, members in enumerate(groups):
            for run in self._runs(members):
                self.chunks.append(self._make_chunk(len(self.chunks), gi, run))
        self.chunk_of: dict[int, Chunk] = {e.pid: c for c in self.chunks for e in c.entries}
        self.elementwise = is_elementwise(facade)
        self.inner: torch.optim.Optimizer | None = None
        self.fused = False
        self._viewed: set[int] = set()       # chunks whose state the facade sees as views
        self._sync: list[tuple[int, dict]] = []   # per inner group: (facade group index, kept keys)
        if self.elementwise and self.chunks:
            self._build_inner()
            facade.register_load_state_dict_post_hook(self._after_load)
        elif self.chunks:
            log.warning("deepcompile: %s is not one of torch.optim's elementwise optimizers (%s): "
                     "it steps the parameters one by one, without the flat fused step, and its "
                     "state cannot be offloaded", type(facade).__name__,
                     ", ".join(c.__name__ for c in ELEMENTWISE))
        self.on_load: list = []              # called after the inner state was reloaded

    @classmethod
    def of_parameters(cls, facade: torch.optim.Optimizer, device) -> "FlatState":
        """Chunks over the facade's own parameters (flat 1-D tensors), with no engine: the flat
        step measured alone (the planner's optimizer timing, benchmarks/opt_step.py)."""
        params = [p for g in facade.param_groups for p in g["params"]]
        return cls(facade, [_Standalone(i, p, f"param{i}") for i, p in enumerate(params)],
                   torch.device(device))

    # -- layout -----------------------------------------------------------------------------
    def _runs(self, members: list[ParamEntry]) -> Iterable[list[ParamEntry]]:
        run: list[ParamEntry] = []
        size = 0
        for e in members:
            nbytes = _align(e.shard.numel(), e.shard.element_size()) * e.shard.element_size()
            if run and (e.shard.dtype != run[0].shard.dtype or size + nbytes > self.chunk_bytes):
                yield run
                run, size = [], 0
            run.append(e)
            size += nbytes
        if run:
            yield run

    @torch.no_grad()
    def _make_chunk(self, index: int, group: int, entries: list[ParamEntry]) -> Chunk:
        dtype = entries[0].shard.dtype
        itemsize = entries[0].shard.element_size()
        offsets, numel = [], 0
        for e in entries:
            offsets.append(numel)
            numel += _align(e.shard.numel(), itemsize)
        master = torch.zeros(numel, dtype=dtype, device=self.device)
        for e, off in zip(entries, offsets):
            n = e.shard.numel()
            master[off:off + n].copy_(e.shard.detach())
            e.shard.data = master[off:off + n]      # the same Parameter object, now a view
        param = nn.Parameter(master, requires_grad=True)
        grad = torch.empty(numel, dtype=dtype, device=self.device)
        views = [grad[off:off + e.shard.numel()] for e, off in zip(entries, offsets)]
        gaps = []
        ends = [off + e.shard.numel() for e, off in zip(entries, offsets)]
        for end, nxt in zip(ends, offsets[1:] + [numel]):
            if nxt > end:
                gaps.append(grad[end:nxt])
        grad.untyped_storage().resize_(0)
        return Chunk(index=index, group=group, entries=entries, offsets=offsets, numel=numel,
                     param=param, grad=grad, grad_views=views, gaps=gaps,
                     shards=[e.shard for e in entries])

    # -- the inner optimizer ----------------------------------------------------------------
    def _build_inner(self) -> None:
        facade = self.facade
        groups, pairs = [], []
        for gi, g in enumerate(facade.param_groups):
            params = [c.param for c in self.chunks if c.group == gi]
            if not params:
                continue
            groups.append({**g, "params": params})
            pairs.append(gi)
        inner = None
        if implementation_open(facade):
            try:
                inner = same_optimizer(facade, groups, fused=True, foreach=None)
                self.fused = True
            except (RuntimeError, ValueError, TypeError):
                inner = None
        if inner is None:
            inner = same_optimizer(facade, groups)
        self.inner = inner
        for ig, gi in zip(inner.param_groups, pairs):
            kept = {"params": ig["params"], **{k: ig[k] for k in _IMPL_KEYS if k in ig}}
            self._sync.append((gi, kept))

    def implementation(self) -> dict[str, object]:
        """The inner optimizer's implementation keys (`fused`, `foreach`, ...) that its class
        takes: what an eager optimizer needs to step exactly as the flat step does
        (`same_optimizer(optimizer, groups, **implementation)`); {} without an inner one."""
        if self.inner is None:
            return {}
        return {k: self.inner.defaults[k] for k in _IMPL_KEYS if k in self.inner.defaults}

    def sync_hyperparameters(self) -> None:
        """The facade's hyperparameters (the LR scheduler writes there) into the inner groups.
        Both sides looked up now, by index: `load_state_dict` replaces an optimizer's group
        dicts (the facade's on a checkpoint load or accelerate's `prepare`, where the scheduler
        then writes; the inner's in `_after_load`)."""
        facade = self.facade.param_groups
        for ig, (gi, kept) in zip(self.inner.param_groups, self._sync):
            ig.update(facade[gi])
            ig.update(kept)

    # -- gradients ----------------------------------------------------------------------------
    def fold_grads(self, chunks: Iterable[Chunk] | None = None) -> None:
        """Each chunk's shard gradients into its flat gradient; the shards' `.grad` dropped."""
        for c in self.chunks if chunks is None else chunks:
            grads = list(map(_grad_of, c.shards))
            if not c.grad_allocated:
                c.grad.untyped_storage().resize_(c.nbytes)
                if c.gaps:
                    torch._foreach_zero_(c.gaps)
                if all(map(_is_not_none, grads)):
                    torch._foreach_copy_(c.grad_views, grads)
                else:   # a shard without a gradient this step (unused): zeros
                    for v, g in zip(c.grad_views, grads):
                        v.zero_() if g is None else v.copy_(g)
            else:       # already folded (a gradient routed here, or a second fold): add
                for v, g in zip(c.grad_views, grads):
                    if g is not None:
                        v.add_(g)
            any(map(setattr, c.shards, itertools.repeat("grad"), itertools.repeat(None)))

    def release_grads(self, chunks: Iterable[Chunk] | None = None) -> None:
        for c in self.chunks if chunks is None else chunks:
            c.grad.untyped_storage().resize_(0)
            c.param.grad = None

    def grads(self) -> list[torch.Tensor]:
        """The flat gradients allocated now (after `fold_grads`)."""
        return [c.grad for c in self.chunks if c.grad_allocated]

    # -- stepping -----------------------------------------------------------------------------
    def step(self, chunks: list[Chunk]) -> None:
        """One inner optimizer step over exactly `chunks` (their gradients folded)."""
        if not chunks:
            return
        for c in chunks:
            c.param.grad = c.grad
        self.inner.step()
        for c in chunks:
            c.param.grad = None
            if c.index not in self._viewed:
                self._view_state(c)

    @torch.no_grad()
    def _view_state(self, c: Chunk) -> None:
        """The facade's per-shard state: views of the chunk's flat state, shared scalars."""
        st = self.inner.state.get(c.param)
        if not st:
            return
        for e, off, shard in zip(c.entries, c.offsets, c.shards):
            n = shard.numel()
            self.facade.state[shard] = {
                k: v[off:off + n] if isinstance(v, torch.Tensor) and v.dim() == 1
                and v.numel() == c.numel else v for k, v in st.items()}
        self._viewed.add(c.index)

    # -- loading ----------------------------------------------------------------------------
    @torch.no_grad()
    def _after_load(self, facade: torch.optim.Optimizer) -> None:
        """`facade.load_state_dict` installed per-shard state: copy it into the flat state."""
        inner = self.inner
        flat_state: dict[int, dict] = {}
        index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
        for c in self.chunks:
            per = [facade.state.get(s) for s in c.shards]
            if not any(per):
                continue
            if not all(per):
                raise RuntimeError("deepcompile: the loaded optimizer state covers only some "
                                   f"parameters of a chunk ({', '.join(e.name for e in c.entries)})")
            out = {}
            for k, v0 in per[0].items():
                if isinstance(v0, torch.Tensor) and v0.dim() == 1 and v0.numel() == c.shards[0].numel():
                    flat = torch.zeros(c.numel, dtype=v0.dtype, device=self.device)
                    for st, off, s in zip(per, c.offsets, c.shards):
                        flat[off:off + s.numel()].copy_(st[k])
                    out[k] = flat
                else:   # a per-chunk scalar (Adam's step): every shard of the chunk has the same
                    for st, e in zip(per, c.entries):
                        same = torch.equal(st[k], v0) if isinstance(v0, torch.Tensor) else st[k] == v0
                        if not same:
                            raise RuntimeError(
                                f"deepcompile: optimizer state {k!r} of {e.name} differs from "
                                f"{c.entries[0].name}'s; parameters stepped together (one chunk) "
                                "must agree on it")
                    out[k] = v0.clone() if isinstance(v0, torch.Tensor) else v0
            flat_state[index[id(c.param)]] = out
        sd = inner.state_dict()
        inner.load_state_dict({"state": flat_state, "param_groups": sd["param_groups"]})
        self._viewed.clear()
        for c in self.chunks:
            self._view_state(c)
        for fn in self.on_load:
            fn()
