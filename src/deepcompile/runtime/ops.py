"""The custom ops that carry communication inside graphs.

Only tensors, ints and dtypes cross the op boundary; fake implementations are pure-shape; the
state (process group, shard layout) is looked up in the registry by `pid`.

`allgather_param(shard, pid, shape, dtype) -> full` gathers a parameter. Its registered autograd
backward is `reduce_grad(grad, pid, shard_numel, shard_dtype) -> shard_grad`, a reduce-scatter of
the gradient into the shard: gradients reach `shard.grad` through ordinary autograd, so tied
weights, graph breaks, gradient accumulation and any torch optimizer need nothing special.

Both ops return new memory that the caller owns (DESIGN §3: an op returns only memory it gives
up).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.profiler import record_function

from . import inflight, registry

NAMESPACE = "deepcompile"


@functools.lru_cache(maxsize=4096)
def _label(kind: str, pids: tuple[int, ...]) -> str:
    """The profiler label of a collective, with its parameters' names (built once per group:
    pids are never reused within a process)."""
    return f"deepcompile.{kind}[{','.join(registry.lookup(p).name for p in pids)}]"


@torch.library.custom_op(f"{NAMESPACE}::allgather_param", mutates_args=())
def allgather_param(shard: torch.Tensor, pid: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    with record_function(_label("allgather", (pid,))):
        return registry.lookup(pid).gather(shard)


@allgather_param.register_fake
def _(shard, pid, shape, dtype):
    return shard.new_empty(shape, dtype=dtype)


@torch.library.custom_op(f"{NAMESPACE}::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, pid: int, shard_numel: int, shard_dtype: torch.dtype,
                shard: torch.Tensor | None = None) -> torch.Tensor:
    """`shard` (ZeRO-1 only): the shard whose gradient this is; it names the parameter that
    keeps the gradient locally before the last micro-step ([Note: ZeRO-1 local accumulation])."""
    with record_function(_label("reduce_scatter", (pid,))):
        entry = registry.lookup(pid)
        return entry.reduce_grad(grad, None if shard is None else registry.lookup_shard(shard))


@reduce_grad.register_fake
def _(grad, pid, shard_numel, shard_dtype, shard=None):
    return grad.new_empty((shard_numel,), dtype=shard_dtype)


def reduce_grad_shard(node):
    """The `shard` argument of a `reduce_grad` graph node (ZeRO-1), else None."""
    return node.args[4] if len(node.args) > 4 else node.kwargs.get("shard")


def _setup_context(ctx, inputs, output):
    shard, pid, _shape, _dtype = inputs
    ctx.pid = pid
    ctx.shard_numel = shard.numel()
    ctx.shard_dtype = shard.dtype


def _backward(ctx, grad):
    return reduce_grad(grad, ctx.pid, ctx.shard_numel, ctx.shard_dtype), None, None, None


allgather_param.register_autograd(_backward, setup_context=_setup_context)


# -- asynchronous, fused collectives (inserted after partitioning by prefetch / bucket_reduce) --
@torch.library.custom_op(f"{NAMESPACE}::allgather_start", mutates_args=())
def allgather_start(shards: list[torch.Tensor], pids: list[int], dtype: torch.dtype) -> torch.Tensor:
    with record_function(_label("allgather_start", tuple(pids))):
        return inflight.start(shards, pids, dtype)


@allgather_start.register_fake
def _(shards, pids, dtype):
    return shards[0].new_empty((1,), dtype=torch.uint8)


@torch.library.custom_op(f"{NAMESPACE}::allgather_wait", mutates_args=())
def allgather_wait(token: torch.Tensor, pids: list[int]) -> list[torch.Tensor]:
    with record_function(_label("allgather_wait", tuple(pids))):
        return inflight.wait(token, pids)


@allgather_wait.register_fake
def _(token, pids):
    entries = [registry.lookup(p) for p in pids]
    return [token.new_empty(e.shape, dtype=e.compute_dtype) for e in entries]


@torch.library.custom_op(f"{NAMESPACE}::allgather_for_next", mutates_args=())
def allgather_for_next(after: torch.Tensor, pids: list[int], dtype: torch.dtype) -> None:
    """Start the gather of a group of the NEXT graph's parameters (their shards come from the
    registry); `after` only orders the start after the node that produced it. No output: the
    op is registered as side-effecting so that FX and Inductor keep it."""
    with record_function(_label("allgather_for_next", tuple(pids))):
        inflight.start_for_next(pids, dtype)


@allgather_for_next.register_fake
def _(after, pids, dtype):
    return None


@torch.library.custom_op(f"{NAMESPACE}::allgather_from_prev", mutates_args=())
def allgather_from_prev(shards: list[torch.Tensor], pids: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """The parameters whose gather the previous graph started (gathered here if it did not)."""
    with record_function(_label("allgather_from_prev", tuple(pids))):
        return inflight.wait_from_prev(shards, pids, dtype)


@allgather_from_prev.register_fake
def _(shards, pids, dtype):
    entries = [registry.lookup(p) for p in pids]
    return [shards[0].new_empty(e.shape, dtype=dtype) for e in entries]


@torch.library.custom_op(f"{NAMESPACE}::reduce_start", mutates_args=(),
                         schema="(Tensor[] grads, int[] pids, Tensor[]? shards=None) -> Tensor")
def reduce_start(grads, pids, shards=None):  # (an optional list has no Python annotation here)
    """`shards`: as `reduce_grad`'s `shard`, one per gradient (ZeRO-1 only)."""
    with record_function(_label("reduce_start", tuple(pids))):
        return inflight.reduce_start(grads, pids, shards)


@reduce_start.register_fake
def _(grads, pids, shards=None):
    return grads[0].new_empty((1,), dtype=torch.uint8)


@torch.library.custom_op(f"{NAMESPACE}::reduce_wait", mutates_args=())
def reduce_wait(token: torch.Tensor, pids: list[int]) -> list[torch.Tensor]:
    with record_function(_label("reduce_wait", tuple(pids))):
        return inflight.reduce_wait(token, pids)


@reduce_wait.register_fake
def _(token, pids):
    entries = [registry.lookup(p) for p in pids]
    return [token.new_empty((e.shard.numel(),), dtype=e.shard.dtype) for e in entries]


# [Note: communication op kinds] Every op that communicates is registered here with its kind,
# so that the profiler, the report and the passes classify graph nodes without knowing every
# op: `launches` names the collective one run of the op starts (counted per graph run), and
# `blocking` says the host waits on communication in it (exposed communication time). Modules
# that define more communication ops register them with `register_comm_op` at import time.
# Convention: a communication op's second argument is its parameter id, or the list of them.
COMM_KINDS: dict[Any, str] = {}     # op overload -> kind
LAUNCHES: dict[str, str] = {}        # kind -> the collective it launches ("all_gather", ...)
BLOCKING: set[str] = set()           # kinds in which the host waits on communication


def register_comm_op(op, kind: str, *, launches: str | None = None, blocking: bool = False) -> None:
    COMM_KINDS[op] = kind
    if launches is not None:
        LAUNCHES[kind] = launches
    if blocking:
        BLOCKING.add(kind)


ALLGATHER = torch.ops.deepcompile.allgather_param.default
ALLGATHER_START = torch.ops.deepcompile.allgather_start.default
ALLGATHER_WAIT = torch.ops.deepcompile.allgather_wait.default
ALLGATHER_FOR_NEXT = torch.ops.deepcompile.allgather_for_next.default
ALLGATHER_FROM_PREV = torch.ops.deepcompile.allgather_from_prev.default
torch.fx.node.has_side_effect(ALLGATHER_FOR_NEXT)
REDUCE_GRAD = torch.ops.deepcompile.reduce_grad.default
REDUCE_START = torch.ops.deepcompile.reduce_start.default
REDUCE_WAIT = torch.ops.deepcompile.reduce_wait.default

register_comm_op(ALLGATHER, "all_gather", launches="all_gather", blocking=True)
register_comm_op(REDUCE_GRAD, "reduce_scatter", launches="reduce_scatter", blocking=True)
register_comm_op(ALLGATHER_START, "all_gather_start", launches="all_gather")
register_comm_op(ALLGATHER_FOR_NEXT, "all_gather_start", launches="all_gather")
register_comm_op(ALLGATHER_WAIT, "all_gather_wait", blocking=True)
register_comm_op(ALLGATHER_FROM_PREV, "all_gather_wait", blocking=True)
register_comm_op(REDUCE_START, "reduce_scatter_start", launches="reduce_scatter")
register_comm_op(REDUCE_WAIT, "reduce_scatter_wait", blocking=True)
