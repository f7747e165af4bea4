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
element alike wherever the element sits in its tensor (torch's Adam and AdamW, single-tensor
and foreach). The CPU's fused kernels round a tensor's last partial vector (its scalar tail)
their own way, so there a flat fused step matches per-parameter fused steps to an ulp: SGD with
momentum always, Adam and AdamW where torch runs its AVX2 kernels. Where the user left the
implementation open (`foreach` and `fused` unset) and the class has one, the inner optimizer
uses torch's fused kernel: one pass over each chunk's master, gradient and state (the
multi-tensor default makes ~8 passes over hundreds of tensors; on the CPU torch's default is
the single-tensor loop, so the fused kernel rounds differently from an eager run there). An
implementation the user chose (`foreach=False`, `foreach=True` or `fused=...`) is the inner
optimizer's. Per step the engine:
  * folds the shards' gradients (accumulated by autograd, one tensor per shard) into each
    chunk's flat gradient (`fold_grads`: one `_foreach_copy_` per chunk; the shards'
    `.grad` are dropped in C, `map(setattr, ...)`), whose storage exists only during the step;
  * copies the facade's hyperparameters into the inner groups (`sync_hyperparameters`: the LR
    scheduler drives the facade);
  * steps chunks (`step(chunks)`): the inner optimizer steps exactly the chunks whose flat
    parameter has a gradient, so the offloader can step resident chunks in one call and
    stream the others in (runtime/offload/).
Python runs per chunk and per group, never per parameter.

[Note: steps without a gradient] torch's optimizers skip a parameter whose `.grad` is None:
no weight decay, no moment decay, no step count. A shard has no gradient in an optimizer step
exactly when no graph and no eager gradient gave it one on any rank (every gradient reaches a
shard through a reduction every rank runs: the graphs are the same on every rank, and the
eager fallback's gradients are reduced by agreement at the step, runtime/eager.py), so every
rank sees the same shards without one. The inner optimizer steps *units*: a run of a chunk's
shards stepped as one tensor with one set of per-parameter scalars (Adam's `step`). A chunk is
one unit (its flat master) until a step where some of its shards have a gradient and others
not (a head used on some steps, a parameter never used): then the unit is split where that
differs (`mark`), each part a view of the master with views of the state and scalars of its
own, and only the parts with a gradient step. Parts never merge again (their step counts
differ from then on); each step remains one call of the inner optimizer over every unit with
a gradient (torch's fused kernel takes a list). A part never stepped has no state, as torch's
own parameter would not; its first step creates it, and it is moved into the chunk's flat
state (`Chunk.flat_state`, what offloading moves) at once (`_adopt`). A chunk whose shards all
have a gradient (the common case) costs one check of its shards' gradients, in C (`map`).

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

import contextlib
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
class Unit:
    """A run of a chunk's shards stepped as one tensor ([Note: steps without a gradient])."""
    first: int                       # its shards: the chunk's [first, end)
    end: int
    start: int                       # its elements: the chunk's [start, stop) (gaps included)
    stop: int
    param: nn.Parameter              # what the inner optimizer steps: the master, or a view
    grad: torch.Tensor = dataclasses.field(repr=False)   # its slice of the chunk's gradient


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
    units: list[Unit] = dataclasses.field(default_factory=list)
    # the units with a gradient in this step (`FlatState.mark`); None: every unit
    live: list[Unit] | None = dataclasses.field(default=None, repr=False)
    # split into several units: the flat state they are views of (one unit: the inner state)
    flat_state: dict[str, torch.Tensor] | None = dataclasses.field(default=None, repr=False)

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
        if len(self.units) > 1:
            return dict(self.flat_state or {})
        return _flat_values(optimizer.state.get(self.param, {}), self.numel)


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
        self.on_layout: list = []            # called with a chunk whose units or state moved

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
                     shards=[e.shard for e in entries],
                     units=[Unit(0, len(entries), 0, numel, param, grad)])

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
        """Each chunk's shard gradients into its flat gradient; the shards' `.grad` dropped;
        the units with a gradient marked ([Note: steps without a gradient]). A chunk none of
        whose shards has a gradient gets no flat gradient (it does not step)."""
        for c in self.chunks if chunks is None else chunks:
            grads = list(map(_grad_of, c.shards))
            every = all(map(_is_not_none, grads))
            if not c.grad_allocated:
                if not every and not any(map(_is_not_none, grads)):
                    c.live = []
                    continue
                c.grad.untyped_storage().resize_(c.nbytes)
                if c.gaps:
                    torch._foreach_zero_(c.gaps)
                if every:
                    torch._foreach_copy_(c.grad_views, grads)
                else:   # a shard without a gradient this step: zeros (it does not step)
                    for v, g in zip(c.grad_views, grads):
                        v.zero_() if g is None else v.copy_(g)
                self.mark(c, None if every else [g is not None for g in grads])
            else:       # already folded (a gradient routed here, or a second fold): add
                for v, g in zip(c.grad_views, grads):
                    if g is not None:
                        v.add_(g)
                if not every and c.live is not None:   # what had none may have one now
                    had = {i for u in c.live for i in range(u.first, u.end)}
                    self.mark(c, [i in had or g is not None for i, g in enumerate(grads)])
            any(map(setattr, c.shards, itertools.repeat("grad"), itertools.repeat(None)))

    def mark(self, c: Chunk, has: list[bool] | None) -> None:
        """`has`: which of `c`'s shards have a gradient in this step (None: all); `c.live`
        becomes its units with one, a unit whose shards differ split where they do ([Note:
        steps without a gradient])."""
        if has is None or all(has):
            c.live = None
            return
        if not any(has):
            c.live = []
            return
        cuts = [i for i in range(1, len(has)) if has[i] != has[i - 1]]
        if any(u.first < i < u.end for u in c.units for i in cuts):
            self._split(c, cuts)
        c.live = [u for u in c.units if has[u.first]]

    def live_units(self, c: Chunk) -> list[Unit]:
        return c.units if c.live is None else c.live

    def release_grads(self, chunks: Iterable[Chunk] | None = None) -> None:
        for c in self.chunks if chunks is None else chunks:
            c.grad.untyped_storage().resize_(0)
            for u in c.units:
                u.param.grad = None
            c.live = None

    def grads(self) -> list[torch.Tensor]:
        """The flat gradients allocated now (after `fold_grads`)."""
        return [c.grad for c in self.chunks if c.grad_allocated]

    # -- stepping -----------------------------------------------------------------------------
    def step(self, chunks: list[Chunk]) -> None:
        """One inner optimizer step over exactly `chunks` (their gradients folded): the units
        with a gradient ([Note: steps without a gradient])."""
        units = [(c, u) for c in chunks for u in self.live_units(c)]
        if not units:
            return
        state = self.inner.state
        fresh = [(c, u) for c, u in units if not state.get(u.param)]
        # units stepped for the first time step apart from those with state (torch's fused SGD
        # takes a list of momentum buffers all made or all to make)
        calls = [[(c, u) for c, u in units if state.get(u.param)], fresh] if fresh else [units]
        for call in calls:
            if not call:
                continue
            for _c, u in call:
                u.param.grad = u.grad
            self.inner.step()
            for _c, u in call:
                u.param.grad = None
        for c, u in fresh:   # state made by this step: the facade shows it from now on
            if len(c.units) > 1:
                self._adopt(c, u)
            else:
                self._viewed.discard(c.index)
        self.show_state(chunks)

    def show_state(self, chunks: Iterable[Chunk]) -> None:
        """The facade's per-shard state of `chunks` made again where their units changed."""
        for c in chunks:
            if c.index not in self._viewed:
                self._view_state(c)

    # -- units ([Note: steps without a gradient]) ---------------------------------------------
    @torch.no_grad()
    def _split(self, c: Chunk, cuts: list[int]) -> None:
        """Split the units of `c` at the shard indices `cuts`: each part a view of the master
        and of the gradient, with views of its unit's state and copies of its scalars, in
        its unit's place in the inner optimizer's group."""
        state = self.inner.state
        units: list[Unit] = []
        with _allocated([c.param, c.grad, *(c.flat_state or {}).values(),
                         *_flat_values(state.get(c.param, {}), c.numel)]):
            if len(c.units) == 1 and state.get(c.param):   # its state becomes the chunk's
                c.flat_state = _flat_values(state[c.param], c.numel)
            for u in c.units:
                inside = [i for i in cuts if u.first < i < u.end]
                if not inside:
                    units.append(u)
                    continue
                bounds = [u.first, *inside, u.end]
                parts = []
                for a, b in zip(bounds, bounds[1:]):
                    start = c.offsets[a]
                    stop = c.offsets[b] if b < len(c.offsets) else c.numel
                    parts.append(Unit(a, b, start, stop,
                                      nn.Parameter(c.param.detach()[start:stop]),
                                      c.grad[start:stop]))
                group = next(g for g in self.inner.param_groups
                             if any(p is u.param for p in g["params"]))
                at = next(i for i, p in enumerate(group["params"]) if p is u.param)
                group["params"][at:at + 1] = [p.param for p in parts]
                old = state.pop(u.param, None)
                if old:
                    n = u.stop - u.start
                    for p in parts:
                        state[p.param] = {
                            k: v[p.start - u.start:p.stop - u.start] if _is_flat(v, n)
                            else v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in old.items()}
                units += parts
        c.units = units
        self._layout_changed(c)

    @torch.no_grad()
    def _adopt(self, c: Chunk, u: Unit) -> None:
        """A part's first step created its state apart: moved into the chunk's flat state."""
        st = self.inner.state[u.param]
        mine = _flat_values(st, u.stop - u.start)
        if c.flat_state is None:
            c.flat_state = {k: torch.zeros(c.numel, dtype=v.dtype, device=v.device)
                            for k, v in mine.items()}
        for k, v in mine.items():
            view = c.flat_state[k][u.start:u.stop]
            view.copy_(v)
            st[k] = view
        self._layout_changed(c)

    def _layout_changed(self, c: Chunk) -> None:
        self._viewed.discard(c.index)
        for fn in self.on_layout:
            fn(c)

    @torch.no_grad()
    def _view_state(self, c: Chunk) -> None:
        """The facade's per-shard state: views of its unit's state, the unit's scalars; none
        for a shard never stepped (as torch's optimizer has none). (Views of offloaded state:
        runtime/offload/ shows the facade meta tensors in their place.)"""
        with _allocated(list(c.state_tensors(self.inner).values())):
            self._view_units(c)
        self._viewed.add(c.index)

    def _view_units(self, c: Chunk) -> None:
        for u in c.units:
            st = self.inner.state.get(u.param)
            n = u.stop - u.start
            for i in range(u.first, u.end):
                shard = c.shards[i]
                if not st:
                    self.facade.state.pop(shard, None)
                    continue
                off, m = c.offsets[i] - u.start, shard.numel()
                self.facade.state[shard] = {k: v[off:off + m] if _is_flat(v, n) else v
                                            for k, v in st.items()}

    # -- loading ----------------------------------------------------------------------------
    @torch.no_grad()
    def _after_load(self, facade: torch.optim.Optimizer) -> None:
        """`facade.load_state_dict` installed per-shard state: copy it into the flat state, in
        units where the shards' scalars differ or some shards have none ([Note: steps without a
        gradient])."""
        inner = self.inner
        loaded = []
        for c in self.chunks:
            per = [facade.state.get(s) for s in c.shards]
            self._merge(c)
            keys = [_scalars(st, s.numel()) for st, s in zip(per, c.shards)]
            cuts = [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
            if cuts:
                self._split(c, cuts)
            loaded.append((c, per))
        index = {id(p): i for i, p in enumerate(p for g in inner.param_groups for p in g["params"])}
        flat_state: dict[int, dict] = {}
        for c, per in loaded:
            i0 = next((i for i, st in enumerate(per) if st), None)
            if i0 is None:
                continue
            flats = {k: torch.zeros(c.numel, dtype=v.dtype, device=self.device)
                     for k, v in _flat_values(per[i0], c.shards[i0].numel()).items()}
            for st, off, s in zip(per, c.offsets, c.shards):
                for k, flat in flats.items():
                    if st:
                        flat[off:off + s.numel()].copy_(st[k])
            if len(c.units) > 1:
                c.flat_state = flats
            for u in c.units:
                st = per[u.first]
                if st:
                    flat_state[index[id(u.param)]] = {
                        k: flats[k][u.start:u.stop] if k in flats
                        else v.clone() if isinstance(v, torch.Tensor) else v
                        for k, v in st.items()}
        sd = inner.state_dict()
        inner.load_state_dict({"state": flat_state, "param_groups": sd["param_groups"]})
        for c, _per in loaded:   # views of the flat state again (the load may have copied)
            if len(c.units) > 1:
                for u in c.units:
                    if inner.state.get(u.param):
                        self._adopt(c, u)
        self._viewed.clear()
        for c in self.chunks:
            self._view_state(c)
        for fn in self.on_load:
            fn()

    def _merge(self, c: Chunk) -> None:
        """`c` one unit again, without state (a load installs it)."""
        state = self.inner.state
        if len(c.units) > 1:
            group = next(g for g in self.inner.param_groups
                         if any(p is c.units[0].param for p in g["params"]))
            ids = {id(u.param) for u in c.units}
            at = next(i for i, p in enumerate(group["params"]) if id(p) in ids)
            group["params"][:] = [p for p in group["params"][:at] if id(p) not in ids] + \
                [c.param] + [p for p in group["params"][at:] if id(p) not in ids]
            for u in c.units:
                state.pop(u.param, None)
            c.units = [Unit(0, len(c.shards), 0, c.numel, c.param, c.grad)]
            c.flat_state = None
            self._layout_changed(c)
        state.pop(c.param, None)


def _is_flat(v, n: int) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == n


def _flat_values(st: dict, n: int) -> dict[str, torch.Tensor]:
    """The state tensors of `st` shaped like its parameter of `n` elements, by key."""
    return {k: v for k, v in st.items() if _is_flat(v, n)}


def _scalars(st: dict | None, n: int) -> tuple | None:
    """What must be equal for two shards' state to be stepped as one unit: their scalars
    (Adam's `step`); None without state."""
    if not st:
        return None
    return tuple(sorted((k, v.tolist() if isinstance(v, torch.Tensor) else v)
                        for k, v in st.items() if not _is_flat(v, n)))


@contextlib.contextmanager
def _allocated(tensors: Iterable[torch.Tensor]):
    """Storages released between steps (a flat gradient, offloaded state or master) allocated
    for the duration, so that views of them can be made; released again after."""
    sizes = []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() == 0:
            st.resize_((t.storage_offset() + t.numel()) * t.element_size())
            sizes.append(st)
    try:
        yield
    finally:
        for st in sizes:
            st.resize_(0)
