"""Loss scaling for float16 compute (Config.loss_scale; dynamic by default with float16).

float16 has 5 exponent bits: gradients under ~6e-8 flush to zero and the backward loses them.
The engine multiplies the loss by `scale` before the backward, so every gradient is `scale`
times larger (exactly, for a power of two), and divides the shards' gradients by it before
clipping and the optimizer step. When a gradient overflowed (inf/NaN on any rank: the flags are
all-reduced, so every rank takes the same decision), the optimizer step is skipped on every rank
and the dynamic scale halves; after `window` good steps it doubles (torch.amp.GradScaler's
policy). A skipped step leaves the shards and the optimizer state as they were.

[Note: overflow agreement] Whether a step's gradients (or losses) hold an inf/NaN is decided the
same way for loss scaling and for `Config.on_nonfinite` (engine.py): `GradCheck` looks at this
rank's shard gradients in one fused kernel per dtype (under a loss scale GradScaler's, which
also unscales; without one their 2-norms, `grad_norms`), and `nonfinite_ranks` all-reduces a
one-hot vector, so that every rank learns *which* ranks found one and every rank takes the same
decision (skip, raise, lower the scale).

[Note: the check reads 2-norms] Without a loss scale the check reads each gradient's 2-norm,
accumulated and returned in float32 (`grad_norms`): inf/NaN when an element is, and also when
the squares sum past float32's range (a norm above ~1.8e19), which counts as non-finite, as in
torch's `clip_grad_norm_(error_if_nonfinite=True)` and DeepSpeed's overflow check (a sum). The
largest magnitude (the inf-norm) would be exact, and on a GPU costs the same one read; on the
CPU torch's inf-norm kernel is ~40x slower than its 2-norm (10.4 against 0.27 ms over 3.95 M
float32, one thread): 7% of small-llama's whole step at world size 1, where the flat step it
guards took 1.8 ms. float32 whatever the gradients' dtype: a float16 norm overflows at 65504.
The step's gradient norm, and the clip, come from the same norms (one read of the gradients
for all three: [Note: the step's gradient norm] in engine.py).
"""

from __future__ import annotations

import functools
import logging
import operator

import torch

from .. import _compat

log = logging.getLogger("deepcompile")


class LossScaler:
    def __init__(self, comm, device: torch.device, *, dynamic: bool, scale: float,
                 window: int) -> None:
        self.comm = comm
        self.device = device
        self.dynamic = dynamic
        self.scale = float(scale)
        self.window = window
        self.good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def inv_scale(self) -> torch.Tensor:
        """1/scale as a device tensor: `GradCheck` unscales the gradients by it."""
        return torch.full((), 1.0 / self.scale, dtype=torch.float32, device=self.device)

    def update(self, overflow: bool) -> None:
        """After the gradients were unscaled and checked on every rank ([Note: overflow
        agreement]): `overflow` is the same on every rank, and so is the new scale."""
        if overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.dynamic:
                self.scale = max(self.scale / 2.0, 1.0)
            log.warning("deepcompile: inf/NaN gradients with loss scale %g: optimizer step "
                        "skipped on every rank%s", self.scale * (2 if self.dynamic else 1),
                        f"; scale now {self.scale:g}" if self.dynamic else "")
        elif self.dynamic:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= 2.0
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])


_grad_of = operator.attrgetter("grad")
_is_not_none = functools.partial(operator.is_not, None)


def grad_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's 2-norm, as float32 ([Note: the check reads 2-norms]): one fused read."""
    return torch._foreach_norm(grads, 2.0, dtype=torch.float32)


class GradCheck:
    """This rank's shard gradients checked for inf/NaN (and unscaled, under a loss scale), a
    few fused kernels per dtype ([Note: overflow agreement]); per-parameter work only in C
    (`map`/`filter`)."""

    def __init__(self, shards: list[torch.Tensor], device: torch.device) -> None:
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for s in shards:
            groups.setdefault(s.dtype, []).append(s)
        self.groups = list(groups.values())
        self.found = torch.zeros((), dtype=torch.float32, device=device)

    @torch.no_grad()
    def __call__(self, inv_scale: torch.Tensor | None = None,
                 flat_grads: list[torch.Tensor] | None = None,
                 host_sq: torch.Tensor | None = None,
                 norms: list[torch.Tensor] | None = None) -> torch.Tensor:
        """1.0 when a gradient of this rank holds an inf/NaN, else 0.0 (a device tensor): the
        shards' gradients, or the flat step's gradients (`flat_grads`: the shards' were folded
        into them, runtime/flat.py), and the gradients on the host by their squared norm
        (`host_sq`, runtime/offload/: inf/NaN if one of them is, or if it overflows).
        Without a loss scale, by their 2-norms ([Note: the check reads 2-norms]); `norms`:
        those of the flat gradients, already computed (`grad_norms`, shared with the clip)."""
        found = self.found.zero_()
        if host_sq is not None:
            found.copy_((~torch.isfinite(host_sq)).float())
        if norms is not None and inv_scale is None:
            if norms:
                bad = torch.logical_not(torch.isfinite(torch.stack(norms))).any()
                found.copy_(found.logical_or(bad))
            return found
        if flat_grads is not None:
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for g in flat_grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            for grads in by_dtype.values():
                self._check(grads, found, inv_scale)
            return found
        for shards in self.groups:
            grads = list(filter(_is_not_none, map(_grad_of, shards)))
            if grads:
                self._check(grads, found, inv_scale)
        return found

    @staticmethod
    def _check(grads: list[torch.Tensor], found: torch.Tensor,
               inv_scale: torch.Tensor | None) -> None:
        """Unscaling: GradScaler's kernel, which reads and writes every gradient. Without a
        loss scale nothing need be written: the 2-norms ([Note: the check reads 2-norms]) read
        each gradient once — on a GPU a step's gradients are gigabytes, and a pass that writes
        them back costs twice the time of one that only reads."""
        if inv_scale is not None:
            _compat.nonfinite_check_and_unscale_(grads, found, inv_scale)
            return
        norms = torch.stack(grad_norms(grads))
        found.copy_(found.logical_or(torch.logical_not(torch.isfinite(norms)).any()))


def nonfinite_ranks(comm, *flags: torch.Tensor, sq: torch.Tensor | None = None,
                    ) -> tuple[list[list[int]], torch.Tensor | None]:
    """For each flag (a 0-dim device tensor, nonzero: found on this rank), the ranks where it is
    set: the same lists on every rank (one all-reduce of a one-hot vector per flag, uncounted:
    bookkeeping, not training traffic); and `sq` (this rank's squared gradient norm) summed over
    the ranks in the same all-reduce ([Note: the step's gradient norm] in engine.py), a 0-dim
    device tensor (None without `sq`)."""
    world = comm.world
    n = len(flags) * world
    vec = torch.zeros(n + (sq is not None), dtype=torch.float32, device=flags[0].device)
    for i, f in enumerate(flags):
        vec[i * world + comm.rank] = f
    if sq is not None:
        vec[n] = sq
    comm.all_reduce(vec, count=False)
    got = vec[:n].tolist()
    return ([[r for r in range(world) if got[i * world + r]] for i in range(len(flags))],
            vec[n] if sq is not None else None)
