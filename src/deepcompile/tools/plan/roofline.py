"""Time of a graph node on a device we may not have: FLOPs and bytes per node, and a roofline.

[Note: the roofline] A node's time is `max(flops / (peak * eff), bytes / (bandwidth * eff_mem))`
plus nothing else: matrix products (`mm`, `addmm`, `bmm`, `baddbmm`, `_grouped_mm`) and fused
attention (every `_scaled_dot_product_*attention*` variant, forward and backward) are counted
in FLOPs from their shapes; every other op is memory-bound (its bytes read and written); views,
`getitem`s and `detach` are free. Efficiencies are what large kernels reach on the device (not
its datasheet peak): `mm_eff` for dense GEMMs, `attn_eff` for flash attention (FA2-class
kernels reach ~40% of an H100's bf16 peak), `grouped_eff` for grouped GEMMs (MoE experts,
small per-expert GEMMs), `mem_eff` for memory-bound kernels. Every figure is printed with a
plan and can be overridden (`--assume gpu.mm_eff=0.6`).

Attention FLOPs: forward 4·B·H·Sq·Sk·D (two GEMMs), backward 10·B·H·Sq·Sk·D (five GEMMs: the
flash backward recomputes the scores), halved for causal attention (the masked half of the
blocks is skipped). The model FLOPs reported as TFLOPs/GPU count the backward as twice the
forward (the usual MFU convention: recomputation is not useful work).

Fusion: Inductor (deepcompile's compiler on a GPU) fuses the memory-bound ops between two
GEMMs into few kernels, which read their inputs from memory once and write only what later
code reads. `fused_times` models that: each maximal run of memory-bound nodes is one kernel
region whose bytes are the tensors it reads from outside the run plus the tensors it produces
that are read after it (or leave the graph). Eager execution (DeepSpeed ZeRO-3 eager, FSDP2
eager) runs every op as its own kernel: `unfused_times`.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from torch import fx

from ...compiler.graph import is_alias_of_input

aten = torch.ops.aten

_MATMUL = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_GROUPED = {aten._grouped_mm.default} if hasattr(aten, "_grouped_mm") else set()
_FREE = {aten.detach.default, aten.alias.default, aten.lift_fresh_copy.default}


@dataclasses.dataclass(frozen=True)
class GPU:
    """Datasheet figures of one accelerator (dense, no sparsity) and what kernels reach."""
    name: str
    bf16_flops: float          # FLOP/s, dense tensor cores
    fp32_flops: float          # FLOP/s, fp32 without tensor cores (fp32 compute dtype)
    hbm_bw: float              # bytes/s
    memory: float              # bytes the framework can allocate (torch's total_memory)
    nvlink_bw: float           # bytes/s per GPU per direction inside a node
    nic_bw: float              # bytes/s per GPU to other nodes (one NIC per GPU, rail-aligned)
    pcie_bw: float             # bytes/s host<->device (pinned)
    mm_eff: float = 0.70
    grouped_eff: float = 0.50
    attn_eff: float = 0.40
    mem_eff: float = 0.80
    kernel_min_s: float = 2.5e-6   # the shortest a kernel takes (launch latency on the device)
    kernel_host_s: float = 5e-6    # host time to launch one compiled kernel (Inductor wrapper)
    eager_op_host_s: float = 12e-6  # host time per eager op (Python + dispatcher + launch)
    framework_host_s: float = 300e-6  # deepcompile's host time per micro-step outside graphs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


GiB = 2**30
GPUS: dict[str, GPU] = {g.name: g for g in (
    # H100 SXM5 80GB: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink4 900 GB/s (450 per
    # direction), one 400 Gb/s NIC per GPU (DGX H100 / ND H100 v5), PCIe gen5 x16
    GPU("h100", 989e12, 67e12, 3.35e12, 79.1 * GiB, 450e9, 50e9, 55e9),
    # H200 SXM 141GB: same compute as H100, 4.8 TB/s HBM3e
    GPU("h200", 989e12, 67e12, 4.8e12, 139.8 * GiB, 450e9, 50e9, 55e9),
    # A100 SXM4 80GB: 312 TFLOP/s bf16, 2.04 TB/s, NVLink3 600 GB/s (300 per direction),
    # one 200 Gb/s NIC per GPU (DGX A100), PCIe gen4
    GPU("a100", 312e12, 19.5e12, 2.04e12, 79.2 * GiB, 300e9, 25e9, 25e9),
    GPU("a100-40gb", 312e12, 19.5e12, 1.555e12, 39.4 * GiB, 300e9, 25e9, 25e9),
    # B200: 2.25 PFLOP/s bf16 dense, 8 TB/s, NVLink5 1.8 TB/s (900 per direction), 400 Gb/s
    GPU("b200", 2250e12, 80e12, 8.0e12, 178.0 * GiB, 900e9, 50e9, 55e9),
)}


def get_gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"deepcompile plan: unknown --gpu {name!r}; known: "
                         f"{', '.join(GPUS)}, cpu (this machine, measured)")
    return GPUS[name]


# ------------------------------------------------------------------------- per-node counts
def _val(node: Any):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def nbytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(nbytes(v) for v in val)
    return 0


def is_free(node: fx.Node) -> bool:
    """A node that moves no data: views, getitem, detach (and placeholders/outputs)."""
    if node.op != "call_function":
        return True
    t = node.target
    return t is operator.getitem or t in _FREE or is_alias_of_input(node)


def _arg(node: fx.Node, name: str, default=None):
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, a in enumerate(schema.arguments):
        if a.name == name:
            if name in node.kwargs:
                return node.kwargs[name]
            return node.args[i] if i < len(node.args) else default
    return default


def is_attention(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    return node.op == "call_function" and "scaled_dot_product" in name and "attention" in name


def kind_of(node: fx.Node) -> str:
    """"free", "matmul", "grouped", "attention" or "memory"."""
    if is_free(node):
        return "free"
    if node.target in _MATMUL:
        return "matmul"
    if node.target in _GROUPED:
        return "grouped"
    if is_attention(node):
        return "attention"
    return "memory"


def _attention_flops(node: fx.Node) -> tuple[float, float]:
    """(hardware FLOPs, model FLOPs) of an attention node."""
    backward = "backward" in node.target.__name__
    q = _val(_arg(node, "query"))
    k = _val(_arg(node, "key"))
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4:
        return 0.0, 0.0
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    causal = 0.5 if _arg(node, "is_causal", False) and sq == sk else 1.0
    fw = 4.0 * b * h * sq * sk * d * causal
    return (2.5 * fw, 2.0 * fw) if backward else (fw, fw)


def flops(node: fx.Node) -> tuple[float, float]:
    """(hardware FLOPs, model FLOPs) of a node (0 for memory-bound and free nodes)."""
    k = kind_of(node)
    out = _val(node)
    if k == "matmul":
        a = _val(node.args[1] if node.target in (aten.addmm.default, aten.baddbmm.default)
                 else node.args[0])
        if not isinstance(a, torch.Tensor) or not isinstance(out, torch.Tensor):
            return 0.0, 0.0
        f = 2.0 * out.numel() * a.shape[-1]
        return f, f
    if k == "grouped":
        a = _val(node.args[0])
        if not isinstance(a, torch.Tensor) or not isinstance(out, torch.Tensor):
            return 0.0, 0.0
        f = 2.0 * a.numel() * out.shape[-1]
        return f, f
    if k == "attention":
        return _attention_flops(node)
    return 0.0, 0.0


def node_bytes(node: fx.Node) -> int:
    """Bytes a node reads and writes when it runs as its own kernel."""
    if is_free(node):
        return 0
    read = sum(nbytes(_val(a)) for a in node.all_input_nodes)
    return read + nbytes(_val(node))


# ------------------------------------------------------------------------------ the times
@dataclasses.dataclass
class NodeCost:
    time_s: float
    flops: float        # model FLOPs
    kernels: int        # device kernels launched (host launch cost)


def _peak(gpu: GPU, dtype: torch.dtype) -> float:
    return gpu.fp32_flops if dtype == torch.float32 else gpu.bf16_flops


def _eff(gpu: GPU, kind: str) -> float:
    return {"matmul": gpu.mm_eff, "grouped": gpu.grouped_eff, "attention": gpu.attn_eff}[kind]


def _compute_time(node: fx.Node, kind: str, gpu: GPU) -> float:
    hw, _ = flops(node)
    val = _val(node)
    first = val[0] if isinstance(val, (list, tuple)) and val else val
    dtype = first.dtype if isinstance(first, torch.Tensor) else torch.bfloat16
    t_flops = hw / (_peak(gpu, dtype) * _eff(gpu, kind))
    t_mem = node_bytes(node) / (gpu.hbm_bw * gpu.mem_eff)
    return max(t_flops, t_mem, gpu.kernel_min_s)


def unfused_times(gm: fx.GraphModule, gpu: GPU) -> dict[str, NodeCost]:
    """Every op its own kernel (eager execution)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        kind = kind_of(node)
        _, model = flops(node)
        if kind == "free":
            out[node.name] = NodeCost(0.0, 0.0, 0)
        elif kind == "memory":
            t = max(node_bytes(node) / (gpu.hbm_bw * gpu.mem_eff), gpu.kernel_min_s)
            out[node.name] = NodeCost(t, model, 1)
        else:
            out[node.name] = NodeCost(_compute_time(node, kind, gpu), model, 1)
    return out


def fused_times(gm: fx.GraphModule, gpu: GPU,
                live_out: set[str] = frozenset()) -> dict[str, NodeCost]:
    """Memory-bound runs fused into one kernel region each (Inductor); a region's time is put on
    its last node. `live_out`: names of nodes read after this graph (its outputs are too)."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    index = {n: i for i, n in enumerate(nodes)}
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = set(out_node.all_input_nodes)
    costs: dict[str, NodeCost] = {}
    i = 0
    while i < len(nodes):
        node = nodes[i]
        kind = kind_of(node)
        if kind in ("matmul", "grouped", "attention"):
            _, model = flops(node)
            costs[node.name] = NodeCost(_compute_time(node, kind, gpu), model, 1)
            i += 1
            continue
        if kind == "free":
            costs[node.name] = NodeCost(0.0, 0.0, 0)
            i += 1
            continue
        j = i   # the run: memory-bound and free nodes up to the next compute-bound one
        while j < len(nodes) and kind_of(nodes[j]) in ("memory", "free"):
            j += 1
        run = nodes[i:j]
        inside = set(run)
        read: set[fx.Node] = set()
        written = 0
        for n in run:
            if is_free(n):
                continue
            for a in n.all_input_nodes:
                src = _storage_node(a)
                if src not in inside:
                    read.add(src)
        for n in run:
            if is_free(n):
                continue
            escapes = n in leaves or n.name in live_out or any(
                index.get(u, len(nodes)) >= j for u in _users_through_views(n))
            if escapes:
                written += nbytes(_val(n))
        nbytes_run = written + sum(nbytes(_val(a)) for a in read)
        real = [n for n in run if not is_free(n)]
        reductions = sum(1 for n in real if _is_reduction(n))
        t = max(nbytes_run / (gpu.hbm_bw * gpu.mem_eff), gpu.kernel_min_s) if real else 0.0
        for n in run:
            costs[n.name] = NodeCost(0.0, 0.0, 0)
        if real:
            costs[real[-1].name] = NodeCost(t, 0.0, 1 + reductions)
        i = j
    return costs


def _storage_node(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and is_alias_of_input(node):
        node = node.args[0]
    return node


def _users_through_views(node: fx.Node):
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            if u.op == "call_function" and (is_alias_of_input(u) or u.target is operator.getitem):
                stack.append(u)
            yield u


def _is_reduction(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    return any(r in name for r in ("sum", "mean", "amax", "max", "min", "var", "norm",
                                   "softmax", "log_softmax", "nll_loss", "cumsum", "sort",
                                   "topk", "histc"))


def total_model_flops(gm: fx.GraphModule) -> float:
    return sum(flops(n)[1] for n in gm.graph.nodes if n.op == "call_function")


def roofline_summary(gpu: GPU) -> str:
    return (f"{gpu.name}: {gpu.bf16_flops / 1e12:.0f} TFLOP/s bf16 x mm {gpu.mm_eff:.2f} / "
            f"attention {gpu.attn_eff:.2f} / grouped {gpu.grouped_eff:.2f}; HBM "
            f"{gpu.hbm_bw / 1e12:.2f} TB/s x {gpu.mem_eff:.2f}; {gpu.memory / GiB:.1f} GiB; "
            f"kernel >= {gpu.kernel_min_s * 1e6:.1f} us, host {gpu.kernel_host_s * 1e6:.1f} us "
            f"per compiled kernel, {gpu.eager_op_host_s * 1e6:.1f} us per eager op, "
            f"{gpu.framework_host_s * 1e6:.0f} us per micro-step (guards, wrappers)")

