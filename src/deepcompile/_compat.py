"""Every private PyTorch API deepcompile touches, in one place, with version switches.

Supported: torch 2.11 through 2.15.  When a torch release moves one of these, fix it here and
nowhere else.  Nothing here patches torch globally; configuration changes are scoped context
managers around a single call.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


# --- collectives -----------------------------------------------------------------------------
# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of
# all_gather_single / reduce_scatter_single, which torch 2.11 lacks.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, op, group, async_op: bool = False):
    return _reduce_scatter_flat(output, input, op=op, group=group, async_op=async_op)


def group_name(group) -> str:
    """The name functional collectives resolve a process group by (a `str` in 2.11; 2.13's
    schemas take `Any` and accept the same string)."""
    return (group if group is not None else dist.group.WORLD).group_name


# ProcessGroupGloo runs collectives on two worker threads. With more than two functional
# all-gathers in flight (the launch sweep of compiler/cost.py, prefetching), two run at once, and
# gloo's `allgather_into_tensor_coalesced` -- the path `_c10d_functional.all_gather_into_tensor`
# takes -- then corrupts the heap: the rank dies with SIGSEGV or SIGABRT ("malloc(): unaligned
# tcache chunk"). benchmarks/validation/gloo_inflight.py reproduces it on torch 2.13 on a default
# gloo group and not on one worker thread (figures in its results README);
# `dist.all_gather_into_tensor`, which takes `_allgather_base`, survives the same load.
# The thread count is settable only through ProcessGroupGloo._Options, which init_process_group
# and new_group do not pass on for gloo; so the engine's gloo collectives run on a group of its
# own, made by a backend registered under its own name (an addition to c10d's registry; it
# changes nothing that exists).
_SERIAL_GLOO = "deepcompile_gloo"


def _make_serial_gloo(store, rank: int, size: int, timeout):
    pgg = dist.ProcessGroupGloo
    opts = pgg._Options()
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    opts._devices = ([pgg.create_device(interface=i) for i in iface.split(",")] if iface
                     else [pgg.create_default_device()])
    opts._threads = 1
    opts._timeout = timeout
    return pgg(store, rank, size, opts)


def serial_gloo_group(group) -> dist.ProcessGroup:
    """A gloo group over `group`'s ranks (same order) whose collectives run one at a time, in
    launch order, on one worker thread. Collective over `group`'s members only."""
    if _SERIAL_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(_SERIAL_GLOO, _make_serial_gloo, devices=["cpu"])
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if ranks != sorted(ranks):
        raise ValueError(f"deepcompile: a gloo group whose ranks are not in order ({ranks}) is "
                         "not supported; make it with its ranks sorted")
    return dist.new_group(ranks, backend=_SERIAL_GLOO, use_local_synchronization=True)


def gloo_threads(group) -> int:
    """The number of worker threads of `group`'s gloo backend (for tests)."""
    return (group or dist.group.WORLD)._get_backend(torch.device("cpu")).options._threads


# Functional collectives: C++ ops that Inductor lowers and calls from its generated code with
# no Python in between (`_c10d_functional`, same schemas from 2.11 on). The graphs call the raw
# ops; the Python wrappers were renamed between versions (all_gather_tensor -> _single).
def funcol_ops():
    """(all_gather_into_tensor, reduce_scatter_tensor, wait_tensor) overloads."""
    c = torch.ops._c10d_functional
    return (c.all_gather_into_tensor.default, c.reduce_scatter_tensor.default,
            c.wait_tensor.default)


def all_gather_into_coalesced(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group):
    """Launch one coalesced all-gather of `inputs[i]` into `outputs[i]` (each `world` times its
    input, rank-major); returns the Work. gloo runs it as one collective of the concatenated
    inputs and copies each output out on its own thread; NCCL as one group of all-gathers
    straight into the outputs. The ProcessGroup method is private in 2.11-2.15
    (`dist.all_gather_into_tensor` in `_coalescing_manager` reaches it, with a Python context
    manager per launch)."""
    return (group if group is not None else dist.group.WORLD).allgather_into_tensor_coalesced(
        outputs, inputs)


def register_work(tensors: Sequence[torch.Tensor], work) -> None:
    """Make `wait_tensor` of (any tensor on the storage of) each of `tensors` wait for `work`:
    what functional collectives do for their outputs (one C call each, no Python frame).
    Private in 2.11-2.15 (`_register_work`)."""
    deque(map(torch._C._distributed_c10d._register_work, tensors, itertools.repeat(work)),
          maxlen=0)


def wait_tensors(tensors: Sequence[torch.Tensor]) -> None:
    """`wait_tensor` of each of `tensors` (each pops and waits for the work registered on its
    storage, if any), in C: the op's C++ entry point is private in 2.11-2.15 (`OpOverload._op`;
    calling the overload itself runs a Python frame per tensor)."""
    op = funcol_ops()[2]
    deque(map(getattr(op, "_op", op), tensors), maxlen=0)
def funcol_all_reduce():
    """The functional all-reduce overload (`(input, reduce_op, group_name)`, same schema from
    2.11 on)."""
    return torch.ops._c10d_functional.all_reduce.default


def below_autograd():
    """Run below the autograd dispatch key: the functional collectives have Python autograd
    kernels, which cost host time even under no_grad; the compiled graphs run without grad."""
    guard = getattr(torch._C, "_AutoDispatchBelowAutograd", None)
    return guard() if guard is not None else torch.no_grad()


def default_store():
    """The default process group's key-value store (the rendezvous store: TCPStore under torchrun
    and env:// init; a FileStore or HashStore where the group was made with one). Private in
    2.11-2.15 (`_get_default_store`)."""
    return dist.distributed_c10d._get_default_store()


def pg_timeout(group) -> tuple[float, float] | None:
    """(the timeout `group`'s collectives have now, torch's default timeout for its backend), in
    seconds; None where neither a gloo nor an NCCL backend says. The backend's options hold it
    (what `init_process_group(timeout=...)` or `new_group(timeout=...)` set); the default is
    `_get_default_timeout` (30 min; NCCL: 10 min). Private in 2.11-2.15."""
    c10d = dist.distributed_c10d
    group = group if group is not None else c10d._get_default_group()
    for device in ("cuda", "cpu"):
        if torch.device(device) not in group._device_types:
            continue
        try:
            options = group._get_backend(torch.device(device)).options
            own = options._timeout
        except (AttributeError, RuntimeError):
            continue
        default = c10d._get_default_timeout(dist.get_backend(group))
        return own.total_seconds(), default.total_seconds()
    return None


def set_pg_timeout(group, seconds: float) -> None:
    """Set the timeout of `group`'s collectives (gloo: each operation's timeout; NCCL: the
    watchdog's). Private in 2.11-2.15 (`_set_pg_timeout`, what torchtitan uses to shorten the
    timeout after the first step)."""
    import datetime

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)


# --- Dynamo / AOTAutograd / Inductor -----------------------------------------------------------

def compile_module(module, backend):
    """`torch.compile(module, backend=backend)`, its recompilations counted apart from any
    other `torch.compile` call's (`isolate_recompiles`, where torch has it): Dynamo keeps the
    cache entries of a released engine on the model class's code, and by default counts them
    against `recompile_limit` (8): the ninth engine of a sweep in one process ran uncompiled."""
    import inspect

    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        return torch.compile(module, backend=backend, isolate_recompiles=True)
    return torch.compile(module, backend=backend)


def graph_breaks() -> dict[str, int]:
    """Dynamo's graph breaks in this process so far, by reason (each counted when a frame is
    traced, not each time it runs). Private in 2.11-2.15 (`torch._dynamo.utils.counters`)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def recompile_limit_name(limit_type: str = "recompile_limit") -> str:
    """Where the user raises Dynamo's limit `limit_type` ("recompile_limit", or
    "accumulated_recompile_limit"; named `cache_size_limit` and `accumulated_cache_size_limit`
    before torch 2.6, the old names kept as aliases since)."""
    config = torch._dynamo.config
    if not hasattr(config, limit_type):
        limit_type = limit_type.replace("recompile_limit", "cache_size_limit")
    return f"torch._dynamo.config.{limit_type} (now {getattr(config, limit_type, '?')})"


class _RecompileLimitFilter(logging.Filter):
    """Reads Dynamo's warning that a frame hit its recompile limit (passes every record on)."""

    def __init__(self, callback: Callable[[str, str], None]) -> None:
        super().__init__()
        self.callback = callback

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = record.msg, record.args
        if isinstance(msg, str) and msg.startswith("torch._dynamo hit config.") \
                and isinstance(args, tuple) and len(args) >= 3:
            self.callback(str(args[0]), str(args[2]))
        return True


def on_recompile_limit(callback: Callable[[str, str], None]) -> Callable[[], None]:
    """Call `callback(limit_type, function)` when Dynamo stops compiling a frame because it hit
    a recompile limit (from then on, calls no graph of the frame's serves run eagerly). Dynamo
    says so only in a warning on its `convert_frame` logger (2.11-2.15: "torch._dynamo hit
    config.%s (%s)\n   function: %s ...", the function as "'name' (file:line)"): a filter on
    that logger reads it and passes it on. Returns what removes the filter."""
    logger = logging.getLogger("torch._dynamo.convert_frame")
    filt = _RecompileLimitFilter(callback)
    logger.addFilter(filt)
    return functools.partial(logger.removeFilter, filt)


def describe_frame(function: str) -> str:
    """Dynamo's "'name' (file:line)" of a frame, in words: the code after a graph break is a
    function Dynamo names `torch_dynamo_resume_in_<function>_at_<line>`."""
    m = re.match(r"'torch_dynamo_resume_in_(\w+)_at_(\d+)' \((.*):\d+\)$", function)
    if m is None:
        return function
    return f"the code of {m[1]}() after its graph break at line {m[2]} of {m[3]}"


def never_a_dynamo_frame(code) -> None:
    """Dynamo never compiles `code` as a frame of its own (it still inlines it into a frame it
    traces). Eager code inside a compiled model — a frame Dynamo gave up on, e.g. torch 2.11's
    "graph break in a for/while loop: skipping the frame" — calls its callees with Dynamo's frame
    callback still on, and Dynamo then compiles those as frames of their own: a hook that checks
    `torch.compiler.is_compiling()` is traced (True) into a no-op (`eval_frame.skip_code`,
    private, the same in 2.11-2.15)."""
    torch._dynamo.eval_frame.skip_code(code)


def detect_fake_mode(example_inputs: Sequence[Any]):
    """The fake mode Dynamo traced with (from the tracing context or the inputs)."""
    from torch._guards import detect_fake_mode as _detect

    return _detect(example_inputs)


def dynamo_frame_id(gm) -> int | None:
    """The id Dynamo gave the Python frame (code object) a graph was traced from: the same for
    every recompilation of that frame (e.g. for a new input shape), another for another frame.
    Process-local. None where Dynamo did not record it."""
    compile_id = getattr(gm, "meta", {}).get("dynamo_compile_id")
    return getattr(compile_id, "frame_id", None)


def static_fake(fake_mode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake of `tensor` with static sizes: shards must not get symbolic sizes in AOT."""
    return fake_mode.from_tensor(tensor, static_shapes=True)


def extend_graph_inputs(gm: torch.fx.GraphModule, names: Sequence[str],
                        example_values: Sequence[Any]):
    """A copy of Dynamo's graph module with extra trailing inputs; returns (copy, new nodes).

    Dynamo's own graph is left untouched (Dynamo reads its placeholders after the backend
    returns). The new placeholders have no Dynamo source, which AOTAutograd accepts (as for
    DDPOptimizer's submodules); the module-level metadata AOTAutograd reads is carried over."""
    graph = torch.fx.Graph()
    val_map: dict = {}
    out_value, _ = graph.graph_copy(gm.graph, val_map, return_output_node=True)
    old = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in old:
        val_map[n]._dynamo_source = getattr(n, "_dynamo_source", None)
    last = val_map[old[-1]] if old else None
    added = []
    for name, value in zip(names, example_values):
        if last is None:
            node = graph.placeholder(name)
        else:
            with graph.inserting_after(last):
                node = graph.placeholder(name)
        node.meta["example_value"] = value
        node._dynamo_source = None
        added.append(node)
        last = node
    graph.output(out_value)
    new = torch.fx.GraphModule(gm, graph)
    new.meta = gm.meta
    if hasattr(gm, "_param_name_to_source"):
        new._param_name_to_source = gm._param_name_to_source
    return new, added


def aot_module_simplified(gm, example_inputs, *, fw_compiler, bw_compiler, inference_compiler,
                          partition_fn, decompositions=None, eager_backward: bool = False):
    """AOTAutograd; `eager_backward`: the backward graph is handed to `bw_compiler` with the
    forward's, at compile time, instead of at the first backward."""
    import torch._functorch.config as fconfig
    from torch._functorch.aot_autograd import aot_module_simplified as _aot

    # (where a torch lacks the setting, the backward comes at its first call, as by default)
    eager = {"force_non_lazy_backward_lowering": True} if eager_backward and hasattr(
        fconfig, "force_non_lazy_backward_lowering") else {}
    with fconfig.patch(**eager):
        return _aot(gm, example_inputs, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                    inference_compiler=inference_compiler, partition_fn=partition_fn,
                    decompositions=decompositions)


@contextlib.contextmanager
def outside_dispatch_modes():
    """The Python dispatch modes in force set aside (AOTAutograd's first call of a compiled
    forward runs under one: [Note: first call] in compiler/runner.py)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


def inductor_decompositions():
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def min_cut_partition(joint_module, joint_inputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)


def inductor_compile_graph(gm, example_inputs: list) -> Callable:
    """Inductor code for an already partitioned (aten-level) graph, on its real inputs.

    Called from inside AOTAutograd's runtime (grad mode off), so Inductor compiles it as an
    inference graph: no second partitioning. Returns a callable taking the arguments as a list."""
    import torch._inductor.config as iconfig
    from torch._inductor.compile_fx import compile_fx

    # Locality reordering glues each prefetch start back onto its wait, and the
    # peak-memory reordering sinks each start (it allocates) down to its wait: both off for our
    # graphs, whose order the passes chose within the memory budget; scoped to this compile.
    # Detached examples: the graph is compiled for a no-grad call (AOT's inference path); the
    # shards it is called with at run time are leaves that require grad.
    # The compile runs in a tracing context of its own whose fake mode has a shape environment,
    # with static-shape fakes of the inputs: Inductor's FX graph cache needs a shape environment
    # (without one it bypasses the cache, and every run of the program compiles every graph
    # again); static fakes keep the shapes concrete, as they were traced.
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    examples = [fake_mode.from_tensor(a.detach(), static_shapes=True)
                if isinstance(a, torch.Tensor) else a for a in example_inputs]
    with iconfig.patch(reorder_for_locality=False, reorder_for_peak_memory=False), \
            tracing(TracingContext(fake_mode)):
        compiled = compile_fx(gm, examples)
    # compile_fx returns AOTAutograd's unboxed `forward(*args)` (which copies the inner boxed
    # function's attributes, `_boxed_call` included: do not trust it). Its arguments stay
    # referenced until it returns; the boxed function under it (AOT's runtime wrapper around
    # Inductor's code) takes a list and clears it, so inputs are freed after their last use.
    # Taken only where the unboxed wrapper adds nothing (a graph without parameters/buffers).
    inner = compiled
    while getattr(inner, "__qualname__", "").endswith("aot_module_simplified.<locals>.forward"):
        inner = getattr(inner, "__wrapped__", None)
    if inner is not None and inner is not compiled and getattr(inner, "_boxed_call", False) \
            and not any(True for _ in gm.parameters()) and not any(True for _ in gm.buffers()):
        return inner
    return lambda args: compiled(*args)


def boxed_fx(gm: torch.fx.GraphModule) -> Callable[[list], Any]:
    """A callable running `gm` on one list of inputs that it clears (FX's boxed calling
    convention): an input is freed after its last use instead of at the end of the call.
    The graph module itself is left as it is (a copy is generated)."""
    try:
        from torch.fx.graph import _BoxedCodeGen
    except ImportError:   # older torch: inputs live to the end of the call
        return lambda args: gm.forward(*args)
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph.set_codegen(_BoxedCodeGen())
    boxed = torch.fx.GraphModule(gm, graph)
    return boxed.forward


@contextlib.contextmanager
def no_autograd_cache():
    """AOTAutograd's on-disk cache would skip our per-graph hooks on a hit; scoped off."""
    import torch._functorch.config as fconfig

    with fconfig.patch(enable_autograd_cache=False):
        yield


def inductor_code_of(fn, *args, **kwargs):
    """Run `fn`, returning (its result, the source of every Inductor module compiled meanwhile).

    Unlike torch._inductor.utils.run_and_get_code, Dynamo is not reset (our passes ran on the
    graphs already compiled), and the FX graph cache is off so that a hit does not hide code."""
    from unittest import mock

    import torch._inductor.config as iconfig
    from torch._inductor.graph import GraphLowering

    codes: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", codes.append), \
            iconfig.patch(fx_graph_cache=False):
        result = fn(*args, **kwargs)
    return result, codes


def must_recompute_policy():
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE


def profiler_events(prof):
    """The raw events a finished `torch.profiler.profile` recorded (private: `_KinetoEvent`s,
    with `name()`, `device_type()`, `start_ns()`, `nbytes()`, `shapes()`, `dtypes()`); the
    public `events()` drops the memory events' sizes and the collectives' tensor shapes."""
    return prof.profiler.kineto_results.events()


def nonfinite_check_and_unscale_(grads: list, found: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """One fused pass over `grads` (one device and dtype): multiply by `inv_scale` in place and
    set `found` to 1 if any element is inf/NaN (GradScaler's kernel; private name, CPU and CUDA
    kernels in 2.11-2.15)."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale)


def cuda_spin(seconds: float, device: torch.device) -> None:
    """Keep `device`'s current stream busy for about `seconds` (`torch.cuda._sleep`, a private
    spin kernel of a number of clock cycles; the cycles per second measured once per device)."""
    cycles = int(seconds * _spin_hz(device.index))   # a tensor's CUDA device has its index
    if cycles > 0:
        torch.cuda._sleep(cycles)


@functools.lru_cache(maxsize=None)
def _spin_hz(index: int) -> float:
    with torch.cuda.device(index):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)   # warm
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / max(start.elapsed_time(end) / 1e3, 1e-9)


def is_op_overload(target) -> bool:
    """Whether an FX node's target is an aten/custom op overload (`torch._ops.OpOverload`)."""
    return isinstance(target, torch._ops.OpOverload)


def profiler_active() -> bool:
    """Whether a torch profiler is recording in this process (a second one cannot start)."""
    return torch.autograd.profiler._is_profiler_enabled


# --- tensor subclasses ---------------------------------------------------------------------------

def disable_torch_function_subclass():
    """Context manager: `__torch_function__` of tensor subclasses is not called inside (what a
    subclass's own `__torch_function__` runs the real op under)."""
    return torch._C.DisableTorchFunctionSubclass()


# --- distributed checkpoint ------------------------------------------------------------------------

def dcp_storage_info(relative_path: str, offset: int, length: int, transforms=None):
    """DCP's per-item file location (`_StorageInfo`, private; its fields are stable 2.11-2.15)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length, transform_descriptors=transforms)


# --- the planner (deepcompile plan) ------------------------------------------------------------

def fake_tensor_mode():
    """A fresh fake mode: modules built and graphs traced in it allocate nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def aot_function(fn, *, fw_compiler, bw_compiler, partition_fn, decompositions=None):
    """AOTAutograd on a plain function (the planner traces model pieces with it)."""
    from torch._functorch.aot_autograd import aot_function as _aot

    return _aot(fn, fw_compiler=fw_compiler, bw_compiler=bw_compiler,
                partition_fn=partition_fn, decompositions=decompositions)


# --- pinned host memory ------------------------------------------------------------------------
def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor of exactly its size. `pin_memory()` goes through the caching
    host allocator, which rounds every block up to a power of two (a 28 GB buffer would take
    32 GB); registering ordinary memory with CUDA pins exactly what is asked. Falls back to
    `pin_memory()` where registration is not available."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return t
    cudart = getattr(torch.cuda, "cudart", None)
    try:
        rt = cudart()
        # cudaHostRegisterPortable (1): pinned for every CUDA context, not only the current
        # device's (an engine on cuda:1 in a process whose current device is 0)
        rc = rt.cudaHostRegister(t.data_ptr(), nbytes, 1)
    except Exception:   # noqa: BLE001 -- no CUDA runtime bindings: the caching host allocator
        return t.pin_memory()
    if int(rc) != 0:
        return t.pin_memory()
    import weakref

    ptr = t.data_ptr()
    weakref.finalize(t, rt.cudaHostUnregister, ptr)   # before the memory goes back to libc
    return t


# --- optimizer step hooks ---------------------------------------------------------------------
def optimizer_step_hooks(opt) -> tuple[list, list]:
    """(pre, post): the step hooks registered on the optimizer object itself
    (`register_step_pre_hook` / `register_step_post_hook`), in registration order. The engine's
    flat step calls them around the step it takes in the user's optimizer's stead (the global
    hooks run through the inner optimizer's own `step`)."""
    return (list(getattr(opt, "_optimizer_step_pre_hooks", {}).values()),
            list(getattr(opt, "_optimizer_step_post_hooks", {}).values()))

