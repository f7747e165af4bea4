"""Loss scaling for float16 compute (Config.loss_scale; dynamic by default with float16).

float16 has 5 exponent bits: gradients under ~6e-8 flush to zero and the backward loses them.
The engine multiplies the loss by `scale` before the backward, so every gradient is `scale`
times larger (exactly, for a power of two), and divides the shards' gradients by it before
clipping and the optimizer step. When a gradient overflowed (inf/NaN on any rank: the flags are
all-reduced, so every rank takes the same decision), the optimizer step is skipped on every rank
and the dynamic scale halves; after `window` good steps it doubles (torch.amp.GradScaler's
policy). A skipped step leaves the shards and the optimizer state as they were.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

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

    def unscale(self, shards: list[torch.Tensor]) -> bool:
        """Divide the shards' gradients by the scale; False (on every rank) when any overflowed."""
        return self.unscale_tensors([s.grad for s in shards if s.grad is not None])

    @torch.no_grad()
    def unscale_tensors(self, grads: list[torch.Tensor]) -> bool:
        """Divide `grads` by the scale; False (on every rank) when any overflowed."""
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float())
        self.comm.all_reduce(found, op=dist.ReduceOp.MAX, count=False)
        finite = not bool(found.item())
        if not finite:
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
        return finite

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
