"""The ops `offload_optimizer` inserts into backward graphs: `reload_state` and `grad_to_host`.

Neither has an output: both are registered as side-effecting (FX and Inductor keep them), and as
host<->device copies, not collectives (ops.register_comm_op). Each names its engine by the
runtime's handle (`engine`: `runtime_of` in runtime/runtime.py).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from .. import ops
from ..runtime import runtime_of


@torch.library.custom_op(f"{ops.NAMESPACE}::reload_state", mutates_args=())
def reload_state(after: torch.Tensor, pids: list[int], group: int, engine: int) -> None:
    """Start copying reload group `group` (the optimizer state of chunks registered by the pass
    with `add_reload_group`) back to the device, in the last micro-step of the accumulation
    window only (the state is needed at the optimizer step). `after` orders the op after the
    node that produced it; `pids` name a parameter of the engine (what the graph's
    communication signature shows: compiler/families.py)."""
    runtime = runtime_of(engine)
    if runtime is None or not runtime.step.last_micro_step:
        return
    with record_function("deepcompile.reload_state"):
        runtime.offload.reload_group(group)


@reload_state.register_fake
def _(after, pids, group, engine):
    return None


RELOAD_STATE = torch.ops.deepcompile.reload_state.default
torch.fx.node.has_side_effect(RELOAD_STATE)
ops.register_comm_op(RELOAD_STATE, "state_reload")   # a host->device copy: not a collective
ops.ORDER_ONLY.add(RELOAD_STATE)


@torch.library.custom_op(f"{ops.NAMESPACE}::grad_to_host", mutates_args=())
def grad_to_host(grad: torch.Tensor, pid: int, engine: int) -> None:
    """Send the shard gradient `grad` of parameter `pid` to its chunk's host buffer ([Note:
    gradients on the host]): placed right after the node that produces it; the lowered graph
    returns None in its place. A follower (ops.FOLLOWERS: a pass that moves the gradient's node
    moves it too)."""
    runtime = runtime_of(engine)
    if runtime is None:
        raise RuntimeError("deepcompile: a gradient to send to the host belongs to an engine "
                           "that was released")
    with record_function("deepcompile.grad_to_host"):
        runtime.offload.grad_to_host(pid, grad)


@grad_to_host.register_fake
def _(grad, pid, engine):
    return None


GRAD_TO_HOST = torch.ops.deepcompile.grad_to_host.default
torch.fx.node.has_side_effect(GRAD_TO_HOST)
ops.register_comm_op(GRAD_TO_HOST, "grad_offload")   # a device->host copy: not a collective
ops.FOLLOWERS.add(GRAD_TO_HOST)
