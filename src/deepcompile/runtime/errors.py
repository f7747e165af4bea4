"""The errors the guardrails raise (runtime/guardrails.py: the user's code catches them from
there), and what their messages are made from."""

from __future__ import annotations

import re

import torch.distributed as dist


class DistributedError(RuntimeError):
    """The ranks are no longer in step (a rank failed, timed out, or ran something else): the
    engine stops. Restart from the last checkpoint."""


class DivergenceError(DistributedError):
    """The ranks ran different collectives, graphs or plans."""


class EngineStoppedError(DistributedError):
    """The engine was called after it stopped (see its __cause__)."""


class CollectiveCallError(DistributedError):
    """A collective engine method (save_checkpoint, save_pretrained, full_state_dict, ...) was
    called on some ranks only, or the ranks called different ones ([Note: collective calls])."""


class UsageError(RuntimeError):
    """The training loop called the engine out of order (nothing was run)."""


class NonFiniteError(FloatingPointError):
    """A loss or a gradient was inf/NaN on some rank (Config.on_nonfinite="raise"); raised on
    every rank, the optimizer step not taken."""


_COMM_ERROR = re.compile(r"timed out|timeout|connection (closed|reset|refused)|broken pipe|nccl|"
                         r"gloo|pair\.cc|unbound_buffer|processgroup|socket|peer", re.IGNORECASE)


def is_comm_error(exc: BaseException) -> bool:
    """A collective (or the transport under it) failed: a timeout, a dead peer."""
    if isinstance(exc, dist.DistError):
        return True
    return isinstance(exc, RuntimeError) and bool(_COMM_ERROR.search(str(exc)))


def brief(exc: BaseException, limit: int = 300) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    if len(line) > limit:
        line = line[:limit] + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def place(w: dict) -> str:
    """Where something happened (`w`: phase, step, micro-step, graph), in words."""
    graph = f", graph {w['graph']}" if w.get("graph") else ""
    return f"step {w['step']} (micro-step {w['micro']}, {w['phase']}{graph})"


def store_has(store, key: str) -> bool:
    """Whether `store` holds `key` (False where the store cannot be read: it may be gone with
    rank 0)."""
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False
