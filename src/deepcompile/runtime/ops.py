"""The planning IR of communication: the insertion ops and the scheduling markers.

Two custom ops are what the backend inserts before AOTAutograd, and what AOTAutograd traces
and partitions:

* `allgather_param(shard, pid, shape, dtype) -> full` gathers a parameter. Its registered
  autograd backward is `reduce_grad(grad, pid, shard_numel, shard_dtype[, shard]) -> shard_grad`,
  a reduce-scatter of the gradient into the shard: gradients reach `shard.grad` through ordinary
  autograd, so tied weights, graph breaks, gradient accumulation and any torch optimizer need
  nothing special. (`shard`, ZeRO-1 only: the shard whose gradient this is; with gradient
  accumulation the gradient is kept locally until the last micro-step.)

Their implementations here are the reference (a synchronous Python collective through the
registry, used by `torch.library.opcheck` and by code that runs outside compiled graphs); the
graphs never run them: before a graph runs, `compiler/lower.py` turns every communication
node into functional collectives and aten ops, so steady-state graphs hold no Python op.

After partitioning, the passes schedule with *markers*: plain functions that stand for a role
in the graph and never run (`_marker`): `allgather_start` / `allgather_wait` (a fused,
asynchronous gather), `allgather_for_next` / `allgather_from_prev` (a gather one graph starts
for the next), `reduce_start` / `reduce_wait` (a gradient bucket), `kept_param` (a parameter
kept gathered by the runtime), `accumulate_grad` (a gradient accumulated locally over the
micro-steps), `replica_wait` (ZeRO-1/2: a replica the optimizer step's refresh may still be
writing). Every marker's second argument is its parameter id or the list of them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from . import registry

NAMESPACE = "deepcompile"


@torch.library.custom_op(f"{NAMESPACE}::allgather_param", mutates_args=())
def allgather_param(shard: torch.Tensor, pid: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return registry.lookup(pid).gather(shard)


@allgather_param.register_fake
def _(shard, pid, shape, dtype):
    return shard.new_empty(shape, dtype=dtype)


@torch.library.custom_op(f"{NAMESPACE}::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, pid: int, shard_numel: int, shard_dtype: torch.dtype,
                shard: torch.Tensor | None = None) -> torch.Tensor:
    """`shard` (ZeRO-1 only): the shard whose gradient this is (a reused graph names the
    parameter only through it); the reference implementation reduces at once."""
    return registry.lookup(pid).reduce_grad(grad)


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


# -- scheduling markers (placed by the passes, lowered before a graph runs) -------------------
def _marker(name: str, doc: str):
    def marker(*args: Any, **kwargs: Any):
        raise RuntimeError(f"deepcompile: the scheduling marker {name!r} ran; a graph with "
                           "markers must be lowered (compiler/lower.py) before it runs")
    marker.__name__ = marker.__qualname__ = name
    marker.__module__ = __name__
    marker.__doc__ = doc
    return marker


allgather_start = _marker(
    "allgather_start", "(shards, pids, dtype) -> token: launch one gather of a group.")
allgather_wait = _marker(
    "allgather_wait", "(token, pids) -> [full]: the group's parameters, one per member.")
allgather_for_next = _marker(
    "allgather_for_next", "(after, pids, dtype) -> None: launch the gather of the next graph's "
    "group (ordered after `after`).")
allgather_from_prev = _marker(
    "allgather_from_prev", "(shards, pids, dtype) -> [full]: the group the previous graph "
    "started (gathered here if it did not).")
reduce_start = _marker(
    "reduce_start", "(grads, pids[, shards]) -> token: launch one reduce-scatter of a bucket "
    "(`shards`: ZeRO-1, as reduce_grad's).")
reduce_wait = _marker(
    "reduce_wait", "(token, pids) -> [shard_grad]: the bucket's shard gradients.")
kept_param = _marker(
    "kept_param", "(shard, pid, shape, dtype) -> full: a parameter the runtime keeps gathered.")
accumulate_grad = _marker(
    "accumulate_grad", "(grad, pid, shard_numel, shard_dtype) -> shard_grad: accumulated "
    "locally over the micro-steps, reduced on the last one.")
accumulate_start = _marker(
    "accumulate_start", "(grads, pids) -> token: a bucket of `accumulate_grad`s: each gradient "
    "added to its accumulator; on the window's last micro-step one reduce-scatter of them all "
    "(`reduce_wait` hands out the shard gradients, zeros before the last micro-step).")

replica_wait = _marker(
    "replica_wait", "(replica, pid) -> replica: ZeRO-1/2's replicated parameter, once the "
    "refresh the optimizer step left in flight has written it ([Note: deferred refresh] in "
    "runtime/replicas.py).")

ALLGATHER = torch.ops.deepcompile.allgather_param.default
REDUCE_GRAD = torch.ops.deepcompile.reduce_grad.default
ALLGATHER_START = allgather_start
ALLGATHER_WAIT = allgather_wait
ALLGATHER_FOR_NEXT = allgather_for_next
ALLGATHER_FROM_PREV = allgather_from_prev
REDUCE_START = reduce_start
REDUCE_WAIT = reduce_wait
KEPT_PARAM = kept_param
ACCUMULATE_GRAD = accumulate_grad
ACCUMULATE_START = accumulate_start
REPLICA_WAIT = replica_wait
MARKERS = (ALLGATHER_START, ALLGATHER_WAIT, ALLGATHER_FOR_NEXT, ALLGATHER_FROM_PREV,
           REDUCE_START, REDUCE_WAIT, KEPT_PARAM, ACCUMULATE_GRAD, ACCUMULATE_START,
           REPLICA_WAIT)
torch.fx.node.has_side_effect(ALLGATHER_FOR_NEXT)
# Ops that act on a value right where it is produced (offload's `grad_to_host`): a pass that
# replaces the value's node by one further down (bucket_reduce's wait) moves them after it, and
# does not count them as a use of the value (passes/_common.py::replace_with_parts).
FOLLOWERS: set[Any] = set()
# Ops whose first argument only orders them (`allgather_for_next`'s and offload's
# `reload_state`'s `after`: the node they run after, chosen by its profiled time): a graph of the
# same code compiled for another shape may lack that node; the op then follows the node before it
# (compiler/families.py::transplant).
ORDER_ONLY: set[Any] = {ALLGATHER_FOR_NEXT}


# [Note: communication op kinds] Every node that communicates is registered here with its kind,
# so that the profiler, the report and the passes classify graph nodes without knowing every
# op: `launches` names the collective one run of the node starts (counted per graph run), and
# `blocking` says the graph waits on communication in it (exposed communication time). Modules
# that define more communication ops register them with `register_comm_op` at import time.
# Convention: a communication node's second argument is its parameter id, or the list of them.
COMM_KINDS: dict[Any, str] = {}     # op or marker -> kind
LAUNCHES: dict[str, str] = {}        # kind -> the collective it launches ("all_gather", ...)
BLOCKING: set[str] = set()           # kinds in which the graph waits on communication


def register_comm_op(op, kind: str, *, launches: str | None = None, blocking: bool = False) -> None:
    COMM_KINDS[op] = kind
    if launches is not None:
        LAUNCHES[kind] = launches
    if blocking:
        BLOCKING.add(kind)


def communicates(node) -> bool:
    """`node` is a communication op, or a part (`getitem`) of one."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        node = node.args[0]
    return getattr(node, "target", None) in COMM_KINDS


register_comm_op(ALLGATHER, "all_gather", launches="all_gather", blocking=True)
register_comm_op(REDUCE_GRAD, "reduce_scatter", launches="reduce_scatter", blocking=True)
register_comm_op(ALLGATHER_START, "all_gather_start", launches="all_gather")
register_comm_op(ALLGATHER_FOR_NEXT, "all_gather_start", launches="all_gather")
register_comm_op(ALLGATHER_WAIT, "all_gather_wait", blocking=True)
register_comm_op(ALLGATHER_FROM_PREV, "all_gather_wait", blocking=True)
register_comm_op(REDUCE_START, "reduce_scatter_start", launches="reduce_scatter")
register_comm_op(REDUCE_WAIT, "reduce_scatter_wait", blocking=True)
# accumulate_grad blocks on a reduce-scatter on the last micro-step only, so it names no
# collective launched per run; a kept parameter is a graph input: no communication.
register_comm_op(ACCUMULATE_GRAD, "reduce_scatter_accumulate", blocking=True)
# its bucket: the start launches on the last micro-step only (counted by the lowered graphs,
# `Lowered.counts`); the bucket's `reduce_wait` is where the graph waits
register_comm_op(ACCUMULATE_START, "reduce_scatter_accumulate_start")
# the refresh it waits for was launched by the optimizer step (counted there)
register_comm_op(REPLICA_WAIT, "all_gather_wait", blocking=True)
